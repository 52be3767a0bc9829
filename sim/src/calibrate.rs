//! Calibration: fit the simulator's throughput parameters from a real run's
//! `metrics.jsonl` (as `yatt train` writes it, read with [`yatt_metrics::read_jsonl`])
//! and check the simulator against the run.
//!
//! The fit uses the run's first steps; the check replays the whole run in the
//! simulator (one group, every role colocated, on-policy: what `yatt train` does in
//! embedded mode) with the run's own batch sizes and response lengths, and compares
//! the predicted step times with the measured ones on the steps the fit did not see.
//!
//! It takes records, not a path: reading the file is the caller's business.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use yatt_metrics::{names, StepRecord};
use yatt_placement::{
    DecodeCoeffs, Efficiency, GpuSpec, GroupId, JobShape, LengthDist, ModelSpec, Plan, Pool, Rates,
    RewardKind, Role, RoleSet, Sim, Stage, WorkloadSpec, World,
};

/// Why calibration failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrateError {
    /// A key the fit needs is missing.
    #[error("metrics step {step}: no `{key}`; calibration needs the stage timings and token counts `yatt train` writes (fix: calibrate on a run's own metrics.jsonl)")]
    Missing {
        /// The step that lacks it.
        step: u64,
        /// The metric.
        key: &'static str,
    },
    /// Too few steps to fit and check.
    #[error("{0} step(s) of metrics; calibration needs at least 6 (it fits on the first half after the warm-up step and checks on the rest)")]
    TooFew(usize),
}

/// One step of a real run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStep {
    /// The step.
    pub step: u64,
    /// Seconds per stage, by metric name ([`names::GEN_S`], [`names::REF_S`], ...).
    pub timing: BTreeMap<String, f64>,
    /// Wall seconds of the step.
    pub step_s: f64,
    /// Mean response length, tokens.
    pub response_len: f64,
    /// Mean prompt length, tokens.
    pub prompt_len: f64,
    /// Prompt + response tokens of the samples trained on.
    pub tokens: f64,
    /// The lag of the step's samples behind the weights they trained
    /// (`async/staleness_max`; 0 for an on-policy run).
    #[serde(default)]
    pub staleness: u32,
}

impl RunStep {
    /// Samples trained on.
    pub fn samples(&self) -> f64 {
        (self.tokens / (self.response_len + self.prompt_len).max(1.0)).round()
    }

    fn t(&self, key: &str) -> f64 {
        self.timing.get(key).copied().unwrap_or(0.0)
    }

    /// The step's timings and sizes from its metrics. A null in the file (read back as
    /// NaN) counts as missing.
    pub fn from_record(r: &StepRecord) -> Result<RunStep, CalibrateError> {
        let value = |key: &str| r.get(key).filter(|v| !v.is_nan());
        let get =
            |key: &'static str| value(key).ok_or(CalibrateError::Missing { step: r.step, key });
        for key in [names::GEN_S, names::UPDATE_ACTOR_S] {
            get(key)?;
        }
        let timing = r
            .values
            .iter()
            .filter(|(k, v)| k.starts_with(names::TIMING_PREFIX) && !v.is_nan())
            .map(|(k, v)| (k.clone(), *v))
            .collect();
        Ok(RunStep {
            step: r.step,
            step_s: get(names::STEP_S)?,
            response_len: get(names::RESPONSE_LENGTH_MEAN)?,
            prompt_len: get(names::PROMPT_LENGTH_MEAN)?,
            tokens: get(names::TOTAL_NUM_TOKENS)?,
            staleness: value(names::STALENESS_MAX).map_or(0, |v| v.max(0.0).round() as u32),
            timing,
        })
    }
}

