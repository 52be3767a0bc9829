//! MKL's kernel choice on AMD CPUs.
//!
//! The PyPI libtorch runs f32 matrix products (training's forward and backward passes,
//! unpacked inference layers) through its statically linked MKL, which picks its code
//! path by asking `mkl_serv_intel_cpu_true` whether the CPU is Intel's. On an AMD CPU
//! with AVX-512 the answer is no, and MKL runs its AVX2 kernels at half the vector
//! width: a training step of SmolLM2-135M on 2 Zen cores took 1.7× as long
//! (`cargo run --release -p yatt-engine --example train_cost`).
//!
//! MKL calls that function through the PLT, so an executable that defines and exports
//! it (the link arguments in `scripts/link_libtorch.rs`) answers instead. This one says
//! yes on Intel CPUs, as MKL's own would, and on CPUs with the AVX-512 subset MKL's
//! AVX-512 kernels use (F, CD, BW, DQ, VL); elsewhere no, so MKL keeps its own choice.
//! The arithmetic is IEEE f32 either way; only the kernels and their summation order
//! change. `YATT_MKL_VENDOR_CHECK=keep` restores MKL's answer.

/// Whether MKL should take its Intel code paths on this CPU (see the module docs).
pub fn mkl_may_use_avx512() -> bool {
    if std::env::var("YATT_MKL_VENDOR_CHECK").as_deref() == Ok("keep") {
        return is_intel();
    }
    is_intel() || has_avx512()
}

#[cfg(target_arch = "x86_64")]
fn is_intel() -> bool {
    // CPUID leaf 0: the vendor string.
    let r = std::arch::x86_64::__cpuid(0);
    let vendor: Vec<u8> = [r.ebx, r.edx, r.ecx]
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .collect();
    vendor == b"GenuineIntel"
}

#[cfg(not(target_arch = "x86_64"))]
fn is_intel() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512cd")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512dq")
        && std::arch::is_x86_feature_detected!("avx512vl")
}

#[cfg(not(target_arch = "x86_64"))]
fn has_avx512() -> bool {
    false
}

/// MKL's vendor check (see the module docs): non-zero takes MKL's Intel code paths.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[no_mangle]
pub extern "C" fn mkl_serv_intel_cpu_true() -> std::os::raw::c_int {
    std::os::raw::c_int::from(mkl_may_use_avx512())
}

#[cfg(test)]
mod tests {
    /// The executable's definition is the one libtorch's MKL resolves to.
    #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
    #[test]
    fn the_exported_vendor_check_is_the_one_the_process_resolves() {
        extern "C" {
            fn dlsym(
                handle: *mut std::ffi::c_void,
                name: *const std::ffi::c_char,
            ) -> *mut std::ffi::c_void;
        }
        // RTLD_DEFAULT: the global scope, executable first.
        let found = unsafe { dlsym(std::ptr::null_mut(), c"mkl_serv_intel_cpu_true".as_ptr()) };
        assert_eq!(
            found as usize,
            super::mkl_serv_intel_cpu_true as *const () as usize,
            "the test binary must export the vendor check (scripts/link_libtorch.rs)"
        );
    }
}
