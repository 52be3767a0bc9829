//! Weight sync in one hop over QUIC: when the policy runs in another process, its
//! actor exports the weights and loads them into the rollouts itself
//! ([`PolicyRequest::PushWeights`]), so each byte crosses the wire once (policy →
//! rollout) instead of twice (policy → controller → rollout). It follows CUDA IPC and
//! NCCL, which move no bytes through any controller either, and comes before the two
//! hops, which stay the fallback: for a policy in this process (its export crosses no
//! wire), for a policy actor that cannot push (a user's), logged once, and with
//! `rollout.weight_sync = "relay"` (the policy's node cannot reach the rollouts').

use std::sync::atomic::Ordering;
use std::time::Duration;

use yatt_roles::{PolicyRequest, PolicyResponse, PushTarget};
use yatt_runtime::{ActorError, ActorId, CallError};

use crate::controller::config::WeightSync;
use crate::controller::core::Controller;
use crate::controller::error::ControllerError;
use crate::controller::refs::RolloutRef;
use crate::controller::weights::{RoutePushed, Settled};
use crate::controller::weights_ipc::variant_of;

const FALLBACK: &str =
    "the policy cannot send its weights to the rollouts itself, so they go through this controller (two hops over QUIC)";

/// The deadline of a push whose export and loads each have the sync's deadline `t`, as
/// over two hops; the margin lets the policy's answer about a late role arrive before
/// this one.
pub(crate) fn push_deadline(t: Duration) -> Duration {
    t * 2 + t / 4
}

impl Controller {
    /// Has the policy load its weights into the rollouts of `targets` in other
    /// processes; `None` when it cannot (see the module), so every target gets buckets
    /// from this controller, as those in this process do and those the policy's node
    /// failed to load. Rollouts found lost go to `lost`.
    pub(crate) async fn push_direct(
        &self,
        targets: &[RolloutRef],
        t: Duration,
        lost: &mut Vec<ActorId>,
    ) -> Result<Option<RoutePushed>, ControllerError> {
        // A rollout in this process gains nothing (the second hop moves no bytes), and
        // may be reachable from this process only (`Node::spawn_local`).
        let (local, remote): (Vec<RolloutRef>, Vec<RolloutRef>) =
            targets.iter().cloned().partition(|r| r.is_local());
        if remote.is_empty()
            || self.config.weight_sync == WeightSync::Relay
            || self.roles.policy.is_local()
            || self.direct_push_off.load(Ordering::Relaxed)
        {
            return Ok(None);
        }
        let to: Vec<PushTarget> = remote
            .iter()
            .map(|r| PushTarget::Rollout(r.id().clone()))
            .collect();
        let request = |_| PolicyRequest::PushWeights {
            to: to.clone(),
            timeout: t,
        };
        let report = match self
            .serve_a_replica(request, "weight_sync", push_deadline(t))
            .await
        {
            Ok(PolicyResponse::Pushed(r)) => r,
            Ok(PolicyResponse::PushUnavailable(why)) => {
                tracing::info!(reason = %why, "weight sync: {FALLBACK}");
                self.direct_push_off.store(true, Ordering::Relaxed);
                return Ok(None);
            }
            Ok(other) => return Err(self.protocol("policy", "PushWeights", variant_of(&other))),
            // A policy that refuses the request (a user's role that does not know it):
            // the two hops ask it for its weights from now on. One that failed this push
            // (an export that timed out, say) is asked again at the next sync; this one
            // goes through the two hops, which report any real failure.
            Err(ControllerError::Call {
                source: CallError::Handler { error, .. },
                ..
            }) => {
                let refused = matches!(error, ActorError::BadRequest(_));
                let when = if refused {
                    "from now on"
                } else {
                    "for this sync"
                };
                tracing::warn!(error = %error, "weight sync: the policy did not push the weights itself; {FALLBACK} {when}");
                if refused {
                    self.direct_push_off.store(true, Ordering::Relaxed);
                }
                return Ok(None);
            }
            Err(e) => return Err(e),
        };
        let (mut loaded, mut left) = (0, local);
        for r in &remote {
            let Some((_, e)) = report.failed.iter().find(|(id, _)| id == r.id()) else {
                loaded += 1;
                continue;
            };
            match self.settle_lost(e.clone(), r) {
                Settled::Lost => lost.push(r.id().clone()),
                // The policy's node may not reach it where this one does (a firewall
                // between them): it gets the buckets from here, whose failure is the
                // step's error.
                Settled::Failed(e) => {
                    tracing::warn!(step = self.step, rollout = %r.id(), error = %e, "weight sync: the policy's node could not load this rollout, so it gets the weights through this controller; set rollout.weight_sync = \"relay\" if the policy's node cannot reach the rollouts' nodes");
                    left.push(r.clone());
                }
            }
        }
        Ok(Some(RoutePushed {
            version: report.version,
            bytes: report.bytes,
            loaded,
            left,
        }))
    }
}
