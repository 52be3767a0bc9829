//! With the `nccl` feature. On a CPU machine only the availability test does work (the
//! others print why they skip); with `YATT_REQUIRE_CUDA=1` (the GPU check) a missing GPU
//! or libnccl fails them instead. Run on a GPU machine with:
//! `YATT_REQUIRE_CUDA=1 cargo test --release -p yatt-collective --features nccl -- --test-threads=1`
#![cfg(feature = "nccl")]

use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use std::sync::Arc;
use std::time::{Duration, Instant};
use yatt_collective::{
    availability, CollectiveError, Communicator, DType, DeviceBuffer, ReduceOp, UniqueId,
};

const DEADLINE: Duration = Duration::from_secs(30);

fn require_cuda() -> bool {
    std::env::var("YATT_REQUIRE_CUDA").is_ok_and(|v| v == "1")
}

/// Whether the GPU tests can run; a reason to skip is a failure under YATT_REQUIRE_CUDA=1.
fn gpu() -> bool {
    match availability() {
        Ok(()) => true,
        Err(e) if require_cuda() => panic!("YATT_REQUIRE_CUDA=1 but {e}"),
        Err(e) => {
            eprintln!("skipped (no GPU): {e}");
            false
        }
    }
}

#[test]
fn availability_names_what_it_searched() {
    match availability() {
        Ok(()) => assert!(yatt_collective::locate_nccl().is_ok()),
        Err(e) => {
            assert!(!require_cuda(), "YATT_REQUIRE_CUDA=1 but {e}");
            if yatt_collective::locate_nccl().is_err() {
                // Unless YATT_NCCL_LIB pins one file, every place of the search is named.
                assert!(
                    e.reason.starts_with("libnccl not found; searched "),
                    "{}",
                    e.reason
                );
                if std::env::var_os("YATT_NCCL_LIB").is_none() {
                    for place in [
                        "libtorch in /proc/self/maps",
                        "VIRTUAL_ENV",
                        "system search path: libnccl.so.2",
                    ] {
                        assert!(
                            e.reason.contains(place),
                            "{place:?} missing from: {}",
                            e.reason
                        );
                    }
                }
            } else {
                // The torch wheel's NCCL loads on a CPU machine too; the driver is missing.
                let version = yatt_collective::nccl_version();
                eprintln!(
                    "loaded {:?}, NCCL version {version:?}",
                    yatt_collective::locate_nccl()
                );
                assert!(version.is_some_and(|v| v >= 21800), "{version:?}");
                assert!(
                    e.reason.contains("libcuda") || e.reason.contains("GPU"),
                    "{}",
                    e.reason
                );
            }
            // Constructors say the same instead of panicking.
            assert!(matches!(
                UniqueId::new(),
                Err(CollectiveError::Unavailable(_))
            ));
            let id = UniqueId::from_bytes([0; 128]);
            let r = Communicator::init(0, 1, &id, 0, Duration::from_secs(1));
            assert!(matches!(r, Err(CollectiveError::Unavailable(_))), "{r:?}");
        }
    }
}

fn stream0() -> Arc<CudaStream> {
    CudaContext::new(0)
        .expect("CUDA context on GPU 0")
        .default_stream()
}

/// Uploads `host` and returns the device buffer with the allocation that backs it.
fn upload<T: cudarc::driver::DeviceRepr>(
    stream: &Arc<CudaStream>,
    host: &[T],
    dtype: DType,
) -> (cudarc::driver::CudaSlice<T>, DeviceBuffer) {
    let dev = stream.clone_htod(host).expect("htod");
    let ptr = {
        let (p, _sync) = dev.device_ptr(stream);
        p
    };
    stream.synchronize().expect("sync after upload");
    (dev, unsafe { DeviceBuffer::new(ptr, host.len(), dtype) })
}

