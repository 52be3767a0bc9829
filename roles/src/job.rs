//! Training jobs: the `JobConfig` TOML schema (with `--set key=value` overrides and
//! validation), the per-role builders, [`build_embedded`] that builds the models, roles
//! and controllers of a job on one in-process node, and [`train`] that runs the steps,
//! writes `OUTPUT_DIR/metrics.jsonl` and saves the policy to `OUTPUT_DIR/checkpoint`.
//!
//! `[placement] mode = "colocate"` runs every role in this process;
//! `mode = "disaggregated"` spawns each role on the cluster node the section names
//! ([`crate::remote::build_cluster`]).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use yatt_engine::tch::{self, Device, Kind};
use yatt_engine::tiny_config;
use yatt_engine::{
    Generator, GeneratorConfig, Llama, LrSchedule, SamplingParams, Tokenizer, TrainConfig, Trainer,
};
use yatt_metrics::{RunWriter, WriteError};
use yatt_runtime::Node;
use yatt_runtime::{RingMember, RING_CHUNK_BYTES};

use crate::algo::advantage::{GaeConfig, GrpoConfig, ReinforcePpConfig};
use crate::algo::loss::{LossAgg, PolicyLossConfig, ValueLossConfig};
use crate::algo::KlEstimator;
use crate::builtin::{
    AsciiCodec, CriticConfig, CriticRole, JudgeConfig, JudgeMode, JudgeScorer, KlLossConfig,
    ModelScorer, OnUnparsed, PolicyConfig, PolicyRole, ReferenceRole, RewardRole, RolloutRole,
    ScalarRewardModel, TextCodec, TokenizerCodec,
};
use crate::controller::{
    join_policy_ring, spawn_role, step_data_parallel, AdvantageEstimator, Controller,
    ControllerConfig, ControllerError, ControllerState, DynamicSamplingConfig, KlPenalty,
    OverlongConfig, PolicyRef, RoleRefs, RolloutRef, StepMetrics,
};
use crate::data::{
    load_jsonl, DataError, Dataloader, LengthSchedule, Prompt, SyntheticTask, SyntheticTaskKind,
};
use crate::remote::PlacementSection;
use crate::reward::{
    ExactMatchVerifier, JudgeTemplate, NumericVerifier, RewardError, RewardFn, RewardInput,
    RewardOutput,
};
use crate::role::DeviceGroup;

/// Why a job could not be configured, built or run.
#[derive(Debug, thiserror::Error)]
pub enum JobError {
    /// The config file could not be read.
    #[error("{path}: cannot read: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// The config is not valid TOML or a value has the wrong type or an unknown key.
    #[error("{origin}: {message}\nfix: compare with config/demo-letters.toml (every key, its type and default are listed in roles/src/job.rs)")]
    Parse {
        /// Where the text came from.
        origin: String,
        /// The TOML/serde message (names the key and the line).
        message: String,
    },
    /// A `--set` argument is malformed or names an unknown key.
    #[error("--set {arg}: {reason}")]
    Set {
        /// The argument as given.
        arg: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A value is of the right type but not acceptable.
    #[error("{key}: expected {expected}, found {found}; fix: {fix}")]
    Invalid {
        /// Dotted key, e.g. `algorithm.name`.
        key: String,
        /// What is accepted.
        expected: String,
        /// What the config holds.
        found: String,
        /// How to fix it.
        fix: String,
    },
    /// The feature asked for exists in the schema but not in the code yet.
    #[error("{key} = {found:?} is not implemented yet; fix: {fix}")]
    NotImplemented {
        /// Dotted key.
        key: String,
        /// The value asked for.
        found: String,
        /// What works today.
        fix: String,
    },
    /// Live placement could not carry out what the run needs (a migration, a lost
    /// node's re-plan, a role start or stop on a group).
    #[error("live placement: {what}; fix: {fix}")]
    Placement {
        /// What failed, naming the group, node or replica.
        what: String,
        /// How to fix it or where to look.
        fix: String,
    },
    /// Loading a model or tokenizer failed.
    #[error("model {source_desc}: {reason}")]
    Model {
        /// `tiny` or the directory.
        source_desc: String,
        /// The engine's message.
        reason: String,
    },
    /// Loading the prompts failed.
    #[error("data: {0}")]
    Data(#[from] DataError),
    /// Building a reward function failed.
    #[error("reward: {0}")]
    Reward(#[from] RewardError),
    /// A controller or role failed (setting up or during a step).
    #[error("{0}")]
    Controller(Box<ControllerError>),
    /// A run directory cannot be resumed.
    #[error("cannot resume from {dir}: {reason}")]
    Resume {
        /// The checkpoint directory.
        dir: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Writing metrics or the checkpoint directory failed.
    #[error("{path}: {source}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
}

impl From<ControllerError> for JobError {
    fn from(e: ControllerError) -> Self {
        JobError::Controller(Box::new(e))
    }
}

/// A training job, as read from TOML.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobConfig {
    /// `[job]`.
    pub job: JobSection,
    /// `[model]`.
    pub model: ModelSection,
    /// `[data]`.
    pub data: DataSection,
    /// `[rollout]`.
    pub rollout: RolloutSection,
    /// `[algorithm]`.
    pub algorithm: AlgorithmSection,
    /// `[optim]`.
    pub optim: OptimSection,
    /// `[reward]`.
    pub reward: RewardSection,
    /// `[checkpoint]`.
    pub checkpoint: CheckpointSection,
    /// `[placement]`: which node runs each role.
    pub placement: PlacementSection,
}

/// `[job]`: name, output, seed, length and layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct JobSection {
    /// Name of the run.
    pub name: String,
    /// Where `metrics.jsonl` and `checkpoint/` go.
    pub output_dir: PathBuf,
    /// Seed of the model init, the data order and sampling.
    pub seed: u64,
    /// Training steps.
    pub steps: u64,
    /// Data-parallel controllers (heads), each with its own rollout and data shard; with
    /// `driver = "single"`, the number of rollout replicas of the one controller.
    pub controllers: usize,
    /// `parallel` (one controller per head, meeting at the update) or `single` (one
    /// driver holding the global batch and spreading generation over the replicas;
    /// for comparison).
    pub driver: String,
    /// Kept for older configs: must be `colocate`. Where roles run is `[placement]`.
    pub placement: String,
    /// Policy replicas: 1 (shared by every head) or `controllers` (one per head, their
    /// gradients all-reduced at each update).
    pub policy_replicas: usize,
}

impl Default for JobSection {
    fn default() -> Self {
        JobSection {
            name: "yatt".into(),
            output_dir: "runs/yatt".into(),
            seed: 0,
            steps: 30,
            controllers: 1,
            driver: "parallel".into(),
            placement: "colocate".into(),
            policy_replicas: 1,
        }
    }
}

/// `[model]`: which model, in which dtype, on how many threads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// `tiny` (a random tiny Llama with a character codec) or an HF model directory
    /// (config.json, safetensors, tokenizer.json).
    pub source: String,
    /// `f32` only for now.
    pub dtype: String,
    /// libtorch intra-op threads.
    pub threads: usize,
    /// Longest sequence (prompt + response) the rollout handles.
    pub max_seq_len: usize,
    /// Wrap prompts in the tokenizer's chat template (HF models only).
    pub chat: bool,
    /// `tiny` only: transformer layers (0 = the fixture's 2). A deeper tiny model
    /// decodes slower per token, as a larger model would.
    pub tiny_layers: usize,
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            source: "tiny".into(),
            dtype: "f32".into(),
            threads: 1,
            max_seq_len: 256,
            chat: false,
            tiny_layers: 0,
        }
    }
}

