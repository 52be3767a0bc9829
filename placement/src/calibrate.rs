//! Calibration: fit the simulator's throughput parameters from a real run's
//! `metrics.jsonl` (as `yatt train` writes it) and check the simulator against the run.
//!
//! The fit uses the run's first steps; the check replays the whole run in the
//! simulator (one group, every role colocated, on-policy: what `yatt train` does in
//! embedded mode) with the run's own batch sizes and response lengths, and compares
//! the predicted step times with the measured ones on the steps the fit did not see.
//!
//! Parsing takes text, not a path: reading the file is the caller's business.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::cost::Stage;
use crate::profile::{DecodeCoeffs, Efficiency, GpuSpec, JobShape, ModelSpec, RewardKind};
use crate::sim::{Sim, World};
use crate::workload::{LengthDist, WorkloadSpec};

/// Why calibration failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum CalibrateError {
    /// A line is not a JSON object.
    #[error("metrics line {line}: not a JSON object ({reason}); expected one object per step as `yatt train` writes")]
    Json {
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        reason: String,
    },
    /// A key the fit needs is missing.
    #[error("metrics line {line}: no `{key}`; calibration needs the stage timings and token counts of `yatt train` metrics")]
    Missing {
        /// 1-based line number.
        line: usize,
        /// The key.
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
    /// Seconds per stage, by metric name (`gen`, `ref`, `old_log_prob`, ...).
    pub timing: BTreeMap<String, f64>,
    /// Wall seconds of the step.
    pub step_s: f64,
    /// Mean response length, tokens.
    pub response_len: f64,
    /// Mean prompt length, tokens.
    pub prompt_len: f64,
    /// Prompt + response tokens of the samples trained on.
    pub tokens: f64,
}

impl RunStep {
    /// Samples trained on.
    pub fn samples(&self) -> f64 {
        (self.tokens / (self.response_len + self.prompt_len).max(1.0)).round()
    }

    fn t(&self, key: &str) -> f64 {
        self.timing.get(key).copied().unwrap_or(0.0)
    }
}

/// Parses `metrics.jsonl` text. Blank lines are skipped.
pub fn parse_metrics(text: &str) -> Result<Vec<RunStep>, CalibrateError> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line_no = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| CalibrateError::Json {
                line: line_no,
                reason: e.to_string(),
            })?;
        let obj = v.as_object().ok_or(CalibrateError::Json {
            line: line_no,
            reason: "not an object".into(),
        })?;
        let get = |key: &'static str| {
            obj.get(key)
                .and_then(serde_json::Value::as_f64)
                .ok_or(CalibrateError::Missing { line: line_no, key })
        };
        let mut timing = BTreeMap::new();
        for (k, v) in obj {
            if let (Some(name), Some(x)) = (k.strip_prefix("timing_s/"), v.as_f64()) {
                timing.insert(name.to_string(), x);
            }
        }
        for key in ["timing_s/gen", "timing_s/update_actor"] {
            get(key)?;
        }
        out.push(RunStep {
            step: get("step").unwrap_or(out.len() as f64) as u64,
            step_s: get("timing_s/step")?,
            response_len: get("response_length/mean")?,
            prompt_len: get("prompt_length/mean")?,
            tokens: get("perf/total_num_tokens")?,
            timing,
        });
    }
    Ok(out)
}

/// Measured rates that replace the simulator's rooflines.
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
pub fn fit(steps: &[RunStep], iterations: f64) -> Rates {
    // Generation: seconds = a·iterations + b·tokens, by least squares on the steps
    // (tokens vary with response lengths); with no spread in tokens, all is per-token.
    let xs: Vec<f64> = steps.iter().map(|s| s.samples() * s.response_len).collect();
    let ys: Vec<f64> = steps.iter().map(|s| s.t("gen")).collect();
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
    for (stage, key) in [
        (Stage::Ref, "ref"),
        (Stage::Values, "values"),
        (Stage::OldLogProb, "old_log_prob"),
        (Stage::TrainActor, "update_actor"),
        (Stage::TrainCritic, "update_critic"),
    ] {
        if steps.iter().any(|s| s.timing.contains_key(key)) {
            s_per_token.insert(
                stage,
                median(steps.iter().map(|s| s.t(key) / s.tokens.max(1.0)).collect()),
            );
        }
    }
    let staged = [
        "gen",
        "ref",
        "values",
        "old_log_prob",
        "update_actor",
        "update_critic",
        "weight_sync",
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
        sync_s: median(steps.iter().map(|s| s.t("weight_sync")).collect()),
        overhead_s: overhead,
        switch_s: 0.0,
    }
}

