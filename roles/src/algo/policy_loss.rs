//! The policy-gradient losses beyond PPO's token-ratio clip: GSPO (sequence-level
//! importance ratio, Zheng et al. 2025) and CISPO (clipped importance-sampling weight,
//! MiniMax-M1 2025), and [`policy_loss`], the one match over [`PolicyLossKind`] that the
//! policy role calls. Inputs are `[B, T]` like [`ppo_policy_loss`]'s.

use tch::Tensor;

use crate::algo::checks::{scalar, AlgoError};
use crate::algo::loss::{
    aggregate_loss, check_policy_inputs, masked_mean, ppo_policy_loss, PolicyLossConfig,
    PolicyLossKind, PolicyLossStats,
};

/// The policy loss `cfg.kind` names (to minimise) and its stats.
pub fn policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<(Tensor, PolicyLossStats), AlgoError> {
    match cfg.kind {
        PolicyLossKind::Ppo => ppo_policy_loss(logp, old_logp, advantages, mask, cfg),
        PolicyLossKind::Gspo => gspo_policy_loss(logp, old_logp, advantages, mask, cfg, false),
        PolicyLossKind::GspoToken => gspo_policy_loss(logp, old_logp, advantages, mask, cfg, true),
        PolicyLossKind::Cispo => cispo_policy_loss(logp, old_logp, advantages, mask, cfg),
    }
}

/// The inputs and clip range ([`check_policy_inputs`]), and no dual clip.
fn check_inputs(
    tensors: [&Tensor; 3],
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    closed_low: Option<&'static str>,
) -> Result<(), AlgoError> {
    check_policy_inputs(tensors, mask, cfg, closed_low)?;
    match cfg.dual_clip {
        Some(c) => Err(AlgoError::Param {
            name: "dual_clip",
            value: c,
            reason: "the dual clip belongs to the PPO loss; set it to None for GSPO and CISPO",
        }),
        None => Ok(()),
    }
}

/// GSPO (Group Sequence Policy Optimization): the PPO clipped surrogate on the
/// sequence-level importance ratio
/// `s_i = exp((1/|y_i|) · Σ_t (log π(y_i,t) − log π_old(y_i,t)))` (log-ratio clamped
/// to ±10), clipped to `[1 − clip_low, 1 + clip_high]` (paper: 3e-4, 4e-4).
///
/// Written in the GSPO-token form: per token `s_i,t = sg(s_i) · π(y_i,t) / sg(π(y_i,t))`,
/// whose value is `s_i` and whose gradient is `s_i · ∇log π(y_i,t)`, and per token loss
/// `max(−A·s_i,t, −A·clip(s_i,t))`, aggregated with `cfg.agg`. With `token_advantages =
/// false` (GSPO) `A` is each sequence's mean advantage `A_i`, and with
/// `seq-mean-token-mean` the loss is exactly the paper's
/// `(1/G) Σ_i max(−A_i·s_i, −A_i·clip(s_i))`, gradient `−(1/G) Σ_i A_i·∇s_i` for
/// unclipped sequences; with `true` (GSPO-token) `A` is the per-token advantage.
pub fn gspo_policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    token_advantages: bool,
) -> Result<(Tensor, PolicyLossStats), AlgoError> {
    check_inputs([logp, old_logp, advantages], mask, cfg, None)?;
    let k = mask.kind();
    let lp = logp.to_kind(k);
    let log_ratio = (&lp - old_logp.to_kind(k)) * mask;
    let lens = mask.sum_dim_intlist(1, true, k).clamp_min(1.0); // [B, 1]
    let seq_log_ratio = (log_ratio.sum_dim_intlist(1, true, k) / &lens).clamp(-10.0, 10.0);
    // value s_i on every token; gradient s_i·∇log π per token
    let ratio = (seq_log_ratio.detach() + &lp - lp.detach()).exp();
    let a = advantages.to_kind(k) * mask;
    let a = if token_advantages {
        a
    } else {
        a.sum_dim_intlist(1, true, k) / &lens
    };
    let l1 = -&a * &ratio;
    let l2 = -&a * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let per_token = l1.maximum(&l2);
    let loss = aggregate_loss(&per_token, mask, cfg.agg)?;
    let ratio = ratio.detach();
    let stats = PolicyLossStats {
        // as PPO's: tokens where the clipped term is the active one
        clip_frac: scalar(&masked_mean(&l2.gt_tensor(&l1).to_kind(k), mask)),
        dual_clip_frac: 0.0,
        approx_kl: scalar(&masked_mean(&(-&log_ratio), mask)),
        ratio_mean: scalar(&masked_mean(&ratio, mask)),
    };
    Ok((loss, stats))
}

/// CISPO (Clipped IS-weight Policy Optimization): per token
/// `−sg(clip(ρ, 1 − clip_low, 1 + clip_high)) · A · log π`, `ρ = exp(log π − log π_old)`
/// (log-ratio clamped to ±20), aggregated with `cfg.agg` (the paper: `token-mean`).
/// Every token keeps a gradient, `−clip(ρ)·A·∇log π`: the clip bounds the weight, not
/// the update. MiniMax-M1 puts no lower bound on the weight (`clip_low = 1`) and tunes
/// `clip_high`. The loss value is a surrogate whose gradient is the estimator's, not a
/// quantity to read.
pub fn cispo_policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<(Tensor, PolicyLossStats), AlgoError> {
    let no_low = "must be in [0, 1] (1: no lower bound on the weight, as MiniMax-M1)";
    check_inputs([logp, old_logp, advantages], mask, cfg, Some(no_low))?;
    let k = mask.kind();
    let lp = logp.to_kind(k);
    let log_ratio = (lp.detach() - old_logp.to_kind(k)).clamp(-20.0, 20.0);
    let ratio = log_ratio.exp();
    let weight = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let per_token = -(advantages.to_kind(k) * &weight * &lp);
    let loss = aggregate_loss(&per_token, mask, cfg.agg)?;
    let clipped = weight.ne_tensor(&ratio).to_kind(k);
    let stats = PolicyLossStats {
        clip_frac: scalar(&masked_mean(&clipped, mask)),
        dual_clip_frac: 0.0,
        approx_kl: scalar(&masked_mean(&(-&log_ratio), mask)),
        ratio_mean: scalar(&masked_mean(&ratio, mask)),
    };
    Ok((loss, stats))
}