/// `[data]`: prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `addition`, `sorting`, `reversal` or `letters`; ignored when `jsonl` is set.
    pub task: String,
    /// A JSONL prompt file (`{"prompt": ..., "reference": ...}` per line); empty = use `task`.
    pub jsonl: String,
    /// Task length of the synthetic tasks (digits, list length, letters); for
    /// `growing`, the target response length at the first step.
    pub length: usize,
    /// `growing`: the target response length at the last step (it grows linearly
    /// from `length` over `job.steps`); 0 keeps it at `length`.
    pub length_end: usize,
    /// Number of distinct prompts generated for a synthetic task.
    pub num_prompts: usize,
    /// Prompts per step and controller.
    pub prompts_per_step: usize,
    /// Samples per prompt (the group size).
    pub samples_per_prompt: u32,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            task: "letters".into(),
            jsonl: String::new(),
            length: 2,
            length_end: 0,
            num_prompts: 256,
            prompts_per_step: 8,
            samples_per_prompt: 8,
        }
    }
}

/// `[rollout]`: sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RolloutSection {
    /// Longest response, tokens.
    pub max_new_tokens: usize,
    /// Sampling temperature.
    pub temperature: f64,
    /// Nucleus sampling (1 = off).
    pub top_p: f64,
    /// Top-k sampling (0 = off).
    pub top_k: usize,
    /// Keep generating past end-of-sequence (fixed-length responses).
    pub ignore_eos: bool,
    /// Stream samples out of the rollout as they finish, and score their rewards while
    /// generation goes on (in-process rollouts only).
    pub stream: bool,
    /// Most sequences a rollout replica decodes at once (its engine's batch slots);
    /// 0 = all of a head's samples. A small cap models an engine whose KV cache holds
    /// few sequences: decoding becomes the bottleneck, as on GPUs.
    pub max_batch: usize,
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection {
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            ignore_eos: false,
            stream: false,
            max_batch: 0,
        }
    }
}

/// `[algorithm]`: advantage estimator, clipping, KL and entropy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// `grpo`, `rloo`, `reinforce++`, `ppo` (GAE with a critic) or `dapo` (GRPO
    /// advantages with dynamic sampling; pair it with `clip_high = 0.28` and
    /// `overlong_buffer`).
    pub name: String,
    /// ε_low of the clipped ratio.
    pub clip_low: f64,
    /// ε_high of the clipped ratio (clip-higher).
    pub clip_high: f64,
    /// KL coefficient (0 = no KL term).
    pub kl_coef: f64,
    /// `k1`, `k2` or `k3`.
    pub kl_estimator: String,
    /// `loss` (KL loss in the policy), `reward` (KL penalty in the reward) or `none`
    /// (no KL term and no reference model, so no `actor/kl` metric).
    pub kl_mode: String,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// `token-mean` or `seq-mean-token-mean`.
    pub loss_agg: String,
    /// PPO: GAE discount γ.
    pub gamma: f64,
    /// PPO: GAE λ.
    pub lam: f64,
    /// PPO: value clipping range of the critic's loss (0 = no clipping).
    pub value_clip: f64,
    /// Dynamic sampling (drop prompt groups whose rewards are all equal and generate
    /// more); default: on for `dapo`, off otherwise.
    pub dynamic_sampling: Option<bool>,
    /// Generation rounds per step at most with dynamic sampling.
    pub max_sampling_rounds: usize,
    /// DAPO overlong penalty: the last `overlong_buffer` tokens before
    /// `rollout.max_new_tokens` ramp the penalty from 0 to −`overlong_coef` (0 = off).
    pub overlong_buffer: usize,
    /// Scale of the overlong penalty.
    pub overlong_coef: f64,
    /// Old log-probs of the PPO ratio: `recompute` (a forward pass of the policy before
    /// the update) or `on-policy` (needs `optim.mini_batches = 1`: the one update runs on
    /// the weights that generated, so the ratio is 1 and that pass is skipped).
    pub old_logprobs: String,
}

impl Default for AlgorithmSection {
    fn default() -> Self {
        AlgorithmSection {
            name: "grpo".into(),
            clip_low: 0.2,
            clip_high: 0.2,
            kl_coef: 0.0,
            kl_estimator: "k3".into(),
            kl_mode: "loss".into(),
            entropy_coef: 0.0,
            loss_agg: "token-mean".into(),
            gamma: 1.0,
            lam: 0.95,
            value_clip: 0.5,
            dynamic_sampling: None,
            max_sampling_rounds: 4,
            overlong_buffer: 0,
            overlong_coef: 1.0,
            old_logprobs: "recompute".into(),
        }
    }
}

/// `[optim]`: optimizer and batching of the update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Linear warm-up steps (optimizer steps).
    pub warmup_steps: u64,
    /// `constant` or `cosine` (to 10 % of `lr` at the end of the run).
    pub schedule: String,
    /// Gradient-norm clip (0 = none).
    pub max_grad_norm: f64,
    /// Samples per forward/backward pass.
    pub micro_batch: usize,
    /// Optimizer steps per training step.
    pub mini_batches: usize,
    /// The critic's learning rate (PPO).
    pub critic_lr: f64,
    /// Skip the forward and backward passes of samples whose advantages are all zero
    /// (exact without a KL loss or entropy bonus; see `PolicyConfig::skip_zero_advantage`).
    pub skip_zero_advantage: bool,
}

impl Default for OptimSection {
    fn default() -> Self {
        OptimSection {
            lr: 1e-6,
            weight_decay: 0.0,
            warmup_steps: 0,
            schedule: "constant".into(),
            max_grad_norm: 1.0,
            micro_batch: 8,
            mini_batches: 1,
            critic_lr: 1e-5,
            skip_zero_advantage: true,
        }
    }
}

/// `[reward]`: reward functions and reward models, and their weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `numeric`, `exact`, `letters`, `model`, `judge`, or a list of them; empty = the
    /// task's default.
    pub kind: OneOrMany,
    /// One weight per kind (empty = all 1).
    pub weights: Vec<f64>,
    /// Characters the `letters` reward counts.
    pub letters: String,
    /// `kind = "model"`: HF directory of a scalar reward model (backbone + `score` head).
    pub model: String,
    /// `kind = "judge"`: HF directory of the judge LLM.
    pub judge_model: String,
    /// Judge prompt with `{question}`, `{response}`, `{rubric}` (empty = built-in).
    pub judge_template: String,
    /// What fills the template's `{rubric}`.
    pub judge_rubric: String,
    /// `generate` (greedy verdict, parsed; per-step scores) or `logits` (expected digit
    /// after a prefilled `Score: `).
    pub judge_mode: String,
    /// Most tokens of a generated verdict.
    pub judge_max_tokens: usize,
    /// Judge cache positions per sequence (judge prompt + verdict).
    pub judge_max_seq_len: usize,
    /// A verdict with no score: `error` (fail the step) or `fallback`.
    pub judge_on_unparsed: String,
    /// The normalised score a verdict with no score gets with `fallback`.
    pub judge_fallback_score: f64,
}

impl Default for RewardSection {
    fn default() -> Self {
        let judge = JudgeConfig::default();
        RewardSection {
            kind: OneOrMany::One(String::new()),
            weights: Vec::new(),
            letters: LETTERS.into(),
            model: String::new(),
            judge_model: String::new(),
            judge_template: String::new(),
            judge_rubric: judge.rubric,
            judge_mode: "generate".into(),
            judge_max_tokens: judge.max_tokens,
            judge_max_seq_len: 1024,
            judge_on_unparsed: "error".into(),
            judge_fallback_score: 0.0,
        }
    }
}

/// A string or a list of strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum OneOrMany {
    /// One value.
    One(String),
    /// Several values.
    Many(Vec<String>),
}

impl OneOrMany {
    fn items(&self) -> Vec<String> {
        match self {
            OneOrMany::One(s) if s.is_empty() => Vec::new(),
            OneOrMany::One(s) => vec![s.clone()],
            OneOrMany::Many(v) => v.clone(),
        }
    }
}

/// `[checkpoint]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save the policy every N steps (0 = only at the end).
    pub every: u64,
}

/// Characters the `letters` reward likes by default: 10 of the 95 printable ones.
pub const LETTERS: &str = "abcdefghij";

/// The character codec of the tiny model.
pub const TINY_CODEC: AsciiCodec = AsciiCodec {
    first_id: 2,
    bos: Some(0),
};

/// Fraction of the response's characters that are in a target set: a trivially
/// learnable reward that a tiny random model picks up in a few dozen steps.
#[derive(Debug, Clone)]
pub struct LettersReward {
    /// The target set.
    pub letters: String,
}

