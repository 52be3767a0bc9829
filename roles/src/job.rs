//! Training jobs: the `JobConfig` TOML schema (with `--set key=value` overrides and
//! validation), [`build_embedded`] that builds the models, roles and controllers of a
//! job on one in-process node, and [`train`] that runs the steps, writes
//! `OUTPUT_DIR/metrics.jsonl` and saves the policy to `OUTPUT_DIR/checkpoint`.
//!
//! Only the embedded mode exists for now: every role runs on the given node and
//! `placement = "colocate"` is the only placement.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use yatt_engine::fixtures::tiny_config;
use yatt_engine::tch::{self, Device, Kind};
use yatt_engine::{
    Generator, GeneratorConfig, Llama, LrSchedule, SamplingParams, Tokenizer, TrainConfig, Trainer,
};
use yatt_runtime::node::Node;

use crate::algo::advantage::{GrpoConfig, ReinforcePpConfig};
use crate::algo::loss::{LossAgg, PolicyLossConfig};
use crate::algo::KlEstimator;
use crate::builtin::{
    AsciiCodec, KlLossConfig, PolicyConfig, PolicyRole, ReferenceRole, RewardRole, RolloutRole,
    TextCodec, TokenizerCodec,
};
use crate::controller::{
    spawn_role, step_data_parallel, AdvantageEstimator, Controller, ControllerConfig,
    ControllerError, KlPenalty, RoleRefs, StepMetrics,
};
use crate::data::{
    load_jsonl, DataError, Dataloader, LengthSchedule, Prompt, SyntheticTask, SyntheticTaskKind,
};
use crate::reward::{
    ExactMatchVerifier, NumericVerifier, RewardError, RewardFn, RewardInput, RewardOutput,
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
    /// Data-parallel controllers (heads), each with its own rollout and data shard.
    pub controllers: usize,
    /// Placement of the roles: only `colocate` (all on one node) for now.
    pub placement: String,
}

impl Default for JobSection {
    fn default() -> Self {
        JobSection {
            name: "yatt".into(),
            output_dir: "runs/yatt".into(),
            seed: 0,
            steps: 30,
            controllers: 1,
            placement: "colocate".into(),
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
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            source: "tiny".into(),
            dtype: "f32".into(),
            threads: 1,
            max_seq_len: 256,
            chat: false,
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
    /// Task length of the synthetic tasks (digits, list length, letters).
    pub length: usize,
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
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection {
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            ignore_eos: false,
        }
    }
}

/// `[algorithm]`: advantage estimator, clipping, KL and entropy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// `grpo`, `rloo` or `reinforce++`.
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
        }
    }
}

/// `[reward]`: rule-based reward functions and their weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `numeric`, `exact`, `letters`, or a list of them; empty = the task's default.
    pub kind: OneOrMany,
    /// One weight per kind (empty = all 1).
    pub weights: Vec<f64>,
    /// Characters the `letters` reward counts.
    pub letters: String,
}

impl Default for RewardSection {
    fn default() -> Self {
        RewardSection {
            kind: OneOrMany::One(String::new()),
            weights: Vec::new(),
            letters: LETTERS.into(),
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
                fix: "use placement = \"colocate\" (every role on this node); other placements come with yatt-placement".into(),
            });
        }
        positive("job.steps", j.steps as f64, "the number of training steps")?;
        positive(
            "job.controllers",
            j.controllers as f64,
            "controllers = 1 for one head",
        )?;
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
                &["addition", "sorting", "reversal", "letters"],
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
        one_of("algorithm.name", &a.name, &["grpo", "rloo", "reinforce++"])?;
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
            one_of("reward.kind", k, &["numeric", "exact", "letters"])?;
        }
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

fn invalid(key: &str, expected: &str, found: &str, fix: &str) -> JobError {
    JobError::Invalid {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.into(),
    }
}

