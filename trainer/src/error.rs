//! The trainer's error type: every way a job can fail, each saying how to fix it.

use std::path::PathBuf;

use yatt_roles::{DataError, RewardError};

use crate::controller::error::ControllerError;

/// Why a job could not be configured, built or run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The config file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config is not valid TOML or a value has the wrong type or an unknown key.
    #[error("{origin}: {message}\nfix: compare with config/demo-letters.toml (every key, its type and default are listed in trainer/src/config/sections.rs)")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The TOML/serde message (names the key and the line).
        message: String,
    },
    /// A `--set` argument is malformed or names an unknown key.
    #[error("--set {arg}: {reason}")]
    Set {
        /// The argument as given.
        arg: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A value is of the right type but not acceptable.
    #[error("{key}: expected {expected}, found {found}; fix: {fix}")]
    Invalid {
        /// Dotted key, e.g. `algorithm.name`.
        key: String,
        /// What is accepted.
        expected: String,
        /// What the config holds.
        found: String,
        /// How to fix it.
        fix: String,
    },
    /// The feature asked for exists in the schema but not in the code yet.
    #[error("{key} = {found:?} is not implemented yet; fix: {fix}")]
    NotImplemented {
        /// Dotted key.
        key: String,
        /// The value asked for.
        found: String,
        /// What works today.
        fix: String,
    },
    /// Live placement could not carry out what the run needs (a migration, a lost
    /// node's re-plan, a role start or stop on a group).
    #[error("live placement: {what}; fix: {fix}")]
    Placement {
        /// What failed, naming the group, node or replica.
        what: String,
        /// How to fix it or where to look.
        fix: String,
    },
    /// A disaggregated run could not recover from a lost node by itself (no node can
    /// host the lost roles, every policy replica is gone, the survivors took the
    /// failed step's update).
    #[error("recovering from a lost node: {what}; fix: {fix}")]
    Recovery {
        /// What was lost and why the run cannot go on.
        what: String,
        /// How to continue.
        fix: String,
    },
    /// Loading a model or tokenizer failed.
    #[error("model {source_desc}: {reason}")]
    Model {
        /// `tiny` or the directory.
        source_desc: String,
        /// The engine's message.
        reason: String,
    },
    /// Loading the prompts failed.
    #[error("data: {0}")]
    Data(#[from] DataError),
    /// Building a reward function failed.
    #[error("reward: {0}")]
    Reward(#[from] RewardError),
    /// A controller or role failed (setting up or during a step).
    #[error("{0}")]
    Controller(Box<ControllerError>),
    /// A run directory cannot be resumed.
    #[error("cannot resume from {dir}: {reason}")]
    Resume {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A step failed mid-run; `recovery` says what the run can be resumed from.
    #[error("{source}\n{recovery}")]
    Stopped {
        /// Why the step failed.
        source: Box<JobError>,
        /// Whether and how to resume: the last checkpoint's step and the command, or
        /// that none was saved.
        recovery: String,
    },
    /// An evaluation during training (`[eval]`) failed.
    #[error("eval after step {step}: {reason}; fix: correct [eval] (or set eval.every = 0 to train without evaluating)")]
    Eval {
        /// The step whose checkpoint was evaluated.
        step: u64,
        /// What went wrong.
        reason: String,
    },
    /// A preflight check failed before the first step (see `yatt train --dry-run`).
    #[error("preflight: {} of {checks} check(s) failed before step 1:\n{}", failed.len(), failed.join("\n"))]
    Preflight {
        /// How many checks ran.
        checks: usize,
        /// Each failed check: node, check, key, what is wrong and the fix.
        failed: Vec<String>,
    },
    /// A checkpoint save failed (`at`: the end-of-run save or a periodic one, after
    /// which step); `rescued` says where the weights were saved instead, or why not.
    #[error("{at}: {source}\n{rescued}")]
    Checkpoint {
        /// E.g. "the end-of-run save (after step 300 of 300)".
        at: String,
        /// Why the save failed.
        source: Box<JobError>,
        /// Where the weights are now, and how to continue from them.
        rescued: String,
    },
    /// Writing metrics or the checkpoint directory failed.
    #[error("{path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<ControllerError> for JobError {
    fn from(e: ControllerError) -> Self {
        JobError::Controller(Box::new(e))
    }
}
