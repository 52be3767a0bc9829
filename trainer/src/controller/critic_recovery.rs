//! The controller's side of surviving a lost critic (see `critic_log.rs`): every call
//! to the critic goes through [`Controller::serve_critic`], which replaces a critic
//! whose node is lost and asks the new one.

use std::path::Path;
use std::time::Duration;

use yatt_roles::{CriticRequest, CriticResponse, Sample};
use yatt_runtime::CallError;

use crate::controller::core::Controller;
use crate::controller::error::ControllerError;
use crate::controller::refs::CriticRef;

/// Whether `e` is a call that a lost node explains (rather than the critic's own error).
fn node_unreached(e: &ControllerError) -> bool {
    matches!(
        e,
        ControllerError::Call {
            source: CallError::Transport { .. }
                | CallError::NodeDown { .. }
                | CallError::Unavailable { .. }
                | CallError::Timeout { .. }
                | CallError::Died { .. }
                | CallError::Closed { .. },
            ..
        }
    )
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
    /// it a second request from `make` (built only then: no copy of the batch waits for
    /// a retry).
    pub(crate) async fn serve_critic(
        &self,
        critic: &CriticRef,
        make: impl Fn() -> CriticRequest,
        stage: &'static str,
        timeout: Duration,
    ) -> Result<CriticResponse, ControllerError> {
        let failed = match self.serve(critic, make(), stage, "critic", timeout).await {
            Err(e) if node_unreached(&e) && self.critic_recovery.is_some() => e,
            done => return done,
        };
        let Some(new) = self.recover_critic(critic).await? else {
            return Err(failed);
        };
        tracing::warn!(step = self.step_no(), stage, error = %failed, critic = %new.id(), "the critic's node was lost; a new critic took its state and the call runs again");
        self.serve(&new, make(), stage, "critic", timeout).await
    }

    /// Replaces `lost` (see the module): the new critic, or `None` when `lost` is not
    /// lost or the controller cannot replace it.
    pub(crate) async fn recover_critic(
        &self,
        lost: &CriticRef,
    ) -> Result<Option<CriticRef>, ControllerError> {
        let Some(r) = &self.critic_recovery else {
            return Ok(None);
        };
        // No critic to start when it could not be given the updates since the checkpoint.
        let unreplayable = |why: String| {
            ControllerError::Spawn {
            role: "critic".into(),
            reason: format!("the critic did not answer (its node may be lost), and a new critic cannot take its state: {why}"),
        }
        };
        r.lock_log().replayable().map_err(unreplayable)?;
        let base = r.lock_log().base().map(Path::to_path_buf);
        let Some(new) = r
            .respawn
            .respawn(self.role_ids(), lost.id(), base.as_deref())
            .await?
        else {
            return Ok(None);
        };
        // One batch at a time: the log is on disk so that it is not all in memory.
        let updates = r.lock_log().len();
        for i in 0..updates {
            let batch = r.lock_log().batch(i).map_err(unreplayable)?;
            let request = CriticRequest::Train(batch);
            match self
                .serve(
                    &new,
                    request,
                    "critic_replay",
                    "critic",
                    self.config.timeouts.train,
                )
                .await?
            {
                CriticResponse::Trained(_) => {}
                other => return Err(self.protocol("critic", "Train", format!("{other:?}"))),
            }
            r.count_replayed();
        }
        *r.lock_replaced() = Some(new.clone());
        Ok(Some(new))
    }

    /// The critic trained on `samples` in the step under way.
    pub(crate) fn log_critic_update(&self, samples: &[Sample]) {
        if let Some(r) = &self.critic_recovery {
            r.lock_log().record(self.step + 1, samples);
        }
    }
}
