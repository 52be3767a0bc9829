//! The cluster simulator behind `yatt sim`: a discrete-event simulation of an RLHF job
//! on a cluster of 8 to 4,096 GPUs that compares three ways of placing it:
//! - **colocate**: full colocation, synchronous and on-policy, as verl runs it: every
//!   role on every group, one phase after another, offloading between phases;
//! - **static**: the best fixed split the search finds, chosen in hindsight among plans
//!   searched for the workload at the start, middle and end of the run and the plans
//!   the dynamic policy used;
//! - **dynamic**: yatt's placement policy re-planning as the workload shifts.
//!
//! It reports each against the lower bound: the work of every step at full efficiency
//! (decoding at full slots, passes at the hardware's rates) divided by every device.
//! The configuration is TOML ([`SimConfig`]); `config/sim-*.toml` are examples.

pub mod engine;
pub mod evaluate;

use serde::{Deserialize, Serialize};

pub use engine::{RunResult, Sim, World};

use crate::cost::{CostSetup, Shape};
use crate::inventory::{Inventory, InventoryError};
use crate::plan::Plan;
use crate::policy::{PlacementPolicy, PolicyConfig, PolicyError};
use crate::profile::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, Efficiency, GpuSpec,
    JobShape, ModelSpec, RewardKind,
};
use crate::search::{assign, search_top_lanes, LaneSearch, Space};
use crate::workload::WorkloadSpec;

/// Why a simulation could not run.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The TOML did not parse or had unknown keys.
    #[error("sim config: {0}")]
    Toml(#[from] toml::de::Error),
    /// A value is out of range; the message names the key and what was expected.
    #[error("sim config: {0}")]
    Invalid(String),
    /// The cluster could not be cut into groups.
    #[error("scenario {scenario}: {source}")]
    Inventory {
        /// The scenario.
        scenario: String,
        /// What was wrong.
        source: InventoryError,
    },
    /// No placement fits the scenario's cluster.
    #[error("scenario {scenario}: {source}")]
    Policy {
        /// The scenario.
        scenario: String,
        /// Why no plan fits.
        source: PolicyError,
    },
}

/// Which placements to compare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Strategy {
    /// Full colocation, synchronous (verl-style).
    Colocate,
    /// The best static split.
    Static,
    /// yatt's dynamic placement.
    Dynamic,
}

impl Strategy {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Strategy::Colocate => "colocate",
            Strategy::Static => "static",
            Strategy::Dynamic => "dynamic",
        }
    }
}

/// `[sim]`: the run as a whole.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SimSection {
    /// A name for the report.
    pub name: String,
    /// Policy versions a sample may lag the weights it trains for the static and
    /// dynamic placements (colocation is always on-policy). 0 makes them on-policy too.
    pub staleness: u32,
    /// The placements to compare.
    pub strategies: Vec<Strategy>,
    /// With `workload.partial_rollout`: also run every placement without partial
    /// rollouts, for comparison in the same report.
    pub without_partial: bool,
    /// With `policy.lanes`: also run the static and dynamic placements without
    /// straggler lanes, for comparison in the same report.
    pub without_lanes: bool,
}

impl Default for SimSection {
    fn default() -> Self {
        SimSection {
            name: "sim".into(),
            staleness: 1,
            strategies: vec![Strategy::Colocate, Strategy::Static, Strategy::Dynamic],
            without_partial: false,
            without_lanes: false,
        }
    }
}

/// `[hardware]`: the cluster (each `[[scenario]]` may override the sizes).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HardwareSection {
    /// Accelerator preset: `h100`, `h200`, `a100`.
    pub gpu: String,
    /// Devices in the cluster.
    #[serde(default = "d8")]
    pub gpus: u32,
    /// Devices per node.
    #[serde(default = "d8")]
    pub gpus_per_node: u32,
    /// Devices per group (the tensor-parallel degree of decoding).
    #[serde(default = "d1")]
    pub group_size: u32,
    /// Network bandwidth per device between nodes, GB/s (overrides the preset).
    #[serde(default)]
    pub net_gb_s: Option<f64>,
}

fn d8() -> u32 {
    8
}
fn d1() -> u32 {
    1
}
fn yes() -> bool {
    true
}

/// `[job]`: the roles and models.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct JobSection {
    /// Policy model preset (`1b` ... `70b`).
    pub model: String,
    /// `rule`, `scalar` or `genrm`.
    pub reward: String,
    /// Reward model preset (default: the policy's).
    #[serde(default)]
    pub reward_model: Option<String>,
    /// Critic model preset, for PPO (none: critic-free).
    #[serde(default)]
    pub critic: Option<String>,
    /// Whether there is a reference model.
    #[serde(default = "yes")]
    pub reference: bool,
    /// Training passes per batch.
    #[serde(default = "d1")]
    pub train_epochs: u32,
}

