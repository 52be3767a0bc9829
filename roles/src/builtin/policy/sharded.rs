//! The policy as one replica sharded over N ranks (ZeRO-3, `job.policy_shards`): in an
//! embedded run each rank is a thread of this process holding a [`ShardedTrainer`], so
//! the shards give parity with the whole policy, not memory; in a cluster this actor
//! holds rank 0 and asks the other ranks, actors on their own `yatt-node`s
//! ([`super::rank::PolicyRankRole`]), over QUIC.
//!
//! A train request splits each optimizer step's samples into N contiguous parts, one
//! per rank; each rank cuts its part into micro-batches as the whole policy would, and
//! every micro-batch's loss is weighted by its share of the step's normaliser over all
//! ranks, so the step's gradient is the whole policy's ([`super::rank::rank_step`],
//! the same on a thread and on a node).
//!
//! Old log-probs are scored the same way: each rank its part, unit by unit. With ranks
//! on nodes a weight sync goes by slices: every rank sends its own shard of each unit
//! to the rollouts and the reference, which write the weights once the last rank's
//! slice has come; no process gathers the model. Embedded, the rollouts in this
//! process take the gathered model (an in-process snapshot: parity, not memory);
//! device (CUDA IPC, NCCL) syncs answer "unavailable", so a byte path serves them.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tch::{Device, Kind};
use yatt_engine::{
    check_shards, model_layout, to_buckets, Llama, MemoryOptions, ShardedTrainer, TrainConfig,
};

use super::config::PolicyConfig;
use super::micro::{begin_update, MicroStats};
use super::protocol::{PolicyRequest, PolicyResponse, PushReport, PushTarget};
use super::rank::{push_slice, rank_step, RankRequest, RankResponse, RankStep};
use super::ranks::{self, Ranks, RemoteRanks};
use super::report::{ShardReport, TrainReport};
use super::slice_push::SlicePusher;
use crate::builtin::scoring::check_device;
use crate::role::{DeviceGroup, LocalWeights, ResourceProfile, Role, RoleError, WeightsUpdate};
use crate::sample::Sample;

/// How a sharded policy replica starts.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedStart {
    /// Ranks of the replica.
    pub shards: usize,
    /// The deadline of each collective between the ranks.
    pub collective: Duration,
    /// The deadline of a whole request on every rank (an update, a save).
    pub deadline: Duration,
}

/// The policy role over one replica sharded over [`ShardedStart::shards`] ranks.
pub struct ShardedPolicyRole {
    pub(super) ranks: Ranks,
    /// HSDP: the local ranks' members of their rings with the other replicas' ranks,
    /// in rank order, until joined ([`super::hsdp`]).
    pub(super) replica_members: Vec<yatt_runtime::RingMember>,
    /// HSDP: every rank has joined its ring with the other replicas.
    pub(super) replicas_joined: bool,
    config: PolicyConfig,
    device: Device,
    kind: Kind,
    /// Optimizer steps taken: the weights' version.
    version: u64,
    /// Parameters of the model.
    params: u64,
    write_root: Option<PathBuf>,
    /// With ranks on nodes: each rank sends its own slice to the rollouts.
    pusher: Option<SlicePusher>,
    /// With every rank in this process: the deadlines of a collective and of a request,
    /// for the ranks of a reshard ([`PolicyRequest::Reshard`]).
    local_deadlines: Option<(Duration, Duration)>,
}

fn engine(doing: &str) -> impl Fn(yatt_engine::EngineError) -> RoleError + '_ {
    move |e| RoleError::Failed(format!("{doing}: {e}"))
}

impl ShardedPolicyRole {
    /// A fresh replica of `model` over `start.shards` ranks (each shards a copy of it:
    /// every rank starts from the same weights). Fails on an unusable config or a shard
    /// count the model's units cannot be split over.
    pub fn new(
        model: Llama,
        train: TrainConfig,
        config: PolicyConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        config.check()?;
        check_shards(&model.config, start.shards).map_err(bad_shards)?;
        let trainers = ranks::shard_copies(
            model,
            (start.shards, start.collective),
            "the policy",
            |m, group| ShardedTrainer::new(m, train.clone(), Box::new(group)),
        )?;
        let mut role = Self::assemble(trainers, None, config, start.deadline)?;
        role.local_deadlines = Some((start.collective, start.deadline));
        Ok(role)
    }

