//! The job config as TOML: one struct per section, every key with its default.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use yatt_roles::{
    AdvantageNorm, Algorithm, BehaviourCorrection, DataFields, DataFormat, EnvKind, JudgeConfig,
    KlEstimator, LossAgg, LossAggMode, StepVote, LETTERS,
};

use crate::config::modes::{
    CallPrefix, DeviceSetting, Driver, Dtype, KlMode, LoraSyncMode, ModelSource, OldLogprobs,
    RewardKind, Schedule, Task, UnparsedVerdict, VerdictMode,
};
use crate::config::placement::PlacementSection;
use crate::config::user_roles::RolesSection;
use crate::controller::config::{GradientSync, WeightSync};
use yatt_engine::{LoraConfig, LoraTarget};

/// A training job, as read from TOML.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// `[eval]`: greedy accuracy on held-out prompts while training.
    pub eval: EvalSection,
    /// `[placement]`: which node runs each role.
    pub placement: PlacementSection,
    /// `[timeouts]`: the deadline of each remote call a step makes.
    pub timeouts: TimeoutsSection,
    /// `[roles]`: user roles, by the names nodes register them under, in built-in slots
    /// and as extra stages.
    #[serde(skip_serializing_if = "RolesSection::is_empty")]
    pub roles: RolesSection,
}

/// `[job]`: name, output, seed, length and layout.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    pub driver: Driver,
    /// Kept for older configs: must be `colocate`. Where roles run is `[placement]`.
    pub placement: String,
    /// Policy replicas: 1 (shared by every head) or `controllers` (one per head, their
    /// gradients all-reduced at each update). With `policy_shards > 1` each replica is
    /// sharded (HSDP): rank r of every replica averages its gradient shards with the
    /// other replicas' rank r.
    pub policy_replicas: usize,
    /// Ranks one policy replica is sharded over (ZeRO-3): each keeps 1/N of the f32
    /// master weights, gradients and AdamW moments, gathers a layer's weights just
    /// before it runs and reduce-scatters its gradients. 1 = the whole model in one
    /// trainer. Embedded, the ranks are threads of this process (parity, not memory);
    /// on a cluster each rank runs on the node `placement.policy` names for it. See
    /// docs/training/sharded.md.
    pub policy_shards: usize,
    /// Ranks the reference model (the KL term's) is sharded over: each keeps 1/N of its
    /// f32 weights and scores its part of the samples, gathering a layer's weights just
    /// before it runs. 1 = the whole model in one process. Embedded, the ranks are
    /// threads of this process; on a cluster, rank r runs beside the policy's, on the
    /// node `placement.policy[r]` names (`placement.reference` is not used). See
    /// docs/training/sharded.md.
    pub reference_shards: usize,
    /// Ranks the critic (PPO's value model) is sharded over, as the policy is: each
    /// keeps 1/N of the f32 master weights, gradients and AdamW moments of the backbone
    /// and the value head, and gathers a layer's weights just before it runs. 1 = the
    /// whole critic in one trainer. Embedded, the ranks are threads of this process
    /// (parity, not memory); on a cluster, rank r runs beside the policy's, on the node
    /// `placement.policy[r]` names. A sharded critic's checkpoint resumes at any count.
    /// See docs/training/sharded.md.
    pub critic_shards: usize,
    /// How the replicas average gradients: `auto` (NCCL on GPUs, else the QUIC ring,
    /// the reason logged), `quic`, `nccl`.
    pub gradient_sync: GradientSync,
}

impl Default for JobSection {
    fn default() -> Self {
        JobSection {
            name: "yatt".into(),
            output_dir: "runs/yatt".into(),
            seed: 0,
            steps: 30,
            controllers: 1,
            driver: Driver::Parallel,
            placement: "colocate".into(),
            policy_replicas: 1,
            policy_shards: 1,
            reference_shards: 1,
            critic_shards: 1,
            gradient_sync: GradientSync::Auto,
        }
    }
}

