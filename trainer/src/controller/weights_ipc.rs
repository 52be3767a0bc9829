//! Weight sync through CUDA IPC (`rollout.weight_sync`): the policy exports one device
//! buffer and the rollouts of its host map it, instead of the weights crossing host
//! memory as byte buckets. Where it cannot be used the sync falls back to buckets and
//! logs why: once for the whole job when the policy cannot export (weights on the
//! CPU, no CUDA driver, a build without the `nccl` feature), once per rollout that
//! cannot map the buffer (another host, another kind of device).

use std::time::Duration;

use yatt_roles::{PolicyRequest, PolicyResponse, RoleRequest, RoleResponse};
use yatt_runtime::ActorId;

use crate::controller::config::WeightSync;
use crate::controller::core::{Controller, IpcRoute};
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, RolloutRef};
use crate::controller::weights::{RoutePushed, Settled};

const FALLBACK: &str =
    "CUDA IPC unavailable, so the weights go to other processes as byte buckets over QUIC";

impl Controller {
    fn ipc_route(&self) -> std::sync::MutexGuard<'_, IpcRoute> {
        self.ipc.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// With `rollout.weight_sync = "cuda_ipc"` or `"nccl"`, one sync by that route
    /// before the first generation, so that a job where it cannot work (weights on the
    /// CPU, a rollout on another host, no NCCL) fails at once with the reason, not after
    /// a whole step. The rollouts load the weights they already hold. Lost rollouts are
    /// left to the step's own sync. Under time sharing the policy is off the device
    /// during generation, so there the first sync (after the update) is where the route
    /// is tried.
    pub(crate) async fn check_forced_route(&self) -> Result<(), ControllerError> {
        let forced = matches!(
            self.config.weight_sync,
            WeightSync::CudaIpc | WeightSync::Nccl
        );
        if !forced
            || self.config.time_share.is_some()
            || std::mem::replace(&mut self.ipc_route().checked, true)
        {
            return Ok(());
        }
        let (in_process, live) = self.sync_targets();
        if in_process {
            return Ok(());
        }
        let (t, mut lost) = (self.config.timeouts.sync, Vec::new());
        let tried = match self.config.weight_sync {
            WeightSync::Nccl => self.push_through_nccl(&live, t, &mut lost).await,
            _ => self.push_through_ipc(&live, t, &mut lost).await,
        };
        match tried {
            Err(ControllerError::Config(why)) => Err(ControllerError::Config(format!(
                "{why} (found by a sync before the first step)"
            ))),
            other => other.map(drop),
        }
    }

    /// Sends the weights to `live`'s rollouts through CUDA IPC where it can; `None`
    /// when IPC is off (by configuration, or known unavailable), so every rollout gets
    /// buckets. Lost rollouts go to `lost`, as with buckets.
    pub(crate) async fn push_through_ipc(
        &self,
        live: &[RolloutRef],
        t: Duration,
        lost: &mut Vec<ActorId>,
    ) -> Result<Option<RoutePushed>, ControllerError> {
        let mode = self.config.weight_sync;
        let (off, refused) = {
            let route = self.ipc_route();
            (route.off, route.refused.clone())
        };
        if !matches!(mode, WeightSync::Auto | WeightSync::CudaIpc) || off {
            return Ok(None);
        }
        let (targets, mut left): (Vec<RolloutRef>, Vec<RolloutRef>) = live
            .iter()
            .cloned()
            .partition(|r| !refused.contains(r.id()));
        if targets.is_empty() {
            return Ok(None);
        }
        let answer = self
            .serve_a_replica(|_| PolicyRequest::ExportDeviceWeights, "weight_sync", t)
            .await?;
        let update = match answer {
            PolicyResponse::Weights(u) if u.device.is_some() => u,
            PolicyResponse::DeviceWeightsUnavailable(why) if mode == WeightSync::CudaIpc => {
                return Err(ControllerError::Config(format!(
                    "rollout.weight_sync = \"cuda_ipc\", but the policy cannot export its weights through CUDA IPC: {why}; set rollout.weight_sync = \"auto\" (falls back to QUIC) or \"quic\""
                )))
            }
            PolicyResponse::DeviceWeightsUnavailable(why) => {
                // Info, not a warning: it is what a CPU cluster always does (and info
                // is shown by default).
                tracing::info!(reason = %why, "weight sync: {FALLBACK}");
                self.ipc_route().off = true;
                return Ok(None);
            }
            other => {
                return Err(self.protocol("policy", "ExportDeviceWeights", variant_of(&other)))
            }
        };
        let (version, bytes) = (update.version, update.bytes());
        let loads = targets
            .iter()
            .map(|r| r.ask(RoleRequest::LoadWeights(update.clone()), t));
        let answers = futures::future::join_all(loads).await;
        let mut loaded = 0;
        for (answer, r) in answers.into_iter().zip(&targets) {
            match answer {
                Ok(RoleResponse::Done) => loaded += 1,
                Ok(other) => return Err(self.protocol("rollout", "LoadWeights", variant(&other))),
                Err(e) => match self.settle_lost(e, r) {
                    Settled::Lost => lost.push(r.id().clone()),
                    Settled::Failed(e) if mode == WeightSync::CudaIpc => {
                        return Err(self.call("weight_sync", "rollout")(e))
                    }
                    Settled::Failed(e) => {
                        tracing::warn!(replica = %r.id(), error = %e, "weight sync: this rollout cannot take the weights through CUDA IPC; it gets byte buckets over QUIC from now on");
                        self.ipc_route().refused.insert(r.id().clone());
                        left.push(r.clone());
                    }
                },
            }
        }
        Ok(Some(RoutePushed {
            version,
            bytes,
            loaded,
            left,
        }))
    }
}

pub(crate) fn variant_of(r: &PolicyResponse) -> String {
    let s = format!("{r:?}");
    s.split(['(', ' ', '{'])
        .next()
        .unwrap_or_default()
        .to_string()
}
