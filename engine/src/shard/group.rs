//! The collectives a sharded replica's ranks run together, and the in-process group
//! (ranks as threads of one process: embedded mode and the tests) that runs them
//! through shared memory. Every call has a deadline; a rank that leaves (its group is
//! dropped, say because its step failed) fails the others' calls at once instead of
//! leaving them waiting.

use crate::error::{EngineError, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use tch::{Kind, Tensor};

/// How [`ShardGroup::all_reduce`] combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise maximum.
    Max,
}

/// What a sharded trainer needs from the ranks of its replica. Every rank calls the
/// same operations in the same order with the same sizes.
pub trait ShardGroup: Send {
    /// This rank, `0..world`.
    fn rank(&self) -> usize;
    /// Ranks in the replica.
    fn world(&self) -> usize;
    /// Every rank's `shard` (1-D, the same length on all), concatenated in rank order.
    fn all_gather(&mut self, shard: &Tensor) -> Result<Tensor>;
    /// The sum over ranks of `full` (1-D, `world × s` long), and of that sum this
    /// rank's `s`-long slice. `full` is consumed: the group may use its memory.
    fn reduce_scatter(&mut self, full: Tensor) -> Result<Tensor>;
    /// Combines small vectors (norms, counts) element-wise over the ranks, in place.
    fn all_reduce(&mut self, values: &mut [f64], op: ReduceOp) -> Result<()>;
}

/// What one rank put on the board for a round.
enum Deposit {
    Tensor(Tensor),
    Values(Vec<f64>, ReduceOp),
}

/// The deposits of a full round, read by every rank at once. libtorch tensors are safe
/// to read from several threads; nothing here writes to them.
struct Round(Vec<Deposit>);
// SAFETY: the tensors in a round are only read (narrowed, added, concatenated into new
// tensors) after the round is complete, never modified, until the round is dropped.
unsafe impl Sync for Round {}

#[derive(Default)]
struct Board {
    /// Deposits of the round being collected, by rank.
    deposits: Vec<Option<(&'static str, Deposit)>>,
    arrived: usize,
    /// The complete round while the ranks read it, and how many have.
    complete: Option<Arc<Round>>,
    taken: usize,
    /// Set when a rank leaves or fails a round: every later call fails with it.
    broken: Option<String>,
}

struct Shared {
    world: usize,
    board: Mutex<Board>,
    changed: Condvar,
    deadline: Duration,
}

/// A replica's ranks as threads of one process, exchanging through shared memory
/// ([`LocalGroup::new`] makes one handle per rank).
pub struct LocalGroup {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalGroup {
    /// One handle per rank of a `world`-rank group whose every call fails after
    /// `deadline` without the other ranks.
    pub fn new(world: usize, deadline: Duration) -> Vec<LocalGroup> {
        let shared = Arc::new(Shared {
            world,
            board: Mutex::new(Board {
                deposits: (0..world).map(|_| None).collect(),
                ..Board::default()
            }),
            changed: Condvar::new(),
            deadline,
        });
        (0..world)
            .map(|rank| LocalGroup {
                rank,
                shared: shared.clone(),
            })
            .collect()
    }

    fn fail(&self, op: &'static str, msg: String) -> EngineError {
        EngineError::Collective {
            op,
            rank: self.rank,
            msg,
        }
    }

