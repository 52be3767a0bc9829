//! The ranks of a sharded policy replica in one process: each a thread that owns a
//! [`ShardedTrainer`] over its [`LocalGroup`] handle and runs the jobs it is sent, in
//! order, from a bounded channel. Every job is sent to every rank at once (they are
//! collectives) and answered within a deadline; a rank that misses it, or whose thread
//! ends, breaks the replica: every later job fails at once with why, and the run stops
//! with its resume hint rather than hanging.

use std::sync::mpsc::{sync_channel, RecvTimeoutError, SyncSender};
use std::time::{Duration, Instant};

use yatt_engine::{LocalGroup, ShardedTrainer};

use crate::role::RoleError;

type Job = Box<dyn FnOnce(&mut ShardedTrainer) + Send>;

/// A sharded replica's rank threads.
pub(super) struct Ranks {
    senders: Vec<SyncSender<Job>>,
    /// How long a job may take on every rank.
    deadline: Duration,
    /// Set when a rank failed to answer: the replica's state is then unknown.
    broken: Option<String>,
}

/// How a replica's ranks meet: the deadline of each collective between them.
pub(super) fn groups(shards: usize, collective: Duration) -> Vec<LocalGroup> {
    LocalGroup::new(shards, collective)
}

impl Ranks {
    /// Starts one thread per trainer (rank order), each job bounded by `deadline`.
    pub(super) fn start(
        trainers: Vec<ShardedTrainer>,
        deadline: Duration,
    ) -> Result<Self, RoleError> {
        let mut senders = Vec::with_capacity(trainers.len());
        for (rank, mut trainer) in trainers.into_iter().enumerate() {
            // One job queued at most: the role sends one per request and waits for it.
            let (tx, rx) = sync_channel::<Job>(1);
            std::thread::Builder::new()
                .name(format!("policy-shard-{rank}"))
                .spawn(move || {
                    // A panic ends the thread and drops its group: the other ranks'
                    // collectives fail at once instead of at their deadline.
                    for job in rx {
                        job(&mut trainer);
                    }
                })
                .map_err(|e| RoleError::Failed(format!("starting policy shard {rank}: {e}")))?;
            senders.push(tx);
        }
        Ok(Ranks {
            senders,
            deadline,
            broken: None,
        })
    }

    /// Ranks of the replica.
    pub(super) fn len(&self) -> usize {
        self.senders.len()
    }

    /// Runs `jobs[r]` on rank `r`, all at once, and returns their answers in rank order.
    pub(super) fn run<T, F>(&mut self, what: &str, jobs: Vec<F>) -> Result<Vec<T>, RoleError>
    where
        T: Send + 'static,
        F: FnOnce(&mut ShardedTrainer) -> T + Send + 'static,
    {
        if let Some(why) = &self.broken {
            return Err(RoleError::Failed(why.clone()));
        }
        let n = self.senders.len();
        assert_eq!(jobs.len(), n, "one job per rank");
        let (tx, rx) = sync_channel::<(usize, T)>(n);
        for (rank, (job, s)) in jobs.into_iter().zip(&self.senders).enumerate() {
            let tx = tx.clone();
            let job: Job = Box::new(move |tr: &mut ShardedTrainer| {
                let _ = tx.send((rank, job(tr)));
            });
            if s.send(job).is_err() {
                return Err(self.break_with(format!("policy shard {rank} has stopped")));
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
                    return Err(
                        self.break_with(format!("policy shard(s) {missing:?} {how} in {what}"))
                    );
                }
            }
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Marks the replica broken (its ranks' states may differ) and says why.
    pub(super) fn break_with(&mut self, why: String) -> RoleError {
        let why = format!(
            "{why}; the sharded policy's state is no longer known: resume from the last checkpoint (`yatt train CONFIG --resume RUN_DIR`)"
        );
        self.broken = Some(why.clone());
        RoleError::Failed(why)
    }
}
