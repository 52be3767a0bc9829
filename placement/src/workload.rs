//! Workloads: how long responses are, how that changes over training, how many
//! prompt groups dynamic sampling throws away, and what the cost model believes about
//! all of it ([`Forecast`]).
//!
//! Everything random comes from counter-based streams keyed by (seed, step, group), so
//! every strategy the simulator compares sees exactly the same prompts in the same
//! order, whatever order it asks for them in.

use serde::{Deserialize, Serialize};

/// A small deterministic generator (SplitMix64): fast, seedable per stream, and good
/// enough for workload sampling.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A stream for `(seed, a, b)`; distinct keys give independent-looking streams.
    pub fn stream(seed: u64, a: u64, b: u64) -> Rng {
        let mut r = Rng(seed ^ 0x9e37_79b9_7f4a_7c15);
        let x = r.next_u64() ^ a.wrapping_mul(0xbf58_476d_1ce4_e5b9);
        let mut r = Rng(x);
        let y = r.next_u64() ^ b.wrapping_mul(0x94d0_49bb_1331_11eb);
        Rng(y)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in (0, 1), never exactly 0 or 1.
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u = self.uniform();
        let v = self.uniform();
        (-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()
    }
}

/// The standard normal CDF (Abramowitz–Stegun 7.1.26 erfc, error below 2e-7).
pub fn normal_cdf(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.327_591_1 * z);
    let poly = t
        * (0.254_829_592
            + t * (-0.284_496_736
                + t * (1.421_413_741 + t * (-1.453_152_027 + t * 1.061_405_429))));
    let erfc = poly * (-z * z).exp();
    if x >= 0.0 {
        1.0 - 0.5 * erfc
    } else {
        0.5 * erfc
    }
}

/// The standard normal quantile, by bisection on [`normal_cdf`] (used off the hot path).
pub fn normal_quantile(p: f64) -> f64 {
    let p = p.clamp(1e-12, 1.0 - 1e-12);
    let (mut lo, mut hi) = (-9.0, 9.0);
    for _ in 0..64 {
        let mid = 0.5 * (lo + hi);
        if normal_cdf(mid) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// A distribution of response (or judge output) lengths, before truncation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "dist", rename_all = "lowercase", deny_unknown_fields)]
pub enum LengthDist {
    /// Lognormal: `ln L ~ N(ln median, sigma²)`.
    Lognormal {
        /// Median length, tokens.
        median: f64,
        /// Standard deviation of `ln L`.
        sigma: f64,
    },
    /// Pareto: `P(L > x) = (scale / x)^alpha` for `x ≥ scale`.
    Pareto {
        /// Smallest length, tokens.
        scale: f64,
        /// Tail index; smaller is heavier (below 2 the variance is infinite).
        alpha: f64,
    },
}

impl LengthDist {
    /// The length at normal score `z` (a Gaussian copula, so lengths of one prompt's
    /// samples can be correlated for either family), scaled by `scale`.
    pub fn at(&self, z: f64, scale: f64) -> f64 {
        match *self {
            LengthDist::Lognormal { median, sigma } => scale * median * (sigma * z).exp(),
            LengthDist::Pareto { scale: xm, alpha } => {
                let u = normal_cdf(z);
                scale * xm * (1.0 - u).max(1e-300).powf(-1.0 / alpha)
            }
        }
    }

    /// Mean and standard deviation of `ln L` (a lognormal's parameters), used to turn
    /// either family into the forecast's lognormal.
    pub fn log_moments(&self) -> (f64, f64) {
        match *self {
            LengthDist::Lognormal { median, sigma } => (median.ln(), sigma),
            // ln L = ln scale + Exp(alpha).
            LengthDist::Pareto { scale, alpha } => (scale.ln() + 1.0 / alpha, 1.0 / alpha),
        }
    }

    fn check(&self, what: &str) -> Result<(), String> {
        match *self {
            LengthDist::Lognormal { median, sigma } if median >= 1.0 && sigma >= 0.0 => Ok(()),
            LengthDist::Pareto { scale, alpha } if scale >= 1.0 && alpha > 0.0 => Ok(()),
            _ => Err(format!(
                "{what}: expected lognormal with median ≥ 1 and sigma ≥ 0, or pareto with scale ≥ 1 and alpha > 0, found {self:?}"
            )),
        }
    }
}

/// DAPO's dynamic sampling: prompt groups whose samples all got the same reward carry
/// no signal and are dropped; the step draws more prompts until the batch is full.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DynamicSampling {
    /// Fraction of groups dropped at the first step.
    pub drop_start: f64,
    /// Fraction dropped at the last step (models get better, more groups are all
    /// correct); the fraction moves linearly in between.
    pub drop_end: f64,
}

/// How a paused response continues when it is carried into a later step.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Resume {
    /// Its KV cache is kept: in a decoding pool of its own it never stops; on groups
    /// that hand their memory to other roles (colocation) the cache is copied to host
    /// memory and back over PCIe.
    #[default]
    Kv,
    /// Its KV cache is dropped: prompt and the tokens so far are prefilled again with
    /// the new weights when it resumes, in every pool.
    Reprefill,
}

