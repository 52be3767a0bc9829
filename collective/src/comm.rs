//! The public communicator: argument checks, the deadline loop shared by every
//! operation, and turning backend failures into errors that name the operation and
//! the ranks. The backend (`nccl.rs` or `stub.rs`) does the calls.

use crate::backend;
use crate::error::{peers_of, CollectiveError, Failure, Unavailable};
use crate::types::{DeviceBuffer, Progress, ReduceOp, UniqueId};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// How long a deadline abort may itself take before we give up waiting for it.
const ABORT_WAIT: Duration = Duration::from_secs(5);

/// Whether NCCL can be used here (libnccl found, CUDA driver and a GPU present). The
/// reason says what was searched; callers log it and fall back to QUIC.
pub fn availability() -> Result<(), Unavailable> {
    backend::availability()
}

/// Finds and loads libnccl: `YATT_NCCL_LIB`; `nvidia/nccl/lib` next to the libtorch in
/// `/proc/self/maps`; under `VIRTUAL_ENV`; under Python venvs on `PATH`; the system
/// search path. Returns the path (or soname) that was loaded.
pub fn locate_nccl() -> Result<PathBuf, Unavailable> {
    backend::locate_nccl()
}

/// The loaded NCCL's version code (e.g. 22807 for 2.28.7), if it loaded.
pub fn nccl_version() -> Option<i32> {
    backend::version()
}

impl UniqueId {
    /// A fresh id from `ncclGetUniqueId` (this also starts NCCL's bootstrap listener in
    /// this process, so call it on rank 0).
    pub fn new() -> Result<UniqueId, CollectiveError> {
        backend::new_unique_id()
            .map(UniqueId::from_bytes)
            .map_err(|f| error("get_unique_id", 0, 1, f))
    }
}

/// One rank of an NCCL communicator on one GPU. Every operation is in place on device
/// memory, runs on the communicator's stream and returns when the work has finished on
/// the GPU, or aborts the communicator when its deadline passes.
pub struct Communicator {
    comm: backend::Comm,
    rank: usize,
    nranks: usize,
    device: usize,
    /// Set when an operation failed or timed out and the communicator was aborted.
    dead: Option<String>,
}

impl std::fmt::Debug for Communicator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Communicator")
            .field("rank", &self.rank)
            .field("nranks", &self.nranks)
            .field("device", &self.device)
            .field("dead", &self.dead)
            .finish()
    }
}

impl Communicator {
    /// Joins the communicator `id` as `rank` of `nranks` on GPU `device_ordinal`. Init
    /// is non-blocking and polled: if the other ranks have not all joined by `deadline`
    /// the communicator is aborted and a `Deadline` error names "init" and the ranks.
    pub fn init(
        rank: usize,
        nranks: usize,
        id: &UniqueId,
        device_ordinal: usize,
        deadline: Duration,
    ) -> Result<Communicator, CollectiveError> {
        const OP: &str = "init";
        if nranks == 0 || rank >= nranks {
            let message = format!("rank {rank} is not in 0..{nranks}");
            return Err(CollectiveError::InvalidArgument { op: OP, message });
        }
        let start = Instant::now();
        let comm = backend::Comm::start_init(rank, nranks, id.as_bytes(), device_ordinal)
            .map_err(|f| error(OP, rank, nranks, f))?;
        let mut c = Communicator {
            comm,
            rank,
            nranks,
            device: device_ordinal,
            dead: None,
        };
        c.wait(OP, start, deadline, |comm| comm.poll_comm())?;
        Ok(c)
    }

    pub fn rank(&self) -> usize {
        self.rank
    }
    pub fn nranks(&self) -> usize {
        self.nranks
    }
    pub fn device(&self) -> usize {
        self.device
    }
    /// True once an operation failed or timed out: every later call fails at once.
    pub fn is_dead(&self) -> bool {
        self.dead.is_some()
    }

    /// Runs later operations on `stream` (a `cudaStream_t`/`CUstream` as an integer)
    /// instead of the legacy default stream (0).
    ///
    /// # Safety
    /// `stream` must be 0 or a live stream of this device's primary context, and stay
    /// alive while this communicator uses it.
    pub unsafe fn set_stream(&mut self, stream: u64) {
        self.comm.set_stream(stream);
    }

