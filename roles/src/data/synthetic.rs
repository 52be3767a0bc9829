//! Deterministic synthetic tasks for tests and placement experiments: addition,
//! sorting and reversal, with a [`LengthSchedule`] so the difficulty (and with it the
//! response length) can grow over training.
//!
//! Everything is a pure function of `(seed, step, index)`: the same task gives the same
//! prompts, references and ids on every machine and run.

use serde::{Deserialize, Serialize};
use serde_json::json;

use crate::data::prompt::{fnv1a, DataError, Prompt, SplitMix64};

/// Which task.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SyntheticTaskKind {
    /// "What is 23 + 58? Answer with just the number." → "81". Length = digits per operand.
    Addition,
    /// "What is 123 * 456? Answer with just the number." → "56088". Length = digits per
    /// operand (a small model gets three digits almost always wrong alone; with a
    /// calculator tool it need not).
    Multiplication,
    /// Sort a list of numbers in `0..=max_value` ascending → "3, 5, 9". Length = list length.
    Sorting {
        /// Largest number that may appear.
        max_value: u64,
    },
    /// Reverse a space-separated sequence of letters → "d c b a". Length = letters.
    Reversal,
}

impl SyntheticTaskKind {
    fn name(&self) -> &'static str {
        match self {
            Self::Addition => "addition",
            Self::Multiplication => "multiplication",
            Self::Sorting { .. } => "sorting",
            Self::Reversal => "reversal",
        }
    }
}

/// The task length (digits, list length, sequence length) as a function of the
/// training step (or epoch — the caller decides what `step` counts).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LengthSchedule {
    /// Always the same length.
    Constant(usize),
    /// Linear from `start` at step 0 to `end` at step `steps`, constant afterwards
    /// (rounded down).
    Linear {
        /// Length at step 0.
        start: usize,
        /// Length from step `steps` on.
        end: usize,
        /// Steps of the ramp.
        steps: u64,
    },
    /// `start`, increased by `increment` every `every` steps, capped at `max`.
    Staircase {
        /// Length at step 0.
        start: usize,
        /// Added at each stair.
        increment: usize,
        /// Steps per stair (> 0).
        every: u64,
        /// Cap.
        max: usize,
    },
}

impl LengthSchedule {
    /// The length at `step`.
    pub fn at(&self, step: u64) -> usize {
        match *self {
            Self::Constant(n) => n,
            Self::Linear { start, end, steps } => {
                if steps == 0 || step >= steps {
                    return end;
                }
                let frac = step as f64 / steps as f64;
                (start as f64 + (end as f64 - start as f64) * frac).floor() as usize
            }
            Self::Staircase {
                start,
                increment,
                every,
                max,
            } => {
                let stairs = step.checked_div(every).unwrap_or(0);
                let grown = start as u64 + stairs.saturating_mul(increment as u64);
                grown.min(max as u64) as usize
            }
        }
    }

    /// (smallest, largest) length over all steps.
    fn bounds(&self) -> (usize, usize) {
        match *self {
            Self::Constant(n) => (n, n),
            Self::Linear { start, end, .. } => (start.min(end), start.max(end)),
            Self::Staircase { start, max, .. } => (start.min(max), start.max(max)),
        }
    }
}

/// A synthetic task: kind, length schedule and seed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SyntheticTask {
    /// Which task.
    pub kind: SyntheticTaskKind,
    /// Length as a function of the step.
    pub schedule: LengthSchedule,
    /// Seed of the whole task.
    pub seed: u64,
}

/// Largest addition operand size: two 18-digit numbers still add up inside `u64`.
pub const MAX_ADDITION_DIGITS: usize = 18;

impl SyntheticTask {
    /// Validates the schedule for the task (lengths ≥ 1; addition ≤ 18 digits;
    /// staircase `every > 0`).
    pub fn new(
        kind: SyntheticTaskKind,
        schedule: LengthSchedule,
        seed: u64,
    ) -> Result<Self, DataError> {
        let (lo, hi) = schedule.bounds();
        if lo == 0 {
            return Err(DataError::Config(format!(
                "{} task: schedule {schedule:?} reaches length 0; lengths must be >= 1",
                kind.name()
            )));
        }
        if let LengthSchedule::Staircase { every: 0, .. } = schedule {
            return Err(DataError::Config(
                "staircase schedule: `every` must be > 0 steps".into(),
            ));
        }
        if kind == SyntheticTaskKind::Multiplication && hi > MAX_ADDITION_DIGITS / 2 {
            return Err(DataError::Config(format!(
                "multiplication task: {hi} digits requested; at most {} digits per operand are supported",
                MAX_ADDITION_DIGITS / 2
            )));
        }
        if kind == SyntheticTaskKind::Addition && hi > MAX_ADDITION_DIGITS {
            return Err(DataError::Config(format!(
                "addition task: {hi} digits requested; at most {MAX_ADDITION_DIGITS} digits per operand are supported"
            )));
        }
        if let SyntheticTaskKind::Sorting {
            max_value: u64::MAX,
        } = kind
        {
            return Err(DataError::Config(
                "sorting task: max_value must be < u64::MAX".into(),
            ));
        }
        Ok(Self {
            kind,
            schedule,
            seed,
        })
    }