impl RewardFn for LettersReward {
    fn name(&self) -> &str {
        "letters"
    }
    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let n = s.response.chars().count().max(1) as f64;
        let hits = s
            .response
            .chars()
            .filter(|c| self.letters.contains(*c))
            .count() as f64;
        Ok(RewardOutput {
            score: hits / n,
            ..Default::default()
        })
    }
}

impl JobConfig {
    /// Parses TOML text, applies `--set key=value` overrides, then validates.
    pub fn parse(text: &str, origin: &str, sets: &[String]) -> Result<Self, JobError> {
        let mut table: toml::Table =
            text.parse().map_err(|e: toml::de::Error| JobError::Parse {
                origin: origin.into(),
                message: e.to_string(),
            })?;
        for arg in sets {
            apply_set(&mut table, arg)?;
        }
        // Round-trip through text so type errors carry the line and the key.
        let merged = toml::to_string(&table).map_err(|e| JobError::Parse {
            origin: origin.into(),
            message: e.to_string(),
        })?;
        let origin = if sets.is_empty() {
            origin.to_string()
        } else {
            format!("{origin} (with --set overrides)")
        };
        let cfg: JobConfig = toml::from_str(&merged).map_err(|e| {
            let key = e.span().and_then(|span| key_at(&merged, span.start));
            let message = match key {
                // With overrides the line numbers refer to the merged text: name the key.
                Some(k) if !sets.is_empty() => format!("key `{k}`: {}", e.message()),
                Some(k) => format!("key `{k}`: {e}"),
                None => e.to_string(),
            };
            JobError::Parse { origin, message }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a config file (see [`JobConfig::parse`]).
    pub fn load(path: impl AsRef<Path>, sets: &[String]) -> Result<Self, JobError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| JobError::Read {
            path: path.into(),
            source,
        })?;
        Self::parse(&text, &path.display().to_string(), sets)
    }

    /// Checks every value the types cannot.
    pub fn validate(&self) -> Result<(), JobError> {
        let j = &self.job;
        if j.placement != "colocate" {
            return Err(JobError::NotImplemented {
                key: "job.placement".into(),
                found: j.placement.clone(),
                fix: "set job.placement = \"colocate\"; to put roles on other nodes, set [placement] mode = \"disaggregated\" with a node per role and run `yatt train CONFIG --cluster SEED_ADDR`".into(),
            });
        }
        self.placement
            .validate(j.policy_replicas, self.algorithm.name == "ppo")?;
        if self.rollout.stream && self.placement.mode == "disaggregated" {
            return Err(invalid(
                "rollout.stream",
                "false with placement.mode = \"disaggregated\"",
                "true",
                "streaming works with in-process rollouts only (samples go through a channel, not QUIC): set rollout.stream = false, or placement.mode = \"colocate\"",
            ));
        }
        positive("job.steps", j.steps as f64, "the number of training steps")?;
        positive(
            "job.controllers",
            j.controllers as f64,
            "controllers = 1 for one head",
        )?;
        one_of("job.driver", &j.driver, &["parallel", "single"])?;
        if j.policy_replicas != 1 && (j.policy_replicas != j.controllers || j.driver != "parallel")
        {
            return Err(invalid(
                "job.policy_replicas",
                &format!(
                    "1, or job.controllers = {} with driver = \"parallel\"",
                    j.controllers
                ),
                &j.policy_replicas.to_string(),
                "use one policy replica per controller, or a shared one",
            ));
        }
        if self.model.dtype != "f32" {
            return Err(JobError::NotImplemented {
                key: "model.dtype".into(),
                found: self.model.dtype.clone(),
                fix: "use dtype = \"f32\"".into(),
            });
        }
        positive(
            "model.threads",
            self.model.threads as f64,
            "threads = 1 or more",
        )?;
        positive(
            "model.max_seq_len",
            self.model.max_seq_len as f64,
            "e.g. max_seq_len = 256",
        )?;
        if self.model.source != "tiny" && !Path::new(&self.model.source).is_dir() {
            return Err(invalid(
                "model.source",
                "\"tiny\" or an existing HF model directory",
                &self.model.source,
                "point it at a directory with config.json, *.safetensors and tokenizer.json",
            ));
        }
        if self.data.jsonl.is_empty() {
            one_of(
                "data.task",
                &self.data.task,
                &["addition", "sorting", "reversal", "letters", "growing"],
            )?;
            positive(
                "data.num_prompts",
                self.data.num_prompts as f64,
                "e.g. num_prompts = 256",
            )?;
            if self.data.task != "letters" {
                positive("data.length", self.data.length as f64, "e.g. length = 2")?;
            }
        }
        positive(
            "data.prompts_per_step",
            self.data.prompts_per_step as f64,
            "e.g. prompts_per_step = 8",
        )?;
        positive(
            "data.samples_per_prompt",
            self.data.samples_per_prompt as f64,
            "e.g. samples_per_prompt = 8",
        )?;
        positive(
            "rollout.max_new_tokens",
            self.rollout.max_new_tokens as f64,
            "e.g. max_new_tokens = 64",
        )?;
        positive(
            "rollout.temperature",
            self.rollout.temperature,
            "e.g. temperature = 1.0",
        )?;
        if !(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0) {
            return Err(invalid(
                "rollout.top_p",
                "a number in (0, 1]",
                &self.rollout.top_p.to_string(),
                "top_p = 1.0 turns it off",
            ));
        }
        let a = &self.algorithm;
        one_of(
            "algorithm.name",
            &a.name,
            &["grpo", "rloo", "reinforce++", "ppo", "dapo"],
        )?;
        if a.name == "ppo" && self.job.controllers > 1 && self.job.driver == "parallel" {
            return Err(invalid(
                "job.controllers",
                "1 with algorithm.name = \"ppo\"",
                &self.job.controllers.to_string(),
                "the critic trains with one controller for now: set controllers = 1, or use grpo",
            ));
        }
        for (key, v) in [("algorithm.gamma", a.gamma), ("algorithm.lam", a.lam)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(invalid(
                    key,
                    "a number in [0, 1]",
                    &v.to_string(),
                    "e.g. 1.0 for gamma, 0.95 for lam",
                ));
            }
        }
        non_negative("algorithm.value_clip", a.value_clip)?;
        positive(
            "algorithm.max_sampling_rounds",
            a.max_sampling_rounds as f64,
            "e.g. max_sampling_rounds = 4",
        )?;
        if a.overlong_buffer > self.rollout.max_new_tokens {
            return Err(invalid(
                "algorithm.overlong_buffer",
                &format!(
                    "at most rollout.max_new_tokens = {}",
                    self.rollout.max_new_tokens
                ),
                &a.overlong_buffer.to_string(),
                "use a buffer of a quarter of max_new_tokens, or 0 to turn the penalty off",
            ));
        }
        non_negative("algorithm.overlong_coef", a.overlong_coef)?;
        one_of(
            "algorithm.kl_estimator",
            &a.kl_estimator,
            &["k1", "k2", "k3"],
        )?;
        one_of("algorithm.kl_mode", &a.kl_mode, &["loss", "reward", "none"])?;
        one_of(
            "algorithm.loss_agg",
            &a.loss_agg,
            &["token-mean", "seq-mean-token-mean"],
        )?;
        one_of(
            "algorithm.old_logprobs",
            &a.old_logprobs,
            &["recompute", "on-policy"],
        )?;
        if a.old_logprobs == "on-policy" && self.optim.mini_batches != 1 {
            return Err(invalid(
                "algorithm.old_logprobs",
                "\"recompute\" when optim.mini_batches > 1",
                "\"on-policy\"",
                "set optim.mini_batches = 1, or old_logprobs = \"recompute\"",
            ));
        }
        non_negative("algorithm.clip_low", a.clip_low)?;
        non_negative("algorithm.clip_high", a.clip_high)?;
        non_negative("algorithm.kl_coef", a.kl_coef)?;
        let o = &self.optim;
        positive(
            "optim.lr",
            o.lr,
            "e.g. lr = 1e-6 for a real model, 3e-3 for the tiny one",
        )?;
        non_negative("optim.weight_decay", o.weight_decay)?;
        non_negative("optim.max_grad_norm", o.max_grad_norm)?;
        positive("optim.critic_lr", o.critic_lr, "e.g. critic_lr = 1e-5")?;
        one_of("optim.schedule", &o.schedule, &["constant", "cosine"])?;
        positive(
            "optim.micro_batch",
            o.micro_batch as f64,
            "e.g. micro_batch = 8",
        )?;
        positive(
            "optim.mini_batches",
            o.mini_batches as f64,
            "mini_batches = 1 for one optimizer step per step",
        )?;
        let batch = self.data.prompts_per_step * self.data.samples_per_prompt as usize;
        if batch % o.mini_batches != 0 {
            return Err(invalid(
                "optim.mini_batches",
                &format!("a divisor of prompts_per_step × samples_per_prompt = {batch}"),
                &o.mini_batches.to_string(),
                "pick a divisor of the batch",
            ));
        }
        let kinds = self.reward_kinds();
        for k in &kinds {
            one_of(
                "reward.kind",
                k,
                &["numeric", "exact", "letters", "model", "judge"],
            )?;
        }
        self.validate_reward_models(&kinds)?;
        if !self.reward.weights.is_empty() && self.reward.weights.len() != kinds.len() {
            return Err(invalid(
                "reward.weights",
                &format!("{} weight(s), one per reward.kind", kinds.len()),
                &format!("{} weight(s)", self.reward.weights.len()),
                "give one weight per kind, or leave weights out for all 1",
            ));
        }
        if kinds.iter().any(|k| k == "letters") && self.reward.letters.is_empty() {
            return Err(invalid(
                "reward.letters",
                "a non-empty set of characters",
                "\"\"",
                "e.g. letters = \"abcdefghij\"",
            ));
        }
        Ok(())
    }

