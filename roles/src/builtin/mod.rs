//! The built-in roles: rollout, reference, policy, critic, reward.
//!
//! What belongs here: [`Role`](crate::role::Role) implementations that wrap the engine
//! (generation, scoring, training) and the reward functions, with the request and
//! response types the controller sends them. Each role is synchronous and runs on its
//! own thread inside a [`RoleActor`](crate::role::RoleActor); tch is only touched there.
//! Samples come in and go out keyed by [`SampleId`](crate::sample::SampleId); a role
//! fills in its own field of each [`Sample`] and nothing else.
//!
//! | file | role |
//! |---|---|
//! | [`rollout`] | generation engine replica; text codecs (tokenizer, ASCII for tests) |
//! | [`reference`](mod@reference) | frozen reference policy: reference log-probs |
//! | [`policy`] | the trainer: old log-probs, PPO/GRPO update, weight export, checkpoints |
//! | [`reward`] | weighted rule-based reward functions and batched scorers (reward models, judge, Python, HTTP) |
//! | [`critic`] | value model (backbone + `v_head`) for PPO: values and value-loss updates |
//! | [`reward_model`] | scalar reward model (backbone + `score` head): scoring, training |
//! | [`judge_model`] | generative reward model (LLM judge) on its own generator |

pub mod critic;
mod device_weights;
mod fault;
pub mod growing_reward;
pub mod judge_model;
mod nccl_member;
pub mod policy;
mod policy_push;
pub mod reference;
pub mod reward;
pub mod reward_model;
pub mod rollout;
pub(crate) mod scoring;
mod shard_ring;
mod slices;
#[cfg(test)]
mod slices_tests;
mod write_root;
pub use growing_reward::GrowingLengthReward;
pub use write_root::check_write_root;

pub use critic::{
    CriticConfig, CriticRankStep, CriticReport, CriticRequest, CriticResponse, CriticRole,
    ShardedCriticRole,
};
pub use judge_model::{JudgeConfig, JudgeMode, JudgeScorer, OnUnparsed};
pub use policy::{
    GradShard, KlLossConfig, LoraSync, PolicyConfig, PolicyRankRole, PolicyRequest, PolicyResponse,
    PolicyRole, PushReport, PushTarget, RankRef, RankRequest, RankResponse, RankSource, RankStep,
    RemoteRanks, ShardReport, ShardedPolicyRole, ShardedReferenceRole, ShardedStart, SlicePusher,
    TrainReport, TrainerState,
};
pub use policy_push::PushingPolicy;
pub use reference::ReferenceRole;
pub use reward::RewardRole;
pub use reward_model::{
    load_model as load_reward_model, load_rm_jsonl, train_reward_model, ModelScorer,
    RewardModelError, RmExample, RmTrainConfig, ScalarRewardModel,
};
pub use rollout::{
    encode_prompt, AsciiCodec, ContinueRequest, GenerateRequest, RolloutRequest, RolloutResponse,
    RolloutRole, RolloutStats, SampleSink, TextCodec, TokenizerCodec, TINY_CODEC,
};
pub use shard_ring::RingShardGroup;
