//! Resharding a running replica in memory, N ranks to M, between two steps: each old
//! rank hands over its shard of every unit (f32 master weights and both AdamW moments),
//! and each new rank takes the parts of the old shards its own overlaps. What a sharded
//! checkpoint's load does with files ([`super::persist`]), without the files: the live
//! placement moves a rank's device to the rollouts and back this way.

use super::group::ShardGroup;
use super::layout::{reshard, UnitLayout};
use super::trainer::{check_world, decay_ranges, ShardedTrainer, UnitState};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::{HeadShape, Llama, MemoryOptions};
use crate::train::TrainConfig;
use tch::{Device, Kind, Tensor};

/// One rank's whole training state, out of its trainer: what
/// [`ShardedTrainer::from_rank_states`] builds the new ranks from.
pub struct RankState {
    rank: usize,
    world: usize,
    step: u64,
    config: TrainConfig,
    model: ModelConfig,
    head: Option<HeadShape>,
    memory: MemoryOptions,
    device: Device,
    kind: Kind,
    layout: Vec<UnitLayout>,
    /// Per unit: master weights, first and second moments (this rank's shard).
    units: Vec<[Tensor; 3]>,
}

impl RankState {
    /// Which rank of how many held it.
    pub fn rank(&self) -> (usize, usize) {
        (self.rank, self.world)
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }
}

impl ShardedTrainer {
    /// Ends this rank and returns its training state for
    /// [`ShardedTrainer::from_rank_states`]. Only a trainer between steps, outside
    /// replicas (HSDP), and not frozen, is handed over.
    pub fn into_rank_state(self) -> Result<RankState> {
        if self.is_frozen() {
            return Err(EngineError::InvalidArgument(
                "a frozen sharded model (a reference) has no training state to hand over".into(),
            ));
        }
        if self.replicas() > 1 {
            return Err(EngineError::InvalidArgument(
                "a rank with replicas (HSDP) is not resharded in memory: its replicas' ranks would no longer match".into(),
            ));
        }
        let (rank, world) = self.rank();
        Ok(RankState {
            rank,
            world,
            step: self.step,
            config: self.config.clone(),
            model: self.model.config.clone(),
            head: self.model.head_shape(),
            memory: self.model.memory,
            device: self.model.device(),
            kind: self.model.kind(),
            layout: self.layout.clone(),
            units: self
                .state
                .iter()
                .map(|s| {
                    [
                        s.master.shallow_clone(),
                        s.m.shallow_clone(),
                        s.v.shallow_clone(),
                    ]
                })
                .collect(),
        })
    }

    /// Rank `group.rank()` of `group.world()` from the states of every rank of the old
    /// replica (in any order, each exactly once): the same weights, moments and step,
    /// split the new way. Every new rank calls it with the same `old`.
    pub fn from_rank_states(old: &[RankState], group: Box<dyn ShardGroup>) -> Result<Self> {
        let Some(first) = old.first() else {
            return Err(EngineError::InvalidArgument(
                "resharding needs the old ranks' states".into(),
            ));
        };
        let old_world = first.world;
        let mut by_rank: Vec<Option<&RankState>> = vec![None; old_world];
        for s in old {
            let same =
                s.world == old_world && s.step == first.step && s.units.len() == first.units.len();
            if !same || s.rank >= old_world || by_rank[s.rank].replace(s).is_some() {
                return Err(EngineError::InvalidArgument(format!(
                    "resharding takes each of the old {old_world} ranks' states once, at one step (got rank {} of {} at step {})",
                    s.rank, s.world, s.step
                )));
            }
        }
        let by_rank: Vec<&RankState> = match by_rank.into_iter().collect::<Option<Vec<_>>>() {
            Some(all) => all,
            None => {
                return Err(EngineError::InvalidArgument(format!(
                    "resharding needs all {old_world} old ranks' states, got {}",
                    old.len()
                )))
            }
        };
        let (rank, world) = (group.rank(), group.world());
        check_world(&first.layout, world)?;
        let mut state = Vec::with_capacity(first.layout.len());
        for (u, ul) in first.layout.iter().enumerate() {
            let part = |which: usize| {
                reshard(
                    ul.numel,
                    old_world,
                    |r| Ok(by_rank[r].units[u][which].shallow_clone()),
                    rank,
                    world,
                )
            };
            let mut s = UnitState::new(part(0)?, decay_ranges(ul, &first.config, rank, world));
            s.m = part(1)?;
            s.v = part(2)?;
            state.push(s);
        }
        let mut model = Llama::skeleton_with_head(
            first.model.clone(),
            first.head.as_ref(),
            first.device,
            first.kind,
        );
        model.memory = first.memory;
        let mut tr = ShardedTrainer::assemble(
            model,
            first.config.clone(),
            first.layout.clone(),
            state,
            group,
        )?;
        tr.step = first.step;
        Ok(tr)
    }
}
