//! What a controller runs: batch, sampling, advantages, KL, dynamic sampling, deadlines.

use std::time::Duration;

use yatt_engine::SamplingParams;
use yatt_roles::{GrpoConfig, KlEstimator, OffPolicyConfig, StepCreditConfig};

use yatt_roles::AdvantageEstimator;

/// DAPO dynamic sampling: drop prompt groups whose rewards are all equal and generate
/// more prompts until the step has `prompts_per_step` groups with signal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicSamplingConfig {
    /// Generation rounds per step at most (the first included); after the last round
    /// the step trains on the groups it has.
    pub max_rounds: usize,
    /// Rewards closer than this count as equal.
    pub tolerance: f64,
}

/// DAPO soft overlong punishment added to the reward of long responses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongConfig {
    /// Length at which the penalty reaches −1 (usually `max_new_tokens`).
    pub max_len: usize,
    /// The buffer before `max_len` over which the penalty ramps from 0 to −1.
    pub buffer: usize,
    /// Scale of the penalty.
    pub coef: f64,
}

/// `rollout.weight_sync`: how weights reach rollouts in other processes (rollouts in
/// the policy's process take a snapshot of its tensors whatever this says).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
pub enum WeightSync {
    /// CUDA IPC where the policy and the rollout share a host and a GPU driver; byte
    /// buckets over QUIC otherwise, the reason logged once.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// Always byte buckets over QUIC (the runtime's shared-memory path on one host),
    /// sent by the policy's process to the rollouts where it can.
    #[serde(rename = "quic")]
    Quic,
    /// Byte buckets over QUIC through the controller (two hops), never from the
    /// policy's node: for clusters where that node cannot reach the rollouts' nodes.
    #[serde(rename = "relay")]
    Relay,
    /// Always CUDA IPC: a sync that cannot use it fails, naming why.
    #[serde(rename = "cuda_ipc")]
    CudaIpc,
    /// Always an NCCL broadcast from the policy (rank 0) to the rollouts (the other
    /// ranks), on any host: a sync that cannot use it fails, naming why.
    #[serde(rename = "nccl")]
    Nccl,
}

/// `job.gradient_sync`: how policy replicas average their gradients.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Default,
    serde::Serialize,
    serde::Deserialize,
    schemars::JsonSchema,
)]
pub enum GradientSync {
    /// An NCCL all-reduce where every replica's weights are on a GPU and NCCL loads;
    /// the QUIC ring otherwise, the reason logged once. A failed all-reduce falls back
    /// to the ring for the rest of the job, with a warning.
    #[default]
    #[serde(rename = "auto")]
    Auto,
    /// Always the QUIC ring.
    #[serde(rename = "quic")]
    Quic,
    /// Always NCCL: a job where it cannot be used fails before the first step, naming why.
    #[serde(rename = "nccl")]
    Nccl,
}

impl WeightSync {
    /// The word the TOML uses.
    pub fn name(self) -> &'static str {
        match self {
            WeightSync::Auto => "auto",
            WeightSync::Quic => "quic",
            WeightSync::Relay => "relay",
            WeightSync::CudaIpc => "cuda_ipc",
            WeightSync::Nccl => "nccl",
        }
    }
}

/// Partial rollouts (interruptible generation): responses decode in chunks, and a
/// chunk after a weight sync continues on the new weights, its prompt and the tokens
/// so far prefilled again (the simulator's `resume = "reprefill"`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartialRolloutConfig {
    /// Tokens a response decodes before the rollout may take newer weights.
    pub chunk_tokens: usize,
}

/// A KL penalty folded into the rewards (KL-in-reward).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlPenalty {
    /// Estimator of KL(old policy ‖ reference) per token.
    pub estimator: KlEstimator,
    /// Coefficient.
    pub coef: f64,
}