/// `[[scenario]]`: one cluster size and model; unset keys come from the sections above.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct ScenarioSection {
    /// A name for the report (default: "GPUS GPUs, MODEL").
    pub name: Option<String>,
    /// Devices in the cluster.
    pub gpus: Option<u32>,
    /// Devices per node.
    pub gpus_per_node: Option<u32>,
    /// Devices per group.
    pub group_size: Option<u32>,
    /// Policy model preset.
    pub model: Option<String>,
    /// Reward model preset.
    pub reward_model: Option<String>,
    /// Prompt groups per step.
    pub prompts_per_step: Option<u32>,
    /// Training steps.
    pub steps: Option<u32>,
}

/// A `yatt sim` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    /// The run.
    #[serde(default)]
    pub sim: SimSection,
    /// The cluster.
    pub hardware: HardwareSection,
    /// Efficiencies the simulated hardware really reaches; the cost model starts from
    /// [`Efficiency::default`] and has to find these from the metrics.
    #[serde(default = "true_efficiency")]
    pub truth: Efficiency,
    /// The job.
    pub job: JobSection,
    /// The workload.
    pub workload: WorkloadSpec,
    /// The placement policy's knobs.
    #[serde(default)]
    pub policy: PolicyConfig,
    /// Scenarios; none runs the sections above as one.
    #[serde(default)]
    pub scenario: Vec<ScenarioSection>,
}

/// What the simulated hardware reaches unless the config says otherwise: somewhat
/// below the cost model's nominal values, as real kernels are.
pub fn true_efficiency() -> Efficiency {
    Efficiency {
        decode_hbm: 0.62,
        decode_mfu: 0.45,
        forward_mfu: 0.42,
        train_mfu: 0.33,
    }
}

/// One scenario, resolved.
#[derive(Debug, Clone)]
pub struct Scenario {
    /// Its name.
    pub name: String,
    /// The world it simulates.
    pub world: World,
    /// Staleness of the static and dynamic placements.
    pub staleness: u32,
    /// The policy's knobs.
    pub policy: PolicyConfig,
    /// The placements to compare.
    pub strategies: Vec<Strategy>,
    /// Whether to run them without partial rollouts too.
    pub without_partial: bool,
    /// Whether to run static and dynamic without straggler lanes too.
    pub without_lanes: bool,
    /// Devices per node.
    pub gpus_per_node: u32,
}

fn model(name: &str, key: &str) -> Result<ModelSpec, SimError> {
    ModelSpec::preset(name).ok_or_else(|| {
        SimError::Invalid(format!(
            "{key}: unknown model {name:?}; expected one of {}",
            ModelSpec::PRESETS.join(", ")
        ))
    })
}

impl SimConfig {
    /// Parses and checks a TOML configuration.
    pub fn parse(text: &str) -> Result<SimConfig, SimError> {
        let c: SimConfig = toml::from_str(text)?;
        c.workload.check().map_err(SimError::Invalid)?;
        if let Some(l) = c.policy.lanes {
            if l.batch == 0 {
                return Err(SimError::Invalid(
                    "policy.lanes.batch: found 0; a lane must decode at least one response at once, e.g. lanes = { batch = 8 }".into(),
                ));
            }
            if let Some(t) = l.threshold {
                if t == 0 || t >= c.workload.max_response {
                    return Err(SimError::Invalid(format!(
                        "policy.lanes.threshold: found {t}; it is the generated length (tokens) at which a response moves to a lane and must be between 1 and workload.max_response - 1 ({}); leave it out to choose it from the forecast",
                        c.workload.max_response.saturating_sub(1)
                    )));
                }
            }
        } else if c.sim.without_lanes {
            return Err(SimError::Invalid(
                "sim.without_lanes: found true without policy.lanes; set policy.lanes (e.g. lanes = { batch = 8 }) or drop without_lanes".into(),
            ));
        }
        if c.sim.strategies.is_empty() {
            return Err(SimError::Invalid(
                "sim.strategies: expected at least one of colocate, static, dynamic".into(),
            ));
        }
        c.scenarios()?;
        Ok(c)
    }

