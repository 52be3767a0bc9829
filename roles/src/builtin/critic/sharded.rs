//! The critic sharded over N ranks (`job.critic_shards`, ZeRO-3 / FSDP as the
//! policy's): each rank keeps only its shard of the f32 master weights, gradients and
//! AdamW moments of the backbone and the value head, gathers each unit's weights just
//! before it runs, and recomputes each layer in backward.
//!
//! Every request is a collective. The samples are cut into N contiguous parts, one per
//! rank, and each rank cuts its part into micro-batches as the whole critic would.
//! Each micro-batch's value loss is weighted by its share of the normaliser over every
//! rank's, so a step is the whole critic's whatever N is. Embedded, the ranks are
//! threads of this process (parity, not memory); on a cluster this actor is rank 0 and
//! the other ranks are `policy-rank` actors on their nodes, started as critic ranks
//! ([`crate::PolicyRankRole::with_critic`]), which run the same [`rank_values`] and
//! [`rank_value_step`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use tch::{Device, Kind};
use yatt_engine::{check_shards, layout_of, Llama, ShardedTrainer, TrainConfig};

use super::protocol::{CriticConfig, CriticReport, CriticRequest, CriticResponse};
use super::rank::{rank_value_step, rank_values, update_report};
use super::values::check_train_samples;
use crate::builtin::policy::ranks::{self, Ranks};
use crate::builtin::policy::{RankRequest, RankResponse, RemoteRanks, ShardedStart};
use crate::builtin::scoring::check_device;
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use crate::sample::Sample;

/// The critic role over one value model sharded over [`ShardedStart::shards`] ranks.
pub struct ShardedCriticRole {
    ranks: Ranks,
    config: CriticConfig,
    device: Device,
    /// Parameters of the whole model, value head included.
    params: u64,
    /// Checkpoints go only under this directory (a node's data directory).
    write_root: Option<PathBuf>,
}

impl ShardedCriticRole {
    /// `model` (a value head is attached, zero, if it has no scalar head) sharded over
    /// `start.shards` rank threads of this process, trained with `train`. Fails on a
    /// shard count the model's units cannot be split over.
    pub fn new(
        mut model: Llama,
        train: TrainConfig,
        config: CriticConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        config.check()?;
        check_shards(&model.config, start.shards)
            .map_err(|e| RoleError::BadRequest(format!("job.critic_shards: {e}")))?;
        if model.head.is_none() {
            model.attach_head("v_head");
        }
        let trainers = ranks::shard_copies(
            model,
            (start.shards, start.collective),
            "the critic",
            |m, group| ShardedTrainer::new(m, train.clone(), Box::new(group)),
        )?;
        Self::assemble(trainers, None, config, start)
    }

    /// The critic of the sharded checkpoint `dir` (written by this role at any rank
    /// count), resharded over `start.shards` ranks, computing in `kind` on `device`.
    pub fn load(
        dir: &Path,
        device: Device,
        kind: Kind,
        config: CriticConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        config.check()?;
        let mut trainers = Vec::with_capacity(start.shards);
        for group in ranks::groups(start.shards, start.collective) {
            let tr =
                ShardedTrainer::load_sharded(dir, device, kind, Box::new(group)).map_err(|e| {
                    RoleError::Failed(format!("loading the critic from {}: {e}", dir.display()))
                })?;
            if tr.model.head.is_none() {
                return Err(RoleError::BadRequest(format!(
                    "{} holds a sharded language model, not a critic (no value head)",
                    dir.display()
                )));
            }
            trainers.push(tr);
        }
        Self::assemble(trainers, None, config, start)
    }

    /// Rank 0 of a critic whose other ranks are `policy-rank` actors on other nodes,
    /// started as critic ranks (`remote`: ranks 1..N, joined to the ring `rank0`'s
    /// group is in).
    pub fn with_remote_ranks(
        rank0: ShardedTrainer,
        remote: RemoteRanks,
        config: CriticConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        config.check()?;
        Self::assemble(vec![rank0], Some(remote), config, start)
    }

    fn assemble(
        trainers: Vec<ShardedTrainer>,
        remote: Option<RemoteRanks>,
        config: CriticConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        let first = &trainers[0].model;
        if first.head.is_none() {
            return Err(RoleError::BadRequest(
                "a sharded critic's ranks need a value head on their model".into(),
            ));
        }
        let device = first.device();
        let params = layout_of(first).iter().map(|u| u.numel as u64).sum();
        let mut ranks = Ranks::start("critic", trainers, start.deadline)?;
        if let Some(r) = remote {
            ranks = ranks.with_remote(r);
        }
        Ok(ShardedCriticRole {
            ranks,
            config,
            device,
            params,
            write_root: None,
        })
    }

    /// Saves checkpoints only under `root` (see [`crate::PolicyRole::with_write_root`]).
    pub fn with_write_root(mut self, root: PathBuf) -> Self {
        self.write_root = Some(root);
        self
    }

    /// Ranks of the critic.
    pub fn shards(&self) -> usize {
        self.ranks.len()
    }

