//! End-to-end runs of the algorithms through `yatt_trainer` (every role as an actor
//! on one in-process node, the tiny model, the letters reward of
//! `config/demo-letters.toml`): PPO with a critic learns, DAPO's dynamic sampling drops
//! flat groups and keeps the ledger balanced, and a resumed run repeats an
//! uninterrupted one exactly.

use std::path::{Path, PathBuf};

use serde_json::Value;
use yatt_runtime::Node;
use yatt_trainer::JobConfig;

use crate::common;

fn demo_config(out: &Path, sets: &[&str]) -> JobConfig {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/demo-letters.toml");
    let mut all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    all.push(format!("job.output_dir={:?}", out.display().to_string()));
    JobConfig::load(path, &all).unwrap()
}

async fn run(job: &JobConfig, resume: bool) -> Vec<serde_json::Map<String, Value>> {
    let summary = common::train_job(job, resume).await.unwrap();
    metrics(&summary.metrics_path)
}

fn metrics(path: &Path) -> Vec<serde_json::Map<String, Value>> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| match serde_json::from_str(l).unwrap() {
            Value::Object(m) => m,
            other => panic!("not an object: {other}"),
        })
        .collect()
}

fn series(rows: &[serde_json::Map<String, Value>], key: &str) -> Vec<f64> {
    rows.iter()
        .map(|r| {
            r.get(key)
                .and_then(Value::as_f64)
                .unwrap_or_else(|| panic!("{key} missing in {r:?}"))
        })
        .collect()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ppo_with_a_critic_learns_the_letters_reward() {
    let dir = tempfile::tempdir().unwrap();
    let job = demo_config(
        dir.path(),
        &[
            "algorithm.name=\"ppo\"",
            "job.steps=30",
            "optim.critic_lr=1e-2",
        ],
    );
    let rows = run(&job, false).await;
    assert_eq!(rows.len(), 30);
    let r = series(&rows, "critic/rewards/mean");
    let (first, last) = (mean(&r[..5]), mean(&r[25..]));
    assert!(
        last > first + 0.3,
        "PPO did not learn: reward {first:.3} → {last:.3}"
    );
    // The critic trains and learns the returns: its loss falls.
    let vf = series(&rows, "critic/vf_loss");
    assert!(vf.iter().all(|v| v.is_finite()));
    assert!(
        mean(&vf[25..]) < mean(&vf[..5]),
        "critic loss did not fall: {vf:?}"
    );
    assert!(series(&rows, "timing_s/update_critic")
        .iter()
        .all(|t| *t > 0.0));
    // GAE advantages are whitened over the batch.
    for a in series(&rows, "critic/advantages/mean") {
        assert!(a.abs() < 1e-3, "advantages mean {a}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dapo_drops_flat_groups_and_samples_more() {
    let dir = tempfile::tempdir().unwrap();
    // Two-token responses: rewards are 0, ½ or 1, so many groups of 4 are flat at the
    // start (every sample scores 0).
    let job = demo_config(
        dir.path(),
        &[
            "algorithm.name=\"dapo\"",
            "algorithm.clip_high=0.28",
            "algorithm.max_sampling_rounds=6",
            "rollout.max_new_tokens=2",
            "data.samples_per_prompt=4",
            "data.num_prompts=64",
            "optim.micro_batch=8",
            "job.steps=8",
        ],
    );
    let rows = run(&job, false).await;
    assert_eq!(rows.len(), 8);
    let dropped = series(&rows, "dapo/groups_dropped");
    let rounds = series(&rows, "dapo/gen_rounds");
    assert!(
        dropped.iter().sum::<f64>() > 0.0,
        "no flat group was dropped: {dropped:?}"
    );
    assert!(
        rounds.iter().any(|r| *r > 1.0),
        "never sampled more: {rounds:?}"
    );
    // The ledger accounted for the dropped samples (it refuses to close otherwise).
    assert!(series(&rows, "training/dropped_samples")
        .iter()
        .zip(&dropped)
        .all(|(s, g)| *s >= *g * 4.0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_repeats_an_uninterrupted_run() {
    // Everything but wall-clock figures must be equal.
    let timing = |k: &str| {
        let k = yatt_metrics::names::without_head(k);
        k.starts_with("timing_s/") || k.starts_with("perf/")
    };
    for algo in ["grpo", "ppo"] {
        let whole = tempfile::tempdir().unwrap();
        let name = format!("algorithm.name={algo:?}");
        let sets = [name.as_str(), "job.steps=8"];
        let straight = run(&demo_config(whole.path(), &sets), false).await;

        let split = tempfile::tempdir().unwrap();
        let half = [name.as_str(), "job.steps=4"];
        run(&demo_config(split.path(), &half), false).await;
        // Resume from the run directory's own job.toml, as `yatt train --resume` does.
        let saved = JobConfig::load(
            split.path().join(yatt_trainer::JOB_FILE),
            &["job.steps=8".into()],
        )
        .unwrap();
        let resumed = run(&saved, true).await;

        assert_eq!(straight.len(), 8);
        assert_eq!(resumed.len(), 8, "{algo}: the resumed run keeps steps 1–4");
        for (step, (a, b)) in straight.iter().zip(&resumed).enumerate() {
            for (k, v) in a {
                if timing(k) {
                    continue;
                }
                assert_eq!(
                    Some(v),
                    b.get(k),
                    "{algo}, step {}: {k} differs after resuming",
                    step + 1
                );
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_single_driver_over_two_replicas_learns() {
    let dir = tempfile::tempdir().unwrap();
    let job = demo_config(
        dir.path(),
        &[
            "job.driver=\"single\"",
            "job.controllers=2",
            "data.prompts_per_step=4",
            "job.steps=30",
        ],
    );
    let rows = run(&job, false).await;
    let r = series(&rows, "critic/rewards/mean");
    let (first, last) = (mean(&r[..5]), mean(&r[25..]));
    assert!(last > first + 0.3, "reward {first:.3} → {last:.3}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_controller_benchmark_runs_both_modes() {
    use yatt_trainer::{markdown_table, run_controller_bench, ControllerBenchOptions};
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("bench-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let opts = ControllerBenchOptions {
        replicas: vec![1, 3],
        steps: 1,
        gen_time: std::time::Duration::from_millis(1),
        train_time: std::time::Duration::from_millis(1),
        ..Default::default()
    };
    let rows = run_controller_bench(&node, &opts).await.unwrap();
    assert_eq!(rows.len(), 2);
    assert_eq!(rows[1].samples, 3 * 8 * 8);
    assert!(markdown_table(&rows).contains("| 3 | 192 |"));
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_replicas_all_reduce_to_the_shared_policy_result() {
    // Two heads with one policy replica each must train exactly like two heads
    // sharing one policy: every replica applies the average of both heads' gradients.
    let timing = |k: &str| {
        let k = yatt_metrics::names::without_head(k);
        k.starts_with("timing_s/") || k.starts_with("perf/")
    };
    let base = [
        "job.controllers=2",
        "data.prompts_per_step=4",
        "job.steps=6",
    ];
    let shared_dir = tempfile::tempdir().unwrap();
    let shared = run(&demo_config(shared_dir.path(), &base), false).await;
    let replicated_dir = tempfile::tempdir().unwrap();
    let mut sets = base.to_vec();
    sets.push("job.policy_replicas=2");
    let replicated = run(&demo_config(replicated_dir.path(), &sets), false).await;
    assert_eq!(shared.len(), 6);
    for (step, (a, b)) in shared.iter().zip(&replicated).enumerate() {
        for (k, v) in a.iter().filter(|(k, _)| !timing(k)) {
            assert_eq!(Some(v), b.get(k), "step {}: {k}", step + 1);
        }
    }
    let r = series(&replicated, "critic/rewards/mean");
    assert!(r[5] > r[0], "no learning with replicas: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dr_grpo_gspo_and_cispo_train_the_demo() {
    for algo in ["dr-grpo", "gspo", "cispo"] {
        let dir = tempfile::tempdir().unwrap();
        let name = format!("algorithm.name={algo:?}");
        let job = demo_config(dir.path(), &[name.as_str(), "job.steps=3"]);
        let rows = run(&job, false).await;
        assert_eq!(rows.len(), 3, "{algo}");
        for key in ["actor/pg_loss", "actor/pg_clipfrac"] {
            let v = series(&rows, key);
            assert!(v.iter().all(|x| x.is_finite()), "{algo}: {key} = {v:?}");
        }
    }
}
