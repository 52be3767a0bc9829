//! CUDA IPC: another process of this host reads a device buffer in place, without a
//! round trip through host memory. The exporter sends the small [`IpcHandle`] by any
//! means (yatt sends it in a QUIC message); the reader opens it as an [`IpcMapping`],
//! copies out what it needs, and drops the mapping. The exporter keeps the buffer
//! allocated and unwritten until the reader says it is done.
//!
//! Only between processes of one host and kernel: the handle carries the kernel's boot
//! id and a handle from elsewhere is refused before the driver sees it. In the
//! exporting process itself the handle is not opened (the driver refuses that) but the
//! buffer's own address is used.

use crate::ipc_backend as backend;
use serde::{Deserialize, Serialize};

/// Bytes of a `CUipcMemHandle`.
pub const IPC_HANDLE_BYTES: usize = 64;

/// A device buffer exported for other processes of this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpcHandle {
    /// The driver's handle to the whole allocation that holds the buffer.
    handle: Vec<u8>,
    /// The buffer's offset in that allocation.
    offset: u64,
    /// The buffer's length in bytes.
    bytes: u64,
    /// The exporting kernel's boot id (`/proc/sys/kernel/random/boot_id`).
    host: String,
    /// The exporting process.
    pid: u32,
    /// The buffer's address in the exporting process.
    ptr: u64,
}

impl IpcHandle {
    /// The buffer's length in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
    /// The exporting process.
    pub fn pid(&self) -> u32 {
        self.pid
    }
}

/// Why CUDA IPC could not be used; the caller logs it and sends the bytes instead.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IpcError {
    /// No CUDA driver or GPU here, or built without the `nccl` feature.
    #[error("CUDA IPC unavailable: {0}")]
    Unavailable(String),
    /// The handle came from a process of another host (or kernel).
    #[error(
        "CUDA IPC: the buffer was exported on another host (boot id {there}, this host's \
         {here}); IPC works only between processes of one host"
    )]
    OtherHost { here: String, there: String },
    /// A driver call failed (a pointer not from `cudaMalloc`, a device that cannot map
    /// the other's memory, ...).
    #[error("CUDA IPC {op} failed: {message}")]
    Cuda { op: &'static str, message: String },
    /// The handle's bytes are not a handle.
    #[error("CUDA IPC: malformed handle: {0}")]
    Malformed(String),
}

/// Whether CUDA IPC can be used in this process (the driver loads and sees a GPU).
pub fn ipc_availability() -> Result<(), IpcError> {
    backend::ipc_availability().map_err(|u| IpcError::Unavailable(u.reason))
}

/// The kernel's boot id: processes that share it share the host's GPUs.
pub fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".to_string())
}

/// Exports `bytes` bytes of device memory at `ptr`, on GPU `device`, for other
/// processes of this host.
///
/// # Safety
/// `ptr..ptr + bytes` must be device memory allocated with `cudaMalloc`/`cuMemAlloc`
/// (libtorch's caching allocator qualifies; virtual-memory allocations do not) in the
/// current device's primary context, and stay allocated while any reader may map it.
pub unsafe fn export_ipc(ptr: u64, bytes: u64, device: usize) -> Result<IpcHandle, IpcError> {
    let (handle, offset) = backend::ipc_export(ptr, bytes, device)?;
    Ok(IpcHandle {
        handle: handle.to_vec(),
        offset,
        bytes,
        host: boot_id(),
        pid: std::process::id(),
        ptr,
    })
}

/// An exported buffer mapped into this process; dropping it unmaps the buffer.
pub struct IpcMapping {
    ptr: u64,
    bytes: u64,
    /// The reader's GPU (whose context the copies run in).
    device: usize,
    /// `Some` when the handle was opened (another process's buffer): what to close.
    opened: Option<backend::Opened>,
}

impl std::fmt::Debug for IpcMapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IpcMapping")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("bytes", &self.bytes)
            .field("opened", &self.opened.is_some())
            .finish()
    }
}

