//! One rank of a sharded policy replica: what it is asked ([`RankRequest`]) and how it
//! runs its share of a step. A rank thread of an embedded replica and a rank actor on
//! a `yatt-node` ([`PolicyRankRole`]) run the same [`rank_step`], so a replica takes
//! the same steps wherever its ranks live.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind};
use yatt_engine::score::SeqBatch;
use yatt_engine::{
    to_buckets, Llama, MemoryOptions, ShardedStepStats, ShardedTrainer, TrainConfig,
};
use yatt_runtime::{ActorId, RingMember, RingSpec};

use super::config::PolicyConfig;
use super::micro::{groups, step_micros, MicroStats, SeqMicro};
use super::protocol::{PushReport, PushTarget};
use super::slice_push::SlicePusher;
use crate::builtin::critic::protocol::CriticConfig;
use crate::builtin::critic::rank::{rank_value_step, rank_values, CriticRankStep};
use crate::builtin::shard_ring::RingShardGroup;
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, WeightSlice, WeightsUpdate};
use crate::sample::Sample;

/// What a rank of a sharded policy replica on another node is asked by the replica's
/// rank 0 (the policy actor the controller drives).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RankRequest {
    /// This rank's ring inbox, for the ring's spec.
    RingInbox,
    /// Join the replica's ring and shard the model (or load this rank's part of the
    /// checkpoint) over it.
    JoinRing(RingSpec),
    /// Run this rank's part of one optimizer step over `samples` (the step's samples,
    /// every rank's: the loss is weighted by the normaliser over all of them).
    Step {
        /// The optimizer step's samples.
        samples: Vec<Sample>,
        /// This rank.
        rank: usize,
        /// Ranks of the replica.
        shards: usize,
    },
    /// Take part in gathering the model rank 0 keeps (a weight sync into rollouts of
    /// rank 0's own process); this rank drops each unit once gathered.
    Gather,
    /// Score this rank's part of `samples` (the old log-probs), unit by unit.
    Score {
        /// Every rank's samples: rank `r` scores the `r`-th of `shards` parts.
        samples: Vec<Sample>,
        /// This rank.
        rank: usize,
        /// Ranks of the replica.
        shards: usize,
    },
    /// HSDP (replicas of a sharded policy): this rank's inbox in the ring of the ranks
    /// that hold the same shards in every replica.
    ReplicaRingInbox,
    /// HSDP: join the ring of this rank's peers in the other replicas, and average the
    /// gradient shards with them before every optimizer step from now on.
    JoinReplicaRing(RingSpec),
    /// A critic's rank: value this rank's part of `samples`, unit by unit.
    Values {
        /// Every rank's samples: rank `r` values the `r`-th of `shards` parts.
        samples: Vec<Sample>,
        /// This rank.
        rank: usize,
        /// Ranks of the critic.
        shards: usize,
    },
    /// A critic's rank: run this rank's part of one critic optimizer step over
    /// `samples` (every rank's: the loss is weighted by the normaliser over all).
    ValueStep {
        /// The optimizer step's samples.
        samples: Vec<Sample>,
        /// This rank.
        rank: usize,
        /// Ranks of the critic.
        shards: usize,
    },
    /// Write this rank's shard of a sharded checkpoint into `dir`.
    Save {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// Where the tokenizer files are copied from, if any.
        tokenizer: Option<PathBuf>,
    },
    /// Send this rank's slice of the weights to these roles (weight sync without a
    /// gather: each rank sends its own), each load with `timeout`.
    PushSlice {
        /// The roles to load the slice into.
        to: Vec<PushTarget>,
        /// The deadline of each load.
        timeout: std::time::Duration,
    },
}

/// What a rank answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RankResponse {
    /// Its ring inbox.
    RingInbox(ActorId),
    /// It joined the ring and holds its shards.
    Joined,
    /// Its part of the step.
    Stepped(RankStep),
    /// A gather or a save is done.
    Done,
    /// What [`RankRequest::PushSlice`] did.
    Pushed(PushReport),
    /// The response-token log-probs of this rank's part of the samples, in order.
    Scored(Vec<Vec<f32>>),
    /// A critic's rank: the response-token values of its part of the samples, in order.
    Valued(Vec<Vec<f32>>),
    /// A critic's rank: its part of the critic step.
    ValueStepped(CriticRankStep),
}

