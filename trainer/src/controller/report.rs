//! What a step reports, and a controller's checkpointed position.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use yatt_roles::{CriticReport, LoaderState, RolloutStats, Sample, TrainReport};

use crate::ledger::LedgerReport;
use yatt_metrics::names;

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
/// With several heads, each head's stage times and pipeline figures are kept beside
/// the means (`head/I/timing_s/gen`, see [`names::HEAD_PREFIX`]), so that its own
/// timeline can be drawn.
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
    m.set(names::LEDGER_TRAINED, trained as f64);
    if reports.len() > 1 {
        for (i, r) in reports.iter().enumerate() {
            for (k, v) in r
                .metrics
                .values
                .iter()
                .filter(|(k, _)| names::kept_per_head(k))
            {
                m.set(&format!("{}{i}/{k}", names::HEAD_PREFIX), *v);
            }
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn report(gen_s: f64, overlap_s: f64) -> StepReport {
        StepReport {
            metrics: StepMetrics {
                step: 3,
                values: BTreeMap::from([
                    (names::GEN_S.to_string(), gen_s),
                    (names::OVERLAP_S.to_string(), overlap_s),
                    (names::REWARDS_MEAN.to_string(), gen_s),
                ]),
            },
            ledger: LedgerReport {
                step: 3,
                samples: 4,
                requeued: 0,
                dropped: 0,
                stages: Vec::new(),
            },
            samples: Vec::new(),
            train: TrainReport::default(),
            critic: None,
        }
    }

    #[test]
    fn several_heads_keep_their_own_stage_times_beside_the_means() {
        let m = average_heads(&[report(1.0, 0.5), report(3.0, 2.0)]);
        assert_eq!(m.get(names::GEN_S), Some(2.0));
        assert_eq!(m.get("head/0/timing_s/gen"), Some(1.0));
        assert_eq!(m.get("head/1/timing_s/gen"), Some(3.0));
        assert_eq!(m.get("head/1/async/overlap_s"), Some(2.0));
        assert_eq!(
            m.get("head/0/critic/rewards/mean"),
            None,
            "stage figures only"
        );
        assert_eq!(m.get(names::LEDGER_TRAINED), Some(8.0));
        // One head: its values are the step's, with nothing repeated.
        let one = average_heads(&[report(1.0, 0.5)]);
        assert!(one
            .values
            .keys()
            .all(|k| !k.starts_with(names::HEAD_PREFIX)));
    }
}
