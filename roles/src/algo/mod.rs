//! Advantage estimators, policy and value losses, KL estimators: pure tensor maths.
//!
//! What belongs here: functions from `tch::Tensor`s to `tch::Tensor`s (plus small `f64`
//! stats structs) that run unchanged on CPU and CUDA. No actors, no I/O, no model code.
//! The policy/critic roles call these between their forward and backward passes.
//!
//! Conventions:
//! - token-level tensors are `[B, T]` (responses × response tokens) with a float `mask`
//!   `[B, T]`: 1 for real response tokens, 0 for padding. Every result is zero on
//!   padding, and padding never contributes to a mean, a sum or a normaliser;
//! - sequence-level tensors are `[B]`;
//! - prompt groups are `&[usize]` of length `B` (sample → group id, any ids);
//!   [`group_ids_from_tensor`] converts a `[B]` integer tensor.
//!
//! | file | concern |
//! |---|---|
//! | [`advantage`] | GRPO, RLOO, REINFORCE++, GAE; token rewards from sequence rewards |
//! | [`kl`] | k1/k2/k3 KL estimators |
//! | [`loss`] | PPO clipped policy loss (clip-higher, dual clip), value loss, entropy, KL loss, aggregation modes |
//! | [`policy_loss`] | GSPO (sequence ratio), CISPO (clipped IS weight), and the match over [`PolicyLossKind`] |
//! | [`off_policy`] | decoupled PPO and truncated IS weights for samples of older weights |
//! | [`dapo`] | DAPO dynamic-sampling filter and overlong penalty |
//! | [`step_credit`] | CAPO-style step credit: a judge's step verdicts as token credit |

pub mod advantage;
pub(crate) mod checks;
pub use checks::{group_ids_from_tensor, AlgoError};
pub mod dapo;
pub mod estimator;
pub use estimator::{AdvantageEstimator, AdvantageInputs, Algorithm};
pub mod kl;
pub mod loss;
pub mod off_policy;
pub mod policy_loss;
pub mod step_credit;

pub use advantage::{
    gae_advantage, grpo_advantage, reinforce_pp_advantage, rloo_advantage, token_level_rewards,
    AdvantageNorm, Advantages, GaeConfig, GrpoConfig, ReinforcePpConfig,
};
pub use dapo::{
    dynamic_sampling_filter, overlong_penalty, overlong_penalty_tensor, DynamicSampling,
};
pub use kl::{kl_estimate, KlEstimator};
pub use loss::{
    aggregate_loss, entropy_from_logits, entropy_loss, kl_loss, masked_mean, ppo_policy_loss,
    value_loss, EntropyStats, KlLossStats, LossAgg, LossAggMode, PolicyLossConfig, PolicyLossKind,
    PolicyLossStats, ValueLossConfig, ValueLossStats,
};
pub use off_policy::{
    behaviour_weights, off_policy_stats, BehaviourCorrection, OffPolicyConfig, OffPolicyStats,
};
pub use policy_loss::{cispo_policy_loss, gspo_policy_loss, policy_loss};
pub use step_credit::{
    apply_step_credit, centre_step_credit, numbered_steps, step_spans, step_token_ends, vote_steps,
    StepCreditConfig, StepCreditOutcome, StepVote,
};

#[cfg(test)]
mod tests;
