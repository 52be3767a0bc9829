//! A sharded policy (`job.policy_shards`) in real runs, embedded: its ranks are threads
//! of this process. SmolLM2-135M addition at 1, 2 and 4 shards takes the same steps
//! (loss, gradient norm and reward within 1e-4 relative); the tiny demo resumes a
//! sharded checkpoint at another shard count as if it had not stopped; PPO's critic
//! sharded (`job.critic_shards`) takes the whole critic's steps and resumes at another
//! count; combinations that are not built are refused by key.

use std::path::PathBuf;

use yatt_metrics::names;
use yatt_trainer::JobConfig;

use crate::common::{self, column, metrics};

/// Relative difference of `a` and `b`, against a floor for values near zero (a step
/// whose groups all have equal rewards has a loss of exactly 0).
fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(1e-3)
}

fn same_steps(what: &str, want: &[serde_json::Value], got: &[serde_json::Value]) {
    assert_eq!(want.len(), got.len(), "{what}: steps");
    for name in [names::PG_LOSS, names::GRAD_NORM, names::REWARDS_MEAN] {
        let (a, b) = (column(want, name), column(got, name));
        eprintln!("{what}: {name} {a:?} vs {b:?}");
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                rel(*x, *y) <= 1e-4,
                "{what}: {name} at step {step}: {x} vs {y}"
            );
        }
    }
}

/// `config/smollm2-addition.toml` on the SmolLM2 fixture, shortened: 3 steps of 2
/// prompts × 4 samples of at most 12 new tokens.
fn smollm2(out: &std::path::Path, shards: usize) -> JobConfig {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/smollm2-addition.toml");
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let sets = [
        format!("model.source={:?}", dir.display().to_string()),
        format!("job.output_dir={:?}", out.display().to_string()),
        format!("job.policy_shards={shards}"),
        "job.steps=3".into(),
        "data.samples_per_prompt=4".into(),
        "rollout.max_new_tokens=12".into(),
        "optim.micro_batch=4".into(),
    ];
    JobConfig::load(path, &sets).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn smollm2_addition_takes_the_same_steps_at_1_2_and_4_shards() {
    let mut runs = Vec::new();
    for shards in [1, 2, 4] {
        let out = tempfile::tempdir().unwrap();
        common::train_job(&smollm2(out.path(), shards), false)
            .await
            .unwrap();
        runs.push((shards, metrics(out.path())));
    }
    let (_, whole) = &runs[0];
    // Not a comparison of zeros: some step had a gradient.
    assert!(
        column(whole, names::GRAD_NORM).iter().any(|&g| g > 0.0),
        "no step had a gradient: {whole:?}"
    );
    assert!(whole[0].get(names::TRAIN_STATE_BYTES).is_none());
    for (shards, got) in &runs[1..] {
        same_steps(&format!("{shards} shards"), whole, got);
        let state = column(got, names::TRAIN_STATE_BYTES);
        let gathered = column(got, names::SHARD_GATHERED_BYTES);
        // SmolLM2-135M: 16 bytes per parameter over the ranks, plus a few units.
        let psi = 134.5e6;
        assert!(state[0] > 16.0 * psi / *shards as f64, "{state:?}");
        assert!(state[0] < 16.0 * psi / *shards as f64 + 0.5e9, "{state:?}");
        assert!(gathered[0] > 0.0, "{gathered:?}");
    }
}

/// The tiny demo with `sets`, `steps` steps, writing to `out`.
fn demo(out: &std::path::Path, steps: u64, sets: &[&str]) -> JobConfig {
    let mut all = vec![format!("job.steps={steps}"), "checkpoint.every=2".into()];
    all.extend(sets.iter().map(|s| s.to_string()));
    common::demo_config(out, &all)
}

/// A sharded run stopped after 2 steps and resumed at another shard count (2 → 3, and
/// 3 → 1: one rank over the sharded checkpoint) continues as the uninterrupted run does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_run_resumes_at_another_shard_count() {
    let whole = tempfile::tempdir().unwrap();
    common::train_job(&demo(whole.path(), 4, &["job.policy_shards=2"]), false)
        .await
        .unwrap();
    let want = metrics(whole.path());
    assert!(
        want[0].get(names::SHARD_REDUCED_BYTES).is_some(),
        "{:?}",
        want[0]
    );
    for (first, then) in [(2, 3), (3, 1)] {
        let parts = tempfile::tempdir().unwrap();
        let at = |n: usize, steps| demo(parts.path(), steps, &[&format!("job.policy_shards={n}")]);
        common::train_job(&at(first, 2), false).await.unwrap();
        assert!(yatt_engine::is_sharded_checkpoint(
            &parts.path().join("checkpoint")
        ));
        common::train_job(&at(then, 4), true).await.unwrap();
        same_steps(
            &format!("{first} -> {then} shards"),
            &want,
            &metrics(parts.path()),
        );
    }
}

