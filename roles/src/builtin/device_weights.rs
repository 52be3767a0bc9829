//! Weight sync between processes of one host through CUDA IPC: the policy packs the
//! weights into one device buffer and sends its handle (a few hundred bytes) instead of
//! the bytes; a rollout (or reference) on the same host maps the buffer and copies the
//! weights out device to device. Nothing crosses host memory or the network.
//!
//! Where it cannot be used (weights on the CPU, no CUDA driver, a role on another host,
//! a build without the `nccl` feature) the error says why, and the controller sends
//! byte buckets instead and logs the reason.

use tch::{Device, Kind, Tensor};
use yatt_collective::{export_ipc, ipc_availability, IpcError, IpcMapping};
use yatt_engine::{BucketDtype, BucketEntry};

use crate::role::DeviceWeights;

/// Every tensor starts on this boundary (as a `cudaMalloc` block does).
const ALIGN: u64 = 256;

/// The policy's exported buffer: the latest version's only. A controller's sync waits
/// for every rollout's load before the policy's next update, so when the next version
/// is exported no one reads the previous one.
#[derive(Default)]
pub(crate) struct Staging {
    kept: Option<(u64, DeviceWeights, Tensor)>,
}

impl Staging {
    /// Packs `named` (the weights at `version`) into a fresh device buffer and exports
    /// it; a version already exported is sent again as it is.
    pub(crate) fn export(
        &mut self,
        version: u64,
        named: &[(String, Tensor)],
    ) -> Result<DeviceWeights, IpcError> {
        if let Some((v, weights, _)) = &self.kept {
            if *v == version {
                return Ok(weights.clone());
            }
        }
        // The old buffer goes first: at most one packed copy of the weights at a time.
        self.kept = None;
        let ordinal = match named.first().map(|(_, t)| t.device()) {
            Some(Device::Cuda(i)) => i,
            Some(_) => {
                return Err(IpcError::Unavailable(
                    "the policy's weights are on the CPU".into(),
                ))
            }
            None => {
                return Err(IpcError::Unavailable(
                    "the policy has no weights to send".into(),
                ))
            }
        };
        ipc_availability()?;
        let device = Device::Cuda(ordinal);
        let mut entries = Vec::with_capacity(named.len());
        let mut total = 0u64;
        for (name, t) in named {
            if t.device() != device {
                return Err(IpcError::Unavailable(format!(
                    "the policy's weights span devices ({name} is on {:?}, not {device:?})",
                    t.device()
                )));
            }
            let dtype = BucketDtype::from_kind(t.kind())
                .map_err(|e| IpcError::Malformed(format!("{name}: {e}")))?;
            let len = (t.numel() * t.kind().elt_size_in_bytes()) as u64;
            entries.push(BucketEntry {
                name: name.clone(),
                dtype,
                shape: t.size(),
                offset: total,
                len,
            });
            total += len.div_ceil(ALIGN) * ALIGN;
        }
        let buffer = Tensor::f_empty([total.max(1) as i64], (Kind::Uint8, device))
            .map_err(tch_failed("allocating the staging buffer"))?;
        let base = buffer.data_ptr() as u64;
        tch::no_grad(|| -> Result<(), IpcError> {
            for ((_, t), e) in named.iter().zip(&entries) {
                // SAFETY: `e.offset..e.offset + e.len` lies inside `buffer`, which
                // outlives this view.
                let mut dst = unsafe {
                    Tensor::f_from_blob(
                        (base + e.offset) as *const u8,
                        &e.shape,
                        &[],
                        t.kind(),
                        device,
                    )
                }
                .map_err(tch_failed("viewing the staging buffer"))?;
                dst.f_copy_(t).map_err(tch_failed("packing the weights"))?;
            }
            Ok(())
        })?;
        // The reader's copies run on its own streams: the bytes must be there first.
        tch::Cuda::synchronize(ordinal as i64);
        // SAFETY: libtorch's caching allocator took the buffer from cudaMalloc, and it
        // stays in `kept` while a reader may map it.
        let handle = unsafe { export_ipc(base, total, ordinal) }?;
        let weights = DeviceWeights { entries, handle };
        self.kept = Some((version, weights.clone(), buffer));
        Ok(weights)
    }
}

/// Copies the weights out of the policy's buffer onto `device` (a GPU of this host),
/// then unmaps the buffer.
pub(crate) fn device_tensors(
    weights: &DeviceWeights,
    device: Device,
) -> Result<Vec<(String, Tensor)>, IpcError> {
    let Device::Cuda(ordinal) = device else {
        return Err(IpcError::Unavailable(
            "this role's weights are on the CPU".into(),
        ));
    };
    let mapping = IpcMapping::open(&weights.handle, ordinal)?;
    let mut out = Vec::with_capacity(weights.entries.len());
    let mut parts = Vec::with_capacity(weights.entries.len());
    for e in &weights.entries {
        let numel: i64 = e.shape.iter().product();
        if numel < 0 || numel as u64 * e.dtype.size() as u64 != e.len {
            return Err(IpcError::Malformed(format!(
                "entry `{}`: shape {:?} of {:?} needs {} bytes, the table says {}",
                e.name,
                e.shape,
                e.dtype,
                numel.max(0) as u64 * e.dtype.size() as u64,
                e.len
            )));
        }
        let own = Tensor::f_empty(e.shape.as_slice(), (e.dtype.kind(), device))
            .map_err(tch_failed("allocating the weights"))?;
        parts.push((e.offset, own.data_ptr() as u64, e.len));
        out.push((e.name.clone(), own));
    }
    // SAFETY: each destination is a fresh tensor of exactly its entry's bytes, which
    // no other work touches before the copies return; `copy_out` checks the sources
    // lie inside the buffer.
    unsafe { mapping.copy_out(&parts) }?;
    drop(mapping);
    Ok(out)
}

/// A libtorch failure during `op`, as the IPC error the caller logs.
fn tch_failed(op: &'static str) -> impl Fn(tch::TchError) -> IpcError {
    move |e| IpcError::Cuda {
        op,
        message: e.to_string(),
    }
}
