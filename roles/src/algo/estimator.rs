//! The algorithm registry: each algorithm's name, what it needs from the step, and the
//! one match that turns rewards into advantages. Adding an estimator touches this file
//! (and its maths in `advantage.rs`), nothing else.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::algo::advantage::{
    gae_advantage, grpo_advantage, reinforce_pp_advantage, rloo_advantage, token_level_rewards,
    Advantages, GaeConfig, GrpoConfig, ReinforcePpConfig,
};
use crate::algo::checks::AlgoError;
use crate::algo::loss::{LossAggMode, PolicyLossKind};

/// `algorithm.name`: the RL algorithm of a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum Algorithm {
    /// Group-normalised outcome advantages (DeepSeekMath).
    Grpo,
    /// Leave-one-out baseline within the prompt group.
    Rloo,
    /// Token returns normalised over the batch.
    #[serde(rename = "reinforce++")]
    ReinforcePp,
    /// GAE on a critic's values.
    Ppo,
    /// GRPO advantages with dynamic sampling (pair it with clip-higher and the
    /// overlong penalty).
    Dapo,
    /// Dr. GRPO (Liu et al. 2025): GRPO advantages without the std division
    /// (`r − mean_g`), loss summed over tokens ÷ a constant (`seq-mean-token-sum-norm`).
    DrGrpo,
    /// GSPO (Zheng et al. 2025): GRPO advantages, the clipped surrogate on the
    /// sequence-level importance ratio (clip 3e-4 / 4e-4).
    Gspo,
    /// CISPO (MiniMax-M1, 2025): GRPO advantages, the clipped importance weight
    /// (stop-gradient) times `A · log π`, token-mean.
    Cispo,
}

impl Algorithm {
    /// Whether the job needs a critic (value model) role.
    pub fn needs_critic(self) -> bool {
        matches!(self, Algorithm::Ppo)
    }

    /// Whether dynamic sampling is on when the config does not say.
    pub fn dynamic_sampling_by_default(self) -> bool {
        matches!(self, Algorithm::Dapo)
    }

    /// The policy loss of the algorithm.
    pub fn policy_loss(self) -> PolicyLossKind {
        match self {
            Algorithm::Gspo => PolicyLossKind::Gspo,
            Algorithm::Cispo => PolicyLossKind::Cispo,
            Algorithm::Grpo
            | Algorithm::Rloo
            | Algorithm::ReinforcePp
            | Algorithm::Ppo
            | Algorithm::Dapo
            | Algorithm::DrGrpo => PolicyLossKind::Ppo,
        }
    }

    /// `(clip_low, clip_high)` when the config gives none: GSPO's paper ranges
    /// (3e-4, 4e-4: a sequence ratio moves much less than a token's), no lower bound on
    /// CISPO's weight (1, as MiniMax-M1) with PPO's 0.2 above, PPO's 0.2 otherwise.
    pub fn default_clip(self) -> (f64, f64) {
        match self {
            Algorithm::Gspo => (3e-4, 4e-4),
            Algorithm::Cispo => (1.0, 0.2),
            _ => (0.2, 0.2),
        }
    }

    /// The loss aggregation when the config gives none: `seq-mean-token-sum-norm` for
    /// Dr. GRPO, `seq-mean-token-mean` for GSPO (the paper's mean over sequences of the
    /// sequence loss), `token-mean` otherwise.
    pub fn default_loss_agg(self) -> LossAggMode {
        match self {
            Algorithm::DrGrpo => LossAggMode::SeqMeanTokenSumNorm,
            Algorithm::Gspo => LossAggMode::SeqMeanTokenMean,
            _ => LossAggMode::TokenMean,
        }
    }

    /// The advantage estimator of the algorithm; `gae` is used by PPO only.
    pub fn estimator(self, gae: GaeConfig) -> AdvantageEstimator {
        match self {
            Algorithm::Grpo | Algorithm::Dapo | Algorithm::Gspo | Algorithm::Cispo => {
                AdvantageEstimator::Grpo(GrpoConfig::default())
            }
            Algorithm::DrGrpo => AdvantageEstimator::Grpo(GrpoConfig {
                norm_by_std: false,
                ..GrpoConfig::default()
            }),
            Algorithm::Rloo => AdvantageEstimator::Rloo,
            Algorithm::ReinforcePp => AdvantageEstimator::ReinforcePp(ReinforcePpConfig::default()),
            Algorithm::Ppo => AdvantageEstimator::Gae(gae),
        }
    }
}

/// How a step's rewards become per-token advantages.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AdvantageEstimator {
    /// Group-normalised outcome rewards (GRPO, DAPO, GSPO, CISPO; Dr. GRPO without the
    /// std division).
    Grpo(GrpoConfig),
    /// Leave-one-out baseline within the prompt group.
    Rloo,
    /// Token returns normalised over the batch.
    ReinforcePp(ReinforcePpConfig),
    /// PPO: generalised advantage estimation on the critic's values.
    Gae(GaeConfig),
}

/// What an estimator reads: `[B]` sequence tensors, `[B, T]` token tensors.
#[derive(Debug)]
pub struct AdvantageInputs<'a> {
    /// The rewards the reward role gave, `[B]`.
    pub scores: &'a Tensor,
    /// `scores` after a KL penalty in the reward, `[B]` (the outcome estimators' input).
    pub rewards: &'a Tensor,
    /// Response mask `[B, T]`.
    pub mask: &'a Tensor,
    /// The prompt group of each sample.
    pub groups: &'a [usize],
    /// Per-token KL penalty and its coefficient, when the reward carries one.
    pub kl: Option<(&'a Tensor, f64)>,
    /// The critic's values `[B, T]` (GAE only).
    pub values: Option<&'a Tensor>,
}

impl AdvantageEstimator {
    /// Whether the estimator reads the critic's values (and gives returns to train it).
    pub fn uses_values(&self) -> bool {
        matches!(self, AdvantageEstimator::Gae(_))
    }

    /// The advantages (and returns) of a step.
    pub fn compute(&self, x: &AdvantageInputs<'_>) -> Result<Advantages, AlgoError> {
        let token_rewards = || {
            token_level_rewards(
                x.scores,
                x.mask,
                x.kl.map(|(k, _)| k),
                x.kl.map_or(0.0, |(_, c)| c),
            )
        };
        match self {
            AdvantageEstimator::Grpo(c) => grpo_advantage(x.rewards, x.mask, x.groups, c),
            AdvantageEstimator::Rloo => rloo_advantage(x.rewards, x.mask, x.groups),
            AdvantageEstimator::ReinforcePp(c) => {
                reinforce_pp_advantage(&token_rewards()?, x.mask, c)
            }
            AdvantageEstimator::Gae(c) => {
                let values = x.values.ok_or(AlgoError::MissingValues)?;
                gae_advantage(&token_rewards()?, values, x.mask, c)
            }
        }
    }
}
