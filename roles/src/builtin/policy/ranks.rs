//! The ranks of a sharded replica (a policy's, and a reference's or a critic's): the local ones, each a thread of this process
//! that owns a [`ShardedTrainer`] and runs the jobs it is sent, in order, from a
//! bounded channel; and, in a cluster, the remote ones, actors on other `yatt-node`s
//! asked over QUIC ([`RemoteRanks`]). Every job goes to every rank at once (they are
//! collectives) and is answered within a deadline; a rank that misses it, fails, or is
//! lost breaks the replica: every later job fails at once with why, and the run stops
//! with its resume hint rather than hanging.

use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

use yatt_engine::{EngineError, Llama, LocalGroup, RankState, ShardedTrainer};
use yatt_runtime::ActorRef;

use super::config::PolicyConfig;
use super::rank::{rank_score, RankRequest, RankResponse};
use crate::role::{RoleError, RoleRequest, RoleResponse};
use crate::sample::Sample;

/// A rank actor on another node.
pub type RankRef = ActorRef<RoleRequest<RankRequest>, RoleResponse<RankResponse>>;

/// The ranks of a replica after the local ones, on other nodes: `refs[i]` is rank
/// `first + i`.
pub struct RemoteRanks {
    refs: Vec<RankRef>,
    first: usize,
    /// The node's runtime, which carries the asks (the role's thread blocks on them).
    runtime: tokio::runtime::Handle,
}

impl RemoteRanks {
    /// `refs[i]` is rank `first + i`; `runtime` is the node's (asked from the role's
    /// own thread, never from within it).
    pub fn new(refs: Vec<RankRef>, first: usize, runtime: tokio::runtime::Handle) -> Self {
        RemoteRanks {
            refs,
            first,
            runtime,
        }
    }
}

type Asked = tokio::task::JoinHandle<Result<RankResponse, String>>;

type Job = Box<dyn FnOnce(&mut ShardedTrainer) + Send>;

/// What a rank thread is sent: a job on its trainer, or the end of the thread with its
/// trainer's state handed back (to be resharded).
enum Work {
    Job(Job),
    HandOver(SyncSender<Result<RankState, String>>),
}

/// A sharded replica's rank threads.
pub(crate) struct Ranks {
    /// The role the ranks are of (`policy`, `reference`, `critic`), for messages.
    role: &'static str,
    senders: Vec<SyncSender<Work>>,
    remote: Option<RemoteRanks>,
    /// How long a job may take on every rank.
    deadline: Duration,
    /// Set when a rank failed to answer: the replica's state is then unknown.
    broken: Option<String>,
}

/// How a replica's ranks meet: the deadline of each collective between them.
pub(crate) fn groups(shards: usize, collective: Duration) -> Vec<LocalGroup> {
    LocalGroup::new(shards, collective)
}

/// `model` sharded over `shards` rank threads' groups (each collective bounded by
/// `collective`) by `shard`: the last rank
/// shards the model itself, the others a copy each, all made here before any rank
/// thread runs (so every rank starts from the same weights).
pub(crate) fn shard_copies(
    model: Llama,
    (shards, collective): (usize, Duration),
    what: &str,
    shard: impl Fn(Llama, LocalGroup) -> Result<ShardedTrainer, EngineError>,
) -> Result<Vec<ShardedTrainer>, RoleError> {
    let (device, kind) = (model.device(), model.kind());
    let failed = |doing: &str, e: EngineError| RoleError::Failed(format!("{doing} {what}: {e}"));
    let mut trainers = Vec::with_capacity(shards);
    let mut whole = Some(model);
    for (rank, group) in groups(shards, collective).into_iter().enumerate() {
        let last = whole.as_ref().expect("the model until the last rank");
        let m = match rank + 1 == shards {
            true => whole.take().expect("the model until the last rank"),
            false => last
                .deep_copy(device, kind)
                .map_err(|e| failed("copying for a shard", e))?,
        };
        trainers.push(shard(m, group).map_err(|e| failed("sharding", e))?);
    }
    Ok(trainers)
}

impl Ranks {
    /// Starts one thread per trainer (rank order), each job bounded by `deadline`.
    pub(crate) fn start(
        role: &'static str,
        trainers: Vec<ShardedTrainer>,
        deadline: Duration,
    ) -> Result<Self, RoleError> {
        let mut senders = Vec::with_capacity(trainers.len());
        for (rank, mut trainer) in trainers.into_iter().enumerate() {
            // One job queued at most: the role sends one per request and waits for it.
            let (tx, rx) = sync_channel::<Work>(1);
            std::thread::Builder::new()
                .name(format!("{role}-shard-{rank}"))
                .spawn(move || {
                    // A panic ends the thread and drops its group: the other ranks'
                    // collectives fail at once instead of at their deadline.
                    for work in rx {
                        match work {
                            Work::Job(job) => job(&mut trainer),
                            Work::HandOver(back) => {
                                let _ =
                                    back.send(trainer.into_rank_state().map_err(|e| e.to_string()));
                                break;
                            }
                        }
                    }
                })
                .map_err(|e| RoleError::Failed(format!("starting {role} shard {rank}: {e}")))?;
            senders.push(tx);
        }
        Ok(Ranks {
            role,
            senders,
            remote: None,
            deadline,
            broken: None,
        })
    }