/// One rank's part of an optimizer step.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankStep {
    /// Optimizer steps taken (after this one).
    pub version: u64,
    /// The step's loss (summed over the ranks: the same on every rank).
    pub loss: f64,
    /// The gradient norm over all shards, before clipping.
    pub grad_norm: f64,
    /// The LR used.
    pub lr: f64,
    /// This rank's training state and the most it gathered at once.
    pub train_state_bytes: u64,
    /// Bytes this rank received in all-gathers.
    pub gathered_bytes: u64,
    /// Bytes this rank sent in reduce-scatters.
    pub reduced_bytes: u64,
    /// Seconds this rank's communication thread spent in all-gathers.
    pub gather_s: f64,
    /// The part of `gather_s` this rank's compute waited for (not hidden by prefetch).
    pub gather_exposed_s: f64,
    /// Bytes this rank sent averaging its gradient shards with the other replicas'
    /// (HSDP; 0 without replicas).
    pub replica_bytes: u64,
    pub(super) stats: MicroStats,
}

impl RankStep {
    fn new(s: &ShardedStepStats, stats: MicroStats) -> Self {
        RankStep {
            version: s.step.step,
            loss: s.step.loss,
            grad_norm: s.step.grad_norm,
            lr: s.step.lr,
            train_state_bytes: s.train_state_bytes,
            gathered_bytes: s.comm.gathered_bytes,
            reduced_bytes: s.comm.reduced_bytes,
            gather_s: s.comm.gather_s,
            gather_exposed_s: s.comm.gather_exposed_s,
            replica_bytes: s.comm.replica_bytes,
            stats,
        }
    }
}

/// Rank `rank`'s part of one optimizer step over `samples`: the step's samples cut
/// into `shards` contiguous parts, this rank's part into micro-batches as the whole
/// policy would, each micro-batch's loss weighted by its share of the normaliser over
/// every rank's (so the step's gradient is the whole policy's).
pub(super) fn rank_step(
    trainer: &mut ShardedTrainer,
    cfg: &PolicyConfig,
    samples: &[Sample],
    rank: usize,
    shards: usize,
) -> Result<RankStep, String> {
    let device = trainer.model.device();
    let len = samples.len();
    let (mut all, mut owner) = (Vec::new(), Vec::new());
    for r in 0..shards {
        for g in groups(cfg, samples, len * r / shards..len * (r + 1) / shards) {
            all.push(g);
            owner.push(r);
        }
    }
    let micros = step_micros(cfg, device, samples, all).map_err(|e| e.to_string())?;
    let mut mine = Vec::new();
    for (mb, _) in micros.into_iter().zip(owner).filter(|(_, r)| *r == rank) {
        let m = SeqMicro::new(samples, mb, cfg.pad_id, device)
            .map_err(|e| format!("policy update: {e}"))?;
        mine.extend(m);
    }
    let (batches, micros): (Vec<SeqBatch>, Vec<SeqMicro>) = mine.into_iter().unzip();
    let mut stats = MicroStats::default();
    let step = trainer
        .step_tokens(&batches, cfg.temperature, |i, scores| {
            micros[i].loss(scores, cfg, &mut stats)
        })
        .map_err(|e| e.to_string())?;
    Ok(RankStep::new(&step, stats))
}

/// Joins `member` to the ring `spec` of this rank's peers in the other replicas
/// (HSDP), and has `trainer` average its gradient shards over it from now on.
pub(super) fn join_replica_ring(
    trainer: &mut ShardedTrainer,
    mut member: RingMember,
    spec: RingSpec,
) -> Result<(), String> {
    member
        .join(spec)
        .map_err(|e| format!("joining the replicas' ring: {e}"))?;
    let group = RingShardGroup::new(member).map_err(|e| e.to_string())?;
    trainer
        .join_replicas(Box::new(group))
        .map_err(|e| e.to_string())
}

