//! Weight sync between processes of one host through CUDA IPC: the policy packs the
//! weights into one device buffer and sends its handle (a few hundred bytes) instead of
//! the bytes; a rollout (or reference) on the same host maps the buffer and copies the
//! weights out device to device. Nothing crosses host memory or the network.
//!
//! Where it cannot be used (weights on the CPU, no CUDA driver, a role on another host,
//! a build without the `nccl` feature) the error says why, and the controller sends
//! byte buckets instead and logs the reason.
//!
//! The same packed buffer is what an NCCL broadcast sends to other hosts
//! (`nccl_member.rs`).

use tch::{Device, Kind, Tensor};
use yatt_collective::{export_ipc, ipc_availability, IpcError, IpcMapping};
use yatt_engine::{BucketDtype, BucketEntry};

use crate::role::{DeviceRoute, DeviceWeights};

/// Every tensor starts on this boundary (as a `cudaMalloc` block does).
const ALIGN: u64 = 256;

/// The policy's packed buffer: the latest version's only. A controller's sync waits
/// for every rollout's load before the policy's next update, so when the next version
/// is packed no one reads the previous one.
#[derive(Default)]
pub(crate) struct Staging {
    kept: Option<Staged>,
}

/// One version's weights packed into one device buffer.
pub(crate) struct Staged {
    pub(crate) version: u64,
    pub(crate) entries: Vec<BucketEntry>,
    pub(crate) buffer: Tensor,
    /// Its CUDA IPC handle, once exported.
    ipc: Option<yatt_collective::IpcHandle>,
}

impl Staging {
    /// Packs `named` (the weights at `version`) and exports the buffer through CUDA
    /// IPC; a version already exported is sent again as it is.
    pub(crate) fn export(
        &mut self,
        version: u64,
        named: &[(String, Tensor)],
    ) -> Result<DeviceWeights, IpcError> {
        let ordinal = cuda_ordinal(named)?;
        ipc_availability()?;
        let staged = self.pack(version, named)?;
        let handle = match &staged.ipc {
            Some(h) => h.clone(),
            None => {
                // The reader's copies run on its own streams: the bytes must be there first.
                tch::Cuda::synchronize(ordinal as i64);
                let (base, total) = (staged.buffer.data_ptr() as u64, staged.buffer.numel());
                // SAFETY: libtorch's caching allocator took the buffer from cudaMalloc, and
                // it stays in `kept` while a reader may map it.
                let h = unsafe { export_ipc(base, total as u64, ordinal) }?;
                staged.ipc = Some(h.clone());
                h
            }
        };
        Ok(DeviceWeights {
            entries: staged.entries.clone(),
            route: DeviceRoute::Ipc(handle),
        })
    }

    /// The buffer packed for `version`, if it is the one kept.
    pub(crate) fn staged(&self, version: u64) -> Option<&Staged> {
        self.kept.as_ref().filter(|s| s.version == version)
    }

    /// Packs `named` (the weights at `version`, all on one GPU) into a fresh device
    /// buffer, or returns the one packed for that version already.
    pub(crate) fn pack(
        &mut self,
        version: u64,
        named: &[(String, Tensor)],
    ) -> Result<&mut Staged, IpcError> {
        if self.kept.as_ref().is_some_and(|s| s.version == version) {
            return Ok(self.kept.as_mut().expect("kept"));
        }
        // The old buffer goes first: at most one packed copy of the weights at a time.
        self.kept = None;
        let device = Device::Cuda(cuda_ordinal(named)?);
        let (entries, buffer) = pack_into_new_buffer(named, device)?;
        Ok(self.kept.insert(Staged {
            version,
            entries,
            buffer,
            ipc: None,
        }))
    }
}

/// `named` (all on `device`) packed into one fresh `Uint8` buffer there, each tensor on
/// an [`ALIGN`] boundary, and the table of where each one is.
fn pack_into_new_buffer(
    named: &[(String, Tensor)],
    device: Device,
) -> Result<(Vec<BucketEntry>, Tensor), IpcError> {
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
    let views = tensor_views(&buffer, &entries)?;
    tch::no_grad(|| -> Result<(), IpcError> {
        for ((_, t), (_, mut dst)) in named.iter().zip(views) {
            dst.f_copy_(t).map_err(tch_failed("packing the weights"))?;
        }
        Ok(())
    })?;
    Ok((entries, buffer))
}

/// The CUDA ordinal the first weight is on: packing needs the weights on a GPU.
fn cuda_ordinal(named: &[(String, Tensor)]) -> Result<usize, IpcError> {
    match named.first().map(|(_, t)| t.device()) {
        Some(Device::Cuda(i)) => Ok(i),
        Some(_) => Err(IpcError::Unavailable(
            "the policy's weights are on the CPU".into(),
        )),
        None => Err(IpcError::Unavailable(
            "the policy has no weights to send".into(),
        )),
    }
}