/// What happens to an unfinished response that would train beyond the staleness bound
/// if it were carried (its generation started more than `staleness` versions before
/// the weights it would train).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BeyondBound {
    /// Never carry it: the step waits for its prompt group, as without partial
    /// rollouts.
    #[default]
    Wait,
    /// Carry the rest and generate its prompt group again from the start with newer
    /// weights; the tokens generated so far are thrown away (reported as wasted).
    Regenerate,
}

/// Partial rollouts, as in Kimi k1.5 and AReaL: a step trains on the prompt groups
/// complete at its cutoff, and the unfinished ones are paused and carried into the
/// next steps instead of holding the step back.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartialRollout {
    /// The cutoff: the fraction of a step's batch (prompt groups, counting groups
    /// carried from earlier steps) that must be complete before the step may train
    /// without the rest. 1 keeps every group in its own step.
    #[serde(default = "default_cutoff")]
    pub cutoff: f64,
    /// Versions of the staleness bound kept for carrying: a pipelined placement starts
    /// a step's generation `staleness − reserve` versions ahead instead of
    /// `staleness`. With 0 it runs as far ahead as without partial rollouts, and a
    /// response is carried only when it started late enough to stay within the bound.
    #[serde(default)]
    pub reserve: u32,
    /// How a carried response continues.
    #[serde(default)]
    pub resume: Resume,
    /// Responses that would train beyond the staleness bound if carried.
    #[serde(default)]
    pub beyond_bound: BeyondBound,
}

fn default_cutoff() -> f64 {
    0.9
}

impl Default for PartialRollout {
    fn default() -> Self {
        PartialRollout {
            cutoff: default_cutoff(),
            reserve: 0,
            resume: Resume::default(),
            beyond_bound: BeyondBound::default(),
        }
    }
}

/// A training run's workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadSpec {
    /// Training steps.
    pub steps: u32,
    /// Prompt groups kept per step (the train batch, in prompts).
    pub prompts_per_step: u32,
    /// Samples per prompt (the group size of GRPO and friends).
    pub samples_per_prompt: u32,
    /// Mean prompt length, tokens.
    pub prompt_len: u32,
    /// Response lengths at the first step.
    pub response: LengthDist,
    /// Longest response; longer ones are truncated here.
    pub max_response: u32,
    /// How much longer responses are at the last step than at the first (lengths scale
    /// geometrically in between); 1 for no growth.
    #[serde(default = "one")]
    pub growth: f64,
    /// Correlation of the (normal scores of) lengths within a prompt group: hard
    /// prompts get long answers.
    #[serde(default)]
    pub group_correlation: f64,
    /// Dynamic sampling; none keeps every group.
    #[serde(default)]
    pub dynamic_sampling: Option<DynamicSampling>,
    /// Generative judge output lengths (with a generative reward model).
    #[serde(default)]
    pub judge: Option<LengthDist>,
    /// Longest judge output, tokens.
    #[serde(default = "judge_max")]
    pub judge_max: u32,
    /// Tokens of judge instructions added to each judged sample's context.
    #[serde(default = "judge_prompt")]
    pub judge_prompt: u32,
    /// Seed of every random draw.
    #[serde(default)]
    pub seed: u64,
    /// Length scale of each step, replacing `growth` when given (replaying a measured
    /// run's length trajectory).
    #[serde(default)]
    pub scale_by_step: Vec<f64>,
    /// Partial rollouts; none makes every step wait for all of its prompt groups.
    #[serde(default)]
    pub partial_rollout: Option<PartialRollout>,
}