/// Rank `rank`'s part of an old-log-prob pass over `samples`: the `rank`-th of
/// `shards` contiguous parts, scored in micro-batches as the policy trains them, unit
/// by unit (a collective: every rank calls it at once). Answers each sample's response
/// log-probs, in order.
pub(super) fn rank_score(
    trainer: &mut ShardedTrainer,
    cfg: &PolicyConfig,
    samples: &[Sample],
    rank: usize,
    shards: usize,
) -> Result<Vec<Vec<f32>>, String> {
    let device = trainer.model.device();
    let len = samples.len();
    let part = len * rank / shards..len * (rank + 1) / shards;
    let mut batches = Vec::new();
    let mut rows = Vec::new();
    for group in groups(cfg, samples, part) {
        let chunk: Vec<&Sample> = group.iter().map(|&i| &samples[i]).collect();
        let pairs: Vec<(&[i64], &[i64])> = chunk
            .iter()
            .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
            .collect();
        batches.push(
            SeqBatch::from_pairs(&pairs, cfg.pad_id, device)
                .map_err(|e| format!("old log-probs: {e}"))?,
        );
        rows.push(chunk);
    }
    let scored = trainer
        .score_tokens(&batches, cfg.temperature)
        .map_err(|e| format!("old log-probs: {e}"))?;
    let mut out = Vec::with_capacity(len / shards + 1);
    for (lp, chunk) in scored.iter().zip(rows) {
        let lp = lp.to_device(tch::Device::Cpu).to_kind(Kind::Float);
        for (i, s) in chunk.iter().enumerate() {
            let (at, n) = (s.prompt_tokens.len() as i64, s.response_len() as i64);
            let row = lp.get(i as i64).narrow(0, at, n);
            out.push(Vec::<f32>::try_from(&row).map_err(|e| format!("old log-probs: {e}"))?);
        }
    }
    Ok(out)
}

/// Sends this rank's slice of the current weights to `to` through `pusher` (a weight
/// sync without a gather: every rank does this at once, and each receiver writes the
/// weights when the last rank's slice has come).
pub(super) fn push_slice(
    trainer: &ShardedTrainer,
    pusher: &SlicePusher,
    to: &[PushTarget],
    timeout: std::time::Duration,
    bucket_bytes: usize,
) -> Result<PushReport, String> {
    let (rank, world) = trainer.rank();
    let buckets = tch::no_grad(|| to_buckets(&trainer.weight_slice(), bucket_bytes))
        .map_err(|e| format!("exporting this rank's slice of the weights: {e}"))?;
    let update = WeightsUpdate {
        slice: Some(WeightSlice {
            rank: rank as u32,
            world: world as u32,
        }),
        ..WeightsUpdate::from_buckets(trainer.step_count(), buckets)
    };
    Ok(pusher.push(update, to, timeout))
}

/// Where a rank's shards come from once it knows the ring.
pub enum RankSource {
    /// Shard this model (every rank loaded the same one).
    Model(Box<Llama>, TrainConfig),
    /// Shard this model to score with, never to train (a sharded reference's rank).
    Frozen(Box<Llama>),
    /// Load this rank's part of a sharded checkpoint (written at any rank count).
    Checkpoint {
        /// The checkpoint's directory.
        dir: PathBuf,
        /// Where the trainer runs.
        device: Device,
        /// The compute dtype.
        kind: Kind,
        /// Recompute and chunking settings.
        memory: MemoryOptions,
    },
}

impl RankSource {
    /// This rank's trainer over the ring `member` has joined.
    pub fn shard(self, member: RingMember) -> Result<ShardedTrainer, String> {
        let group = Box::new(RingShardGroup::new(member).map_err(|e| e.to_string())?);
        match self {
            RankSource::Model(model, train) => {
                ShardedTrainer::new(*model, train, group).map_err(|e| e.to_string())
            }
            RankSource::Frozen(model) => {
                ShardedTrainer::frozen(*model, group).map_err(|e| e.to_string())
            }
            RankSource::Checkpoint {
                dir,
                device,
                kind,
                memory,
            } => {
                let mut t = ShardedTrainer::load_sharded(&dir, device, kind, group)
                    .map_err(|e| format!("loading {}: {e}", dir.display()))?;
                t.model.memory = memory;
                Ok(t)
            }
        }
    }
}

