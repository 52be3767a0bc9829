//! Weights: syncing the rollouts to the policy, saving the policy and the critic.

use yatt_roles::{
    CriticRequest, CriticResponse, PolicyRequest, PolicyResponse, RoleRequest, RoleResponse,
};

use yatt_runtime::ActorId;
use yatt_runtime::CallError;

use crate::controller::core::{Controller, SyncRoutes};
use crate::controller::error::replica_lost;
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, RolloutRef};

/// The routes a sync to other processes tries, in order, before this controller's
/// buckets.
#[derive(Clone, Copy)]
enum Route {
    Ipc,
    Nccl,
    Direct,
}

/// What one route of a sync (CUDA IPC, NCCL, the policy's own push) did.
pub(crate) struct RoutePushed {
    pub(crate) version: u64,
    pub(crate) bytes: u64,
    /// Rollouts that took the weights by this route.
    pub(crate) loaded: usize,
    /// Rollouts still to be sent buckets (refused, or never tried).
    pub(crate) left: Vec<RolloutRef>,
}

/// What one weight sync did.
pub(crate) struct Pushed {
    /// The version the rollouts now hold.
    pub(crate) version: u64,
    /// Replicas found lost on the way.
    pub(crate) lost: Vec<ActorId>,
    pub(crate) routes: SyncRoutes,
}

/// A rollout's failed load, sorted.
pub(crate) enum Settled {
    /// Gone with its node: recorded as lost, the sync goes on.
    Lost,
    /// Any other failure.
    Failed(CallError),
}

impl Controller {
    /// Weight sync: the policy exports its weights and this controller's rollout loads
    /// them in place. Returns the version the rollout now holds.
    pub async fn sync_weights(&mut self) -> Result<u64, ControllerError> {
        let pushed = self.push_weights().await?;
        self.lost_rollouts.extend(pushed.lost);
        self.weights_version = pushed.version;
        self.last_sync = pushed.routes;
        Ok(pushed.version)
    }

    /// Weight sync with a shared borrow (it may run while the next batch generates):
    /// the version the rollouts now hold and the replicas found lost on the way, for
    /// the caller to record.
    ///
    /// Across processes each rollout takes the first route that serves it: CUDA IPC
    /// (the policy's host), an NCCL broadcast, byte buckets the policy's process sends
    /// itself; the rest get buckets from this controller.
    pub(crate) async fn push_weights(&self) -> Result<Pushed, ControllerError> {
        let t = self.config.timeouts.sync;
        let (in_process, mut left) = self.sync_targets();
        let mut lost = Vec::new();
        let mut routes = SyncRoutes::default();
        let mut version = None;
        if !in_process {
            for route in [Route::Ipc, Route::Nccl, Route::Direct] {
                let done = match route {
                    Route::Ipc => self.push_through_ipc(&left, t, &mut lost).await?,
                    Route::Nccl => self.push_through_nccl(&left, t, &mut lost).await?,
                    Route::Direct => self.push_direct(&left, t, &mut lost).await?,
                };
                let Some(p) = done else { continue };
                let reached = match route {
                    Route::Ipc => &mut routes.via_ipc,
                    Route::Nccl => &mut routes.via_nccl,
                    Route::Direct => &mut routes.via_direct,
                };
                *reached = p.loaded;
                routes.bytes = p.bytes;
                version = Some(p.version);
                left = p.left;
            }
        }
        if let (Some(version), true) = (version, left.is_empty()) {
            return Ok(Pushed {
                version,
                lost,
                routes,
            });
        }
        let update = match self.export_from_a_replica(in_process, t).await? {
            PolicyResponse::Weights(u) => u,
            other => return Err(self.protocol("policy", "ExportWeights", format!("{other:?}"))),
        };
        let version = update.version;
        routes.bytes = update.bytes();
        // Every replica but the last gets a copy; the last takes the buckets themselves.
        let mut update = Some(update);
        let mut loads = Vec::new();
        for (i, r) in left.iter().enumerate() {
            let u = match i + 1 == left.len() {
                true => update.take(),
                false => update.clone(),
            };
            if let Some(u) = u {
                loads.push(r.ask(RoleRequest::LoadWeights(u), t));
            }
        }
        for (answer, r) in futures::future::join_all(loads)
            .await
            .into_iter()
            .zip(&left)
        {
            match answer {
                Ok(RoleResponse::Done) => {}
                Ok(other) => return Err(self.protocol("rollout", "LoadWeights", variant(&other))),
                Err(e) => match self.settle_lost(e, r) {
                    Settled::Lost => lost.push(r.id().clone()),
                    Settled::Failed(e) => return Err(self.call("weight_sync", "rollout")(e)),
                },
            }
        }
        Ok(Pushed {
            version,
            lost,
            routes,
        })
    }

