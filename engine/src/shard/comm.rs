//! A rank's collectives on a thread of their own, so that a unit's all-gather (or the
//! previous unit's reduce-scatter) runs while the compute thread runs another unit.
//!
//! The thread owns the rank's [`ShardGroup`] and runs what it is handed strictly in the
//! order it was handed: every rank submits the same collectives in the same order, so
//! the rounds still agree and each result is the one the call would give inline, bit
//! for bit. Waits cannot hang: the group's own deadline bounds every call on the
//! thread, and if the thread ends (a panic) every wait on it fails at once.

use super::group::{ReduceOp, ShardGroup};
use crate::error::{EngineError, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;
use tch::Tensor;

enum Op {
    Gather(Tensor),
    ReduceScatter(Tensor),
    AllReduce(Vec<f64>, ReduceOp),
}

impl Op {
    fn name(&self) -> &'static str {
        match self {
            Op::Gather(_) => "all-gather",
            Op::ReduceScatter(_) => "reduce-scatter",
            Op::AllReduce(..) => "all-reduce",
        }
    }
}

enum Output {
    Tensor(Tensor),
    Values(Vec<f64>),
}

struct Job {
    op: Op,
    reply: Sender<Done>,
}

/// A collective's result and when the thread ran it.
struct Done {
    output: Result<Output>,
    started: Instant,
    ended: Instant,
}

/// The communication thread of one rank: submit collectives, wait on their handles.
pub(crate) struct CommThread {
    rank: usize,
    world: usize,
    jobs: Option<Sender<Job>>,
    /// Set when the trainer is dropped: the thread skips what is still queued and drops
    /// the group at once, so the other ranks learn that this one left.
    closing: Arc<AtomicBool>,
}

/// A collective submitted and not yet waited on.
pub(crate) struct Pending {
    op: &'static str,
    rank: usize,
    reply: Receiver<Done>,
    submitted: Instant,
}

/// Since when the compute thread has had nothing to do but wait for a collective.
pub(crate) enum WaitingSince {
    /// Its submission: it was submitted to be waited on at once. Counting from the
    /// wait's own start instead would miss the time the thread lost to the
    /// communication thread it had just woken (on a busy machine, the whole call).
    Submission,
    /// Now: the compute thread did other work since submitting it.
    Now,
}

/// A finished tensor collective: its result, the seconds the communication thread
/// spent in it, and the part of those the compute thread spent waiting for it.
pub(crate) struct Finished {
    pub(crate) tensor: Tensor,
    pub(crate) busy_s: f64,
    pub(crate) exposed_s: f64,
}

impl CommThread {
    /// Moves `group` onto a new thread.
    pub(crate) fn start(group: Box<dyn ShardGroup>) -> Result<Self> {
        let (rank, world) = (group.rank(), group.world());
        let (jobs, queue) = channel();
        let closing = Arc::new(AtomicBool::new(false));
        let stop = closing.clone();
        std::thread::Builder::new()
            .name(format!("shard-comm-{rank}"))
            .spawn(move || serve(group, queue, stop))
            .map_err(|e| EngineError::Collective {
                op: "start",
                rank,
                msg: format!("could not start the communication thread: {e}"),
            })?;
        Ok(CommThread {
            rank,
            world,
            jobs: Some(jobs),
            closing,
        })
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }

    pub(crate) fn world(&self) -> usize {
        self.world
    }

    fn submit(&self, op: Op) -> Result<Pending> {
        let name = op.name();
        let (reply, answer) = channel();
        // Taken before the send: the thread it wakes may start the call at once.
        let submitted = Instant::now();
        let sent = self.jobs.as_ref().map(|j| j.send(Job { op, reply }));
        match sent {
            Some(Ok(())) => Ok(Pending {
                op: name,
                rank: self.rank,
                reply: answer,
                submitted,
            }),
            _ => Err(thread_gone(name, self.rank)),
        }
    }

    /// Starts an all-gather of `shard` (see [`ShardGroup::all_gather`]).
    pub(crate) fn submit_gather(&self, shard: Tensor) -> Result<Pending> {
        self.submit(Op::Gather(shard))
    }

    /// Starts a reduce-scatter of `full` (see [`ShardGroup::reduce_scatter`]).
    pub(crate) fn submit_reduce_scatter(&self, full: Tensor) -> Result<Pending> {
        self.submit(Op::ReduceScatter(full))
    }

    /// [`ShardGroup::all_gather`], waited on at once.
    pub(crate) fn all_gather(&self, shard: &Tensor) -> Result<Tensor> {
        let pending = self.submit_gather(shard.shallow_clone())?;
        Ok(pending.wait(WaitingSince::Submission)?.tensor)
    }

    /// [`ShardGroup::all_reduce`], waited on at once.
    pub(crate) fn all_reduce(&self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        let pending = self.submit(Op::AllReduce(values.to_vec(), op))?;
        match pending.receive(WaitingSince::Submission)?.0 {
            Output::Values(v) => {
                values.copy_from_slice(&v);
                Ok(())
            }
            Output::Tensor(_) => unreachable!("an all-reduce answers values"),
        }
    }
}