    /// Deposits this rank's part of a round and returns the complete round.
    fn exchange(&self, op: &'static str, deposit: Deposit) -> Result<Arc<Round>> {
        let sh = &*self.shared;
        let until = Instant::now() + sh.deadline;
        let mut b = sh.board.lock().unwrap_or_else(|p| p.into_inner());
        // The previous round may still be being read: wait for it to clear.
        while b.complete.is_some() || b.deposits[self.rank].is_some() {
            if let Some(why) = &b.broken {
                return Err(self.fail(op, why.clone()));
            }
            b = self.wait(b, until, op, "for the previous round to finish")?;
        }
        if let Some(why) = &b.broken {
            return Err(self.fail(op, why.clone()));
        }
        b.deposits[self.rank] = Some((op, deposit));
        b.arrived += 1;
        if b.arrived == sh.world {
            let mut round = Vec::with_capacity(sh.world);
            let mut mismatch = None;
            for (r, d) in b.deposits.iter_mut().enumerate() {
                let (their_op, d) = d.take().expect("every rank deposited");
                if their_op != op {
                    mismatch = Some(format!(
                        "rank {r} called {their_op} while rank {} called {op}: the ranks \
                         ran different steps (a bug, or ranks given different micro-batch \
                         counts)",
                        self.rank
                    ));
                }
                round.push(d);
            }
            b.arrived = 0;
            if let Some(m) = mismatch {
                b.broken = Some(m.clone());
                sh.changed.notify_all();
                return Err(self.fail(op, m));
            }
            b.complete = Some(Arc::new(Round(round)));
            b.taken = 0;
            sh.changed.notify_all();
        }
        loop {
            if let Some(round) = &b.complete {
                let round = round.clone();
                b.taken += 1;
                if b.taken == sh.world {
                    b.complete = None;
                    sh.changed.notify_all();
                }
                return Ok(round);
            }
            if let Some(why) = &b.broken {
                return Err(self.fail(op, why.clone()));
            }
            b = self.wait(b, until, op, "for the other ranks")?;
        }
    }

    fn wait<'a>(
        &self,
        b: std::sync::MutexGuard<'a, Board>,
        until: Instant,
        op: &'static str,
        what: &str,
    ) -> Result<std::sync::MutexGuard<'a, Board>> {
        let now = Instant::now();
        if now >= until {
            let missing: Vec<usize> = (0..self.shared.world)
                .filter(|&r| b.deposits[r].is_none())
                .collect();
            let msg = format!(
                "waited {:?} {what}; ranks {missing:?} had not arrived (raise \
                 timeouts.collective_s if a unit's compute takes longer)",
                self.shared.deadline
            );
            drop(b);
            self.break_group(&msg);
            return Err(self.fail(op, msg));
        }
        let (b, _) = self
            .shared
            .changed
            .wait_timeout(b, until - now)
            .unwrap_or_else(|p| p.into_inner());
        Ok(b)
    }

    fn break_group(&self, why: &str) {
        let mut b = self.shared.board.lock().unwrap_or_else(|p| p.into_inner());
        if b.broken.is_none() {
            b.broken = Some(why.to_string());
        }
        self.shared.changed.notify_all();
    }
}

impl Drop for LocalGroup {
    fn drop(&mut self) {
        // Ranks still running would otherwise wait for this one until their deadline.
        self.break_group(&format!("rank {} left the group", self.rank));
    }
}

impl ShardGroup for LocalGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.shared.world
    }

    fn all_gather(&mut self, shard: &Tensor) -> Result<Tensor> {
        const OP: &str = "all-gather";
        let round = self.exchange(OP, Deposit::Tensor(shard.detach()))?;
        let parts = tensors(&round, shard.size()[0], OP).map_err(|m| self.fail(OP, m))?;
        Ok(Tensor::cat(&parts, 0))
    }

    fn reduce_scatter(&mut self, full: Tensor) -> Result<Tensor> {
        const OP: &str = "reduce-scatter";
        let n = full.size()[0];
        let world = self.shared.world as i64;
        if n % world != 0 {
            return Err(self.fail(OP, format!("{n} elements do not split over {world} ranks")));
        }
        let kind = full.kind();
        let round = self.exchange(OP, Deposit::Tensor(full))?;
        let parts = tensors(&round, n, OP).map_err(|m| self.fail(OP, m))?;
        let s = n / world;
        let at = self.rank as i64 * s;
        // Summed in rank order on every rank: the same bits whichever rank computes.
        let mut acc = parts[0].narrow(0, at, s).to_kind(Kind::Float);
        for p in &parts[1..] {
            acc += p.narrow(0, at, s);
        }
        Ok(acc.to_kind(kind))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: ReduceOp) -> Result<()> {
        const OP: &str = "all-reduce";
        let round = self.exchange(OP, Deposit::Values(values.to_vec(), op))?;
        for (r, d) in round.0.iter().enumerate() {
            match d {
                Deposit::Values(v, o) if v.len() == values.len() && *o == op => {
                    if r == 0 {
                        values.copy_from_slice(v);
                        continue;
                    }
                    for (x, y) in values.iter_mut().zip(v) {
                        *x = match op {
                            ReduceOp::Sum => *x + y,
                            ReduceOp::Max => x.max(*y),
                        };
                    }
                }
                _ => {
                    return Err(self.fail(
                        OP,
                        format!("rank {r} reduced something else (a different length or op)"),
                    ))
                }
            }
        }
        Ok(())
    }
}