#[test]
fn single_rank_all_reduce_and_broadcast_give_the_right_values() {
    if !gpu() {
        return;
    }
    let stream = stream0();
    let id = UniqueId::new().expect("unique id");
    let mut comm = Communicator::init(0, 1, &id, 0, DEADLINE).expect("single-rank init");
    assert_eq!((comm.rank(), comm.nranks(), comm.device()), (0, 1, 0));

    let host: Vec<f32> = (0..1_000_003)
        .map(|i| (i % 97) as f32 * 0.5 - 3.0)
        .collect();
    let (dev, buf) = upload(&stream, &host, DType::F32);
    comm.all_reduce_sum(&buf, DEADLINE).expect("all_reduce_sum");
    assert_eq!(
        stream.clone_dtoh(&dev).unwrap(),
        host,
        "sum over one rank is the value"
    );
    comm.all_reduce_mean(&buf, DEADLINE)
        .expect("all_reduce_mean");
    assert_eq!(
        stream.clone_dtoh(&dev).unwrap(),
        host,
        "mean over one rank is the value"
    );
    comm.broadcast(&buf, 0, DEADLINE).expect("broadcast");
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), host);

    // Several buffers and dtypes in one grouped call; bf16/f16 as raw bits.
    let bf16: Vec<u16> = (0..4099)
        .map(|i| ((i % 50) as f32).to_bits().wrapping_shr(16) as u16)
        .collect();
    let f16: Vec<u16> = (0..513).map(|i| 0x3c00 + (i % 7) as u16).collect(); // 1.0, 1.0009765625, ...
    let (dev_b, buf_b) = upload(&stream, &bf16, DType::BF16);
    let (dev_h, buf_h) = upload(&stream, &f16, DType::F16);
    comm.all_reduce_many(&[buf, buf_b, buf_h], ReduceOp::Sum, DEADLINE)
        .expect("grouped all_reduce");
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), host);
    assert_eq!(stream.clone_dtoh(&dev_b).unwrap(), bf16);
    assert_eq!(stream.clone_dtoh(&dev_h).unwrap(), f16);
    assert!(!comm.is_dead());
}

#[test]
fn runs_on_a_caller_stream() {
    if !gpu() {
        return;
    }
    let ctx = CudaContext::new(0).unwrap();
    let stream = ctx.new_stream().expect("stream");
    let id = UniqueId::new().unwrap();
    let mut comm = Communicator::init(0, 1, &id, 0, DEADLINE).unwrap();
    unsafe { comm.set_stream(stream.cu_stream() as u64) };
    let host: Vec<f32> = (0..4096).map(|i| i as f32).collect();
    let (dev, buf) = upload(&stream, &host, DType::F32);
    comm.all_reduce_mean(&buf, DEADLINE)
        .expect("all_reduce on a caller stream");
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), host);
}

