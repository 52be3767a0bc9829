//! The backend without the `nccl` feature: the same surface as `nccl.rs`, where every
//! entry point reports `Unavailable` and no communicator can exist.

use crate::error::{Failure, Unavailable};
use crate::types::{DeviceBuffer, Progress, ReduceOp, UNIQUE_ID_BYTES};
use std::path::PathBuf;
use std::time::Duration;

const REASON: &str = "built without the nccl feature";

fn unavailable() -> Unavailable {
    Unavailable::new(REASON)
}

pub(crate) fn locate_nccl() -> Result<PathBuf, Unavailable> {
    Err(unavailable())
}

pub(crate) fn availability() -> Result<(), Unavailable> {
    Err(unavailable())
}

pub(crate) fn version() -> Option<i32> {
    None
}

pub(crate) fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES], Failure> {
    Err(unavailable().into())
}

/// Uninhabited: `start_init` never returns one.
pub(crate) enum Comm {}

impl Comm {
    pub(crate) fn start_init(
        _: usize,
        _: usize,
        _: &[u8; UNIQUE_ID_BYTES],
        _: usize,
    ) -> Result<Comm, Failure> {
        Err(unavailable().into())
    }
    pub(crate) fn set_stream(&mut self, _: u64) {
        match *self {}
    }
    pub(crate) fn poll_comm(&self) -> Result<Progress, Failure> {
        match *self {}
    }
    pub(crate) fn poll_stream(&self) -> Result<Progress, Failure> {
        match *self {}
    }
    pub(crate) fn all_reduce(&self, _: &[DeviceBuffer], _: ReduceOp) -> Result<(), Failure> {
        match *self {}
    }
    pub(crate) fn broadcast(&self, _: &DeviceBuffer, _: usize) -> Result<(), Failure> {
        match *self {}
    }
    pub(crate) fn abort(&mut self, _: Duration) {
        match *self {}
    }
}