    /// Whether the policy and every rollout share this process, and the rollouts a sync
    /// goes to. A replica found lost this step is skipped (another head's spare
    /// generated its samples); one lost only at the sync is marked so, when a spare can
    /// take its work.
    pub(crate) fn sync_targets(&self) -> (bool, Vec<RolloutRef>) {
        let in_process = self.roles.policy.is_local()
            && self.roles.rollout.is_local()
            && self.roles.extra_rollouts.iter().all(|r| r.is_local());
        let live = self
            .roles
            .extra_rollouts
            .iter()
            .chain(std::iter::once(&self.roles.rollout))
            .filter(|r| !self.lost_rollouts.contains(r.id()))
            .cloned()
            .collect();
        (in_process, live)
    }

    /// Whether a rollout's failed load means the rollout is lost (logged), or is an
    /// error of its own.
    pub(crate) fn settle_lost(&self, e: CallError, r: &RolloutRef) -> Settled {
        match e {
            e if replica_lost(&e) && !self.spare_rollouts.is_empty() => {
                tracing::warn!(step = self.step, replica = %r.id(), error = %e, "rollout lost at weight sync; its work goes to a spare replica");
                Settled::Lost
            }
            // Gone with its node after the update: the step is complete, and the
            // next one finds the replica lost and (on a cluster) spawns it again.
            e if replica_lost(&e) && !matches!(e, CallError::Timeout { .. }) => {
                tracing::warn!(step = self.step, replica = %r.id(), error = %e, "rollout lost at weight sync with no spare; the next step replaces it");
                Settled::Lost
            }
            e => Settled::Failed(e),
        }
    }

    /// The weight export of a sync: see [`Controller::serve_a_replica`].
    async fn export_from_a_replica(
        &self,
        in_process: bool,
        t: std::time::Duration,
    ) -> Result<PolicyResponse, ControllerError> {
        // Within one process the rollouts take over a snapshot of the policy's tensors;
        // across processes the weights travel as byte buckets.
        self.serve_a_replica(
            |local| match in_process && local {
                true => PolicyRequest::ExportLocalWeights,
                false => PolicyRequest::ExportWeights,
            },
            "weight_sync",
            t,
        )
        .await
    }

    /// Asks this head's policy replica, or, when it is gone (its node died after the
    /// update, which the ring had completed), the first peer replica that answers: the
    /// replicas hold bit-identical weights and optimizer state, so the step completes
    /// (or the checkpoint is saved) as it would have been, and the next step finds the
    /// replica lost. `request(local)` builds the request for a replica in this process
    /// or not.
    pub(crate) async fn serve_a_replica(
        &self,
        request: impl Fn(bool) -> PolicyRequest,
        stage: &'static str,
        t: std::time::Duration,
    ) -> Result<PolicyResponse, ControllerError> {
        let own = self
            .serve_policy(request(self.roles.policy.is_local()), stage, t)
            .await;
        let Err(ControllerError::Call { source, .. }) = &own else {
            return own;
        };
        if !replica_lost(source) || self.peer_policies.is_empty() {
            return own;
        }
        for peer in &self.peer_policies {
            match self
                .serve(peer, request(peer.is_local()), stage, "policy", t)
                .await
            {
                Ok(answer) => {
                    tracing::warn!(step = self.step, stage, replica = %self.roles.policy.id(), from = %peer.id(), "policy replica lost; a peer replica answered for it");
                    return Ok(answer);
                }
                Err(e) => {
                    tracing::warn!(peer = %peer.id(), error = %e, "peer replica did not answer either")
                }
            }
        }
        own
    }

    /// Asks the critic (if any) to save a checkpoint to `dir`.
    pub async fn save_critic(&self, dir: std::path::PathBuf) -> Result<(), ControllerError> {
        let Some(c) = self.critic() else {
            return Ok(());
        };
        match self
            .serve_critic(
                &c,
                || CriticRequest::SaveCheckpoint(dir.clone()),
                "checkpoint",
                self.config.timeouts.sync,
            )
            .await?
        {
            CriticResponse::Saved => Ok(()),
            other => Err(self.protocol("critic", "SaveCheckpoint", format!("{other:?}"))),
        }
    }

    /// Asks the policy to save a checkpoint to `dir`.
    pub async fn save_policy(&self, dir: std::path::PathBuf) -> Result<(), ControllerError> {
        match self
            .serve_a_replica(
                |_| PolicyRequest::SaveCheckpoint(dir.clone()),
                "checkpoint",
                self.config.timeouts.sync,
            )
            .await?
        {
            PolicyResponse::Saved => Ok(()),
            other => Err(self.protocol("policy", "SaveCheckpoint", format!("{other:?}"))),
        }
    }
}
