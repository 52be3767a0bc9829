//! What a run simulates and what it measured.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cost::Stage;
use crate::profile::{DecodeCoeffs, Efficiency, GpuSpec, JobShape};
use crate::workload::WorkloadSpec;

/// What a simulation run is: the hardware, the job, the workload.
#[derive(Debug, Clone)]
pub struct World {
    /// The accelerator.
    pub gpu: GpuSpec,
    /// Efficiencies the hardware really reaches.
    pub truth: Efficiency,
    /// The job.
    pub job: JobShape,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Devices per group.
    pub group_devices: u32,
    /// Groups in the cluster.
    pub groups: u32,
    /// Measured rates replacing the rooflines (a run calibrated from its metrics).
    pub rates: Option<Rates>,
}

/// What one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// Seconds from start to the last step's weights published.
    pub makespan_s: f64,
    /// Each step's duration (time between consecutive steps finishing), seconds.
    pub step_s: Vec<f64>,
    /// Fraction of device-time spent computing (decoding, prefill, passes).
    pub compute_frac: f64,
    /// Tokens generated, responses and verdicts, including those thrown away.
    pub generated_tokens: f64,
    /// Fraction spent on overhead: offload/reload, weight sync, migrations.
    pub overhead_frac: f64,
    /// Fraction with nothing to do.
    pub idle_frac: f64,
    /// Generated tokens thrown away (aborted sequences, surplus groups), fraction of all.
    pub wasted_frac: f64,
    /// Tokens trained on (prompt + response of kept samples), all steps.
    pub trained_tokens: f64,
    /// Migrations carried out.
    pub migrations: u32,
    /// The plans in force: (step at which it was decided, summary).
    pub plans: Vec<(u64, String)>,
    /// The policy's search log, when there was a policy.
    pub log: Vec<String>,
    /// Per stage over the run: group-seconds, and for decoding stages the mean batch
    /// (tokens per iteration).
    pub stages: Vec<(Stage, f64, Option<f64>)>,
    /// Prompt groups trained by a later step than the one they were issued for
    /// (carried by partial rollouts), fraction of the groups trained.
    pub carried_frac: f64,
    /// Generated tokens thrown away because their response would have trained beyond
    /// the staleness bound (generated again), fraction of all generated.
    pub stale_frac: f64,
    /// Tokens prefilled again by responses that resumed without their KV cache,
    /// fraction of all generated.
    pub reprefill_frac: f64,
    /// The most versions a trained group's oldest response lagged the weights it
    /// trained.
    pub max_lag: u32,
    /// Every group trained: (the step it was issued for, its index, the step that
    /// trained it).
    pub trained_groups: Vec<(u32, u32, u32)>,
    /// Responses moved to a straggler lane.
    pub lane_moves: u64,
    /// Group-seconds the lanes spent bringing moved responses' KV caches over the
    /// interconnect (or prefilling them again).
    pub lane_transfer_s: f64,
}

/// Measured rates that replace the rooflines (a run calibrated from its metrics, or a
/// policy's candidates judged with its fitted cost model).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Rates {
    /// Decoding: seconds per iteration (`a`) and per generated token (`b`); `c` and
    /// `prefill` are folded into those on CPU.
    pub gen: DecodeCoeffs,
    /// The generative judge's decoding, when there is one to override.
    pub judge: Option<DecodeCoeffs>,
    /// Sequences the engine decodes at once (0: as many as memory allows).
    pub slots: u32,
    /// Device-seconds per token of the forward and training stages.
    pub s_per_token: BTreeMap<Stage, f64>,
    /// Weight sync, seconds per step.
    pub sync_s: f64,
    /// Everything else per step (reward, advantages, bookkeeping), seconds.
    pub overhead_s: f64,
    /// Seconds of switching roles (none when roles share a process without offload).
    pub switch_s: f64,
}
