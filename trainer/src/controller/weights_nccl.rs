//! Weight sync by NCCL broadcast (`rollout.weight_sync`): the policy packs its weights
//! into one device buffer and broadcasts it, as rank 0 of a group whose other ranks are
//! the rollouts, on any host. It follows CUDA IPC (which serves the policy's own host)
//! and comes before byte buckets over QUIC.
//!
//! The group is made once (the policy makes its NCCL id, each member joins on its
//! first broadcast) and kept while the same rollouts receive; other receivers get a new
//! group. Every NCCL operation has the `timeouts.collective_s` deadline. Where NCCL
//! cannot be used (weights on the CPU, no libnccl or GPU, a build without the `nccl`
//! feature) the sync logs why once and sends byte buckets; a failed broadcast sends
//! them to the rollouts that missed it and turns NCCL off for the job, with a warning
//! naming each failure. With `rollout.weight_sync = "nccl"` either is an error instead.

use std::time::Duration;

use yatt_roles::{
    DeviceRoute, NcclGroup, PolicyRequest, PolicyResponse, RoleRequest, RoleResponse,
    RolloutRequest, RolloutResponse,
};
use yatt_runtime::ActorId;

use crate::controller::config::WeightSync;
use crate::controller::core::{Controller, NcclRoute};
use crate::controller::error::{replica_lost, ControllerError};
use crate::controller::refs::{variant, RolloutRef};
use crate::controller::weights::{RoutePushed, Settled};
use crate::controller::weights_ipc::variant_of;

const FALLBACK: &str =
    "NCCL unavailable, so the weights go to other processes as byte buckets over QUIC";

/// The fix a forced `nccl` error ends with.
const FIX: &str = "set rollout.weight_sync = \"auto\" (falls back to QUIC) or \"quic\"";

impl Controller {
    fn nccl_route(&self) -> std::sync::MutexGuard<'_, NcclRoute> {
        self.nccl.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Broadcasts the weights to `targets` through NCCL where it can; `None` when NCCL
    /// is off (by configuration, or known unusable), so every target gets buckets.
    /// Rollouts found lost go to `lost`; those that missed the broadcast are `left`.
    pub(crate) async fn push_through_nccl(
        &self,
        targets: &[RolloutRef],
        t: Duration,
        lost: &mut Vec<ActorId>,
    ) -> Result<Option<RoutePushed>, ControllerError> {
        let mode = self.config.weight_sync;
        let forced = mode == WeightSync::Nccl;
        if !matches!(mode, WeightSync::Auto | WeightSync::Nccl)
            || targets.is_empty()
            || self.nccl_route().off
        {
            return Ok(None);
        }
        if self.config.time_share.is_some() {
            // The rollouts are offloaded when the weights arrive (after the update).
            return match forced {
                true => Err(ControllerError::Config(format!(
                    "rollout.weight_sync = \"nccl\" cannot be used with placement.time_share: the rollouts are off the device when the weights arrive; {FIX}"
                ))),
                false => Ok(None),
            };
        }
        let (targets, unable) = self.split_by_readiness(targets, t, lost).await?;
        let targets = &targets[..];
        if targets.is_empty() {
            return Ok(None);
        }
        let members: Vec<ActorId> = targets.iter().map(|r| r.id().clone()).collect();
        let (group, fresh) = match &self.nccl_route().group {
            Some((id, m)) => (Some(*id), *m != members),
            None => (None, true),
        };
        let staged = match self
            .serve_policy(
                PolicyRequest::StageBroadcast { group, fresh },
                "weight_sync",
                t,
            )
            .await
        {
            // Its replica is gone: the buckets come from a peer replica this time.
            Err(e) if policy_lost(&e) => return Ok(None),
            other => other?,
        };
        let (update, group) = match staged {
            PolicyResponse::Weights(u) => match u.device.as_ref().map(|d| &d.route) {
                Some(DeviceRoute::Broadcast(g)) => {
                    let g = *g;
                    (u, g)
                }
                _ => return Err(self.protocol("policy", "StageBroadcast", "Weights".into())),
            },
            PolicyResponse::NcclUnavailable(why) if forced => {
                return Err(ControllerError::Config(format!(
                    "rollout.weight_sync = \"nccl\", but the policy cannot broadcast its weights: {why}; {FIX}"
                )))
            }
            PolicyResponse::NcclUnavailable(why) => {
                // Info, not a warning: it is what a CPU cluster always does.
                tracing::info!(reason = %why, "weight sync: {FALLBACK}");
                self.nccl_route().off = true;
                return Ok(None);
            }
            other => return Err(self.protocol("policy", "StageBroadcast", variant_of(&other))),
        };
        let group = NcclGroup {
            nranks: targets.len() as u32 + 1,
            deadline_ms: self.config.timeouts.collective.as_millis() as u64,
            ..group
        };
        let (version, bytes) = (update.version, update.bytes());
        let send = self.serve_policy(PolicyRequest::Broadcast(group), "weight_sync", t);
        let loads = targets.iter().enumerate().map(|(i, r)| {
            let mut u = update.clone();
            if let Some(d) = u.device.as_mut() {
                d.route = DeviceRoute::Broadcast(NcclGroup {
                    rank: i as u32 + 1,
                    ..group
                });
            }
            r.ask(RoleRequest::LoadWeights(u), t)
        });
        let (sent, answers) = futures::join!(send, futures::future::join_all(loads));
        let (mut failures, mut root_lost) = (Vec::new(), false);
        match sent {
            Ok(PolicyResponse::Sent) => {}
            Ok(other) => return Err(self.protocol("policy", "Broadcast", variant_of(&other))),
            Err(e) => {
                root_lost = policy_lost(&e);
                failures.push(format!("policy (rank 0): {e}"));
            }
        }
        let (mut loaded, mut left, lost_before) = (0, unable, lost.len());
        for (rank, (answer, r)) in answers.into_iter().zip(targets).enumerate() {
            match answer {
                Ok(RoleResponse::Done) => loaded += 1,
                Ok(other) => return Err(self.protocol("rollout", "LoadWeights", variant(&other))),
                Err(e) => match self.settle_lost(e, r) {
                    Settled::Lost => lost.push(r.id().clone()),
                    Settled::Failed(e) => {
                        failures.push(format!("{} (rank {}): {e}", r.id(), rank + 1));
                        left.push(r.clone());
                    }
                },
            }
        }
        let mut route = self.nccl_route();
        let someone_lost = root_lost || lost.len() > lost_before;
        if failures.is_empty() && !someone_lost {
            route.group = Some((group.id, members));
            return Ok(Some(RoutePushed {
                version,
                bytes,
                loaded,
                left,
            }));
        }
        // A member that failed or was lost broke the group: the next sync makes a new one
        // (and the policy drops this one).
        route.group = Some((group.id, Vec::new()));
        let failures = failures.join("; ");
        if forced {
            return Err(ControllerError::Config(format!(
                "rollout.weight_sync = \"nccl\", but the NCCL broadcast of weights v{version} failed: {failures}; {FIX}"
            )));
        }
        // A lost member explains the others' deadlines; anything else will happen again.
        if !someone_lost {
            route.off = true;
            tracing::warn!(step = self.step, failures = %failures, "weight sync: the NCCL broadcast failed; the weights go as byte buckets over QUIC from now on");
        } else {
            tracing::warn!(step = self.step, failures = %failures, "weight sync: a member was lost during the NCCL broadcast; the others get byte buckets this time and a new group next time");
        }
        Ok(Some(RoutePushed {
            version,
            bytes,
            loaded,
            left,
        }))
    }

