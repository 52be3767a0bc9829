//! The cost model: a plan's predicted step time, refit online from stage metrics.
//!
//! It starts from the rooflines in [`crate::profile`] with nominal efficiencies and
//! corrects them from what each step reports:
//! - decoding stages (rollout, generative judge) fit the per-iteration time
//!   `a·iterations + b·tokens + c·context tokens + p·prefill tokens` by ridge regression
//!   towards the roofline, with exponential forgetting;
//! - forward and training stages fit a ratio of measured to roofline seconds per token;
//! - weight sync and offload/reload switches are running averages of what they took;
//! - the workload forecast tracks the log-mean and log-spread of response lengths, their
//!   trend per step, the dynamic-sampling drop rate and judge lengths.
//!
//! Prediction has two regimes. With `staleness = 0` (on-policy, synchronous) a step is
//! the critical path gen → reward → scoring → train → sync, where stages on different
//! pools overlap by streaming. With `staleness ≥ 1` pools work on different steps at
//! once and a step costs the busiest pool's time per step, but no less than the cycle
//! a sample needs from admission to trained weights divided by `staleness + 1`.

use serde::{Deserialize, Serialize};
use yatt_metrics::names;

use crate::plan::Move;
use crate::profile::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, Efficiency, GpuSpec,
    JobShape, RewardKind, Role, RoleSet,
};
use crate::workload::{Forecast, ForecastParams, PartialRollout};

/// A kind of work in a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// Generating responses (rollout).
    Gen,
    /// A generative judge decoding verdicts (reward).
    Judge,
    /// A scalar reward model's forward pass (reward).
    Score,
    /// Reference log-probs (reference).
    Ref,
    /// Critic values (critic).
    Values,
    /// Old log-probs (policy).
    OldLogProb,
    /// The policy update (policy).
    TrainActor,
    /// The critic update (critic).
    TrainCritic,
}

impl Stage {
    /// Every stage, in pipeline order.
    pub const ALL: [Stage; 8] = [
        Stage::Gen,
        Stage::Judge,
        Stage::Score,
        Stage::Ref,
        Stage::Values,
        Stage::OldLogProb,
        Stage::TrainActor,
        Stage::TrainCritic,
    ];

    /// The role doing it.
    pub fn role(self) -> Role {
        match self {
            Stage::Gen => Role::Rollout,
            Stage::Judge | Stage::Score => Role::Reward,
            Stage::Ref => Role::Reference,
            Stage::Values | Stage::TrainCritic => Role::Critic,
            Stage::OldLogProb | Stage::TrainActor => Role::Policy,
        }
    }

    /// The metric `yatt train` writes its time under (`timing_s/gen`, ...).
    pub fn timing_metric(self) -> &'static str {
        match self {
            Stage::Gen => names::GEN_S,
            Stage::Judge | Stage::Score => names::REWARD_S,
            Stage::Ref => names::REF_S,
            Stage::Values => names::VALUES_S,
            Stage::OldLogProb => names::OLD_LOG_PROB_S,
            Stage::TrainActor => names::UPDATE_ACTOR_S,
            Stage::TrainCritic => names::UPDATE_CRITIC_S,
        }
    }

    /// Its short name, for logs: the timing metric without `timing_s/` (`gen`, ...).
    pub fn metric(self) -> &'static str {
        let m = self.timing_metric();
        m.strip_prefix(names::TIMING_PREFIX).unwrap_or(m)
    }

    /// The stages `job` has, in pipeline order.
    pub fn of_job(job: &JobShape) -> Vec<Stage> {
        Stage::ALL
            .into_iter()
            .filter(|s| match s {
                Stage::Judge => matches!(job.reward, RewardKind::Generative { .. }),
                Stage::Score => matches!(job.reward, RewardKind::Scalar { .. }),
                Stage::Ref => job.reference,
                Stage::Values | Stage::TrainCritic => job.critic.is_some(),
                _ => true,
            })
            .collect()
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// What one stage did in one step, summed over the groups that did it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct StageObs {
    /// The stage.
    pub stage: Stage,
    /// Group-seconds spent on it (a group busy for 2 s and another for 3 s: 5).
    pub group_s: f64,
    /// Devices per group.
    pub group_devices: u32,
    /// Tokens processed: generated tokens for decoding stages, tokens scored or
    /// trained on (prompt + response, times epochs) otherwise.
    pub tokens: f64,
    /// Decoding stages: iterations summed over groups.
    pub iterations: Option<f64>,
    /// Decoding stages: context tokens read, summed over iterations and sequences.
    pub context_tokens: Option<f64>,
    /// Decoding stages: prompt tokens prefilled.
    pub prefill_tokens: Option<f64>,
}

/// One step's metrics, as the live metrics actor or the simulator reports them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct StepMetrics {
    /// The step (0-based).
    pub step: u64,
    /// Wall time since the previous step finished, seconds.
    pub step_s: f64,
    /// What each stage did.
    pub stages: Vec<StageObs>,
    /// Mean response length of the samples generated, tokens.
    pub response_len_mean: f64,
    /// Mean of `ln L` of response lengths.
    pub response_log_mean: f64,
    /// Standard deviation of `ln L` of response lengths.
    pub response_log_std: f64,
    /// Mean prompt length, tokens.
    pub prompt_len_mean: f64,
    /// Mean and standard deviation of `ln J` of judge outputs (zeros without a judge).
    pub judge_log_mean: f64,
    /// Standard deviation of `ln J`.
    pub judge_log_std: f64,
    /// Prompt groups whose rewards were seen by the dynamic-sampling filter.
    pub groups_filtered: u64,
    /// Of those, groups dropped for carrying no signal.
    pub groups_dropped: u64,
    /// Weight sync, seconds (none if the step had none).
    pub weight_sync_s: Option<f64>,
    /// Whether the sync was local (rollout and policy on the same groups).
    pub weight_sync_local: bool,
    /// Offload/reload switches this step and the seconds they took in all.
    pub switches: u32,
    /// Seconds all switches took.
    pub switch_s: f64,
}

