//! A role's place in an NCCL group, with the group's deadline on every call.
//!
//! - Weight sync by broadcast: the policy (rank 0) sends its packed device buffer
//!   (`device_weights.rs`) in buckets of bytes, and every other member receives it into
//!   a buffer of its own on its GPU, then copies the tensors into its model. It works
//!   between hosts, where CUDA IPC cannot.
//! - Gradients: policy replicas average their flat f32 gradients with one all-reduce.
//!
//! A member that never joins, or one lost mid-operation, makes the others' calls end
//! at the deadline: the communicator is aborted (`ncclCommAbort`) and dropped, and the
//! error names the operation and the ranks, so the caller falls back to QUIC (or, when
//! NCCL was asked for, fails saying why) instead of hanging.

use tch::{Device, Kind, Tensor};
use yatt_collective::{CollectiveError, Communicator, DType, DeviceBuffer, UniqueId};

use crate::builtin::device_weights::{tch_failed, tensor_views};
use crate::role::{DeviceWeights, NcclGroup, RoleError};

/// Whether a role whose weights are on `device` can be a member of an NCCL group, else
/// why not; `whose` names the weights in the reason ("the policy's").
pub(crate) fn can_join(device: Device, whose: &str) -> Result<(), String> {
    if !matches!(device, Device::Cuda(_)) {
        return Err(format!("NCCL unavailable: {whose} weights are on the CPU"));
    }
    yatt_collective::availability().map_err(|e| e.to_string())
}

/// A role's place in an NCCL group: its communicator, kept while the group's id stays
/// the same (a new id means the members changed; the old one is destroyed).
#[derive(Default)]
pub(crate) struct GroupMember {
    comm: Option<(UniqueId, Communicator)>,
}

impl GroupMember {
    /// The communicator of `group` on GPU `ordinal`, joining it first if needed.
    fn joined(
        &mut self,
        group: &NcclGroup,
        ordinal: usize,
    ) -> Result<&mut Communicator, CollectiveError> {
        let same = |(id, c): &(UniqueId, Communicator)| {
            *id == group.id && !c.is_dead() && c.nranks() == group.nranks as usize
        };
        if !self.comm.as_ref().is_some_and(same) {
            // Destroy the old communicator before joining the new group.
            self.comm = None;
            let c = Communicator::init(
                group.rank as usize,
                group.nranks as usize,
                &group.id,
                ordinal,
                group.deadline(),
            )?;
            self.comm = Some((group.id, c));
        }
        Ok(&mut self.comm.as_mut().expect("joined").1)
    }

    /// Broadcasts (rank 0) or receives (the others) the first `bytes` bytes of
    /// `buffer` (a `Uint8` tensor on GPU `ordinal`), one bucket per NCCL call.
    fn broadcast(
        &mut self,
        group: &NcclGroup,
        buffer: &Tensor,
        bytes: u64,
    ) -> Result<(), CollectiveError> {
        let invalid = |message: String| CollectiveError::InvalidArgument {
            op: "broadcast",
            message,
        };
        let ordinal = match buffer.device() {
            Device::Cuda(i) => i,
            other => return Err(invalid(format!("the buffer is on {other:?}, not a GPU"))),
        };
        if bytes > buffer.numel() as u64 {
            return Err(invalid(format!(
                "{bytes} bytes asked of a {}-byte buffer",
                buffer.numel()
            )));
        }
        let comm = self.joined(group, ordinal)?;
        // libtorch's work on the buffer (packing, allocation) must be done before NCCL's
        // stream reads or writes it.
        tch::Cuda::synchronize(ordinal as i64);
        let base = buffer.data_ptr() as u64;
        let bucket = group.bucket_bytes.max(1);
        let mut start = 0;
        while start < bytes {
            let len = bucket.min(bytes - start);
            // SAFETY: `start..start + len` lies inside `buffer` (checked above), a
            // device tensor on this communicator's GPU that the caller keeps alive and
            // does not touch until the call returns.
            let buf = unsafe { DeviceBuffer::new(base + start, len as usize, DType::U8) };
            comm.broadcast(&buf, 0, group.deadline())?;
            start += len;
        }
        Ok(())
    }

