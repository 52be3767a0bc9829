//! `yatt sim`'s configuration: the TOML ([`SimConfig`], `config/sim-*.toml` are
//! examples) and the scenarios it resolves to.

use serde::{Deserialize, Serialize};
use yatt_placement::{
    Efficiency, GpuSpec, Inventory, InventoryError, JobShape, ModelSpec, PolicyConfig, PolicyError,
    RewardKind, WorkloadSpec, World,
};

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
