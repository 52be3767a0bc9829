//! The real backend: libnccl opened by path with libloading, the CUDA driver through
//! cudarc. cudarc's own NCCL loader looks only for `libnccl.so`, `libnccl.so.13`,
//! `.so.12`, … (never `libnccl.so.2`, the wheel's file), so we open the library
//! ourselves and use cudarc's NCCL types for the signatures. Every failure to find a
//! library is an `Unavailable`, never a panic.

use crate::error::{Failure, Unavailable};
use crate::locate::{self, SearchEnv, Target};
use crate::types::{DType, DeviceBuffer, Progress, ReduceOp, UNIQUE_ID_BYTES};
use cudarc::driver::{sys as cu, CudaContext};
use cudarc::nccl::sys as nc;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// NCCL results as plain ints: a library newer than the bindings may return codes the
/// Rust enum does not have.
type Code = c_int;
const SUCCESS: Code = nc::ncclResult_t::ncclSuccess as Code;
const IN_PROGRESS: Code = nc::ncclResult_t::ncclInProgress as Code;
/// `ncclCommInitRankConfig` (2.14) and a config we can fill need at least this.
const MIN_VERSION: c_int = 21800;

/// `ncclAllReduce` and `ncclBroadcast`: (send, recv, count, dtype, op or root, comm,
/// stream).
type InPlaceFn = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    nc::ncclComm_t,
    nc::cudaStream_t,
) -> Code;

/// The NCCL entry points we use, resolved once from the library we opened.
struct Api {
    path: String,
    version: c_int,
    get_unique_id: unsafe extern "C" fn(*mut nc::ncclUniqueId) -> Code,
    comm_init_rank_config: unsafe extern "C" fn(
        *mut nc::ncclComm_t,
        c_int,
        nc::ncclUniqueId,
        c_int,
        *mut nc::ncclConfig_t,
    ) -> Code,
    comm_get_async_error: unsafe extern "C" fn(nc::ncclComm_t, *mut Code) -> Code,
    comm_abort: unsafe extern "C" fn(nc::ncclComm_t) -> Code,
    all_reduce: InPlaceFn,
    broadcast: InPlaceFn,
    group_start: unsafe extern "C" fn() -> Code,
    group_end: unsafe extern "C" fn() -> Code,
    get_error_string: unsafe extern "C" fn(Code) -> *const c_char,
    get_last_error: unsafe extern "C" fn(nc::ncclComm_t) -> *const c_char,
}

fn api() -> Result<&'static Api, Unavailable> {
    static API: OnceLock<Result<Api, Unavailable>> = OnceLock::new();
    API.get_or_init(|| load_nccl(&SearchEnv::from_process()))
        .as_ref()
        .map_err(Clone::clone)
}

/// Opens the first libnccl of the search plan that loads and has what we need.
fn load_nccl(env: &SearchEnv) -> Result<Api, Unavailable> {
    let mut tried = Vec::new();
    for step in locate::plan(env) {
        let Some(target) = step.target else {
            tried.push(step.place);
            continue;
        };
        let name = match &target {
            Target::File(p) => p.as_os_str().to_owned(),
            Target::Soname(s) => s.into(),
        };
        // RTLD_GLOBAL: a libtorch loaded later that asks for the soname gets this copy.
        let flags = libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_GLOBAL;
        let lib = match unsafe { libloading::os::unix::Library::open(Some(&name), flags) } {
            Ok(lib) => libloading::Library::from(lib),
            Err(e) => {
                // libloading's Display says only "dlopen failed"; dlerror's text is the source.
                let why =
                    std::error::Error::source(&e).map_or_else(|| e.to_string(), |s| s.to_string());
                tried.push(format!("{} ({why})", step.place));
                continue;
            }
        };
        let path = match &target {
            Target::File(p) => p.display().to_string(),
            Target::Soname(s) => s.to_string(),
        };
        match resolve(lib, path) {
            Ok(api) => return Ok(api),
            Err(e) => tried.push(format!("{} ({e})", step.place)),
        }
    }
    Err(Unavailable::new(locate::describe(&tried)))
}

