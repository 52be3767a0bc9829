//! A policy update's micro-batches: how a step is split (by samples or by a token
//! budget), each micro-batch's share of the step's loss, and its forward and backward
//! pass.

use tch::{Kind, Tensor};
use yatt_engine::EngineError;

use super::config::PolicyConfig;
use super::report::TrainReport;
use crate::algo::loss::{entropy_loss, kl_loss, masked_mean, LossAgg};
use crate::algo::policy_loss::policy_loss;
use crate::builtin::scoring::response_backward;
use crate::sample::Sample;

pub(super) struct Micro {
    /// The samples this micro-batch runs (indices into the batch): all of its range, or
    /// with [`PolicyConfig::skip_zero_advantage`] those with a non-zero advantage.
    pub(super) rows: Vec<usize>,
    /// Scales the loss over `rows` to the loss over the whole range: the aggregation's
    /// normaliser counts the samples left out (their loss terms are exactly zero).
    pub(super) keep_scale: f64,
    /// This micro-batch's share of the step's loss: its aggregation's normaliser (tokens
    /// or sequences) over the step's, so that the gradient does not depend on how the
    /// step is split into micro-batches.
    pub(super) weight: f64,
    pub(super) old: Tensor,
    pub(super) adv: Tensor,
    pub(super) reference: Option<Tensor>,
    pub(super) mask: Tensor,
}

#[derive(Default)]
pub(super) struct MicroStats {
    /// Micro-batches that ran a forward pass (the means below are over them).
    ran: usize,
    clip: f64,
    approx_kl: f64,
    kl: f64,
    entropy: f64,
}

/// One micro-batch's forward and backward pass of its loss (policy loss + KL loss −
/// entropy bonus, times its [`Micro::weight`]); returns the weighted loss, or `None` when
/// none of its samples carries a gradient. The LM head runs in chunks and, with layer
/// recompute on, the decoder keeps only each layer's input
/// ([`response_backward`]).
pub(super) fn micro_backward(
    model: &yatt_engine::Llama,
    samples: &[Sample],
    mb: &Micro,
    cfg: &PolicyConfig,
    stats: &mut MicroStats,
) -> yatt_engine::Result<Option<f64>> {
    if mb.rows.is_empty() {
        return Ok(None);
    }
    // The whole range borrows the batch; only a thinned micro-batch copies its samples.
    let contiguous = mb.rows.windows(2).all(|w| w[1] == w[0] + 1);
    let picked: Vec<Sample>;
    let chunk: &[Sample] = if contiguous {
        &samples[mb.rows[0]..=mb.rows[mb.rows.len() - 1]]
    } else {
        picked = mb.rows.iter().map(|&i| samples[i].clone()).collect();
        &picked
    };
    let scale = mb.keep_scale * mb.weight;
    let (v, _, _) = response_backward(model, chunk, cfg.pad_id, cfg.temperature, |lp, ent| {
        micro_loss(lp, ent, mb, cfg, stats).map(|l| l * scale)
    })?;
    stats.ran += 1;
    Ok(Some(v))
}

/// The loss of one micro-batch from its response log-probs and entropies `[B, T]`
/// (policy loss + KL loss − entropy bonus), before its weight.
fn micro_loss(
    lp: &Tensor,
    ent: &Tensor,
    mb: &Micro,
    cfg: &PolicyConfig,
    stats: &mut MicroStats,
) -> yatt_engine::Result<Tensor> {
    let old = if cfg.on_policy {
        lp.detach()
    } else {
        mb.old.shallow_clone()
    };
    let (mut total, pg) = policy_loss(lp, &old, &mb.adv, &mb.mask, &cfg.loss).map_err(algo)?;
    stats.clip += pg.clip_frac;
    stats.approx_kl += pg.approx_kl;
    if let (Some(kc), Some(r)) = (cfg.kl_loss, mb.reference.as_ref()) {
        let (kl, ks) =
            kl_loss(lp, r, &mb.mask, kc.estimator, kc.coef, cfg.loss.agg).map_err(algo)?;
        total = total + kl;
        stats.kl += ks.kl_mean;
    }
    if cfg.entropy_coef != 0.0 {
        let (el, es) = entropy_loss(ent, &mb.mask, cfg.entropy_coef, cfg.loss.agg).map_err(algo)?;
        total = total + el;
        stats.entropy += es.entropy_mean;
    } else {
        stats.entropy += masked_mean(&ent.detach(), &mb.mask).double_value(&[]);
    }
    Ok(total)
}