    /// The `model` and `judge` reward keys.
    fn validate_reward_models(&self, kinds: &[String]) -> Result<(), JobError> {
        let r = &self.reward;
        for (kind, key, dir) in [
            ("model", "reward.model", &r.model),
            ("judge", "reward.judge_model", &r.judge_model),
        ] {
            let used = kinds.iter().any(|k| k == kind);
            if !used && !dir.is_empty() {
                return Err(invalid(
                    key,
                    &format!("empty unless reward.kind includes \"{kind}\""),
                    dir,
                    &format!("add \"{kind}\" to reward.kind (with a weight in reward.weights), or remove {key}"),
                ));
            }
            if used && !Path::new(dir).join("config.json").is_file() {
                let how = if kind == "model" {
                    "train one with `yatt reward-model --out DIR` (or yatt_roles::builtin::train_reward_model and save_pretrained) and set reward.model = \"DIR\""
                } else {
                    "set reward.judge_model to an HF model directory (config.json, model.safetensors, tokenizer.json)"
                };
                return Err(invalid(
                    key,
                    "an existing HF model directory with config.json",
                    &format!("{dir:?}"),
                    how,
                ));
            }
        }
        if kinds.iter().any(|k| k == "judge") {
            one_of("reward.judge_mode", &r.judge_mode, &["generate", "logits"])?;
            one_of(
                "reward.judge_on_unparsed",
                &r.judge_on_unparsed,
                &["error", "fallback"],
            )?;
            positive(
                "reward.judge_max_tokens",
                r.judge_max_tokens as f64,
                "e.g. judge_max_tokens = 128",
            )?;
            positive(
                "reward.judge_max_seq_len",
                r.judge_max_seq_len as f64,
                "e.g. judge_max_seq_len = 1024 (judge prompt + verdict)",
            )?;
            if !(0.0..=1.0).contains(&r.judge_fallback_score) {
                return Err(invalid(
                    "reward.judge_fallback_score",
                    "a number in [0, 1] (scores are normalised)",
                    &r.judge_fallback_score.to_string(),
                    "e.g. judge_fallback_score = 0.0",
                ));
            }
            if !r.judge_template.is_empty() {
                JudgeTemplate::new(r.judge_template.clone()).map_err(|e| {
                    invalid(
                        "reward.judge_template",
                        "a template with a {response} placeholder",
                        &format!("{:?}", crate::reward::excerpt(&r.judge_template, 60)),
                        &e.to_string(),
                    )
                })?;
            }
        }
        Ok(())
    }

    /// The reward kinds, with the task's default when none is given.
    pub fn reward_kinds(&self) -> Vec<String> {
        let k = self.reward.kind.items();
        if !k.is_empty() {
            return k;
        }
        let default = match (self.data.jsonl.is_empty(), self.data.task.as_str()) {
            (false, _) | (true, "addition") => "numeric",
            (true, "letters") => "letters",
            _ => "exact",
        };
        vec![default.into()]
    }
}

/// The dotted key (`section.key`) of the line holding byte `pos` of a TOML text.
fn key_at(text: &str, pos: usize) -> Option<String> {
    let before = text.get(..pos)?;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next()?.trim();
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"'))
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    let section = before[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim());
    match (section, key) {
        (Some(s), Some(k)) => Some(format!("{s}.{k}")),
        (None, Some(k)) => Some(k.to_string()),
        _ => None,
    }
}

pub(crate) fn invalid(key: &str, expected: &str, found: &str, fix: &str) -> JobError {
    JobError::Invalid {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.into(),
    }
}

pub(crate) fn positive(key: &str, v: f64, fix: &str) -> Result<(), JobError> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(key, "a positive number", &v.to_string(), fix))
    }
}

fn non_negative(key: &str, v: f64) -> Result<(), JobError> {
    if v >= 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(
            key,
            "a number ≥ 0",
            &v.to_string(),
            "use 0 to turn it off",
        ))
    }
}

pub(crate) fn one_of(key: &str, v: &str, allowed: &[&str]) -> Result<(), JobError> {
    if allowed.contains(&v) {
        Ok(())
    } else {
        let list = allowed
            .iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ");
        Err(invalid(
            key,
            &format!("one of {list}"),
            &format!("\"{v}\""),
            &format!("set {key} = \"{}\"", allowed[0]),
        ))
    }
}

/// Applies one `key=value` override (dotted key, TOML value; a bare word that is not
/// valid TOML is taken as a string). The key must exist in the schema.
fn apply_set(table: &mut toml::Table, arg: &str) -> Result<(), JobError> {
    let err = |reason: String| JobError::Set {
        arg: arg.into(),
        reason,
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value, e.g. job.steps=10".into()))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() != 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err(format!(
            "key `{key}`: expected section.key, e.g. job.steps"
        )));
    }
    let schema = toml::Value::try_from(JobConfig::default()).map_err(|e| err(e.to_string()))?;
    let section = schema
        .get(parts[0])
        .and_then(|s| s.as_table())
        .ok_or_else(|| {
            let names: Vec<&String> = schema
                .as_table()
                .map(|t| t.keys().collect())
                .unwrap_or_default();
            err(format!(
                "unknown key `{key}`: there is no section [{}]; sections are {names:?}",
                parts[0]
            ))
        })?;
    if !section.contains_key(parts[1]) {
        let names: Vec<&String> = section.keys().collect();
        return Err(err(format!(
            "unknown key `{key}`: [{}] has {names:?}",
            parts[0]
        )));
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    };
    let entry = table
        .entry(parts[0].to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(sec) = entry else {
        return Err(err(format!("`{}` in the config is not a table", parts[0])));
    };
    sec.insert(parts[1].to_string(), value);
    Ok(())
}