/// Views of `buffer` (a `Uint8` device tensor) as the tensors `entries` describe, after
/// checking each lies inside it and its shape matches its bytes. The views do not own
/// their memory: they must not outlive `buffer`.
pub(crate) fn tensor_views(
    buffer: &Tensor,
    entries: &[BucketEntry],
) -> Result<Vec<(String, Tensor)>, IpcError> {
    let (base, size, device) = (
        buffer.data_ptr() as u64,
        buffer.numel() as u64,
        buffer.device(),
    );
    entries
        .iter()
        .map(|e| {
            check_entry(e)?;
            if e.offset.checked_add(e.len).is_none_or(|end| end > size) {
                return Err(IpcError::Malformed(format!(
                    "entry `{}`: bytes {}..+{} lie outside the {size}-byte buffer",
                    e.name, e.offset, e.len
                )));
            }
            // SAFETY: `e.offset..e.offset + e.len` lies inside `buffer` (checked above),
            // and the caller keeps `buffer` alive while it uses the view.
            let view = unsafe {
                Tensor::f_from_blob(
                    (base + e.offset) as *const u8,
                    &e.shape,
                    &[],
                    e.dtype.kind(),
                    device,
                )
            }
            .map_err(tch_failed("viewing the packed buffer"))?;
            Ok((e.name.clone(), view))
        })
        .collect()
}

/// Whether an entry's shape and dtype take exactly its bytes.
fn check_entry(e: &BucketEntry) -> Result<(), IpcError> {
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
    Ok(())
}

/// Copies the weights out of the policy's buffer (`handle`, with the tensors
/// `entries`) onto `device` (a GPU of this host), then unmaps the buffer.
pub(crate) fn device_tensors(
    entries: &[BucketEntry],
    handle: &yatt_collective::IpcHandle,
    device: Device,
) -> Result<Vec<(String, Tensor)>, IpcError> {
    let Device::Cuda(ordinal) = device else {
        return Err(IpcError::Unavailable(
            "this role's weights are on the CPU".into(),
        ));
    };
    let mapping = IpcMapping::open(handle, ordinal)?;
    let mut out = Vec::with_capacity(entries.len());
    let mut parts = Vec::with_capacity(entries.len());
    for e in entries {
        check_entry(e)?;
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
pub(crate) fn tch_failed(op: &'static str) -> impl Fn(tch::TchError) -> IpcError {
    move |e| IpcError::Cuda {
        op,
        message: e.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CPU always, and the first GPU where libtorch sees one.
    fn devices() -> Vec<Device> {
        let mut d = vec![Device::Cpu];
        if tch::Cuda::is_available() {
            d.push(Device::Cuda(0));
        }
        d
    }

    /// What a broadcast receiver does with the packed bytes: views by the table give
    /// back every tensor, bit for bit, whatever its dtype and alignment.
    #[test]
    fn packed_weights_come_back_through_views_of_the_buffer() {
        for device in devices() {
            let named: Vec<(String, Tensor)> = vec![
                (
                    "a".into(),
                    Tensor::arange(7, (Kind::Float, device)).view([7]),
                ),
                (
                    "b".into(),
                    Tensor::arange(15, (Kind::Float, device))
                        .to_kind(Kind::BFloat16)
                        .view([3, 5]),
                ),
                ("c".into(), Tensor::ones([2, 2], (Kind::Half, device))),
            ];
            let (entries, buffer) = pack_into_new_buffer(&named, device).unwrap();
            assert!(entries.iter().all(|e| e.offset % ALIGN == 0), "{entries:?}");
            // A copy of the bytes, as a receiver holds them.
            let received = buffer.copy();
            let views = tensor_views(&received, &entries).unwrap();
            for ((name, want), (got_name, got)) in named.iter().zip(&views) {
                assert_eq!(name, got_name);
                assert_eq!((got.kind(), got.size()), (want.kind(), want.size()));
                assert!(got.equal(want), "{name} on {device:?}");
            }
        }
    }

    /// A table that does not fit the buffer, or whose shape does not fit its bytes, is
    /// refused naming the entry, not read out of bounds.
    #[test]
    fn a_table_that_does_not_fit_the_buffer_is_refused() {
        let named = vec![(
            "w".to_string(),
            Tensor::ones([4], (Kind::Float, Device::Cpu)),
        )];
        let (mut entries, buffer) = pack_into_new_buffer(&named, Device::Cpu).unwrap();
        entries[0].offset = buffer.numel() as u64 - 8;
        let e = tensor_views(&buffer, &entries).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("outside"), "{e}");
        entries[0].offset = 0;
        entries[0].shape = vec![5];
        let e = tensor_views(&buffer, &entries).unwrap_err().to_string();
        assert!(e.contains("`w`") && e.contains("needs 20 bytes"), "{e}");
    }
}
