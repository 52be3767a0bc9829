//! Surviving the loss of the critic's node. The critic holds trainer state (weights,
//! AdamW moments, step) that no other node has, and it has no replica. Instead, the
//! controller keeps the batches it trained the critic on since the critic's state was
//! last saved (an [`UpdateLog`], on the trainer's disk): a new critic started from that
//! state (the run's last checkpoint, or the job's base model with its zero-initialised
//! value head) and given those updates again is the lost one, bit for bit on nodes that
//! compute alike.
//!
//! A call the critic's loss fails (`Controller::serve_critic`, `critic_recovery.rs`)
//! starts the new critic through the job's [`CriticRespawn`], replays the log into it
//! and asks it again, so the step goes on where it was: also during the update, which
//! by then the policy may have taken. A step that fails on another role first, with the
//! critic's node lost too, recovers it the same way before the step runs again
//! (`build/respawn.rs`).

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};

use yatt_roles::Sample;
use yatt_runtime::ActorId;

use crate::controller::error::ControllerError;
use crate::controller::refs::CriticRef;
use crate::controller::update_log::{LoggedUpdates, UpdateLog};

/// The critic's update log, in the run's output directory `output_dir`, starting from
/// the checkpoint `base` (or the job's fresh critic).
pub(crate) fn critic_log(base: Option<PathBuf>, output_dir: &Path) -> UpdateLog {
    let path = output_dir.join("critic-updates.bin");
    UpdateLog::new("critic", Some(critic_fields), base, path)
}

/// A sample with only what the critic's update reads; the texts, log-probs and
/// metadata would multiply the log's size for nothing.
fn critic_fields(s: &Sample) -> Sample {
    Sample {
        rollout_logprobs: Vec::new(),
        prompt_text: String::new(),
        response_text: String::new(),
        reference: None,
        metadata: serde_json::Value::Null,
        ref_logprobs: None,
        old_logprobs: None,
        advantages: None,
        step_rewards: None,
        step_ends: None,
        episode: None,
        ..s.clone()
    }
}

/// A future a [`CriticRespawn`] returns.
pub(crate) type RespawnFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Option<CriticRef>, ControllerError>> + Send + 'a>>;

/// Starts a new built-in critic in place of a lost one (the cluster build gives one).
pub(crate) trait CriticRespawn: Send + Sync {
    /// Waits (a bounded time) until the cluster declares `lost` gone; then spawns a new
    /// critic on a surviving node (`roles`: the job's role actors, whose nodes' load
    /// decides which), loading its state from the checkpoint `base` (or fresh). `None`:
    /// the critic is not lost (a slow call, or a partition), so there is nothing to
    /// replace.
    fn respawn<'a>(
        &'a self,
        roles: Vec<(ActorId, &'static str)>,
        lost: &'a ActorId,
        base: Option<&'a Path>,
    ) -> RespawnFuture<'a>;
}

/// What a controller needs to replace its critic.
pub(crate) struct CriticRecovery {
    pub(crate) updates: LoggedUpdates,
    pub(crate) respawn: Arc<dyn CriticRespawn>,
    /// A critic started during a step that borrowed the controller shared; adopted
    /// into the roles at the next exclusive borrow.
    replaced: Mutex<Option<CriticRef>>,
}

impl CriticRecovery {
    pub(crate) fn new(log: UpdateLog, respawn: Arc<dyn CriticRespawn>) -> Self {
        CriticRecovery {
            updates: LoggedUpdates::new(log),
            respawn,
            replaced: Mutex::new(None),
        }
    }

    pub(crate) fn lock_log(&self) -> MutexGuard<'_, UpdateLog> {
        self.updates.lock()
    }

    pub(crate) fn lock_replaced(&self) -> MutexGuard<'_, Option<CriticRef>> {
        self.replaced.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use yatt_roles::SampleId;

    #[test]
    fn the_critics_log_keeps_only_what_its_update_reads() {
        let id = SampleId {
            step: 0,
            prompt: 1,
            k: 0,
        };
        let mut s = Sample::new(id, id.prompt);
        s.prompt_tokens = vec![1, 2];
        s.response_tokens = vec![3, 4, 5];
        s.prompt_text = "a long prompt".into();
        s.rollout_logprobs = vec![-0.5; 3];
        s.values = Some(vec![0.5; 3]);
        s.returns = Some(vec![1.0; 3]);
        s.loss_mask = Some(vec![1, 0, 1]);
        let dir = tempfile::tempdir().unwrap();
        let mut log = critic_log(None, dir.path());
        log.record(1, std::slice::from_ref(&s));
        let kept = &log.batch(0).unwrap()[0];
        assert!(kept.prompt_text.is_empty(), "texts are not kept");
        assert!(kept.rollout_logprobs.is_empty(), "log-probs are not kept");
        assert_eq!(kept.values, s.values);
        assert_eq!(kept.returns, s.returns);
        assert_eq!(kept.loss_mask, s.loss_mask);
        assert_eq!(kept.response_tokens, s.response_tokens);
        assert_eq!(kept.prompt_tokens, s.prompt_tokens);
    }
}
