//! Stages a user adds to the step: a filter, a second reward, a safety classifier, a
//! code sandbox. Each is a role that takes samples and gives them back (the shape of a
//! reward role), placed after one of the built-in stages. It may change any field
//! (add to `reward`, fill `metadata`) and may drop samples (a filter): a sample it
//! does not give back is dropped through the ledger, never lost silently. Giving back
//! a sample it was not given, or one twice, fails the step. (The controller runs them
//! in `stages.rs`.)

use std::time::Duration;

use crate::controller::refs::SamplesRef;
use crate::ledger::Stage;

/// Where an extra stage runs: after which built-in stage (in `[[roles.stages]]`:
/// `after = "reward"`, `"reference"` or `"old_logprobs"`).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum StageAt {
    /// After the reward (each generation round, before DAPO's dynamic sampling and the
    /// overlong penalty): reward shaping, filters, classifiers.
    Reward,
    /// After the reference log-probs (or where they would be, without a reference).
    Reference,
    /// After the old log-probs, just before the advantages.
    #[serde(rename = "old_logprobs", alias = "old_log_probs")]
    OldLogProbs,
}

impl StageAt {
    /// The ledger stage a sample has passed when this place is reached (a dropped
    /// sample is dropped after it).
    pub(crate) fn ledger_stage(self, has_reference: bool) -> Stage {
        match self {
            StageAt::Reward => Stage::Rewarded,
            StageAt::Reference if has_reference => Stage::Referenced,
            StageAt::Reference => Stage::Rewarded,
            StageAt::OldLogProbs => Stage::OldLogProbs,
        }
    }
}

/// A user's stage in the step.
#[derive(Clone)]
pub struct ExtraStage {
    /// Its name, in metrics (`timing_s/stage/NAME`, `stage/NAME/dropped`) and errors.
    pub name: &'static str,
    /// Where it runs.
    pub after: StageAt,
    /// The role: `Vec<Sample>` in, `Vec<Sample>` out.
    pub role: SamplesRef,
    /// Deadline of one call.
    pub timeout: Duration,
}

impl ExtraStage {
    /// A stage named `name` (kept for the life of the process: stages are few and built
    /// once) running `role` after `after`, with a 300 s deadline per call.
    pub fn new(name: impl Into<String>, after: StageAt, role: SamplesRef) -> Self {
        ExtraStage {
            name: Box::leak(name.into().into_boxed_str()),
            after,
            role,
            timeout: Duration::from_secs(300),
        }
    }

    /// Sets the deadline of one call.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }
}

impl std::fmt::Debug for ExtraStage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExtraStage")
            .field("name", &self.name)
            .field("after", &self.after)
            .field("role", &self.role.id())
            .finish()
    }
}