/// The job's training prompts (the synthetic task with the job seed, or the JSONL file).
pub(crate) fn prompts(job: &JobConfig) -> Result<Vec<Prompt>, JobError> {
    let d = &job.data;
    if !d.jsonl.is_empty() {
        return Ok(load_jsonl(&d.jsonl)?);
    }
    let kind = match d.task.as_str() {
        "letters" => {
            return Ok((0..d.num_prompts as u64)
                .map(|i| Prompt {
                    id: 1000 + i,
                    text: format!("q{i}:"),
                    reference: None,
                    metadata: serde_json::Value::Null,
                })
                .collect())
        }
        "growing" => return Ok(growing_task(job).prompts(d.num_prompts)),
        "addition" => SyntheticTaskKind::Addition,
        "sorting" => SyntheticTaskKind::Sorting { max_value: 99 },
        "reversal" => SyntheticTaskKind::Reversal,
        other => {
            return Err(invalid(
                "data.task",
                "addition, sorting, reversal or letters",
                other,
                "set data.task = \"letters\"",
            ))
        }
    };
    let task = SyntheticTask::new(kind, LengthSchedule::Constant(d.length), job.job.seed)?;
    Ok(task.prompts(0, d.num_prompts))
}

/// The `growing` task of the job: target length from `data.length` to
/// `data.length_end` over the run's steps.
pub fn growing_task(job: &JobConfig) -> crate::data::GrowingLength {
    let d = &job.data;
    let end = if d.length_end == 0 {
        d.length
    } else {
        d.length_end
    };
    crate::data::GrowingLength {
        target: LengthSchedule::Linear {
            start: d.length,
            end,
            steps: job.job.steps.saturating_sub(1).max(1),
        },
    }
}

/// Spawns the job's reward role on `node`: the `growing` task's length reward, or the
/// reward functions of `reward.kind`.
pub(crate) async fn spawn_reward(
    job: &JobConfig,
    node: &Node,
    group: DeviceGroup,
) -> Result<crate::controller::SamplesRef, JobError> {
    if job.data.jsonl.is_empty() && job.data.task == "growing" {
        let role = crate::placement_live::GrowingLengthReward(growing_task(job));
        return Ok(spawn_role(node, role, 0, group).await?);
    }
    Ok(spawn_role(node, reward_role(job)?, 0, group).await?)
}

/// The job's reward role: its reward functions and reward models with their weights.
/// Models load here (on the role's thread when built through a factory).
pub fn reward_role(job: &JobConfig) -> Result<RewardRole, JobError> {
    let kinds = job.reward_kinds();
    let mut parts: Vec<(f64, Box<dyn RewardFn>)> = Vec::new();
    let mut models: Vec<(f64, Box<dyn ModelScorer>)> = Vec::new();
    for (i, k) in kinds.iter().enumerate() {
        let w = job.reward.weights.get(i).copied().unwrap_or(1.0);
        let f: Box<dyn RewardFn> = match k.as_str() {
            "numeric" => Box::new(NumericVerifier::default()),
            "exact" => Box::new(ExactMatchVerifier::default()),
            "model" => {
                models.push((w, Box::new(reward_model(job)?)));
                continue;
            }
            "judge" => {
                models.push((w, Box::new(judge(job)?)));
                continue;
            }
            _ => Box::new(LettersReward {
                letters: job.reward.letters.clone(),
            }),
        };
        parts.push((w, f));
    }
    RewardRole::with_models(parts, models).map_err(|e| {
        invalid(
            "reward.kind",
            "a valid reward combination",
            &format!("{kinds:?}"),
            &e.to_string(),
        )
    })
}

/// The codec a reward model or judge in `dir` reads text with: its own tokenizer (with
/// the chat template when `model.chat` is on), else the policy's codec.
fn reward_codec(job: &JobConfig, dir: &Path) -> Result<Arc<dyn TextCodec>, JobError> {
    let from = if dir.join("tokenizer.json").is_file() {
        dir.to_path_buf()
    } else if job.model.source == "tiny" {
        return Ok(Arc::new(TINY_CODEC));
    } else {
        PathBuf::from(&job.model.source)
    };
    let tok = Tokenizer::from_dir(&from).map_err(|e| JobError::Model {
        source_desc: from.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(Arc::new(TokenizerCodec {
        tokenizer: Arc::new(tok),
        chat: job.model.chat,
    }))
}

/// The job's scalar reward model (`reward.model`).
fn reward_model(job: &JobConfig) -> Result<ScalarRewardModel, JobError> {
    let dir = Path::new(&job.reward.model);
    let codec = reward_codec(job, dir)?;
    ScalarRewardModel::load(dir, Device::Cpu, codec, 0, job.optim.micro_batch).map_err(|e| {
        invalid(
            "reward.model",
            "an HF directory of a reward model (a `score` head)",
            &format!("{:?}", job.reward.model),
            &e.to_string(),
        )
    })
}

/// The job's LLM judge (`reward.judge_model`).
fn judge(job: &JobConfig) -> Result<JudgeScorer, JobError> {
    let r = &job.reward;
    let dir = Path::new(&r.judge_model);
    let codec = reward_codec(job, dir)?;
    let model = crate::builtin::reward_model::load_model(dir, Device::Cpu).map_err(|e| {
        invalid(
            "reward.judge_model",
            "an HF model directory",
            &format!("{:?}", r.judge_model),
            &e.to_string(),
        )
    })?;
    let batch = job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    let generator = Generator::new(
        model,
        GeneratorConfig {
            max_batch: batch.clamp(1, 32),
            max_seq_len: r.judge_max_seq_len,
            ..Default::default()
        },
    );
    let template = if r.judge_template.is_empty() {
        JudgeTemplate::default()
    } else {
        JudgeTemplate::new(r.judge_template.clone())?
    };
    let config = JudgeConfig {
        template,
        rubric: r.judge_rubric.clone(),
        max_tokens: r.judge_max_tokens,
        mode: if r.judge_mode == "logits" {
            JudgeMode::DigitLogits
        } else {
            JudgeMode::Generate
        },
        on_unparsed: if r.judge_on_unparsed == "fallback" {
            OnUnparsed::Fallback(r.judge_fallback_score)
        } else {
            OnUnparsed::Error
        },
        ..Default::default()
    };
    JudgeScorer::new(generator, codec, config, 0).map_err(|e| {
        invalid(
            "reward.judge_model",
            "a judge model that can score",
            &format!("{:?}", r.judge_model),
            &e.to_string(),
        )
    })
}

fn loss_agg(s: &str) -> LossAgg {
    if s == "seq-mean-token-mean" {
        LossAgg::SeqMeanTokenMean
    } else {
        LossAgg::TokenMean
    }
}

fn kl_estimator(s: &str) -> KlEstimator {
    match s {
        "k1" => KlEstimator::K1,
        "k2" => KlEstimator::K2,
        _ => KlEstimator::K3,
    }
}

/// The job's model (every role starts from a copy of it), the codec of its text and its
/// padding id.
pub fn base_model(job: &JobConfig) -> Result<(Llama, Arc<dyn TextCodec>, i64), JobError> {
    tch::set_num_threads(job.model.threads as i32);
    let seed = job.job.seed;
    if job.model.source == "tiny" {
        // Llama::random seeds libtorch's global RNG: builds in parallel must not
        // interleave their draws.
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
        let mut config = tiny_config();
        if job.model.tiny_layers > 0 {
            // Through the JSON, so a checkpoint's config.json (written from it) says
            // the same depth and loads back as this model.
            let mut raw = config.raw.clone();
            raw["num_hidden_layers"] = serde_json::json!(job.model.tiny_layers);
            config = yatt_engine::ModelConfig::from_json(&raw).map_err(|e| JobError::Model {
                source_desc: "tiny".into(),
                reason: e,
            })?;
        }
        let m = Llama::random(config, Device::Cpu, Kind::Float, seed as i64).map_err(|e| {
            JobError::Model {
                source_desc: "tiny".into(),
                reason: e.to_string(),
            }
        })?;
        return Ok((m, Arc::new(TINY_CODEC), 1));
    }
    let dir = &job.model.source;
    let me = |e: yatt_engine::EngineError| JobError::Model {
        source_desc: dir.clone(),
        reason: e.to_string(),
    };
    let m = Llama::load(dir, Device::Cpu, Kind::Float).map_err(me)?;
    let tok = Tokenizer::from_dir(dir).map_err(me)?;
    Ok((
        m,
        Arc::new(TokenizerCodec {
            tokenizer: Arc::new(tok),
            chat: job.model.chat,
        }),
        0,
    ))
}

/// A rollout replica of the job over `model`.
pub fn rollout_role(job: &JobConfig, model: Llama, codec: Arc<dyn TextCodec>) -> RolloutRole {
    let mut batch = job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    if job.rollout.max_batch > 0 {
        batch = batch.min(job.rollout.max_batch);
    }
    let gen_config = GeneratorConfig {
        max_batch: batch.max(1),
        max_seq_len: job.model.max_seq_len,
        ..Default::default()
    };
    RolloutRole::new(Generator::new(model, gen_config), codec)
}

/// The job's reference role over `model`.
pub fn reference_role(job: &JobConfig, model: Llama, pad_id: i64) -> ReferenceRole {
    ReferenceRole::new(
        model,
        pad_id,
        job.rollout.temperature,
        job.optim.micro_batch,
    )
}

/// The policy's optimizer settings.
pub(crate) fn train_config(job: &JobConfig) -> TrainConfig {
    let o = &job.optim;
    let warmup_steps = o.warmup_steps;
    let schedule = match o.schedule.as_str() {
        "cosine" => LrSchedule::Cosine {
            warmup_steps,
            total_steps: job.job.steps * o.mini_batches as u64,
            min_ratio: 0.1,
        },
        _ => LrSchedule::Constant { warmup_steps },
    };
    TrainConfig {
        lr: o.lr,
        weight_decay: o.weight_decay,
        max_grad_norm: (o.max_grad_norm > 0.0).then_some(o.max_grad_norm),
        schedule,
        seed: job.job.seed,
        ..Default::default()
    }
}

/// Role name of a policy replica's ring inbox (its end of the gradient all-reduce).
pub const POLICY_RING: &str = "policy-ring";

/// A policy replica's ring member: its inbox on `node`, as `node/policy-ring/replica`.
pub(crate) fn policy_ring(node: &Node, replica: u32) -> Result<RingMember, JobError> {
    RingMember::start(node, POLICY_RING, replica).map_err(|e| {
        JobError::Controller(Box::new(ControllerError::Spawn {
            role: format!("{POLICY_RING} {replica}"),
            reason: e.to_string(),
        }))
    })
}

/// The job's policy role: a fresh trainer over `model` with the job's optimizer and loss.
pub fn policy_role(job: &JobConfig, model: Llama, pad_id: i64) -> Result<PolicyRole, JobError> {
    policy_role_from(job, Trainer::new(model, train_config(job)), pad_id)
}

/// The job's policy role over `trainer` (fresh, or loaded from a checkpoint).
pub fn policy_role_from(
    job: &JobConfig,
    trainer: Trainer,
    pad_id: i64,
) -> Result<PolicyRole, JobError> {
    let a = &job.algorithm;
    let o = &job.optim;
    let policy_config = PolicyConfig {
        loss: PolicyLossConfig {
            clip_low: a.clip_low,
            clip_high: a.clip_high,
            agg: loss_agg(&a.loss_agg),
            ..Default::default()
        },
        kl_loss: kl_term(job)
            .filter(|_| a.kl_mode == "loss")
            .map(|(estimator, coef)| KlLossConfig { estimator, coef }),
        entropy_coef: a.entropy_coef,
        micro_batch_size: o.micro_batch,
        mini_batches: o.mini_batches,
        temperature: job.rollout.temperature,
        pad_id,
        on_policy: a.old_logprobs == "on-policy",
        tokenizer_dir: (job.model.source != "tiny").then(|| PathBuf::from(&job.model.source)),
        skip_zero_advantage: o.skip_zero_advantage,
        ..Default::default()
    };
    PolicyRole::new(trainer, policy_config).map_err(|e| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: format!("policy role: {e}"),
    })
}

/// The job's critic (PPO) over `trainer`; `None` gives a fresh one over `model`.
pub fn critic_role(
    job: &JobConfig,
    model: Llama,
    trainer: Option<Trainer>,
    pad_id: i64,
) -> Result<CriticRole, JobError> {
    let a = &job.algorithm;
    let o = &job.optim;
    let trainer = trainer.unwrap_or_else(|| {
        Trainer::new(
            model,
            TrainConfig {
                lr: o.critic_lr,
                ..train_config(job)
            },
        )
    });
    let config = CriticConfig {
        loss: ValueLossConfig {
            clip: (a.value_clip > 0.0).then_some(a.value_clip),
            agg: loss_agg(&a.loss_agg),
        },
        micro_batch_size: o.micro_batch,
        mini_batches: o.mini_batches,
        pad_id,
    };
    CriticRole::new(trainer, config).map_err(|e| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: format!("critic role: {e}"),
    })
}

