//! How a controller's step fails.

use yatt_roles::{AlgoError, DataError, SampleError, SampleId};
use yatt_runtime::CallError;

use crate::ledger::LedgerError;

/// Why a step (or setting up a controller) failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A role did not answer, or answered with an error.
    #[error("{}, {stage}: asking {role}: {source}", when(*step, stage))]
    Call {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// What the controller was doing.
        stage: &'static str,
        /// The role asked.
        role: &'static str,
        /// The runtime's error (timeout, handler error, ...).
        #[source]
        source: CallError,
    },
    /// A role answered with the wrong kind of response.
    #[error("step {step}: {role} answered {got} to a {asked} request")]
    Protocol {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// The role.
        role: &'static str,
        /// What was asked.
        asked: &'static str,
        /// What came back.
        got: String,
    },
    /// The sample ledger does not balance: a sample is missing, doubled or unexpected.
    #[error("step {step}: sample ledger: {source}")]
    Ledger {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// Which sample and stage.
        #[source]
        source: LedgerError,
    },
    /// A sample lacks what a stage needs.
    #[error("step {step}: {source}")]
    Sample {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// What is missing.
        #[source]
        source: SampleError,
    },
    /// The advantage or KL maths rejected the batch.
    #[error("step {step}: advantages: {source}")]
    Algo {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// The algorithm's error.
        #[source]
        source: AlgoError,
    },
    /// The rollout generated with weights other than the policy's latest.
    #[error("step {step}: {id} was generated with weights v{got}, but the policy is at v{want}; weight sync did not reach the rollout")]
    StaleWeights {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// The first stale sample.
        id: SampleId,
        /// Its weights version.
        got: u64,
        /// The policy's version.
        want: u64,
    },
    /// A sample would train more versions after the one its generation started with
    /// than the staleness bound allows.
    #[error("step {step}: {id} started generating on the weights after update {started} and would train the weights after update {trains}: {} versions behind, beyond rollout.staleness = {bound}", trains - started)]
    BeyondStaleness {
        /// The failing step, 1-based.
        step: u64,
        /// The sample.
        id: SampleId,
        /// The policy version (updates taken) its generation started with.
        started: u64,
        /// The policy version (updates taken) it would train.
        trains: u64,
        /// The bound.
        bound: u32,
    },
    /// The configuration cannot work.
    #[error("controller config: {0}")]
    Config(String),
    /// Dynamic sampling found no prompt group whose rewards differ.
    #[error("step {step}: dynamic sampling found no prompt group with differing rewards in {rounds} generation rounds ({groups} groups dropped); raise algorithm.max_sampling_rounds or the temperature, or check the reward")]
    NoSignal {
        /// The failing step, 1-based as the progress line numbers it (0: before the first).
        step: u64,
        /// Generation rounds tried.
        rounds: usize,
        /// Groups seen and dropped.
        groups: usize,
    },
    /// Reloading a role (time sharing) would take the device beyond its budget.
    #[error("step {step}: reloading the {role} needs {need} bytes, and the roles on the device hold {in_use} bytes already: {} bytes in all, beyond the budget of {budget} bytes (placement.device_memory_gb); raise placement.device_memory_gb, shrink the batch or the model, or set placement.time_share = \"off\" on a device that holds every role", need + in_use)]
    DeviceBudget {
        /// The failing step, 1-based as the progress line numbers it.
        step: u64,
        /// The role to reload.
        role: String,
        /// Bytes it held before its offload.
        need: u64,
        /// Bytes the other roles hold now.
        in_use: u64,
        /// The budget.
        budget: u64,
    },
    /// The dataloader state could not be restored.
    #[error("restoring the controller: {0}")]
    Restore(#[source] DataError),
    /// A role could not be started or spawned.
    #[error("starting role {role}: {reason}")]
    Spawn {
        /// The role.
        role: String,
        /// Why.
        reason: String,
    },
}

/// When a call failed, for its message: the step it belonged to, or, for a checkpoint
/// (saved between steps, numbered as the next step's call), the step it follows: the
/// end-of-run save of a 300-step run is "after step 300", never "step 301".
fn when(step: u64, stage: &str) -> String {
    match stage {
        "checkpoint" => format!("after step {}", step.saturating_sub(1)),
        _ => format!("step {step}"),
    }
}

/// Whether a failed call means the replica is gone (its node died or left, its actor
/// stopped, or it missed its deadline) rather than that it refused the request: only
/// then is its work worth handing to another replica.
pub(crate) fn replica_lost(e: &CallError) -> bool {
    !matches!(e, CallError::Handler { .. })
}

/// The node a call failed to reach, when the failure is one a lost node or a broken
/// network gives (rather than the role's own error).
pub(crate) fn unreached_node(e: &CallError) -> Option<&str> {
    match e {
        CallError::Transport { node, .. }
        | CallError::NodeDown { node }
        | CallError::Unavailable { node, .. } => Some(node),
        CallError::Timeout { target, .. }
        | CallError::Died { target }
        | CallError::Closed { target } => Some(&target.name.node),
        CallError::Stale { .. } | CallError::Handler { .. } | CallError::Codec(_) => None,
    }
}