/// An exponential moving average.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Ema {
    /// The current value.
    pub value: f64,
    /// How many samples went in.
    pub n: u64,
    alpha: f64,
}

impl Ema {
    /// Starts at `prior` with weight `alpha` for new samples.
    pub fn new(prior: f64, alpha: f64) -> Self {
        Ema {
            value: prior,
            n: 0,
            alpha,
        }
    }

    /// Adds a sample.
    pub fn push(&mut self, x: f64) {
        if !x.is_finite() {
            return;
        }
        if !self.value.is_finite() {
            // A prior of NaN means "none": the first sample is the estimate.
            self.value = x;
            self.n = 1;
            return;
        }
        // The first sample replaces the prior and the next ones weigh more, so a
        // measurement wins over a guess at once.
        let a = self.alpha.max(1.0 / (self.n as f64 + 1.0));
        self.value += a * (x - self.value);
        self.n += 1;
    }
}

const DECODE_FEATURES: usize = 4;

/// Ridge regression of decoding time on (iterations, tokens, context tokens, prefill
/// tokens), in units of the roofline coefficients, with exponential forgetting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DecodeFit {
    prior: DecodeCoeffs,
    xtx: [[f64; DECODE_FEATURES]; DECODE_FEATURES],
    xty: [f64; DECODE_FEATURES],
    /// Multipliers of the roofline coefficients fitted so far (1 = the roofline).
    pub scale: [f64; DECODE_FEATURES],
    /// Observations taken.
    pub n: u64,
}

impl DecodeFit {
    const FORGET: f64 = 0.8;
    const RIDGE: f64 = 0.01;

    fn new(prior: DecodeCoeffs) -> Self {
        DecodeFit {
            prior,
            xtx: [[0.0; DECODE_FEATURES]; DECODE_FEATURES],
            xty: [0.0; DECODE_FEATURES],
            scale: [1.0; DECODE_FEATURES],
            n: 0,
        }
    }

    /// The fitted coefficients.
    pub fn coeffs(&self) -> DecodeCoeffs {
        DecodeCoeffs {
            a: self.prior.a * self.scale[0],
            b: self.prior.b * self.scale[1],
            c: self.prior.c * self.scale[2],
            prefill: self.prior.prefill * self.scale[3],
        }
    }

    fn observe(&mut self, o: &StageObs) {
        let (Some(it), Some(ctx), Some(pf)) = (o.iterations, o.context_tokens, o.prefill_tokens)
        else {
            return;
        };
        if o.group_s <= 0.0 {
            return;
        }
        let x = [
            it * self.prior.a,
            o.tokens * self.prior.b,
            ctx * self.prior.c,
            pf * self.prior.prefill,
        ];
        // Relative errors: every step weighs the same whatever its length.
        let w = 1.0 / (o.group_s * o.group_s);
        for i in 0..DECODE_FEATURES {
            for j in 0..DECODE_FEATURES {
                self.xtx[i][j] = Self::FORGET * self.xtx[i][j] + w * x[i] * x[j];
            }
            self.xty[i] = Self::FORGET * self.xty[i] + w * x[i] * o.group_s;
        }
        self.n += 1;
        // Ridge towards the roofline (scale 1), scaled to the data's weight.
        let mut a = self.xtx;
        let mut b = self.xty;
        let trace: f64 =
            (0..DECODE_FEATURES).map(|i| a[i][i]).sum::<f64>() / DECODE_FEATURES as f64;
        for i in 0..DECODE_FEATURES {
            a[i][i] += Self::RIDGE * trace.max(1e-12);
            b[i] += Self::RIDGE * trace.max(1e-12);
        }
        if let Some(s) = solve(a, b) {
            for (dst, v) in self.scale.iter_mut().zip(s) {
                *dst = v.clamp(0.05, 20.0);
            }
        }
    }
}

/// Solves `a x = b` by Gaussian elimination with partial pivoting.
fn solve<const N: usize>(mut a: [[f64; N]; N], mut b: [f64; N]) -> Option<[f64; N]> {
    for col in 0..N {
        let piv = (col..N).max_by(|i, j| a[*i][col].abs().total_cmp(&a[*j][col].abs()))?;
        if a[piv][col].abs() < 1e-300 {
            return None;
        }
        a.swap(col, piv);
        b.swap(col, piv);
        let (top, rest) = a.split_at_mut(col + 1);
        let pivot = &top[col];
        for (i, row) in rest.iter_mut().enumerate() {
            let f = row[col] / pivot[col];
            for (x, p) in row[col..].iter_mut().zip(&pivot[col..]) {
                *x -= f * p;
            }
            b[col + 1 + i] -= f * b[col];
        }
    }
    let mut x = [0.0; N];
    for row in (0..N).rev() {
        let s: f64 = (row + 1..N).map(|k| a[row][k] * x[k]).sum();
        x[row] = (b[row] - s) / a[row][row];
    }
    x.iter().all(|v| v.is_finite()).then_some(x)
}

