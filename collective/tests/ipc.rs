//! CUDA IPC between two processes of this host: the test exports a device buffer and
//! runs itself again as the reader (`YATT_IPC_HANDLE` carries the handle), which maps
//! the buffer and checks every byte. One GPU is enough (unlike NCCL, IPC allows two
//! processes on one device). On a CPU machine only the unavailability test does work;
//! with `YATT_REQUIRE_CUDA=1` (the GPU check) a missing GPU fails the others instead.
//! `YATT_REQUIRE_CUDA=1 cargo test --release -p yatt-collective --features nccl --test ipc`
#![cfg(feature = "nccl")]

use cudarc::driver::{sys as cu, CudaContext};
use yatt_collective::{export_ipc, ipc_availability, IpcError, IpcHandle, IpcMapping};

const HANDLE_ENV: &str = "YATT_IPC_HANDLE";
const BYTES: usize = 3 << 20;
/// The buffer starts this far into its allocation, as a tensor in libtorch's cache does.
const OFFSET: usize = 4096 + 256;

fn require_cuda() -> bool {
    std::env::var("YATT_REQUIRE_CUDA").is_ok_and(|v| v == "1")
}

fn gpu() -> bool {
    match ipc_availability() {
        Ok(()) => true,
        Err(e) if require_cuda() => panic!("YATT_REQUIRE_CUDA=1 but {e}"),
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            false
        }
    }
}

fn pattern() -> Vec<u8> {
    (0..BYTES).map(|i| (i * 31 % 251) as u8).collect()
}

#[test]
fn without_a_gpu_ipc_is_unavailable_with_a_reason_not_a_panic() {
    if ipc_availability().is_ok() {
        return; // the GPU tests below cover this machine
    }
    assert!(!require_cuda(), "YATT_REQUIRE_CUDA=1 but no CUDA IPC");
    let e = unsafe { export_ipc(0x1000, 16, 0) }.unwrap_err();
    assert!(
        matches!(&e, IpcError::Unavailable(r) if !r.is_empty()),
        "{e}"
    );
    assert!(e.to_string().starts_with("CUDA IPC unavailable: "), "{e}");
}

#[test]
fn another_process_reads_the_exported_buffer_in_place() {
    if std::env::var_os(HANDLE_ENV).is_some() || !gpu() {
        return;
    }
    let ctx = CudaContext::new(0).expect("CUDA context on GPU 0");
    ctx.bind_to_thread().unwrap();
    let mut base: cu::CUdeviceptr = 0;
    unsafe { cu::cuMemAlloc_v2(&mut base, OFFSET + BYTES).result() }.expect("cuMemAlloc");
    let ptr = base + OFFSET as u64;
    let host = pattern();
    unsafe { cu::cuMemcpyHtoD_v2(ptr, host.as_ptr().cast(), BYTES).result() }.expect("htod");
    let handle = unsafe { export_ipc(ptr, BYTES as u64, 0) }.expect("export");
    assert_eq!(handle.bytes(), BYTES as u64);

    // In this process the buffer is used in place.
    let here = IpcMapping::open(&handle, 0).expect("open in the exporter");
    assert_eq!(here.ptr(), ptr);
    drop(here);

    let json = serde_json::to_string(&handle).unwrap();
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "reader", "--nocapture", "--test-threads=1"])
        .env(HANDLE_ENV, json)
        .output()
        .expect("run the reader");
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "reader failed:\n{text}");
    assert!(text.contains("reader: every byte matches"), "{text}");
    unsafe { cu::cuMemFree_v2(base).result() }.unwrap();
}

/// The reader half of the test above (does nothing unless it set `YATT_IPC_HANDLE`).
#[test]
fn reader() {
    let Some(json) = std::env::var_os(HANDLE_ENV) else {
        return;
    };
    let handle: IpcHandle = serde_json::from_str(json.to_str().unwrap()).unwrap();
    assert_ne!(handle.pid(), std::process::id());
    let ctx = CudaContext::new(0).expect("CUDA context on GPU 0");
    ctx.bind_to_thread().unwrap();
    let mapping = IpcMapping::open(&handle, 0).expect("open the exporter's buffer");
    let mut back = vec![0u8; BYTES];
    unsafe { cu::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), mapping.ptr(), BYTES).result() }
        .expect("dtoh from the mapping");
    assert!(
        back == pattern(),
        "the mapped bytes differ from the exporter's"
    );
    // copy_out: two parts, swapped, into memory of this process.
    let half = (BYTES / 2) as u64;
    let mut own: cu::CUdeviceptr = 0;
    unsafe { cu::cuMemAlloc_v2(&mut own, BYTES).result() }.expect("cuMemAlloc");
    unsafe { mapping.copy_out(&[(half, own, half), (0, own + half, half)]) }.expect("copy_out");
    unsafe { cu::cuMemcpyDtoH_v2(back.as_mut_ptr().cast(), own, BYTES).result() }.expect("dtoh");
    let want = [&pattern()[BYTES / 2..], &pattern()[..BYTES / 2]].concat();
    assert!(back == want, "copy_out put the wrong bytes");
    unsafe { cu::cuMemFree_v2(own).result() }.unwrap();
    drop(mapping);
    println!("reader: every byte matches");
}
