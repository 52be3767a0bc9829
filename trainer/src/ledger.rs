//! The sample ledger: every sample of a step accounted for exactly once at every stage.
//!
//! What belongs here: [`SampleLedger`], a pure bookkeeping structure (no actors, no
//! tensors). The controller `expect`s the samples of a step, `record`s each stage a
//! role reports done for a sample, `requeue`s work a drained role gave up, and
//! `close`s the step. Closing (and [`SampleLedger::verify_stage`], which the controller
//! calls after each stage so a broken batch never reaches the optimizer) refuses a
//! sample that is missing at a stage, counted twice, or never expected, naming it.
//!
//! Recording never fails: a role's answer is recorded as it is, and the verdict comes
//! from the check, which sees the whole step and reports the first problem in id order.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use yatt_roles::SampleId;

/// A stage a sample passes through in a step, in pipeline order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Stage {
    /// The rollout generated it.
    Generated,
    /// The reward role scored it.
    Rewarded,
    /// The reference role computed its reference log-probs.
    Referenced,
    /// The critic computed its values.
    Valued,
    /// The policy computed its old log-probs.
    OldLogProbs,
    /// The controller computed its advantages.
    Advantaged,
    /// The policy trained on it.
    Trained,
    /// The critic trained on it.
    CriticTrained,
}

impl Stage {
    /// Every stage, in order.
    pub const ALL: [Stage; 8] = [
        Stage::Generated,
        Stage::Rewarded,
        Stage::Referenced,
        Stage::Valued,
        Stage::OldLogProbs,
        Stage::Advantaged,
        Stage::Trained,
        Stage::CriticTrained,
    ];

    fn index(self) -> usize {
        self as usize
    }

    /// The stage's name, for errors and metrics.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Generated => "generated",
            Stage::Rewarded => "rewarded",
            Stage::Referenced => "referenced",
            Stage::Valued => "valued",
            Stage::OldLogProbs => "old_log_prob",
            Stage::Advantaged => "advantaged",
            Stage::Trained => "trained",
            Stage::CriticTrained => "critic_trained",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Why a step's accounting does not balance.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LedgerError {
    /// A sample never reached a stage (`others` more samples are missing somewhere too).
    #[error("{id} is missing at stage {stage} (and {others} more missing samples/stages); a role dropped it")]
    Missing {
        /// The first missing sample (in id order).
        id: SampleId,
        /// The stage it did not reach.
        stage: Stage,
        /// How many other (sample, stage) pairs are missing.
        others: usize,
    },
    /// A sample was recorded more than once at a stage.
    #[error("{id} was counted {count} times at stage {stage}; a role returned it twice or requeued work also finished")]
    Duplicate {
        /// The sample.
        id: SampleId,
        /// The stage.
        stage: Stage,
        /// How many times it was recorded.
        count: u32,
    },
    /// A sample was recorded that the step never expected.
    #[error("{id} was recorded at stage {stage} but is not part of step {step}")]
    Unexpected {
        /// The sample.
        id: SampleId,
        /// The stage.
        stage: Stage,
        /// The ledger's step.
        step: u64,
    },
    /// `expect` was given a sample twice, or one of another step.
    #[error("cannot expect {id} in step {step}: {reason}")]
    BadExpect {
        /// The sample.
        id: SampleId,
        /// The ledger's step.
        step: u64,
        /// Why.
        reason: &'static str,
    },
    /// A sample dropped by dynamic sampling reached a later stage anyway.
    #[error(
        "{id} was dropped after stage {dropped_after} (dynamic sampling) but reached stage {stage}"
    )]
    AfterDrop {
        /// The sample.
        id: SampleId,
        /// The last stage it had to pass.
        dropped_after: Stage,
        /// The stage it should never have reached.
        stage: Stage,
    },
    /// `drop_after` was asked for a sample that is not expected, or before it passed
    /// the stage it is dropped after.
    #[error("cannot drop {id} after stage {stage}: {reason}")]
    BadDrop {
        /// The sample.
        id: SampleId,
        /// The stage.
        stage: Stage,
        /// Why.
        reason: &'static str,
    },
    /// `requeue` was asked for a sample that is not expected or already complete.
    #[error("cannot requeue {id}: {reason}")]
    BadRequeue {
        /// The sample.
        id: SampleId,
        /// Why.
        reason: &'static str,
    },
}

#[derive(Debug, Clone, Default)]
struct Entry {
    counts: [u32; Stage::ALL.len()],
    requeued: u32,
    /// Dropped by dynamic sampling: the sample is accounted for up to this stage and
    /// must not reach any later one.
    dropped_after: Option<Stage>,
}

/// The accounting of one closed step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LedgerReport {
    /// The step.
    pub step: u64,
    /// Samples accounted for.
    pub samples: usize,
    /// Times work was requeued.
    pub requeued: u64,
    /// Samples dropped by dynamic sampling (accounted for up to their drop stage).
    #[serde(default)]
    pub dropped: usize,
    /// The stages every sample passed.
    pub stages: Vec<Stage>,
}