/// HSDP: two heads, each with a replica of the policy sharded over 2 ranks, take the
/// steps of two heads with a replica of the whole policy each (the replicas average
/// their gradients either way), and each rank reports what it sent to its peer in
/// the other replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replicas_of_a_sharded_policy_take_the_replicated_policys_steps() {
    let base = [
        "job.controllers=2",
        "job.policy_replicas=2",
        "data.prompts_per_step=4",
    ];
    let run = |shards: usize| async move {
        let out = tempfile::tempdir().unwrap();
        let mut sets = base.to_vec();
        let n = format!("job.policy_shards={shards}");
        sets.push(&n);
        common::train_job(&demo(out.path(), 4, &sets), false)
            .await
            .unwrap();
        metrics(out.path())
    };
    let replicated = run(1).await;
    let hsdp = run(2).await;
    assert!(
        column(&replicated, names::GRAD_NORM)
            .iter()
            .any(|&g| g > 0.0),
        "no step had a gradient: {replicated:?}"
    );
    same_steps("2 replicas x 2 shards", &replicated, &hsdp);
    let sent = column(&hsdp, names::SHARD_REPLICA_BYTES);
    let state = column(&hsdp, names::TRAIN_STATE_BYTES);
    assert!(
        !sent.is_empty() && sent.iter().all(|&b| b > 0.0),
        "{sent:?}"
    );
    // Half of each rank's gradient shards goes to the other replica and half comes back:
    // 2·(R−1)/R = 1 × its gradient shards (4 of the 16 bytes per parameter it holds),
    // once per optimizer step.
    assert!(sent[0] < state[0], "{sent:?} vs {state:?}");
}

/// A reference sharded over 2 and 3 ranks scores as the whole one: with a KL loss,
/// the steps (KL included) match those of a run with the whole reference.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_reference_scores_as_the_whole_one() {
    let run = |shards: usize| async move {
        let out = tempfile::tempdir().unwrap();
        let n = format!("job.reference_shards={shards}");
        let sets = [
            "algorithm.kl_coef=0.5",
            "algorithm.kl_mode=\"loss\"",
            n.as_str(),
        ];
        common::train_job(&demo(out.path(), 3, &sets), false)
            .await
            .unwrap();
        metrics(out.path())
    };
    // The KL is left out of a step's metrics where it is exactly 0 (the first step's,
    // while the policy is still the reference).
    let kl_of = |rows: &[serde_json::Value]| -> Vec<f64> {
        rows.iter()
            .map(|m| m[names::KL_LOSS].as_f64().unwrap_or(0.0))
            .collect()
    };
    let whole = run(1).await;
    let kl = kl_of(&whole);
    assert!(kl.iter().any(|&k| k > 0.0), "no KL to compare: {kl:?}");
    for shards in [2, 3] {
        let got = run(shards).await;
        same_steps(&format!("reference over {shards} ranks"), &whole, &got);
        for (step, (a, b)) in kl.iter().zip(kl_of(&got)).enumerate() {
            assert!(rel(*a, b) <= 1e-4, "kl at step {step}: {a} vs {b}");
        }
    }
}

/// PPO's critic sharded over 2 and 3 ranks takes the whole critic's steps: its value
/// loss, gradient norm and values, and so the advantages and the policy's steps, match
/// within 1e-4 relative.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_critic_takes_the_whole_critics_steps() {
    let run = |shards: usize| async move {
        let out = tempfile::tempdir().unwrap();
        let n = format!("job.critic_shards={shards}");
        let sets = ["algorithm.name=\"ppo\"", "optim.micro_batch=3", n.as_str()];
        common::train_job(&demo(out.path(), 3, &sets), false)
            .await
            .unwrap();
        metrics(out.path())
    };
    let whole = run(1).await;
    let vf = column(&whole, names::VF_LOSS);
    assert!(
        vf.iter().all(|&v| v > 0.0),
        "no value loss to compare: {vf:?}"
    );
    for shards in [2, 3] {
        let got = run(shards).await;
        same_steps(&format!("critic over {shards} ranks"), &whole, &got);
        for name in [names::VF_LOSS, names::CRITIC_GRAD_NORM, names::VALUES_MEAN] {
            let (a, b) = (column(&whole, name), column(&got, name));
            for (step, (x, y)) in a.iter().zip(&b).enumerate() {
                assert!(
                    rel(*x, *y) <= 1e-4,
                    "{shards} ranks: {name} at step {step}: {x} vs {y}"
                );
            }
        }
    }
}

