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

/// A contiguous f32 tensor on the CPU, lent to the ring as its buffer: the ring reads
/// and writes the tensor's own memory, with no copy in or out.
struct TensorBuf(Tensor);

impl TensorBuf {
    /// `t` (handed over by the caller, its memory the ring's to overwrite) as a flat
    /// f32 CPU tensor: itself when it is one already, else converted.
    fn own(t: Tensor) -> Self {
        let t = t.detach();
        if t.kind() == Kind::Float && t.device() == Device::Cpu && t.is_contiguous() {
            return TensorBuf(t.reshape([-1]));
        }
        TensorBuf(
            t.to_device(Device::Cpu)
                .to_kind(Kind::Float)
                .contiguous()
                .reshape([-1]),
        )
    }
}

impl AsMut<[f32]> for TensorBuf {
    fn as_mut(&mut self) -> &mut [f32] {
        let n = self.0.numel();
        // SAFETY: the tensor is f32, contiguous and on the CPU (see `own` and
        // `all_gather`), and owned by this buffer alone: nothing else reads or writes
        // its memory while the slice lives.
        unsafe { std::slice::from_raw_parts_mut(self.0.data_ptr() as *mut f32, n) }
    }
}

impl ShardGroup for RingShardGroup {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world(&self) -> usize {
        self.world
    }

    fn all_gather(&mut self, shard: &Tensor) -> Result<Tensor, EngineError> {
        if self.world == 1 {
            return Ok(shard.copy());
        }
        let s = shard.numel() as i64;
        let full = Tensor::empty([s * self.world as i64], (Kind::Float, Device::Cpu));
        full.narrow(0, self.rank as i64 * s, s)
            .copy_(&shard.detach().reshape([-1]));
        let round = self.next_round();
        let full = self
            .member
            .all_gather_blocking(TensorBuf(full), round)
            .map_err(|e| self.fail("all-gather", e))?
            .0;
        Ok(full.to_kind(shard.kind()).to_device(shard.device()))
    }

    fn reduce_scatter(&mut self, full: Tensor) -> Result<Tensor, EngineError> {
        let n = full.numel();
        if n % self.world != 0 {
            return Err(self.fail(
                "reduce-scatter",
                format!("{n} elements do not split over {} ranks", self.world),
            ));
        }
        if self.world == 1 {
            return Ok(full);
        }
        let s = (n / self.world) as i64;
        let (kind, device) = (full.kind(), full.device());
        let round = self.next_round();
        let buf = self
            .member
            .reduce_scatter_sum_blocking(TensorBuf::own(full), round)
            .map_err(|e| self.fail("reduce-scatter", e))?
            .0;
        Ok(buf
            .narrow(0, self.rank as i64 * s, s)
            .copy()
            .to_kind(kind)
            .to_device(device))
    }

    fn all_reduce(&mut self, values: &mut [f64], op: ReduceOp) -> Result<(), EngineError> {
        if self.world == 1 {
            return Ok(());
        }
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
