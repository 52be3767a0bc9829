//! Device and dtype selection, and loading libtorch's CUDA backend.

use std::sync::OnceLock;

use tch::{Device, Kind};

/// Loads `libtorch_cuda.so` from the folder of the `libtorch_cpu.so` this process runs
/// on, once, and says whether it is loaded.
///
/// The binaries link `libtorch_cpu` alone (they are built against the CPU wheel). Run
/// against a CUDA wheel's libraries (`LD_LIBRARY_PATH`), libtorch sees no GPU until its
/// CUDA library is loaded: it registers the CUDA hooks from its static initialisers.
/// With a CPU wheel there is no such file and this is a no-op.
pub fn load_cuda_backend() -> bool {
    static LOADED: OnceLock<bool> = OnceLock::new();
    *LOADED.get_or_init(|| {
        let Some(dir) = libtorch_dir() else {
            return false;
        };
        let lib = dir.join("libtorch_cuda.so");
        if !lib.exists() {
            return false;
        }
        let Ok(path) = std::ffi::CString::new(lib.as_os_str().as_encoded_bytes()) else {
            return false;
        };
        // SAFETY: dlopen with a valid C string; the handle is kept for the process's life.
        let handle = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns a thread-local C string or null.
            let why = unsafe {
                let e = libc::dlerror();
                if e.is_null() {
                    String::new()
                } else {
                    std::ffi::CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            tracing::warn!(lib = %lib.display(), %why, "libtorch's CUDA backend did not load; running on the CPU");
            return false;
        }
        true
    })
}

/// The folder of the `libtorch_cpu.so` mapped into this process.
pub fn libtorch_dir() -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libtorch_cpu.so"))
        .and_then(|p| std::path::Path::new(p).parent().map(|d| d.to_path_buf()))
}

/// How many CUDA devices libtorch sees (after loading its CUDA backend).
pub fn cuda_device_count() -> usize {
    load_cuda_backend();
    tch::Cuda::device_count().max(0) as usize
}

/// CUDA device 0 when libtorch sees a GPU, else the CPU.
pub fn default_device() -> Device {
    if cuda_device_count() > 0 {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// The devices a test body should run on: the CPU always, CUDA 0 when available.
///
/// With `YATT_REQUIRE_CUDA=1` (the GPU check sets it) a machine where libtorch sees no
/// GPU panics here instead of quietly testing the CPU alone.
pub fn test_devices() -> Vec<Device> {
    let mut v = vec![Device::Cpu];
    if cuda_device_count() > 0 {
        v.push(Device::Cuda(0));
    } else if std::env::var("YATT_REQUIRE_CUDA").as_deref() == Ok("1") {
        panic!(
            "YATT_REQUIRE_CUDA=1 but libtorch sees no CUDA device (libtorch from {:?}); \
             point LD_LIBRARY_PATH at a CUDA build of torch 2.11's lib folder",
            libtorch_dir()
        );
    }
    v
}

/// Parses a device name: `cpu`, `cuda` (ordinal 0) or `cuda:N`, and checks it against
/// the GPUs libtorch sees. The error says what was wrong and what would work.
pub fn parse_device(s: &str) -> Result<Device, String> {
    let s = s.trim().to_ascii_lowercase();
    let ordinal = match s.as_str() {
        "cpu" => return Ok(Device::Cpu),
        "cuda" | "gpu" => 0,
        _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
            Some(Ok(n)) => n,
            _ => return Err(format!("unknown device `{s}`; use cpu, cuda or cuda:N")),
        },
    };
    let n = cuda_device_count();
    if ordinal >= n {
        return Err(if n == 0 {
            format!("device `{s}`: libtorch sees no CUDA device here; use cpu")
        } else {
            format!(
                "device `{s}`: this machine has {n} CUDA device(s), cuda:0 to cuda:{}",
                n - 1
            )
        });
    }
    Ok(Device::Cuda(ordinal))
}

/// Sets libtorch's intra-op thread count (0 leaves it unchanged).
pub fn set_threads(n: usize) {
    if n > 0 {
        tch::set_num_threads(n as i32);
    }
}

/// Parses a dtype name: `f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`.
pub fn parse_kind(s: &str) -> Option<Kind> {
    match s.to_ascii_lowercase().as_str() {
        "f32" | "float32" | "float" => Some(Kind::Float),
        "bf16" | "bfloat16" => Some(Kind::BFloat16),
        "f16" | "float16" | "half" => Some(Kind::Half),
        _ => None,
    }
}

/// Runs one test body on every device of [`test_devices`]:
/// `test_device!(|dev| { ... })` binds `dev: tch::Device` in the body.
#[macro_export]
macro_rules! test_device {
    (|$dev:ident| $body:block) => {
        for $dev in $crate::test_devices() {
            eprintln!("test on {:?}", $dev);
            $body
        }
    };
}

/// Tells glibc's malloc to keep large freed blocks instead of returning them to the OS
/// (raises the mmap and trim thresholds to 1 GiB). libtorch's CPU allocator goes through
/// malloc, and a decode step allocates and frees many multi-megabyte activations; without
/// this every one of them is a fresh mmap with page faults. Process-wide; idempotent.
pub fn tune_host_allocator() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if !SHARDS_TUNED.load(std::sync::atomic::Ordering::Relaxed) {
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only adjusts allocator tunables.
        unsafe {
            libc::mallopt(M_MMAP_THRESHOLD, 1 << 30);
            libc::mallopt(M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}

/// Set once a process holds a rank of a sharded model: a generator made later (a
/// rollout on the same node) keeps the rank's allocator settings.
static SHARDS_TUNED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Undoes [`tune_host_allocator`] for a process that trains a sharded model, for good: blocks of
/// 256 KiB and more get their own mappings, which go back to the OS the moment they are
/// freed. A rank's step allocates and frees unit-sized buffers (gathered weights, their
/// gradients, ring chunks) on several threads; kept in the heap, freed ones fragment
/// each thread's arena and stay resident, which measured about a fifth of a rank's peak
/// (`yatt bench sharded --mmap-threshold-kb`). Process-wide; rollouts in the same
/// process then pay page faults on their large activations.
pub fn tune_host_allocator_for_shards() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        SHARDS_TUNED.store(true, std::sync::atomic::Ordering::Relaxed);
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only adjusts allocator tunables.
        unsafe {
            libc::mallopt(M_MMAP_THRESHOLD, 256 << 10);
            libc::mallopt(M_TRIM_THRESHOLD, 1 << 20);
        }
    }
}

/// Returns the heap pages that [`tune_host_allocator`] keeps for reuse (freed weights,
/// caches and activations) to the OS. Call it when a model is done with: a daemon whose
/// job's roles have stopped would otherwise keep them resident until its next job.
pub fn release_host_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only releases free memory of the allocator's arenas.
    unsafe {
        libc::malloc_trim(0);
    }
}
