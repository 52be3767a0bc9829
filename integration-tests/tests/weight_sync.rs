//! How weights reach a rollout in another process (`rollout.weight_sync`), with the
//! policy and the rollout on two real `yatt-node` processes of this host: through CUDA
//! IPC where the policy's weights are on a GPU, by NCCL broadcast when asked, else as
//! byte buckets over QUIC with the reason logged, sent by the policy's node itself
//! (`relay`: through the controller). One test body for every machine: on a
//! CPU machine it checks the fallbacks and their reasons, on a GPU machine (the GPU
//! check sets `YATT_REQUIRE_CUDA=1`) that every sync went the way asked.
//!
//! The same for the gradients of two policy replicas on the two nodes
//! (`job.gradient_sync`): an NCCL all-reduce on a GPU machine, the QUIC ring otherwise.
//!
//! NCCL refuses two ranks on one GPU of one host, so each node claims a host of its
//! own (`NCCL_HOSTID`) and NCCL runs over its socket transport on loopback, as it would
//! between two hosts.

use std::path::Path;
use std::time::Duration;

use yatt_integration_tests::Cluster;

const STEPS: usize = 3;
const FALLBACK: &str = "weight sync: CUDA IPC unavailable";
const NCCL_FALLBACK: &str = "weight sync: NCCL unavailable";
const DIRECT_FALLBACK: &str = "the policy cannot send its weights to the rollouts itself";
const FIRST_SYNC_DIRECT: &str = "initial weight sync: the policy's node loaded";

/// What the first sync logs when the policy's node loaded `loaded` of the `asked` roles
/// in other processes than the controller's.
fn first_sync_direct(loaded: usize, asked: usize) -> String {
    format!("{FIRST_SYNC_DIRECT} {loaded} of {asked} roles")
}

/// Each node's NCCL settings: a host of its own, loopback sockets, no InfiniBand.
const NCCL_ENV: [(usize, &str, &str); 8] = [
    (0, "NCCL_HOSTID", "yatt-ws-0"),
    (1, "NCCL_HOSTID", "yatt-ws-1"),
    (0, "NCCL_SOCKET_IFNAME", "lo"),
    (1, "NCCL_SOCKET_IFNAME", "lo"),
    (0, "NCCL_IB_DISABLE", "1"),
    (1, "NCCL_IB_DISABLE", "1"),
    (0, "NCCL_DEBUG", "WARN"),
    (1, "NCCL_DEBUG", "WARN"),
];

fn on_gpu() -> bool {
    let gpu = yatt_engine::cuda_device_count() > 0;
    let required = std::env::var("YATT_REQUIRE_CUDA").is_ok_and(|v| v == "1");
    assert!(
        gpu || !required,
        "YATT_REQUIRE_CUDA=1 but libtorch sees no GPU"
    );
    gpu
}

/// A short job on the two nodes, with `sets` (the route under test and the placement).
fn train_with(cluster: &Cluster, out: &Path, sets: &[&str]) -> (bool, String) {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let steps = format!("job.steps={STEPS}");
    let mut all = vec![
        steps.as_str(),
        // A broken NCCL shows well inside the run's own deadline.
        "timeouts.collective_s=20",
        "placement.mode=disaggregated",
    ];
    all.extend_from_slice(sets);
    cluster.try_yatt_train(config, &all, out, Duration::from_secs(90))
}

/// The rollout and reward on ws-0, the policy and reference on ws-1.
fn train(cluster: &Cluster, out: &Path, mode: &str) -> (bool, String) {
    let mode = format!("rollout.weight_sync=\"{mode}\"");
    train_with(
        cluster,
        out,
        &[
            &mode,
            "placement.rollout=ws-0",
            "placement.reward=ws-0",
            "placement.policy=ws-1",
            "placement.reference=ws-1",
        ],
    )
}

/// `metric` of every step (`perf/weight_sync_cuda_ipc`: rollouts reached through IPC;
/// `perf/weight_sync_nccl`: by NCCL broadcast).
fn counts_of(out: &Path, metric: &str) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap();
            row[metric]
                .as_f64()
                .unwrap_or_else(|| panic!("no {metric} in {l}"))
        })
        .collect()
}

fn ipc_counts(out: &Path) -> Vec<f64> {
    counts_of(out, "perf/weight_sync_cuda_ipc")
}

fn nccl_counts(out: &Path) -> Vec<f64> {
    counts_of(out, "perf/weight_sync_nccl")
}

/// Rollouts each sync reached from the policy's node in one hop.
fn direct_counts(out: &Path) -> Vec<f64> {
    counts_of(out, "perf/weight_sync_direct")
}

