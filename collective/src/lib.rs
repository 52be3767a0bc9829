//! NCCL collectives with deadlines for yatt: broadcast and all-reduce, in place, on raw
//! CUDA device pointers. It knows nothing of actors, tch or models; the runtime carries
//! the [`UniqueId`] between hosts and the trainer decides what to reduce.
//!
//! With the `nccl` feature, libnccl and the CUDA driver are loaded at run time (no CUDA
//! toolkit at build time); without it, or when they are missing, every constructor
//! returns [`Unavailable`] and the caller uses the QUIC fallback. Check
//! [`availability`] first and log its reason.
//!
//! The same feature brings CUDA IPC ([`export_ipc`], [`IpcMapping`]): a process of the
//! same host reads another's device buffer in place (weight sync on one host).
//!
//! Every operation takes a deadline: on expiry the communicator is aborted
//! (`ncclCommAbort`), later calls fail at once, and the error names the operation, the
//! ranks and the deadline, so a lost peer is a diagnosable error rather than a hang.

mod comm;
mod error;
mod ipc;
// Without `nccl` only its tests use the search plan.
#[cfg_attr(not(feature = "nccl"), allow(dead_code))]
mod locate;
mod types;

#[cfg(feature = "nccl")]
#[path = "nccl.rs"]
mod backend;
#[cfg(not(feature = "nccl"))]
#[path = "stub.rs"]
mod backend;
#[cfg(feature = "nccl")]
#[path = "ipc_cuda.rs"]
mod ipc_backend;
#[cfg(not(feature = "nccl"))]
#[path = "ipc_stub.rs"]
mod ipc_backend;

pub use comm::{availability, locate_nccl, nccl_version, Communicator};
pub use error::{CollectiveError, Unavailable};
pub use ipc::{
    boot_id, export_ipc, ipc_availability, IpcError, IpcHandle, IpcMapping, IPC_HANDLE_BYTES,
};
pub use locate::NCCL_LIB_ENV;
pub use types::{DType, DeviceBuffer, ReduceOp, UniqueId, UNIQUE_ID_BYTES};