/// A run's steps from its metrics records (as [`yatt_metrics::read_jsonl`] returns them).
pub fn run_steps(records: &[StepRecord]) -> Result<Vec<RunStep>, CalibrateError> {
    records.iter().map(RunStep::from_record).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Fits rates from `steps`, whose generation ran `iterations` decoding iterations per
/// step (the longest response: `rollout.max_new_tokens` when some response reaches
/// it). Each rate is a median over the steps, so a step disturbed by other load on
/// the machine does not drag it.
pub fn fit_rates(steps: &[RunStep], iterations: f64) -> Rates {
    // Generation: seconds = a·iterations + b·tokens, by least squares on the steps
    // (tokens vary with response lengths); with no spread in tokens, all is per-token.
    let xs: Vec<f64> = steps.iter().map(|s| s.samples() * s.response_len).collect();
    let ys: Vec<f64> = steps.iter().map(|s| s.t(names::GEN_S)).collect();
    let n = xs.len() as f64;
    let mx = xs.iter().sum::<f64>() / n;
    let my = ys.iter().sum::<f64>() / n;
    let sxx: f64 = xs.iter().map(|x| (x - mx) * (x - mx)).sum();
    let sxy: f64 = xs.iter().zip(&ys).map(|(x, y)| (x - mx) * (y - my)).sum();
    let (a, b) = if sxx > 1e-9 * mx * mx * n && sxy > 0.0 {
        let b = sxy / sxx;
        let intercept = my - b * mx;
        if intercept > 0.0 {
            (intercept / iterations.max(1.0), b)
        } else {
            (
                0.0,
                median(xs.iter().zip(&ys).map(|(x, y)| y / x.max(1.0)).collect()),
            )
        }
    } else {
        (
            0.0,
            median(xs.iter().zip(&ys).map(|(x, y)| y / x.max(1.0)).collect()),
        )
    };
    let mut s_per_token = BTreeMap::new();
    for stage in [
        Stage::Ref,
        Stage::Values,
        Stage::OldLogProb,
        Stage::TrainActor,
        Stage::TrainCritic,
    ] {
        let key = stage.timing_metric();
        if steps.iter().any(|s| s.timing.contains_key(key)) {
            s_per_token.insert(
                stage,
                median(steps.iter().map(|s| s.t(key) / s.tokens.max(1.0)).collect()),
            );
        }
    }
    let staged = [
        names::GEN_S,
        names::REF_S,
        names::VALUES_S,
        names::OLD_LOG_PROB_S,
        names::UPDATE_ACTOR_S,
        names::UPDATE_CRITIC_S,
        names::WEIGHT_SYNC_S,
    ];
    let overhead = median(
        steps
            .iter()
            .map(|s| (s.step_s - staged.iter().map(|k| s.t(k)).sum::<f64>()).max(0.0))
            .collect(),
    );
    Rates {
        gen: DecodeCoeffs {
            a,
            b,
            c: 0.0,
            prefill: 0.0,
        },
        judge: None,
        slots: steps.iter().map(|s| s.samples() as u32).max().unwrap_or(1),
        s_per_token,
        sync_s: median(steps.iter().map(|s| s.t(names::WEIGHT_SYNC_S)).collect()),
        overhead_s: overhead,
        switch_s: 0.0,
    }
}

/// The simulator's replay of a run against what it measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Calibration {
    /// The rates fitted.
    pub rates: Rates,
    /// Steps used for the fit (after the warm-up step).
    pub fit_steps: usize,
    /// Predicted seconds of each step (from the second on).
    pub predicted_s: Vec<f64>,
    /// Measured seconds of the same steps.
    pub measured_s: Vec<f64>,
    /// Relative error of the mean step time on the held-out steps.
    pub held_out_error: f64,
    /// Relative error of the mean step time on all steps after the warm-up.
    pub overall_error: f64,
}