/// The normaliser of `agg` over a micro-batch's response `mask` `[B, T]`: its tokens
/// (token-mean), its sequences with tokens (seq-mean-token-mean), its sequences
/// (seq-mean-token-sum-norm). A step's loss is the micro-batches' losses weighted by
/// their normaliser over the step's.
pub(super) fn normaliser(mask: &Tensor, agg: LossAgg) -> f64 {
    let tokens: Vec<f64> =
        Vec::try_from(mask.sum_dim_intlist(1, false, Kind::Double)).unwrap_or_default();
    match agg {
        LossAgg::TokenMean => tokens.iter().sum(),
        LossAgg::SeqMeanTokenMean => tokens.iter().filter(|&&t| t > 0.0).count() as f64,
        LossAgg::SeqMeanTokenSumNorm { .. } => tokens.len() as f64,
    }
}

/// Token-budget micro-batches: the samples of lengths `lens` split into as few groups
/// as keep each group's tokens within `budget`, balanced by longest-first into the
/// lightest group (LPT); a sample longer than the budget runs alone. Groups list
/// sample indices in order, and come in order of their first sample.
pub(crate) fn token_groups(lens: &[usize], budget: usize) -> Vec<Vec<usize>> {
    let total: usize = lens.iter().sum();
    let mut order: Vec<usize> = (0..lens.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(lens[i]));
    let mut k = total.div_ceil(budget.max(1)).clamp(1, lens.len().max(1));
    loop {
        let mut bins: Vec<(usize, Vec<usize>)> = vec![(0, Vec::new()); k];
        for &i in &order {
            let lightest = (0..k).min_by_key(|&b| bins[b].0).unwrap_or(0);
            bins[lightest].0 += lens[i];
            bins[lightest].1.push(i);
        }
        let over = bins.iter().any(|(t, g)| *t > budget && g.len() > 1);
        if !over || k >= lens.len() {
            let mut groups: Vec<Vec<usize>> = bins
                .into_iter()
                .map(|(_, mut g)| {
                    g.sort_unstable();
                    g
                })
                .filter(|g| !g.is_empty())
                .collect();
            groups.sort_by_key(|g| g[0]);
            return groups;
        }
        k += 1;
    }
}

/// The rows of a micro-batch whose loss terms can be non-zero, and the factor that
/// scales their aggregated loss to the whole micro-batch's (`mask` and `adv`: `[B, T]`).
/// A sample whose every advantage is zero has a zero policy-loss term at every token
/// (PPO's clipped surrogate and dual clip, GSPO's and CISPO's terms are all multiples
/// of the advantage; GSPO's sequence advantage is the mean of the row's), so
/// leaving it out changes only the aggregation's normaliser, corrected here.
pub(super) fn rows_with_gradient(mask: &Tensor, adv: &Tensor, agg: LossAgg) -> (Vec<usize>, f64) {
    let k = mask.kind();
    let tokens: Vec<f64> =
        Vec::try_from(mask.sum_dim_intlist(1, false, Kind::Double)).unwrap_or_default();
    let signal: Vec<bool> = Vec::try_from(
        (adv.to_kind(k) * mask)
            .abs()
            .sum_dim_intlist(1, false, k)
            .gt(0.0),
    )
    .unwrap_or_default();
    let rows: Vec<usize> = (0..signal.len()).filter(|&i| signal[i]).collect();
    let share = |counts: &dyn Fn(usize) -> f64| {
        let all: f64 = (0..tokens.len()).map(counts).sum();
        let kept: f64 = rows.iter().map(|&i| counts(i)).sum();
        if all > 0.0 {
            kept / all
        } else {
            1.0
        }
    };
    let keep_scale = match agg {
        LossAgg::TokenMean => share(&|i| tokens[i]),
        LossAgg::SeqMeanTokenMean => share(&|i| f64::from(u8::from(tokens[i] > 0.0))),
        LossAgg::SeqMeanTokenSumNorm { .. } => share(&|_| 1.0),
    };
    (rows, keep_scale)
}

impl MicroStats {
    /// Fills the report's loss metrics: means over the micro-batches that ran; with
    /// none (every advantage zero) the clip and KL fractions are 0 and the entropy is
    /// unknown (NaN).
    pub(super) fn report_into(&self, report: &mut TrainReport) {
        let n = self.ran.max(1) as f64;
        report.pg_clipfrac = self.clip / n;
        report.approx_kl = self.approx_kl / n;
        report.kl_loss = self.kl / n;
        report.entropy = if self.ran == 0 {
            f64::NAN
        } else {
            self.entropy / n
        };
    }
}

fn algo(e: crate::algo::checks::AlgoError) -> EngineError {
    EngineError::InvalidArgument(e.to_string())
}