fn resolve(lib: libloading::Library, path: String) -> Result<Api, String> {
    unsafe fn sym<T: Copy>(lib: &libloading::Library, name: &str) -> Result<T, String> {
        let cname = format!("{name}\0");
        unsafe { lib.get::<T>(cname.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("missing {name}: {e}"))
    }
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> Code = sym(&lib, "ncclGetVersion")?;
        let mut version = 0;
        if get_version(&mut version) != SUCCESS || version < MIN_VERSION {
            return Err(format!(
                "NCCL version {version} is older than {MIN_VERSION}"
            ));
        }
        let api = Api {
            path,
            version,
            get_unique_id: sym(&lib, "ncclGetUniqueId")?,
            comm_init_rank_config: sym(&lib, "ncclCommInitRankConfig")?,
            comm_get_async_error: sym(&lib, "ncclCommGetAsyncError")?,
            comm_abort: sym(&lib, "ncclCommAbort")?,
            all_reduce: sym(&lib, "ncclAllReduce")?,
            broadcast: sym(&lib, "ncclBroadcast")?,
            group_start: sym(&lib, "ncclGroupStart")?,
            group_end: sym(&lib, "ncclGroupEnd")?,
            get_error_string: sym(&lib, "ncclGetErrorString")?,
            get_last_error: sym(&lib, "ncclGetLastError")?,
        };
        // The function pointers live as long as the library: keep it loaded for good.
        std::mem::forget(lib);
        Ok(api)
    }
}

/// Runs a cudarc driver call, turning its panics (a symbol the installed driver lacks)
/// into errors.
pub(crate) fn cuda<T>(
    call: &str,
    f: impl FnOnce() -> Result<T, cudarc::driver::DriverError>,
) -> Result<T, Failure> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(v)) => Ok(v),
        Ok(Err(e)) => Err(Failure::Cuda(format!("{call}: {e}"))),
        Err(p) => Err(Failure::Cuda(format!(
            "{call} panicked: {}",
            panic_text(&p)
        ))),
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// The CUDA driver is loadable and sees at least one GPU.
pub(crate) fn driver() -> Result<(), Unavailable> {
    static DRIVER: OnceLock<Result<(), Unavailable>> = OnceLock::new();
    DRIVER
        .get_or_init(|| {
            // Checked first: cudarc panics when it cannot load libcuda.
            if !unsafe { cu::is_culib_present() } {
                return Err(Unavailable::new(
                    "libcuda (the CUDA driver) not found on the system search path (libcuda.so, libcuda.so.1)",
                ));
            }
            match cuda("cuDeviceGetCount", CudaContext::device_count) {
                Ok(n) if n > 0 => Ok(()),
                Ok(_) => Err(Unavailable::new("the CUDA driver sees no GPU")),
                Err(Failure::Cuda(m)) => Err(Unavailable::new(format!("CUDA driver unusable: {m}"))),
                Err(_) => Err(Unavailable::new("CUDA driver unusable")),
            }
        })
        .clone()
}

pub(crate) fn locate_nccl() -> Result<PathBuf, Unavailable> {
    api().map(|a| PathBuf::from(&a.path))
}

pub(crate) fn availability() -> Result<(), Unavailable> {
    match (api(), driver()) {
        (Ok(_), Ok(())) => Ok(()),
        (Err(n), Ok(())) => Err(n),
        (Ok(_), Err(d)) => Err(d),
        (Err(n), Err(d)) => Err(Unavailable::new(format!("{}; {}", n.reason, d.reason))),
    }
}

pub(crate) fn version() -> Option<i32> {
    api().ok().map(|a| a.version)
}

pub(crate) fn new_unique_id() -> Result<[u8; UNIQUE_ID_BYTES], Failure> {
    let api = api()?;
    // An id is only good for a communicator, which needs a GPU: say so here already.
    driver()?;
    let mut id = nc::ncclUniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    let code = unsafe { (api.get_unique_id)(&mut id) };
    if code != SUCCESS {
        return Err(Failure::Nccl(format!(
            "ncclGetUniqueId: {}",
            error_string(api, code, None)
        )));
    }
    Ok(id.internal.map(|c| c as u8))
}