    /// Adds the ranks on other nodes (after the local ones).
    pub(crate) fn with_remote(mut self, remote: RemoteRanks) -> Self {
        assert_eq!(
            remote.first,
            self.senders.len(),
            "remote ranks follow the local"
        );
        self.remote = Some(remote);
        self
    }

    /// Ranks of the replica.
    pub(crate) fn len(&self) -> usize {
        self.senders.len() + self.remote.as_ref().map_or(0, |r| r.refs.len())
    }

    /// Ranks in this process (the first ones).
    pub(crate) fn local(&self) -> usize {
        self.senders.len()
    }

    /// Runs `jobs[r]` on local rank `r` and `remote(r)` on each remote rank `r`, all at
    /// once; returns the local answers in rank order, then the remote ones.
    pub(crate) fn run_all<T, F>(
        &mut self,
        what: &str,
        jobs: Vec<F>,
        remote: impl Fn(usize) -> RankRequest,
    ) -> Result<(Vec<T>, Vec<RankResponse>), RoleError>
    where
        T: Send + 'static,
        F: FnOnce(&mut ShardedTrainer) -> T + Send + 'static,
    {
        if let Some(why) = &self.broken {
            return Err(RoleError::Failed(why.clone()));
        }
        let asked = self.ask_remote(&remote);
        let local = self.run(what, jobs);
        let answers = self.wait_remote(what, asked);
        let local = local?;
        Ok((local, answers?))
    }

    fn ask_remote(&self, request: &impl Fn(usize) -> RankRequest) -> Vec<Asked> {
        let Some(r) = &self.remote else {
            return Vec::new();
        };
        let deadline = self.deadline;
        r.refs
            .iter()
            .enumerate()
            .map(|(i, rank)| {
                let (rank, ask) = (rank.clone(), request(r.first + i));
                r.runtime.spawn(async move {
                    match rank.ask(RoleRequest::Serve(ask), deadline).await {
                        Ok(RoleResponse::Served(a)) => Ok(a),
                        Ok(_) => Err(format!("{} answered something else", rank.id())),
                        Err(e) => Err(e.to_string()),
                    }
                })
            })
            .collect()
    }

    fn wait_remote(
        &mut self,
        what: &str,
        asked: Vec<Asked>,
    ) -> Result<Vec<RankResponse>, RoleError> {
        let Some(r) = &self.remote else {
            return Ok(Vec::new());
        };
        let (first, runtime) = (r.first, r.runtime.clone());
        let mut out = Vec::with_capacity(asked.len());
        let mut failed = Vec::new();
        for (i, a) in asked.into_iter().enumerate() {
            match runtime.block_on(a) {
                Ok(Ok(answer)) => out.push(answer),
                Ok(Err(e)) => failed.push(format!("rank {}: {e}", first + i)),
                Err(e) => failed.push(format!("rank {}: {e}", first + i)),
            }
        }
        if failed.is_empty() {
            return Ok(out);
        }
        Err(self.break_with(format!(
            "{} shard(s) on other nodes failed in {what}: {}",
            self.role,
            failed.join("; ")
        )))
    }

