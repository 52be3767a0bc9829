//! Per-token KL estimators between the policy and the reference policy, from their
//! log-probs of the sampled tokens (Schulman's k1/k2/k3). Use the result as a reward
//! penalty ([`super::token_level_rewards`]) or as a loss term ([`super::kl_loss`]).

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::algo::checks::{check_bt, check_same_bt, AlgoError};

/// Which estimator of `KL(π ‖ π_ref)` to use per token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum KlEstimator {
    /// `logp − logp_ref`: unbiased, high variance, can be negative.
    K1,
    /// `½ (logp − logp_ref)²`: biased, low variance, ≥ 0.
    K2,
    /// `exp(logp_ref − logp) − (logp_ref − logp) − 1`: unbiased, low variance, ≥ 0
    /// (GRPO's KL loss). Clamped to at most 10, as verl does, so one outlier token cannot
    /// blow up the loss.
    K3,
}

/// Upper clamp of the k3 estimate.
pub const K3_CLAMP: f64 = 10.0;

/// Per-token KL estimate `[B, T]`, zero on padding. `logp`, `ref_logp`, `mask` are `[B, T]`.
pub fn kl_estimate(
    logp: &Tensor,
    ref_logp: &Tensor,
    mask: &Tensor,
    estimator: KlEstimator,
) -> Result<Tensor, AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_same_bt(logp, "logp", b, t)?;
    check_same_bt(ref_logp, "ref_logp", b, t)?;
    let k = mask.kind();
    let diff = logp.to_kind(k) - ref_logp.to_kind(k);
    let kl = match estimator {
        KlEstimator::K1 => diff,
        KlEstimator::K2 => diff.square() * 0.5,
        KlEstimator::K3 => {
            // log r = logp_ref − logp; clamp before exp so padding garbage cannot overflow.
            let log_r = (-diff).clamp(-20.0, 20.0);
            (log_r.exp() - &log_r - 1.0).clamp(0.0, K3_CLAMP)
        }
    };
    Ok(kl * mask)
}