    /// The task length at `step`.
    pub fn length_at(&self, step: u64) -> usize {
        self.schedule.at(step)
    }

    /// Prompt number `index` of step `step` (a pure function of seed, step, index).
    pub fn prompt(&self, step: u64, index: u64) -> Prompt {
        let name = self.kind.name();
        let id = fnv1a(&[
            b"synthetic",
            name.as_bytes(),
            &self.seed.to_le_bytes(),
            &step.to_le_bytes(),
            &index.to_le_bytes(),
        ]);
        let mut rng = SplitMix64::new(id);
        let len = self.length_at(step);
        let (text, reference) = match self.kind {
            SyntheticTaskKind::Addition | SyntheticTaskKind::Multiplication => {
                let (lo, hi) = if len == 1 {
                    (0, 9)
                } else {
                    (10u64.pow(len as u32 - 1), 10u64.pow(len as u32) - 1)
                };
                let (a, b) = (rng.range(lo, hi), rng.range(lo, hi));
                let (op, value) = match self.kind {
                    SyntheticTaskKind::Addition => ('+', a + b),
                    _ => ('*', a * b),
                };
                (
                    format!("What is {a} {op} {b}? Answer with just the number."),
                    value.to_string(),
                )
            }
            SyntheticTaskKind::Sorting { max_value } => {
                let mut xs: Vec<u64> = (0..len).map(|_| rng.range(0, max_value)).collect();
                let shown = join(&xs, ", ");
                xs.sort_unstable();
                (
                    format!("Sort these numbers in ascending order: {shown}. Answer with just the sorted numbers, separated by commas."),
                    join(&xs, ", "),
                )
            }
            SyntheticTaskKind::Reversal => {
                let xs: Vec<char> = (0..len)
                    .map(|_| (b'a' + rng.below(26) as u8) as char)
                    .collect();
                let shown = join(&xs, " ");
                let rev: Vec<char> = xs.iter().rev().copied().collect();
                (
                    format!("Reverse this sequence: {shown}. Answer with just the reversed sequence, separated by spaces."),
                    join(&rev, " "),
                )
            }
        };
        Prompt {
            id,
            text,
            messages: Vec::new(),
            reference: Some(reference),
            metadata: json!({"task": name, "length": len, "step": step, "index": index, "seed": self.seed}),
        }
    }

    /// Prompts `0..n` of step `step`.
    pub fn prompts(&self, step: u64, n: usize) -> Vec<Prompt> {
        (0..n as u64).map(|i| self.prompt(step, i)).collect()
    }
}

fn join<T: std::fmt::Display>(xs: &[T], sep: &str) -> String {
    xs.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(sep)
}

/// A task whose target response length grows with the training step: any response
/// counts, only its length matters. It makes generation take a growing share of a
/// step, which is what the live placement actor must react to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct GrowingLength {
    /// Target response length (tokens) by step.
    pub target: LengthSchedule,
}

impl GrowingLength {
    /// `n` prompts `n{i}:`, ids from 2000 (deterministic; the text carries no target:
    /// the reward knows the step).
    pub fn prompts(&self, n: usize) -> Vec<Prompt> {
        (0..n as u64)
            .map(|i| Prompt {
                id: 2000 + i,
                text: format!("n{i}:"),
                messages: Vec::new(),
                reference: None,
                metadata: json!({ "task": "growing" }),
            })
            .collect()
    }

    /// The target length at `step`.
    pub fn target_at(&self, step: u64) -> usize {
        self.target.at(step).max(1)
    }