    /// `targets` split into the rollouts that can receive by broadcast and those that
    /// cannot, asking each once (a lost one goes to `lost`). The latter are logged once
    /// (at info: a CPU cluster always says so) and get buckets; with a forced `nccl`
    /// they are an error naming each and why.
    async fn split_by_readiness(
        &self,
        targets: &[RolloutRef],
        t: Duration,
        lost: &mut Vec<ActorId>,
    ) -> Result<(Vec<RolloutRef>, Vec<RolloutRef>), ControllerError> {
        let unknown: Vec<&RolloutRef> = {
            let route = self.nccl_route();
            let known =
                |r: &&RolloutRef| route.ready.contains(r.id()) || route.unable.contains(r.id());
            targets.iter().filter(|r| !known(r)).collect()
        };
        let asks = unknown
            .iter()
            .map(|r| r.ask(RoleRequest::Serve(RolloutRequest::CanReceiveBroadcast), t));
        let mut reasons = Vec::new();
        for (answer, r) in futures::future::join_all(asks)
            .await
            .into_iter()
            .zip(&unknown)
        {
            let ready = match answer {
                Ok(RoleResponse::Served(RolloutResponse::BroadcastReadiness(ready))) => ready,
                // A custom rollout may not know the question: it gets buckets.
                Ok(other) => Err(format!("it answered {}", variant(&other))),
                Err(e) => match self.settle_lost(e, r) {
                    Settled::Lost => {
                        lost.push(r.id().clone());
                        continue;
                    }
                    Settled::Failed(e) => Err(format!("asking whether it can: {e}")),
                },
            };
            let mut route = self.nccl_route();
            match ready {
                Ok(()) => route.ready.insert(r.id().clone()),
                Err(why) => {
                    reasons.push(format!("{}: {why}", r.id()));
                    route.unable.insert(r.id().clone())
                }
            };
        }
        if !reasons.is_empty() {
            let reasons = reasons.join("; ");
            if self.config.weight_sync == WeightSync::Nccl {
                return Err(ControllerError::Config(format!(
                    "rollout.weight_sync = \"nccl\", but a rollout cannot receive weights by NCCL broadcast ({reasons}); {FIX}"
                )));
            }
            tracing::info!(rollouts = %reasons, "weight sync: {FALLBACK}");
        }
        let route = self.nccl_route();
        let (ready, unable) = targets
            .iter()
            .filter(|r| !lost.contains(r.id()))
            .cloned()
            .partition(|r| route.ready.contains(r.id()));
        Ok((ready, unable))
    }
}

/// Whether a call to the policy failed because its replica is gone with its node.
fn policy_lost(e: &ControllerError) -> bool {
    matches!(e, ControllerError::Call { source, .. } if replica_lost(source))
}