    /// A replica over `start.shards` ranks from the sharded checkpoint `dir`, whatever
    /// rank count wrote it (each unit is resharded on the way in).
    pub fn load(
        dir: &Path,
        device: Device,
        kind: Kind,
        memory: MemoryOptions,
        config: PolicyConfig,
        start: &ShardedStart,
    ) -> Result<Self, RoleError> {
        config.check()?;
        let mut trainers = Vec::with_capacity(start.shards);
        for group in ranks::groups(start.shards, start.collective) {
            let mut t =
                ShardedTrainer::load_sharded(dir, device, kind, Box::new(group)).map_err(|e| {
                    RoleError::BadRequest(format!(
                        "loading the sharded policy from {}: {e}",
                        dir.display()
                    ))
                })?;
            t.model.memory = memory;
            trainers.push(t);
        }
        let mut role = Self::assemble(trainers, None, config, start.deadline)?;
        role.local_deadlines = Some((start.collective, start.deadline));
        Ok(role)
    }

    /// Rank 0 of a replica whose other ranks are actors on other nodes (`remote`:
    /// ranks 1..N, joined to the ring `rank0`'s group is in).
    pub fn with_remote_ranks(
        rank0: ShardedTrainer,
        remote: RemoteRanks,
        config: PolicyConfig,
        deadline: std::time::Duration,
    ) -> Result<Self, RoleError> {
        config.check()?;
        Self::assemble(vec![rank0], Some(remote), config, deadline)
    }

    /// The role over `trainers` (the local ranks, rank order) and any `remote` ranks
    /// after them, each request bounded by `deadline`.
    fn assemble(
        trainers: Vec<ShardedTrainer>,
        remote: Option<RemoteRanks>,
        config: PolicyConfig,
        deadline: std::time::Duration,
    ) -> Result<Self, RoleError> {
        let first = &trainers[0].model;
        let (device, kind, params) = (first.device(), first.kind(), param_count(first));
        let version = trainers[0].step_count();
        let mut ranks = Ranks::start("policy", trainers, deadline)?;
        if let Some(r) = remote {
            ranks = ranks.with_remote(r);
        }
        Ok(ShardedPolicyRole {
            ranks,
            config,
            device,
            kind,
            version,
            params,
            write_root: None,
            pusher: None,
            local_deadlines: None,
            replica_members: Vec::new(),
            replicas_joined: false,
        })
    }

    /// Syncs weights by slices ([`PolicyRequest::PushWeights`]): rank 0 sends its own
    /// through `pusher` and asks every other rank to send its own, so no process
    /// gathers the model. Without it the weights are gathered into rank 0 and exported.
    pub fn with_pusher(mut self, pusher: SlicePusher) -> Self {
        self.pusher = Some(pusher);
        self
    }

    /// Saves checkpoints only under `root` (see [`crate::PolicyRole::with_write_root`]).
    pub fn with_write_root(mut self, root: PathBuf) -> Self {
        self.write_root = Some(root);
        self
    }

    /// Ranks of the replica.
    pub fn shards(&self) -> usize {
        self.ranks.len()
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.version
    }

    /// The whole model with the current weights, gathered from the ranks into rank 0
    /// (it holds the whole model in the compute dtype; the other ranks keep nothing).
    pub fn gathered_model(&mut self) -> Result<Llama, RoleError> {
        let jobs = (0..self.ranks.local())
            .map(|rank| {
                move |tr: &mut ShardedTrainer| match rank {
                    0 => tr.gathered_model().map(Some).map_err(|e| e.to_string()),
                    _ => tr
                        .gather_for_peer()
                        .map(|_| None)
                        .map_err(|e| e.to_string()),
                }
            })
            .collect();
        let (answers, _) = self
            .ranks
            .run_all("gathering the weights", jobs, |_| RankRequest::Gather)?;
        let mut model = None;
        for a in answers {
            let m = a.map_err(|e| RoleError::Failed(format!("gathering the weights: {e}")))?;
            model = model.or(m);
        }
        Ok(model.expect("rank 0 answers with the model"))
    }

    fn train(&mut self, samples: Vec<Sample>) -> Result<TrainReport, RoleError> {
        self.train_in(samples, false)
    }