/// The KL term's estimator and coefficient, when the job has one.
fn kl_term(job: &JobConfig) -> Option<(KlEstimator, f64)> {
    let a = &job.algorithm;
    (a.kl_coef > 0.0).then(|| (kl_estimator(&a.kl_estimator), a.kl_coef))
}

/// What each controller of the job runs.
pub(crate) fn controller_config(job: &JobConfig) -> ControllerConfig {
    let a = &job.algorithm;
    let advantage = match a.name.as_str() {
        "rloo" => AdvantageEstimator::Rloo,
        "reinforce++" => AdvantageEstimator::ReinforcePp(ReinforcePpConfig::default()),
        "ppo" => AdvantageEstimator::Gae(GaeConfig {
            gamma: a.gamma,
            lam: a.lam,
            ..Default::default()
        }),
        _ => AdvantageEstimator::Grpo(GrpoConfig::default()),
    };
    let r = &job.rollout;
    ControllerConfig {
        prompts_per_step: job.data.prompts_per_step,
        n: job.data.samples_per_prompt,
        sampling: SamplingParams {
            temperature: r.temperature as f32,
            top_p: r.top_p as f32,
            top_k: r.top_k,
            max_new_tokens: r.max_new_tokens,
            ignore_eos: r.ignore_eos,
            ..Default::default()
        },
        seed: job.job.seed,
        advantage,
        kl_in_reward: kl_term(job)
            .filter(|_| a.kl_mode == "reward")
            .map(|(estimator, coef)| KlPenalty { estimator, coef }),
        kl_metric: kl_estimator(&a.kl_estimator),
        dynamic_sampling: a.dynamic_sampling.unwrap_or(a.name == "dapo").then_some(
            DynamicSamplingConfig {
                max_rounds: a.max_sampling_rounds,
                tolerance: 1e-6,
            },
        ),
        overlong: (a.overlong_buffer > 0).then_some(OverlongConfig {
            max_len: r.max_new_tokens,
            buffer: a.overlong_buffer,
            coef: a.overlong_coef,
        }),
        stream: r.stream,
        ..Default::default()
    }
}

/// The job's controllers over running roles: with `driver = "parallel"`, one per
/// rollout (data-parallel head), each with its shard of the prompts, sharing the other
/// roles of `shared` (each head gets its own policy from `policies` when there is one
/// per head); with `driver = "single"`, one driver with the global batch over every
/// rollout.
pub(crate) fn controllers(
    job: &JobConfig,
    shared: RoleRefs,
    mut rollouts: Vec<RolloutRef>,
    policies: Vec<PolicyRef>,
) -> Result<Vec<Controller>, JobError> {
    let config = controller_config(job);
    let all: Arc<[Prompt]> = prompts(job)?.into();
    let heads = rollouts.len();
    let seed = job.job.seed.wrapping_add(3);
    if job.job.driver == "single" {
        let loader = Dataloader::new(all, 0, 1, seed)?;
        let roles = RoleRefs {
            rollout: rollouts.remove(0),
            extra_rollouts: rollouts,
            ..shared
        };
        let config = ControllerConfig {
            prompts_per_step: config.prompts_per_step * heads,
            ..config
        };
        return Ok(vec![Controller::new(config, loader, roles)?]);
    }
    let mut controllers = Vec::with_capacity(heads);
    for (i, rollout) in rollouts.into_iter().enumerate() {
        let loader = Dataloader::new(all.clone(), i, heads, seed)?;
        let roles = RoleRefs {
            rollout,
            policy: policies
                .get(i)
                .cloned()
                .unwrap_or_else(|| shared.policy.clone()),
            ..shared.clone()
        };
        controllers.push(Controller::new(config.clone(), loader, roles)?);
    }
    Ok(controllers)
}

