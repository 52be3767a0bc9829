//! The config's modes as enums: each value a variant, each with the word the TOML uses.
//! A word the enum does not know is refused when the config is read, and the error
//! lists the words it accepts (see `config::parse`). Algorithm names, KL estimators
//! and loss aggregations are `yatt-roles`' own enums.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// Defines a config mode: the enum, its TOML words, and `name()` / `Display` that give
/// the word back.
macro_rules! config_mode {
    ($(#[$meta:meta])* $name:ident { $($(#[$vmeta:meta])* $variant:ident = $word:literal,)+ }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $word)] $variant,)+
        }

        impl $name {
            /// The word the TOML uses.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $word,)+
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.name())
            }
        }
    };
}

config_mode! {
    /// `rollout.env.call_prefix`: how a tool environment's opening of a call is used.
    CallPrefix {
        /// No opening: calling is the model's choice alone.
        Off = "off",
        /// Every episode's first turn opens with the call, masked out of the loss: a
        /// scaffold the model never learns to do without.
        Always = "always",
        /// Guidance: `rollout.env.guide_fraction` of each prompt's episodes open with
        /// the call, trained as if the model had written it; the others get none. Where
        /// the guided episodes score better, the model learns to call by itself.
        Guide = "guide",
    }
}

impl CallPrefix {
    /// Reads the word, or a boolean as the key took before the words (`true` is
    /// `always`, `false` is `off`).
    pub(crate) fn deserialize_word_or_bool<'de, D>(d: D) -> Result<Self, D::Error>
    where
        D: serde::Deserializer<'de>,
    {
        struct WordOrBool;
        impl<'de> serde::de::Visitor<'de> for WordOrBool {
            type Value = CallPrefix;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("\"off\", \"always\" or \"guide\" (or true / false)")
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<CallPrefix, E> {
                Ok(if v {
                    CallPrefix::Always
                } else {
                    CallPrefix::Off
                })
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<CallPrefix, E> {
                use serde::de::IntoDeserializer;
                CallPrefix::deserialize(v.into_deserializer())
            }
        }
        d.deserialize_any(WordOrBool)
    }
}

config_mode! {
    /// `job.driver`: how the heads are driven.
    Driver {
        /// One controller per head, meeting at the update.
        Parallel = "parallel",
        /// One driver holding the global batch and spreading generation over the
        /// replicas (for comparison).
        Single = "single",
    }
}

config_mode! {
    /// `model.dtype`: the dtype of the models' weights.
    Dtype {
        /// 32-bit float.
        F32 = "f32",
        /// bfloat16.
        Bf16 = "bf16",
        /// IEEE half.
        F16 = "f16",
    }
}

config_mode! {
    /// `data.task`: the synthetic task (when no dataset file is given).
    Task {
        /// Two numbers to add.
        Addition = "addition",
        /// Two numbers to multiply (`data.length` digits each; pair it with
        /// `rollout.env = { kind = "calculator" }`).
        Multiplication = "multiplication",
        /// A list to sort.
        Sorting = "sorting",
        /// A string to reverse.
        Reversal = "reversal",
        /// Any text; the `letters` reward scores it.
        Letters = "letters",
        /// A target response length that grows over the run.
        Growing = "growing",
    }
}

config_mode! {
    /// `algorithm.kl_mode`: where the KL to the reference goes.
    KlMode {
        /// A KL loss in the policy.
        Loss = "loss",
        /// A KL penalty in the reward.
        Reward = "reward",
        /// No KL term and no reference model.
        None = "none",
    }
}

config_mode! {
    /// `algorithm.old_logprobs`: where the PPO ratio's old log-probs come from.
    OldLogprobs {
        /// A forward pass of the policy before the update.
        Recompute = "recompute",
        /// The one update runs on the weights that generated: the ratio is 1.
        OnPolicy = "on-policy",
        /// The rollout's own log-probs (the behaviour policy), no forward pass: the
        /// ratio is against the weights that generated, up to `rollout.staleness`
        /// versions back (asynchronous RL without the recompute).
        Rollout = "rollout",
    }
}

config_mode! {
    /// `model.lora.sync`: what a weight sync of a LoRA policy carries.
    LoraSyncMode {
        /// The adapters alone; rollouts fold them into their copy of the base.
        Adapters = "adapters",
        /// The merged weights, the whole model.
        Merged = "merged",
    }
}

config_mode! {
    /// `optim.schedule`: the learning-rate schedule.
    Schedule {
        /// Constant after warm-up.
        Constant = "constant",
        /// Cosine to 10 % of `lr` at the end of the run.
        Cosine = "cosine",
    }
}

config_mode! {
    /// `reward.kind`: one reward function or model.
    RewardKind {
        /// The final number of the response against the reference.
        Numeric = "numeric",
        /// The response against the reference, exactly.
        Exact = "exact",
        /// The fraction of the response's characters in `reward.letters`.
        Letters = "letters",
        /// A scalar reward model (`reward.model`).
        Model = "model",
        /// An LLM judge (`reward.judge_model`).
        Judge = "judge",
        /// A Python function, `reward.function = "file.py:compute_score"`, on a pool of
        /// worker processes.
        Python = "python",
        /// A remote endpoint, `reward.url`.
        Http = "http",
    }
}

config_mode! {
    /// `reward.judge_mode`: how the judge's verdict becomes a score.
    VerdictMode {
        /// A greedy verdict, parsed; per-step scores.
        Generate = "generate",
        /// The expected digit after a prefilled `Score: `.
        Logits = "logits",
    }
}

config_mode! {
    /// `reward.judge_on_unparsed`: a verdict with no score.
    UnparsedVerdict {
        /// Fail the step.
        Error = "error",
        /// Score it `reward.judge_fallback_score`.
        Fallback = "fallback",
    }
}

config_mode! {
    /// `placement.mode`: where a job's roles run.
    PlacementMode {
        /// Every role in the training process.
        Colocate = "colocate",
        /// Each role on the cluster node `[placement]` names.
        Disaggregated = "disaggregated",
    }
}

config_mode! {
    /// `placement.policy_pool`: what the live placement's policy groups hold.
    PolicyPool {
        /// A whole replica of the policy each (1 or `job.controllers` of them, their
        /// gradients averaged); a group that moves takes or hands over a whole replica.
        Replicas = "replicas",
        /// The ranks of one policy sharded over them (ZeRO-3): a group that moves to
        /// or from the rollout reshards the policy in place, N → N−1 or N+1 ranks,
        /// between two steps.
        Sharded = "sharded",
    }
}

config_mode! {
    /// `placement.time_share`: whether colocated roles take turns with the device's
    /// memory between the phases of a step (verl's and OpenRLHF's "sleep / wake").
    TimeShare {
        /// Every role keeps its memory all the time.
        Off = "off",
        /// Before generation the policy (and critic, and reference) move their state
        /// to the host and the rollout comes back; after generation the rollout frees
        /// its KV cache and moves its weights to the host, and the others come back.
        Offload = "offload",
    }
}

/// `model.source`: `tiny` (a random tiny Llama with a character codec) or an HF model
/// directory. In TOML it is one string.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(from = "String", into = "String")]
pub enum ModelSource {
    /// The tiny random Llama.
    Tiny,
    /// An HF model directory (config.json, safetensors, tokenizer.json).
    Dir(PathBuf),
}

impl ModelSource {
    /// The directory, when the model comes from one.
    pub fn dir(&self) -> Option<&std::path::Path> {
        match self {
            ModelSource::Tiny => None,
            ModelSource::Dir(d) => Some(d),
        }
    }
}

impl From<String> for ModelSource {
    fn from(s: String) -> Self {
        if s == "tiny" {
            ModelSource::Tiny
        } else {
            ModelSource::Dir(s.into())
        }
    }
}

impl From<ModelSource> for String {
    fn from(s: ModelSource) -> Self {
        s.to_string()
    }
}

impl std::fmt::Display for ModelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ModelSource::Tiny => f.write_str("tiny"),
            ModelSource::Dir(d) => write!(f, "{}", d.display()),
        }
    }
}

