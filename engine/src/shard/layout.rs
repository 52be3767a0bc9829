//! How a model's units split over the ranks of a replica: each unit's parameters are one
//! flat buffer (canonical order, see [`unit_shapes`]) padded to a multiple of the rank
//! count and cut into equal contiguous shards. Resharding is a pure function of the old
//! and new rank counts and the flat sizes: `--resume` with another count, `checkpoint
//! merge` and live placement all use it.

use crate::config::ModelConfig;
use crate::model::{unit_shapes, HeadShape, Llama, Unit};
use tch::Tensor;

/// One parameter's place in its unit's flat buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSlot {
    /// Canonical name (`layers.3.wqkv`).
    pub name: String,
    /// Shape.
    pub shape: Vec<i64>,
    /// Offset in the unit's flat buffer.
    pub offset: i64,
    /// Elements.
    pub numel: i64,
}

/// One unit's flat layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnitLayout {
    /// Which unit.
    pub unit: Unit,
    /// Its parameters, back to back.
    pub slots: Vec<ParamSlot>,
    /// Elements without padding.
    pub numel: i64,
}

impl UnitLayout {
    /// The layout of `unit` of a model with `config` and, if any, a scalar head of
    /// `head` (part of [`Unit::Head`]).
    pub fn of(config: &ModelConfig, unit: Unit, head: Option<&HeadShape>) -> Self {
        let mut offset = 0;
        let slots = unit_shapes(config, unit, head)
            .into_iter()
            .map(|(name, shape)| {
                let numel = shape.iter().product();
                let s = ParamSlot {
                    name,
                    shape,
                    offset,
                    numel,
                };
                offset += numel;
                s
            })
            .collect();
        UnitLayout {
            unit,
            slots,
            numel: offset,
        }
    }

    /// Elements per rank's shard over `world` ranks (the last rank's tail is padding).
    pub fn shard_len(&self, world: usize) -> i64 {
        shard_len(self.numel, world)
    }

    /// Makes `model`'s parameters of this unit views of `flat` (the unit's flat buffer,
    /// padding allowed at its end): they keep `flat`'s memory alive, and write through.
    pub fn install(&self, model: &mut Llama, flat: &Tensor) {
        for ((_, p), s) in model
            .unit_parameters_mut(self.unit)
            .into_iter()
            .zip(&self.slots)
        {
            *p = flat.narrow(0, s.offset, s.numel).view(s.shape.as_slice());
        }
    }

    /// The flat `[start, end)` this rank's shard covers, padding included.
    pub fn shard_range(&self, rank: usize, world: usize) -> (i64, i64) {
        let s = self.shard_len(world);
        (rank as i64 * s, (rank as i64 + 1) * s)
    }
}

/// The layouts of every unit of a language model with `config`, in forward order.
pub fn model_layout(config: &ModelConfig) -> Vec<UnitLayout> {
    model_layout_with_head(config, None)
}

/// The layouts of every unit of a model with `config` and, if any, a scalar head of
/// `head` (a critic's value head, in the last unit), in forward order.
pub fn model_layout_with_head(config: &ModelConfig, head: Option<&HeadShape>) -> Vec<UnitLayout> {
    let mut units = vec![Unit::Embed];
    units.extend((0..config.num_hidden_layers as usize).map(Unit::Layer));
    units.push(Unit::Head);
    units
        .iter()
        .map(|&u| UnitLayout::of(config, u, head))
        .collect()
}

/// The layouts of `model`'s units, its scalar head included.
pub fn layout_of(model: &Llama) -> Vec<UnitLayout> {
    model_layout_with_head(&model.config, model.head_shape().as_ref())
}

/// Bytes one rank moves per micro-batch of sharded training (the trainer's schedule):
/// the embeddings and the head are gathered once, each layer twice (forward, and again
/// for its recompute), and every unit's gradient is reduce-scattered once; a ring moves
/// (N−1)/N of each padded buffer per rank. The embeddings' second gather is saved
/// because the lookup's gradient needs no weights; the head's, because it runs forward
/// and backward at once. So this is 3·(N−1)/N·Ψ·b less one gather of the two.
pub fn moved_bytes_per_micro_batch(layout: &[UnitLayout], world: usize, elt_bytes: usize) -> f64 {
    let n = world as f64;
    let last = layout.len().saturating_sub(1);
    layout
        .iter()
        .enumerate()
        .map(|(i, u)| {
            let moves = if i == 0 || i == last { 2.0 } else { 3.0 };
            moves * (u.shard_len(world) as f64 * n) * elt_bytes as f64 * (n - 1.0) / n
        })
        .sum()
}