/// `[model]`: which model, in which dtype, on how many threads.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ModelSection {
    /// `tiny` (a random tiny Llama with a character codec) or an HF model directory
    /// (config.json, safetensors, tokenizer.json).
    pub source: ModelSource,
    /// The weights' dtype (`f32`, `bf16`, `f16`). Trainers keep f32 master weights and
    /// AdamW state whatever it is; rollouts, references and scoring run in it.
    pub dtype: Dtype,
    /// Where the models run: `auto` (the role's device group: a GPU when the node has
    /// one), `cpu`, `cuda` or `cuda:N`.
    pub device: DeviceSetting,
    /// libtorch intra-op threads.
    pub threads: usize,
    /// Longest sequence (prompt + response) the rollout handles.
    pub max_seq_len: usize,
    /// Wrap prompts in the tokenizer's chat template (HF models only).
    pub chat: bool,
    /// `tiny` only: transformer layers (0 = the fixture's 2). A deeper tiny model
    /// decodes slower per token, as a larger model would.
    pub tiny_layers: usize,
    /// `[model.lora]`: train LoRA adapters on the policy instead of every weight
    /// (unset: full fine-tuning).
    pub lora: Option<LoraSection>,
    /// Tokens per chunk of the LM head when scoring and training: log-probs and entropy
    /// are computed chunk by chunk (recomputed in backward), so the `[tokens, vocab]`
    /// logits never exist whole.
    pub logprob_chunk_tokens: usize,
    /// Layer recompute in the policy's update: keep only each decoder layer's input and
    /// run the layer again in backward (about a third more compute). The recomputed
    /// layer runs a few whole sequences at a time (up to `recompute_chunk_tokens`, or
    /// one longer sequence) and its MLP in chunks of that many tokens, so its
    /// activations stay bounded however long the micro-batch.
    pub activation_checkpointing: bool,
    /// Tokens per part of a recomputed layer, and per chunk of its MLP (with
    /// `activation_checkpointing`). Smaller holds less at once; a micro-batch that fits
    /// in one part gives bit-identical gradients, a split one differs by float rounding.
    pub recompute_chunk_tokens: usize,
    /// How a micro-batch's sequences are laid out for scoring and training: `padded`
    /// (one row each, a GRPO group's prompt run once) or `packed` (back to back in one
    /// row, attention confined to each: no padding on long-tail lengths).
    pub packing: Packing,
}

/// `model.packing`: how a micro-batch's sequences are laid out.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum Packing {
    /// One right-padded row per sequence.
    #[default]
    Padded,
    /// Every sequence back to back in one row.
    Packed,
}

/// `[model.lora]`: LoRA adapters on the policy (PEFT's settings and names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct LoraSection {
    /// Rank `r` of every adapter.
    pub rank: i64,
    /// `lora_alpha`: updates are scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapters' input while training.
    pub dropout: f64,
    /// The adapted projections (PEFT names); default: every linear layer.
    pub target_modules: Vec<LoraTarget>,
    /// What a weight sync carries: `adapters` (megabytes; rollouts fold them into their
    /// base) or `merged` (the whole model).
    pub sync: LoraSyncMode,
}

impl Default for LoraSection {
    fn default() -> Self {
        LoraSection {
            rank: 16,
            alpha: 32.0,
            dropout: 0.0,
            target_modules: LoraTarget::ALL.to_vec(),
            sync: LoraSyncMode::Adapters,
        }
    }
}

impl LoraSection {
    /// The engine's settings.
    pub fn engine_config(&self) -> LoraConfig {
        LoraConfig {
            rank: self.rank,
            alpha: self.alpha,
            dropout: self.dropout,
            targets: self.target_modules.clone(),
        }
    }
}

impl Default for ModelSection {
    fn default() -> Self {
        ModelSection {
            source: ModelSource::Tiny,
            dtype: Dtype::F32,
            device: DeviceSetting::Auto,
            threads: 1,
            max_seq_len: 256,
            chat: false,
            tiny_layers: 0,
            lora: None,
            logprob_chunk_tokens: yatt_engine::score::DEFAULT_CHUNK_TOKENS,
            activation_checkpointing: false,
            recompute_chunk_tokens: yatt_engine::score::DEFAULT_CHUNK_TOKENS,
            packing: Packing::Padded,
        }
    }
}