/// What the cost model needs to know about the hardware and the regime.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostSetup {
    /// The job's roles and models.
    pub job: JobShape,
    /// The accelerator.
    pub gpu: GpuSpec,
    /// Devices per group.
    pub group_devices: u32,
    /// How many policy versions a sample may lag the weights it trains (0: on-policy).
    pub staleness: u32,
    /// Partial rollouts, when the job carries unfinished responses into later steps.
    #[serde(default)]
    pub partial_rollout: Option<PartialRollout>,
}

/// A plan reduced to what its cost depends on: roles per pool and group counts.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Shape {
    /// Each pool's roles and its number of groups.
    pub pools: Vec<(RoleSet, u32)>,
    /// The rollout's batch cap per group (see [`crate::plan::Plan::rollout_batch_cap`]).
    pub rollout_cap: Option<u32>,
    /// Straggler lanes of the rollout (see [`crate::plan::Lanes`]).
    #[serde(default)]
    pub lanes: Option<crate::plan::Lanes>,
}

impl Shape {
    /// The shape of a plan.
    pub fn of(plan: &crate::plan::Plan) -> Shape {
        Shape {
            pools: plan
                .pools
                .iter()
                .map(|p| (p.roles, p.groups.len() as u32))
                .collect(),
            rollout_cap: plan.rollout_batch_cap,
            lanes: plan.lanes,
        }
    }

    /// Total groups.
    pub fn groups(&self) -> u32 {
        self.pools.iter().map(|p| p.1).sum()
    }

    fn pool_of(&self, role: Role) -> Option<usize> {
        self.pools.iter().position(|p| p.0.contains(role))
    }
}

/// A predicted step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    /// Seconds per step.
    pub step_s: f64,
    /// Each pool's busy seconds per step, in the shape's pool order.
    pub pool_busy_s: Vec<f64>,
    /// With staleness: a sample's cycle from admission to trained weights, seconds.
    pub cycle_s: f64,
}

/// The cost model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CostModel {
    setup: CostSetup,
    decode: Vec<Option<DecodeFit>>,
    ratio: Vec<Ema>,
    prior_s_per_token: Vec<f64>,
    sync_s: Ema,
    local_sync_s: Ema,
    switch_s: Ema,
    len_mu: Ema,
    len_sigma: Ema,
    len_trend: Ema,
    last_mu: Option<f64>,
    drop_rate: Ema,
    judge_mu: Ema,
    judge_sigma: Ema,
    prompt_len: Ema,
    base: ForecastParams,
    #[serde(default = "default_start_decoder")]
    start_decoder_s: f64,
    #[serde(default = "default_start_other")]
    start_other_s: f64,
}

fn default_start_decoder() -> f64 {
    START_DECODER_S
}

fn default_start_other() -> f64 {
    START_OTHER_S
}

/// Seconds to start a decoding engine on a group (allocate the KV cache, capture CUDA
/// graphs); other roles start in [`START_OTHER_S`].
pub const START_DECODER_S: f64 = 10.0;
/// Seconds to start a role that does not decode.
pub const START_OTHER_S: f64 = 3.0;
/// Fixed seconds of one offload/reload switch besides the copies (wake-up, allocator).
pub const SWITCH_FIXED_S: f64 = 1.0;

impl CostModel {
    /// A model that knows only the rooflines and an initial workload forecast.
    pub fn new(setup: CostSetup, forecast: ForecastParams) -> Self {
        Self::with_efficiency(setup, forecast, Efficiency::default())
    }

    /// A model whose rooflines assume `eff` (an oracle that knows the hardware).
    pub fn with_efficiency(setup: CostSetup, forecast: ForecastParams, eff: Efficiency) -> Self {
        let n = Stage::ALL.len();
        let mut decode = vec![None; n];
        let mut prior = vec![0.0; n];
        for s in Stage::of_job(&setup.job) {
            let Some(model) = setup.job.model(s.role()) else {
                continue;
            };
            match s {
                Stage::Gen | Stage::Judge => {
                    decode[s.index()] = Some(DecodeFit::new(DecodeCoeffs::roofline(
                        model,
                        &setup.gpu,
                        setup.group_devices,
                        &eff,
                    )))
                }
                Stage::TrainActor | Stage::TrainCritic => {
                    prior[s.index()] = train_s_per_token(model, &setup.gpu, &eff)
                }
                _ => prior[s.index()] = forward_s_per_token(model, &setup.gpu, &eff),
            }
        }
        let w = setup.job.policy.weight_bytes() / f64::from(setup.group_devices.max(1));
        CostModel {
            decode,
            ratio: vec![Ema::new(1.0, 0.3); n],
            prior_s_per_token: prior,
            sync_s: Ema::new(w / setup.gpu.net_bytes_per_s + 1.0, 0.3),
            local_sync_s: Ema::new(w / setup.gpu.pcie_bytes_per_s + SWITCH_FIXED_S, 0.3),
            switch_s: Ema::new(f64::NAN, 0.3),
            len_mu: Ema::new(forecast.len_log_mean, 0.3),
            len_sigma: Ema::new(forecast.len_log_sigma, 0.3),
            len_trend: Ema::new(0.0, 0.3),
            last_mu: None,
            drop_rate: Ema::new(forecast.drop_rate, 0.3),
            judge_mu: Ema::new(forecast.judge_log_mean, 0.3),
            judge_sigma: Ema::new(forecast.judge_log_sigma, 0.3),
            prompt_len: Ema::new(forecast.prompt_len, 0.3),
            base: forecast,
            setup,
            start_decoder_s: START_DECODER_S,
            start_other_s: START_OTHER_S,
        }
    }

