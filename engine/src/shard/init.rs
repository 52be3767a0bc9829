//! Random weights made unit by unit, for benchmarks and memory checks of models no rank
//! can hold whole: each unit's draw is seeded by its index, so every rank, whatever the
//! rank count, draws the same model, and no process ever holds more than one unit of
//! it before sharding.

use super::group::ShardGroup;
use super::layout::{model_layout, shard_of, UnitLayout};
use super::trainer::{check_world, decay_ranges, ShardedTrainer, UnitState};
use crate::config::ModelConfig;
use crate::error::Result;
use crate::model::Llama;
use crate::train::TrainConfig;
use tch::{Device, Kind, Tensor};

/// Unit `index` of the model (`ul`) drawn as [`Llama::random`] draws: norms one, every
/// other parameter normal(0, 0.02); f32 on the CPU, flat.
pub fn random_unit(ul: &UnitLayout, seed: i64, index: usize) -> Tensor {
    tch::manual_seed(seed.wrapping_mul(1_000_003).wrapping_add(index as i64));
    let parts: Vec<Tensor> = ul
        .slots
        .iter()
        .map(|s| {
            let norm = ["ln1", "ln2", "norm", "q_norm", "k_norm"]
                .iter()
                .any(|n| s.name == *n || s.name.ends_with(&format!(".{n}")));
            if norm {
                Tensor::ones([s.numel], (Kind::Float, Device::Cpu))
            } else {
                Tensor::randn([s.numel], (Kind::Float, Device::Cpu)) * 0.02
            }
        })
        .collect();
    Tensor::cat(&parts, 0)
}

impl ShardedTrainer {
    /// A sharded trainer over random weights ([`random_unit`]), drawn and sharded one
    /// unit at a time: the peak is one unit, never the model.
    pub fn random(
        config: ModelConfig,
        device: Device,
        kind: Kind,
        seed: i64,
        train: TrainConfig,
        group: Box<dyn ShardGroup>,
    ) -> Result<Self> {
        let layout = model_layout(&config);
        check_world(&layout, group.world())?;
        let (rank, world) = (group.rank(), group.world());
        let state = layout
            .iter()
            .enumerate()
            .map(|(i, ul)| {
                let master = shard_of(&random_unit(ul, seed, i), ul.numel, rank, world);
                UnitState::new(
                    master.to_device(device),
                    decay_ranges(ul, &train, rank, world),
                )
            })
            .collect();
        let model = Llama::skeleton(config, device, kind);
        ShardedTrainer::assemble(model, train, layout, state, group)
    }
}

/// The whole model [`ShardedTrainer::random`] shards: what an unsharded trainer
/// compares against.
pub fn random_model_by_units(config: ModelConfig, device: Device, kind: Kind, seed: i64) -> Llama {
    let layout = model_layout(&config);
    let mut model = Llama::skeleton(config, device, kind);
    for (i, ul) in layout.iter().enumerate() {
        ul.install(
            &mut model,
            &random_unit(ul, seed, i).to_device(device).to_kind(kind),
        );
    }
    model
}