/// A forced route on a CPU machine: refused before the first generation, naming the
/// key, the reason and the fix.
fn refused_before_the_first_step(out: &Path, printed: &str, key: &str, why: &str) {
    assert!(
        printed.contains("found by a sync before the first step"),
        "{printed}"
    );
    let rows = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap_or_default();
    assert_eq!(
        rows.lines().count(),
        0,
        "a step ran before the refusal:\n{printed}"
    );
    assert!(
        printed.contains(key) && printed.contains(why) && printed.contains("\"auto\""),
        "{printed}"
    );
}

#[test]
fn weights_go_through_cuda_ipc_or_nccl_on_a_gpu_host_and_as_bytes_otherwise_saying_why() {
    let gpu = on_gpu();
    let cluster = Cluster::start_with_env("ws", &[&[], &[]], &NCCL_ENV);

    // auto: IPC on a GPU (the rollout shares the policy's host, so NCCL is not needed);
    // otherwise bytes, and the log says why, once for each route.
    let auto = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, auto.path(), "auto");
    assert!(ok, "auto failed:\n{printed}");
    let counts = ipc_counts(auto.path());
    assert_eq!(counts.len(), STEPS, "{counts:?}");
    assert!(nccl_counts(auto.path()).iter().all(|&n| n == 0.0));
    if gpu {
        assert!(counts.iter().all(|&n| n == 1.0), "{counts:?}\n{printed}");
        assert!(!printed.contains(FALLBACK), "{printed}");
        assert!(direct_counts(auto.path()).iter().all(|&n| n == 0.0));
    } else {
        assert!(counts.iter().all(|&n| n == 0.0), "{counts:?}");
        // The bytes go from the policy's node to the rollout's, not through the
        // controller.
        let direct = direct_counts(auto.path());
        assert!(direct.iter().all(|&n| n == 1.0), "{direct:?}\n{printed}");
        assert_eq!(printed.matches(FALLBACK).count(), 1, "{printed}");
        assert_eq!(printed.matches(NCCL_FALLBACK).count(), 1, "{printed}");
        assert!(
            printed.contains("the policy's weights are on the CPU")
                && printed.contains("byte buckets over QUIC"),
            "{printed}"
        );
    }

    // quic: never tries IPC or NCCL.
    let quic = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, quic.path(), "quic");
    assert!(ok, "quic failed:\n{printed}");
    assert!(ipc_counts(quic.path()).iter().all(|&n| n == 0.0));
    assert!(nccl_counts(quic.path()).iter().all(|&n| n == 0.0));
    assert!(!printed.contains("CUDA IPC"), "{printed}");
    assert!(!printed.contains("NCCL"), "{printed}");
    let direct = direct_counts(quic.path());
    assert!(direct.iter().all(|&n| n == 1.0), "{direct:?}\n{printed}");
    assert!(!printed.contains(DIRECT_FALLBACK), "{printed}");
    // The first sync as well: the policy's node loads the rollout (ws-0) and the
    // reference (its own node, asked in the reference's own message types).
    assert!(printed.contains(&first_sync_direct(2, 2)), "{printed}");
    // The rollout generated with the weights the policy trained: its log-probs match
    // the trainer's recomputed ones after every sync.
    let gaps = counts_of(quic.path(), "rollout/logprob_diff_max");
    assert!(gaps.iter().all(|&g| g < 1e-3), "{gaps:?}\n{printed}");
    // Regression: the leader closed the connection of a node that announced its leave
    // before its answer went out, so every cluster run ended warning that the leave
    // went unheard.
    assert!(!printed.contains("could not tell the leader"), "{printed}");

    // relay: the buckets go through the controller, without a word about why.
    let relay = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, relay.path(), "relay");
    assert!(ok, "relay failed:\n{printed}");
    let direct = direct_counts(relay.path());
    assert!(direct.iter().all(|&n| n == 0.0), "{direct:?}");
    assert!(!printed.contains(FIRST_SYNC_DIRECT), "{printed}");
    assert!(ipc_counts(relay.path()).iter().all(|&n| n == 0.0));
    assert!(!printed.contains(DIRECT_FALLBACK), "{printed}");

    // cuda_ipc: IPC or a clear error naming the key and the reason.
    let forced = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, forced.path(), "cuda_ipc");
    if gpu {
        assert!(ok, "cuda_ipc failed on a GPU:\n{printed}");
        assert!(ipc_counts(forced.path()).iter().all(|&n| n == 1.0));
    } else {
        assert!(!ok, "cuda_ipc ran without a GPU:\n{printed}");
        refused_before_the_first_step(
            forced.path(),
            &printed,
            "rollout.weight_sync = \"cuda_ipc\"",
            "the policy's weights are on the CPU",
        );
    }

    // nccl: every sync an NCCL broadcast, or a clear error naming the key and the reason.
    let nccl = tempfile::tempdir().unwrap();
    let (ok, printed) = train(&cluster, nccl.path(), "nccl");
    if gpu {
        assert!(ok, "nccl failed on a GPU:\n{printed}");
        let counts = nccl_counts(nccl.path());
        assert_eq!(counts.len(), STEPS, "{counts:?}");
        assert!(counts.iter().all(|&n| n == 1.0), "{counts:?}\n{printed}");
        assert!(ipc_counts(nccl.path()).iter().all(|&n| n == 0.0));
    } else {
        assert!(!ok, "nccl ran without a GPU:\n{printed}");
        // The rollouts are asked first, so the policy never waits for one that cannot
        // join: the error names the rollout.
        refused_before_the_first_step(
            nccl.path(),
            &printed,
            "rollout.weight_sync = \"nccl\"",
            "ws-0/rollout/",
        );
        assert!(
            printed.contains("NCCL unavailable: the rollout's weights are on the CPU"),
            "{printed}"
        );
    }
}

