//! The GPU check: prints one JSON line per check and exits non-zero when one fails
//! (or when NCCL is unavailable and `YATT_REQUIRE_CUDA=1`).
//! `cargo run --release -p yatt-collective --features nccl --example nccl_check`
//!
//! Lines: `availability` (library, version, or the reason); `all_reduce` (single-rank
//! in-place sum of a 256 MiB f32 buffer: mean time and algorithm bandwidth; on one rank
//! NCCL moves nothing, so this is the per-call overhead, not a link's speed); `deadline`
//! (rank 0 of 2 whose peer never joins: elapsed time against a 3 s deadline).

use cudarc::driver::{CudaContext, DevicePtr};
use serde_json::json;
use std::time::{Duration, Instant};
use yatt_collective::{
    availability, locate_nccl, nccl_version, CollectiveError, Communicator, DType, DeviceBuffer,
    UniqueId,
};

const DEADLINE: Duration = Duration::from_secs(60);

fn main() {
    let require = std::env::var("YATT_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    let avail = availability();
    println!(
        "{}",
        json!({
            "check": "availability",
            "ok": avail.is_ok(),
            "reason": avail.as_ref().err().map(|e| e.reason.clone()),
            "nccl_lib": locate_nccl().ok().map(|p| p.display().to_string()),
            "nccl_version": nccl_version(),
        })
    );
    if avail.is_err() {
        std::process::exit(if require { 1 } else { 0 });
    }
    let mut failed = false;
    match all_reduce_bandwidth() {
        Ok(line) => println!("{line}"),
        Err(e) => {
            failed = true;
            println!(
                "{}",
                json!({"check": "all_reduce", "ok": false, "error": e})
            );
        }
    }
    let line = deadline_check();
    failed |= line["ok"] != json!(true);
    println!("{line}");
    std::process::exit(i32::from(failed));
}

fn all_reduce_bandwidth() -> Result<serde_json::Value, String> {
    let ctx = CudaContext::new(0).map_err(|e| e.to_string())?;
    let stream = ctx.default_stream();
    let count = 256 << 20 >> 2; // 256 MiB of f32
    let host: Vec<f32> = (0..count).map(|i| (i % 1024) as f32).collect();
    let dev = stream.clone_htod(&host).map_err(|e| e.to_string())?;
    let ptr = dev.device_ptr(&stream).0;
    stream.synchronize().map_err(|e| e.to_string())?;
    let buf = unsafe { DeviceBuffer::new(ptr, count, DType::F32) };

    let t = Instant::now();
    let mut comm = Communicator::init(
        0,
        1,
        &UniqueId::new().map_err(|e| e.to_string())?,
        0,
        DEADLINE,
    )
    .map_err(|e| e.to_string())?;
    let init_s = t.elapsed().as_secs_f64();
    for _ in 0..3 {
        comm.all_reduce_sum(&buf, DEADLINE)
            .map_err(|e| e.to_string())?;
    }
    let iters = 20;
    let t = Instant::now();
    for _ in 0..iters {
        comm.all_reduce_sum(&buf, DEADLINE)
            .map_err(|e| e.to_string())?;
    }
    let per = t.elapsed().as_secs_f64() / iters as f64;
    let back = stream.clone_dtoh(&dev).map_err(|e| e.to_string())?;
    let correct = back == host;
    Ok(json!({
        "check": "all_reduce",
        "ok": correct,
        "bytes": buf.size_bytes(),
        "init_s": init_s,
        "mean_s": per,
        "algbw_gbps": buf.size_bytes() as f64 / per / 1e9,
        "values_correct": correct,
        "note": "one rank, in place: NCCL has nothing to move, so this measures the call (enqueue and completion polling), not a link",
    }))
}

fn deadline_check() -> serde_json::Value {
    let deadline = Duration::from_secs(3);
    let id = match UniqueId::new() {
        Ok(id) => id,
        Err(e) => return json!({"check": "deadline", "ok": false, "error": e.to_string()}),
    };
    let t = Instant::now();
    let r = Communicator::init(0, 2, &id, 0, deadline);
    let elapsed = t.elapsed();
    let ok = matches!(
        &r,
        Err(CollectiveError::Deadline {
            op: "init",
            rank: 0,
            nranks: 2,
            ..
        })
    ) && elapsed < Duration::from_secs(10);
    json!({
        "check": "deadline",
        "ok": ok,
        "deadline_s": deadline.as_secs_f64(),
        "elapsed_s": elapsed.as_secs_f64(),
        "error": r.err().map(|e| e.to_string()),
    })
}