#[test]
fn init_with_a_missing_peer_misses_its_deadline_and_does_not_hang() {
    if !gpu() {
        return;
    }
    let id = UniqueId::new().unwrap();
    let deadline = Duration::from_secs(3);
    let start = Instant::now();
    // Rank 1 never joins.
    let err =
        Communicator::init(0, 2, &id, 0, deadline).expect_err("init cannot finish without rank 1");
    let elapsed = start.elapsed();
    eprintln!("deadline error after {elapsed:?}: {err}");
    match &err {
        CollectiveError::Deadline {
            op,
            rank,
            nranks,
            peers,
            deadline: d,
        } => {
            assert_eq!(
                (*op, *rank, *nranks, peers.as_str(), *d),
                ("init", 0, 2, "[1]", deadline)
            );
        }
        other => panic!("expected a deadline error, got {other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("init") && text.contains("rank 0 of 2") && text.contains("3s"),
        "{text}"
    );
    assert!(
        elapsed >= deadline,
        "returned before the deadline: {elapsed:?}"
    );
    assert!(
        elapsed < Duration::from_secs(10),
        "took {elapsed:?} for a 3 s deadline"
    );

    // The process can still use NCCL after the abort.
    let mut comm = Communicator::init(0, 1, &UniqueId::new().unwrap(), 0, DEADLINE)
        .expect("init after an abort");
    let stream = stream0();
    let (dev, buf) = upload(&stream, &[1.0f32, 2.0, 3.0], DType::F32);
    comm.all_reduce_sum(&buf, DEADLINE).unwrap();
    assert_eq!(stream.clone_dtoh(&dev).unwrap(), [1.0, 2.0, 3.0]);
}

// An all-reduce whose peer never posts needs two ranks that finish init; NCCL refuses
// two ranks of one communicator on the same GPU ("Duplicate GPU"), so with one GPU it
// cannot be built. The deadline loop it would exercise is the one init uses above.

/// Environment of the two-process test's children: their rank, and where rank 0 writes
/// the group's id (hex) for the parent to hand to rank 1.
const CHILD_RANK: &str = "YATT_NCCL_TEST_RANK";
const CHILD_ID: &str = "YATT_NCCL_TEST_ID";
const CHILD_ID_FILE: &str = "YATT_NCCL_TEST_ID_FILE";
/// Bytes broadcast, in buckets of a size that leaves a short last one.
const TWO_PROC_BYTES: usize = (4 << 20) + 3;
const TWO_PROC_BUCKET: usize = 1 << 20;

fn hex(id: &UniqueId) -> String {
    id.as_bytes().iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> UniqueId {
    let mut bytes = [0u8; yatt_collective::UNIQUE_ID_BYTES];
    for (i, b) in bytes.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex id");
    }
    UniqueId::from_bytes(bytes)
}

fn pattern(i: usize) -> u8 {
    (i % 251) as u8
}

/// Two processes on one GPU broadcast raw bytes in buckets, as a weight sync does. NCCL
/// refuses two ranks on one GPU of one host, so each child claims a host of its own
/// (`NCCL_HOSTID`) and the bytes go over NCCL's socket transport on loopback, as they
/// would between two hosts.
#[test]
fn two_processes_broadcast_bytes_in_buckets_on_one_gpu() {
    if !gpu() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("yatt-nccl-two-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let id_file = dir.join("id");
    let _ = std::fs::remove_file(&id_file);
    let child = |rank: usize, id: Option<&str>| {
        let mut cmd = std::process::Command::new(std::env::current_exe().unwrap());
        cmd.args(["--ignored", "--exact", "nccl_child_process", "--nocapture"])
            .env(CHILD_RANK, rank.to_string())
            .env(CHILD_ID_FILE, &id_file)
            .env("NCCL_HOSTID", format!("yatt-test-host-{rank}"))
            .env("NCCL_SOCKET_IFNAME", "lo")
            .env("NCCL_IB_DISABLE", "1");
        if let Some(id) = id {
            cmd.env(CHILD_ID, id);
        }
        cmd.spawn().expect("spawn a child")
    };
    let mut root = child(0, None);
    let start = Instant::now();
    let id = loop {
        if let Ok(s) = std::fs::read_to_string(&id_file) {
            if s.len() == 2 * yatt_collective::UNIQUE_ID_BYTES {
                break s;
            }
        }
        assert!(root.try_wait().unwrap().is_none(), "rank 0 exited early");
        assert!(start.elapsed() < DEADLINE, "rank 0 wrote no id");
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut peer = child(1, Some(&id));
    let wait = |c: &mut std::process::Child, who: &str| loop {
        if let Some(status) = c.try_wait().unwrap() {
            assert!(status.success(), "{who} failed: {status}");
            return;
        }
        if start.elapsed() > 3 * DEADLINE {
            let _ = c.kill();
            panic!("{who} still runs after {:?}", 3 * DEADLINE);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    wait(&mut root, "rank 0");
    wait(&mut peer, "rank 1");
    let _ = std::fs::remove_dir_all(&dir);
}

/// One rank of the test above; run only as its child process.
#[test]
#[ignore = "a child process of two_processes_broadcast_bytes_in_buckets_on_one_gpu"]
fn nccl_child_process() {
    let rank: usize = std::env::var(CHILD_RANK)
        .expect("run as a child of the two-process test")
        .parse()
        .unwrap();
    let stream = stream0();
    let id = match rank {
        0 => {
            let id = UniqueId::new().expect("unique id");
            let file = std::env::var(CHILD_ID_FILE).unwrap();
            let tmp = format!("{file}.tmp");
            std::fs::write(&tmp, hex(&id)).unwrap();
            std::fs::rename(&tmp, &file).unwrap();
            id
        }
        _ => unhex(&std::env::var(CHILD_ID).unwrap()),
    };
    let mut comm = Communicator::init(rank, 2, &id, 0, DEADLINE).expect("two-rank init");
    let host: Vec<u8> = match rank {
        0 => (0..TWO_PROC_BYTES).map(pattern).collect(),
        _ => vec![0; TWO_PROC_BYTES],
    };
    let (dev, whole) = upload(&stream, &host, DType::U8);
    let t = Instant::now();
    let mut start = 0;
    while start < TWO_PROC_BYTES {
        let len = TWO_PROC_BUCKET.min(TWO_PROC_BYTES - start);
        let bucket = unsafe { DeviceBuffer::new(whole.ptr() + start as u64, len, DType::U8) };
        comm.broadcast(&bucket, 0, DEADLINE)
            .expect("bucket broadcast");
        start += len;
    }
    eprintln!("rank {rank}: {TWO_PROC_BYTES} bytes in {:?}", t.elapsed());
    let got = stream.clone_dtoh(&dev).unwrap();
    let wrong = got.iter().enumerate().find(|(i, b)| **b != pattern(*i));
    assert!(wrong.is_none(), "rank {rank}: first wrong byte {wrong:?}");
}
