//! The live placement over a sharded policy (`placement.policy_pool = "sharded"`): on
//! `config/live-placement.toml`'s 3 groups, a group moves between the policy's ranks
//! and the rollout while training goes on, the policy resharding in place (2 → 1 ranks
//! as responses grow, 1 → 2 as they shrink), with every sample trained once.

use std::collections::BTreeSet;

use yatt_placement::Role;
use yatt_placement::{parse_records, Record};
use yatt_runtime::Node;
use yatt_trainer::{train, JobConfig};

/// Runs `config/live-placement.toml` with a sharded policy pool and `sets`; returns its
/// placement records and each step's metrics.
async fn run(name: &str, sets: &[&str]) -> (Vec<Record>, Vec<serde_json::Value>, JobConfig) {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/live-placement.toml");
    let mut all = vec![
        format!("job.output_dir=\"{}\"", out.path().display()),
        "placement.policy_pool=\"sharded\"".to_string(),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    let job = JobConfig::load(config, &all).unwrap();
    let node = Node::builder(name)
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let summary = tokio::time::timeout(
        std::time::Duration::from_secs(400),
        train(&job, &node, |_| {}),
    )
    .await
    .expect("the run finishes in time")
    .unwrap();
    assert_eq!(summary.steps, job.job.steps);
    let text = std::fs::read_to_string(out.path().join("placement.jsonl")).unwrap();
    let metrics = std::fs::read_to_string(summary.metrics_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (parse_records(&text).unwrap(), metrics, job)
}

/// The migration that moved a group `from` one role `to` the other: its step and what
/// it did; it must have completed.
fn the_move(records: &[Record], from: Role, to: Role) -> (u64, String) {
    let (step, id) = records
        .iter()
        .find_map(|r| match r {
            Record::Decision {
                step, id, moves, ..
            } if moves
                .iter()
                .any(|m| m.from.contains(from) && m.to.contains(to)) =>
            {
                Some((*step, *id))
            }
            _ => None,
        })
        .unwrap_or_else(|| panic!("no move from the {from:?} to the {to:?}"));
    let detail = records
        .iter()
        .find_map(|r| match r {
            Record::Migrated {
                id: i, ok, detail, ..
            } if *i == id => Some((*ok, detail.clone())),
            _ => None,
        })
        .expect("the migration's outcome");
    assert!(detail.0, "the migration failed: {}", detail.1);
    (step, detail.1)
}

/// Every step trained every sample it generated (a ledger that does not balance fails
/// the run), and the policy's ranks in each step; each step's ranks.
fn shards_by_step(metrics: &[serde_json::Value]) -> Vec<(u64, u64)> {
    metrics
        .iter()
        .map(|v| {
            assert_eq!(v["training/dropped_samples"], 0.0, "{v}");
            let step = v["step"].as_u64().unwrap();
            let shards = v["perf/policy_shards"]
                .as_f64()
                .unwrap_or_else(|| panic!("step {step}: no perf/policy_shards"));
            (step, shards as u64)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn growing_responses_move_a_rank_of_the_sharded_policy_to_the_rollout() {
    let (records, metrics, job) = run("live-sharded-0", &[]).await;
    let (step, detail) = the_move(&records, Role::Policy, Role::Rollout);
    assert!(detail.contains("policy resharded 2 -> 1 ranks"), "{detail}");
    assert!(step + 3 < job.job.steps, "moved too late: step {step}");
    let shards = shards_by_step(&metrics);
    let seen: BTreeSet<u64> = shards.iter().map(|s| s.1).collect();
    assert_eq!(seen, BTreeSet::from([1, 2]), "{shards:?}");
    // 2 ranks up to the move, 1 after it (the records count steps from 0, the
    // metrics from 1).
    for (s, n) in &shards {
        assert_eq!(*n, if *s <= step + 1 { 2 } else { 1 }, "step {s}: {shards:?}");
    }
    eprintln!("moved after step {step}: {detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_responses_give_a_rollout_group_to_the_sharded_policy_as_a_rank() {
    let sets = [
        "placement.rollout_groups=2",
        "data.length=16",
        "data.length_end=4",
        "rollout.max_batch=0",
        "job.steps=24",
    ];
    let (records, metrics, _) = run("live-sharded-1", &sets).await;
    let (step, detail) = the_move(&records, Role::Rollout, Role::Policy);
    assert!(detail.contains("policy resharded 1 -> 2 ranks"), "{detail}");
    let shards = shards_by_step(&metrics);
    for (s, n) in &shards {
        assert_eq!(*n, if *s <= step + 1 { 1 } else { 2 }, "step {s}: {shards:?}");
    }
    eprintln!("moved after step {step}: {detail}");
}