fn positive(key: &str, v: f64, fix: &str) -> Result<(), JobError> {
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

fn one_of(key: &str, v: &str, allowed: &[&str]) -> Result<(), JobError> {
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

/// The job's reward role: its reward functions and weights.
pub(crate) fn reward_role(job: &JobConfig) -> Result<RewardRole, JobError> {
    let kinds = job.reward_kinds();
    let mut parts: Vec<(f64, Box<dyn RewardFn>)> = Vec::new();
    for (i, k) in kinds.iter().enumerate() {
        let w = job.reward.weights.get(i).copied().unwrap_or(1.0);
        let f: Box<dyn RewardFn> = match k.as_str() {
            "numeric" => Box::new(NumericVerifier::default()),
            "exact" => Box::new(ExactMatchVerifier::default()),
            _ => Box::new(LettersReward {
                letters: job.reward.letters.clone(),
            }),
        };
        parts.push((w, f));
    }
    RewardRole::new(parts).map_err(|e| {
        invalid(
            "reward.kind",
            "a valid reward combination",
            &format!("{kinds:?}"),
            &e.to_string(),
        )
    })
}

fn kl_estimator(s: &str) -> KlEstimator {
    match s {
        "k1" => KlEstimator::K1,
        "k2" => KlEstimator::K2,
        _ => KlEstimator::K3,
    }
}

/// Builds the models, roles (on `node`, with `spawn_local`) and the controllers of an
/// embedded job: one policy, reference and reward role, and one rollout role and
/// controller per data-parallel head.
pub async fn build_embedded(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    job.validate()?;
    tch::set_num_threads(job.model.threads as i32);
    let seed = job.job.seed;
    let (model, codec, pad_id): (Llama, Arc<dyn TextCodec>, i64) = if job.model.source == "tiny" {
        // Llama::random seeds libtorch's global RNG: builds in parallel must not
        // interleave their draws.
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
        let m =
            Llama::random(tiny_config(), Device::Cpu, Kind::Float, seed as i64).map_err(|e| {
                JobError::Model {
                    source_desc: "tiny".into(),
                    reason: e.to_string(),
                }
            })?;
        (m, Arc::new(TINY_CODEC), 1)
    } else {
        let dir = &job.model.source;
        let me = |e: yatt_engine::EngineError| JobError::Model {
            source_desc: dir.clone(),
            reason: e.to_string(),
        };
        let m = Llama::load(dir, Device::Cpu, Kind::Float).map_err(me)?;
        let tok = Tokenizer::from_dir(dir).map_err(me)?;
        (
            m,
            Arc::new(TokenizerCodec {
                tokenizer: Arc::new(tok),
                chat: job.model.chat,
            }),
            0,
        )
    };
    let me = |e: yatt_engine::EngineError| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: e.to_string(),
    };
    let heads = job.job.controllers;
    let batch = job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    let gen_config = GeneratorConfig {
        max_batch: batch.max(1),
        max_seq_len: job.model.max_seq_len,
        ..Default::default()
    };
    let a = &job.algorithm;
    let temperature = job.rollout.temperature;
    // No KL term at all: no reference model to hold or run.
    let reference = match a.kl_mode.as_str() {
        "none" => None,
        _ => Some(ReferenceRole::new(
            model.deep_copy(Device::Cpu, Kind::Float).map_err(me)?,
            pad_id,
            temperature,
            job.optim.micro_batch,
        )),
    };
    let mut generators = Vec::with_capacity(heads);
    for _ in 0..heads {
        generators.push(Generator::new(
            model.deep_copy(Device::Cpu, Kind::Float).map_err(me)?,
            gen_config.clone(),
        ));
    }
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
    let train = TrainConfig {
        lr: o.lr,
        weight_decay: o.weight_decay,
        max_grad_norm: (o.max_grad_norm > 0.0).then_some(o.max_grad_norm),
        schedule,
        seed,
        ..Default::default()
    };
    let trainer = Trainer::new(model, train);
    let kl = (a.kl_coef > 0.0).then(|| (kl_estimator(&a.kl_estimator), a.kl_coef));
    let policy_config = PolicyConfig {
        loss: PolicyLossConfig {
            clip_low: a.clip_low,
            clip_high: a.clip_high,
            agg: if a.loss_agg == "seq-mean-token-mean" {
                LossAgg::SeqMeanTokenMean
            } else {
                LossAgg::TokenMean
            },
            ..Default::default()
        },
        kl_loss: kl
            .filter(|_| a.kl_mode == "loss")
            .map(|(estimator, coef)| KlLossConfig { estimator, coef }),
        entropy_coef: a.entropy_coef,
        micro_batch_size: o.micro_batch,
        mini_batches: o.mini_batches,
        temperature,
        pad_id,
        on_policy: a.old_logprobs == "on-policy",
        tokenizer_dir: (job.model.source != "tiny").then(|| PathBuf::from(&job.model.source)),
        ..Default::default()
    };
    let policy = PolicyRole::new(trainer, policy_config).map_err(|e| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: format!("policy role: {e}"),
    })?;
    let g = || DeviceGroup::cpu(node.name());
    let shared = RoleRefs {
        rollout: spawn_role(
            node,
            RolloutRole::new(generators.remove(0), codec.clone()),
            0,
            g(),
        )
        .await?,
        reward: spawn_role(node, reward_role(job)?, 0, g()).await?,
        reference: match reference {
            Some(r) => Some(spawn_role(node, r, 0, g()).await?),
            None => None,
        },
        policy: spawn_role(node, policy, 0, g()).await?,
    };
    let advantage = match a.name.as_str() {
        "rloo" => AdvantageEstimator::Rloo,
        "reinforce++" => AdvantageEstimator::ReinforcePp(ReinforcePpConfig::default()),
        _ => AdvantageEstimator::Grpo(GrpoConfig::default()),
    };
    let r = &job.rollout;
    let config = ControllerConfig {
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
        seed,
        advantage,
        kl_in_reward: kl
            .filter(|_| a.kl_mode == "reward")
            .map(|(estimator, coef)| KlPenalty { estimator, coef }),
        kl_metric: kl_estimator(&a.kl_estimator),
        ..Default::default()
    };
    let all: Arc<[Prompt]> = prompts(job)?.into();
    let mut controllers = Vec::with_capacity(heads);
    let mut rollouts = vec![shared.rollout.clone()];
    for (i, gen) in generators.into_iter().enumerate() {
        rollouts.push(
            spawn_role(
                node,
                RolloutRole::new(gen, codec.clone()),
                i as u32 + 1,
                g(),
            )
            .await?,
        );
    }
    for (i, rollout) in rollouts.into_iter().enumerate() {
        let loader = Dataloader::new(all.clone(), i, heads, seed.wrapping_add(3))?;
        let roles = RoleRefs {
            rollout,
            ..shared.clone()
        };
        controllers.push(Controller::new(config.clone(), loader, roles)?);
    }
    Ok(controllers)
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
    /// Seconds since the first step started.
    pub elapsed_s: f64,
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
/// `OUTPUT_DIR/metrics.jsonl`, saves the policy to `OUTPUT_DIR/checkpoint` every
/// `checkpoint.every` steps and at the end, and calls `on_step` after each step.
pub async fn train(
    job: &JobConfig,
    node: &Node,
    mut on_step: impl FnMut(&Progress<'_>),
) -> Result<TrainSummary, JobError> {
    let out = job.job.output_dir.clone();
    std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
        path: out.clone(),
        source,
    })?;
    let metrics_path = out.join("metrics.jsonl");
    let checkpoint_dir = out.join("checkpoint");
    let wr = |source| JobError::Write {
        path: metrics_path.clone(),
        source,
    };
    let mut file = std::io::BufWriter::new(std::fs::File::create(&metrics_path).map_err(wr)?);
    let mut controllers = build_embedded(job, node).await?;
    let total = job.job.steps;
    let every = job.checkpoint.every;
    let t0 = Instant::now();
    let mut rewards = Vec::new();
    let mut step = 0u64;
    for _ in 0..total {
        run_steps(&mut controllers, 1, |m| {
            step += 1;
            // `step` first, then the metrics in name order (non-finite values as null).
            let mut line = format!("{{\"step\":{step}");
            for (k, v) in &m.values {
                let v = serde_json::Number::from_f64(*v)
                    .map(serde_json::Value::Number)
                    .unwrap_or(serde_json::Value::Null);
                line.push_str(&format!(",{}:{v}", serde_json::Value::String(k.clone())));
            }
            line.push('}');
            writeln!(file, "{line}")
                .and_then(|_| file.flush())
                .map_err(wr)?;
            rewards.push(m.get("critic/rewards/mean").unwrap_or(f64::NAN));
            on_step(&Progress {
                step,
                total,
                elapsed_s: t0.elapsed().as_secs_f64(),
                metrics: m,
            });
            Ok(())
        })
        .await?;
        if every > 0 && step % every == 0 && step < total {
            save(&controllers, &checkpoint_dir).await?;
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    save(&controllers, &checkpoint_dir).await?;
    Ok(TrainSummary {
        steps: step,
        metrics_path,
        checkpoint_dir,
        seconds,
        rewards,
    })
}

/// Saves the policy (shared by every head) to `dir`.
async fn save(controllers: &[Controller], dir: &Path) -> Result<(), JobError> {
    std::fs::create_dir_all(dir).map_err(|source| JobError::Write {
        path: dir.into(),
        source,
    })?;
    if let Some(c) = controllers.first() {
        c.save_policy(dir.into()).await?;
    }
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