    /// The scenarios to run.
    pub fn scenarios(&self) -> Result<Vec<Scenario>, SimError> {
        let list = if self.scenario.is_empty() {
            vec![ScenarioSection::default()]
        } else {
            self.scenario.clone()
        };
        let mut gpu = GpuSpec::preset(&self.hardware.gpu).ok_or_else(|| {
            SimError::Invalid(format!(
                "hardware.gpu: unknown GPU {:?}; expected one of {}",
                self.hardware.gpu,
                GpuSpec::PRESETS.join(", ")
            ))
        })?;
        if let Some(net) = self.hardware.net_gb_s {
            gpu.net_bytes_per_s = net * 1e9;
        }
        list.iter()
            .map(|s| {
                let gpus = s.gpus.unwrap_or(self.hardware.gpus);
                let per_node = s.gpus_per_node.unwrap_or(self.hardware.gpus_per_node);
                let group = s.group_size.unwrap_or(self.hardware.group_size);
                if group == 0 || per_node % group != 0 || gpus % per_node != 0 {
                    return Err(SimError::Invalid(format!(
                        "scenario {:?}: gpus ({gpus}) must be a multiple of gpus_per_node ({per_node}), which must be a multiple of group_size ({group})",
                        s.name
                    )));
                }
                let policy = model(s.model.as_deref().unwrap_or(&self.job.model), "job.model")?;
                let rm_name = s
                    .reward_model
                    .as_deref()
                    .or(self.job.reward_model.as_deref())
                    .unwrap_or(&policy.name)
                    .to_string();
                let reward = match self.job.reward.as_str() {
                    "rule" => RewardKind::Rule,
                    "scalar" => RewardKind::Scalar {
                        model: model(&rm_name, "job.reward_model")?,
                    },
                    "genrm" => RewardKind::Generative {
                        model: model(&rm_name, "job.reward_model")?,
                    },
                    other => {
                        return Err(SimError::Invalid(format!(
                            "job.reward: expected rule, scalar or genrm, found {other:?}"
                        )))
                    }
                };
                if matches!(reward, RewardKind::Generative { .. }) && self.workload.judge.is_none() {
                    return Err(SimError::Invalid(
                        "workload.judge: a generative reward model needs judge output lengths, e.g. judge = { dist = \"lognormal\", median = 300, sigma = 0.6 }".into(),
                    ));
                }
                let critic = self
                    .job
                    .critic
                    .as_deref()
                    .map(|c| model(c, "job.critic"))
                    .transpose()?;
                let mut workload = self.workload.clone();
                if let Some(p) = s.prompts_per_step {
                    workload.prompts_per_step = p;
                }
                if let Some(n) = s.steps {
                    workload.steps = n;
                }
                workload.check().map_err(SimError::Invalid)?;
                if let Some(pr) = &workload.partial_rollout {
                    if pr.reserve > self.sim.staleness {
                        return Err(SimError::Invalid(format!(
                            "workload.partial_rollout.reserve: {} exceeds sim.staleness ({}): it is the part of the staleness bound kept for carrying; lower reserve or raise sim.staleness",
                            pr.reserve, self.sim.staleness
                        )));
                    }
                }
                let job = JobShape {
                    policy: policy.clone(),
                    reward,
                    critic,
                    reference: self.job.reference,
                    train_epochs: self.job.train_epochs,
                    max_response: workload.max_response,
                    prompt_len: workload.prompt_len,
                };
                Ok(Scenario {
                    name: s
                        .name
                        .clone()
                        .unwrap_or_else(|| format!("{gpus} GPUs, {}", policy.name)),
                    world: World {
                        gpu: gpu.clone(),
                        truth: self.truth,
                        job,
                        workload,
                        group_devices: group,
                        groups: gpus / group,
                        rates: None,
                    },
                    staleness: self.sim.staleness,
                    policy: self.policy,
                    strategies: self.sim.strategies.clone(),
                    without_partial: self.sim.without_partial,
                    without_lanes: self.sim.without_lanes,
                    gpus_per_node: per_node,
                })
            })
            .collect()
    }
}

/// One placement's figures in a scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StrategyReport {
    /// `colocate`, `static` or `dynamic`.
    pub strategy: Strategy,
    /// Whether it ran with partial rollouts.
    pub partial: bool,
    /// Whether its search could use straggler lanes.
    pub lanes: bool,
    /// Responses moved to a straggler lane.
    pub lane_moves: u64,
    /// The plan it started with (group counts per pool).
    pub plan: String,
    /// Whether it ran; if not, why (e.g. it does not fit memory).
    pub refused: Option<String>,
    /// Seconds for the whole run.
    pub makespan_s: f64,
    /// Mean seconds per step.
    pub step_s: f64,
    /// Each step's seconds.
    pub steps_s: Vec<f64>,
    /// Mean step over the lower bound's (1 = the bound).
    pub vs_bound: f64,
    /// Trained tokens per second.
    pub tokens_per_s: f64,
    /// Throughput over full colocation's with the same partial-rollout setting (when
    /// colocation ran).
    pub speedup: Option<f64>,
    /// Throughput over on-policy full colocation without partial rollouts (verl-style),
    /// when that ran.
    pub speedup_vs_on_policy: Option<f64>,
    /// Fraction of device time computing.
    pub compute_frac: f64,
    /// Fraction of device time on offload/reload, weight sync and migration.
    pub overhead_frac: f64,
    /// Fraction of device time idle.
    pub idle_frac: f64,
    /// Fraction of generated tokens thrown away (aborted, surplus, beyond the
    /// staleness bound).
    pub wasted_frac: f64,
    /// Of those, the fraction of generated tokens thrown away because their response
    /// would have trained beyond the staleness bound.
    pub stale_frac: f64,
    /// Prompt groups trained by a later step than the one they were issued for,
    /// fraction of all trained (partial rollouts).
    pub carried_frac: f64,
    /// Tokens prefilled again by responses resuming without their KV cache, fraction
    /// of the generated tokens.
    pub reprefill_frac: f64,
    /// The most versions a trained group's oldest response lagged the weights it
    /// trained.
    pub max_lag: u32,
    /// Migrations (dynamic only).
    pub migrations: u32,
    /// Plans in force, by the step they were decided at.
    pub plans: Vec<(u64, String)>,
}