/// Deadlines of the controller's asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// Generation.
    pub generate: Duration,
    /// Reward, reference and old-log-prob scoring.
    pub score: Duration,
    /// The policy update.
    pub train: Duration,
    /// Weight export and load, and each offload or reload of time sharing.
    pub sync: Duration,
    /// Each NCCL operation of a weight sync (joining the group, each bucket's
    /// broadcast): past it the communicator is aborted and the error names the
    /// operation and the ranks.
    pub collective: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        let m = Duration::from_secs(600);
        Timeouts {
            generate: m,
            score: m,
            train: m,
            sync: m,
            collective: Duration::from_secs(120),
        }
    }
}

/// Time sharing of one device by colocated roles: the roles a phase does not use are
/// offloaded for it (the policy, critic and reference during generation; the rollout
/// during the rest of the step) and reloaded for the phase that needs them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TimeShareConfig {
    /// Device bytes the roles may hold together: a reload that would go beyond it
    /// fails the step naming the role. 0: unchecked.
    pub budget_bytes: u64,
}

/// How a controller runs its steps.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Prompts per step (from this controller's shard).
    pub prompts_per_step: usize,
    /// Samples per prompt.
    pub n: u32,
    /// Sampling parameters (the seed is replaced per sample).
    pub sampling: SamplingParams,
    /// Seed of the per-sample sampling seeds.
    pub seed: u64,
    /// Advantage estimator.
    pub advantage: AdvantageEstimator,
    /// Optional KL penalty in the reward (needs a reference role).
    pub kl_in_reward: Option<KlPenalty>,
    /// Estimator of the `actor/kl` metric (old policy vs reference).
    pub kl_metric: KlEstimator,
    /// DAPO dynamic sampling (off when `None`).
    pub dynamic_sampling: Option<DynamicSamplingConfig>,
    /// DAPO overlong penalty (off when `None`).
    pub overlong: Option<OverlongConfig>,
    /// CAPO-style step credit: the tokens of steps the reward's step verdicts failed
    /// lose advantage (off when `None`).
    pub step_credit: Option<StepCreditConfig>,
    /// Stream samples out of the rollouts as they finish and score their rewards
    /// while generation goes on (in-process rollouts only: the stream is a channel).
    pub stream: bool,
    /// Versions a sample may lag behind the weights it trains (0 = on-policy): with
    /// k ≥ 1 the next batches generate while the policy trains, up to k ahead.
    pub staleness: u32,
    /// Partial rollouts (with `staleness` ≥ 1): weights reach the rollouts while they
    /// generate, between chunks; `None`: after generation.
    pub partial_rollout: Option<PartialRolloutConfig>,
    /// The policy's off-policy correction (for the importance-weight metrics).
    pub off_policy: OffPolicyConfig,
    /// Warn once when the mean |old − rollout| log-prob difference of a step's
    /// up-to-date samples exceeds this (0 = never).
    pub logprob_diff_warn: f64,
    /// Devices this controller's roles use (the divisor of `perf/throughput`).
    pub devices: usize,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Offload and reload roles between the phases of a step (`None`: every role keeps
    /// its memory). Not with `staleness` ≥ 1: generation overlaps the update then.
    pub time_share: Option<TimeShareConfig>,
    /// How weights reach rollouts in other processes.
    pub weight_sync: WeightSync,
    /// How policy replicas average their gradients.
    pub gradient_sync: GradientSync,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            prompts_per_step: 8,
            n: 4,
            sampling: SamplingParams::default(),
            seed: 0,
            advantage: AdvantageEstimator::Grpo(GrpoConfig::default()),
            kl_in_reward: None,
            kl_metric: KlEstimator::K3,
            dynamic_sampling: None,
            overlong: None,
            step_credit: None,
            stream: false,
            staleness: 0,
            partial_rollout: None,
            off_policy: OffPolicyConfig::default(),
            logprob_diff_warn: 0.0,
            devices: 1,
            timeouts: Timeouts::default(),
            time_share: None,
            weight_sync: WeightSync::Auto,
            gradient_sync: GradientSync::Auto,
        }
    }
}