fn one() -> f64 {
    1.0
}
fn judge_max() -> u32 {
    4096
}
fn judge_prompt() -> u32 {
    256
}

/// One prompt and its samples, as drawn for a step.
#[derive(Debug, Clone, PartialEq)]
pub struct PromptGroup {
    /// Prompt length, tokens.
    pub prompt_len: u32,
    /// Each sample's response length, tokens.
    pub lengths: Vec<u32>,
    /// Each sample's judge output length (empty without a generative judge).
    pub judge: Vec<u32>,
    /// Whether dynamic sampling keeps the group.
    pub keep: bool,
}

impl WorkloadSpec {
    /// Checks the values; the error names the field and what was expected.
    pub fn check(&self) -> Result<(), String> {
        if self.steps == 0 || self.prompts_per_step == 0 || self.samples_per_prompt == 0 {
            return Err(format!(
                "workload: steps, prompts_per_step and samples_per_prompt must be at least 1, found {}, {}, {}",
                self.steps, self.prompts_per_step, self.samples_per_prompt
            ));
        }
        if self.max_response == 0 || self.prompt_len == 0 {
            return Err("workload: max_response and prompt_len must be at least 1".into());
        }
        // Written so that NaN is refused too.
        if self.growth.partial_cmp(&0.0) != Some(std::cmp::Ordering::Greater) {
            return Err(format!(
                "workload.growth: expected > 0, found {}",
                self.growth
            ));
        }
        if !(0.0..=1.0).contains(&self.group_correlation) {
            return Err(format!(
                "workload.group_correlation: expected 0 to 1, found {}",
                self.group_correlation
            ));
        }
        if let Some(ds) = self.dynamic_sampling {
            for (k, v) in [("drop_start", ds.drop_start), ("drop_end", ds.drop_end)] {
                if !(0.0..0.95).contains(&v) {
                    return Err(format!(
                        "workload.dynamic_sampling.{k}: expected 0 to 0.95 (a step must keep some groups), found {v}"
                    ));
                }
            }
        }
        if let Some(pr) = &self.partial_rollout {
            // Written so that NaN is refused too.
            if !(pr.cutoff > 0.0 && pr.cutoff <= 1.0) {
                return Err(format!(
                    "workload.partial_rollout.cutoff: expected more than 0 and at most 1 (the fraction of a step's prompt groups that must be complete before it trains without the rest), found {}; e.g. cutoff = 0.9",
                    pr.cutoff
                ));
            }
        }
        self.response.check("workload.response")?;
        if let Some(j) = &self.judge {
            j.check("workload.judge")?;
        }
        Ok(())
    }

    /// The length scale at `step` (1 at the first step, `growth` at the last).
    pub fn scale_at(&self, step: u32) -> f64 {
        if let Some(s) = self.scale_by_step.get(step as usize) {
            return *s;
        }
        let f = if self.steps > 1 {
            f64::from(step) / f64::from(self.steps - 1)
        } else {
            0.0
        };
        self.growth.powf(f)
    }

    /// The fraction of groups dynamic sampling drops at `step`.
    pub fn drop_at(&self, step: u32) -> f64 {
        let Some(ds) = self.dynamic_sampling else {
            return 0.0;
        };
        let f = if self.steps > 1 {
            f64::from(step) / f64::from(self.steps - 1)
        } else {
            0.0
        };
        ds.drop_start + (ds.drop_end - ds.drop_start) * f
    }