    /// Replaces the seconds a role takes to start on a group (defaults
    /// `START_DECODER_S` and `START_OTHER_S` in this module: GPU figures); a live
    /// executor passes what it measured starting roles on its devices.
    pub fn set_start_costs(&mut self, decoder_s: f64, other_s: f64) {
        if decoder_s.is_finite() && decoder_s >= 0.0 {
            self.start_decoder_s = decoder_s;
        }
        if other_s.is_finite() && other_s >= 0.0 {
            self.start_other_s = other_s;
        }
    }

    /// The setup it was made with.
    pub fn setup(&self) -> &CostSetup {
        &self.setup
    }

    /// Folds one step's metrics in.
    pub fn observe(&mut self, m: &StepMetrics) {
        for o in &m.stages {
            let i = o.stage.index();
            if let Some(fit) = self.decode[i].as_mut() {
                fit.observe(o);
            } else if o.tokens > 0.0 && self.prior_s_per_token[i] > 0.0 {
                let measured = o.group_s * f64::from(o.group_devices) / o.tokens;
                self.ratio[i].push(measured / self.prior_s_per_token[i]);
            }
        }
        if let Some(s) = m.weight_sync_s {
            if m.weight_sync_local {
                self.local_sync_s.push(s);
            } else {
                self.sync_s.push(s);
            }
        }
        if m.switches > 0 {
            self.switch_s.push(m.switch_s / f64::from(m.switches));
        }
        if m.response_len_mean > 0.0 {
            if let Some(last) = self.last_mu {
                self.len_trend.push(m.response_log_mean - last);
            }
            self.last_mu = Some(m.response_log_mean);
            self.len_mu.push(m.response_log_mean);
            self.len_sigma.push(m.response_log_std);
            self.prompt_len.push(m.prompt_len_mean);
        }
        if m.groups_filtered > 0 {
            self.drop_rate
                .push(m.groups_dropped as f64 / m.groups_filtered as f64);
        }
        if m.judge_log_mean > 0.0 {
            self.judge_mu.push(m.judge_log_mean);
            self.judge_sigma.push(m.judge_log_std);
        }
    }

    /// The fitted growth of the mean of ln(response length) per step.
    pub fn length_trend(&self) -> f64 {
        if self.len_trend.n >= 2 {
            self.len_trend.value
        } else {
            0.0
        }
    }

    /// The workload forecast `ahead` steps after the last observed one. The observed
    /// log-mean is of truncated lengths, so it is a slight under-estimate of the
    /// untruncated parameter; the truncation in the forecast then trims it again.
    pub fn forecast(&self, ahead: f64) -> Forecast {
        let mut p = self.base;
        let trend = if self.len_trend.n >= 2 {
            self.len_trend.value
        } else {
            0.0
        };
        p.len_log_mean = self.len_mu.value + trend * ahead;
        p.len_log_sigma = self.len_sigma.value.max(0.0);
        p.drop_rate = self.drop_rate.value.clamp(0.0, 0.95);
        p.judge_log_mean = self.judge_mu.value;
        p.judge_log_sigma = self.judge_sigma.value.max(0.0);
        p.prompt_len = self.prompt_len.value;
        Forecast::new(p)
    }

    /// The fitted decoding coefficients of a decoding stage.
    pub fn decode_coeffs(&self, stage: Stage) -> Option<DecodeCoeffs> {
        self.decode[stage.index()].as_ref().map(DecodeFit::coeffs)
    }

    /// A one-line summary of the fit, for logs: the decoding multipliers of the
    /// roofline and the ratios of the other stages.
    pub fn fit_summary(&self) -> String {
        let mut parts = Vec::new();
        for s in Stage::of_job(&self.setup.job) {
            if let Some(fit) = &self.decode[s.index()] {
                parts.push(format!(
                    "{} a×{:.2} b×{:.2} c×{:.2} p×{:.2}",
                    s.metric(),
                    fit.scale[0],
                    fit.scale[1],
                    fit.scale[2],
                    fit.scale[3]
                ));
            } else if self.ratio[s.index()].n > 0 {
                parts.push(format!(
                    "{} ×{:.2}",
                    s.metric(),
                    self.ratio[s.index()].value
                ));
            }
        }
        parts.join(", ")
    }

    /// Fitted device-seconds per token of a forward or training stage.
    pub fn s_per_token(&self, stage: Stage) -> f64 {
        self.prior_s_per_token[stage.index()] * self.ratio[stage.index()].value
    }

    /// Seconds of one offload/reload switch of `role` on a pool of `pool_devices`.
    pub fn switch_cost(&self, role: Role, pool_devices: u32) -> f64 {
        if self.switch_s.n > 0 {
            return self.switch_s.value;
        }
        let Some(m) = self.setup.job.memory(role) else {
            return 0.0;
        };
        // Offload what was loaded and reload what runs next: two copies of the state.
        2.0 * m.resident_per_device(self.setup.group_devices, pool_devices)
            / self.setup.gpu.pcie_bytes_per_s
            + SWITCH_FIXED_S
    }

    /// Seconds of weight sync from the policy to the rollout.
    pub fn sync_cost(&self, colocated: bool) -> f64 {
        if colocated {
            self.local_sync_s.value
        } else {
            self.sync_s.value
        }
    }