/// A scenario's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// The scenario.
    pub name: String,
    /// Devices.
    pub gpus: u32,
    /// Devices per group.
    pub group_size: u32,
    /// The policy model.
    pub model: String,
    /// Steps simulated.
    pub steps: u32,
    /// Staleness of static and dynamic.
    pub staleness: u32,
    /// Partial rollouts, when the workload has them.
    pub partial_rollout: Option<crate::workload::PartialRollout>,
    /// Straggler lanes the static and dynamic searches could use.
    pub lanes: Option<LaneSearch>,
    /// Lower bound per step: each step's work at full efficiency over all devices.
    pub bound_steps_s: Vec<f64>,
    /// Mean of the bound per step.
    pub bound_step_s: f64,
    /// The placements compared.
    pub strategies: Vec<StrategyReport>,
    /// What the dynamic policy considered, one line per search.
    pub policy_log: Vec<String>,
}

impl ScenarioReport {
    /// The report of one strategy, as configured: with partial rollouts when the
    /// workload has them and with lanes when the policy may use them (the runs
    /// without are there for comparison).
    pub fn get(&self, s: Strategy) -> Option<&StrategyReport> {
        let configured = self.partial_rollout.is_some();
        let lanes = self.lanes.is_some() && s != Strategy::Colocate;
        self.strategies.iter().find(|r| {
            r.strategy == s && r.refused.is_none() && r.partial == configured && r.lanes == lanes
        })
    }
}

/// Each step's lower bound: the minimal prompt groups that fill its batch (the same
/// groups every strategy draws first), their work at full efficiency, over all devices.
pub fn lower_bound(w: &World) -> Vec<f64> {
    let job = &w.job;
    let g = f64::from(w.group_devices);
    let devices = f64::from(w.groups) * g;
    let gen = DecodeCoeffs::roofline(&job.policy, &w.gpu, w.group_devices, &w.truth);
    let judge_model = match &job.reward {
        RewardKind::Generative { model } | RewardKind::Scalar { model } => Some(model.clone()),
        RewardKind::Rule => None,
    };
    let judge = judge_model
        .as_ref()
        .map(|m| DecodeCoeffs::roofline(m, &w.gpu, w.group_devices, &w.truth));
    let fwd = forward_s_per_token(&job.policy, &w.gpu, &w.truth);
    let train = train_s_per_token(&job.policy, &w.gpu, &w.truth);
    let critic = job.critic.as_ref().map(|c| {
        (
            forward_s_per_token(c, &w.gpu, &w.truth),
            train_s_per_token(c, &w.gpu, &w.truth),
        )
    });
    let decode = |c: &DecodeCoeffs, slots: f64, ctx0: f64, len: f64| {
        g * (c.a * len / slots
            + c.b * len
            + c.c * (ctx0 * len + len * (len + 1.0) / 2.0)
            + c.prefill * ctx0)
    };
    (0..w.workload.steps)
        .map(|k| {
            let f = w.workload.forecast_at(k);
            let slots = f64::from(
                decode_slots(
                    &job.policy,
                    &w.gpu,
                    w.group_devices,
                    f.params.prompt_len + f.mean_len(),
                )
                .max(1),
            );
            let jslots = judge_model.as_ref().map(|m| {
                let ctx =
                    f.params.prompt_len + f.mean_len() + f.params.judge_prompt + f.mean_judge_len();
                f64::from(decode_slots(m, &w.gpu, w.group_devices, ctx).max(1))
            });
            let mut kept = 0;
            let mut work = 0.0;
            let mut i = 0;
            while kept < w.workload.prompts_per_step {
                let pg = w.workload.group(k, i);
                i += 1;
                let p = f64::from(pg.prompt_len);
                let mut tokens = 0.0;
                for (s, &l) in pg.lengths.iter().enumerate() {
                    let l = f64::from(l);
                    tokens += p + l;
                    work += decode(&gen, slots, p, l);
                    match (&job.reward, &judge, jslots) {
                        (RewardKind::Generative { .. }, Some(jc), Some(js)) => {
                            let j = f64::from(pg.judge.get(s).copied().unwrap_or(1));
                            work += decode(jc, js, p + l + f64::from(w.workload.judge_prompt), j);
                        }
                        (RewardKind::Scalar { model }, _, _) => {
                            work += (p + l) * forward_s_per_token(model, &w.gpu, &w.truth);
                        }
                        _ => {}
                    }
                }
                if pg.keep {
                    kept += 1;
                    let epochs = f64::from(job.train_epochs.max(1));
                    let reference = if job.reference { fwd } else { 0.0 };
                    work += tokens * (reference + fwd + train * epochs);
                    if let Some((cf, ct)) = critic {
                        work += tokens * (cf + ct * epochs);
                    }
                }
            }
            work / devices
        })
        .collect()
}

