//! CUDA graphs for the decode step. An eager decode step on a GPU is bound by launching
//! its ~80 small operations per layer from the host (measured on an H200: 50–90 ms a
//! step whatever the model's size), not by the GPU. A graph records one step's kernels
//! once and replays them with one launch.
//!
//! A graph has fixed shapes and fixed addresses, so one is recorded per (rows, span)
//! bucket: rows rounded up to a power of two (the extra rows decode token 0 at position
//! 0 of the scratch block, which no request reads), the attended span rounded up to a
//! multiple of [`SPAN_BUCKET`] (masked like any position past a row's own). Inputs are
//! copied into the graph's own id, position and block-table tensors before each replay
//! (the paged cache's tables are graph inputs, so blocks taken or moved between steps
//! need no new recording); the logits
//! come out in the graph's own output tensor. Weights must be updated in place
//! ([`Llama::copy_weights_from`]); anything that moves them or the cache must call
//! [`DecodeGraphs::clear`].
//!
//! libtorch's `at::cuda::CUDAGraph` does the recording (`csrc/cuda_graph.cpp`, built when
//! the linked libtorch has CUDA). Any failure turns graphs off for the generator, logs
//! why once, and the step runs eagerly: results never depend on graphs being there.

use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use super::attention::Attn;
use super::blocks::blocks_for;
use super::kv_cache::KvCache;
use super::llama::Llama;

/// Granularity of the attended span of a recorded step.
pub const SPAN_BUCKET: i64 = 64;

/// Most graphs one generator keeps (each holds its output logits).
const MAX_GRAPHS: usize = 64;

/// The decode-step graphs of one generator.
#[derive(Debug)]
pub struct DecodeGraphs {
    enabled: bool,
    /// Why graphs were turned off after a failure (logged once).
    failed: Option<String>,
    graphs: HashMap<(i64, i64), Recorded>,
    /// The memory pool every graph of this generator shares.
    pool: (u64, u64),
    /// Steps replayed and graphs recorded, for tests and benchmarks.
    pub replays: u64,
    pub recorded: u64,
}

#[derive(Debug)]
struct Recorded {
    // Fields drop in order: the tensors from the graph's pool before the graph.
    inputs: Inputs,
    logits: Tensor,
    graph: ffi::Graph,
}

/// A graph's own input tensors: last tokens and their positions `[rows, 1]`, and the
/// rows' block tables `[rows, blocks of the span bucket]`.
#[derive(Debug)]
struct Inputs {
    ids: Tensor,
    pos: Tensor,
    table: Tensor,
}

impl Inputs {
    /// Copies the step's `[2, n]` ids and positions and its `[n, nb]` block tables in;
    /// the rows past `n` decode token 0 at position 0 of the scratch block (table 0),
    /// and the tables are padded with it.
    fn load(&mut self, ids_pos: &Tensor, table: &Tensor, n: i64) {
        let rows = self.ids.size()[0];
        let nb = table.size()[1].min(self.table.size()[1]);
        tch::no_grad(|| {
            self.ids.narrow(0, 0, n).copy_(&ids_pos.get(0).view([n, 1]));
            self.pos.narrow(0, 0, n).copy_(&ids_pos.get(1).view([n, 1]));
            let _ = self.table.zero_();
            self.table
                .narrow(0, 0, n)
                .narrow(1, 0, nb)
                .copy_(&table.narrow(1, 0, nb));
            if rows > n {
                let _ = self.ids.narrow(0, n, rows - n).zero_();
                let _ = self.pos.narrow(0, n, rows - n).zero_();
            }
        });
    }
}

impl Default for DecodeGraphs {
    fn default() -> Self {
        DecodeGraphs {
            enabled: true,
            failed: None,
            graphs: HashMap::new(),
            pool: (0, 0),
            replays: 0,
            recorded: 0,
        }
    }
}

/// Whether this build can record CUDA graphs at all.
pub fn cuda_graphs_built() -> bool {
    cfg!(yatt_cuda_graphs)
}

/// Loads the CUDA-graph shim (it is loaded on first use otherwise): an error says why
/// graphs cannot be used in this process. Needs libtorch's CUDA backend, not a GPU.
pub fn load_cuda_graph_shim() -> Result<(), String> {
    ffi::load_shim()
}

impl DecodeGraphs {
    /// Turns graphs on or off (on by default; they apply only on CUDA).
    pub fn set_enabled(&mut self, on: bool) {
        self.enabled = on;
        if !on {
            self.clear();
        }
    }