    /// An update: one optimizer step per mini-batch (`optim.mini_batches`), or with
    /// `one_step` one over all `samples` (as replicas of a data-parallel policy take).
    pub(super) fn train_in(
        &mut self,
        samples: Vec<Sample>,
        one_step: bool,
    ) -> Result<TrainReport, RoleError> {
        let t0 = Instant::now();
        let cfg = self.config.clone();
        let n = self.ranks.len();
        let (mut per_mini, mut report) = begin_update(&cfg, &samples)?;
        if one_step {
            per_mini = samples.len();
        }
        let mut shard = ShardReport {
            shards: n,
            ..Default::default()
        };
        let (mut grad_norm, mut loss) = (0.0, 0.0);
        let mut stats = MicroStats::default();
        for mini_start in (0..samples.len()).step_by(per_mini) {
            let mini_end = (mini_start + per_mini).min(samples.len());
            let step = self.step(&samples, mini_start..mini_end)?;
            let s = &step[0];
            grad_norm += s.grad_norm;
            loss += s.loss;
            report.lr = s.lr;
            report.optimizer_steps += 1;
            self.version = s.version;
            for st in &step {
                stats.add(&st.stats);
            }
            let k = n as u64;
            shard.train_state_bytes = step
                .iter()
                .map(|s| s.train_state_bytes)
                .fold(shard.train_state_bytes, u64::max);
            shard.gathered_bytes += step.iter().map(|s| s.gathered_bytes).sum::<u64>() / k;
            shard.reduced_bytes += step.iter().map(|s| s.reduced_bytes).sum::<u64>() / k;
            shard.gather_s += step.iter().map(|s| s.gather_s).fold(0.0, f64::max);
            shard.gather_exposed_s += step.iter().map(|s| s.gather_exposed_s).fold(0.0, f64::max);
            shard.replica_bytes += step.iter().map(|s| s.replica_bytes).sum::<u64>() / k;
        }
        let steps = report.optimizer_steps.max(1) as f64;
        report.grad_norm = grad_norm / steps;
        report.loss = loss / steps;
        stats.report_into(&mut report);
        report.version = self.version;
        report.sharded = Some(shard);
        crate::builtin::fault::after_update(report.version);
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    /// One optimizer step over `samples[range]` on every rank: rank `r` runs the
    /// `r`-th of N contiguous parts ([`rank_step`]). Returns every rank's part.
    fn step(
        &mut self,
        samples: &[Sample],
        range: std::ops::Range<usize>,
    ) -> Result<Vec<RankStep>, RoleError> {
        let n = self.ranks.len();
        let mini = std::sync::Arc::new(samples[range].to_vec());
        let jobs = (0..self.ranks.local())
            .map(|rank| {
                let (cfg, mini) = (self.config.clone(), mini.clone());
                move |tr: &mut ShardedTrainer| rank_step(tr, &cfg, &mini, rank, n)
            })
            .collect();
        let (local, remote) =
            self.ranks
                .run_all("a policy update", jobs, |rank| RankRequest::Step {
                    samples: mini.to_vec(),
                    rank,
                    shards: n,
                })?;
        self.ranks
            .parts("policy update", local, remote, |a| match a {
                RankResponse::Stepped(s) => Ok(s),
                other => Err(other),
            })
    }

    fn export(&mut self, local: bool) -> Result<WeightsUpdate, RoleError> {
        let mut model = self.gathered_model()?;
        if local {
            // A fresh copy: the roles that take it over share it with no one.
            return Ok(WeightsUpdate {
                version: self.version,
                buckets: Vec::new(),
                local: Some(LocalWeights::new(model.weights_snapshot())),
                device: None,
                slice: None,
            });
        }
        let named = model.hf_named_tensors();
        let buckets = tch::no_grad(|| to_buckets(&named, self.config.bucket_bytes))
            .map_err(engine("exporting weights"))?;
        Ok(WeightsUpdate::from_buckets(self.version, buckets))
    }

    /// Every rank sends its own slice of the weights to `to` at once; one report of
    /// the sync, a target failed where any rank's load into it failed.
    fn push_slices(
        &mut self,
        pusher: SlicePusher,
        to: Vec<PushTarget>,
        timeout: Duration,
    ) -> Result<PushReport, RoleError> {
        let bucket_bytes = self.config.bucket_bytes;
        let jobs = (0..self.ranks.local())
            .map(|_| {
                let (pusher, to) = (pusher.clone(), to.clone());
                move |tr: &mut ShardedTrainer| push_slice(tr, &pusher, &to, timeout, bucket_bytes)
            })
            .collect();
        let push = |_| RankRequest::PushSlice {
            to: to.clone(),
            timeout,
        };
        let (local, remote) = self.ranks.run_all("a weight sync", jobs, push)?;
        let mut report = PushReport {
            version: self.version,
            bytes: 0,
            failed: Vec::new(),
        };
        let mut reports = Vec::with_capacity(local.len() + remote.len());
        for a in local {
            reports.push(a.map_err(|e| RoleError::Failed(format!("a weight sync: {e}")))?);
        }
        for a in remote {
            match a {
                RankResponse::Pushed(r) => reports.push(r),
                other => {
                    return Err(RoleError::Failed(format!(
                        "a weight sync: a rank answered {other:?}"
                    )))
                }
            }
        }
        for r in reports {
            report.bytes += r.bytes;
            for (id, e) in r.failed {
                if !report.failed.iter().any(|(known, _)| *known == id) {
                    report.failed.push((id, e));
                }
            }
        }
        Ok(report)
    }

    /// The old log-probs, each rank scoring its part unit by unit: no process holds
    /// the whole model.
    fn old_logprobs(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        if samples.is_empty() || self.config.old_from_rollout(&mut samples) {
            return Ok(samples);
        }
        let (mut samples, rows) = self
            .ranks
            .score_all(&self.config, samples, "old log-probs")?;
        for (s, r) in samples.iter_mut().zip(rows) {
            s.old_logprobs = Some(r);
        }
        Ok(samples)
    }

    fn save(&mut self, dir: PathBuf) -> Result<(), RoleError> {
        crate::builtin::fault::in_policy_save();
        crate::builtin::write_root::check_under(
            self.write_root.as_deref(),
            &dir,
            "the policy's checkpoint",
        )?;
        let tokenizer = self.config.tokenizer_dir.clone();
        let jobs = (0..self.ranks.local())
            .map(|_| {
                let (dir, tokenizer) = (dir.clone(), tokenizer.clone());
                move |tr: &mut ShardedTrainer| {
                    tr.save_sharded(&dir, tokenizer.as_deref())
                        .map_err(|e| e.to_string())
                }
            })
            .collect();
        let save = |_| RankRequest::Save {
            dir: dir.clone(),
            tokenizer: tokenizer.clone(),
        };
        // A remote rank's failure fails the call; its answers say nothing more.
        let (local, _) = self.ranks.run_all("saving a checkpoint", jobs, save)?;
        for a in local {
            a.map_err(|e| {
                RoleError::Failed(format!("saving a checkpoint to {}: {e}", dir.display()))
            })?;
        }
        Ok(())
    }
}

impl ShardedPolicyRole {
    /// Reshards the replica in place, between two requests, over `shards` ranks: the
    /// ranks hand their states over and the new ranks take the parts they overlap (in
    /// memory; for a moment both are held). The weights, moments and step carry over,
    /// so the next update is the one the old ranks would have taken. Only a replica
    /// wholly in this process, outside replicas (HSDP), is resharded; a shard count the
    /// model's units cannot be split over leaves the old ranks as they were.
    fn reshard(&mut self, shards: usize) -> Result<(usize, usize), RoleError> {
        let Some((collective, deadline)) = self.local_deadlines else {
            return Err(RoleError::BadRequest(
                "a sharded policy with ranks on other nodes is not resharded in place: resume it with another job.policy_shards".into(),
            ));
        };
        if self.replicas_joined || !self.replica_members.is_empty() {
            return Err(RoleError::BadRequest(
                "a replica of a sharded policy (HSDP, job.policy_replicas > 1) is not resharded in place: its replicas' ranks would no longer match".into(),
            ));
        }
        let from = self.ranks.len();
        if shards == 0 {
            return Err(RoleError::BadRequest("resharding to 0 ranks".into()));
        }
        if shards == from {
            return Ok((from, from));
        }
        let states = self.ranks.hand_over()?;
        let build = |n: usize| -> Result<Vec<ShardedTrainer>, String> {
            ranks::groups(n, collective)
                .into_iter()
                .map(|g| {
                    ShardedTrainer::from_rank_states(&states, Box::new(g))
                        .map_err(|e| e.to_string())
                })
                .collect()
        };
        let (trainers, refused) = match build(shards) {
            Ok(t) => (t, None),
            Err(e) => (build(from).map_err(|again| {
                self.ranks.break_with(format!(
                    "resharding {from} -> {shards} ranks failed ({e}), and so did restoring the {from} ranks ({again})"
                ))
            })?, Some(e)),
        };
        self.ranks = Ranks::start("policy", trainers, deadline)?;
        match refused {
            None => Ok((from, shards)),
            Some(e) => Err(RoleError::BadRequest(format!(
                "resharding {from} -> {shards} ranks: {e}; the {from} ranks are kept"
            ))),
        }
    }
}

fn param_count(model: &Llama) -> u64 {
    model_layout(&model.config)
        .iter()
        .map(|u| u.numel as u64)
        .sum()
}

fn bad_shards(e: yatt_engine::EngineError) -> RoleError {
    RoleError::BadRequest(format!("job.policy_shards: {e}"))
}

/// What a sharded policy does not do yet, for the requests that need it.
fn not_sharded(what: &str) -> RoleError {
    RoleError::BadRequest(format!(
        "{what} is not built for a sharded policy (job.policy_shards > 1): set job.policy_shards = 1"
    ))
}

impl Role for ShardedPolicyRole {
    type Request = PolicyRequest;
    type Response = PolicyResponse;

