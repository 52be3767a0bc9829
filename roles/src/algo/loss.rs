//! Losses: PPO clipped policy loss (asymmetric clip-higher, dual clip), clipped value
//! loss, entropy bonus, KL loss; and the aggregation modes that turn a `[B, T]` loss
//! matrix into a scalar. Each loss returns the scalar tensor (differentiable) and a small
//! stats struct of plain `f64`s for metrics.

use serde::{Deserialize, Serialize};
use tch::Tensor;

use crate::algo::checks::{check_bt, check_same_bt, scalar, AlgoError};
use crate::algo::kl::{kl_estimate, KlEstimator};

/// How a `[B, T]` per-token loss becomes a scalar.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LossAgg {
    /// Sum over all valid tokens ÷ number of valid tokens (DAPO token-level loss:
    /// long responses weigh in proportion to their length).
    TokenMean,
    /// Mean over each sequence's valid tokens, then mean over the sequences that have
    /// at least one valid token (original GRPO).
    SeqMeanTokenMean,
    /// Sum over each sequence's valid tokens ÷ a constant `max_len`, then mean over
    /// sequences (Dr. GRPO: no length bias).
    SeqMeanTokenSumNorm {
        /// The constant normaliser, usually the maximum response length.
        max_len: f64,
    },
}

/// `algorithm.loss_agg`: an aggregation mode by name, before its parameters are known
/// ([`LossAggMode::with_max_len`] gives the [`LossAgg`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum LossAggMode {
    /// [`LossAgg::TokenMean`].
    TokenMean,
    /// [`LossAgg::SeqMeanTokenMean`].
    SeqMeanTokenMean,
    /// [`LossAgg::SeqMeanTokenSumNorm`], normalised by the maximum response length.
    SeqMeanTokenSumNorm,
}

impl LossAggMode {
    /// The aggregation; `max_len` (the maximum response length, e.g.
    /// `rollout.max_new_tokens`) is the constant normaliser of `seq-mean-token-sum-norm`.
    pub fn with_max_len(self, max_len: usize) -> LossAgg {
        match self {
            LossAggMode::TokenMean => LossAgg::TokenMean,
            LossAggMode::SeqMeanTokenMean => LossAgg::SeqMeanTokenMean,
            LossAggMode::SeqMeanTokenSumNorm => LossAgg::SeqMeanTokenSumNorm {
                max_len: max_len as f64,
            },
        }
    }
}

impl std::fmt::Display for LossAggMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            LossAggMode::TokenMean => "token-mean",
            LossAggMode::SeqMeanTokenMean => "seq-mean-token-mean",
            LossAggMode::SeqMeanTokenSumNorm => "seq-mean-token-sum-norm",
        })
    }
}

/// Which policy-gradient loss `policy_loss` computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PolicyLossKind {
    /// PPO clipped surrogate on the token ratio `π/π_old` ([`ppo_policy_loss`]).
    #[default]
    Ppo,
    /// GSPO (Zheng et al. 2025): the clipped surrogate on the sequence ratio
    /// `s_i = exp(mean_t(log π − log π_old))`, with the sequence's advantage
    /// ([`super::gspo_policy_loss`]).
    Gspo,
    /// GSPO-token: GSPO's sequence ratio with per-token advantages.
    GspoToken,
    /// CISPO (MiniMax-M1, 2025): `−sg(clip(ρ, 1−ε_low, 1+ε_high)) · A · log π`, the
    /// importance weight clipped instead of the update ([`super::cispo_policy_loss`]).
    Cispo,
}

/// Mean of `x` over valid tokens (scalar tensor; 0 when the mask is empty).
pub fn masked_mean(x: &Tensor, mask: &Tensor) -> Tensor {
    let k = mask.kind();
    (x.to_kind(k) * mask).sum(k) / mask.sum(k).clamp_min(1.0)
}