fn report(
    strategy: Strategy,
    plan: &Plan,
    r: RunResult,
    bound_step: f64,
    steps: u32,
) -> StrategyReport {
    let step_s = r.makespan_s / f64::from(steps.max(1));
    StrategyReport {
        strategy,
        partial: false,
        lanes: false,
        lane_moves: r.lane_moves,
        plan: plan.summary(),
        refused: None,
        makespan_s: r.makespan_s,
        step_s,
        steps_s: r.step_s,
        vs_bound: step_s / bound_step,
        tokens_per_s: r.trained_tokens / r.makespan_s.max(1e-9),
        speedup: None,
        speedup_vs_on_policy: None,
        compute_frac: r.compute_frac,
        overhead_frac: r.overhead_frac,
        idle_frac: r.idle_frac,
        wasted_frac: r.wasted_frac,
        stale_frac: r.stale_frac,
        carried_frac: r.carried_frac,
        reprefill_frac: r.reprefill_frac,
        max_lag: r.max_lag,
        migrations: r.migrations,
        plans: r.plans,
    }
}

fn refused(strategy: Strategy, why: String) -> StrategyReport {
    StrategyReport {
        strategy,
        partial: false,
        lanes: false,
        lane_moves: 0,
        plan: String::new(),
        refused: Some(why),
        makespan_s: f64::NAN,
        step_s: f64::NAN,
        steps_s: Vec::new(),
        vs_bound: f64::NAN,
        tokens_per_s: f64::NAN,
        speedup: None,
        speedup_vs_on_policy: None,
        compute_frac: f64::NAN,
        overhead_frac: f64::NAN,
        idle_frac: f64::NAN,
        wasted_frac: f64::NAN,
        stale_frac: f64::NAN,
        carried_frac: f64::NAN,
        reprefill_frac: f64::NAN,
        max_lag: 0,
        migrations: 0,
        plans: Vec::new(),
    }
}

impl Scenario {
    /// The scenario's cluster as an inventory of uniform nodes.
    pub fn inventory(&self) -> Result<Inventory, SimError> {
        let w = &self.world;
        Inventory::uniform(
            w.groups * w.group_devices / self.gpus_per_node,
            self.gpus_per_node,
            w.group_devices,
            w.gpu.memory_bytes,
            w.gpu.host_memory_bytes,
        )
        .map_err(|source| SimError::Inventory {
            scenario: self.name.clone(),
            source,
        })
    }
}

/// Runs one scenario's placements (and, with `without_partial`, each again without
/// partial rollouts).
pub fn run_scenario(sc: &Scenario) -> Result<ScenarioReport, SimError> {
    let w = &sc.world;
    let bound = lower_bound(w);
    let bound_step = bound.iter().sum::<f64>() / bound.len().max(1) as f64;
    let steps = w.workload.steps;
    let mut out = Vec::new();
    let mut policy_log = Vec::new();
    let mut worlds = Vec::new();
    if w.workload.partial_rollout.is_some() && sc.without_partial {
        let mut plain = w.clone();
        plain.workload.partial_rollout = None;
        worlds.push(plain);
    }
    worlds.push(w.clone());
    for world in &worlds {
        // Colocation has no lanes: it runs once, with the placements without lanes.
        if sc.policy.lanes.is_some() && sc.without_lanes {
            let mut plain = sc.clone();
            plain.policy.lanes = None;
            out.extend(run_placements(&plain, world, bound_step)?.0);
            let mut laned = sc.clone();
            laned.strategies.retain(|s| *s != Strategy::Colocate);
            let (rs, log) = run_placements(&laned, world, bound_step)?;
            out.extend(rs);
            policy_log = log;
        } else {
            let (rs, log) = run_placements(sc, world, bound_step)?;
            out.extend(rs);
            policy_log = log;
        }
    }
    let colo = |partial: bool| {
        out.iter()
            .find(|r| r.strategy == Strategy::Colocate && r.partial == partial)
            .filter(|r| r.refused.is_none())
            .map(|r| r.tokens_per_s)
    };
    let (colo_plain, colo_partial) = (colo(false), colo(true));
    for r in &mut out {
        if r.refused.is_none() {
            let like = if r.partial { colo_partial } else { colo_plain };
            r.speedup = like.map(|c| r.tokens_per_s / c);
            r.speedup_vs_on_policy = colo_plain.map(|c| r.tokens_per_s / c);
        }
    }
    out.sort_by_key(|r| (r.partial, r.lanes, r.strategy as u8));
    Ok(ScenarioReport {
        name: sc.name.clone(),
        gpus: w.groups * w.group_devices,
        group_size: w.group_devices,
        model: w.job.policy.name.clone(),
        steps,
        staleness: sc.staleness,
        partial_rollout: w.workload.partial_rollout,
        lanes: sc.policy.lanes,
        bound_step_s: bound_step,
        bound_steps_s: bound,
        strategies: out,
        policy_log,
    })
}