    /// Broadcasts `buf` from rank `root` to every rank, in place.
    pub fn broadcast(
        &mut self,
        buf: &DeviceBuffer,
        root: usize,
        deadline: Duration,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "broadcast";
        self.alive(OP)?;
        if root >= self.nranks {
            let message = format!("root {root} is not in 0..{}", self.nranks);
            return Err(CollectiveError::InvalidArgument { op: OP, message });
        }
        let start = Instant::now();
        let enqueued = self.comm.broadcast(buf, root);
        self.finish(OP, start, deadline, enqueued)
    }

    /// Sums `buf` over all ranks, in place.
    pub fn all_reduce_sum(
        &mut self,
        buf: &DeviceBuffer,
        deadline: Duration,
    ) -> Result<(), CollectiveError> {
        self.all_reduce_many(std::slice::from_ref(buf), ReduceOp::Sum, deadline)
    }

    /// Averages `buf` over all ranks, in place (NCCL's `ncclAvg`).
    pub fn all_reduce_mean(
        &mut self,
        buf: &DeviceBuffer,
        deadline: Duration,
    ) -> Result<(), CollectiveError> {
        self.all_reduce_many(std::slice::from_ref(buf), ReduceOp::Mean, deadline)
    }

    /// All-reduces every buffer in place, fused into NCCL groups (one launch per group
    /// rather than per buffer), with one deadline for the whole list. Every rank must
    /// pass buffers of the same counts and types in the same order.
    pub fn all_reduce_many(
        &mut self,
        bufs: &[DeviceBuffer],
        op: ReduceOp,
        deadline: Duration,
    ) -> Result<(), CollectiveError> {
        const OP: &str = "all_reduce";
        self.alive(OP)?;
        if bufs.is_empty() {
            return Ok(());
        }
        let start = Instant::now();
        let enqueued = self.comm.all_reduce(bufs, op);
        self.finish(OP, start, deadline, enqueued)
    }

    fn alive(&self, op: &'static str) -> Result<(), CollectiveError> {
        match &self.dead {
            None => Ok(()),
            Some(cause) => Err(CollectiveError::Dead {
                op,
                rank: self.rank,
                nranks: self.nranks,
                cause: cause.clone(),
            }),
        }
    }

    /// After an enqueue: wait for the stream, or abort on an enqueue failure.
    fn finish(
        &mut self,
        op: &'static str,
        start: Instant,
        deadline: Duration,
        enqueued: Result<(), Failure>,
    ) -> Result<(), CollectiveError> {
        if let Err(f) = enqueued {
            return Err(self.fail(op, f));
        }
        self.wait(op, start, deadline, |comm| comm.poll_stream())
    }

    /// Polls until done, a failure, or the deadline; the last two abort the communicator.
    fn wait(
        &mut self,
        op: &'static str,
        start: Instant,
        deadline: Duration,
        mut poll: impl FnMut(&backend::Comm) -> Result<Progress, Failure>,
    ) -> Result<(), CollectiveError> {
        let mut spins = 0u32;
        loop {
            match poll(&self.comm) {
                Ok(Progress::Done) => return Ok(()),
                Ok(Progress::Pending) => {}
                Err(f) => return Err(self.fail(op, f)),
            }
            if start.elapsed() >= deadline {
                self.comm.abort(ABORT_WAIT);
                self.dead = Some(format!("{op} missed its deadline of {deadline:?}"));
                let (rank, nranks) = (self.rank, self.nranks);
                return Err(CollectiveError::Deadline {
                    op,
                    rank,
                    nranks,
                    peers: peers_of(rank, nranks),
                    deadline,
                });
            }
            // Spin briefly for short collectives, then back off to at most 1 ms so a
            // long wait does not burn a core.
            spins += 1;
            if spins < 200 {
                std::thread::yield_now();
            } else {
                let us = (spins - 200).min(1000) as u64;
                std::thread::sleep(Duration::from_micros(us.max(20)));
            }
        }
    }

    fn fail(&mut self, op: &'static str, f: Failure) -> CollectiveError {
        self.comm.abort(ABORT_WAIT);
        let err = error(op, self.rank, self.nranks, f);
        self.dead = Some(err.to_string());
        err
    }
}

fn error(op: &'static str, rank: usize, nranks: usize, f: Failure) -> CollectiveError {
    match f {
        Failure::Unavailable(u) => CollectiveError::Unavailable(u),
        Failure::Nccl(message) => CollectiveError::Nccl {
            op,
            rank,
            nranks,
            peers: peers_of(rank, nranks),
            message,
        },
        Failure::Cuda(message) => CollectiveError::Cuda {
            op,
            rank,
            nranks,
            message,
        },
    }
}