/// A run with a sharded critic stopped after 2 steps and resumed with another rank
/// count (2 → 3, and 2 → 1) continues as the uninterrupted run; a whole critic's
/// checkpoint is not resumed sharded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sharded_critic_resumes_at_another_rank_count() {
    let ppo = "algorithm.name=\"ppo\"";
    let whole = tempfile::tempdir().unwrap();
    common::train_job(&demo(whole.path(), 4, &[ppo, "job.critic_shards=2"]), false)
        .await
        .unwrap();
    let want = metrics(whole.path());
    for then in [3, 1] {
        let parts = tempfile::tempdir().unwrap();
        let at = |n: usize, steps| {
            demo(
                parts.path(),
                steps,
                &[ppo, &format!("job.critic_shards={n}")],
            )
        };
        common::train_job(&at(2, 2), false).await.unwrap();
        assert!(yatt_engine::is_sharded_checkpoint(
            &parts.path().join("checkpoint/critic")
        ));
        common::train_job(&at(then, 4), true).await.unwrap();
        let got = metrics(parts.path());
        same_steps(&format!("critic 2 -> {then} ranks"), &want, &got);
        let (a, b) = (column(&want, names::VF_LOSS), column(&got, names::VF_LOSS));
        for (step, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                rel(*x, *y) <= 1e-4,
                "2 -> {then}: vf_loss at step {step}: {x} vs {y}"
            );
        }
    }
    let unsharded = tempfile::tempdir().unwrap();
    let at = |n: usize, steps| {
        demo(
            unsharded.path(),
            steps,
            &[ppo, &format!("job.critic_shards={n}")],
        )
    };
    common::train_job(&at(1, 2), false).await.unwrap();
    let e = common::train_job(&at(2, 4), true)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("job.critic_shards"), "{e}");
}

fn refused(sets: &[&str]) -> String {
    let out = tempfile::tempdir().unwrap();
    let mut all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    all.push("job.steps=1".into());
    match common::load_demo(out.path(), &all) {
        Err(e) => e.to_string(),
        Ok(job) => {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            match rt.block_on(common::train_job(&job, false)) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("{sets:?} trained"),
            }
        }
    }
}

#[test]
fn what_a_sharded_policy_cannot_do_yet_is_refused_by_key() {
    let cases: [(&[&str], &[&str]); 10] = [
        (&["job.policy_shards=0"], &["job.policy_shards"]),
        (&["job.critic_shards=0"], &["job.critic_shards"]),
        (
            &["job.critic_shards=2"],
            &["job.critic_shards", "no critic"],
        ),
        (
            &[
                "algorithm.name=\"ppo\"",
                "job.critic_shards=2",
                "placement.time_share=\"offload\"",
            ],
            &["job.critic_shards", "placement.time_share"],
        ),
        (
            &["algorithm.name=\"ppo\"", "job.critic_shards=100000"],
            &["job.critic_shards", "at most"],
        ),
        (&["job.reference_shards=0"], &["job.reference_shards"]),
        (
            &["job.reference_shards=2", "placement.time_share=\"offload\""],
            &["job.reference_shards", "placement.time_share"],
        ),
        (
            &["job.policy_shards=2", "model.lora={rank=8, alpha=16}"],
            &["job.policy_shards", "model.lora"],
        ),
        (
            &["job.policy_shards=2", "placement.time_share=\"offload\""],
            &["job.policy_shards", "placement.time_share"],
        ),
        // The tiny model's smallest unit (the embeddings) has 97 × 64 parameters.
        (
            &["job.policy_shards=100000"],
            &["job.policy_shards", "at most 6208"],
        ),
    ];
    for (sets, words) in cases {
        let e = refused(sets);
        for w in words {
            assert!(e.contains(w), "{sets:?}: {w:?} not in {e}");
        }
    }
}
