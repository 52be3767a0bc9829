//! CUDA IPC through cudarc's driver bindings (loaded at run time, like NCCL's).

use crate::backend::{cuda, driver};
use crate::error::{Failure, Unavailable};
use crate::ipc::{IpcError, IPC_HANDLE_BYTES};
use cudarc::driver::{sys as cu, CudaContext};
use std::ffi::c_char;
use std::sync::Arc;

pub(crate) fn ipc_availability() -> Result<(), Unavailable> {
    driver()
}

fn failed(op: &'static str) -> impl Fn(Failure) -> IpcError {
    move |f| match f {
        Failure::Unavailable(u) => IpcError::Unavailable(u.reason),
        Failure::Cuda(message) | Failure::Nccl(message) => IpcError::Cuda { op, message },
    }
}

/// The primary context of `device` (libtorch's), current on this thread.
fn bind(device: usize, op: &'static str) -> Result<Arc<CudaContext>, IpcError> {
    driver().map_err(|u| IpcError::Unavailable(u.reason))?;
    let ctx = cuda("cuDevicePrimaryCtxRetain", || CudaContext::new(device)).map_err(failed(op))?;
    cuda("cuCtxSetCurrent", || ctx.bind_to_thread()).map_err(failed(op))?;
    Ok(ctx)
}

/// The handle of the allocation holding `ptr`, and `ptr`'s offset in it.
pub(crate) fn ipc_export(
    ptr: u64,
    bytes: u64,
    device: usize,
) -> Result<([u8; IPC_HANDLE_BYTES], u64), IpcError> {
    const OP: &str = "export";
    let _ctx = bind(device, OP)?;
    let (mut base, mut size) = (0 as cu::CUdeviceptr, 0usize);
    cuda("cuMemGetAddressRange", || unsafe {
        cu::cuMemGetAddressRange_v2(&mut base, &mut size, ptr).result()
    })
    .map_err(failed(OP))?;
    if ptr + bytes > base + size as u64 {
        return Err(IpcError::Cuda {
            op: OP,
            message: format!(
                "{bytes} bytes at {ptr:#x} run past their allocation ({size} bytes at {base:#x})"
            ),
        });
    }
    let mut handle = cu::CUipcMemHandle {
        reserved: [0 as c_char; IPC_HANDLE_BYTES],
    };
    cuda("cuIpcGetMemHandle", || unsafe {
        cu::cuIpcGetMemHandle(&mut handle, base).result()
    })
    .map_err(failed(OP))?;
    Ok((handle.reserved.map(|c| c as u8), ptr - base))
}

/// An opened handle: the allocation's base in this process, and the context it lives in.
pub(crate) struct Opened {
    base: u64,
    ctx: Arc<CudaContext>,
}

impl Opened {
    pub(crate) fn base(&self) -> u64 {
        self.base
    }
}

pub(crate) fn ipc_open(handle: &[u8; IPC_HANDLE_BYTES], device: usize) -> Result<Opened, IpcError> {
    const OP: &str = "open";
    let ctx = bind(device, OP)?;
    let handle = cu::CUipcMemHandle {
        reserved: handle.map(|b| b as c_char),
    };
    let mut base = 0 as cu::CUdeviceptr;
    let flags = cu::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
    cuda("cuIpcOpenMemHandle", || unsafe {
        cu::cuIpcOpenMemHandle_v2(&mut base, handle, flags).result()
    })
    .map_err(failed(OP))?;
    Ok(Opened { base, ctx })
}

/// Copies `(dst, src, bytes)` device to device on the legacy default stream (which
/// libtorch's default stream is), then waits for them.
pub(crate) fn ipc_copy(parts: &[(u64, u64, u64)], device: usize) -> Result<(), IpcError> {
    const OP: &str = "copy";
    let _ctx = bind(device, OP)?;
    for &(dst, src, len) in parts {
        cuda("cuMemcpyDtoDAsync", || unsafe {
            cu::cuMemcpyDtoDAsync_v2(dst, src, len as usize, std::ptr::null_mut()).result()
        })
        .map_err(failed(OP))?;
    }
    cuda("cuStreamSynchronize", || unsafe {
        cu::cuStreamSynchronize(std::ptr::null_mut()).result()
    })
    .map_err(failed(OP))
}

pub(crate) fn ipc_close(opened: Opened) -> Result<(), IpcError> {
    const OP: &str = "close";
    cuda("cuCtxSetCurrent", || opened.ctx.bind_to_thread()).map_err(failed(OP))?;
    cuda("cuIpcCloseMemHandle", || unsafe {
        cu::cuIpcCloseMemHandle(opened.base).result()
    })
    .map_err(failed(OP))
}
