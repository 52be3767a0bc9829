//! A policy update's micro-batches: how a step is split (by samples or by a token
//! budget), each micro-batch's share of the step's loss, and its forward and backward
//! pass.

use std::borrow::Cow;
use std::ops::Range;

use tch::{Device, Kind, Tensor};
use yatt_engine::score::{SeqBatch, TokenScores};
use yatt_engine::EngineError;

use super::config::PolicyConfig;
use super::report::TrainReport;
use crate::algo::loss::{entropy_loss, kl_loss, masked_mean, normaliser, LossAgg};
use crate::algo::off_policy::{behaviour_weights, BehaviourCorrection};
use crate::algo::policy_loss::policy_loss;
use crate::builtin::scoring::{response_backward, score_samples};
use crate::role::RoleError;
use crate::sample::{response_mask, token_matrix, Sample, SampleError, TokenField};

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

#[derive(Debug, Default, Clone, Copy, serde::Serialize, serde::Deserialize)]
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
    let chunk = rows_of(samples, &mb.rows);
    let scale = mb.keep_scale * mb.weight;
    let (v, _, _) = response_backward(model, &chunk, cfg.pad_id, cfg.temperature, |lp, ent| {
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

/// The samples of `rows`: the batch's own slice when they are contiguous (the whole
/// range borrows it), else copies (a thinned or balanced micro-batch).
fn rows_of<'a>(samples: &'a [Sample], rows: &[usize]) -> Cow<'a, [Sample]> {
    if rows.windows(2).all(|w| w[1] == w[0] + 1) {
        Cow::Borrowed(&samples[rows[0]..=rows[rows.len() - 1]])
    } else {
        Cow::Owned(rows.iter().map(|&i| samples[i].clone()).collect())
    }
}

/// The samples with their old log-probs: the rollout's where the config takes those,
/// else scored by `model` (the policy's weights, whole or gathered).
pub(super) fn with_old_logprobs(
    model: &yatt_engine::Llama,
    cfg: &PolicyConfig,
    mut samples: Vec<Sample>,
) -> Result<Vec<Sample>, RoleError> {
    if samples.is_empty() || cfg.old_from_rollout(&mut samples) {
        return Ok(samples);
    }
    let rows = score_samples(
        model,
        &samples,
        cfg.pad_id,
        cfg.temperature,
        cfg.micro_batch_size,
    )?;
    for (s, r) in samples.iter_mut().zip(rows) {
        s.old_logprobs = Some(r);
    }
    Ok(samples)
}

/// What every policy update starts with, whole or sharded: a non-empty batch whose
/// samples carry what the loss reads; returns the mini-batch size and the report that
/// names the samples trained.
pub(super) fn begin_update(
    cfg: &PolicyConfig,
    samples: &[Sample],
) -> Result<(usize, TrainReport), RoleError> {
    if samples.is_empty() {
        return Err(RoleError::BadRequest(
            "train needs at least one sample".into(),
        ));
    }
    check_samples(cfg, samples)?;
    let report = TrainReport {
        trained: samples.iter().map(|s| s.id).collect(),
        ..Default::default()
    };
    Ok((samples.len().div_ceil(cfg.mini_batches), report))
}

/// Refuses samples a train request cannot use: each needs its old log-probs and
/// advantages, and with a KL loss its reference log-probs.
fn check_samples(cfg: &PolicyConfig, samples: &[Sample]) -> Result<(), RoleError> {
    let bad = |e: SampleError| RoleError::BadRequest(e.to_string());
    for s in samples {
        s.token_field(TokenField::OldLogprobs).map_err(bad)?;
        s.token_field(TokenField::Advantages).map_err(bad)?;
        if cfg.kl_loss.is_some() {
            s.token_field(TokenField::RefLogprobs).map_err(bad)?;
        }
    }
    Ok(())
}

/// The micro-batches of the samples in `range` (indices into the batch): runs of
/// `micro_batch_size`, or token-budget groups.
pub(super) fn groups(
    cfg: &PolicyConfig,
    samples: &[Sample],
    range: Range<usize>,
) -> Vec<Vec<usize>> {
    if cfg.max_tokens_per_micro_batch > 0 {
        let lens: Vec<usize> = samples[range.clone()]
            .iter()
            .map(|s| s.prompt_tokens.len() + s.response_len())
            .collect();
        token_groups(&lens, cfg.max_tokens_per_micro_batch)
            .into_iter()
            .map(|g| g.into_iter().map(|i| range.start + i).collect())
            .collect()
    } else {
        range
            .clone()
            .step_by(cfg.micro_batch_size)
            .map(|s| (s..(s + cfg.micro_batch_size).min(range.end)).collect())
            .collect()
    }
}