    fn name(&self) -> &str {
        "policy"
    }

    fn profile(&self) -> ResourceProfile {
        // The ranks in this process: 16 bytes per parameter of sharded f32 state each,
        // plus, embedded, a gathered copy of the model in its dtype at a sync (with
        // ranks on nodes a sync sends this rank's slice: 1/N of it).
        let n = self.ranks.len() as u64;
        let w = self.params * self.kind.elt_size_in_bytes() as u64;
        let local = self.ranks.local() as u64;
        ResourceProfile {
            resident_bytes: 16 * self.params * local / n,
            peak_extra_bytes: match self.pusher {
                Some(_) => w / n,
                None => w,
            },
            offloadable: false,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("policy", self.device, group)
    }

    fn stop(&mut self) {
        self.ranks.stop_remote();
    }

    fn serve(&mut self, request: PolicyRequest) -> Result<PolicyResponse, RoleError> {
        use PolicyRequest as Q;
        use PolicyResponse as A;
        let why_not = "a sharded policy (job.policy_shards > 1) gathers its weights and sends them as byte buckets";
        let answer = match request {
            Q::OldLogProbs(samples) => self.old_logprobs(samples).map(A::Scored),
            Q::Train(samples) => self.train(samples).map(A::Trained),
            Q::ExportWeights => self.export(false).map(A::Weights),
            Q::ExportLocalWeights => self.export(true).map(A::Weights),
            Q::ExportDeviceWeights => Ok(A::DeviceWeightsUnavailable(why_not.into())),
            Q::StageBroadcast { .. } => Ok(A::NcclUnavailable(why_not.into())),
            Q::PushWeights { to, timeout } => match self.pusher.clone() {
                Some(pusher) => self.push_slices(pusher, to, timeout).map(A::Pushed),
                None => Ok(A::PushUnavailable(
                    "an embedded sharded policy exports its gathered weights".into(),
                )),
            },
            Q::SaveCheckpoint(dir) => self.save(dir).map(|_| A::Saved),
            Q::Broadcast(_) => Err(not_sharded("an NCCL weight broadcast")),
            // Replicas of a sharded policy (HSDP): each rank has its own ring with the
            // other replicas' ranks of the same shards.
            Q::RingInbox => self.shard_ring_inboxes().map(A::ShardRingInboxes),
            Q::JoinShardRings(specs) => self.join_shard_rings(specs).map(|_| A::Joined),
            Q::TrainAllReduce(samples) => self.train_with_replicas(samples).map(A::Trained),
            Q::GradientGroup { .. } => Ok(A::NcclUnavailable(
                "a sharded policy's replicas average their gradient shards over the ranks' rings"
                    .into(),
            )),
            Q::JoinGradientGroup(None) => Ok(A::Joined),
            Q::JoinRing(_) => Err(RoleError::BadRequest(
                "a sharded policy replica joins one ring per rank (JoinShardRings), not one".into(),
            )),
            Q::Gradients(_) | Q::ApplyGradients(_) | Q::JoinGradientGroup(Some(_)) => Err(
                not_sharded("averaging gradients through the controllers or over NCCL"),
            ),
            Q::Reshard { shards } => self
                .reshard(shards as usize)
                .map(|(from, to)| A::Resharded {
                    from: from as u32,
                    to: to as u32,
                }),
            Q::ExportState | Q::ImportState(_) => {
                Err(not_sharded("handing the trainer state to another replica"))
            }
        };
        // On a node, what a request gathered (a whole model at a sync) goes back to the
        // OS rather than staying resident until the next one. Embedded, the process's
        // rollouts keep freed blocks for decoding on purpose.
        if self.ranks.local() < self.ranks.len() {
            yatt_engine::release_host_memory();
        }
        answer
    }
}