    /// Rank 0: sends `buffer`, the policy's packed weights, to the group.
    pub(crate) fn send(
        &mut self,
        group: &NcclGroup,
        buffer: &Tensor,
        bytes: u64,
    ) -> Result<(), RoleError> {
        if group.rank != 0 {
            return Err(RoleError::BadRequest(format!(
                "the policy sends weight broadcasts as rank 0, not rank {} of {}",
                group.rank, group.nranks
            )));
        }
        self.broadcast(group, buffer, bytes)
            .map_err(|e| self.failed(format!("sending the weights by NCCL broadcast: {e}")))
    }

    /// A receiver: the weights of `weights` (version `version`) through `group`, as
    /// views of a fresh buffer on `device` that the returned [`Received`] keeps alive.
    pub(crate) fn receive(
        &mut self,
        version: u64,
        weights: &DeviceWeights,
        group: &NcclGroup,
        device: Device,
    ) -> Result<Received, RoleError> {
        let Device::Cuda(_) = device else {
            return Err(RoleError::Failed(format!(
                "weights v{version} by NCCL broadcast: this role's weights are on the CPU (use rollout.weight_sync = \"auto\" or \"quic\")"
            )));
        };
        if group.rank == 0 || group.rank >= group.nranks {
            return Err(RoleError::BadRequest(format!(
                "weights v{version} by NCCL broadcast: a receiver's rank must be in 1..{}, not {}",
                group.nranks, group.rank
            )));
        }
        let bytes = weights.packed_bytes();
        let buffer =
            Tensor::f_empty([bytes.max(1) as i64], (Kind::Uint8, device)).map_err(|e| {
                RoleError::Failed(tch_failed("allocating the receive buffer")(e).to_string())
            })?;
        self.broadcast(group, &buffer, bytes).map_err(|e| {
            self.failed(format!(
                "weights v{version} by NCCL broadcast (rank {} of {}): {e}",
                group.rank, group.nranks
            ))
        })?;
        let views = tensor_views(&buffer, &weights.entries)
            .map_err(|e| RoleError::BadRequest(format!("weights v{version}: {e}")))?;
        Ok(Received {
            views,
            _buffer: buffer,
        })
    }

    /// Averages `flat` (a 1-D f32 tensor on this member's GPU) over the group, in place.
    pub(crate) fn all_reduce_mean(
        &mut self,
        group: &NcclGroup,
        flat: &Tensor,
    ) -> Result<(), RoleError> {
        let ordinal = match (flat.device(), flat.kind(), flat.dim()) {
            (Device::Cuda(i), Kind::Float, 1) if flat.is_contiguous() => i,
            (device, kind, _) => {
                return Err(RoleError::BadRequest(format!(
                    "an NCCL all-reduce needs one contiguous f32 vector on a GPU, not {kind:?} of shape {:?} on {device:?}",
                    flat.size()
                )))
            }
        };
        let reduced = self.joined(group, ordinal).and_then(|comm| {
            tch::Cuda::synchronize(ordinal as i64);
            // SAFETY: `flat` is a contiguous f32 device tensor of `numel` elements on
            // this communicator's GPU, which the caller keeps alive and leaves alone
            // until the call returns.
            let buf =
                unsafe { DeviceBuffer::new(flat.data_ptr() as u64, flat.numel(), DType::F32) };
            comm.all_reduce_mean(&buf, group.deadline())
        });
        reduced.map_err(|e| {
            self.failed(format!(
                "gradient all-reduce by NCCL (rank {} of {}): {e}",
                group.rank, group.nranks
            ))
        })
    }

    /// A failure: the communicator is dead (aborted) or its peers are out of step, so
    /// it is dropped and the next call joins afresh.
    fn failed(&mut self, message: String) -> RoleError {
        self.comm = None;
        RoleError::Failed(message)
    }
}

/// Weights received by broadcast: views of the buffer they arrived in.
pub(crate) struct Received {
    pub(crate) views: Vec<(String, Tensor)>,
    _buffer: Tensor,
}