    /// Prompt group `index` of `step` (the same value however often it is asked).
    pub fn group(&self, step: u32, index: u32) -> PromptGroup {
        let mut rng = Rng::stream(self.seed, u64::from(step), u64::from(index));
        let scale = self.scale_at(step);
        let rho = self.group_correlation;
        let zg = rng.normal();
        let max = f64::from(self.max_response);
        let lengths = (0..self.samples_per_prompt)
            .map(|_| {
                let z = rho.sqrt() * zg + (1.0 - rho).sqrt() * rng.normal();
                self.response.at(z, scale).clamp(1.0, max).round() as u32
            })
            .collect();
        let judge = match &self.judge {
            Some(j) => (0..self.samples_per_prompt)
                .map(|_| {
                    j.at(rng.normal(), 1.0)
                        .clamp(1.0, f64::from(self.judge_max))
                        .round() as u32
                })
                .collect(),
            None => Vec::new(),
        };
        // Prompt lengths vary mildly around the mean.
        let prompt_len = (f64::from(self.prompt_len) * (0.3 * rng.normal()).exp()).round() as u32;
        let keep = rng.uniform() >= self.drop_at(step);
        PromptGroup {
            prompt_len: prompt_len.max(1),
            lengths,
            judge,
            keep,
        }
    }

    /// How many of `step`'s leading prompt groups hold its first `prompts_per_step`
    /// kept ones: the groups its batch is made of when they are accepted in issue
    /// order (and what the lower bound counts).
    pub fn batch_groups(&self, step: u32) -> u32 {
        let mut kept = 0;
        let mut i = 0;
        while kept < self.prompts_per_step {
            if self.group(step, i).keep {
                kept += 1;
            }
            i += 1;
        }
        i
    }

    /// The forecast of a perfectly informed observer at `step` (the simulator's oracle
    /// for picking the best static split in hindsight).
    pub fn forecast_at(&self, step: u32) -> Forecast {
        let (mu, sigma) = self.response.log_moments();
        let (jmu, jsigma) = self.judge.map(|j| j.log_moments()).unwrap_or((0.0, 0.0));
        Forecast::new(ForecastParams {
            prompts_per_step: self.prompts_per_step,
            samples_per_prompt: self.samples_per_prompt,
            prompt_len: f64::from(self.prompt_len),
            len_log_mean: mu + self.scale_at(step).ln(),
            len_log_sigma: sigma,
            max_response: self.max_response,
            drop_rate: self.drop_at(step),
            judge_log_mean: jmu,
            judge_log_sigma: jsigma,
            judge_max: self.judge_max,
            judge_prompt: f64::from(self.judge_prompt),
        })
    }
}

/// What a forecast is made from.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ForecastParams {
    /// Prompt groups kept per step.
    pub prompts_per_step: u32,
    /// Samples per prompt.
    pub samples_per_prompt: u32,
    /// Mean prompt length, tokens.
    pub prompt_len: f64,
    /// Mean of `ln L` of response lengths (before truncation).
    pub len_log_mean: f64,
    /// Standard deviation of `ln L`.
    pub len_log_sigma: f64,
    /// Truncation length.
    pub max_response: u32,
    /// Fraction of prompt groups dynamic sampling drops.
    pub drop_rate: f64,
    /// Mean of `ln J` of judge output lengths (0 without a judge).
    pub judge_log_mean: f64,
    /// Standard deviation of `ln J`.
    pub judge_log_sigma: f64,
    /// Truncation length of judge outputs.
    pub judge_max: u32,
    /// Judge instruction tokens per judged sample.
    pub judge_prompt: f64,
}

impl ForecastParams {
    /// A forecast of `prompts` prompts of `samples` samples with 512-token prompts and
    /// lognormal responses (`median`, `sigma`) truncated at `max_response`; no dynamic
    /// sampling and no judge until [`ForecastParams::with_drop`] and
    /// [`ForecastParams::with_judge`] add them.
    pub fn lognormal(
        prompts: u32,
        samples: u32,
        median: f64,
        sigma: f64,
        max_response: u32,
    ) -> Self {
        ForecastParams {
            prompts_per_step: prompts,
            samples_per_prompt: samples,
            prompt_len: 512.0,
            len_log_mean: median.ln(),
            len_log_sigma: sigma,
            max_response,
            drop_rate: 0.0,
            judge_log_mean: 0.0,
            judge_log_sigma: 0.0,
            judge_max: 0,
            judge_prompt: 0.0,
        }
    }

