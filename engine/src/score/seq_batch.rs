//! The batch every scoring function takes: right-padded prompt+response sequences.

use crate::error::{EngineError, Result};
use tch::{Device, Tensor};

/// A right-padded batch of prompt+response sequences.
#[derive(Debug)]
pub struct SeqBatch {
    /// Token ids `[B, T]`.
    pub ids: Tensor,
    /// 1 for real tokens, 0 for padding `[B, T]`.
    pub attention_mask: Tensor,
    /// 1 for response tokens (the ones a loss looks at) `[B, T]`.
    pub response_mask: Tensor,
    /// Prompt length of each row.
    pub prompt_lens: Vec<usize>,
    /// Total (prompt + response) length of each row.
    pub lens: Vec<usize>,
}

impl SeqBatch {
    /// Builds a batch from `(prompt, response)` pairs, right-padded with `pad_id`.
    pub fn from_pairs(pairs: &[(&[i64], &[i64])], pad_id: i64, device: Device) -> Result<Self> {
        if pairs.is_empty() {
            return Err(EngineError::InvalidArgument("empty batch".into()));
        }
        let t = pairs
            .iter()
            .map(|(p, r)| p.len() + r.len())
            .max()
            .unwrap_or(0);
        if t == 0 {
            return Err(EngineError::InvalidArgument(
                "every sequence in the batch is empty".into(),
            ));
        }
        let b = pairs.len();
        let mut ids = vec![pad_id; b * t];
        let mut am = vec![0i64; b * t];
        let mut rm = vec![0i64; b * t];
        for (i, (p, r)) in pairs.iter().enumerate() {
            for (j, &x) in p.iter().chain(r.iter()).enumerate() {
                ids[i * t + j] = x;
                am[i * t + j] = 1;
                if j >= p.len() {
                    rm[i * t + j] = 1;
                }
            }
        }
        let mk = |v: Vec<i64>| {
            Tensor::from_slice(&v)
                .view([b as i64, t as i64])
                .to_device(device)
        };
        Ok(SeqBatch {
            ids: mk(ids),
            attention_mask: mk(am),
            response_mask: mk(rm),
            prompt_lens: pairs.iter().map(|(p, _)| p.len()).collect(),
            lens: pairs.iter().map(|(p, r)| p.len() + r.len()).collect(),
        })
    }

    /// Number of rows.
    pub fn len(&self) -> usize {
        self.lens.len()
    }

    /// Whether the batch has no rows.
    pub fn is_empty(&self) -> bool {
        self.lens.is_empty()
    }
}