/// Builds the models, roles (on `node`, with `spawn_local`) and the controllers of an
/// embedded job: one policy (or one per head), reference, reward and (PPO) critic role,
/// and one rollout role per data-parallel head.
pub async fn build_embedded(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    build_embedded_with(job, node, None, &CustomRoles::default()).await
}

/// Roles a program brings itself in place of the built-in ones (see
/// `examples/custom_role`). They must already run (e.g. started with
/// [`spawn_role`] or `Node::spawn_remote`).
#[derive(Debug, Clone, Default)]
pub struct CustomRoles {
    /// The reward role: takes the step's samples and gives them back with `reward` set.
    pub reward: Option<crate::controller::SamplesRef>,
}

/// [`build_embedded`] with `custom` roles, resuming from the run directory `resume`
/// when given: the policy (weights, optimizer, step), the critic and every
/// controller's position come from `RESUME/checkpoint`, the rollouts start with the
/// policy's weights, and the reference is rebuilt from `model.source` (it is the
/// initial policy).
pub async fn build_embedded_with(
    job: &JobConfig,
    node: &Node,
    resume: Option<&Path>,
    custom: &CustomRoles,
) -> Result<Vec<Controller>, JobError> {
    job.validate()?;
    if job.placement.mode != "colocate" {
        return Err(invalid(
            "placement.mode",
            "\"colocate\" for a run in this process",
            &job.placement.mode,
            "run it on a cluster with `yatt train CONFIG --cluster SEED_ADDR`, or set placement.mode = \"colocate\"",
        ));
    }
    let (model, codec, pad_id) = base_model(job)?;
    let me = |e: yatt_engine::EngineError| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: e.to_string(),
    };
    let ckpt = resume.map(|d| d.join("checkpoint"));
    let load = |role: &str| -> Result<Option<Trainer>, JobError> {
        match &ckpt {
            Some(dir) if role == "critic" => Ok(Some(load_trainer(&dir.join("critic"), role)?)),
            Some(dir) => Ok(Some(load_trainer(dir, role)?)),
            None => Ok(None),
        }
    };
    // Every policy replica starts from the same trainer (fresh or resumed).
    let mut trainers = Vec::with_capacity(job.job.policy_replicas);
    for _ in 0..job.job.policy_replicas {
        trainers.push(match load("policy")? {
            Some(t) => t,
            None => Trainer::new(
                model.deep_copy(Device::Cpu, Kind::Float).map_err(me)?,
                train_config(job),
            ),
        });
    }
    let g = || DeviceGroup::cpu(node.name());
    // Rollouts start from the policy's weights (the initial model, or the checkpoint).
    let mut rollouts = Vec::with_capacity(job.job.controllers);
    for i in 0..job.job.controllers {
        let m = trainers[0]
            .model
            .deep_copy(Device::Cpu, Kind::Float)
            .map_err(me)?;
        let role = rollout_role(job, m, codec.clone());
        rollouts.push(spawn_role(node, role, i as u32, g()).await?);
    }
    let critic = if job.algorithm.name == "ppo" {
        let m = model.deep_copy(Device::Cpu, Kind::Float).map_err(me)?;
        let role = critic_role(job, m, load("critic")?, pad_id)?;
        Some(spawn_role(node, role, 0, g()).await?)
    } else {
        None
    };
    let replicated = trainers.len() > 1;
    let mut policies = Vec::with_capacity(trainers.len());
    for (i, t) in trainers.into_iter().enumerate() {
        let mut role = policy_role_from(job, t, pad_id)?;
        if replicated {
            role = role.with_ring(policy_ring(node, i as u32)?);
        }
        policies.push(spawn_role(node, role, i as u32, g()).await?);
    }
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward: match &custom.reward {
            Some(r) => r.clone(),
            None => spawn_reward(job, node, g()).await?,
        },
        // The reference is the initial policy, also when resuming; with no KL term
        // there is nothing to hold or run.
        reference: match job.algorithm.kl_mode.as_str() {
            "none" => None,
            _ => Some(spawn_role(node, reference_role(job, model, pad_id), 0, g()).await?),
        },
        policy: policies[0].clone(),
        critic,
    };
    let mut controllers = controllers(job, shared, rollouts, policies)?;
    if replicated {
        join_policy_ring(&mut controllers, RING_CHUNK_BYTES).await?;
    }
    if let Some(dir) = &ckpt {
        let state = RunState::read(dir)?;
        if state.controllers.len() != controllers.len() {
            return Err(JobError::Resume {
                dir: dir.clone(),
                reason: format!(
                    "the checkpoint has {} controller(s) but the job has {}; resume with the same job.controllers and job.driver",
                    state.controllers.len(),
                    controllers.len(),
                ),
            });
        }
        for (c, s) in controllers.iter_mut().zip(state.controllers) {
            c.restore(s)?;
            // The rollout must hold the restored policy's weights and version.
            c.sync_weights().await?;
        }
    }
    Ok(controllers)
}

/// Builds the job where its placement says: in this process (`colocate`), or on the
/// cluster `node` belongs to (`disaggregated`, see [`crate::remote::build_cluster`]).
pub async fn build(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    match job.placement.mode.as_str() {
        "disaggregated" => crate::remote::build_cluster(job, node).await,
        _ => build_embedded(job, node).await,
    }
}

/// Runs `steps` steps of `controllers` (together with [`step_data_parallel`] when there
/// are several) and calls `on_step` with each step's metrics (averaged over the heads).
pub async fn run_steps(
    controllers: &mut [Controller],
    steps: u64,
    mut on_step: impl FnMut(&StepMetrics) -> Result<(), JobError>,
) -> Result<(), JobError> {
    for _ in 0..steps {
        let metrics = if controllers.len() == 1 {
            controllers[0].step().await?.metrics
        } else {
            let reports = step_data_parallel(controllers).await?;
            let mut sum: BTreeMap<String, (f64, usize)> = BTreeMap::new();
            for r in &reports {
                for (k, v) in &r.metrics.values {
                    let e = sum.entry(k.clone()).or_insert((0.0, 0));
                    e.0 += v;
                    e.1 += 1;
                }
            }
            let step = reports.first().map(|r| r.metrics.step).unwrap_or(0);
            StepMetrics {
                step,
                values: sum
                    .into_iter()
                    .map(|(k, (s, n))| (k, s / n as f64))
                    .collect(),
            }
        };
        on_step(&metrics)?;
    }
    Ok(())
}

/// One finished step, as [`train`] reports it.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// 1-based step number.
    pub step: u64,
    /// Total steps.
    pub total: u64,
    /// Seconds since this session's first step started.
    pub elapsed_s: f64,
    /// Steps already done when this session began (a resumed run's checkpoint step;
    /// 0 for a fresh run): `elapsed_s` covers the steps after it.
    pub first_step: u64,
    /// The step's metrics.
    pub metrics: &'a StepMetrics,
}

/// What a finished run produced.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Steps run.
    pub steps: u64,
    /// `OUTPUT_DIR/metrics.jsonl`.
    pub metrics_path: PathBuf,
    /// `OUTPUT_DIR/checkpoint`.
    pub checkpoint_dir: PathBuf,
    /// Seconds of the steps (not counting set-up).
    pub seconds: f64,
    /// `critic/rewards/mean` of every step.
    pub rewards: Vec<f64>,
}

/// Builds the job on `node` and runs it: writes one JSON object per step to
/// `OUTPUT_DIR/metrics.jsonl` and the same metrics as TensorBoard scalars to
/// `OUTPUT_DIR/events.out.tfevents.*` (see [`yatt_metrics::RunWriter`]), saves the policy to `OUTPUT_DIR/checkpoint` every
/// `checkpoint.every` steps and at the end, and calls `on_step` after each step.
pub async fn train(
    job: &JobConfig,
    node: &Node,
    on_step: impl FnMut(&Progress<'_>),
) -> Result<TrainSummary, JobError> {
    train_with(job, node, TrainOptions::default(), on_step).await
}

/// How [`train_with`] runs a job.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Continue the run in `job.output_dir` from its checkpoint: steps already done
    /// are skipped (`job.steps` is the run's total) and metrics are appended.
    pub resume: bool,
    /// Roles the caller brings in place of the built-in ones.
    pub roles: CustomRoles,
}