/// Aggregates a per-token loss `[B, T]` under `mask` with `agg`.
pub fn aggregate_loss(loss: &Tensor, mask: &Tensor, agg: LossAgg) -> Result<Tensor, AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_same_bt(loss, "loss", b, t)?;
    let k = mask.kind();
    let masked = loss.to_kind(k) * mask;
    Ok(match agg {
        LossAgg::TokenMean => masked.sum(k) / mask.sum(k).clamp_min(1.0),
        LossAgg::SeqMeanTokenMean => {
            let lens = mask.sum_dim_intlist(1, false, k);
            let seq = masked.sum_dim_intlist(1, false, k) / lens.clamp_min(1.0);
            let has = lens.gt(0.0).to_kind(k);
            (seq * &has).sum(k) / has.sum(k).clamp_min(1.0)
        }
        LossAgg::SeqMeanTokenSumNorm { max_len } => {
            if max_len.is_nan() || max_len <= 0.0 {
                return Err(AlgoError::Param {
                    name: "max_len",
                    value: max_len,
                    reason: "the Dr. GRPO normaliser must be > 0 (use the maximum response length)",
                });
            }
            (masked.sum_dim_intlist(1, false, k) / max_len).mean(k)
        }
    })
}

/// Policy-loss options: which loss, its clip range, its aggregation.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PolicyLossConfig {
    /// Which loss (PPO, GSPO, GSPO-token, CISPO).
    #[serde(default)]
    pub kind: PolicyLossKind,
    /// ε_low: the ratio is clipped below at `1 − clip_low`.
    pub clip_low: f64,
    /// ε_high: the ratio is clipped above at `1 + clip_high` (DAPO clip-higher: 0.28).
    pub clip_high: f64,
    /// Dual-clip constant `c > 1` (verl: 3.0): for negative advantages the loss is
    /// capped at `−c·A`, so a huge ratio cannot produce an unbounded update (PPO only).
    pub dual_clip: Option<f64>,
    /// Aggregation of the per-token loss.
    pub agg: LossAgg,
}

impl Default for PolicyLossConfig {
    fn default() -> Self {
        Self {
            kind: PolicyLossKind::Ppo,
            clip_low: 0.2,
            clip_high: 0.2,
            dual_clip: None,
            agg: LossAgg::TokenMean,
        }
    }
}

/// Metrics of one policy-loss evaluation (means over valid tokens).
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct PolicyLossStats {
    /// Fraction of tokens where the clipped surrogate was the active (larger) loss.
    pub clip_frac: f64,
    /// Fraction of tokens where the dual clip capped the loss (negative advantages).
    pub dual_clip_frac: f64,
    /// k1 estimate of KL(π_old ‖ π): mean of `old_logp − logp`.
    pub approx_kl: f64,
    /// Mean importance ratio `π / π_old`.
    pub ratio_mean: f64,
}

/// Checks a policy loss's `[B, T]` inputs (`logp`, `old_logp`, `advantages`) against
/// `mask`, and its clip range: `clip_high ≥ 0`, `clip_low` in `[0, 1)`, or in `[0, 1]`
/// when `closed_low` gives the reason (CISPO's weight may have no lower bound).
pub(crate) fn check_policy_inputs(
    tensors: [&Tensor; 3],
    mask: &Tensor,
    cfg: &PolicyLossConfig,
    closed_low: Option<&'static str>,
) -> Result<(), AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    for (x, what) in tensors.into_iter().zip(["logp", "old_logp", "advantages"]) {
        check_same_bt(x, what, b, t)?;
    }
    let low_ok = match closed_low {
        Some(_) => (0.0..=1.0).contains(&cfg.clip_low),
        None => (0.0..1.0).contains(&cfg.clip_low),
    };
    if !low_ok {
        return Err(AlgoError::Param {
            name: "clip_low",
            value: cfg.clip_low,
            reason: closed_low.unwrap_or("must be in [0, 1)"),
        });
    }
    if cfg.clip_high.is_nan() || cfg.clip_high < 0.0 {
        return Err(AlgoError::Param {
            name: "clip_high",
            value: cfg.clip_high,
            reason: "must be >= 0",
        });
    }
    Ok(())
}