/// `[data]`: prompts.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DataSection {
    /// `addition`, `sorting`, `reversal` or `letters`; ignored when `path` (or `jsonl`)
    /// is set.
    pub task: Task,
    /// A dataset: a JSONL file, a parquet file (verl's layout) or a directory saved with
    /// HF `datasets`' `save_to_disk`; empty = use `task`.
    pub path: String,
    /// The dataset's format: `jsonl`, `parquet` or `hf-disk`; unset = from `path` (a
    /// directory is `hf-disk`, `.parquet` is `parquet`, `.jsonl`/`.json` is `jsonl`).
    pub format: Option<DataFormat>,
    /// The prompt column: a string or a list of `{role, content}` chat messages
    /// (rendered with the model's chat template). With the default, `question` and
    /// `messages` are tried too.
    pub prompt_key: String,
    /// The ground-truth column, a dotted path into a struct column. With the default,
    /// a top-level `ground_truth`, `answer` or `reference` is tried too.
    pub ground_truth_key: String,
    /// The column handed to the reward as `data_source`.
    pub data_source_key: String,
    /// The column handed to the reward as `extra_info`.
    pub extra_info_key: String,
    /// A JSONL prompt file (the older key: the same as `path` with `format = "jsonl"`);
    /// empty = use `path` or `task`.
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
    /// Drop the prompts whose tokens plus `rollout.max_new_tokens` do not fit
    /// `model.max_seq_len` (with a warning saying how many), as verl's
    /// `filter_overlong_prompts`; off: such a prompt is an error before the first step.
    pub filter_overlong_prompts: bool,
}

impl Default for DataSection {
    fn default() -> Self {
        DataSection {
            task: Task::Letters,
            path: String::new(),
            format: None,
            prompt_key: DataFields::default().prompt_key,
            ground_truth_key: DataFields::default().ground_truth_key,
            data_source_key: DataFields::default().data_source_key,
            extra_info_key: DataFields::default().extra_info_key,
            jsonl: String::new(),
            length: 2,
            length_end: 0,
            num_prompts: 256,
            prompts_per_step: 8,
            samples_per_prompt: 8,
            filter_overlong_prompts: false,
        }
    }
}

impl DataSection {
    /// The dataset file or directory (`path`, else `jsonl`), when the job reads one.
    pub fn dataset(&self) -> Option<&str> {
        [&self.path, &self.jsonl]
            .into_iter()
            .find(|p| !p.is_empty())
            .map(String::as_str)
    }

    /// The dataset's format: `format`, else `jsonl` for the `jsonl` key, else from the
    /// path.
    pub fn dataset_format(&self) -> Option<DataFormat> {
        self.format.or_else(|| {
            (self.path.is_empty() && !self.jsonl.is_empty()).then_some(DataFormat::Jsonl)
        })
    }

    /// The column names.
    pub fn fields(&self) -> DataFields {
        DataFields {
            prompt_key: self.prompt_key.clone(),
            ground_truth_key: self.ground_truth_key.clone(),
            data_source_key: self.data_source_key.clone(),
            extra_info_key: self.extra_info_key.clone(),
        }
    }
}