/// Fits on the first half of `steps` (skipping the first, which pays for warm-up),
/// replays every step after the first in the simulator, and compares.
pub fn check_calibration(
    steps: &[RunStep],
    iterations: f64,
) -> Result<Calibration, CalibrateError> {
    if steps.len() < 6 {
        return Err(CalibrateError::TooFew(steps.len()));
    }
    let body = &steps[1..];
    let fit_n = body.len() / 2;
    let rates = fit_rates(&body[..fit_n], iterations);
    let predicted = replay_run(&rates, body, iterations, run_staleness(steps));
    let measured: Vec<f64> = body.iter().map(|s| s.step_s).collect();
    let err = |from: usize| {
        let p: f64 = predicted[from..].iter().sum();
        let m: f64 = measured[from..].iter().sum();
        (p - m).abs() / m.max(1e-12)
    };
    Ok(Calibration {
        held_out_error: err(fit_n),
        overall_error: err(0),
        fit_steps: fit_n,
        predicted_s: predicted,
        measured_s: measured,
        rates,
    })
}

/// The run's staleness bound as its metrics show it: the largest lag of any step.
pub fn run_staleness(steps: &[RunStep]) -> u32 {
    steps.iter().map(|s| s.staleness).max().unwrap_or(0)
}

/// Simulates `steps` (their batch sizes and mean lengths) with `rates`; returns each
/// step's predicted seconds. On-policy (`staleness` 0): one group with every role
/// colocated, as `yatt train` runs embedded. Asynchronous (`staleness` ≥ 1): the
/// rollout on a group of its own and the other roles on another, pipelined with that
/// bound, as the embedded trainer overlaps generation with the update.
pub fn replay_run(rates: &Rates, steps: &[RunStep], iterations: f64, staleness: u32) -> Vec<f64> {
    let samples = steps.iter().map(|s| s.samples()).fold(1.0, f64::max) as u32;
    let prompt = steps.iter().map(|s| s.prompt_len).sum::<f64>() / steps.len().max(1) as f64;
    let max_len = iterations.max(1.0).round() as u32;
    // Lengths vary a little around each step's mean (a mild lognormal); the scale of
    // each step carries the measured mean.
    let sigma: f64 = 0.2;
    let median = (-sigma * sigma / 2.0).exp();
    let tiny = ModelSpec {
        name: "calibrated".into(),
        params: 1.0,
        layers: 1,
        kv_heads: 1,
        head_dim: 1,
    };
    let mut job = JobShape {
        policy: tiny,
        reward: RewardKind::Rule,
        critic: None,
        reference: rates.s_per_token.contains_key(&Stage::Ref),
        train_epochs: 1,
        max_response: max_len,
        prompt_len: prompt.round().max(1.0) as u32,
    };
    if rates.s_per_token.contains_key(&Stage::Values) {
        job.critic = Some(job.policy.clone());
    }
    let world = World {
        gpu: GpuSpec::preset("h100").expect("preset"),
        truth: Efficiency::default(),
        workload: WorkloadSpec {
            steps: steps.len() as u32,
            prompts_per_step: 1,
            samples_per_prompt: samples,
            prompt_len: job.prompt_len,
            response: LengthDist::Lognormal { median, sigma },
            max_response: max_len,
            growth: 1.0,
            group_correlation: 0.0,
            dynamic_sampling: None,
            judge: None,
            judge_max: 1,
            judge_prompt: 0,
            seed: 1,
            scale_by_step: steps.iter().map(|s| s.response_len.max(1.0)).collect(),
            partial_rollout: None,
        },
        job,
        group_devices: 1,
        groups: if staleness == 0 { 1 } else { 2 },
        rates: Some(rates.clone()),
    };
    let all = world.job.gpu_roles();
    let pools = match staleness {
        0 => vec![Pool {
            roles: all,
            groups: vec![GroupId(0)],
        }],
        _ => {
            let trainer_roles = all
                .iter()
                .filter(|r| *r != Role::Rollout)
                .collect::<Vec<_>>();
            vec![
                Pool {
                    roles: RoleSet::of(&[Role::Rollout]),
                    groups: vec![GroupId(0)],
                },
                Pool {
                    roles: RoleSet::of(&trainer_roles),
                    groups: vec![GroupId(1)],
                },
            ]
        }
    };
    let plan = Plan {
        pools,
        rollout_batch_cap: None,
        lanes: None,
    };
    Sim::new(&world, &plan, staleness).run().step_s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real CPU run of `yatt train` (tests/fixtures/README.md has the command).
    fn fixture() -> Vec<RunStep> {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/calib-metrics.jsonl");
        run_steps(&yatt_metrics::read_jsonl(&path).unwrap()).unwrap()
    }
    /// Decoding iterations per step of that run (its `rollout.max_new_tokens`).
    const FIXTURE_ITERATIONS: f64 = 24.0;

    #[test]
    fn reads_the_fixture() {
        let steps = fixture();
        assert!(steps.len() >= 20);
        assert!(steps.iter().all(|s| s.step_s > 0.0 && s.tokens > 0.0));
        assert!(steps[3].timing.contains_key(names::GEN_S));
    }

    #[test]
    fn names_missing_keys() {
        let record = |pairs: &[(&str, f64)]| StepRecord {
            step: 4,
            values: pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        };
        let err = run_steps(&[record(&[(names::GEN_S, 1.0)])]).unwrap_err();
        assert!(
            err.to_string()
                .contains("step 4: no `timing_s/update_actor`"),
            "{err}"
        );
        // A null in the file is no value.
        let err = RunStep::from_record(&record(&[
            (names::GEN_S, 1.0),
            (names::UPDATE_ACTOR_S, f64::NAN),
        ]))
        .unwrap_err();
        assert!(err.to_string().contains("timing_s/update_actor"), "{err}");
        assert_eq!(
            check_calibration(&[], 1.0).unwrap_err(),
            CalibrateError::TooFew(0)
        );
    }

    #[test]
    fn simulator_predicts_the_real_run_within_20_percent() {
        let steps = fixture();
        let c = check_calibration(&steps, FIXTURE_ITERATIONS).unwrap();
        assert!(
            c.held_out_error < 0.20,
            "held-out error {:.1}% (predicted {:?}, measured {:?})",
            c.held_out_error * 100.0,
            c.predicted_s,
            c.measured_s
        );
        assert_eq!(c.predicted_s.len(), steps.len() - 1);
    }

    #[test]
    fn fit_recovers_synthetic_rates() {
        // Steps made from known rates: gen = 0.002·24 + 1e-5·tokens, train 3e-6/token.
        let steps: Vec<RunStep> = (0..10)
            .map(|i| {
                let resp = 10.0 + f64::from(i);
                let tokens = 64.0 * (resp + 8.0);
                let gen = 0.002 * 24.0 + 1e-5 * 64.0 * resp;
                let mut timing = BTreeMap::new();
                timing.insert(names::GEN_S.into(), gen);
                timing.insert(names::UPDATE_ACTOR_S.into(), 3e-6 * tokens);
                timing.insert(names::OLD_LOG_PROB_S.into(), 1e-6 * tokens);
                timing.insert(names::WEIGHT_SYNC_S.into(), 0.001);
                let step_s = gen + 4e-6 * tokens + 0.001 + 0.003;
                RunStep {
                    step: u64::from(i as u32),
                    timing,
                    step_s,
                    response_len: resp,
                    prompt_len: 8.0,
                    tokens,
                    staleness: 0,
                }
            })
            .collect();
        let r = fit_rates(&steps, 24.0);
        assert!((r.gen.a / 0.002 - 1.0).abs() < 1e-6, "{:?}", r.gen);
        assert!((r.gen.b / 1e-5 - 1.0).abs() < 1e-6);
        assert!((r.s_per_token[&Stage::TrainActor] / 3e-6 - 1.0).abs() < 1e-9);
        assert!((r.overhead_s - 0.003).abs() < 1e-9);
        let c = check_calibration(&steps, 24.0).unwrap();
        assert!(c.held_out_error < 0.05, "{c:?}");
    }
}