/// `model.device`: where the job's models, KV caches and optimizer state live. In TOML
/// it is one string: `auto`, `cpu`, `cuda` or `cuda:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(try_from = "String", into = "String")]
pub enum DeviceSetting {
    /// The role's device group from placement: CUDA 0 of the node when libtorch sees a
    /// GPU there, else the CPU.
    Auto,
    /// The CPU.
    Cpu,
    /// One CUDA device, by ordinal on the node.
    Cuda(u32),
}

impl TryFrom<String> for DeviceSetting {
    type Error = String;
    fn try_from(s: String) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(DeviceSetting::Auto),
            "cpu" => Ok(DeviceSetting::Cpu),
            "cuda" => Ok(DeviceSetting::Cuda(0)),
            other => other
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(DeviceSetting::Cuda)
                .ok_or_else(|| {
                    format!("model.device = {s:?} is not a device; use auto, cpu, cuda or cuda:N")
                }),
        }
    }
}

impl From<DeviceSetting> for String {
    fn from(d: DeviceSetting) -> Self {
        d.to_string()
    }
}

impl std::fmt::Display for DeviceSetting {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DeviceSetting::Auto => f.write_str("auto"),
            DeviceSetting::Cpu => f.write_str("cpu"),
            DeviceSetting::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl Dtype {
    /// The libtorch dtype of the models' weights.
    pub fn kind(self) -> tch::Kind {
        match self {
            Dtype::F32 => tch::Kind::Float,
            Dtype::Bf16 => tch::Kind::BFloat16,
            Dtype::F16 => tch::Kind::Half,
        }
    }
}