    /// Seconds to load `roles` onto a group that joins their pool (weights over the
    /// network, engine start), and the seconds the policy or critic pool pauses to
    /// re-shard its state when its size changes.
    pub fn load_cost(&self, roles: RoleSet, pool_devices: u32) -> f64 {
        let g = self.setup.group_devices;
        roles
            .iter()
            .filter_map(|r| {
                let m = self.setup.job.memory(r)?;
                let start = if self.setup.job.decodes(r) {
                    self.start_decoder_s
                } else {
                    self.start_other_s
                };
                Some(
                    m.resident_per_device(g, pool_devices) / self.setup.gpu.net_bytes_per_s + start,
                )
            })
            .sum()
    }

    /// The job-seconds a migration costs: the moved groups' idle time spread over the
    /// cluster, plus the pause of pools that re-shard.
    pub fn migration_cost(&self, moves: &[Move], after: &Shape) -> f64 {
        let total = after.groups().max(1) as f64;
        let g = self.setup.group_devices;
        let mut lost = 0.0;
        let mut reshard = RoleSet::EMPTY;
        for m in moves {
            let devices = after
                .pools
                .iter()
                .find(|p| p.0 == m.to)
                .map(|p| p.1 * g)
                .unwrap_or(g);
            lost += self.load_cost(m.to, devices);
            for r in m.from.union(m.to).iter() {
                if matches!(r, Role::Policy | Role::Critic) {
                    reshard.insert(r);
                }
            }
        }
        let mut pause: f64 = 0.0;
        for r in reshard.iter() {
            let Some(mem) = self.setup.job.memory(r) else {
                continue;
            };
            let devices = after
                .pools
                .iter()
                .find(|p| p.0.contains(r))
                .map(|p| p.1 * g)
                .unwrap_or(g);
            pause = pause.max(mem.resident_per_device(g, devices) / self.setup.gpu.net_bytes_per_s);
        }
        lost / total + pause
    }