/// [`train`] with options: resuming, custom roles.
pub async fn train_with(
    job: &JobConfig,
    node: &Node,
    options: TrainOptions,
    mut on_step: impl FnMut(&Progress<'_>),
) -> Result<TrainSummary, JobError> {
    let resume = options.resume;
    let out = job.job.output_dir.clone();
    std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
        path: out.clone(),
        source,
    })?;
    let job_path = out.join(JOB_FILE);
    let text = toml::to_string(job).map_err(|e| JobError::Resume {
        dir: out.clone(),
        reason: format!("cannot write the job config: {e}"),
    })?;
    std::fs::write(&job_path, text).map_err(|source| JobError::Write {
        path: job_path.clone(),
        source,
    })?;
    let metrics_err = |e: WriteError| JobError::Write {
        path: e.path,
        source: e.source,
    };
    let checkpoint_dir = out.join("checkpoint");
    if job.placement.live && (resume || options.roles.reward.is_some()) {
        return Err(JobError::NotImplemented {
            key: "placement.live".into(),
            found: "true".into(),
            fix: "resume and custom roles work without live placement for now".into(),
        });
    }
    // Live placement owns the heads and re-routes them between steps.
    let mut live = if job.placement.live {
        Some(crate::placement_live::LivePlacement::build(job, node).await?)
    } else {
        None
    };
    let mut controllers = if live.is_some() {
        Vec::new()
    } else if job.placement.mode == "disaggregated" {
        if resume || options.roles.reward.is_some() {
            return Err(JobError::NotImplemented {
                key: "placement.mode".into(),
                found: job.placement.mode.clone(),
                fix: "resume and custom roles work with placement.mode = \"colocate\" for now"
                    .into(),
            });
        }
        crate::remote::build_cluster(job, node).await?
    } else {
        build_embedded_with(job, node, resume.then_some(out.as_path()), &options.roles).await?
    };
    let mut step = match &live {
        Some(l) => l.controllers().first().map_or(0, Controller::step_count),
        None => controllers.first().map_or(0, Controller::step_count),
    };
    // metrics.jsonl and a TensorBoard event file, both flushed after every step.
    let mut writer = if resume {
        RunWriter::resume(&out, step)
    } else {
        RunWriter::create(&out)
    }
    .map_err(metrics_err)?;
    let metrics_path = writer.metrics_path().to_path_buf();
    let total = job.job.steps;
    let every = job.checkpoint.every;
    let t0 = Instant::now();
    let first_step = step;
    let mut rewards = Vec::new();
    for _ in step..total {
        let mut record = |m: &StepMetrics| {
            step += 1;
            writer.write_step(step, &m.values).map_err(metrics_err)?;
            rewards.push(m.get("critic/rewards/mean").unwrap_or(f64::NAN));
            on_step(&Progress {
                step,
                total,
                elapsed_s: t0.elapsed().as_secs_f64(),
                first_step,
                metrics: m,
            });
            Ok::<(), JobError>(())
        };
        match live.as_mut() {
            Some(l) => record(&l.step().await?)?,
            None => run_steps(&mut controllers, 1, record).await?,
        }
        if every > 0 && step % every == 0 && step < total {
            match &live {
                Some(l) => save(l.controllers(), &checkpoint_dir).await?,
                None => save(&controllers, &checkpoint_dir).await?,
            }
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    match &live {
        Some(l) => save(l.controllers(), &checkpoint_dir).await?,
        None => save(&controllers, &checkpoint_dir).await?,
    }
    Ok(TrainSummary {
        steps: step,
        metrics_path,
        checkpoint_dir,
        seconds,
        rewards,
    })
}

/// The run's config, written to the run directory so `--resume` can rebuild the job.
pub const JOB_FILE: &str = "job.toml";

/// What a checkpoint holds besides the models: every controller's position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Format tag.
    pub format: String,
    /// Each controller's step, weights version and dataloader position.
    pub controllers: Vec<ControllerState>,
}

impl RunState {
    const FILE: &'static str = "run_state.json";
    const FORMAT: &'static str = "yatt-run-v1";

    /// Reads `DIR/run_state.json`.
    pub fn read(dir: &Path) -> Result<Self, JobError> {
        let path = dir.join(Self::FILE);
        let bad = |reason: String| JobError::Resume {
            dir: dir.into(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| {
            bad(format!(
                "{}: {e}; is this the checkpoint of a `yatt train` run?",
                path.display()
            ))
        })?;
        let state: RunState =
            serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        if state.format != Self::FORMAT {
            return Err(bad(format!(
                "{} has format {:?}, expected {:?}",
                path.display(),
                state.format,
                Self::FORMAT
            )));
        }
        Ok(state)
    }
}

pub(crate) fn load_trainer(dir: &Path, role: &str) -> Result<Trainer, JobError> {
    Trainer::load_checkpoint(dir, Device::Cpu, Kind::Float).map_err(|e| JobError::Resume {
        dir: dir.into(),
        reason: format!("loading the {role}: {e}"),
    })
}

/// Saves the policy (shared by every head) to `dir`, the critic to `dir/critic`, and
/// every controller's position to `dir/run_state.json`, the last so that a checkpoint
/// without it is recognisably incomplete.
pub(crate) async fn save(controllers: &[Controller], dir: &Path) -> Result<(), JobError> {
    let wr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| JobError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(wr(dir))?;
    let state_path = dir.join(RunState::FILE);
    // An interrupted save must not look complete.
    match std::fs::remove_file(&state_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(wr(&state_path)(e)),
        _ => {}
    }
    if let Some(c) = controllers.first() {
        c.save_policy(dir.into()).await?;
        c.save_critic(dir.join("critic")).await?;
    }
    let state = RunState {
        format: RunState::FORMAT.into(),
        controllers: controllers.iter().map(Controller::state).collect(),
    };
    let text = serde_json::to_string_pretty(&state).expect("run state serializes");
    std::fs::write(&state_path, text).map_err(wr(&state_path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEMO: &str = include_str!("../../config/demo-letters.toml");

    #[test]
    fn the_shipped_config_parses() {
        let c = JobConfig::parse(DEMO, "demo-letters.toml", &[]).unwrap();
        assert_eq!(c.data.task, "letters");
        assert_eq!(c.reward_kinds(), vec!["letters".to_string()]);
        assert!(c.job.steps > 0);
    }

    #[test]
    fn a_wrong_type_names_the_key() {
        let e = JobConfig::parse("[job]\nsteps = \"ten\"\n", "x.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job.steps") && e.contains("x.toml") && e.contains("fix:"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &["optim.lr=\"fast\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `optim.lr`") && e.contains("expected f64"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_key_is_refused() {
        let e = JobConfig::parse("[optim]\nlearning_rate = 1.0\n", "x.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("optim.learning_rate") && e.contains("unknown field"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &["optim.learning_rate=1".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--set optim.learning_rate=1") && e.contains("unknown key"),
            "{e}"
        );
    }

    #[test]
    fn a_set_override_works() {
        let sets = [
            "job.steps=3".to_string(),
            "algorithm.name=rloo".into(),
            "optim.lr=0.5".into(),
            "reward.kind=[\"letters\"]".into(),
        ];
        let c = JobConfig::parse(DEMO, "d", &sets).unwrap();
        assert_eq!(
            (c.job.steps, c.algorithm.name.as_str(), c.optim.lr),
            (3, "rloo", 0.5)
        );
        let e = JobConfig::parse(DEMO, "d", &["algorithm.name=ppo2".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("algorithm.name")
                && e.contains("\"grpo\"")
                && e.contains("ppo2")
                && e.contains("fix"),
            "{e}"
        );
    }

    #[test]
    fn an_unsupported_placement_says_not_implemented() {
        let e = JobConfig::parse(DEMO, "d", &["job.placement=\"split\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job.placement") && e.contains("not implemented yet"),
            "{e}"
        );
    }
}
