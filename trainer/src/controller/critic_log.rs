//! Surviving the loss of the critic's node. The critic holds trainer state (weights,
//! AdamW moments, step) that no other node has, and it has no replica. Instead, the
//! controller keeps the batches it trained the critic on since the critic's state was
//! last saved ([`CriticLog`]): a new critic started from that state (the run's last
//! checkpoint, or the job's base model with its zero-initialised value head) and given
//! those updates again is the lost one, bit for bit on nodes that compute alike.
//!
//! A call the critic's loss fails (`Controller::serve_critic`, `critic_recovery.rs`)
//! starts the new critic through the job's [`CriticRespawn`], replays the log into it
//! and asks it again, so the step goes on where it was: also during the update, which
//! by then the policy may have taken. A step that fails on another role first, with the
//! critic's node lost too, recovers it the same way before the step runs again
//! (`build/respawn.rs`).
//!
//! The log costs the controller the critic's fields of every sample trained since the
//! last checkpoint (tokens, values, returns, loss mask): `checkpoint.every` bounds it.

use std::future::Future;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use yatt_roles::Sample;
use yatt_runtime::ActorId;

use crate::controller::error::ControllerError;
use crate::controller::refs::CriticRef;

/// The critic's updates since its state was last saved, oldest first.
#[derive(Debug, Default)]
pub(crate) struct CriticLog {
    /// The checkpoint whose `critic/` holds the state before `batches`; `None`: the
    /// job's fresh critic.
    base: Option<PathBuf>,
    /// Each update's samples (only what the critic trains on), with the step
    /// (1-based) that made it.
    batches: Vec<(u64, Vec<Sample>)>,
}

impl CriticLog {
    /// A log whose critic started from `base` (a resumed run's checkpoint) or fresh.
    pub(crate) fn new(base: Option<PathBuf>) -> Self {
        CriticLog {
            base,
            batches: Vec::new(),
        }
    }

    /// Step `step` trained the critic on `samples`.
    pub(crate) fn record(&mut self, step: u64, samples: &[Sample]) {
        self.batches
            .push((step, samples.iter().map(critic_fields).collect()));
    }

    /// The critic's state was saved in checkpoint `dir`: the log starts again there.
    pub(crate) fn checkpointed(&mut self, dir: &Path) {
        self.base = Some(dir.to_path_buf());
        self.batches.clear();
    }

    /// The run goes back to after step `completed`: later updates are undone with it.
    pub(crate) fn rewind(&mut self, completed: u64) {
        self.batches.retain(|(step, _)| *step <= completed);
    }

    /// Where a new critic starts (see [`CriticLog::base`]).
    pub(crate) fn base(&self) -> Option<&Path> {
        self.base.as_deref()
    }

    /// The updates to give a new critic, oldest first.
    pub(crate) fn batches(&self) -> impl Iterator<Item = &[Sample]> {
        self.batches.iter().map(|(_, b)| b.as_slice())
    }
}

/// A sample with only what the critic's update reads; the texts, log-probs and
/// metadata would multiply the log's memory for nothing.
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
    log: Mutex<CriticLog>,
    pub(crate) respawn: Arc<dyn CriticRespawn>,
    /// A critic started during a step that borrowed the controller shared; adopted
    /// into the roles at the next exclusive borrow.
    replaced: Mutex<Option<CriticRef>>,
    /// Updates replayed since the step's metrics last took the count.
    replayed: AtomicU64,
}

impl CriticRecovery {
    pub(crate) fn new(log: CriticLog, respawn: Arc<dyn CriticRespawn>) -> Self {
        CriticRecovery {
            log: Mutex::new(log),
            respawn,
            replaced: Mutex::new(None),
            replayed: AtomicU64::new(0),
        }
    }

    pub(crate) fn lock_log(&self) -> MutexGuard<'_, CriticLog> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn lock_replaced(&self) -> MutexGuard<'_, Option<CriticRef>> {
        self.replaced.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Updates replayed since the last call.
    pub(crate) fn take_replayed(&self) -> u64 {
        self.replayed.swap(0, Ordering::Relaxed)
    }

    /// One more update replayed.
    pub(crate) fn count_replayed(&self) {
        self.replayed.fetch_add(1, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(id: u64) -> Sample {
        let id = yatt_roles::SampleId {
            step: 0,
            prompt: id,
            k: 0,
        };
        let mut s = Sample::new(id, id.prompt);
        s.prompt_tokens = vec![1, 2];
        s.response_tokens = vec![3, 4, 5];
        s.prompt_text = "a long prompt".into();
        s.values = Some(vec![0.5; 3]);
        s.returns = Some(vec![1.0; 3]);
        s
    }

    #[test]
    fn the_log_keeps_what_the_critic_trains_on_since_the_last_checkpoint() {
        let mut log = CriticLog::new(None);
        log.record(1, &[sample(1), sample(2)]);
        log.record(2, &[sample(3)]);
        let b: Vec<&[Sample]> = log.batches().collect();
        assert_eq!(b.len(), 2);
        assert_eq!(b[0][1].id, sample(2).id);
        assert!(b[0][0].prompt_text.is_empty(), "texts are not kept");
        assert_eq!(b[0][0].returns, Some(vec![1.0; 3]));
        assert_eq!(b[0][0].values, Some(vec![0.5; 3]));
        assert_eq!(b[0][0].response_tokens, sample(1).response_tokens);

        log.checkpointed(Path::new("/run/checkpoint"));
        assert_eq!(log.base(), Some(Path::new("/run/checkpoint")));
        assert_eq!(log.batches().count(), 0);
        log.record(3, &[sample(4)]);
        log.record(4, &[sample(5)]);
        // Step 4 runs again from after step 3: its update is undone.
        log.rewind(3);
        let ids: Vec<_> = log.batches().flatten().map(|s| s.id).collect();
        assert_eq!(ids, [sample(4).id]);
    }
}