    /// Predicts the step time of `shape` under `forecast`.
    pub fn predict(&self, shape: &Shape, f: &Forecast) -> Prediction {
        let job = &self.setup.job;
        let g = self.setup.group_devices;
        let stages = Stage::of_job(job);
        let n_gen = f.generated_samples();
        let n_kept = f.kept_samples();
        let p = f.params.prompt_len;
        let l = f.mean_len();
        let l2 = f.mean_len_sq();
        // Pools work on different steps at once only when the rollout has groups of its
        // own; a rollout that takes turns with other roles drains every batch first.
        // Partial rollouts keep `reserve` versions of the staleness for carrying, so
        // generation runs that many fewer steps ahead.
        let lookahead = match self.setup.partial_rollout {
            Some(pr) => self.setup.staleness.saturating_sub(pr.reserve),
            None => self.setup.staleness,
        };
        let pipelined = lookahead > 0
            && shape
                .pool_of(Role::Rollout)
                .is_some_and(|p| shape.pools[p].0 == RoleSet::of(&[Role::Rollout]));
        // On-policy with dynamic sampling, a step issues the expected number of prompts
        // and usually needs a second, small round: a second tail of gen and reward.
        let rounds = if f.params.drop_rate > 0.02 { 2.0 } else { 1.0 };
        let mut busy = vec![0.0; shape.pools.len()];
        // Per stage: (pool, time if the pool did only this, latency of the last item).
        let mut work: Vec<(Stage, usize, f64, f64)> = Vec::new();
        for &s in &stages {
            let Some(pool) = shape.pool_of(s.role()) else {
                continue;
            };
            let groups = f64::from(shape.pools[pool].1.max(1));
            let devices = groups * f64::from(g);
            let (time, last) = match s {
                Stage::Gen | Stage::Judge => {
                    let Some(c) = self.decode_coeffs(s) else {
                        continue;
                    };
                    let model = job.model(s.role()).expect("decoding role has a model");
                    // Per sample: prompt (context before decoding), generated tokens,
                    // context read over the decode, and the longest generation.
                    let (ctx0, gen, gen_sq, max) = if s == Stage::Gen {
                        // With partial rollouts a step waits for the cutoff's share of
                        // its groups, each complete with its longest response.
                        let last = match self.setup.partial_rollout {
                            Some(pr) => f.len_quantile(
                                pr.cutoff.powf(1.0 / f64::from(f.params.samples_per_prompt)),
                            ),
                            None => f.expected_max_len(n_gen),
                        };
                        (p, l, l2, last)
                    } else {
                        let j = f.mean_judge_len();
                        (
                            p + l + f.params.judge_prompt,
                            j,
                            j * j * 1.3,
                            f.expected_max_judge(n_gen),
                        )
                    };
                    let mut slots = decode_slots(model, &self.setup.gpu, g, ctx0 + gen).max(1);
                    if let (Stage::Gen, Some(cap)) = (s, shape.rollout_cap) {
                        slots = slots.min(cap.max(1));
                    }
                    let slots = f64::from(slots);
                    let tokens = n_gen * gen / groups;
                    let ctx = n_gen * (ctx0 * gen + gen_sq / 2.0) / groups;
                    let prefill = n_gen * ctx0 / groups;
                    let per_group = n_gen / groups;
                    let occupancy = slots.min(per_group.max(1.0));
                    // A decoding pool of its own streams (slots refill with the next
                    // step's work); one that takes turns with other roles drains its
                    // batch to the last sequence before it hands over.
                    let streams = pipelined && shape.pools[pool].0.len() == 1;
                    let iters = if streams {
                        tokens / occupancy
                    } else {
                        // Bulk at full slots, then the drain of the longest sequence,
                        // once per round.
                        max.max(tokens / slots + max / 2.0) + (rounds - 1.0) * max
                    };
                    let lanes = shape
                        .lanes
                        .filter(|l| s == Stage::Gen && streams && l.groups < shape.pools[pool].1);
                    if let Some(l) = lanes {
                        let lane = lane_split(&c, f, l, n_gen, ctx0, slots, groups, max);
                        busy[pool] += lane.time;
                        work.push((s, pool, lane.time, lane.last));
                        continue;
                    }
                    let time = c.a * iters + c.b * tokens + c.c * ctx + c.prefill * prefill;
                    // The last sample's latency: its length at the batch it runs in.
                    let last = max * c.iteration(occupancy, occupancy * (ctx0 + gen / 2.0));
                    (time, last)
                }
                _ => {
                    let tokens = match s {
                        Stage::Score => n_gen * (p + l),
                        Stage::TrainActor | Stage::TrainCritic => {
                            n_kept * (p + l) * f64::from(job.train_epochs.max(1))
                        }
                        _ => n_kept * (p + l),
                    };
                    let time = tokens * self.s_per_token(s) / devices;
                    // Streamed scoring finishes a small batch after its input.
                    let last = if matches!(s, Stage::TrainActor | Stage::TrainCritic) {
                        time
                    } else {
                        time * 0.05
                    };
                    (time, last)
                }
            };
            busy[pool] += time;
            work.push((s, pool, time, last));
        }
        let rollout_pool = shape.pool_of(Role::Rollout);
        let policy_pool = shape.pool_of(Role::Policy);
        let colocated = rollout_pool == policy_pool;
        let sync = self.sync_cost(colocated);
        for (i, (roles, n)) in shape.pools.iter().enumerate() {
            let devices = n * g;
            if crate::plan::needs_offload(job, *roles, g, devices, self.setup.gpu.memory_bytes) {
                busy[i] += roles
                    .iter()
                    .map(|r| self.switch_cost(r, devices))
                    .sum::<f64>();
            }
        }
        if let Some(rp) = rollout_pool {
            busy[rp] += sync;
        }
        if let Some(pp) = policy_pool {
            if !colocated {
                busy[pp] += sync;
            }
        }
        if pipelined {
            // A step's last sample may be admitted only after the step's other work
            // went through its decoding pools: queueing adds their busy time.
            let queued: f64 = shape
                .pools
                .iter()
                .enumerate()
                .filter(|(_, p)| p.0.len() == 1 && p.0.iter().all(|r| job.decodes(r)))
                .map(|(i, _)| busy[i])
                .sum();
            let cycle: f64 = work.iter().map(|w| w.3).sum::<f64>() + sync + queued;
            let max_busy = busy.iter().copied().fold(0.0, f64::max);
            let step = max_busy.max(cycle / f64::from(self.setup.staleness + 1));
            return Prediction {
                step_s: step,
                pool_busy_s: busy,
                cycle_s: cycle,
            };
        }
        // On-policy: the critical path, with streaming between different pools.
        let mut pool_free = vec![0.0_f64; shape.pools.len()];
        let mut last_role_on_pool: Vec<Option<Role>> = vec![None; shape.pools.len()];
        let mut finish_gen_side = 0.0_f64; // gen, then reward
        let mut finish_scoring = 0.0_f64; // ref, values, old log-probs
        let mut upstream_start = 0.0_f64;
        let mut finish_train = 0.0_f64;
        for &(s, pool, time, last) in &work {
            let (dep_finish, dep_start) = match s {
                Stage::Gen => (0.0, 0.0),
                Stage::Judge | Stage::Score => (finish_gen_side, upstream_start),
                Stage::Ref | Stage::Values | Stage::OldLogProb => (finish_gen_side, upstream_start),
                Stage::TrainActor | Stage::TrainCritic => {
                    (finish_scoring.max(finish_gen_side), finish_scoring)
                }
            };
            let (pool_roles, pool_groups) = shape.pools[pool];
            let offload = crate::plan::needs_offload(
                job,
                pool_roles,
                g,
                pool_groups * g,
                self.setup.gpu.memory_bytes,
            );
            let switch = match last_role_on_pool[pool] {
                Some(r) if r != s.role() && offload => self.switch_cost(s.role(), pool_groups * g),
                _ => 0.0,
            };
            let same_pool_as_dep = match s {
                Stage::Gen => true,
                _ => work
                    .iter()
                    .any(|w| w.1 == pool && w.0 < s && w.0.role() != s.role()),
            };
            let start = if same_pool_as_dep || matches!(s, Stage::TrainActor | Stage::TrainCritic) {
                pool_free[pool].max(dep_finish) + switch
            } else {
                pool_free[pool].max(dep_start) + switch
            };
            let finish = (start + time).max(dep_finish + last);
            pool_free[pool] = finish;
            last_role_on_pool[pool] = Some(s.role());
            match s {
                Stage::Gen | Stage::Judge | Stage::Score => {
                    finish_gen_side = finish_gen_side.max(finish);
                    upstream_start = upstream_start.max(start);
                }
                Stage::Ref | Stage::Values | Stage::OldLogProb => {
                    finish_scoring = finish_scoring.max(finish)
                }
                Stage::TrainActor | Stage::TrainCritic => finish_train = finish_train.max(finish),
            }
        }
        // Weight sync, then (colocated) the switch back to the rollout.
        let back = match (rollout_pool, policy_pool) {
            (Some(rp), Some(pp)) if rp == pp && shape.pools[rp].0.len() > 1 => {
                self.switch_cost(Role::Rollout, shape.pools[rp].1 * g)
            }
            _ => 0.0,
        };
        let step = finish_train + sync + back;
        Prediction {
            step_s: step,
            pool_busy_s: busy,
            cycle_s: step,
        }
    }

