//! A sharded replica's ranks on different nodes: the engine's [`ShardGroup`] over the
//! runtime's ring ([`RingMember`]), QUIC between processes and the mailbox within one.
//! The ring moves `f32`: tensors of another dtype travel as `f32` and come back in
//! their own. Every wait has the ring's deadline ([`RingSpec::timeout`]), and a member
//! that gives up tells the others, so a lost rank fails the step instead of hanging it.
//!
//! [`RingSpec::timeout`]: yatt_runtime::RingSpec

use tch::{Device, Kind, Tensor};
use yatt_engine::{EngineError, ReduceOp, ShardGroup};
use yatt_runtime::RingMember;

/// One rank of a sharded replica over a joined ring (its rank and size are the ring's).
pub struct RingShardGroup {
    member: RingMember,
    rank: usize,
    world: usize,
    /// Numbers the ring's rounds: every rank runs the same collectives in the same
    /// order, so their counters agree.
    round: u64,
}

impl RingShardGroup {
    /// Wraps a member that has joined its ring. Use it from a compute thread, not from
    /// within the node's runtime (the calls block).
    pub fn new(member: RingMember) -> Result<Self, EngineError> {
        let spec = member.spec().ok_or_else(|| {
            EngineError::InvalidArgument("the ring member has not joined a ring".into())
        })?;
        let (rank, world) = (spec.rank as usize, spec.members.len());
        Ok(RingShardGroup {
            member,
            rank,
            world,
            round: 0,
        })
    }

    fn next_round(&mut self) -> u64 {
        self.round += 1;
        self.round
    }

    fn fail(&self, op: &'static str, e: impl std::fmt::Display) -> EngineError {
        EngineError::Collective {
            op,
            rank: self.rank,
            msg: e.to_string(),
        }
    }
}

fn to_vec(t: &Tensor) -> Result<Vec<f32>, EngineError> {
    let t = t
        .detach()
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous();
    Ok(Vec::<f32>::try_from(&t.view([-1]))?)
}

fn like(values: &[f32], t: &Tensor) -> Tensor {
    Tensor::from_slice(values)
        .to_kind(t.kind())
        .to_device(t.device())
}

impl ShardGroup for RingShardGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, shard: &Tensor) -> Result<Tensor, EngineError> {
        let own = to_vec(shard)?;
        let s = own.len();
        let mut buf = vec![0f32; s * self.world];
        buf[self.rank * s..(self.rank + 1) * s].copy_from_slice(&own);
        let round = self.next_round();
        let buf = self
            .member
            .all_gather_blocking(buf, round)
            .map_err(|e| self.fail("all-gather", e))?;
        Ok(like(&buf, shard))
    }

    fn reduce_scatter(&mut self, full: &Tensor) -> Result<Tensor, EngineError> {
        let buf = to_vec(full)?;
        if buf.len() % self.world != 0 {
            return Err(self.fail(
                "reduce-scatter",
                format!(
                    "{} elements do not split over {} ranks",
                    buf.len(),
                    self.world
                ),
            ));
        }
        let s = buf.len() / self.world;
        let round = self.next_round();
        let buf = self
            .member
            .reduce_scatter_sum_blocking(buf, round)
            .map_err(|e| self.fail("reduce-scatter", e))?;
        Ok(like(&buf[self.rank * s..(self.rank + 1) * s], full))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: ReduceOp) -> Result<(), EngineError> {
        // Exact: each rank's f64 bits travel as two f32 bit patterns through an
        // all-gather (copies, never arithmetic), and every rank reduces them in rank
        // order, so all get the same bits.
        let k = values.len();
        let mut buf = vec![0f32; 2 * k * self.world];
        for (i, v) in values.iter().enumerate() {
            let b = v.to_bits();
            let at = 2 * (self.rank * k + i);
            buf[at] = f32::from_bits(b as u32);
            buf[at + 1] = f32::from_bits((b >> 32) as u32);
        }
        let round = self.next_round();
        let buf = self
            .member
            .all_gather_blocking(buf, round)
            .map_err(|e| self.fail("all-reduce", e))?;
        for (i, out) in values.iter_mut().enumerate() {
            let value = |r: usize| {
                let at = 2 * (r * k + i);
                f64::from_bits(
                    u64::from(buf[at].to_bits()) | (u64::from(buf[at + 1].to_bits()) << 32),
                )
            };
            let mut acc = value(0);
            for r in 1..self.world {
                acc = match op {
                    ReduceOp::Sum => acc + value(r),
                    ReduceOp::Max => acc.max(value(r)),
                };
            }
            *out = acc;
        }
        Ok(())
    }
}