/// The ledger of one step.
#[derive(Debug, Clone)]
pub struct SampleLedger {
    step: u64,
    stages: Vec<Stage>,
    entries: BTreeMap<SampleId, Entry>,
    unexpected: Vec<(SampleId, Stage)>,
}

impl SampleLedger {
    /// A ledger for `step` whose samples must pass each of `stages` exactly once.
    pub fn new(step: u64, stages: &[Stage]) -> Self {
        let mut stages = stages.to_vec();
        stages.sort();
        stages.dedup();
        SampleLedger {
            step,
            stages,
            entries: BTreeMap::new(),
            unexpected: Vec::new(),
        }
    }

    /// The step.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// The stages every sample must pass.
    pub fn stages(&self) -> &[Stage] {
        &self.stages
    }

    /// Samples expected so far.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no sample is expected.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Declares the samples of the step. A sample of another step, or one already
    /// expected, is refused (and nothing of this call is kept).
    pub fn expect(&mut self, ids: impl IntoIterator<Item = SampleId>) -> Result<(), LedgerError> {
        let ids: Vec<SampleId> = ids.into_iter().collect();
        let mut fresh = std::collections::BTreeSet::new();
        for id in &ids {
            if id.step != self.step {
                return Err(LedgerError::BadExpect {
                    id: *id,
                    step: self.step,
                    reason: "it belongs to another step",
                });
            }
            if self.entries.contains_key(id) || !fresh.insert(*id) {
                return Err(LedgerError::BadExpect {
                    id: *id,
                    step: self.step,
                    reason: "it is already expected",
                });
            }
        }
        for id in ids {
            self.entries.insert(id, Entry::default());
        }
        Ok(())
    }

    /// Records that `id` passed `stage`. Never fails; [`Self::verify_stage`] and
    /// [`Self::close`] judge.
    pub fn record(&mut self, id: SampleId, stage: Stage) {
        match self.entries.get_mut(&id) {
            Some(e) => e.counts[stage.index()] += 1,
            None => self.unexpected.push((id, stage)),
        }
    }

