//! Weight sync from a sharded replica without gathering it: each rank sends its own
//! shard of every unit (in the compute dtype) to the rollouts, and a receiver writes
//! each slice into its whole model's parameters where the unit's flat layout puts it.
//! No process holds more of the model than it did already: a rank its shards, a
//! receiver its model. A slice's tensor is named by its unit's index in
//! [`model_layout`] order ([`unit_slice_name`]).

use tch::Tensor;

use super::layout::{model_layout, shard_len};
use super::trainer::ShardedTrainer;
use crate::error::{EngineError, Result};
use crate::model::Llama;

const PREFIX: &str = "yatt.unit.";

/// The name of unit `index`'s slice in a weight update.
pub fn unit_slice_name(index: usize) -> String {
    format!("{PREFIX}{index}")
}

impl ShardedTrainer {
    /// This rank's slice of the current weights: its shard of every unit in the
    /// compute dtype, named by [`unit_slice_name`]. Not a collective, and no more than
    /// the rank's shards are ever held.
    pub fn weight_slice(&self) -> Vec<(String, Tensor)> {
        let kind = self.model.kind();
        tch::no_grad(|| {
            self.state
                .iter()
                .enumerate()
                .map(|(u, s)| (unit_slice_name(u), s.master.to_kind(kind)))
                .collect()
        })
    }
}

/// Writes slices of a replica over `world` ranks (each `(rank, name, tensor)`, named
/// by [`unit_slice_name`]) into `model`'s parameters, in place, and repacks a model
/// packed for inference once. Returns the slices written. Fails, before writing
/// anything, on a rank out of range, an unknown name, or a slice of the wrong length.
pub fn write_unit_slices<'a>(
    model: &mut Llama,
    world: usize,
    slices: impl IntoIterator<Item = (usize, &'a str, &'a Tensor)>,
) -> Result<usize> {
    let layout = model_layout(&model.config);
    let mut checked = Vec::new();
    for (rank, name, t) in slices {
        if rank >= world {
            return Err(EngineError::Weights(format!(
                "a weight slice of rank {rank} of {world}: the rank must be below the rank count"
            )));
        }
        let unit = name
            .strip_prefix(PREFIX)
            .and_then(|i| i.parse::<usize>().ok())
            .filter(|&i| i < layout.len())
            .ok_or_else(|| {
                EngineError::Weights(format!(
                    "`{name}` names no unit of this model's {} (expected {PREFIX}0..{PREFIX}{})",
                    layout.len(),
                    layout.len() - 1
                ))
            })?;
        let want = shard_len(layout[unit].numel, world);
        if t.size() != [want] {
            return Err(EngineError::Weights(format!(
                "`{name}`: a slice of shape {:?}, where rank {rank} of {world} holds [{want}] of this model's unit",
                t.size()
            )));
        }
        checked.push((rank, unit, t));
    }
    let pack = model.inference_pack_batch();
    let n = checked.len();
    tch::no_grad(|| -> Result<()> {
        for (rank, unit, t) in checked {
            let ul = &layout[unit];
            let (start, end) = ul.shard_range(rank, world);
            let end = end.min(ul.numel);
            for ((name, p), slot) in model
                .unit_parameters_mut(ul.unit)
                .into_iter()
                .zip(&ul.slots)
            {
                let (a, b) = (start.max(slot.offset), end.min(slot.offset + slot.numel));
                if a >= b {
                    continue;
                }
                if !p.is_contiguous() || p.numel() as i64 != slot.numel {
                    return Err(EngineError::Weights(format!(
                        "`{name}` is not one contiguous tensor of {} elements here, so a slice cannot be written into it",
                        slot.numel
                    )));
                }
                p.view([-1])
                    .narrow(0, a - slot.offset, b - a)
                    .f_copy_(&t.narrow(0, a - start, b - a))?;
            }
        }
        Ok(())
    })?;
    if let Some(b) = pack {
        model.pack_for_inference(b);
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::super::group::LocalGroup;
    use super::*;
    use crate::config::tiny_config;
    use crate::train::TrainConfig;
    use tch::{Device, Kind};

    /// Every rank's slice written into a model of other weights gives the sharded
    /// replica's weights exactly, whatever the rank count (padding included).
    #[test]
    fn every_ranks_slice_rebuilds_the_model() {
        for world in [1, 2, 3] {
            let mut source = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 11).unwrap();
            let want: Vec<(String, Tensor)> = source.parameters();
            let trainers: Vec<ShardedTrainer> =
                LocalGroup::new(world, std::time::Duration::from_secs(30))
                    .into_iter()
                    .map(|g| {
                        let m = source.deep_copy(Device::Cpu, Kind::Float).unwrap();
                        ShardedTrainer::new(m, TrainConfig::default(), Box::new(g)).unwrap()
                    })
                    .collect();
            let mut target = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 12).unwrap();
            let slices: Vec<Vec<(String, Tensor)>> =
                trainers.iter().map(|t| t.weight_slice()).collect();
            let all = slices
                .iter()
                .enumerate()
                .flat_map(|(r, s)| s.iter().map(move |(n, t)| (r, n.as_str(), t)));
            let n = write_unit_slices(&mut target, world, all).unwrap();
            assert_eq!(n, world * slices[0].len());
            for ((name, w), (_, got)) in want.iter().zip(target.parameters()) {
                assert!(w.equal(&got), "{name} at {world} ranks");
            }
        }
    }

    #[test]
    fn bad_slices_are_refused_before_anything_is_written() {
        let mut m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 1).unwrap();
        let before: Vec<(String, Tensor)> = m
            .parameters()
            .into_iter()
            .map(|(n, t)| (n, t.copy()))
            .collect();
        let ok = Tensor::zeros(
            [shard_len(model_layout(&m.config)[0].numel, 2)],
            (Kind::Float, Device::Cpu),
        );
        let wrong = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        for (name, t, rank, world, says) in [
            ("yatt.unit.999", &ok, 0, 2, "names no unit"),
            ("model.embed", &ok, 0, 2, "names no unit"),
            ("yatt.unit.1", &wrong, 0, 2, "a slice of shape [3]"),
            ("yatt.unit.0", &ok, 2, 2, "below the rank count"),
        ] {
            let first = unit_slice_name(0);
            let named = [(0, first.as_str(), &ok), (rank, name, t)];
            let e = write_unit_slices(&mut m, world, named)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{name}: {e}");
        }
        for ((n, a), (_, b)) in before.iter().zip(m.parameters()) {
            assert!(a.equal(&b), "{n} was written");
        }
    }
}