/// `[rollout]`: sampling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
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
    /// Strings that end a response once it contains them (kept in the response), e.g.
    /// `["\n\n"]` to stop a completion prompt after one answer. Needs a model with a
    /// tokenizer.
    pub stop: Vec<String>,
    /// Stream samples out of the rollout as they finish, and score their rewards while
    /// generation goes on (in-process rollouts only).
    pub stream: bool,
    /// Most sequences a rollout replica decodes at once (its engine's batch slots, a
    /// cap on compute); 0 = all of a head's samples. A small cap models an engine that
    /// decodes few sequences together: decoding becomes the bottleneck, as on GPUs.
    pub max_batch: usize,
    /// Bytes of a rollout replica's paged KV cache (blocks of 16 positions): sequences
    /// are admitted while its blocks hold their prompts, hold memory as their tokens
    /// grow, and the newest are preempted (and later resume by recomputing their
    /// prefix) when the blocks run out, counted in `rollout/kv_preemptions`. 0 = blocks
    /// for `max_batch × model.max_seq_len` positions, which never preempts. It must hold
    /// one sequence of `model.max_seq_len` positions, e.g. `kv_cache_bytes =
    /// 4_000_000_000`.
    pub kv_cache_bytes: u64,
    /// Free the KV cache after each generation request, as verl's
    /// `free_cache_engine` does: in a colocated run its memory goes back for the
    /// update, at the cost of allocating it again at the next step's generation (and
    /// of the KV kept for continuing sequences, whose prefixes are then prefilled
    /// again).
    pub free_kv_cache: bool,
    /// Asynchronous RL: how many policy versions a sample may lag behind the weights
    /// it trains (counted from the version its generation started with, as in the
    /// simulator). 0 = on-policy, generation and training take turns. With k ≥ 1 the
    /// rollouts generate the next steps' batches while the policy trains, up to k
    /// batches ahead.
    pub staleness: u32,
    /// Warn (once) when the mean |recomputed − rollout| log-prob difference per token
    /// of a step's samples that are on the newest weights exceeds this: a silent
    /// train/rollout mismatch (0 = never warn).
    pub logprob_diff_warn: f64,
    /// Decode through CUDA graphs on a GPU (one launch per step instead of ~80 per
    /// layer; no effect on the CPU). Off: every decode step runs eagerly.
    pub cuda_graphs: bool,
    /// How weights reach rollouts in other processes: `auto` (CUDA IPC on one host
    /// with a GPU, an NCCL broadcast to other hosts' GPUs, else byte buckets over QUIC,
    /// the reason logged), `quic`, `relay` (buckets through the controller),
    /// `cuda_ipc`, `nccl`.
    pub weight_sync: WeightSync,
    /// Partial rollouts (interruptible generation, with `staleness` ≥ 1): responses
    /// decode in chunks of `chunk_tokens`, and weights synced while a batch generates
    /// reach its later chunks. The simulator's words: `resume = "reprefill"` (the prompt
    /// and the tokens so far are prefilled again on the new weights; `kv` is not
    /// implemented live). Unset: weights reach the rollouts between batches.
    pub partial_rollout: Option<PartialRolloutSection>,
    /// Multi-turn episodes with an environment (`rollout.env = { kind = "calculator" }`):
    /// model turns alternate with the environment's observations inside the chat
    /// template, and only the model's tokens get loss. Unset: one generation per sample.
    pub env: Option<EnvSection>,
}

/// `rollout.env = { kind = "calculator", max_turns = 3, max_env_tokens = 64, timeout_s = 10 }`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EnvSection {
    /// `calculator` (a tool environment with the calculator), `python` (with the
    /// sandboxed Python tool) or `guess-number` (the multi-turn game).
    pub kind: EnvKind,
    /// Most model turns per episode (1–64).
    pub max_turns: u32,
    /// Most tokens of one observation's content; longer ones are cut (≥ 1).
    pub max_env_tokens: usize,
    /// Most tokens of one model turn (0: the rest of `rollout.max_new_tokens`, the
    /// budget of the whole response, observations included).
    pub max_turn_tokens: usize,
    /// Deadline of every environment call (`reset`, `step`), seconds; an episode whose
    /// environment misses it is marked failed (`env/episodes_failed`).
    pub timeout_s: f64,
    /// `kind = "python"`: the interpreter (empty: the reward's default, the venv's).
    pub python: PathBuf,
    /// `kind = "python"`: wall time of one call, seconds.
    pub python_timeout_s: f64,
    /// `kind = "python"`: the interpreter's address-space limit, MiB.
    pub python_memory_mb: u64,
    /// `kind = "python"`: most bytes of output (stdout, stderr each).
    pub python_output_bytes: usize,
    /// `calculator`/`python`: whether the environment writes the opening of a tool call
    /// at the start of the first turn, for models too small to write the format
    /// themselves. `off`; `always` (every episode, masked out of the loss: calling is
    /// then not the model's choice); `guide` (`guide_fraction` of each prompt's
    /// episodes, trained as the model's own tokens, so that it learns to call by
    /// itself; evaluation never opens the call). `true`/`false` mean `always`/`off`.
    #[serde(deserialize_with = "CallPrefix::deserialize_word_or_bool")]
    pub call_prefix: CallPrefix,
    /// With `call_prefix = "guide"`: the share of each prompt's samples that the
    /// environment opens the call for, in (0, 1) (rounded up to whole samples).
    pub guide_fraction: f64,
    /// With `placement.env`: environment actors per rollout (episodes spread over them).
    pub pool: usize,
    /// Keep each episode's KV cache across its turns: a turn prefills only what was
    /// appended since the last (the observation), not the whole conversation again.
    /// Off, every turn prefills everything (the samples are the same up to rounding).
    pub keep_kv: bool,
}