    /// Runs `jobs[r]` on rank `r`, all at once, and returns their answers in rank order.
    pub(crate) fn run<T, F>(&mut self, what: &str, jobs: Vec<F>) -> Result<Vec<T>, RoleError>
    where
        T: Send + 'static,
        F: FnOnce(&mut ShardedTrainer) -> T + Send + 'static,
    {
        if let Some(why) = &self.broken {
            return Err(RoleError::Failed(why.clone()));
        }
        let n = self.senders.len();
        assert_eq!(jobs.len(), n, "one job per local rank");
        let (tx, rx) = sync_channel::<(usize, T)>(n);
        for (rank, (job, s)) in jobs.into_iter().zip(&self.senders).enumerate() {
            let tx = tx.clone();
            let job: Job = Box::new(move |tr: &mut ShardedTrainer| {
                let _ = tx.send((rank, job(tr)));
            });
            if s.send(Work::Job(job)).is_err() {
                return Err(self.break_with(format!("{} shard {rank} has stopped", self.role)));
            }
        }
        drop(tx);
        let until = Instant::now() + self.deadline;
        let mut out: Vec<Option<T>> = (0..n).map(|_| None).collect();
        for _ in 0..n {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok((rank, v)) => out[rank] = Some(v),
                Err(e) => {
                    let missing: Vec<usize> = (0..n).filter(|&r| out[r].is_none()).collect();
                    let how = match e {
                        RecvTimeoutError::Timeout => {
                            format!("did not finish within {:?}", self.deadline)
                        }
                        RecvTimeoutError::Disconnected => "stopped (panicked)".into(),
                    };
                    return Err(self.break_with(format!(
                        "{} shard(s) {missing:?} {how} in {what}",
                        self.role
                    )));
                }
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Every rank's part of a collective request, in rank order: the local ranks'
    /// results, then the remote ranks' answers of the kind `pick` takes. A failed
    /// rank or an answer of another kind breaks the replica (the ranks may have stopped
    /// at different points of the request).
    pub(crate) fn parts<T>(
        &mut self,
        what: &str,
        local: Vec<Result<T, String>>,
        remote: Vec<RankResponse>,
        pick: impl Fn(RankResponse) -> Result<T, RankResponse>,
    ) -> Result<Vec<T>, RoleError> {
        let mut out = Vec::with_capacity(local.len() + remote.len());
        for a in local {
            match a {
                Ok(part) => out.push(part),
                Err(e) => return Err(self.break_with(format!("{what}: {e}"))),
            }
        }
        for a in remote {
            match pick(a) {
                Ok(part) => out.push(part),
                Err(other) => {
                    return Err(self.break_with(format!("{what}: a rank answered {other:?}")))
                }
            }
        }
        Ok(out)
    }

    /// Every rank scores its part of `samples` (the response tokens' log-probs, unit by
    /// unit, without gradients: no process holds the whole model). Returns the samples
    /// and their rows, in order.
    pub(super) fn score_all(
        &mut self,
        cfg: &PolicyConfig,
        samples: Vec<Sample>,
        what: &str,
    ) -> Result<(Vec<Sample>, Vec<Vec<f32>>), RoleError> {
        let n = self.len();
        let all = std::sync::Arc::new(samples);
        let jobs = (0..self.local())
            .map(|rank| {
                let (cfg, all) = (cfg.clone(), all.clone());
                move |tr: &mut ShardedTrainer| rank_score(tr, &cfg, &all, rank, n)
            })
            .collect();
        let score = |rank| RankRequest::Score {
            samples: all.to_vec(),
            rank,
            shards: n,
        };
        let (local, remote) = self.run_all(what, jobs, score)?;
        let parts = self.parts(what, local, remote, |a| match a {
            RankResponse::Scored(r) => Ok(r),
            other => Err(other),
        })?;
        let rows: Vec<Vec<f32>> = parts.into_iter().flatten().collect();
        let samples = std::sync::Arc::try_unwrap(all).unwrap_or_else(|a| a.to_vec());
        if rows.len() != samples.len() {
            return Err(self.break_with(format!(
                "{what}: the ranks scored {} of {} samples",
                rows.len(),
                samples.len()
            )));
        }
        Ok((samples, rows))
    }

    /// Ends every local rank's thread and returns their training states, in rank order,
    /// for a new replica of another rank count. Only for replicas wholly in this
    /// process, between requests.
    pub(super) fn hand_over(&mut self) -> Result<Vec<RankState>, RoleError> {
        if let Some(why) = &self.broken {
            return Err(RoleError::Failed(why.clone()));
        }
        if self.remote.is_some() {
            return Err(RoleError::BadRequest(
                "a sharded policy with ranks on other nodes is not resharded in place: resume it with another job.policy_shards".into(),
            ));
        }
        let mut answers = Vec::with_capacity(self.senders.len());
        for (rank, s) in std::mem::take(&mut self.senders).into_iter().enumerate() {
            let (tx, rx) = sync_channel(1);
            if s.send(Work::HandOver(tx)).is_err() {
                return Err(self.break_with(format!("{} shard {rank} has stopped", self.role)));
            }
            answers.push(rx);
        }
        let until = Instant::now() + self.deadline;
        let mut states = Vec::with_capacity(answers.len());
        for (rank, rx) in answers.into_iter().enumerate() {
            match rx.recv_timeout(until.saturating_duration_since(Instant::now())) {
                Ok(Ok(state)) => states.push(state),
                Ok(Err(e)) => {
                    return Err(
                        self.break_with(format!("{} shard {rank} kept its state: {e}", self.role))
                    )
                }
                Err(_) => {
                    return Err(self.break_with(format!(
                        "{} shard {rank} did not hand its state over within {:?}",
                        self.role, self.deadline
                    )))
                }
            }
        }
        Ok(states)
    }

    /// Stops the ranks on other nodes (best effort, briefly: a lost one is gone).
    pub(crate) fn stop_remote(&mut self) {
        let Some(r) = self.remote.take() else {
            return;
        };
        let stops = r
            .refs
            .iter()
            .map(|rank| rank.ask(RoleRequest::Stop, Duration::from_secs(10)));
        r.runtime.block_on(futures::future::join_all(stops));
    }

    /// Marks the replica broken (its ranks' states may differ) and says why.
    pub(crate) fn break_with(&mut self, why: String) -> RoleError {
        let why = format!(
            "{why}; the sharded {}'s state is no longer known: resume from the last checkpoint (`yatt train CONFIG --resume RUN_DIR`)",
            self.role
        );
        self.broken = Some(why.clone());
        RoleError::Failed(why)
    }
}
