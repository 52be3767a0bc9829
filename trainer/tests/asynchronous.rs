//! Asynchronous RL (`rollout.staleness` ≥ 1) on the demo job: every sample trains
//! exactly once within the bound, in the same steps as on-policy training, the run
//! learns, and a resumed run continues as if it had not stopped.

use std::collections::BTreeSet;

use yatt_metrics::names;
use yatt_roles::SampleId;
use yatt_runtime::Node;
use yatt_trainer::{build, step_data_parallel, JobConfig, StepMetrics};

use crate::common;

/// Per step: the ids trained and the metrics, for the demo job with `sets`.
async fn run(sets: &[&str], steps: u64) -> Vec<(Vec<SampleId>, StepMetrics)> {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let job: JobConfig = common::demo_config(out.path(), &sets);
    let node = Node::builder("async-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build(&job, &node).await.unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let reports = step_data_parallel(&mut controllers).await.unwrap();
        let ids = reports
            .iter()
            .flat_map(|r| r.train.trained.iter().copied())
            .collect();
        out.push((ids, reports[0].metrics.clone()));
    }
    node.shutdown().await;
    out
}

fn metric(m: &StepMetrics, name: &str) -> f64 {
    m.get(name)
        .unwrap_or_else(|| panic!("{name} missing in step {}", m.step))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_sample_trains_once_in_the_same_step_as_on_policy_within_the_bound() {
    let steps = 6;
    let on_policy = run(&["job.steps=6"], steps).await;
    let partial = "rollout.partial_rollout={chunk_tokens=2}";
    let rollout_old = "algorithm.old_logprobs=\"rollout\"";
    for (k, chunks) in [(1u32, ""), (2, ""), (1, partial), (1, rollout_old)] {
        let staleness = format!("rollout.staleness={k}");
        for heads in ["job.controllers=1", "job.controllers=2"] {
            let mut sets = vec!["job.steps=6", &staleness, heads];
            if !chunks.is_empty() {
                sets.push(chunks);
            }
            let async_run = run(&sets, steps).await;
            let reference = match heads {
                "job.controllers=1" => on_policy.clone(),
                _ => run(&["job.steps=6", heads], steps).await,
            };
            let mut seen = BTreeSet::new();
            for (s, ((ids, m), (want, _))) in async_run.iter().zip(&reference).enumerate() {
                // The prompts of each step are those on-policy training takes in it.
                let got: BTreeSet<_> = ids.iter().copied().collect();
                let want: BTreeSet<_> = want.iter().copied().collect();
                assert_eq!(
                    got, want,
                    "staleness {k}, {heads}: step {s} trained other samples"
                );
                for id in ids {
                    assert!(seen.insert(*id), "staleness {k}: {id} trained twice");
                    assert_eq!(id.step, s as u64, "{id} trained in step {s}");
                }
                // A batch generated while step j trained trains at step j + k (the first
                // k steps' batches: as soon as they exist).
                let lag = (s as f64).min(f64::from(k));
                assert_eq!(
                    metric(m, names::STALENESS_MAX),
                    lag,
                    "staleness {k}, step {s}"
                );
                assert_eq!(metric(m, names::PENDING_BATCHES), f64::from(k));
                if s > 0 {
                    assert!(metric(m, names::SAMPLES_CARRIED) > 0.0);
                }
                assert!(metric(m, names::IS_WEIGHT_MEAN).is_finite());
                assert!(metric(m, names::LOGPROB_DIFF_MAX) >= 0.0);
                if chunks == partial {
                    assert!(metric(m, names::SAMPLES_INTERRUPTED) >= 0.0);
                }
            }
            let total: usize = reference.iter().map(|(ids, _)| ids.len()).sum();
            assert_eq!(seen.len(), total, "staleness {k}, {heads}: samples lost");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_learns_at_staleness_1_and_2() {
    let partial = "rollout.partial_rollout={chunk_tokens=2}";
    let rollout_old = "algorithm.old_logprobs=\"rollout\"";
    for (k, chunks) in [(1, ""), (2, ""), (1, partial), (1, rollout_old)] {
        let out = tempfile::tempdir().unwrap();
        let mut sets = vec!["job.steps=30".to_string(), format!("rollout.staleness={k}")];
        if !chunks.is_empty() {
            sets.push(chunks.into());
        }
        let job = common::demo_config(out.path(), &sets);
        let summary = common::train_job(&job, false).await.unwrap();
        let r = &summary.rewards;
        let first: f64 = r[..5].iter().sum::<f64>() / 5.0;
        let last: f64 = r[r.len() - 5..].iter().sum::<f64>() / 5.0;
        assert!(
            last > first + 0.4 && last > 0.8,
            "staleness {k} {chunks}: reward first 5 steps {first:.3}, last 5 {last:.3}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_steps_then_resume_then_four_equal_eight_at_staleness_1() {
    let whole = tempfile::tempdir().unwrap();
    let sets = |steps: u64| vec![format!("job.steps={steps}"), "rollout.staleness=1".into()];
    common::train_job(&common::demo_config(whole.path(), &sets(8)), false)
        .await
        .unwrap();
    let parts = tempfile::tempdir().unwrap();
    common::train_job(&common::demo_config(parts.path(), &sets(4)), false)
        .await
        .unwrap();
    // The checkpoint holds the batch generated for step 5 during step 4.
    let state = std::fs::read_to_string(parts.path().join("checkpoint/run_state.json")).unwrap();
    let state: serde_json::Value = serde_json::from_str(&state).unwrap();
    let pending = &state["controllers"][0]["pending"];
    assert_eq!(pending.as_array().map(Vec::len), Some(1), "{pending}");
    assert_eq!(pending[0]["step"], 4);
    common::train_job(&common::demo_config(parts.path(), &sets(8)), true)
        .await
        .unwrap();
    let read = |d: &std::path::Path| std::fs::read_to_string(d.join("metrics.jsonl")).unwrap();
    let (a, b) = (read(whole.path()), read(parts.path()));
    let (a, b): (Vec<_>, Vec<_>) = (a.lines().collect(), b.lines().collect());
    assert_eq!(a.len(), 8);
    assert_eq!(b.len(), 8);
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            common::deterministic_metrics(x),
            common::deterministic_metrics(y),
            "step {}",
            i + 1
        );
    }
}

#[test]
fn on_policy_old_logprobs_with_a_staleness_bound_is_refused_naming_the_fix() {
    let out = tempfile::tempdir().unwrap();
    let e = common::load_demo(
        out.path(),
        &[
            "rollout.staleness=1".into(),
            "algorithm.old_logprobs=\"on-policy\"".into(),
        ],
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("algorithm.old_logprobs") && e.contains("recompute"),
        "{e}"
    );
    let e = common::load_demo(out.path(), &["algorithm.off_policy=\"clip\"".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("decoupled") && e.contains("tis"), "{e}");
    let e = common::load_demo(
        out.path(),
        &["rollout.partial_rollout={chunk_tokens=2}".into()],
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("rollout.staleness = 1"), "{e}");
    let kv = "rollout.partial_rollout={resume=\"kv\"}";
    let e = common::load_demo(out.path(), &["rollout.staleness=1".into(), kv.into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("reprefill"), "{e}");
}