impl Default for EnvSection {
    fn default() -> Self {
        EnvSection {
            kind: EnvKind::Calculator,
            max_turns: 3,
            max_env_tokens: 64,
            max_turn_tokens: 0,
            timeout_s: 10.0,
            python: PathBuf::new(),
            python_timeout_s: 5.0,
            python_memory_mb: 512,
            python_output_bytes: 4096,
            call_prefix: CallPrefix::Off,
            guide_fraction: 0.5,
            pool: 2,
            keep_kv: true,
        }
    }
}

/// `rollout.partial_rollout = { chunk_tokens = 8, resume = "reprefill" }`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PartialRolloutSection {
    /// Tokens a response decodes before newer weights may take over.
    pub chunk_tokens: usize,
    /// How an interrupted response continues: `reprefill` (`kv` is the simulator's
    /// other word, refused here).
    pub resume: yatt_placement::Resume,
}

impl Default for PartialRolloutSection {
    fn default() -> Self {
        PartialRolloutSection {
            chunk_tokens: 8,
            resume: yatt_placement::Resume::Reprefill,
        }
    }
}

impl Default for RolloutSection {
    fn default() -> Self {
        RolloutSection {
            max_new_tokens: 64,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            ignore_eos: false,
            stop: Vec::new(),
            stream: false,
            max_batch: 0,
            kv_cache_bytes: 0,
            free_kv_cache: false,
            staleness: 0,
            logprob_diff_warn: 0.1,
            cuda_graphs: true,
            weight_sync: WeightSync::Auto,
            partial_rollout: None,
            env: None,
        }
    }
}

/// `[algorithm]`: advantage estimator, clipping, KL and entropy.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct AlgorithmSection {
    /// `grpo`, `rloo`, `reinforce++`, `ppo` (GAE with a critic), `dapo` (GRPO
    /// advantages with dynamic sampling; pair it with `clip_high = 0.28` and
    /// `overlong_buffer`), `dr-grpo`, `gspo` or `cispo`.
    pub name: Algorithm,
    /// ε_low of the clipped ratio (GSPO: of the sequence ratio; CISPO: of the importance
    /// weight, up to 1 = no lower bound). Unset: the algorithm's default,
    /// [`Algorithm::default_clip`] (0.2; GSPO 3e-4; CISPO 1).
    pub clip_low: Option<f64>,
    /// ε_high of the clipped ratio (clip-higher). Unset: the algorithm's default (0.2;
    /// GSPO 4e-4).
    pub clip_high: Option<f64>,
    /// KL coefficient (0 = no KL term).
    pub kl_coef: f64,
    /// `k1`, `k2` or `k3`.
    pub kl_estimator: KlEstimator,
    /// `loss` (KL loss in the policy), `reward` (KL penalty in the reward) or `none`
    /// (no KL term and no reference model, so no `actor/kl` metric).
    pub kl_mode: KlMode,
    /// Entropy bonus coefficient.
    pub entropy_coef: f64,
    /// `token-mean`, `seq-mean-token-mean` or `seq-mean-token-sum-norm` (sum over the
    /// response's tokens ÷ `rollout.max_new_tokens`, mean over responses). Unset: the
    /// algorithm's default, [`Algorithm::default_loss_agg`] (`token-mean`; `dr-grpo`
    /// `seq-mean-token-sum-norm`; `gspo` `seq-mean-token-mean`).
    pub loss_agg: Option<LossAggMode>,
    /// PPO: GAE discount γ.
    pub gamma: f64,
    /// PPO: GAE λ.
    pub lam: f64,
    /// PPO: how GAE's advantages are normalised over the batch: `whiten` (the
    /// default, as verl and OpenRLHF), `center` (mean removed, reward units kept: a
    /// batch without reward signal no longer moves the policy at full scale) or `none`.
    pub advantage_norm: AdvantageNorm,
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
    /// the update), `on-policy` (needs `optim.mini_batches = 1`: the one update runs on
    /// the weights that generated, so the ratio is 1 and that pass is skipped) or
    /// `rollout` (the rollout's own log-probs, no pass: with `rollout.staleness` ≥ 1 the
    /// clip bounds the update against the weights that generated).
    pub old_logprobs: OldLogprobs,
    /// Off-policy correction for samples of older weights (`rollout.staleness` ≥ 1):
    /// `none`, `decoupled` (AReaL's decoupled PPO: the ratio against the recomputed
    /// old log-probs, each token weighted by π_old/π_rollout and left out above
    /// `behaviour_cap`) or `tis` (truncated importance sampling: the weight capped at
    /// `behaviour_cap`). Unset: `decoupled` when `rollout.staleness` ≥ 1, else `none`.
    pub off_policy: Option<BehaviourCorrection>,
    /// The importance-weight cap of `off_policy` (> 1).
    pub behaviour_cap: f64,
    /// `[algorithm.step_credit]`: CAPO-style step credit (off when absent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub step_credit: Option<StepCreditSection>,
}

