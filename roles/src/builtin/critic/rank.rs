//! One rank of a sharded critic: its part of a values pass and of an optimizer step.
//! A rank thread of an embedded critic and a rank actor on a `yatt-node`
//! ([`crate::PolicyRankRole::with_critic`]) run the same functions, so the critic takes
//! the same steps wherever its ranks live.

use tch::Tensor;
use yatt_engine::{EngineError, ShardedTrainer};

use super::protocol::{CriticConfig, CriticReport};
use super::values::{micro_weights, response_columns, sample_err, seq_batch};
use crate::algo::loss::value_loss;
use crate::sample::{response_mask, token_matrix, Sample, SampleId, TokenField};

/// One rank's part of a critic optimizer step.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct CriticRankStep {
    /// The step's value loss (summed over the ranks: the same on every rank).
    pub loss: f64,
    /// The gradient norm over all shards, before clipping.
    pub grad_norm: f64,
    /// Sum of this rank's micro-batches' clipped fractions.
    pub clip: f64,
    /// Sum of this rank's micro-batches' mean predicted values.
    pub vpred: f64,
    /// Micro-batches this rank ran.
    pub micro_batches: usize,
}

/// The sample indices of rank `rank`'s part of `len` samples over `shards` ranks, in
/// micro-batches of `size`.
fn rank_micros(len: usize, rank: usize, shards: usize, size: usize) -> Vec<Vec<usize>> {
    let part = len * rank / shards..len * (rank + 1) / shards;
    part.clone()
        .step_by(size)
        .map(|s| (s..(s + size).min(part.end)).collect())
        .collect()
}

fn picked(samples: &[Sample], rows: &[usize]) -> Vec<Sample> {
    rows.iter().map(|&i| samples[i].clone()).collect()
}

/// Rank `rank`'s part of a values pass: its part of `samples`, valued in micro-batches
/// unit by unit (a collective). Each sample's response values, in order.
pub(crate) fn rank_values(
    tr: &mut ShardedTrainer,
    cfg: &CriticConfig,
    samples: &[Sample],
    rank: usize,
    shards: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let device = tr.model.device();
    let fail = |e: EngineError| format!("critic values: {e}");
    let mut batches = Vec::new();
    let mut chunks = Vec::new();
    for rows in rank_micros(samples.len(), rank, shards, cfg.micro_batch_size) {
        let chunk = picked(samples, &rows);
        batches.push(seq_batch(&chunk, cfg.pad_id, device).map_err(fail)?);
        chunks.push(chunk);
    }
    let scored = tr.score_values(&batches).map_err(fail)?;
    let mut out = Vec::new();
    for (all, chunk) in scored.iter().zip(&chunks) {
        let v = response_columns(all, chunk).map_err(fail)?;
        out.extend(crate::sample::split_rows(&v, chunk));
    }
    Ok(out)
}

/// What a rank's micro-batch of a critic step needs beside its batch.
struct ValueMicro {
    samples: Vec<Sample>,
    old: Tensor,
    returns: Tensor,
    mask: Tensor,
    weight: f64,
}

/// Rank `rank`'s part of one critic optimizer step over `samples` (every rank's): its
/// micro-batches' value losses, each weighted by its share of the normaliser over
/// every rank's micro-batches.
pub(crate) fn rank_value_step(
    tr: &mut ShardedTrainer,
    cfg: &CriticConfig,
    samples: &[Sample],
    rank: usize,
    shards: usize,
) -> Result<CriticRankStep, String> {
    let device = tr.model.device();
    let fail = |e: EngineError| format!("critic update: {e}");
    let every: Vec<(usize, Vec<usize>)> = (0..shards)
        .flat_map(|r| {
            rank_micros(samples.len(), r, shards, cfg.micro_batch_size)
                .into_iter()
                .map(move |m| (r, m))
        })
        .collect();
    let chunks: Vec<Vec<Sample>> = every.iter().map(|(_, m)| picked(samples, m)).collect();
    let weights =
        micro_weights(chunks.iter().map(Vec::as_slice), cfg, device).map_err(|e| e.to_string())?;
    let mut batches = Vec::new();
    let mut micros = Vec::new();
    for ((owner, _), (chunk, weight)) in every.iter().zip(chunks.into_iter().zip(weights)) {
        if *owner != rank {
            continue;
        }
        let field = |f| token_matrix(&chunk, f, device).map_err(sample_err);
        let (old, returns) = (field(TokenField::Values), field(TokenField::Returns));
        let mask = response_mask(&chunk, device).map_err(|e| e.to_string())?;
        batches.push(seq_batch(&chunk, cfg.pad_id, device).map_err(fail)?);
        micros.push(ValueMicro {
            old: old.map_err(fail)?,
            returns: returns.map_err(fail)?,
            mask,
            weight,
            samples: chunk,
        });
    }
    let (mut clip, mut vpred) = (0.0, 0.0);
    let step = tr
        .step_values(&batches, |i, all: &Tensor| {
            let mb = &micros[i];
            let v = response_columns(all, &mb.samples)?;
            let (loss, st) = value_loss(&v, &mb.old, &mb.returns, &mb.mask, &cfg.loss)
                .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
            clip += st.clip_frac;
            vpred += st.value_mean;
            Ok(loss * mb.weight)
        })
        .map_err(fail)?;
    Ok(CriticRankStep {
        loss: step.step.loss,
        grad_norm: step.step.grad_norm,
        clip,
        vpred,
        micro_batches: batches.len(),
    })
}

/// A critic update's report from its optimizer steps, each given as every rank's part
/// (one part for the whole critic): loss and gradient norm are means over the steps,
/// the clipped fraction and predicted value means over every micro-batch.
pub(crate) fn update_report(
    trained: Vec<SampleId>,
    steps: &[Vec<CriticRankStep>],
    seconds: f64,
) -> CriticReport {
    let parts = || steps.iter().flatten();
    let s = steps.len().max(1) as f64;
    let m = parts().map(|p| p.micro_batches).sum::<usize>().max(1) as f64;
    CriticReport {
        trained,
        vf_loss: steps
            .iter()
            .filter_map(|p| p.first())
            .map(|p| p.loss)
            .sum::<f64>()
            / s,
        grad_norm: steps
            .iter()
            .filter_map(|p| p.first())
            .map(|p| p.grad_norm)
            .sum::<f64>()
            / s,
        vf_clipfrac: parts().map(|p| p.clip).sum::<f64>() / m,
        vpred_mean: parts().map(|p| p.vpred).sum::<f64>() / m,
        seconds,
    }
}