/// The round's tensors, all of length `n`.
fn tensors(round: &Round, n: i64, op: &str) -> std::result::Result<Vec<Tensor>, String> {
    round
        .0
        .iter()
        .enumerate()
        .map(|(r, d)| match d {
            Deposit::Tensor(t) if t.size()[0] == n => Ok(t.shallow_clone()),
            Deposit::Tensor(t) => Err(format!(
                "rank {r} gave {} elements to the {op}, this rank {n}",
                t.size()[0]
            )),
            Deposit::Values(..) => Err(format!("rank {r} gave values to the {op}")),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;

    fn run<T: Send + 'static>(
        world: usize,
        deadline: Duration,
        f: impl Fn(LocalGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let f = Arc::new(f);
        let handles: Vec<_> = LocalGroup::new(world, deadline)
            .into_iter()
            .map(|g| {
                let f = f.clone();
                std::thread::spawn(move || f(g))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn gather_and_reduce_scatter_agree_with_the_definitions() {
        let out = run(3, Duration::from_secs(20), |mut g| {
            let r = g.rank() as f64;
            let shard = Tensor::full([2], r, (Kind::Float, Device::Cpu));
            let all = g.all_gather(&shard).unwrap();
            let full = Tensor::arange(6, (Kind::Float, Device::Cpu)) * (r + 1.0);
            let mine = g.reduce_scatter(full).unwrap();
            let mut v = [r, 10.0 - r];
            g.all_reduce(&mut v, ReduceOp::Max).unwrap();
            (
                Vec::<f32>::try_from(&all).unwrap(),
                Vec::<f32>::try_from(&mine).unwrap(),
                v,
            )
        });
        for (rank, (all, mine, v)) in out.into_iter().enumerate() {
            assert_eq!(all, [0., 0., 1., 1., 2., 2.]);
            // Σ_r (r+1)·i = 6·i over i in this rank's two elements.
            let i = 2.0 * rank as f32;
            assert_eq!(mine, [6. * i, 6. * (i + 1.)]);
            assert_eq!(v, [2.0, 10.0]);
        }
    }

    #[test]
    fn a_rank_that_leaves_fails_the_others_at_once() {
        let t0 = Instant::now();
        let out = run(2, Duration::from_secs(60), |mut g| {
            if g.rank() == 1 {
                return None; // leaves: its handle drops
            }
            let shard = Tensor::zeros([4], (Kind::Float, Device::Cpu));
            Some(g.all_gather(&shard).unwrap_err().to_string())
        });
        let msg = out[0].clone().unwrap();
        assert!(msg.contains("rank 1 left the group"), "{msg}");
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "it waited for the deadline"
        );
    }

    #[test]
    fn a_rank_that_never_comes_fails_the_call_by_the_deadline() {
        let groups = LocalGroup::new(2, Duration::from_millis(300));
        let mut it = groups.into_iter();
        let mut g0 = it.next().unwrap();
        let _g1 = it.next().unwrap(); // alive, never calls
        let t0 = Instant::now();
        let err = g0
            .all_gather(&Tensor::zeros([1], (Kind::Float, Device::Cpu)))
            .unwrap_err()
            .to_string();
        assert!(err.contains("ranks [1] had not arrived"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn ranks_that_disagree_on_the_operation_fail_with_both_named() {
        let out = run(2, Duration::from_secs(20), |mut g| {
            let t = Tensor::zeros([2], (Kind::Float, Device::Cpu));
            let r = match g.rank() {
                0 => g.all_gather(&t).map(|_| ()),
                _ => g.reduce_scatter(t).map(|_| ()),
            };
            r.unwrap_err().to_string()
        });
        assert!(
            out.iter().any(|m| m.contains("ran different steps")),
            "{out:?}"
        );
    }
}