/// `[algorithm.step_credit]`: the reward's per-step verdicts (an LLM judge's, or a
/// Python reward's `step_scores`) become token-level credit: every token keeps the
/// outcome advantage, and the tokens of a failed step lose `penalty` more.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct StepCreditSection {
    /// What ends a step of the response. Steps are the pieces after each delimiter;
    /// a whitespace-only piece joins the step before it.
    pub delimiter: String,
    /// Advantage taken from every token of a failed step (> 0).
    pub penalty: f64,
    /// A step whose verdict is below this fails (in `[0, 1]`).
    pub threshold: f64,
    /// Centre the credit within each prompt group: the group's mean penalty per token
    /// goes back to all its tokens, so steps are ranked against each other and writing
    /// fewer checkable steps gains nothing. Off: a plain penalty, which on a group of
    /// equal outcomes is the only signal (and a policy can escape it by writing less).
    pub centre: bool,
}

impl Default for StepCreditSection {
    fn default() -> Self {
        StepCreditSection {
            delimiter: "\n".into(),
            penalty: 0.5,
            threshold: 0.5,
            centre: true,
        }
    }
}

impl Default for AlgorithmSection {
    fn default() -> Self {
        AlgorithmSection {
            name: Algorithm::Grpo,
            clip_low: None,
            clip_high: None,
            kl_coef: 0.0,
            kl_estimator: KlEstimator::K3,
            kl_mode: KlMode::Loss,
            entropy_coef: 0.0,
            loss_agg: None,
            gamma: 1.0,
            lam: 0.95,
            advantage_norm: AdvantageNorm::Whiten,
            value_clip: 0.5,
            dynamic_sampling: None,
            max_sampling_rounds: 4,
            overlong_buffer: 0,
            overlong_coef: 1.0,
            old_logprobs: OldLogprobs::Recompute,
            off_policy: None,
            behaviour_cap: 2.0,
            step_credit: None,
        }
    }
}

impl AlgorithmSection {
    /// The off-policy correction: the config's, or `decoupled` when samples may be
    /// stale (`staleness` ≥ 1), else `none`.
    pub fn off_policy(&self, staleness: u32) -> BehaviourCorrection {
        self.off_policy
            .unwrap_or(match (staleness, self.old_logprobs) {
                // The rollout's log-probs as the old ones: old = behaviour, nothing to weight.
                (_, OldLogprobs::Rollout) | (0, _) => BehaviourCorrection::None,
                _ => BehaviourCorrection::Decoupled,
            })
    }

