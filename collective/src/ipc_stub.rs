//! CUDA IPC without the `nccl` feature: unavailable, and no handle can be opened.

use crate::error::Unavailable;
use crate::ipc::{IpcError, IPC_HANDLE_BYTES};

const REASON: &str = "built without the nccl feature (it brings the CUDA driver bindings)";

pub(crate) fn ipc_availability() -> Result<(), Unavailable> {
    Err(Unavailable::new(REASON))
}

pub(crate) fn ipc_export(
    _: u64,
    _: u64,
    _: usize,
) -> Result<([u8; IPC_HANDLE_BYTES], u64), IpcError> {
    Err(IpcError::Unavailable(REASON.into()))
}

/// Uninhabited: `ipc_open` never returns one.
pub(crate) enum Opened {}

impl Opened {
    pub(crate) fn base(&self) -> u64 {
        match *self {}
    }
}

pub(crate) fn ipc_open(_: &[u8; IPC_HANDLE_BYTES], _: usize) -> Result<Opened, IpcError> {
    Err(IpcError::Unavailable(REASON.into()))
}

pub(crate) fn ipc_copy(_: &[(u64, u64, u64)], _: usize) -> Result<(), IpcError> {
    Err(IpcError::Unavailable(REASON.into()))
}

pub(crate) fn ipc_close(opened: Opened) -> Result<(), IpcError> {
    match opened {}
}