/// Runs the scenario's placements on `w` (the scenario's world, with or without
/// partial rollouts); returns their reports and the dynamic policy's log.
fn run_placements(
    sc: &Scenario,
    w: &World,
    bound_step: f64,
) -> Result<(Vec<StrategyReport>, Vec<String>), SimError> {
    let inv = sc.inventory()?;
    let steps = w.workload.steps;
    let partial = w.workload.partial_rollout;
    let setup = |staleness| CostSetup {
        job: w.job.clone(),
        gpu: w.gpu.clone(),
        group_devices: w.group_devices,
        staleness,
        partial_rollout: partial,
    };
    // Colocation starts each step's generation on the newest weights. With partial
    // rollouts it spends the whole staleness bound on carrying (Kimi k1.5's
    // synchronous partial rollouts), so every placement has the same bound.
    let colocate = |plan: &Plan| match partial {
        Some(_) => Sim::new(w, plan, sc.staleness, None).synchronous(),
        None => Sim::new(w, plan, 0, None),
    };
    let prior = w.workload.forecast_at(0).params;
    let mut out = Vec::new();
    let mut policy_log = Vec::new();
    let mut dynamic_shapes: Vec<Shape> = Vec::new();
    let mut fitted = None;
    // Dynamic first: the static candidates include the plans it used.
    let mut order = sc.strategies.clone();
    order.sort_by_key(|s| match s {
        Strategy::Dynamic => 0,
        Strategy::Colocate => 1,
        Strategy::Static => 2,
    });
    for strategy in order {
        match strategy {
            Strategy::Colocate => {
                let plan = Plan::full_colocation(&inv, &w.job);
                match plan.validate(&inv, &w.job) {
                    Ok(()) => {
                        let r = colocate(&plan).run();
                        out.push(report(strategy, &plan, r, bound_step, steps));
                    }
                    Err(e) => out.push(refused(strategy, e.to_string())),
                }
            }
            Strategy::Dynamic => {
                let policy =
                    PlacementPolicy::new(sc.policy, inv.clone(), setup(sc.staleness), prior)
                        .map_err(|source| SimError::Policy {
                            scenario: sc.name.clone(),
                            source,
                        })?;
                let plan = policy.plan().clone();
                let (r, final_policy) = Sim::new(w, &plan, sc.staleness, Some(policy)).run_keep();
                if let Some(p) = final_policy {
                    fitted = Some(p.cost_model().clone());
                    dynamic_shapes.push(Shape::of(&plan));
                    dynamic_shapes.push(Shape::of(p.plan()));
                }
                policy_log = r.log.clone();
                out.push(report(strategy, &plan, r, bound_step, steps));
            }
            Strategy::Static => {
                let cm = match fitted.clone() {
                    Some(cm) => cm,
                    None => crate::cost::CostModel::new(setup(sc.staleness), prior),
                };
                let space = Space::of(&inv);
                let mut shapes = dynamic_shapes.clone();
                for k in [0, steps / 2, steps.saturating_sub(1)] {
                    let f = w.workload.forecast_at(k);
                    let all = search_top_lanes(&cm, &f, &space, usize::MAX, sc.policy.lanes);
                    // The best split without lanes, and the best with lanes when they
                    // are allowed.
                    for lanes in [false, true] {
                        if let Some(x) = all.iter().find(|x| x.shape.lanes.is_some() == lanes) {
                            shapes.push(x.shape.clone());
                        }
                    }
                }
                let mut seen = Vec::new();
                let mut best: Option<StrategyReport> = None;
                for s in shapes {
                    if seen.contains(&s) {
                        continue;
                    }
                    seen.push(s.clone());
                    let plan = assign(&s, &inv, None);
                    if let Err(e) = plan.validate(&inv, &w.job) {
                        if best.is_none() {
                            best = Some(refused(strategy, e.to_string()));
                        }
                        continue;
                    }
                    let r = Sim::new(w, &plan, sc.staleness, None).run();
                    let rep = report(strategy, &plan, r, bound_step, steps);
                    if best
                        .as_ref()
                        .is_none_or(|b| b.refused.is_some() || rep.makespan_s < b.makespan_s)
                    {
                        best = Some(rep);
                    }
                }
                out.push(best.unwrap_or_else(|| refused(strategy, "no static split fits".into())));
            }
        }
    }
    for r in &mut out {
        r.partial = partial.is_some();
        r.lanes = sc.policy.lanes.is_some() && r.strategy != Strategy::Colocate;
    }
    Ok((out, policy_log))
}

/// Runs every scenario of a configuration.
pub fn run(config: &SimConfig) -> Result<Vec<ScenarioReport>, SimError> {
    config.scenarios()?.iter().map(run_scenario).collect()
}

