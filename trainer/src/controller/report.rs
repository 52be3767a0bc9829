//! What a step reports, and a controller's checkpointed position.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use yatt_roles::{CriticReport, LoaderState, RolloutStats, Sample, TrainReport};

use crate::ledger::LedgerReport;

/// One step's metrics, by verl-style name (`timing_s/gen`, `critic/rewards/mean`, ...).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The step.
    pub step: u64,
    /// Metric name → value.
    pub values: BTreeMap<String, f64>,
}

impl StepMetrics {
    /// A metric's value.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name).copied()
    }

    pub(crate) fn set(&mut self, name: &str, v: f64) {
        self.values.insert(name.to_string(), v);
    }

    /// Adds `v` to the metric (e.g. over the rounds of dynamic sampling).
    pub(crate) fn add(&mut self, name: &str, v: f64) {
        *self.values.entry(name.to_string()).or_insert(0.0) += v;
    }
}

/// What one step produced.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Metrics.
    pub metrics: StepMetrics,
    /// The closed ledger.
    pub ledger: LedgerReport,
    /// The step's samples with every stage's fields (as sent to training).
    pub samples: Vec<Sample>,
    /// The policy update's report.
    pub train: TrainReport,
    /// The critic update's report (PPO).
    pub critic: Option<CriticReport>,
}

/// The heads' metrics of one step averaged, and the samples their ledgers closed on
/// as trained, summed (`ledger/samples_trained`): what a run records for the step.
pub(crate) fn average_heads(reports: &[StepReport]) -> StepMetrics {
    let mut sum: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for r in reports {
        for (k, v) in &r.metrics.values {
            let e = sum.entry(k.clone()).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    let mut m = StepMetrics {
        step: reports.first().map_or(0, |r| r.metrics.step),
        values: sum
            .into_iter()
            .map(|(k, (s, n))| (k, s / n as f64))
            .collect(),
    };
    let trained: usize = reports
        .iter()
        .map(|r| r.ledger.samples - r.ledger.dropped)
        .sum();
    m.set(yatt_metrics::names::LEDGER_TRAINED, trained as f64);
    m
}

/// A controller's position, to checkpoint next to the policy's weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ControllerState {
    /// Steps completed.
    pub step: u64,
    /// Policy weights version the rollout holds.
    pub weights_version: u64,
    /// The dataloader's position.
    pub loader: LoaderState,
    /// Batches generated and rewarded ahead of the steps that train them (staleness
    /// ≥ 1): resuming trains them as they are, so no prompt is lost or repeated.
    #[serde(default)]
    pub pending: Vec<PendingBatch>,
}

/// A generated batch not yet trained, as a checkpoint keeps it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PendingBatch {
    /// The step that trains it.
    pub step: u64,
    /// The step that generated it: its samples started on the weights after that
    /// many updates.
    pub generated_at: u64,
    /// Its rewarded samples.
    pub samples: Vec<Sample>,
    /// Its generation's counters.
    pub gen: RolloutStats,
    /// Its generation's metrics.
    pub metrics: StepMetrics,
}
