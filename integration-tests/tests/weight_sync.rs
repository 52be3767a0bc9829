//! How weights reach a rollout in another process (`rollout.weight_sync`), with the
//! policy and the rollout on two real `yatt-node` processes of this host: through CUDA
//! IPC where the policy's weights are on a GPU, else as byte buckets over QUIC with the
//! reason logged. One test body for every machine: on a CPU machine it checks the
//! fallback and its reasons, on a GPU machine (the GPU check sets `YATT_REQUIRE_CUDA=1`)
//! that every sync went through IPC.

use std::path::Path;
use std::time::Duration;

use yatt_integration_tests::Cluster;

const STEPS: usize = 3;
const FALLBACK: &str = "weight sync: CUDA IPC unavailable";

fn on_gpu() -> bool {
    let gpu = yatt_engine::cuda_device_count() > 0;
    let required = std::env::var("YATT_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    assert!(
        gpu || !required,
        "YATT_REQUIRE_CUDA=1 but libtorch sees no GPU"
    );
    gpu
}

fn train(cluster: &Cluster, out: &Path, mode: &str) -> (bool, String) {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let mode = format!("rollout.weight_sync=\"{mode}\"");
    let steps = format!("job.steps={STEPS}");
    cluster.try_yatt_train(
        config,
        &[
            &steps,
            &mode,
            "placement.mode=disaggregated",
            "placement.rollout=ws-0",
            "placement.reward=ws-0",
            "placement.policy=ws-1",
            "placement.reference=ws-1",
        ],
        out,
        Duration::from_secs(90),
    )
}

/// `perf/weight_sync_cuda_ipc` of every step: rollouts reached through IPC.
fn ipc_counts(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap();
            row["perf/weight_sync_cuda_ipc"]
                .as_f64()
                .unwrap_or_else(|| panic!("no perf/weight_sync_cuda_ipc in {l}"))
        })
        .collect()
}

#[test]
fn weights_go_through_cuda_ipc_on_a_gpu_host_and_as_bytes_otherwise_saying_why() {
    let gpu = on_gpu();
    let cluster = Cluster::start("ws", 2);

    // auto: IPC on a GPU; otherwise bytes, and the log says why, once.
    let auto = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, auto.path(), "auto");
    assert!(ok, "auto failed:\n{printed}");
    let counts = ipc_counts(auto.path());
    assert_eq!(counts.len(), STEPS, "{counts:?}");
    if gpu {
        assert!(counts.iter().all(|&n| n == 1.0), "{counts:?}\n{printed}");
        assert!(!printed.contains(FALLBACK), "{printed}");
    } else {
        assert!(counts.iter().all(|&n| n == 0.0), "{counts:?}");
        assert_eq!(printed.matches(FALLBACK).count(), 1, "{printed}");
        assert!(
            printed.contains("the policy's weights are on the CPU")
                && printed.contains("byte buckets over QUIC"),
            "{printed}"
        );
    }

    // quic: never tries IPC.
    let quic = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, quic.path(), "quic");
    assert!(ok, "quic failed:\n{printed}");
    assert!(ipc_counts(quic.path()).iter().all(|&n| n == 0.0));
    assert!(!printed.contains("CUDA IPC"), "{printed}");

    // cuda_ipc: IPC or a clear error naming the key and the reason.
    let forced = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, forced.path(), "cuda_ipc");
    if gpu {
        assert!(ok, "cuda_ipc failed on a GPU:\n{printed}");
        assert!(ipc_counts(forced.path()).iter().all(|&n| n == 1.0));
    } else {
        assert!(!ok, "cuda_ipc ran without a GPU:\n{printed}");
        // Refused before the first generation, not after a whole step.
        assert!(
            printed.contains("found by a sync before the first step"),
            "{printed}"
        );
        let rows = std::fs::read_to_string(forced.path().join("metrics.jsonl")).unwrap_or_default();
        assert_eq!(
            rows.lines().count(),
            0,
            "a step ran before the refusal:\n{printed}"
        );
        assert!(
            printed.contains("rollout.weight_sync = \"cuda_ipc\"")
                && printed.contains("the policy's weights are on the CPU")
                && printed.contains("\"auto\""),
            "{printed}"
        );
    }
}
