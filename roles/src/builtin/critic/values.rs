//! The critic's values of response tokens and the weights of its micro-batches, shared
//! by the whole critic and a sharded one's ranks.

use tch::Tensor;
use yatt_engine::score::{values, SeqBatch};
use yatt_engine::{EngineError, Llama};

use super::protocol::CriticConfig;
use crate::algo::loss::normaliser;
use crate::role::RoleError;
use crate::sample::{response_mask, Sample, SampleId, TokenField};

pub(crate) fn sample_err(e: crate::sample::SampleError) -> EngineError {
    EngineError::InvalidArgument(e.to_string())
}

/// Each micro-batch's share of an optimizer step's value loss: its aggregation's
/// normaliser (response tokens, or sequences) over the step's, so that the step's
/// gradient does not depend on how it is split into micro-batches (or over ranks).
pub(crate) fn micro_weights<'a>(
    micros: impl Iterator<Item = &'a [Sample]>,
    cfg: &CriticConfig,
    dev: tch::Device,
) -> Result<Vec<f64>, RoleError> {
    let bad = |e: crate::sample::SampleError| RoleError::BadRequest(e.to_string());
    let mut d = Vec::new();
    for chunk in micros {
        d.push(normaliser(
            &response_mask(chunk, dev).map_err(bad)?,
            cfg.loss.agg,
        ));
    }
    let total: f64 = d.iter().sum();
    let n = d.len().max(1) as f64;
    // A step with nothing to normalise by (no response tokens) weighs evenly.
    Ok(d.iter()
        .map(|x| if total > 0.0 { x / total } else { 1.0 / n })
        .collect())
}

/// Values `[B, T]` of the response tokens (zero on padding): row `i`, column `j` is the
/// value head at position `prompt_len + j − 1`, the state response token `j` was
/// sampled from. Differentiable when gradients are on.
pub(crate) fn response_values(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
) -> yatt_engine::Result<Tensor> {
    let device = model.device();
    let batch = seq_batch(samples, pad_id, device)?;
    response_columns(&values(model, &batch)?, samples)
}

/// `samples` as one right-padded batch.
pub(crate) fn seq_batch(
    samples: &[Sample],
    pad_id: i64,
    device: tch::Device,
) -> yatt_engine::Result<SeqBatch> {
    let pairs: Vec<(&[i64], &[i64])> = samples
        .iter()
        .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
        .collect();
    SeqBatch::from_pairs(&pairs, pad_id, device)
}

/// The response columns `[B, T]` of values at every position `all` `[B, full]` of
/// `samples`' batch: column `j` of row `i` is position `prompt_len + j − 1`, zero past
/// the row's response.
pub(crate) fn response_columns(all: &Tensor, samples: &[Sample]) -> yatt_engine::Result<Tensor> {
    let device = all.device();
    let full = all.size().get(1).copied().unwrap_or(0);
    let t = samples.iter().map(Sample::response_len).max().unwrap_or(0);
    let mut idx = vec![0i64; samples.len() * t];
    for (i, s) in samples.iter().enumerate() {
        for j in 0..t {
            idx[i * t + j] = ((s.prompt_tokens.len() + j) as i64 - 1).clamp(0, full - 1);
        }
    }
    let shape = [samples.len() as i64, t as i64];
    let idx = Tensor::from_slice(&idx).view(shape).to_device(device);
    let mask = response_mask(samples, device).map_err(sample_err)?;
    Ok(all.gather(1, &idx, false) * mask)
}

/// Refuses a critic update that cannot run: no samples, or one without the values
/// from before the update or the returns (naming the sample and the field). Returns
/// the ids of the samples to be trained, for the report.
pub(crate) fn check_train_samples(samples: &[Sample]) -> Result<Vec<SampleId>, RoleError> {
    if samples.is_empty() {
        return Err(RoleError::BadRequest(
            "critic train needs at least one sample".into(),
        ));
    }
    let bad = |e: crate::sample::SampleError| RoleError::BadRequest(e.to_string());
    for s in samples {
        s.token_field(TokenField::Values).map_err(bad)?;
        s.token_field(TokenField::Returns).map_err(bad)?;
    }
    Ok(samples.iter().map(|s| s.id).collect())
}