/// Two heads, each with its policy replica: one on ws-0, one on ws-1.
fn train_replicated(cluster: &Cluster, out: &Path, mode: &str) -> (bool, String) {
    let mode = format!("job.gradient_sync=\"{mode}\"");
    train_with(
        cluster,
        out,
        &[
            &mode,
            "job.controllers=2",
            "job.policy_replicas=2",
            "data.prompts_per_step=4",
            "placement.rollout=ws-0",
            "placement.reward=ws-0",
            "placement.reference=ws-0",
            "placement.policy=[\"ws-0\", \"ws-1\"]",
        ],
    )
}

#[test]
fn replicas_average_gradients_through_nccl_on_a_gpu_and_over_the_ring_otherwise_saying_why() {
    const RING_FALLBACK: &str = "gradient all-reduce: NCCL unavailable";
    let gpu = on_gpu();
    let cluster = Cluster::start_with_env("ws", &[&[], &[]], &NCCL_ENV);

    let auto = tempfile::tempdir().unwrap();
    let (ok, printed) = train_replicated(&cluster, auto.path(), "auto");
    assert!(ok, "auto failed:\n{printed}");
    let counts = counts_of(auto.path(), "perf/grad_allreduce_nccl");
    assert_eq!(counts.len(), STEPS, "{counts:?}");
    let want = if gpu { 1.0 } else { 0.0 };
    assert!(counts.iter().all(|&n| n == want), "{counts:?}\n{printed}");
    match gpu {
        true => assert!(!printed.contains(RING_FALLBACK), "{printed}"),
        false => {
            assert_eq!(printed.matches(RING_FALLBACK).count(), 1, "{printed}");
            assert!(
                printed.contains("the policy's weights are on the CPU"),
                "{printed}"
            );
        }
    }

    // quic: the ring, without a word about NCCL.
    let quic = tempfile::tempdir().unwrap();
    let (ok, printed) = train_replicated(&cluster, quic.path(), "quic");
    assert!(ok, "quic failed:\n{printed}");
    let counts = counts_of(quic.path(), "perf/grad_allreduce_nccl");
    assert!(counts.iter().all(|&n| n == 0.0), "{counts:?}");
    assert!(!printed.contains(RING_FALLBACK), "{printed}");
    // The first replica (ws-0) loads the two rollouts and the reference of its own node
    // and the other replica (ws-1), so both replicas start from one model.
    assert!(printed.contains(&first_sync_direct(4, 4)), "{printed}");

    // nccl: NCCL every step, or refused before the first step naming the key and why.
    let nccl = tempfile::tempdir().unwrap();
    let (ok, printed) = train_replicated(&cluster, nccl.path(), "nccl");
    if gpu {
        assert!(ok, "nccl failed on a GPU:\n{printed}");
        let counts = counts_of(nccl.path(), "perf/grad_allreduce_nccl");
        assert!(counts.iter().all(|&n| n == 1.0), "{counts:?}\n{printed}");
    } else {
        assert!(!ok, "nccl ran without a GPU:\n{printed}");
        let rows = std::fs::read_to_string(nccl.path().join("metrics.jsonl")).unwrap_or_default();
        assert_eq!(rows.lines().count(), 0, "a step ran:\n{printed}");
        assert!(
            printed.contains("job.gradient_sync = \"nccl\"")
                && printed.contains("the policy's weights are on the CPU")
                && printed.contains("\"auto\""),
            "{printed}"
        );
    }
}