    /// Device-seconds of work one step needs at full efficiency (the lower bound's
    /// numerator): decoding at full slots, everything else at the fitted rates.
    pub fn work_device_s(&self, f: &Forecast) -> f64 {
        let job = &self.setup.job;
        let g = f64::from(self.setup.group_devices);
        let n_gen = f.generated_samples();
        let n_kept = f.kept_samples();
        let p = f.params.prompt_len;
        let l = f.mean_len();
        let mut total = 0.0;
        for s in Stage::of_job(job) {
            total += match s {
                Stage::Gen | Stage::Judge => {
                    let Some(c) = self.decode_coeffs(s) else {
                        continue;
                    };
                    let model = job.model(s.role()).expect("decoding role has a model");
                    let (ctx0, gen, gen_sq) = if s == Stage::Gen {
                        (p, l, f.mean_len_sq())
                    } else {
                        let j = f.mean_judge_len();
                        (p + l + f.params.judge_prompt, j, j * j * 1.3)
                    };
                    let slots = f64::from(
                        decode_slots(model, &self.setup.gpu, self.setup.group_devices, ctx0 + gen)
                            .max(1),
                    );
                    let tokens = n_gen * gen;
                    g * (c.a * tokens / slots
                        + c.b * tokens
                        + c.c * n_gen * (ctx0 * gen + gen_sq / 2.0)
                        + c.prefill * n_gen * ctx0)
                }
                Stage::Score => n_gen * (p + l) * self.s_per_token(s),
                Stage::TrainActor | Stage::TrainCritic => {
                    n_kept * (p + l) * f64::from(job.train_epochs.max(1)) * self.s_per_token(s)
                }
                _ => n_kept * (p + l) * self.s_per_token(s),
            };
        }
        total
    }
}

/// A streaming rollout pool split into ordinary groups and straggler lanes.
struct LaneSplit {
    /// Seconds per step of the busier side.
    time: f64,
    /// The longest response's latency: up to the threshold in an ordinary batch, the
    /// rest in a lane's.
    last: f64,
}

