//! Rotary position embedding: positions of a padded batch and the cos/sin tables.

use crate::config::ModelConfig;
use tch::{Device, Kind, Tensor};

/// Rotary positions for a batch: `cumsum(mask) - 1` (clamped at 0), or `0..T`.
pub fn positions_from_mask(ids: &Tensor, mask: Option<&Tensor>) -> Tensor {
    let (b, t) = ids.size2().expect("ids must be [B, T]");
    match mask {
        Some(m) => (m.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0),
        None => Tensor::arange(t, (Kind::Int64, ids.device()))
            .unsqueeze(0)
            .expand([b, t], false),
    }
}

pub(super) fn rope_tables(c: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let inv: Vec<f32> = c.rope_inv_freq().into_iter().map(|x| x as f32).collect();
    let inv = Tensor::from_slice(&inv);
    let n = c.max_position_embeddings.max(1);
    let pos = Tensor::arange(n, (Kind::Float, Device::Cpu));
    let freqs = pos.unsqueeze(1) * inv.unsqueeze(0); // [n, hd/2] in f32, like HF
    (freqs.cos().to_device(device), freqs.sin().to_device(device))
}