/// A rank (other than rank 0) of a sharded policy replica whose ranks are actors on
/// `yatt-node`s: it holds only its shards, and runs what rank 0 asks, in the order
/// asked. Rank 0 is the policy actor ([`crate::ShardedPolicyRole::with_remote_ranks`]).
pub struct PolicyRankRole {
    config: PolicyConfig,
    /// A critic's rank: its value loss and micro-batching.
    critic: Option<CriticConfig>,
    inbox: ActorId,
    pending: Option<(RingMember, RankSource)>,
    /// HSDP: this rank's member of its peers' ring in the other replicas, until joined.
    replica_member: Option<RingMember>,
    trainer: Option<ShardedTrainer>,
    params: u64,
    write_root: Option<PathBuf>,
    pusher: Option<SlicePusher>,
}

impl PolicyRankRole {
    /// A rank that will shard `source` over the ring `member` joins
    /// ([`RankRequest::JoinRing`]). `params`: the model's parameter count.
    pub fn new(
        config: PolicyConfig,
        member: RingMember,
        source: RankSource,
        params: u64,
    ) -> Result<Self, RoleError> {
        config.check()?;
        Ok(PolicyRankRole {
            config,
            critic: None,
            inbox: member.inbox_id().clone(),
            pending: Some((member, source)),
            replica_member: None,
            trainer: None,
            params,
            write_root: None,
            pusher: None,
        })
    }

    /// Sends its slice of the weights through `pusher` when asked
    /// ([`RankRequest::PushSlice`]).
    pub fn with_pusher(mut self, pusher: SlicePusher) -> Self {
        self.pusher = Some(pusher);
        self
    }

    /// A rank of a sharded critic ([`crate::ShardedCriticRole`]): its model has a value
    /// head, and it answers [`RankRequest::Values`] and [`RankRequest::ValueStep`].
    pub fn with_critic(mut self, config: CriticConfig) -> Self {
        self.critic = Some(config);
        self
    }

    fn critic_config(&self) -> Result<CriticConfig, RoleError> {
        self.critic.clone().ok_or_else(|| {
            RoleError::BadRequest("this rank was not started as a critic's rank".into())
        })
    }

    /// Saves checkpoints only under `root` (see [`crate::PolicyRole::with_write_root`]).
    pub fn with_write_root(mut self, root: PathBuf) -> Self {
        self.write_root = Some(root);
        self
    }

    /// A rank of one of several replicas of the sharded policy (HSDP): `member` joins
    /// the ring of the ranks holding the same shards in the other replicas
    /// ([`RankRequest::JoinReplicaRing`]).
    pub fn with_replica_member(mut self, member: RingMember) -> Self {
        self.replica_member = Some(member);
        self
    }

    fn trainer(&mut self) -> Result<&mut ShardedTrainer, RoleError> {
        self.trainer.as_mut().ok_or_else(|| {
            RoleError::BadRequest("this policy rank has not joined its ring (JoinRing)".into())
        })
    }
}

impl Role for PolicyRankRole {
    type Request = RankRequest;
    type Response = RankResponse;

    fn name(&self) -> &str {
        "policy-rank"
    }