    /// With this dynamic-sampling drop rate.
    pub fn with_drop(mut self, rate: f64) -> Self {
        self.drop_rate = rate;
        self
    }

    /// With a generative judge: lognormal verdicts (`median`, `sigma`) of at most `max`
    /// tokens, after 256 tokens of instructions.
    pub fn with_judge(mut self, median: f64, sigma: f64, max: u32) -> Self {
        self.judge_log_mean = median.ln();
        self.judge_log_sigma = sigma;
        self.judge_max = max;
        self.judge_prompt = 256.0;
        self
    }
}

/// Number of quantiles a forecast keeps of each length distribution.
const QUANTILES: usize = 256;

/// The predicted workload of a step: response lengths as a truncated lognormal, the
/// dynamic-sampling drop rate and judge lengths. Quantiles are precomputed so the cost
/// model can query it in the plan search's inner loop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    /// The parameters.
    pub params: ForecastParams,
    len_q: Vec<f64>,
    judge_q: Vec<f64>,
}

impl Forecast {
    /// A forecast from its parameters.
    pub fn new(params: ForecastParams) -> Self {
        let q = |mu: f64, s: f64, max: u32| -> Vec<f64> {
            (0..QUANTILES)
                .map(|i| {
                    let p = (i as f64 + 0.5) / QUANTILES as f64;
                    (mu + s * normal_quantile(p))
                        .exp()
                        .clamp(1.0, f64::from(max))
                })
                .collect()
        };
        Forecast {
            len_q: q(
                params.len_log_mean,
                params.len_log_sigma,
                params.max_response,
            ),
            judge_q: if params.judge_log_mean > 0.0 {
                q(
                    params.judge_log_mean,
                    params.judge_log_sigma,
                    params.judge_max,
                )
            } else {
                Vec::new()
            },
            params,
        }
    }

    /// Samples kept per step (what trains).
    pub fn kept_samples(&self) -> f64 {
        f64::from(self.params.prompts_per_step) * f64::from(self.params.samples_per_prompt)
    }

    /// Samples generated per step, counting the groups dynamic sampling drops.
    pub fn generated_samples(&self) -> f64 {
        self.kept_samples() / (1.0 - self.params.drop_rate.clamp(0.0, 0.95))
    }

    /// Mean response length, tokens.
    pub fn mean_len(&self) -> f64 {
        self.len_q.iter().sum::<f64>() / self.len_q.len() as f64
    }

    /// Mean of the squared response length (the KV-cache read cost grows with it).
    pub fn mean_len_sq(&self) -> f64 {
        self.len_q.iter().map(|l| l * l).sum::<f64>() / self.len_q.len() as f64
    }

    /// The response-length quantiles (ascending, truncated).
    pub fn len_quantiles(&self) -> &[f64] {
        &self.len_q
    }

    /// The response length at quantile `q` (truncated).
    pub fn len_quantile(&self, q: f64) -> f64 {
        (self.params.len_log_mean + self.params.len_log_sigma * normal_quantile(q))
            .exp()
            .clamp(1.0, f64::from(self.params.max_response))
    }

    /// Expected longest response among `n` samples.
    pub fn expected_max_len(&self, n: f64) -> f64 {
        let z = normal_quantile(1.0 - 1.0 / (2.0 * n.max(1.0)));
        (self.params.len_log_mean + self.params.len_log_sigma * z)
            .exp()
            .min(f64::from(self.params.max_response))
    }

    /// Mean judge output length, tokens (0 without a judge).
    pub fn mean_judge_len(&self) -> f64 {
        if self.judge_q.is_empty() {
            return 0.0;
        }
        self.judge_q.iter().sum::<f64>() / self.judge_q.len() as f64
    }