    /// Every rank runs `job` on the shared samples (a remote rank is sent `remote`'s
    /// request and answers what `pick` takes); their answers in rank order.
    fn on_every_rank<T: Send + 'static>(
        &mut self,
        what: &str,
        samples: Arc<Vec<Sample>>,
        job: impl Fn(&mut ShardedTrainer, &[Sample], usize, usize) -> Result<T, String>
            + Clone
            + Send
            + 'static,
        remote: impl Fn(Vec<Sample>, usize, usize) -> RankRequest,
        pick: impl Fn(RankResponse) -> Result<T, RankResponse>,
    ) -> Result<Vec<T>, RoleError> {
        let n = self.ranks.len();
        let jobs = (0..self.ranks.local())
            .map(|rank| {
                let (samples, job) = (samples.clone(), job.clone());
                move |tr: &mut ShardedTrainer| job(tr, &samples, rank, n)
            })
            .collect();
        let ask = |rank| remote(samples.to_vec(), rank, n);
        let (local, answers) = self.ranks.run_all(what, jobs, ask)?;
        self.ranks.parts(what, local, answers, pick)
    }

    fn values(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        let cfg = self.config.clone();
        let all = Arc::new(samples);
        let parts = self.on_every_rank(
            "critic values",
            all.clone(),
            move |tr, s, r, n| rank_values(tr, &cfg, s, r, n),
            |samples, rank, shards| RankRequest::Values {
                samples,
                rank,
                shards,
            },
            |a| match a {
                RankResponse::Valued(rows) => Ok(rows),
                other => Err(other),
            },
        )?;
        let rows: Vec<Vec<f32>> = parts.into_iter().flatten().collect();
        let mut samples = Arc::try_unwrap(all).unwrap_or_else(|a| a.to_vec());
        if rows.len() != samples.len() {
            return Err(self.ranks.break_with(format!(
                "critic values: the ranks valued {} of {} samples",
                rows.len(),
                samples.len()
            )));
        }
        for (s, r) in samples.iter_mut().zip(rows) {
            s.values = Some(r);
        }
        Ok(samples)
    }

    fn train(&mut self, samples: Vec<Sample>) -> Result<CriticReport, RoleError> {
        let t0 = Instant::now();
        let trained = check_train_samples(&samples)?;
        let per_mini = samples.len().div_ceil(self.config.mini_batches);
        let mut steps = Vec::new();
        for mini in samples.chunks(per_mini) {
            let cfg = self.config.clone();
            let mini = Arc::new(mini.to_vec());
            steps.push(self.on_every_rank(
                "critic update",
                mini,
                move |tr, s, r, n| rank_value_step(tr, &cfg, s, r, n),
                |samples, rank, shards| RankRequest::ValueStep {
                    samples,
                    rank,
                    shards,
                },
                |a| match a {
                    RankResponse::ValueStepped(step) => Ok(step),
                    other => Err(other),
                },
            )?);
        }
        Ok(update_report(trained, &steps, t0.elapsed().as_secs_f64()))
    }

    fn save(&mut self, dir: PathBuf) -> Result<(), RoleError> {
        crate::builtin::write_root::check_under(
            self.write_root.as_deref(),
            &dir,
            "the critic's checkpoint",
        )?;
        let jobs = (0..self.ranks.local())
            .map(|_| {
                let dir = dir.clone();
                move |tr: &mut ShardedTrainer| {
                    tr.save_sharded(&dir, None).map_err(|e| e.to_string())
                }
            })
            .collect();
        let remote = |_| RankRequest::Save {
            dir: dir.clone(),
            tokenizer: None,
        };
        let done = self
            .ranks
            .run_all("saving the critic", jobs, remote)
            .and_then(|(local, answers)| {
                self.ranks
                    .parts("saving the critic", local, answers, |a| match a {
                        RankResponse::Done => Ok(()),
                        other => Err(other),
                    })
            });
        done.map(drop).map_err(|e| {
            RoleError::Failed(format!(
                "saving the critic checkpoint to {}: {e}",
                dir.display()
            ))
        })
    }
}

impl Role for ShardedCriticRole {
    type Request = CriticRequest;
    type Response = CriticResponse;

    fn name(&self) -> &str {
        "critic"
    }

    fn profile(&self) -> ResourceProfile {
        // The ranks in this process: their shards of the f32 training state.
        let (n, local) = (self.ranks.len() as u64, self.ranks.local() as u64);
        ResourceProfile {
            resident_bytes: 16 * self.params * local / n,
            peak_extra_bytes: 0,
            offloadable: false,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("critic", self.device, group)
    }

    fn stop(&mut self) {
        self.ranks.stop_remote();
    }

    fn serve(&mut self, request: CriticRequest) -> Result<CriticResponse, RoleError> {
        match request {
            CriticRequest::Values(samples) if samples.is_empty() => {
                Ok(CriticResponse::Valued(samples))
            }
            CriticRequest::Values(samples) => self.values(samples).map(CriticResponse::Valued),
            CriticRequest::Train(samples) => {
                crate::builtin::fault::in_critic_update();
                self.train(samples).map(CriticResponse::Trained)
            }
            CriticRequest::SaveCheckpoint(dir) => self.save(dir).map(|()| CriticResponse::Saved),
        }
    }
}