    /// `(clip_low, clip_high)`: the config's, or the algorithm's defaults.
    pub fn clip(&self) -> (f64, f64) {
        let (low, high) = self.name.default_clip();
        (self.clip_low.unwrap_or(low), self.clip_high.unwrap_or(high))
    }

    /// The aggregation mode: the config's, or the algorithm's default.
    pub fn loss_agg_mode(&self) -> LossAggMode {
        self.loss_agg.unwrap_or(self.name.default_loss_agg())
    }

    /// The loss aggregation; `max_new_tokens` is `seq-mean-token-sum-norm`'s constant.
    pub fn loss_agg(&self, max_new_tokens: usize) -> LossAgg {
        self.loss_agg_mode().with_max_len(max_new_tokens)
    }
}

/// `[optim]`: optimizer and batching of the update.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct OptimSection {
    /// Learning rate.
    pub lr: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Linear warm-up steps (optimizer steps).
    pub warmup_steps: u64,
    /// `constant` or `cosine` (to 10 % of `lr` at the end of the run).
    pub schedule: Schedule,
    /// Gradient-norm clip (0 = none).
    pub max_grad_norm: f64,
    /// Samples per forward/backward pass.
    pub micro_batch: usize,
    /// Cap on a policy micro-batch's tokens (prompt + response) instead of its samples
    /// (0 = off: `micro_batch` samples each). Samples are balanced across as few
    /// micro-batches as the cap allows (longest first, into the lightest); a sample
    /// longer than the cap runs alone.
    pub max_tokens_per_micro_batch: usize,
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
            schedule: Schedule::Constant,
            max_grad_norm: 1.0,
            micro_batch: 8,
            max_tokens_per_micro_batch: 0,
            mini_batches: 1,
            critic_lr: 1e-5,
            skip_zero_advantage: true,
        }
    }
}

/// `[reward]`: reward functions and reward models, and their weights.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RewardSection {
    /// `numeric`, `exact`, `letters`, `model`, `judge`, `python`, `http`, or a list of
    /// them; empty = the task's default.
    pub kind: RewardKinds,
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
    pub judge_mode: VerdictMode,
    /// Most tokens of a generated verdict.
    pub judge_max_tokens: usize,
    /// Judge cache positions per sequence (judge prompt + verdict).
    pub judge_max_seq_len: usize,
    /// A verdict with no score: `error` (fail the step) or `fallback`.
    pub judge_on_unparsed: UnparsedVerdict,
    /// The normalised score a verdict with no score gets with `fallback`.
    pub judge_fallback_score: f64,
    /// Critiques per response in `generate` mode: 1 = one greedy verdict; more are
    /// sampled at `judge_temperature`, their scores averaged and their step verdicts
    /// voted (CAPO).
    pub judge_critiques: usize,
    /// How several critiques' step verdicts combine: `majority`, `intersection` (a step
    /// fails only if every critique fails it) or `average`.
    pub judge_vote: StepVote,
    /// Sampling temperature of the critiques when `judge_critiques` > 1.
    pub judge_temperature: f64,
    /// `kind = "python"`: `path/to/file.py:function` (verl's `compute_score` signature).
    pub function: String,
    /// `kind = "python"`: the interpreter; empty = `$VIRTUAL_ENV/bin/python`, else
    /// `.venv/bin/python`, else `python3`.
    pub python: String,
    /// `kind = "python"`: worker processes.
    pub python_workers: usize,
    /// `kind = "python"`: the function takes lists and returns a list.
    pub batched: bool,
    /// `kind = "python"` / `"http"`: deadline of one call / one request attempt, seconds.
    pub timeout_s: f64,
    /// `kind = "python"`: the score of a sample whose call raised (unset: fail the step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fallback_score: Option<f64>,
    /// `kind = "http"`: `http://host:port/path` of the reward endpoint.
    pub url: String,
    /// `kind = "http"`: retries after a failed attempt (timeouts, connection errors, 5xx).
    pub max_retries: u32,
}