/// PPO clipped surrogate loss (to minimise), per token:
/// `max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high))`, then for `A < 0` with dual clip
/// `min(that, −c·A)`; aggregated with `cfg.agg`. `ρ = exp(logp − old_logp)` with the
/// log-ratio clamped to ±20. All inputs `[B, T]`.
pub fn ppo_policy_loss(
    logp: &Tensor,
    old_logp: &Tensor,
    advantages: &Tensor,
    mask: &Tensor,
    cfg: &PolicyLossConfig,
) -> Result<(Tensor, PolicyLossStats), AlgoError> {
    check_policy_inputs([logp, old_logp, advantages], mask, cfg, None)?;
    if let Some(c) = cfg.dual_clip {
        if c.is_nan() || c <= 1.0 {
            return Err(AlgoError::Param {
                name: "dual_clip",
                value: c,
                reason: "the dual-clip constant must be > 1 (verl uses 3.0)",
            });
        }
    }
    let k = mask.kind();
    let a = advantages.to_kind(k);
    let log_ratio = (logp.to_kind(k) - old_logp.to_kind(k)).clamp(-20.0, 20.0);
    let ratio = log_ratio.exp();
    let l1 = -&a * &ratio;
    let l2 = -&a * ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
    let clipped = l1.maximum(&l2);
    let clip_frac = scalar(&masked_mean(&l2.gt_tensor(&l1).to_kind(k), mask));
    let (per_token, dual_clip_frac) = match cfg.dual_clip {
        Some(c) => {
            let l3 = -&a * c;
            let neg = a.lt(0.0);
            let capped = clipped.minimum(&l3);
            let frac = clipped.gt_tensor(&l3).logical_and(&neg).to_kind(k);
            (
                capped.where_self(&neg, &clipped),
                scalar(&masked_mean(&frac, mask)),
            )
        }
        None => (clipped, 0.0),
    };
    let loss = aggregate_loss(&per_token, mask, cfg.agg)?;
    let stats = PolicyLossStats {
        clip_frac,
        dual_clip_frac,
        approx_kl: scalar(&masked_mean(&(-&log_ratio), mask)),
        ratio_mean: scalar(&masked_mean(&ratio, mask)),
    };
    Ok((loss, stats))
}

/// Value-loss options.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct ValueLossConfig {
    /// PPO value clipping: new values are clipped to `old ± clip`; `None` disables it.
    pub clip: Option<f64>,
    /// Aggregation of the per-token loss.
    pub agg: LossAgg,
}

impl Default for ValueLossConfig {
    fn default() -> Self {
        Self {
            clip: Some(0.5),
            agg: LossAgg::TokenMean,
        }
    }
}

/// Metrics of one value-loss evaluation.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct ValueLossStats {
    /// Fraction of valid tokens where the clipped error was the larger one.
    pub clip_frac: f64,
    /// Mean predicted value over valid tokens.
    pub value_mean: f64,
}

/// Clipped value loss `½ · agg(max((V − R)², (clip(V, V_old ± ε) − R)²))`.
/// `values` (new predictions), `old_values`, `returns`, `mask` are `[B, T]`.
pub fn value_loss(
    values: &Tensor,
    old_values: &Tensor,
    returns: &Tensor,
    mask: &Tensor,
    cfg: &ValueLossConfig,
) -> Result<(Tensor, ValueLossStats), AlgoError> {
    let (b, t) = check_bt(mask, "mask")?;
    check_same_bt(values, "values", b, t)?;
    check_same_bt(old_values, "old_values", b, t)?;
    check_same_bt(returns, "returns", b, t)?;
    let k = mask.kind();
    let (v, r) = (values.to_kind(k), returns.to_kind(k));
    let l1 = (&v - &r).square();
    let (per_token, clip_frac) = match cfg.clip {
        Some(eps) => {
            if eps.is_nan() || eps < 0.0 {
                return Err(AlgoError::Param {
                    name: "clip",
                    value: eps,
                    reason: "value clip range must be >= 0",
                });
            }
            let old = old_values.to_kind(k);
            let vc = old.shallow_clone() + (&v - &old).clamp(-eps, eps);
            let l2 = (vc - &r).square();
            let frac = scalar(&masked_mean(&l2.gt_tensor(&l1).to_kind(k), mask));
            (l1.maximum(&l2), frac)
        }
        None => (l1, 0.0),
    };
    let loss = aggregate_loss(&per_token, mask, cfg.agg)? * 0.5;
    Ok((
        loss,
        ValueLossStats {
            clip_frac,
            value_mean: scalar(&masked_mean(&v, mask)),
        },
    ))
}