    /// Records `stage` for every id.
    pub fn record_all<'a>(&mut self, ids: impl IntoIterator<Item = &'a SampleId>, stage: Stage) {
        for id in ids {
            self.record(*id, stage);
        }
    }

    /// Dynamic sampling dropped `id` after it passed `stage`: it needs no later stage,
    /// and reaching one is an error.
    pub fn drop_after(&mut self, id: SampleId, stage: Stage) -> Result<(), LedgerError> {
        let bad = |reason| LedgerError::BadDrop { id, stage, reason };
        let e = self
            .entries
            .get_mut(&id)
            .ok_or(bad("it is not expected in this step"))?;
        if e.counts[stage.index()] == 0 {
            return Err(bad("it has not passed that stage"));
        }
        if e.dropped_after.is_some() {
            return Err(bad("it was already dropped"));
        }
        e.dropped_after = Some(stage);
        Ok(())
    }

    /// Work on `id` was given up (a drained role): it is expected again at the first
    /// required stage it has not passed, which is returned.
    pub fn requeue(&mut self, id: SampleId) -> Result<Stage, LedgerError> {
        let stages = self.stages.clone();
        let e = self.entries.get_mut(&id).ok_or(LedgerError::BadRequeue {
            id,
            reason: "it is not expected in this step",
        })?;
        let next = stages
            .iter()
            .copied()
            .find(|s| e.counts[s.index()] == 0 && e.dropped_after.is_none_or(|d| *s <= d))
            .ok_or(LedgerError::BadRequeue {
                id,
                reason: "it has already passed every stage",
            })?;
        e.requeued += 1;
        Ok(next)
    }

    /// Checks one stage: every expected sample recorded exactly once there, and nothing
    /// unexpected recorded there.
    pub fn verify_stage(&self, stage: Stage) -> Result<(), LedgerError> {
        self.check(&[stage])
    }

    fn check(&self, stages: &[Stage]) -> Result<(), LedgerError> {
        if let Some((id, stage)) = self.unexpected.iter().find(|(_, s)| stages.contains(s)) {
            return Err(LedgerError::Unexpected {
                id: *id,
                stage: *stage,
                step: self.step,
            });
        }
        let mut missing: Vec<(SampleId, Stage)> = Vec::new();
        for (id, e) in &self.entries {
            for &stage in stages {
                if let Some(d) = e.dropped_after.filter(|d| stage > *d) {
                    if e.counts[stage.index()] > 0 {
                        return Err(LedgerError::AfterDrop {
                            id: *id,
                            dropped_after: d,
                            stage,
                        });
                    }
                    continue;
                }
                match e.counts[stage.index()] {
                    0 => missing.push((*id, stage)),
                    1 => {}
                    count => {
                        return Err(LedgerError::Duplicate {
                            id: *id,
                            stage,
                            count,
                        })
                    }
                }
            }
        }
        match missing.first() {
            Some(&(id, stage)) => Err(LedgerError::Missing {
                id,
                stage,
                others: missing.len() - 1,
            }),
            None => Ok(()),
        }
    }

    /// Ends the step: every expected sample passed every required stage exactly once.
    pub fn close(self) -> Result<LedgerReport, LedgerError> {
        self.check(&self.stages)?;
        if let Some((id, stage)) = self.unexpected.first() {
            return Err(LedgerError::Unexpected {
                id: *id,
                stage: *stage,
                step: self.step,
            });
        }
        Ok(LedgerReport {
            step: self.step,
            samples: self.entries.len(),
            requeued: self.entries.values().map(|e| e.requeued as u64).sum(),
            dropped: self
                .entries
                .values()
                .filter(|e| e.dropped_after.is_some())
                .count(),
            stages: self.stages,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(prompt: u64, k: u32) -> SampleId {
        SampleId { step: 3, prompt, k }
    }

    fn ledger() -> SampleLedger {
        let mut l = SampleLedger::new(3, &[Stage::Generated, Stage::Rewarded]);
        l.expect([id(1, 0), id(1, 1), id(2, 0)]).unwrap();
        l
    }

    #[test]
    fn balanced_step_closes() {
        let mut l = ledger();
        for s in [Stage::Generated, Stage::Rewarded] {
            l.record_all(&[id(1, 0), id(1, 1), id(2, 0)], s);
            l.verify_stage(s).unwrap();
        }
        let r = l.close().unwrap();
        assert_eq!((r.step, r.samples, r.requeued), (3, 3, 0));
    }

    #[test]
    fn missing_sample_is_named_with_its_stage() {
        let mut l = ledger();
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0)], Stage::Generated);
        l.record_all(&[id(1, 0), id(2, 0)], Stage::Rewarded);
        let e = l.verify_stage(Stage::Rewarded).unwrap_err();
        assert_eq!(
            e,
            LedgerError::Missing {
                id: id(1, 1),
                stage: Stage::Rewarded,
                others: 0
            }
        );
        let e = l.close().unwrap_err();
        assert!(
            e.to_string()
                .contains("prompt 0x1 sample 1 is missing at stage rewarded"),
            "{e}"
        );
    }

    #[test]
    fn double_count_is_named() {
        let mut l = ledger();
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0), id(2, 0)], Stage::Generated);
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0)], Stage::Rewarded);
        let e = l.close().unwrap_err();
        assert_eq!(
            e,
            LedgerError::Duplicate {
                id: id(2, 0),
                stage: Stage::Generated,
                count: 2
            }
        );
    }

    #[test]
    fn unexpected_and_bad_expect_are_refused() {
        let mut l = ledger();
        assert!(matches!(
            l.expect([id(1, 0)]),
            Err(LedgerError::BadExpect { .. })
        ));
        let other_step = SampleId {
            step: 4,
            prompt: 1,
            k: 0,
        };
        assert!(matches!(
            l.expect([other_step]),
            Err(LedgerError::BadExpect { .. })
        ));
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0), id(9, 0)], Stage::Generated);
        let e = l.verify_stage(Stage::Generated).unwrap_err();
        assert_eq!(
            e,
            LedgerError::Unexpected {
                id: id(9, 0),
                stage: Stage::Generated,
                step: 3
            }
        );
    }

    #[test]
    fn requeued_work_is_expected_again_once() {
        let mut l = ledger();
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0)], Stage::Generated);
        l.record_all(&[id(1, 0), id(2, 0)], Stage::Rewarded);
        // The reward replica holding (1, 1) was drained: it gives the sample back.
        assert_eq!(l.requeue(id(1, 1)).unwrap(), Stage::Rewarded);
        l.record(id(1, 1), Stage::Rewarded);
        assert!(matches!(
            l.requeue(id(1, 1)),
            Err(LedgerError::BadRequeue { .. })
        ));
        assert!(matches!(
            l.requeue(id(7, 0)),
            Err(LedgerError::BadRequeue { .. })
        ));
        assert_eq!(l.close().unwrap().requeued, 1);
    }

    #[test]
    fn dropped_samples_need_no_later_stage_and_may_not_reach_one() {
        let mut l = ledger();
        l.record_all(&[id(1, 0), id(1, 1), id(2, 0)], Stage::Generated);
        // (2, 0)'s group carried no signal: dynamic sampling drops it after generation.
        l.drop_after(id(2, 0), Stage::Generated).unwrap();
        assert!(matches!(
            l.drop_after(id(2, 0), Stage::Generated),
            Err(LedgerError::BadDrop { .. })
        ));
        assert!(matches!(
            l.drop_after(id(1, 0), Stage::Rewarded),
            Err(LedgerError::BadDrop { .. })
        ));
        l.record_all(&[id(1, 0), id(1, 1)], Stage::Rewarded);
        l.verify_stage(Stage::Rewarded).unwrap();
        let mut bad = l.clone();
        let r = l.close().unwrap();
        assert_eq!((r.samples, r.dropped), (3, 1));
        // A dropped sample that is trained on anyway is caught.
        bad.record(id(2, 0), Stage::Rewarded);
        assert_eq!(
            bad.close().unwrap_err(),
            LedgerError::AfterDrop {
                id: id(2, 0),
                dropped_after: Stage::Generated,
                stage: Stage::Rewarded
            }
        );
    }
}