    /// Whether the next decode step on `device` would use a graph.
    pub fn active(&self, device: Device) -> bool {
        self.enabled
            && self.failed.is_none()
            && cuda_graphs_built()
            && matches!(device, Device::Cuda(_))
            // Per-layer profiling waits for the device inside the step, which a capture
            // forbids.
            && !crate::profile::per_layer()
    }

    /// Drops every recorded graph (the weights or the cache moved).
    pub fn clear(&mut self) {
        self.graphs.clear();
        self.pool = (0, 0);
    }

    /// Why graphs were turned off after a failure, if they were.
    pub fn failure(&self) -> Option<&str> {
        self.failed.as_deref()
    }

    /// The logits `[n, vocab]` of one decode step over slots `0..n`, from a recorded
    /// graph; `ids_pos` `[2, n]` holds the last tokens and their positions on the device,
    /// `table` `[n, nb]` the slots' block tables (positions reserved). `None`: run the
    /// step eagerly (graphs inactive, or recording failed just now).
    pub fn decode(
        &mut self,
        model: &Llama,
        cache: &mut KvCache,
        ids_pos: &Tensor,
        table: &Tensor,
        n: i64,
        span: i64,
    ) -> Option<Tensor> {
        let device = model.device();
        if !self.active(device) || n > cache.slots {
            return None;
        }
        let rows = bucket_rows(n, cache.slots);
        let span = bucket_span(span, cache.max_len);
        let key = (rows, span);
        if let Some(r) = self.graphs.get_mut(&key) {
            r.inputs.load(ids_pos, table, n);
            if let Err(e) = r.graph.replay() {
                tracing::warn!("CUDA graph replay failed: {e}; decoding eagerly from now on");
                self.failed = Some(e);
                self.clear();
                return None;
            }
            self.replays += 1;
            return Some(r.logits.narrow(0, 0, n));
        }
        if self.graphs.len() >= MAX_GRAPHS {
            return None;
        }
        match self.record(model, cache, (ids_pos, table), n, rows, span) {
            Ok(r) => {
                // Recording ran this step once already: its logits are this step's.
                let logits = r.logits.narrow(0, 0, n);
                self.graphs.insert(key, r);
                self.recorded += 1;
                self.replays += 1;
                Some(logits)
            }
            Err(e) => {
                tracing::warn!(
                    "CUDA graphs are off for this generator: recording a decode step of {rows} rows over {span} positions failed: {e}; decoding eagerly"
                );
                self.failed = Some(e);
                self.clear();
                None
            }
        }
    }

    /// Records the step for `rows` slots over `span` positions, on this step's inputs
    /// (every run writes this step's keys and values into the cache, so they must be the
    /// real ones): a warm-up run on the capture stream (libraries allocate their
    /// workspaces outside the capture), the capture, then one replay that computes this
    /// step and makes a broken graph fail here.
    fn record(
        &mut self,
        model: &Llama,
        cache: &mut KvCache,
        (ids_pos, table): (&Tensor, &Tensor),
        n: i64,
        rows: i64,
        span: i64,
    ) -> Result<Recorded, String> {
        let Device::Cuda(ordinal) = model.device() else {
            return Err("not a CUDA device".into());
        };
        let graph = ffi::Graph::new(ordinal as i64)?;
        let opts = (Kind::Int64, model.device());
        let mut inputs = Inputs {
            ids: Tensor::zeros([rows, 1], opts),
            pos: Tensor::zeros([rows, 1], opts),
            table: Tensor::zeros([rows, blocks_for(span)], opts),
        };
        inputs.load(ids_pos, table, n);
        let (ids, pos, table) = (&inputs.ids, &inputs.pos, &inputs.table);
        let step = |cache: &mut KvCache| -> Tensor {
            let h = model.hidden(
                ids,
                pos,
                Attn::Decode {
                    cache,
                    span,
                    table: Some(table),
                },
            );
            model.logits(&h.squeeze_dim(1))
        };
        graph.enter_side_stream()?;
        let pool = self.pool;
        // tch panics on a libtorch error (e.g. an operation a capture forbids): caught
        // here, so that the capture is ended and the stream restored.
        let captured = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            tch::no_grad(|| -> Result<Tensor, String> {
                let _ = step(cache);
                graph.capture_begin(pool)?;
                let logits = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| step(cache)));
                graph.capture_end()?;
                logits.map_err(|p| panic_message(&p))
            })
        }))
        .unwrap_or_else(|p| Err(panic_message(&p)));
        let logits = match captured {
            Ok(l) => l,
            Err(e) => {
                graph.leave_side_stream();
                return Err(e);
            }
        };
        if self.pool == (0, 0) {
            self.pool = graph.pool();
        }
        graph.replay()?;
        Ok(Recorded {
            inputs,
            logits,
            graph,
        })
    }
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic in libtorch".into())
}