/// The simulator's replay of a run against what it measured.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
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
pub fn check(steps: &[RunStep], iterations: f64) -> Result<Check, CalibrateError> {
    if steps.len() < 6 {
        return Err(CalibrateError::TooFew(steps.len()));
    }
    let body = &steps[1..];
    let fit_n = body.len() / 2;
    let rates = fit(&body[..fit_n], iterations);
    let predicted = replay(&rates, body, iterations);
    let measured: Vec<f64> = body.iter().map(|s| s.step_s).collect();
    let err = |from: usize| {
        let p: f64 = predicted[from..].iter().sum();
        let m: f64 = measured[from..].iter().sum();
        (p - m).abs() / m.max(1e-12)
    };
    Ok(Check {
        held_out_error: err(fit_n),
        overall_error: err(0),
        fit_steps: fit_n,
        predicted_s: predicted,
        measured_s: measured,
        rates,
    })
}

/// Simulates `steps` (their batch sizes and mean lengths) with `rates` on one group
/// with every role colocated and on-policy; returns each step's predicted seconds.
pub fn replay(rates: &Rates, steps: &[RunStep], iterations: f64) -> Vec<f64> {
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
        groups: 1,
        rates: Some(rates.clone()),
    };
    let plan = crate::plan::Plan {
        pools: vec![crate::plan::Pool {
            roles: world.job.gpu_roles(),
            groups: vec![crate::inventory::GroupId(0)],
        }],
        rollout_batch_cap: None,
        lanes: None,
    };
    Sim::new(&world, &plan, 0, None).run().step_s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real CPU run of `yatt train` (tests/fixtures/README.md has the command).
    const FIXTURE: &str = include_str!("../tests/fixtures/calib-metrics.jsonl");
    /// Decoding iterations per step of that run (its `rollout.max_new_tokens`).
    const FIXTURE_ITERATIONS: f64 = 24.0;

    #[test]
    fn parses_the_fixture() {
        let steps = parse_metrics(FIXTURE).unwrap();
        assert!(steps.len() >= 20);
        assert!(steps.iter().all(|s| s.step_s > 0.0 && s.tokens > 0.0));
        assert!(steps[3].timing.contains_key("gen"));
    }

    #[test]
    fn names_missing_keys_and_bad_lines() {
        let err = parse_metrics("{\"step\": 0, \"timing_s/gen\": 1}\n").unwrap_err();
        assert!(err.to_string().contains("timing_s/update_actor"), "{err}");
        let err = parse_metrics("\n[1,2]\n").unwrap_err();
        assert!(matches!(err, CalibrateError::Json { line: 2, .. }), "{err}");
        assert_eq!(check(&[], 1.0).unwrap_err(), CalibrateError::TooFew(0));
    }

    #[test]
    fn simulator_predicts_the_real_run_within_20_percent() {
        let steps = parse_metrics(FIXTURE).unwrap();
        let c = check(&steps, FIXTURE_ITERATIONS).unwrap();
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
                timing.insert("gen".into(), gen);
                timing.insert("update_actor".into(), 3e-6 * tokens);
                timing.insert("old_log_prob".into(), 1e-6 * tokens);
                timing.insert("weight_sync".into(), 0.001);
                let step_s = gen + 4e-6 * tokens + 0.001 + 0.003;
                RunStep {
                    step: u64::from(i as u32),
                    timing,
                    step_s,
                    response_len: resp,
                    prompt_len: 8.0,
                    tokens,
                }
            })
            .collect();
        let r = fit(&steps, 24.0);
        assert!((r.gen.a / 0.002 - 1.0).abs() < 1e-6, "{:?}", r.gen);
        assert!((r.gen.b / 1e-5 - 1.0).abs() < 1e-6);
        assert!((r.s_per_token[&Stage::TrainActor] / 3e-6 - 1.0).abs() < 1e-9);
        assert!((r.overhead_s - 0.003).abs() < 1e-9);
        let c = check(&steps, 24.0).unwrap();
        assert!(c.held_out_error < 0.05, "{c:?}");
    }
}