/// Elements per shard of `numel` over `world` ranks.
pub fn shard_len(numel: i64, world: usize) -> i64 {
    let w = world.max(1) as i64;
    (numel + w - 1) / w
}

/// Rank `rank`'s shard of a flat unit `[numel]` (or longer: padding is dropped) over
/// `world` ranks, zero-padded: `[shard_len]`.
pub fn shard_of(flat: &Tensor, numel: i64, rank: usize, world: usize) -> Tensor {
    let s = shard_len(numel, world);
    let start = (rank as i64 * s).min(numel);
    let end = ((rank as i64 + 1) * s).min(numel);
    let part = flat.narrow(0, start, end - start);
    if end - start == s {
        return part.copy();
    }
    let pad = Tensor::zeros([s - (end - start)], (flat.kind(), flat.device()));
    Tensor::cat(&[part, pad], 0)
}

/// Reshards one unit: from the old shards (all of them, in rank order, padded over
/// `old.len()` ranks) to rank `rank`'s shard over `world` ranks. Reads only the old
/// shards the new one overlaps (`old` is called with an old rank).
pub fn reshard(
    numel: i64,
    old_world: usize,
    mut old: impl FnMut(usize) -> crate::Result<Tensor>,
    rank: usize,
    world: usize,
) -> crate::Result<Tensor> {
    let (os, ns) = (shard_len(numel, old_world), shard_len(numel, world));
    let start = (rank as i64 * ns).min(numel);
    let end = ((rank as i64 + 1) * ns).min(numel);
    let mut parts = Vec::new();
    let mut at = start;
    while at < end {
        let r = (at / os) as usize;
        let (o0, o1) = (r as i64 * os, ((r as i64 + 1) * os).min(numel));
        let take = o1.min(end) - at;
        parts.push(old(r)?.narrow(0, at - o0, take).copy());
        at += take;
    }
    let got: i64 = parts.iter().map(|p| p.numel() as i64).sum();
    if got < ns {
        let like = match parts.first() {
            Some(p) => (p.kind(), p.device()),
            None => {
                let t = old(0)?;
                (t.kind(), t.device())
            }
        };
        parts.push(Tensor::zeros([ns - got], like));
    }
    Ok(Tensor::cat(&parts, 0))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::{Device, Kind};

    fn flat(n: i64) -> Tensor {
        Tensor::arange(n, (Kind::Float, Device::Cpu))
    }

    #[test]
    fn shards_cover_the_unit_once_with_zero_padding() {
        let f = flat(10);
        let shards: Vec<Tensor> = (0..4).map(|r| shard_of(&f, 10, r, 4)).collect();
        assert!(shards.iter().all(|s| s.size() == [3]));
        let all = Tensor::cat(&shards, 0);
        assert_eq!(all.narrow(0, 0, 10), f);
        assert_eq!(
            all.narrow(0, 10, 2),
            Tensor::zeros([2], (Kind::Float, Device::Cpu))
        );
    }

    #[test]
    fn resharding_is_the_same_as_sharding_the_whole() {
        for numel in [1, 7, 10, 64, 65] {
            let f = flat(numel);
            for old_world in 1..=5 {
                let old: Vec<Tensor> = (0..old_world)
                    .map(|r| shard_of(&f, numel, r, old_world))
                    .collect();
                for world in 1..=5 {
                    for rank in 0..world {
                        let got = reshard(
                            numel,
                            old_world,
                            |r| Ok(old[r].shallow_clone()),
                            rank,
                            world,
                        )
                        .unwrap();
                        assert_eq!(
                            got,
                            shard_of(&f, numel, rank, world),
                            "{numel} {old_world}->{world} rank {rank}"
                        );
                    }
                }
            }
        }
    }
}
