//! Device and dtype selection.

use tch::{Device, Kind};

/// CUDA device 0 when libtorch sees a GPU, else the CPU.
pub fn default_device() -> Device {
    if tch::Cuda::is_available() {
        Device::Cuda(0)
    } else {
        Device::Cpu
    }
}

/// The devices a test body should run on: the CPU always, CUDA 0 when available.
pub fn test_devices() -> Vec<Device> {
    let mut v = vec![Device::Cpu];
    if tch::Cuda::is_available() {
        v.push(Device::Cuda(0));
    }
    v
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
    {
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only adjusts allocator tunables.
        unsafe {
            libc::mallopt(M_MMAP_THRESHOLD, 1 << 30);
            libc::mallopt(M_TRIM_THRESHOLD, 1 << 30);
        }
    }
}