/// A scenario's figures as a plain-text table.
pub fn format_report(r: &ScenarioReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} GPUs in groups of {}, {} model, {} steps, staleness {} (static, dynamic); lower bound {:.1} s/step",
        r.name, r.gpus, r.group_size, r.model, r.steps, r.staleness, r.bound_step_s
    );
    if let Some(pr) = &r.partial_rollout {
        let _ = writeln!(
            s,
            "  partial rollouts: cutoff {:.0}% of a batch, {} version(s) reserved for carrying, resume {:?}, beyond the bound: {:?}",
            pr.cutoff * 100.0,
            pr.reserve,
            pr.resume,
            pr.beyond_bound
        );
    }
    let _ = writeln!(
        s,
        "  {:<23} {:>7} {:>7} {:>8} {:>8} {:>6} {:>7} {:>7} {:>7} {:>4} {:>7} {:>5} {:>6}  plan",
        "placement",
        "s/step",
        "x bound",
        "speedup",
        "vs sync",
        "idle",
        "overhd",
        "wasted",
        "carried",
        "lag",
        "tok/s",
        "migr",
        "lane"
    );
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
    let times = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"));
    for x in &r.strategies {
        let name = format!(
            "{}{}{}",
            x.strategy.name(),
            if x.partial { "+partial" } else { "" },
            if x.lanes { "+lanes" } else { "" }
        );
        if let Some(why) = &x.refused {
            let _ = writeln!(s, "  {name:<23} refused: {why}");
            continue;
        }
        let _ = writeln!(
            s,
            "  {:<23} {:>7.1} {:>7.2} {:>8} {:>8} {:>6} {:>7} {:>7} {:>7} {:>4} {:>7.0} {:>5} {:>6}  {}",
            name,
            x.step_s,
            x.vs_bound,
            times(x.speedup),
            times(x.speedup_vs_on_policy),
            pct(x.idle_frac),
            pct(x.overhead_frac),
            pct(x.wasted_frac),
            pct(x.carried_frac),
            x.max_lag,
            x.tokens_per_s,
            x.migrations,
            x.lane_moves,
            match x.plans.last() {
                Some(last) if x.plans.len() > 1 => format!("{} → {}", x.plan, last.1),
                _ => x.plan.clone(),
            }
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMALL: &str = r#"
[sim]
name = "small"
staleness = 1

[hardware]
gpu = "h100"
gpus = 8
gpus_per_node = 8
group_size = 1

[job]
model = "1b"
reward = "genrm"

[workload]
steps = 4
prompts_per_step = 16
samples_per_prompt = 4
prompt_len = 128
response = { dist = "lognormal", median = 200, sigma = 1.0 }
max_response = 2048
growth = 2.0
dynamic_sampling = { drop_start = 0.2, drop_end = 0.4 }
judge = { dist = "lognormal", median = 60, sigma = 0.5 }
judge_max = 256
"#;

    #[test]
    fn every_placement_runs_every_step_above_the_bound() {
        let config = SimConfig::parse(SMALL).unwrap();
        let sc = &config.scenarios().unwrap()[0];
        let r = run_scenario(sc).unwrap();
        assert_eq!(r.strategies.len(), 3);
        assert_eq!(r.bound_steps_s.len(), 4);
        for s in &r.strategies {
            assert!(s.refused.is_none(), "{:?}", s.refused);
            assert_eq!(s.steps_s.len(), 4, "{:?}", s.strategy);
            // In-order acceptance makes every placement train the same groups, so none
            // can beat the work they need at full efficiency.
            assert!(
                s.vs_bound >= 1.0,
                "{:?} at {} x bound",
                s.strategy,
                s.vs_bound
            );
            let total = s.compute_frac + s.overhead_frac + s.idle_frac;
            assert!((total - 1.0).abs() < 1e-9, "{total}");
        }
        let colo = r.get(Strategy::Colocate).unwrap();
        assert_eq!(colo.plan, format!("rollout+reward+reference+policy:8"));
        assert_eq!(colo.speedup, Some(1.0));
        // Deterministic: the same config gives the same figures.
        let again = run_scenario(sc).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn config_errors_name_the_key() {
        let bad = SMALL.replace("reward = \"genrm\"", "reward = \"llm\"");
        let err = SimConfig::parse(&bad).unwrap_err().to_string();
        assert!(
            err.contains("job.reward") && err.contains("\"llm\""),
            "{err}"
        );
        let bad = SMALL.replace("gpu = \"h100\"", "gpu = \"h100\"\ngpus_per_rack = 4");
        let err = SimConfig::parse(&bad).unwrap_err().to_string();
        assert!(err.contains("gpus_per_rack"), "{err}");
        let bad = SMALL.replace("group_size = 1", "group_size = 3");
        let err = SimConfig::parse(&bad).unwrap_err().to_string();
        assert!(err.contains("group_size (3)"), "{err}");
        let bad = SMALL.replace("model = \"1b\"", "model = \"13b\"");
        let err = SimConfig::parse(&bad).unwrap_err().to_string();
        assert!(err.contains("13b") && err.contains("70b"), "{err}");
    }

    #[test]
    fn partial_rollout_errors_name_the_key_and_the_fix() {
        let with = |pr: &str| {
            SMALL.replace(
                "judge_max = 256",
                &format!("judge_max = 256\npartial_rollout = {pr}"),
            )
        };
        for (value, wants) in [
            (
                "{ cutoff = 0 }",
                ["workload.partial_rollout.cutoff", "cutoff = 0.9"],
            ),
            (
                "{ reserve = 2 }",
                ["workload.partial_rollout.reserve", "raise sim.staleness"],
            ),
            ("{ resume = \"swap\" }", ["swap", "reprefill"]),
        ] {
            let err = SimConfig::parse(&with(value)).unwrap_err().to_string();
            assert!(wants.iter().all(|w| err.contains(w)), "{value}: {err}");
        }
        let ok = SimConfig::parse(&with(
            "{ cutoff = 0.7, resume = \"reprefill\", beyond_bound = \"regenerate\" }",
        ));
        assert!(ok.is_ok(), "{:?}", ok.err());
    }

    /// Runs `SMALL` with two text replacements (`(from, to)`).
    fn small_with(a: (&str, &str), b: (&str, &str)) -> ScenarioReport {
        let text = SMALL.replace(a.0, a.1).replace(b.0, b.1);
        let config = SimConfig::parse(&text).unwrap();
        run_scenario(&config.scenarios().unwrap()[0]).unwrap()
    }

    #[test]
    fn partial_rollouts_run_beside_the_plain_placements() {
        let r = small_with(
            ("staleness = 1", "staleness = 1\nwithout_partial = true"),
            (
                "judge_max = 256",
                "judge_max = 256\npartial_rollout = { cutoff = 0.7 }",
            ),
        );
        assert_eq!(r.strategies.len(), 6);
        for s in &r.strategies {
            assert!(s.refused.is_none(), "{:?}", s.refused);
            assert!(
                s.vs_bound >= 1.0,
                "{:?} {} at {}",
                s.strategy,
                s.partial,
                s.vs_bound
            );
            assert!(s.max_lag <= 1, "{:?}: lag {}", s.strategy, s.max_lag);
        }
        let colo = r
            .strategies
            .iter()
            .find(|s| s.strategy == Strategy::Colocate && s.partial)
            .unwrap();
        assert_eq!(colo.speedup, Some(1.0), "compared like for like");
        assert!(colo.speedup_vs_on_policy.is_some());
    }

    #[test]
    fn a_model_that_fits_nowhere_is_refused_with_the_reason() {
        let big = SMALL.replace("model = \"1b\"", "model = \"70b\"");
        let config = SimConfig::parse(&big).unwrap();
        let err = run_scenario(&config.scenarios().unwrap()[0])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("no placement fits") && err.contains("GiB"),
            "{err}"
        );
    }

    #[test]
    fn lane_config_errors_name_the_key_and_the_fix() {
        let with = |policy: &str, sim: &str| {
            SMALL
                .replace("staleness = 1", &format!("staleness = 1\n{sim}"))
                .replace("[hardware]", &format!("[policy]\n{policy}\n\n[hardware]"))
        };
        let err = |policy: &str, sim: &str| match SimConfig::parse(&with(policy, sim)) {
            Ok(_) => panic!("{policy} {sim}: accepted"),
            Err(e) => e.to_string(),
        };
        for (policy, sim, want) in [
            (
                "lanes = { batch = 0 }",
                "",
                &["policy.lanes.batch: found 0", "batch = 8"][..],
            ),
            (
                "lanes = { batch = 8, threshold = 2048 }",
                "",
                &["policy.lanes.threshold: found 2048", "(2047)"],
            ),
            ("lanes = { batch = 8, size = 2 }", "", &["size"]),
            (
                "",
                "without_lanes = true",
                &["sim.without_lanes", "policy.lanes"],
            ),
        ] {
            let e = err(policy, sim);
            assert!(want.iter().all(|w| e.contains(w)), "{e}");
        }
        SimConfig::parse(&with(
            "lanes = { batch = 8, threshold = 512 }",
            "without_lanes = true",
        ))
        .unwrap();
    }

    #[test]
    fn lanes_run_beside_the_placements_without_them() {
        let r = small_with(
            ("staleness = 1", "staleness = 1\nwithout_lanes = true"),
            (
                "[hardware]",
                "[policy]\nlanes = { batch = 4 }\n\n[hardware]",
            ),
        );
        let names: Vec<(Strategy, bool)> =
            r.strategies.iter().map(|s| (s.strategy, s.lanes)).collect();
        assert_eq!(
            names,
            vec![
                (Strategy::Colocate, false),
                (Strategy::Static, false),
                (Strategy::Dynamic, false),
                (Strategy::Static, true),
                (Strategy::Dynamic, true),
            ]
        );
        for s in &r.strategies {
            assert!(s.refused.is_none(), "{:?}", s.refused);
            assert!(s.vs_bound >= 1.0, "{:?} at {}", s.strategy, s.vs_bound);
            if !s.lanes {
                assert_eq!(s.lane_moves, 0);
            }
        }
        // The static split with leave to use lanes is the best of a superset of plans.
        let st = |lanes: bool| {
            r.strategies
                .iter()
                .find(|s| s.strategy == Strategy::Static && s.lanes == lanes)
                .unwrap()
                .step_s
        };
        assert!(st(true) <= st(false) + 1e-9);
        assert!(r.get(Strategy::Dynamic).unwrap().lanes);
        assert!(!r.get(Strategy::Colocate).unwrap().lanes);
        assert!(format_report(&r).contains("dynamic+lanes"));
    }
}