impl Default for RewardSection {
    fn default() -> Self {
        let judge = JudgeConfig::default();
        RewardSection {
            kind: RewardKinds::default(),
            weights: Vec::new(),
            letters: LETTERS.into(),
            model: String::new(),
            judge_model: String::new(),
            judge_template: String::new(),
            judge_rubric: judge.rubric,
            judge_mode: VerdictMode::Generate,
            judge_max_tokens: judge.max_tokens,
            judge_max_seq_len: 1024,
            judge_on_unparsed: UnparsedVerdict::Error,
            judge_fallback_score: 0.0,
            judge_critiques: 1,
            judge_vote: StepVote::Majority,
            judge_temperature: 1.0,
            function: String::new(),
            python: String::new(),
            python_workers: 2,
            batched: false,
            timeout_s: 60.0,
            fallback_score: None,
            url: String::new(),
            max_retries: 3,
        }
    }
}

/// `reward.kind`: one kind, or a list of them; empty (`""` or `[]`) = the task's
/// default. Written back as one word when there is one kind.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RewardKinds(pub Vec<RewardKind>);

impl schemars::JsonSchema for RewardKinds {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "RewardKinds".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(generator: &mut schemars::SchemaGenerator) -> schemars::Schema {
        let kind = generator.subschema_for::<RewardKind>();
        schemars::json_schema!({
            "anyOf": [kind, { "type": "array", "items": kind }]
        })
    }
}

impl Serialize for RewardKinds {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self.0.as_slice() {
            [] => s.serialize_str(""),
            [one] => one.serialize(s),
            many => many.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for RewardKinds {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Kinds;
        impl<'de> serde::de::Visitor<'de> for Kinds {
            type Value = RewardKinds;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a reward kind, or a list of them")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<RewardKinds, E> {
                if v.is_empty() {
                    return Ok(RewardKinds::default());
                }
                let kind = RewardKind::deserialize(serde::de::value::StrDeserializer::<E>::new(v))?;
                Ok(RewardKinds(vec![kind]))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<RewardKinds, A::Error> {
                let mut kinds = Vec::new();
                while let Some(k) = seq.next_element::<RewardKind>()? {
                    kinds.push(k);
                }
                Ok(RewardKinds(kinds))
            }
        }
        d.deserialize_any(Kinds)
    }
}

/// `[checkpoint]`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct CheckpointSection {
    /// Save the policy every N steps (0 = only at the end).
    pub every: u64,
}

/// `[eval]`: greedy accuracy on held-out prompts during training (verl's `test_freq`,
/// TRL's `eval_steps`), as `yatt eval --checkpoint` measures it, written to
/// `OUTPUT_DIR/eval.jsonl`. It reads the policy's checkpoint, so it does not change
/// the training, and it works with a cosine schedule, which cannot be resumed with
/// another `job.steps` to evaluate between segments.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct EvalSection {
    /// Evaluate every N steps and after the last one (0 = never).
    pub every: u64,
    /// Held-out prompts per evaluation (one greedy answer each).
    pub prompts: usize,
    /// Also evaluate the starting weights, as step 0, before a fresh run's first step
    /// (verl's `val_before_train`), so the curve has its starting point.
    pub before_train: bool,
}

impl Default for EvalSection {
    fn default() -> Self {
        EvalSection {
            every: 0,
            prompts: 200,
            before_train: false,
        }
    }
}

/// `[timeouts]`: the deadline, in seconds, of each call a step makes to a role (and of
/// each wait inside it, such as a ring all-reduce chunk). A call past its deadline fails
/// the step with an error naming the stage, the role and the deadline, instead of hanging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TimeoutsSection {
    /// Generation (a whole batch on a rollout replica).
    pub generate_s: f64,
    /// Reward, reference, critic-value and old-log-prob scoring.
    pub score_s: f64,
    /// The policy's and the critic's update, including the replicas' all-reduce.
    pub train_s: f64,
    /// Weight export and load, and each offload or reload of time sharing.
    pub sync_s: f64,
    /// Each NCCL operation of a weight sync (joining the group, each bucket's
    /// broadcast); at most `sync_s`.
    pub collective_s: f64,
}

impl Default for TimeoutsSection {
    fn default() -> Self {
        TimeoutsSection {
            generate_s: 600.0,
            score_s: 600.0,
            train_s: 600.0,
            sync_s: 600.0,
            collective_s: 120.0,
        }
    }
}