impl IpcMapping {
    /// Maps `handle`'s buffer into this process, on GPU `device` (the reader's own; a
    /// buffer of another GPU of the host is reached through peer access).
    pub fn open(handle: &IpcHandle, device: usize) -> Result<IpcMapping, IpcError> {
        let here = boot_id();
        if handle.host != here {
            return Err(IpcError::OtherHost {
                here,
                there: handle.host.clone(),
            });
        }
        if handle.pid == std::process::id() {
            return Ok(IpcMapping {
                ptr: handle.ptr,
                bytes: handle.bytes,
                device,
                opened: None,
            });
        }
        let raw: [u8; IPC_HANDLE_BYTES] = handle.handle.as_slice().try_into().map_err(|_| {
            IpcError::Malformed(format!(
                "{} bytes where a handle has {IPC_HANDLE_BYTES}",
                handle.handle.len()
            ))
        })?;
        let opened = backend::ipc_open(&raw, device)?;
        Ok(IpcMapping {
            ptr: opened.base() + handle.offset,
            bytes: handle.bytes,
            device,
            opened: Some(opened),
        })
    }

    /// The buffer's address in this process.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    /// The buffer's length in bytes.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Copies parts of the buffer out, device to device: each `(offset in the buffer,
    /// destination address, bytes)`. Returns once every copy has landed. Raw driver
    /// copies rather than tensors over the mapping: libtorch checks a tensor's device
    /// against where its memory lives, which for another GPU's buffer is not ours.
    ///
    /// # Safety
    /// Each destination must be device memory of this process with room for its
    /// bytes, not in use by other work until this returns.
    pub unsafe fn copy_out(&self, parts: &[(u64, u64, u64)]) -> Result<(), IpcError> {
        for &(offset, _, len) in parts {
            if offset.checked_add(len).is_none_or(|end| end > self.bytes) {
                return Err(IpcError::Malformed(format!(
                    "bytes {offset}..+{len} of a {}-byte buffer",
                    self.bytes
                )));
            }
        }
        let parts: Vec<(u64, u64, u64)> = parts
            .iter()
            .map(|&(offset, dst, len)| (dst, self.ptr + offset, len))
            .collect();
        backend::ipc_copy(&parts, self.device)
    }
}

impl Drop for IpcMapping {
    fn drop(&mut self) {
        if let Some(opened) = self.opened.take() {
            if let Err(e) = backend::ipc_close(opened) {
                // Nothing to hand back from a drop: the mapping leaks until exit.
                eprintln!("yatt-collective: {e}");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn handle(host: &str, pid: u32) -> IpcHandle {
        IpcHandle {
            handle: vec![7; IPC_HANDLE_BYTES],
            offset: 256,
            bytes: 1024,
            host: host.to_string(),
            pid,
            ptr: 0x7000_0000,
        }
    }

    #[test]
    fn a_copy_past_the_buffer_is_refused_before_the_driver() {
        let m = IpcMapping::open(&handle(&boot_id(), std::process::id()), 0).unwrap();
        let e = unsafe { m.copy_out(&[(0, 0x1000, 512), (768, 0x2000, 512)]) }.unwrap_err();
        assert!(
            matches!(e, IpcError::Malformed(ref s) if s.contains("768..+512 of a 1024-byte")),
            "{e}"
        );
    }

    #[test]
    fn a_handle_from_another_host_is_refused_naming_both_boot_ids() {
        let e = IpcMapping::open(&handle("another-kernel", 1), 0).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, IpcError::OtherHost { .. }), "{s}");
        assert!(
            s.contains("another-kernel") && s.contains(&boot_id()),
            "{s}"
        );
    }

    #[test]
    fn the_exporting_process_uses_the_buffer_in_place() {
        let m = IpcMapping::open(&handle(&boot_id(), std::process::id()), 0).unwrap();
        assert_eq!((m.ptr(), m.bytes()), (0x7000_0000, 1024));
    }

    #[test]
    fn a_handle_of_the_wrong_length_is_malformed_not_a_panic() {
        let mut h = handle(&boot_id(), std::process::id() + 1);
        h.handle.truncate(10);
        let e = IpcMapping::open(&h, 0).unwrap_err();
        assert!(matches!(e, IpcError::Malformed(_)), "{e}");
    }

    #[test]
    fn a_handle_survives_the_wire() {
        let h = handle(&boot_id(), 42);
        let back: IpcHandle = postcard::from_bytes(&postcard::to_stdvec(&h).unwrap()).unwrap();
        assert_eq!(back, h);
    }
}