/// Rows of the graph that serves `n` active slots of a `slots`-slot cache.
pub(crate) fn bucket_rows(n: i64, slots: i64) -> i64 {
    (n.max(1) as u64)
        .next_power_of_two()
        .min(slots.max(1) as u64) as i64
}

/// Attended positions of the graph that serves a step attending `span` positions.
pub(crate) fn bucket_span(span: i64, max_len: i64) -> i64 {
    (((span.max(1) + SPAN_BUCKET - 1) / SPAN_BUCKET) * SPAN_BUCKET).min(max_len)
}

#[cfg(yatt_cuda_graphs)]
mod ffi {
    //! The shim is a shared object embedded in the engine and loaded on first use: from
    //! memory (`memfd_create`), after libtorch's CUDA backend, whose libraries it needs.
    use std::ffi::CStr;
    use std::os::raw::{c_char, c_void};
    use std::sync::OnceLock;

    static SHIM: &[u8] = include_bytes!(env!("YATT_CUDA_GRAPH_SO"));

    type Err = *mut c_char;
    struct Api {
        new: unsafe extern "C" fn(i64, Err, usize) -> *mut c_void,
        enter: unsafe extern "C" fn(*mut c_void, Err, usize) -> i32,
        begin: unsafe extern "C" fn(*mut c_void, u64, u64, Err, usize) -> i32,
        end: unsafe extern "C" fn(*mut c_void, Err, usize) -> i32,
        leave: unsafe extern "C" fn(*mut c_void),
        pool: unsafe extern "C" fn(*mut c_void, *mut u64, *mut u64),
        replay: unsafe extern "C" fn(*mut c_void, Err, usize) -> i32,
        free: unsafe extern "C" fn(*mut c_void),
    }

    fn dl_error() -> String {
        // SAFETY: dlerror returns a thread-local C string or null.
        unsafe {
            let e = libc::dlerror();
            if e.is_null() {
                "unknown dlopen error".into()
            } else {
                CStr::from_ptr(e).to_string_lossy().into_owned()
            }
        }
    }