fn error_string(api: &Api, code: Code, comm: Option<nc::ncclComm_t>) -> String {
    let text = |p: *const c_char| {
        if p.is_null() {
            String::new()
        } else {
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
    };
    let mut s = format!(
        "{} (code {code})",
        text(unsafe { (api.get_error_string)(code) })
    );
    if let Some(comm) = comm {
        let last = text(unsafe { (api.get_last_error)(comm) });
        if !last.is_empty() {
            s.push_str(": ");
            s.push_str(&last);
        }
    }
    s
}

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`, so init and collectives return
/// `ncclInProgress` instead of blocking and we can poll them against a deadline.
fn nonblocking_config() -> nc::ncclConfig_t {
    const UNDEF: c_int = c_int::MIN; // NCCL_CONFIG_UNDEF_INT
    nc::ncclConfig_t {
        size: std::mem::size_of::<nc::ncclConfig_t>(),
        magic: 0xcafebeef,
        version: 22800, // NCCL_VERSION(2, 28, 0): the layout of these bindings
        blocking: 0,
        cgaClusterSize: UNDEF,
        minCTAs: UNDEF,
        maxCTAs: UNDEF,
        netName: std::ptr::null(),
        splitShare: UNDEF,
        trafficClass: UNDEF,
        commName: std::ptr::null(),
        collnetEnable: UNDEF,
        CTAPolicy: UNDEF,
        shrinkShare: UNDEF,
        nvlsCTAs: UNDEF,
        nChannelsPerNetPeer: UNDEF,
        nvlinkCentricSched: UNDEF,
    }
}

fn nccl_dtype(d: DType) -> c_int {
    (match d {
        DType::F32 => nc::ncclDataType_t::ncclFloat32,
        DType::BF16 => nc::ncclDataType_t::ncclBfloat16,
        DType::F16 => nc::ncclDataType_t::ncclFloat16,
        DType::U8 => nc::ncclDataType_t::ncclUint8,
    }) as c_int
}

fn nccl_op(op: ReduceOp) -> c_int {
    (match op {
        ReduceOp::Sum => nc::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => nc::ncclRedOp_t::ncclAvg,
    }) as c_int
}

/// A raw communicator handle that may be moved to the thread that aborts it.
struct RawComm(nc::ncclComm_t);
unsafe impl Send for RawComm {}

/// One NCCL communicator on one GPU, driven from whichever thread owns it.
pub(crate) struct Comm {
    api: &'static Api,
    raw: nc::ncclComm_t,
    ctx: Arc<CudaContext>,
    /// `cudaStream_t`/`CUstream`; null is the legacy default stream, which orders with
    /// libtorch's default stream.
    stream: u64,
}

// NCCL communicators may be used from any thread, one at a time; `Communicator` takes
// `&mut self` for every call.
unsafe impl Send for Comm {}

impl Comm {
    /// Starts a non-blocking `ncclCommInitRankConfig`; poll with `poll_comm`.
    pub(crate) fn start_init(
        rank: usize,
        nranks: usize,
        id: &[u8; UNIQUE_ID_BYTES],
        device: usize,
    ) -> Result<Comm, Failure> {
        let api = api()?;
        driver()?;
        // Retains the device's primary context (the one libtorch uses) and makes it
        // current: NCCL takes the device from the calling thread.
        let ctx = cuda("cuDevicePrimaryCtxRetain", || CudaContext::new(device))?;
        let mut config = nonblocking_config();
        let uid = nc::ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut raw: nc::ncclComm_t = std::ptr::null_mut();
        let code = unsafe {
            (api.comm_init_rank_config)(&mut raw, nranks as c_int, uid, rank as c_int, &mut config)
        };
        if code != SUCCESS && code != IN_PROGRESS {
            let msg = error_string(api, code, (!raw.is_null()).then_some(raw));
            if !raw.is_null() {
                unsafe { (api.comm_abort)(raw) };
            }
            return Err(Failure::Nccl(format!("ncclCommInitRankConfig: {msg}")));
        }
        if raw.is_null() {
            return Err(Failure::Nccl(
                "ncclCommInitRankConfig returned no communicator".into(),
            ));
        }
        Ok(Comm {
            api,
            raw,
            ctx,
            stream: 0,
        })
    }

    pub(crate) fn set_stream(&mut self, stream: u64) {
        self.stream = stream;
    }

    fn bind(&self) -> Result<(), Failure> {
        cuda("cuCtxSetCurrent", || self.ctx.bind_to_thread())
    }

    fn check(&self, call: &str, code: Code) -> Result<Progress, Failure> {
        match code {
            SUCCESS => Ok(Progress::Done),
            IN_PROGRESS => Ok(Progress::Pending),
            _ => Err(Failure::Nccl(format!(
                "{call}: {}",
                error_string(self.api, code, Some(self.raw))
            ))),
        }
    }

    /// The communicator's own state: init done, or enqueued work accepted.
    pub(crate) fn poll_comm(&self) -> Result<Progress, Failure> {
        let mut state: Code = SUCCESS;
        let code = unsafe { (self.api.comm_get_async_error)(self.raw, &mut state) };
        self.check("ncclCommGetAsyncError", code)?;
        self.check("ncclCommGetAsyncError", state)
    }

    /// The communicator, then the stream: done when all work on the stream finished.
    pub(crate) fn poll_stream(&self) -> Result<Progress, Failure> {
        if self.poll_comm()? == Progress::Pending {
            return Ok(Progress::Pending);
        }
        self.bind()?;
        let r = cuda("cuStreamQuery", || {
            Ok(unsafe { cu::cuStreamQuery(self.stream as cu::CUstream) })
        })?;
        match r {
            cu::CUresult::CUDA_SUCCESS => Ok(Progress::Done),
            cu::CUresult::CUDA_ERROR_NOT_READY => Ok(Progress::Pending),
            e => Err(Failure::Cuda(format!("cuStreamQuery: {e:?}"))),
        }
    }

    /// Enqueues in-place all-reduces of `bufs`, fused into NCCL groups.
    pub(crate) fn all_reduce(&self, bufs: &[DeviceBuffer], op: ReduceOp) -> Result<(), Failure> {
        self.bind()?;
        // One group per 256 buffers keeps each group's launch plan bounded.
        for chunk in bufs.chunks(256) {
            self.grouped(chunk, |b| {
                let p = b.ptr() as *mut c_void;
                let code = unsafe {
                    (self.api.all_reduce)(
                        p,
                        p,
                        b.count(),
                        nccl_dtype(b.dtype()),
                        nccl_op(op),
                        self.raw,
                        self.nccl_stream(),
                    )
                };
                self.check("ncclAllReduce", code).map(|_| ())
            })?;
        }
        Ok(())
    }

    /// Enqueues an in-place broadcast from `root`.
    pub(crate) fn broadcast(&self, buf: &DeviceBuffer, root: usize) -> Result<(), Failure> {
        self.bind()?;
        let p = buf.ptr() as *mut c_void;
        let code = unsafe {
            (self.api.broadcast)(
                p,
                p,
                buf.count(),
                nccl_dtype(buf.dtype()),
                root as c_int,
                self.raw,
                self.nccl_stream(),
            )
        };
        self.check("ncclBroadcast", code).map(|_| ())
    }

    fn grouped(
        &self,
        bufs: &[DeviceBuffer],
        mut each: impl FnMut(&DeviceBuffer) -> Result<(), Failure>,
    ) -> Result<(), Failure> {
        if bufs.len() == 1 {
            return each(&bufs[0]);
        }
        self.check("ncclGroupStart", unsafe { (self.api.group_start)() })?;
        // The group must be closed even when an enqueue fails.
        let first_err = bufs.iter().map(&mut each).find_map(Result::err);
        let end = self.check("ncclGroupEnd", unsafe { (self.api.group_end)() });
        match first_err {
            Some(e) => Err(e),
            None => end.map(|_| ()),
        }
    }

    fn nccl_stream(&self) -> nc::cudaStream_t {
        self.stream as nc::cudaStream_t
    }

    /// `ncclCommAbort` on a helper thread, waited for at most `wait`: abort stops NCCL's
    /// kernels and threads, but if it blocks itself (a peer in a bad state) the caller
    /// still gets its error back in bounded time. The handle is never used again.
    pub(crate) fn abort(&mut self, wait: Duration) {
        if self.raw.is_null() {
            return;
        }
        let raw = RawComm(std::mem::replace(&mut self.raw, std::ptr::null_mut()));
        let abort = self.api.comm_abort;
        let ctx = self.ctx.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                let raw = raw;
                let _ = cuda("cuCtxSetCurrent", || ctx.bind_to_thread());
                unsafe { abort(raw.0) };
                let _ = tx.send(());
            });
        if spawned.is_ok() {
            let _ = rx.recv_timeout(wait);
        }
    }
}

impl Drop for Comm {
    // Every operation waited for completion, so nothing is in flight: abort releases
    // the resources without the handshake with peers that ncclCommFinalize needs and
    // that would hang on a dead peer.
    fn drop(&mut self) {
        self.abort(Duration::from_secs(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_library_is_unavailable_with_the_searched_places() {
        let env = SearchEnv {
            explicit: Some("/nonexistent/libnccl.so.2".into()),
            ..Default::default()
        };
        let err = load_nccl(&env)
            .err()
            .expect("no library at a nonexistent path");
        assert!(
            err.reason
                .contains("YATT_NCCL_LIB=/nonexistent/libnccl.so.2 (no such file)"),
            "{}",
            err.reason
        );
    }

    #[test]
    fn a_file_that_is_not_a_library_is_unavailable_not_a_panic() {
        let f = std::env::temp_dir().join(format!(
            "yatt-collective-fake-nccl-{}.so.2",
            std::process::id()
        ));
        std::fs::write(&f, b"not an ELF file").unwrap();
        let env = SearchEnv {
            explicit: Some(f.clone().into()),
            ..Default::default()
        };
        let err = load_nccl(&env).err().expect("garbage is not a library");
        assert!(
            err.reason
                .contains(&format!("YATT_NCCL_LIB={}", f.display())),
            "{}",
            err.reason
        );
        let _ = std::fs::remove_file(f);
    }

    #[test]
    fn config_carries_the_nonblocking_flag_and_magic() {
        let c = nonblocking_config();
        assert_eq!(
            (c.blocking, c.magic, c.minCTAs),
            (0, 0xcafebeef, c_int::MIN)
        );
        assert_eq!(c.size, std::mem::size_of::<nc::ncclConfig_t>());
    }
}
