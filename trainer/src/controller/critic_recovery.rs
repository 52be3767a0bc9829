//! The controller's side of surviving a lost critic (see `critic_log.rs`): every call
//! to the critic goes through [`Controller::serve_critic`], which replaces a critic
//! whose node is lost and asks the new one.

use std::path::Path;
use std::time::Duration;

use yatt_roles::{CriticRequest, CriticResponse, RoleRequest, Sample};
use yatt_runtime::ActorId;

use crate::controller::core::Controller;
use crate::controller::critic_log::CriticRecovery;
use crate::controller::error::{unreached_node, ControllerError};
use crate::controller::refs::CriticRef;

/// How many new critics one call, or one recovery, starts at most before it gives up:
/// each lost one took a node with it, so more means the cluster is failing faster than
/// a critic can be rebuilt.
pub(crate) const CRITIC_RESPAWNS: u32 = 3;

/// How long stopping a new critic the recovery gave up on may take: a busy one takes
/// the stop when its current call ends.
const STOP_ABANDONED: Duration = Duration::from_secs(5);

/// Whether `e` is a call that a lost node explains (rather than the critic's own error).
fn node_unreached(e: &ControllerError) -> bool {
    matches!(e, ControllerError::Call { source, .. } if unreached_node(source).is_some())
}

impl Controller {
    /// The critic the next call goes to: one started during this step, else the roles'.
    pub(crate) fn critic(&self) -> Option<CriticRef> {
        let replaced = self
            .critic_recovery
            .as_ref()
            .and_then(|r| r.lock_replaced().clone());
        replaced.or_else(|| self.roles.critic.clone())
    }

    /// Puts a critic started during a step into the roles.
    pub(crate) fn adopt_replaced_critic(&mut self) {
        if let Some(new) = self
            .critic_recovery
            .as_ref()
            .and_then(|r| r.lock_replaced().take())
        {
            self.roles.critic = Some(new);
        }
    }

    /// Asks the critic the request `make` builds; when the call fails because the
    /// critic's node is lost, starts a new critic, gives it the logged updates, and asks
    /// it a new request from `make` (built only then: no copy of the batch waits for a
    /// retry). A new critic lost in turn is replaced the same way, up to
    /// [`CRITIC_RESPAWNS`] in all.
    pub(crate) async fn serve_critic(
        &self,
        critic: &CriticRef,
        make: impl Fn() -> CriticRequest,
        stage: &'static str,
        timeout: Duration,
    ) -> Result<CriticResponse, ControllerError> {
        let mut failed = match self.serve(critic, make(), stage, "critic", timeout).await {
            Err(e) if node_unreached(&e) && self.critic_recovery.is_some() => e,
            done => return done,
        };
        let mut lost = critic.clone();
        for _ in 0..CRITIC_RESPAWNS {
            let Some(new) = self.recover_critic(&lost).await? else {
                return Err(failed);
            };
            tracing::warn!(step = self.step_no(), stage, error = %failed, critic = %new.id(), "the critic's node was lost; a new critic took its state and the call runs again");
            match self.serve(&new, make(), stage, "critic", timeout).await {
                Err(e) if node_unreached(&e) => (failed, lost) = (e, new),
                done => return done,
            }
        }
        Err(failed)
    }

    /// Replaces `lost` (see the module): the new critic, or `None` when `lost` is not
    /// lost or the controller cannot replace it. A new critic whose node is lost while
    /// it takes the updates is replaced in turn, up to [`CRITIC_RESPAWNS`] in all.
    pub(crate) async fn recover_critic(
        &self,
        lost: &CriticRef,
    ) -> Result<Option<CriticRef>, ControllerError> {
        let Some(r) = &self.critic_recovery else {
            return Ok(None);
        };
        let mut lost = lost.clone();
        // A critic this recovery started and gave up on: stopped unless another took
        // over, as it may only be slow, not lost, and would hold its model until the
        // trainer leaves.
        let mut abandoned = None;
        let mut tries = 0;
        let recovered = loop {
            tries += 1;
            // No critic to start when it could not be given the updates since the
            // checkpoint.
            if let Err(why) = r.lock_log().replayable() {
                break Err(unreplayable(why));
            }
            let base = r.lock_log().base().map(Path::to_path_buf);
            let respawned = r
                .respawn
                .respawn(self.role_ids_with(&lost), lost.id(), base.as_deref())
                .await;
            let new = match respawned {
                Ok(Some(new)) => new,
                other => break other,
            };
            match self.replay_critic_log(r, &new).await {
                Ok(updates) => {
                    r.updates.count_replayed(updates);
                    *r.lock_replaced() = Some(new.clone());
                    break Ok(Some(new));
                }
                Err(e) if node_unreached(&e) && tries < CRITIC_RESPAWNS => {
                    tracing::warn!(step = self.step_no(), error = %e, critic = %new.id(), "the new critic's node was lost while it took the logged updates; starting another");
                    abandoned = Some(new.clone());
                    lost = new;
                }
                Err(e) => {
                    abandoned = Some(new);
                    break Err(e);
                }
            }
        };
        if let (Some(a), false) = (abandoned, matches!(recovered, Ok(Some(_)))) {
            if let Err(e) = a.ask(RoleRequest::Stop, STOP_ABANDONED).await {
                tracing::debug!(critic = %a.id(), error = %e, "could not stop an abandoned critic");
            }
        }
        recovered
    }

    /// Trains `new` on the logged updates, oldest first, one batch at a time (the log
    /// is on disk so that it is not all in memory); how many.
    async fn replay_critic_log(
        &self,
        r: &CriticRecovery,
        new: &CriticRef,
    ) -> Result<u64, ControllerError> {
        let updates = r.lock_log().len();
        for i in 0..updates {
            let batch = r.lock_log().batch(i).map_err(unreplayable)?;
            let request = CriticRequest::Train(batch);
            let timeout = self.config.timeouts.train;
            match self
                .serve(new, request, "critic_replay", "critic", timeout)
                .await?
            {
                CriticResponse::Trained(_) => {}
                other => return Err(self.protocol("critic", "Train", format!("{other:?}"))),
            }
        }
        Ok(updates as u64)
    }

    /// The job's roles, with `critic` among them (one started during this step is not
    /// in the roles yet): a new critic's node is picked by their load.
    fn role_ids_with(&self, critic: &CriticRef) -> Vec<(ActorId, &'static str)> {
        let mut ids = self.role_ids();
        if !ids.iter().any(|(id, _)| id == critic.id()) {
            ids.push((critic.id().clone(), "critic"));
        }
        ids
    }

    /// The critic trained on `samples` in the step under way.
    pub(crate) fn log_critic_update(&self, samples: &[Sample]) {
        if let Some(r) = &self.critic_recovery {
            r.lock_log().record(self.step + 1, samples);
        }
    }
}

/// The log could not be given to a new critic: why.
fn unreplayable(why: String) -> ControllerError {
    ControllerError::Spawn {
        role: "critic".into(),
        reason: format!("the critic did not answer (its node may be lost), and a new critic cannot take its state: {why}"),
    }
}