    fn load() -> Result<Api, String> {
        if !crate::device::load_cuda_backend() {
            return Err("libtorch's CUDA backend (libtorch_cuda.so) is not loaded".into());
        }
        // SAFETY: plain libc calls on a file descriptor this function owns; the bytes
        // are a shared object built for this libtorch by build.rs.
        unsafe {
            let fd = libc::memfd_create(c"yatt-cuda-graph".as_ptr(), libc::MFD_CLOEXEC);
            if fd < 0 {
                return Err(format!("memfd_create: {}", std::io::Error::last_os_error()));
            }
            let written = libc::write(fd, SHIM.as_ptr().cast(), SHIM.len());
            if written != SHIM.len() as isize {
                libc::close(fd);
                return Err("writing the CUDA-graph shim to memory failed".into());
            }
            let path = std::ffi::CString::new(format!("/proc/self/fd/{fd}")).expect("no NUL");
            let handle = libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL);
            libc::close(fd);
            if handle.is_null() {
                return Err(format!("loading the CUDA-graph shim: {}", dl_error()));
            }
            let sym = |name: &CStr| -> Result<*mut c_void, String> {
                let p = libc::dlsym(handle, name.as_ptr());
                if p.is_null() {
                    Err(format!("the CUDA-graph shim lacks {name:?}"))
                } else {
                    Ok(p)
                }
            };
            Ok(Api {
                new: std::mem::transmute(sym(c"yatt_graph_new")?),
                enter: std::mem::transmute(sym(c"yatt_graph_enter_side_stream")?),
                begin: std::mem::transmute(sym(c"yatt_graph_capture_begin")?),
                end: std::mem::transmute(sym(c"yatt_graph_capture_end")?),
                leave: std::mem::transmute(sym(c"yatt_graph_leave_side_stream")?),
                pool: std::mem::transmute(sym(c"yatt_graph_pool")?),
                replay: std::mem::transmute(sym(c"yatt_graph_replay")?),
                free: std::mem::transmute(sym(c"yatt_graph_free")?),
            })
        }
    }

    fn api() -> Result<&'static Api, String> {
        static API: OnceLock<Result<Api, String>> = OnceLock::new();
        API.get_or_init(load).as_ref().map_err(|e| e.clone())
    }

    /// An owned `at::cuda::CUDAGraph`.
    #[derive(Debug)]
    pub struct Graph(*mut c_void);

    // The graph is only touched by the thread that owns its generator; moving the
    // generator between threads moves it too.
    unsafe impl Send for Graph {}

    fn call(f: impl FnOnce(*mut c_char, usize) -> i32) -> Result<(), String> {
        let mut buf = [0 as c_char; 512];
        if f(buf.as_mut_ptr(), buf.len()) == 0 {
            Ok(())
        } else {
            // SAFETY: the shim writes a NUL-terminated message into `buf`.
            Err(unsafe { CStr::from_ptr(buf.as_ptr()) }
                .to_string_lossy()
                .into_owned())
        }
    }

    impl Graph {
        pub fn new(device: i64) -> Result<Graph, String> {
            let api = api()?;
            let mut p = std::ptr::null_mut();
            // SAFETY: plain constructor; errors come back through the buffer.
            call(|e, l| {
                p = unsafe { (api.new)(device, e, l) };
                i32::from(p.is_null())
            })?;
            Ok(Graph(p))
        }
        // Every method below: `self.0` is a live graph from `new`, so `api()` loaded.
        fn api(&self) -> &'static Api {
            api().expect("a graph exists, so the shim loaded")
        }
        pub fn enter_side_stream(&self) -> Result<(), String> {
            // SAFETY: see above.
            call(|e, l| unsafe { (self.api().enter)(self.0, e, l) })
        }
        pub fn capture_begin(&self, pool: (u64, u64)) -> Result<(), String> {
            // SAFETY: see above.
            call(|e, l| unsafe { (self.api().begin)(self.0, pool.0, pool.1, e, l) })
        }
        pub fn capture_end(&self) -> Result<(), String> {
            // SAFETY: see above.
            call(|e, l| unsafe { (self.api().end)(self.0, e, l) })
        }
        pub fn leave_side_stream(&self) {
            // SAFETY: see above.
            unsafe { (self.api().leave)(self.0) }
        }
        pub fn pool(&self) -> (u64, u64) {
            let (mut a, mut b) = (0, 0);
            // SAFETY: see above; the shim writes both outputs.
            unsafe { (self.api().pool)(self.0, &mut a, &mut b) };
            (a, b)
        }
        pub fn replay(&self) -> Result<(), String> {
            // SAFETY: see above.
            call(|e, l| unsafe { (self.api().replay)(self.0, e, l) })
        }
    }

    impl Drop for Graph {
        fn drop(&mut self) {
            // SAFETY: `self.0` came from the shim's constructor and is freed once.
            unsafe { (self.api().free)(self.0) }
        }
    }

    /// Loads the shim (for a test that it loads where it was built).
    pub fn load_shim() -> Result<(), String> {
        api().map(|_| ())
    }
}

#[cfg(not(yatt_cuda_graphs))]
mod ffi {
    /// Stands in where libtorch has no CUDA: every call fails, so graphs stay off.
    #[derive(Debug)]
    pub struct Graph;

    const NOT_BUILT: &str = "this build has no CUDA graphs (libtorch without CUDA)";

    impl Graph {
        pub fn new(_device: i64) -> Result<Graph, String> {
            Err(NOT_BUILT.into())
        }
        pub fn enter_side_stream(&self) -> Result<(), String> {
            Err(NOT_BUILT.into())
        }
        pub fn capture_begin(&self, _pool: (u64, u64)) -> Result<(), String> {
            Err(NOT_BUILT.into())
        }
        pub fn capture_end(&self) -> Result<(), String> {
            Err(NOT_BUILT.into())
        }
        pub fn leave_side_stream(&self) {}
        pub fn pool(&self) -> (u64, u64) {
            (0, 0)
        }
        pub fn replay(&self) -> Result<(), String> {
            Err(NOT_BUILT.into())
        }
    }

    pub fn load_shim() -> Result<(), String> {
        Err(NOT_BUILT.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_round_up_within_the_cache() {
        assert_eq!(bucket_rows(1, 64), 1);
        assert_eq!(bucket_rows(3, 64), 4);
        assert_eq!(bucket_rows(33, 64), 64);
        assert_eq!(bucket_rows(40, 48), 48);
        assert_eq!(bucket_rows(64, 64), 64);
        assert_eq!(bucket_span(1, 1024), 64);
        assert_eq!(bucket_span(64, 1024), 64);
        assert_eq!(bucket_span(65, 1024), 128);
        assert_eq!(bucket_span(1000, 1010), 1010);
    }
}