    fn profile(&self) -> ResourceProfile {
        let world = self.trainer.as_ref().map_or(1, |t| t.world()) as u64;
        ResourceProfile {
            resident_bytes: 16 * self.params / world,
            peak_extra_bytes: 0,
            offloadable: false,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        let device = match &self.pending {
            Some((_, RankSource::Model(m, _) | RankSource::Frozen(m))) => m.device(),
            Some((_, RankSource::Checkpoint { device, .. })) => *device,
            None => Device::Cpu,
        };
        crate::builtin::scoring::check_device("policy-rank", device, group)
    }

    fn serve(&mut self, request: RankRequest) -> Result<RankResponse, RoleError> {
        let answer = self.answer(request);
        // The node keeps freed blocks for the rollouts' decoding; a rank's are a whole
        // model's worth at its start and gathered units after each request.
        yatt_engine::release_host_memory();
        answer
    }
}

impl PolicyRankRole {
    fn answer(&mut self, request: RankRequest) -> Result<RankResponse, RoleError> {
        let failed = RoleError::Failed;
        match request {
            RankRequest::RingInbox => Ok(RankResponse::RingInbox(self.inbox.clone())),
            RankRequest::JoinRing(spec) => {
                let (mut member, source) = self.pending.take().ok_or_else(|| {
                    RoleError::BadRequest("this policy rank has joined its ring already".into())
                })?;
                member
                    .join(spec)
                    .map_err(|e| RoleError::BadRequest(format!("joining the ring: {e}")))?;
                self.trainer = Some(source.shard(member).map_err(failed)?);
                Ok(RankResponse::Joined)
            }
            RankRequest::ReplicaRingInbox => match &self.replica_member {
                Some(m) => Ok(RankResponse::RingInbox(m.inbox_id().clone())),
                None => Err(no_replicas()),
            },
            RankRequest::JoinReplicaRing(spec) => {
                let member = self.replica_member.take().ok_or_else(no_replicas)?;
                join_replica_ring(self.trainer()?, member, spec).map_err(failed)?;
                Ok(RankResponse::Joined)
            }
            RankRequest::Step {
                samples,
                rank,
                shards,
            } => {
                let cfg = self.config.clone();
                let step = rank_step(self.trainer()?, &cfg, &samples, rank, shards);
                step.map(RankResponse::Stepped).map_err(failed)
            }
            RankRequest::Score {
                samples,
                rank,
                shards,
            } => {
                let cfg = self.config.clone();
                let scored = rank_score(self.trainer()?, &cfg, &samples, rank, shards);
                scored.map(RankResponse::Scored).map_err(failed)
            }
            RankRequest::Values {
                samples,
                rank,
                shards,
            } => {
                let cfg = self.critic_config()?;
                let valued = rank_values(self.trainer()?, &cfg, &samples, rank, shards);
                valued.map(RankResponse::Valued).map_err(failed)
            }
            RankRequest::ValueStep {
                samples,
                rank,
                shards,
            } => {
                let cfg = self.critic_config()?;
                let step = rank_value_step(self.trainer()?, &cfg, &samples, rank, shards);
                step.map(RankResponse::ValueStepped).map_err(failed)
            }
            RankRequest::Gather => {
                let t = self.trainer()?;
                t.gather_for_peer().map_err(|e| failed(e.to_string()))?;
                Ok(RankResponse::Done)
            }
            RankRequest::Save { dir, tokenizer } => {
                crate::builtin::write_root::check_under(
                    self.write_root.as_deref(),
                    &dir,
                    "the policy's checkpoint",
                )?;
                let t = self.trainer()?;
                t.save_sharded(&dir, tokenizer.as_deref())
                    .map_err(|e| failed(format!("saving to {}: {e}", dir.display())))?;
                Ok(RankResponse::Done)
            }
            RankRequest::PushSlice { to, timeout } => {
                let pusher = self.pusher.clone().ok_or_else(|| {
                    RoleError::BadRequest(
                        "this policy rank was started without a node to send its slice from".into(),
                    )
                })?;
                let bucket_bytes = self.config.bucket_bytes;
                let t = self.trainer()?;
                push_slice(t, &pusher, &to, timeout, bucket_bytes)
                    .map(RankResponse::Pushed)
                    .map_err(failed)
            }
        }
    }
}

/// A replica ring asked of a rank started without a member for one (or joined).
fn no_replicas() -> RoleError {
    RoleError::BadRequest(
        "this policy rank has no replicas' ring to join: it was started with job.policy_replicas = 1, or has joined it already".into(),
    )
}