/// One optimizer step's micro-batches over `groups` (each a list of sample indices),
/// each weighted by its share of the step's normaliser over all of `groups`, so the
/// step's gradient does not depend on how they are split (or over which ranks).
pub(super) fn step_micros(
    cfg: &PolicyConfig,
    dev: Device,
    samples: &[Sample],
    groups: Vec<Vec<usize>>,
) -> Result<Vec<Micro>, RoleError> {
    let bad = |e: SampleError| RoleError::BadRequest(e.to_string());
    // A KL loss or an entropy bonus does not vanish with the advantage.
    let skip = cfg.skip_zero_advantage && cfg.kl_loss.is_none() && cfg.entropy_coef == 0.0;
    let mut micros = Vec::new();
    let mut denominators = Vec::new();
    for group in groups {
        let chunk = rows_of(samples, &group);
        let chunk: &[Sample] = &chunk;
        let mut mb = Micro {
            old: token_matrix(chunk, TokenField::OldLogprobs, dev).map_err(bad)?,
            adv: token_matrix(chunk, TokenField::Advantages, dev).map_err(bad)?,
            reference: match cfg.kl_loss {
                Some(_) => Some(token_matrix(chunk, TokenField::RefLogprobs, dev).map_err(bad)?),
                None => None,
            },
            mask: response_mask(chunk, dev).map_err(bad)?,
            rows: group.clone(),
            keep_scale: 1.0,
            weight: 1.0,
        };
        if cfg.off_policy.correction != BehaviourCorrection::None {
            let behaviour = token_matrix(chunk, TokenField::RolloutLogprobs, dev).map_err(bad)?;
            let (w, keep) = behaviour_weights(&mb.old, &behaviour, &mb.mask, &cfg.off_policy)
                .map_err(|e| RoleError::BadRequest(e.to_string()))?;
            mb.adv = &mb.adv * w;
            mb.mask = keep;
        }
        denominators.push(normaliser(&mb.mask, cfg.loss.agg));
        if skip {
            let (kept, keep_scale) = rows_with_gradient(&mb.mask, &mb.adv, cfg.loss.agg);
            if kept.len() < chunk.len() {
                let index: Vec<i64> = kept.iter().map(|&i| i as i64).collect();
                let index = Tensor::from_slice(&index).to_device(dev);
                // Token matrices are as wide as their longest response.
                let width = kept.iter().map(|&i| chunk[i].response_len()).max();
                let width = width.unwrap_or(0) as i64;
                let pick = |t: &Tensor| t.index_select(0, &index).narrow(1, 0, width);
                mb.old = pick(&mb.old);
                mb.adv = pick(&mb.adv);
                mb.mask = pick(&mb.mask);
                mb.reference = mb.reference.as_ref().map(pick);
                mb.rows = kept.into_iter().map(|i| group[i]).collect();
                mb.keep_scale = keep_scale;
            }
        }
        micros.push(mb);
    }
    let total: f64 = denominators.iter().sum();
    for (mb, d) in micros.iter_mut().zip(&denominators) {
        // A step with nothing to normalise by (no response tokens) weighs evenly.
        mb.weight = if total > 0.0 {
            d / total
        } else {
            1.0 / denominators.len() as f64
        };
    }
    Ok(micros)
}

/// A micro-batch for a trainer that scores whole sequences (the sharded one): where
/// each response token sits in its samples' [`SeqBatch`].
pub(super) struct SeqMicro {
    /// `[B, w]`: the position in `batch` of response token `j` of each row (clamped
    /// where the row's response is shorter than the longest).
    at: Tensor,
    /// `[B, w]`: 1 where a row has response token `j`.
    present: Tensor,
    micro: Micro,
}

impl SeqMicro {
    /// `mb`'s samples as one right-padded batch, and `mb` over it; `None` when none of
    /// them carries a gradient.
    pub(super) fn new(
        samples: &[Sample],
        mb: Micro,
        pad_id: i64,
        dev: Device,
    ) -> yatt_engine::Result<Option<(SeqBatch, Self)>> {
        if mb.rows.is_empty() {
            return Ok(None);
        }
        let chunk = rows_of(samples, &mb.rows);
        let pairs: Vec<(&[i64], &[i64])> = chunk
            .iter()
            .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
            .collect();
        let batch = SeqBatch::from_pairs(&pairs, pad_id, dev)?;
        let full = batch.ids.size()[1];
        let w = chunk.iter().map(Sample::response_len).max().unwrap_or(0);
        let (mut at, mut present) = (vec![0i64; chunk.len() * w], vec![0f32; chunk.len() * w]);
        for (i, s) in chunk.iter().enumerate() {
            for j in 0..w {
                at[i * w + j] = ((s.prompt_tokens.len() + j) as i64).min(full - 1);
                present[i * w + j] = f32::from(u8::from(j < s.response_len()));
            }
        }
        let shape = [chunk.len() as i64, w as i64];
        Ok(Some((
            batch,
            SeqMicro {
                at: Tensor::from_slice(&at).view(shape).to_device(dev),
                present: Tensor::from_slice(&present).view(shape).to_device(dev),
                micro: mb,
            },
        )))
    }

    /// The micro-batch's weighted loss from the scores of its whole sequences: the
    /// response positions picked out as [`response_backward`] gives them, then the
    /// same loss as the unsharded policy's.
    pub(super) fn loss(
        &self,
        scores: &TokenScores,
        cfg: &PolicyConfig,
        stats: &mut MicroStats,
    ) -> yatt_engine::Result<Tensor> {
        let pick = |x: &Tensor| x.gather(1, &self.at, false) * &self.present;
        let (lp, ent) = (pick(&scores.logprobs), pick(&scores.entropy));
        let scale = self.micro.keep_scale * self.micro.weight;
        stats.ran += 1;
        micro_loss(&lp, &ent, &self.micro, cfg, stats).map(|l| l * scale)
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
    /// Adds another rank's statistics of the same step.
    pub(super) fn add(&mut self, o: &MicroStats) {
        self.ran += o.ran;
        self.clip += o.clip;
        self.approx_kl += o.approx_kl;
        self.kl += o.kl;
        self.entropy += o.entropy;
    }

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