/// The normaliser of `agg` over a micro-batch's response `mask` `[B, T]`: its tokens
/// (token-mean), its sequences with tokens (seq-mean-token-mean), its sequences
/// (seq-mean-token-sum-norm). A step's loss is the micro-batches' losses weighted by
/// their normaliser over the step's.
pub(crate) fn normaliser(mask: &Tensor, agg: LossAgg) -> f64 {
    let tokens: Vec<f64> =
        Vec::try_from(mask.sum_dim_intlist(1, false, tch::Kind::Double)).unwrap_or_default();
    match agg {
        LossAgg::TokenMean => tokens.iter().sum(),
        LossAgg::SeqMeanTokenMean => tokens.iter().filter(|&&t| t > 0.0).count() as f64,
        LossAgg::SeqMeanTokenSumNorm { .. } => tokens.len() as f64,
    }
}

/// Per-token entropy of the categorical distribution given by `logits` `[B, T, V]`:
/// `logsumexp(z) − Σ softmax(z)·z`, shape `[B, T]`.
pub fn entropy_from_logits(logits: &Tensor) -> Result<Tensor, AlgoError> {
    crate::algo::checks::check_float(logits, "logits")?;
    if logits.dim() != 3 {
        return Err(AlgoError::Shape {
            what: "logits",
            expected: "[B, T, V] (batch × response tokens × vocabulary)".into(),
            got: logits.size(),
            hint: "pass the response-token logits before sampling",
        });
    }
    let p = logits.softmax(-1, logits.kind());
    Ok(logits.logsumexp(-1, false) - (p * logits).sum_dim_intlist(-1, false, logits.kind()))
}

/// Metrics of the entropy term.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct EntropyStats {
    /// Mean entropy over valid tokens.
    pub entropy_mean: f64,
}

/// Entropy bonus as a loss term: `−coef · agg(entropy)` (minimising it raises entropy).
pub fn entropy_loss(
    entropy: &Tensor,
    mask: &Tensor,
    coef: f64,
    agg: LossAgg,
) -> Result<(Tensor, EntropyStats), AlgoError> {
    let loss = aggregate_loss(entropy, mask, agg)? * (-coef);
    Ok((
        loss,
        EntropyStats {
            entropy_mean: scalar(&masked_mean(entropy, mask)),
        },
    ))
}

/// Metrics of the KL loss.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
pub struct KlLossStats {
    /// Mean per-token KL estimate over valid tokens.
    pub kl_mean: f64,
}

/// KL loss (GRPO: k3 with coefficient β): `coef · agg(kl_estimate(logp, ref_logp))`.
pub fn kl_loss(
    logp: &Tensor,
    ref_logp: &Tensor,
    mask: &Tensor,
    estimator: KlEstimator,
    coef: f64,
    agg: LossAgg,
) -> Result<(Tensor, KlLossStats), AlgoError> {
    let kl = kl_estimate(logp, ref_logp, mask, estimator)?;
    let loss = aggregate_loss(&kl, mask, agg)? * coef;
    Ok((
        loss,
        KlLossStats {
            kl_mean: scalar(&masked_mean(&kl, mask)),
        },
    ))
}
