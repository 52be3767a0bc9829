//! Sharded training (ZeRO-3 / FSDP): the units' flat layout and resharding, the
//! collectives between a replica's ranks, the trainer that holds only its shard, and
//! its checkpoints. This file only declares and re-exports.

mod comm;
mod group;
mod init;
mod layout;
mod persist;
mod regroup;
mod score;
mod slices;
mod trainer;

pub use group::{LocalGroup, ReduceOp, ShardGroup};
pub use init::{random_model_by_units, random_unit};
pub use layout::{
    layout_of, model_layout, model_layout_with_head, moved_bytes_per_micro_batch, reshard,
    shard_len, shard_of, ParamSlot, UnitLayout,
};
pub use persist::{is_sharded_checkpoint, load_sharded_weights, merge_sharded_checkpoint};
pub use regroup::RankState;
pub use slices::{unit_slice_name, write_unit_slices};
pub use trainer::{check_shards, CommStats, ShardedStepStats, ShardedTrainer, PREFETCH_DEPTH};
