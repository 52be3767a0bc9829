//! # yatt-roles
//!
//! The SDK a user writes roles against, and the RLHF parts built on it. A user's role
//! depends on this crate only.
//!
//! What belongs here:
//! - the SDK: the [`Role`] trait and the actor that runs a role on its own thread
//!   ([`RoleActor`]), the [`Sample`] that flows between roles, and how role messages
//!   travel (bulk weight buckets, spilled large bodies);
//! - algorithms: advantage estimators, policy and value losses, KL estimators (pure
//!   tensor maths);
//! - rewards: rule-based verifiers, the HTTP endpoint client, Python reward functions
//!   (a pool of worker processes), the LLM judge's template and parser;
//! - data: prompts (text or chat), JSONL, parquet and `save_to_disk` datasets, synthetic
//!   tasks, the checkpointable dataloader;
//! - the built-in roles: rollout, reference, policy, critic, reward, reward model,
//!   judge.
//!
//! What does not: how a job is configured, built, stepped, placed, checkpointed and
//! measured. That is `yatt-trainer`, which builds on this crate together with
//! `yatt-placement` and `yatt-metrics`. Models and maths kernels live in `yatt-engine`;
//! actors and transport in `yatt-runtime`.
//!
//! Every module is private; this page is the whole public API.

// The SDK a user writes against: every public item is documented.
#![deny(missing_docs)]

mod algo;
mod builtin;
mod data;
mod env;
mod json_value;
mod reward;
mod role;
mod sample;
mod wire;

// The SDK: what every role touches.
pub use role::{
    DeviceGroup, DeviceRoute, DeviceWeights, LocalWeights, NcclGroup, ResourceProfile, Role,
    RoleActor, RoleError, RoleRequest, RoleResponse, WeightSlice, WeightsUpdate,
};
pub use sample::{
    group_indices, response_mask, split_rows, token_matrix, EpisodeInfo, Finish, Sample,
    SampleError, SampleId, TokenField,
};

// Environments and tools for multi-turn rollouts.
pub use env::{
    builtin_env_factory, evaluate_expression, format_number, parse_tool_call, CalculatorTool, Env,
    EnvActorRef, EnvError, EnvFactory, EnvKind, EnvRequest, EnvResponse, EnvRole, EnvSettings,
    EnvStep, Episode, EpisodeLimits, GuessNumberEnv, NetIsolation, ParsedTurn, PrefixUse,
    PythonTool, PythonToolConfig, RemoteEnvPool, SpawnEnvActor, Tool, ToolCall, ToolEnv, ToolError,
    TurnOutcome, MAX_EPISODES_PER_ACTOR, TOOL_CALL_CLOSE, TOOL_CALL_OPEN,
};

// Algorithms: advantage estimators, losses, KL.
pub use algo::{
    aggregate_loss, behaviour_weights, cispo_policy_loss, dynamic_sampling_filter,
    entropy_from_logits, entropy_loss, gae_advantage, group_ids_from_tensor, grpo_advantage,
    gspo_policy_loss, kl_estimate, kl_loss, masked_mean, off_policy_stats, overlong_penalty,
    overlong_penalty_tensor, policy_loss, ppo_policy_loss, reinforce_pp_advantage, rloo_advantage,
    token_level_rewards, value_loss, AdvantageEstimator, AdvantageInputs, AdvantageNorm,
    Advantages, AlgoError, Algorithm, BehaviourCorrection, DynamicSampling, EntropyStats,
    GaeConfig, GrpoConfig, KlEstimator, KlLossStats, LossAgg, LossAggMode, OffPolicyConfig,
    OffPolicyStats, PolicyLossConfig, PolicyLossKind, PolicyLossStats, ReinforcePpConfig,
    ValueLossConfig, ValueLossStats,
};
// CAPO-style step credit.
pub use algo::{
    apply_step_credit, centre_step_credit, numbered_steps, step_spans, step_token_ends, vote_steps,
    StepCreditConfig, StepCreditOutcome, StepVote,
};

// Rewards.
pub use reward::{
    default_python, excerpt, extract_final_number, parse_function, parse_judge_output,
    CombinedReward, ExactMatchVerifier, FormatVerifier, HttpRewardClient, HttpRewardConfig,
    HttpRewardScorer, JudgeTemplate, JudgeVerdict, LettersReward, NumericVerifier, PythonReward,
    PythonRewardConfig, RewardError, RewardFn, RewardInput, RewardOutput, LETTERS,
};

// Data.
pub use data::{
    load_dataset, load_jsonl, parse_jsonl, DataError, DataFields, DataFormat, Dataloader,
    GrowingLength, LengthSchedule, LoaderState, Prompt, SyntheticTask, SyntheticTaskKind,
    DEFAULT_GROUND_TRUTH_KEY, DEFAULT_PROMPT_KEY,
};
/// An NCCL group's id, as [`NcclGroup`] and [`PolicyRequest::StageBroadcast`] carry it.
pub use yatt_collective::UniqueId;
/// A chat message (`role`, `content`): a chat prompt's turns.
pub use yatt_engine::ChatMessage;

// The built-in roles, their configs and their messages.
pub use builtin::{
    check_write_root, encode_prompt, load_reward_model, load_rm_jsonl, train_reward_model,
    AsciiCodec, ContinueRequest, CriticConfig, CriticRankStep, CriticReport, CriticRequest,
    CriticResponse, CriticRole, GenerateRequest, GradShard, GrowingLengthReward, JudgeConfig,
    JudgeMode, JudgeScorer, KlLossConfig, LoraSync, ModelScorer, OnUnparsed, PolicyConfig,
    PolicyRankRole, PolicyRequest, PolicyResponse, PolicyRole, PushReport, PushTarget,
    PushingPolicy, RankRef, RankRequest, RankResponse, RankSource, RankStep, ReferenceRole,
    RemoteRanks, RewardModelError, RewardRole, RingShardGroup, RmExample, RmTrainConfig,
    RolloutRequest, RolloutResponse, RolloutRole, RolloutStats, SampleSink, ScalarRewardModel,
    ShardReport, ShardedCriticRole, ShardedPolicyRole, ShardedReferenceRole, ShardedStart,
    SlicePusher, TextCodec, TokenizerCodec, TrainReport, TrainerState, TINY_CODEC,
};