    /// Expected longest judge output among `n`.
    pub fn expected_max_judge(&self, n: f64) -> f64 {
        if self.judge_q.is_empty() {
            return 0.0;
        }
        let z = normal_quantile(1.0 - 1.0 / (2.0 * n.max(1.0)));
        (self.params.judge_log_mean + self.params.judge_log_sigma * z)
            .exp()
            .min(f64::from(self.params.judge_max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec() -> WorkloadSpec {
        WorkloadSpec {
            steps: 10,
            prompts_per_step: 64,
            samples_per_prompt: 8,
            prompt_len: 512,
            response: LengthDist::Lognormal {
                median: 1000.0,
                sigma: 1.0,
            },
            max_response: 16384,
            growth: 3.0,
            group_correlation: 0.5,
            dynamic_sampling: Some(DynamicSampling {
                drop_start: 0.1,
                drop_end: 0.5,
            }),
            judge: Some(LengthDist::Lognormal {
                median: 200.0,
                sigma: 0.5,
            }),
            judge_max: 2048,
            judge_prompt: 256,
            seed: 7,
            scale_by_step: Vec::new(),
            partial_rollout: None,
        }
    }

    #[test]
    fn normal_cdf_and_quantile_agree() {
        assert!((normal_cdf(0.0) - 0.5).abs() < 1e-7);
        assert!((normal_cdf(1.959_964) - 0.975).abs() < 1e-6);
        for p in [0.001, 0.1, 0.5, 0.9, 0.999] {
            assert!((normal_cdf(normal_quantile(p)) - p).abs() < 1e-9);
        }
    }

    #[test]
    fn groups_are_reproducible_and_independent_of_order() {
        let s = spec();
        let a = s.group(3, 17);
        let _ = s.group(3, 16);
        assert_eq!(s.group(3, 17), a);
        assert_ne!(s.group(3, 18).lengths, a.lengths);
        assert_eq!(a.lengths.len(), 8);
        assert_eq!(a.judge.len(), 8);
    }

    #[test]
    fn lengths_follow_the_distribution_and_grow() {
        let s = spec();
        let median_at = |step: u32| {
            let mut l: Vec<u32> = (0..400).flat_map(|i| s.group(step, i).lengths).collect();
            l.sort_unstable();
            f64::from(l[l.len() / 2])
        };
        let m0 = median_at(0);
        let m9 = median_at(9);
        assert!((m0 / 1000.0 - 1.0).abs() < 0.1, "{m0}");
        assert!((m9 / m0 / 3.0 - 1.0).abs() < 0.15, "{m9} vs {m0}");
        let kept = |step: u32| (0..2000).filter(|i| s.group(step, *i).keep).count() as f64 / 2000.0;
        assert!((kept(0) - 0.9).abs() < 0.03);
        assert!((kept(9) - 0.5).abs() < 0.04);
    }

    #[test]
    fn pareto_tail_is_heavy_and_truncated() {
        let mut s = spec();
        s.response = LengthDist::Pareto {
            scale: 300.0,
            alpha: 1.2,
        };
        s.growth = 1.0;
        let l: Vec<u32> = (0..2000).flat_map(|i| s.group(0, i).lengths).collect();
        assert!(l.iter().all(|x| *x >= 299 && *x <= 16384));
        let at_max = l.iter().filter(|x| **x == 16384).count() as f64 / l.len() as f64;
        // P(L > 16384) = (300/16384)^1.2 ≈ 0.8%.
        assert!(at_max > 0.003 && at_max < 0.015, "{at_max}");
    }

    #[test]
    fn forecast_matches_the_spec() {
        let s = spec();
        let f = s.forecast_at(0);
        // Mean of a lognormal(ln 1000, 1) is 1000·e^0.5 ≈ 1649 (truncation trims a bit).
        assert!((f.mean_len() - 1649.0).abs() < 60.0, "{}", f.mean_len());
        assert!((f.generated_samples() - 512.0 / 0.9).abs() < 1e-6);
        assert!(f.expected_max_len(512.0) > 15_000.0);
        assert!(s.check().is_ok());
        let mut bad = s.clone();
        bad.dynamic_sampling = Some(DynamicSampling {
            drop_start: 0.1,
            drop_end: 1.0,
        });
        assert!(bad.check().unwrap_err().contains("drop_end"));
    }
}
