//! The reference model sharded over N ranks (`job.reference_shards`): each rank keeps
//! only its shard of the f32 weights (4Ψ/N, no gradients or moments) and scores its
//! part of the samples unit by unit, gathering each unit's weights just before it runs
//! ([`ShardedTrainer::frozen`], the ranks' scoring pass that the sharded policy's old
//! log-probs use). No process holds the whole reference.
//!
//! Embedded, the ranks are threads of this process (parity, not memory); in a cluster
//! this actor is rank 0 and the other ranks are `policy-rank` actors on their nodes,
//! started frozen. It keeps the weights it was built with (the run's initial model):
//! the first weight sync does not load it.

use tch::Device;
use yatt_engine::{check_shards, model_layout, Llama, ShardedTrainer};

use super::config::PolicyConfig;
use super::ranks::{self, Ranks, RemoteRanks};
use super::sharded::ShardedStart;
use crate::builtin::scoring::check_device;
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, WeightsUpdate};
use crate::sample::Sample;

/// The reference role over one model sharded over [`ShardedStart::shards`] ranks.
pub struct ShardedReferenceRole {
    ranks: Ranks,
    /// Temperature, padding and micro-batching of the scoring (the policy's).
    config: PolicyConfig,
    device: Device,
    params: u64,
}

impl ShardedReferenceRole {
    /// `model` sharded over `start.shards` rank threads of this process. Fails on a
    /// shard count the model's units cannot be split over.
    pub fn new(
        model: Llama,
        config: PolicyConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        check_shards(&model.config, start.shards)
            .map_err(|e| RoleError::BadRequest(format!("job.reference_shards: {e}")))?;
        let trainers = ranks::shard_copies(
            model,
            (start.shards, start.collective),
            "the reference",
            |m, group| ShardedTrainer::frozen(m, Box::new(group)),
        )?;
        Self::assemble(trainers, None, config, start)
    }

    /// Rank 0 of a reference whose other ranks are actors on other nodes (`remote`:
    /// ranks 1..N, joined to the ring `rank0`'s group is in).
    pub fn with_remote_ranks(
        rank0: ShardedTrainer,
        remote: RemoteRanks,
        config: PolicyConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        Self::assemble(vec![rank0], Some(remote), config, start)
    }

    fn assemble(
        trainers: Vec<ShardedTrainer>,
        remote: Option<RemoteRanks>,
        config: PolicyConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        if let Some(t) = trainers.iter().find(|t| !t.is_frozen()) {
            return Err(RoleError::BadRequest(format!(
                "a sharded reference's ranks only score, but rank {} holds a trainer",
                t.rank().0
            )));
        }
        let first = &trainers[0].model;
        let device = first.device();
        let params = model_layout(&first.config)
            .iter()
            .map(|u| u.numel as u64)
            .sum();
        let mut ranks = Ranks::start("reference", trainers, start.deadline)?;
        if let Some(r) = remote {
            ranks = ranks.with_remote(r);
        }
        Ok(ShardedReferenceRole {
            ranks,
            config,
            device,
            params,
        })
    }

    /// Ranks of the reference.
    pub fn shards(&self) -> usize {
        self.ranks.len()
    }
}

impl Role for ShardedReferenceRole {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reference"
    }

    fn profile(&self) -> ResourceProfile {
        // The ranks in this process: their shards of the f32 weights.
        let (n, local) = (self.ranks.len() as u64, self.ranks.local() as u64);
        ResourceProfile {
            resident_bytes: 4 * self.params * local / n,
            peak_extra_bytes: 0,
            offloadable: false,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("reference", self.device, group)
    }

    fn stop(&mut self) {
        self.ranks.stop_remote();
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        if samples.is_empty() {
            return Ok(samples);
        }
        let (mut samples, rows) =
            self.ranks
                .score_all(&self.config, samples, "reference log-probs")?;
        for (s, r) in samples.iter_mut().zip(rows) {
            s.ref_logprobs = Some(r);
        }
        // On a node, the gathered units go back to the OS rather than staying resident.
        if self.ranks.local() < self.ranks.len() {
            yatt_engine::release_host_memory();
        }
        Ok(samples)
    }

    fn load_weights(&mut self, _: WeightsUpdate) -> Result<(), RoleError> {
        Err(RoleError::BadRequest(
            "a sharded reference keeps the weights it was built with (the run's initial model, from model.source); it takes no weight sync".into(),
        ))
    }
}