impl Drop for CommThread {
    fn drop(&mut self) {
        self.closing.store(true, Ordering::Release);
        // The thread sees the queue close once it is done with the call it is in; it is
        // not joined, so dropping a trainer never waits for a peer's deadline.
        self.jobs.take();
    }
}

impl Pending {
    /// Blocks until the collective is done: its output, its run's seconds and the
    /// part of those the compute thread spent waiting.
    fn receive(self, since: WaitingSince) -> Result<(Output, f64, f64)> {
        let waited_from = match since {
            WaitingSince::Submission => self.submitted,
            WaitingSince::Now => Instant::now(),
        };
        let done = self
            .reply
            .recv()
            .map_err(|_| thread_gone(self.op, self.rank))?;
        let waited_to = Instant::now();
        let busy = done.ended.duration_since(done.started).as_secs_f64();
        let from = waited_from.max(done.started);
        let to = waited_to.min(done.ended);
        let exposed = to.saturating_duration_since(from).as_secs_f64();
        Ok((done.output?, busy, exposed))
    }

    /// Blocks until the tensor collective is done.
    pub(crate) fn wait(self, since: WaitingSince) -> Result<Finished> {
        let (output, busy_s, exposed_s) = self.receive(since)?;
        match output {
            Output::Tensor(tensor) => Ok(Finished {
                tensor,
                busy_s,
                exposed_s,
            }),
            Output::Values(_) => unreachable!("a tensor collective answers a tensor"),
        }
    }
}

fn thread_gone(op: &'static str, rank: usize) -> EngineError {
    EngineError::Collective {
        op,
        rank,
        msg: "the communication thread ended without an answer (it panicked)".into(),
    }
}

/// The communication thread's loop: each job in turn, until the queue closes.
fn serve(mut group: Box<dyn ShardGroup>, queue: Receiver<Job>, closing: Arc<AtomicBool>) {
    // After a failure every later call fails at once with it: a rank that has failed
    // must not sit out another deadline on calls its peers will never match.
    let mut failed: Option<String> = None;
    while let Ok(Job { op, reply }) = queue.recv() {
        if closing.load(Ordering::Acquire) {
            break;
        }
        let started = Instant::now();
        let name = op.name();
        let output = match &failed {
            Some(why) => Err(EngineError::Collective {
                op: name,
                rank: group.rank(),
                msg: format!("an earlier collective failed: {why}"),
            }),
            None => tch::no_grad(|| run(&mut *group, op)),
        };
        if let Err(e) = &output {
            failed.get_or_insert_with(|| e.to_string());
        }
        let ended = Instant::now();
        // The compute thread may have given up on the answer (its step failed).
        let _ = reply.send(Done {
            output,
            started,
            ended,
        });
    }
    // Dropping the group here tells the other ranks this one left.
    drop(group);
}

fn run(group: &mut dyn ShardGroup, op: Op) -> Result<Output> {
    Ok(match op {
        Op::Gather(shard) => Output::Tensor(group.all_gather(&shard)?),
        Op::ReduceScatter(full) => Output::Tensor(group.reduce_scatter(full)?),
        Op::AllReduce(mut values, reduce) => {
            group.all_reduce(&mut values, reduce)?;
            Output::Values(values)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;
    use tch::{Device, Kind};

    /// A group whose gathers panic and whose reduce-scatters fail.
    struct Faulty;

    impl ShardGroup for Faulty {
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            2
        }
        fn all_gather(&mut self, _: &Tensor) -> Result<Tensor> {
            panic!("a bug in the transport");
        }
        fn reduce_scatter(&mut self, _: Tensor) -> Result<Tensor> {
            std::thread::sleep(Duration::from_millis(800));
            Err(EngineError::Collective {
                op: "reduce-scatter",
                rank: 0,
                msg: "the peer is gone".into(),
            })
        }
        fn all_reduce(&mut self, _: &mut [f64], _: ReduceOp) -> Result<()> {
            Ok(())
        }
    }

    fn zeros() -> Tensor {
        Tensor::zeros([4], (Kind::Float, Device::Cpu))
    }

    #[test]
    fn a_failed_collective_fails_those_queued_behind_it_at_once() {
        let comm = CommThread::start(Box::new(Faulty)).unwrap();
        let first = comm.submit_reduce_scatter(zeros()).unwrap();
        let second = comm.submit_reduce_scatter(zeros()).unwrap();
        let e = first
            .wait(WaitingSince::Submission)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("the peer is gone"), "{e}");
        let t0 = Instant::now();
        let e = second.wait(WaitingSince::Now).err().unwrap().to_string();
        assert!(e.contains("an earlier collective failed"), "{e}");
        assert!(e.contains("the peer is gone"), "{e}");
        assert!(
            t0.elapsed() < Duration::from_millis(600),
            "it ran the call again"
        );
    }

    #[test]
    fn a_wait_on_a_dead_communication_thread_fails_at_once() {
        let comm = CommThread::start(Box::new(Faulty)).unwrap();
        let gather = comm.submit_gather(zeros()).unwrap();
        let e = gather.wait(WaitingSince::Now).err().unwrap().to_string();
        assert!(e.contains("communication thread ended"), "{e}");
        // The thread is gone: later calls fail too, instead of waiting for it.
        let mut v = [1.0];
        let later = comm.all_reduce(&mut v, ReduceOp::Sum);
        assert!(later.is_err());
    }
}