    /// Reward of a response of `len` tokens at `step`: 1 at the target, falling
    /// linearly to 0 at no tokens and at twice the target. Overshooting is not paid,
    /// so a random model (whose responses run long) first learns to stop early and
    /// then follows the target as it grows.
    pub fn score(&self, step: u64, len: usize) -> f64 {
        let t = self.target_at(step) as f64;
        (1.0 - (len as f64 - t).abs() / t).max(0.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addition_is_deterministic_and_correct() {
        let t = SyntheticTask::new(SyntheticTaskKind::Addition, LengthSchedule::Constant(2), 7)
            .unwrap();
        let a = t.prompts(0, 50);
        assert_eq!(a, t.prompts(0, 50));
        for p in &a {
            // "What is 23 + 58? Answer with just the number."
            let rest = p.text.strip_prefix("What is ").unwrap();
            let (x, rest) = rest.split_once(" + ").unwrap();
            let (y, _) = rest.split_once('?').unwrap();
            let (x, y): (u64, u64) = (x.parse().unwrap(), y.parse().unwrap());
            assert!(
                (10..100).contains(&x) && (10..100).contains(&y),
                "{}",
                p.text
            );
            assert_eq!(p.reference.as_deref(), Some((x + y).to_string().as_str()));
            assert_eq!(p.metadata["task"], "addition");
        }
        let ids: std::collections::HashSet<u64> = a.iter().map(|p| p.id).collect();
        assert_eq!(ids.len(), 50);
        let other = SyntheticTask::new(SyntheticTaskKind::Addition, LengthSchedule::Constant(2), 8)
            .unwrap();
        assert_ne!(other.prompts(0, 50), a);
    }

    #[test]
    fn sorting_and_reversal() {
        let s = SyntheticTask::new(
            SyntheticTaskKind::Sorting { max_value: 9 },
            LengthSchedule::Constant(5),
            1,
        )
        .unwrap();
        let p = s.prompt(0, 0);
        let shown = p
            .text
            .split_once(": ")
            .unwrap()
            .1
            .split_once('.')
            .unwrap()
            .0;
        let mut xs: Vec<u64> = shown.split(", ").map(|x| x.parse().unwrap()).collect();
        assert_eq!(xs.len(), 5);
        xs.sort_unstable();
        let want = xs
            .iter()
            .map(|x| x.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        assert_eq!(p.reference.as_deref(), Some(want.as_str()));

        let r = SyntheticTask::new(SyntheticTaskKind::Reversal, LengthSchedule::Constant(4), 1)
            .unwrap();
        let p = r.prompt(3, 9);
        let shown = p
            .text
            .split_once(": ")
            .unwrap()
            .1
            .split_once('.')
            .unwrap()
            .0;
        let rev: Vec<&str> = shown.split(' ').rev().collect();
        assert_eq!(rev.len(), 4);
        assert_eq!(p.reference.as_deref(), Some(rev.join(" ").as_str()));
    }

    #[test]
    fn length_schedules_grow() {
        let lin = LengthSchedule::Linear {
            start: 2,
            end: 10,
            steps: 8,
        };
        assert_eq!([0, 1, 4, 8, 100].map(|s| lin.at(s)), [2, 3, 6, 10, 10]);
        let st = LengthSchedule::Staircase {
            start: 3,
            increment: 2,
            every: 10,
            max: 8,
        };
        assert_eq!([0, 9, 10, 25, 1000].map(|s| st.at(s)), [3, 3, 5, 7, 8]);
        let r = SyntheticTask::new(SyntheticTaskKind::Reversal, lin, 0).unwrap();
        assert_eq!(r.prompt(0, 0).reference.unwrap().split(' ').count(), 2);
        assert_eq!(r.prompt(8, 0).reference.unwrap().split(' ').count(), 10);
        assert_eq!(r.prompt(8, 0).metadata["length"], 10);
    }

    #[test]
    fn rejects_bad_configs() {
        assert!(
            SyntheticTask::new(SyntheticTaskKind::Reversal, LengthSchedule::Constant(0), 0)
                .is_err()
        );
        let e = SyntheticTask::new(SyntheticTaskKind::Addition, LengthSchedule::Constant(19), 0)
            .unwrap_err();
        assert!(e.to_string().contains("18"), "{e}");
        let st = LengthSchedule::Staircase {
            start: 1,
            increment: 1,
            every: 0,
            max: 3,
        };
        assert!(SyntheticTask::new(SyntheticTaskKind::Reversal, st, 0).is_err());
    }

    #[test]
    fn growing_length_pays_for_reaching_a_growing_target() {
        let t = GrowingLength {
            target: LengthSchedule::Linear {
                start: 4,
                end: 20,
                steps: 8,
            },
        };
        assert_eq!(t.target_at(0), 4);
        assert_eq!(t.target_at(8), 20);
        assert_eq!(t.score(0, 2), 0.5);
        assert_eq!(t.score(0, 4), 1.0);
        assert_eq!(t.score(0, 6), 0.5);
        assert_eq!(t.score(0, 9), 0.0);
        assert_eq!(t.score(8, 10), 0.5);
        let p = t.prompts(3);
        assert_eq!(p[2].id, 2002);
        assert_eq!(p, t.prompts(3));
    }
}