/// Splits a step's generation of `n_gen` responses (prompts of `ctx0` tokens) between
/// the ordinary groups of a streaming rollout pool of `groups` groups (`slots` each)
/// and lanes `l`: every response's tokens up to the threshold decode in an ordinary
/// batch, the rest in a lane's; `max` is the length the step waits for. Both decode
/// at the roofline of `c`, so a lane's small batch reads less KV cache per iteration.
#[allow(clippy::too_many_arguments)]
fn lane_split(
    c: &DecodeCoeffs,
    f: &Forecast,
    l: crate::plan::Lanes,
    n_gen: f64,
    ctx0: f64,
    slots: f64,
    groups: f64,
    max: f64,
) -> LaneSplit {
    let t = f64::from(l.threshold);
    let q = f.len_quantiles();
    let k = q.len().max(1) as f64;
    // Per response: tokens and context read below and above the threshold.
    let (mut main, mut main_ctx, mut over, mut over_ctx, mut beyond) = (0.0, 0.0, 0.0, 0.0, 0.0);
    for &len in q {
        let m = len.min(t);
        let e = (len - t).max(0.0);
        main += m / k;
        main_ctx += (ctx0 * m + m * m / 2.0) / k;
        over += e / k;
        over_ctx += ((ctx0 + t) * e + e * e / 2.0) / k;
        if e > 0.0 {
            beyond += 1.0 / k;
        }
    }
    let ordinary = (groups - f64::from(l.groups)).max(1.0);
    let lanes = f64::from(l.groups.max(1));
    let tokens = n_gen * main / ordinary;
    let occupancy = slots.min((n_gen / ordinary).max(1.0));
    let main_time = c.a * tokens / occupancy
        + c.b * tokens
        + c.c * n_gen * main_ctx / ordinary
        + c.prefill * n_gen * ctx0 / ordinary;
    let lane_tokens = n_gen * over / lanes;
    let lane_occ = f64::from(l.batch)
        .min((n_gen * beyond / lanes).max(1.0))
        .max(1.0);
    // A moved response brings its KV cache (or prefills it again): at most as much
    // as one prefill of its context.
    let lane_time = c.a * lane_tokens / lane_occ
        + c.b * lane_tokens
        + c.c * n_gen * over_ctx / lanes
        + c.prefill * n_gen * beyond * (ctx0 + t) / lanes;
    let head = max.min(t);
    let tail = (max - t).max(0.0);
    let last = head * c.iteration(occupancy, occupancy * (ctx0 + main))
        + tail * c.iteration(lane_occ, lane_occ * (ctx0 + t + tail / 2.0));
    LaneSplit {
        time: main_time.max(lane_time),
        last,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::profile::ModelSpec;

    fn setup(staleness: u32) -> CostSetup {
        let m = ModelSpec::preset("7b").unwrap();
        CostSetup {
            job: JobShape::new(m.clone(), RewardKind::Generative { model: m }, 16384),
            gpu: GpuSpec::preset("h100").unwrap(),
            group_devices: 2,
            staleness,
            partial_rollout: None,
        }
    }

    fn forecast() -> ForecastParams {
        ForecastParams::lognormal(256, 16, 1000.0, 1.0, 16384)
            .with_drop(0.2)
            .with_judge(200.0, 0.5, 2048)
    }

    fn shape(parts: &[(&[Role], u32)]) -> Shape {
        Shape {
            lanes: None,
            pools: parts.iter().map(|(r, n)| (RoleSet::of(r), *n)).collect(),
            rollout_cap: None,
        }
    }

    #[test]
    fn solve_small_systems() {
        let x = solve([[2.0, 1.0], [1.0, 3.0]], [3.0, 5.0]).unwrap();
        assert!((x[0] - 0.8).abs() < 1e-12 && (x[1] - 1.4).abs() < 1e-12);
        assert!(solve([[1.0, 2.0], [2.0, 4.0]], [1.0, 2.0]).is_none());
    }

    #[test]
    fn decode_fit_recovers_true_coefficients() {
        let s = setup(1);
        let mut cm = CostModel::new(s.clone(), forecast());
        let prior = cm.decode_coeffs(Stage::Gen).unwrap();
        // The "true" hardware decodes 30% slower on weights, 60% slower on the KV cache.
        let truth = DecodeCoeffs {
            a: prior.a * 1.3,
            b: prior.b,
            c: prior.c * 1.6,
            prefill: prior.prefill * 1.1,
        };
        for step in 0..12u32 {
            // Batch, iterations, context and prefill vary independently across steps.
            let b = 40.0 + 20.0 * f64::from(step % 5);
            let iters = 1000.0 + 300.0 * f64::from(step % 3);
            let ctx = b * iters * (300.0 + 400.0 * f64::from((step * 7) % 4));
            let pf = 40_000.0 + 25_000.0 * f64::from((step * 3) % 2);
            let t = truth.a * iters + truth.b * b * iters + truth.c * ctx + truth.prefill * pf;
            cm.observe(&StepMetrics {
                step: u64::from(step),
                stages: vec![StageObs {
                    stage: Stage::Gen,
                    group_s: t,
                    group_devices: 2,
                    tokens: b * iters,
                    iterations: Some(iters),
                    context_tokens: Some(ctx),
                    prefill_tokens: Some(pf),
                }],
                ..StepMetrics::default()
            });
        }
        let fit = cm.decode_coeffs(Stage::Gen).unwrap();
        assert!((fit.a / truth.a - 1.0).abs() < 0.1, "{fit:?} vs {truth:?}");
        assert!((fit.c / truth.c - 1.0).abs() < 0.1, "{fit:?} vs {truth:?}");
    }

    #[test]
    fn ratio_fit_and_forecast_follow_metrics() {
        let mut cm = CostModel::new(setup(1), forecast());
        let prior = cm.s_per_token(Stage::TrainActor);
        for step in 0..10u64 {
            let mu = 1000f64.ln() + 0.05 * step as f64;
            cm.observe(&StepMetrics {
                step,
                stages: vec![StageObs {
                    stage: Stage::TrainActor,
                    group_s: 2.0 * prior * 1e6 / 16.0,
                    group_devices: 2,
                    tokens: 1e6,
                    iterations: None,
                    context_tokens: None,
                    prefill_tokens: None,
                }],
                response_len_mean: mu.exp(),
                response_log_mean: mu,
                response_log_std: 0.8,
                prompt_len_mean: 500.0,
                groups_filtered: 100,
                groups_dropped: 40,
                ..StepMetrics::default()
            });
        }
        // 16 group-seconds per device-second ratio: measured is prior × 2 / 8.
        assert!((cm.s_per_token(Stage::TrainActor) / prior - 0.25).abs() < 0.01);
        let f = cm.forecast(5.0);
        assert!((f.params.drop_rate - 0.4).abs() < 0.01);
        // The trend carries the log-mean forward (0.05 per step).
        assert!(f.params.len_log_mean > 1000f64.ln() + 0.05 * 9.0 + 0.1);
        assert!((f.params.len_log_sigma - 0.8).abs() < 0.05);
    }

    #[test]
    fn colocation_pays_the_tail_and_a_batch_cap_shortens_the_cycle() {
        let f = Forecast::new(forecast());
        let sync = CostModel::new(setup(0), forecast());
        let piped = CostModel::new(setup(1), forecast());
        let full = shape(&[(
            &[Role::Rollout, Role::Reward, Role::Reference, Role::Policy],
            32,
        )]);
        let split = shape(&[
            (&[Role::Rollout], 20),
            (&[Role::Reward], 4),
            (&[Role::Reference, Role::Policy], 8),
        ]);
        let bound = piped.work_device_s(&f) / 64.0;
        let t_full = sync.predict(&full, &f).step_s;
        assert!(t_full > bound * 1.5, "{t_full} vs bound {bound}");
        let open = piped.predict(&split, &f);
        assert!(
            open.step_s >= bound * 0.99,
            "{} below the bound {bound}",
            open.step_s
        );
        assert_eq!(open.pool_busy_s.len(), 3);
        // A smaller batch cuts the longest response's latency, so the cycle shortens,
        // and the rollout pool works longer for the same tokens.
        let mut capped = split.clone();
        capped.rollout_cap = Some(64);
        let c = piped.predict(&capped, &f);
        assert!(
            c.cycle_s < open.cycle_s,
            "{} vs {}",
            c.cycle_s,
            open.cycle_s
        );
        assert!(c.pool_busy_s[0] > open.pool_busy_s[0]);
    }
}
