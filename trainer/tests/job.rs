//! `config/demo-letters.toml` runs through the library entry point ([`train`]): a few
//! steps, one metrics line per step with the expected keys, a TensorBoard event file
//! with a record per step, and a saved checkpoint.

use std::path::Path;

use yatt_runtime::Node;
use yatt_trainer::{build_embedded_with, train, CustomRoles, JobConfig, JOB_FILE};

use crate::common;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_letters_writes_one_metrics_line_per_step() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        "job.steps=3".to_string(),
        format!("job.output_dir=\"{}\"", out.path().display()),
    ];
    let job = JobConfig::load(config, &sets).unwrap();
    let node = Node::builder("n0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut seen = Vec::new();
    let summary = train(&job, &node, |p| seen.push((p.step, p.total)))
        .await
        .unwrap();
    assert_eq!(seen, vec![(1, 3), (2, 3), (3, 3)]);
    assert_eq!(summary.steps, 3);
    let text = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["step"], (i + 1) as u64, "{line}");
        for key in [
            "critic/rewards/mean",
            "actor/kl",
            "actor/grad_norm",
            "perf/gen_tokens_per_s",
            "timing_s/step",
            "response_length/mean",
            "perf/process_rss_bytes",
            "perf/process_peak_rss_bytes",
        ] {
            assert!(
                v[key].as_f64().is_some_and(f64::is_finite),
                "{key} missing or not finite in {line}"
            );
        }
        let rss = v["perf/process_rss_bytes"].as_f64().unwrap();
        let peak = v["perf/process_peak_rss_bytes"].as_f64().unwrap();
        assert!(
            rss > 1e6 && peak >= rss,
            "resident {rss}, peak {peak}: {line}"
        );
    }
    let events: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let records = yatt_metrics::read_event_records(&std::fs::read(&events[0]).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        1 + 3,
        "the file_version record and one per step"
    );
    let ckpt: Vec<_> = std::fs::read_dir(out.path().join("checkpoint"))
        .unwrap()
        .collect();
    assert!(!ckpt.is_empty(), "the checkpoint directory is empty");
}

/// The demo job with `sets`, writing to `out`.
fn demo(out: &Path, sets: &[&str]) -> JobConfig {
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    common::demo_config(out, &sets)
}

fn metrics_lines(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .count()
}

/// Regression: a save deleted run_state.json and overwrote the checkpoint in place, so a
/// crash mid-save destroyed the only checkpoint. Saves now swap a complete copy in; a
/// crash between the swap's two renames leaves the new copy as `checkpoint.tmp-<pid>`,
/// which a resume puts in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_checkpoint_save_interrupted_between_its_renames_is_completed_on_resume() {
    let out = tempfile::tempdir().unwrap();
    // checkpoint.every = 1: the final save replaces the one of step 1.
    common::train_job(
        &demo(out.path(), &["job.steps=2", "checkpoint.every=1"]),
        false,
    )
    .await
    .unwrap();
    let names = |dir: &Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("checkpoint"))
            .collect();
        v.sort();
        v
    };
    assert_eq!(
        names(out.path()),
        ["checkpoint"],
        "no temporary or old copy is left"
    );
    assert!(out.path().join("checkpoint/run_state.json").is_file());
    // A crash after `checkpoint` was moved aside and before the new copy took its name.
    std::fs::rename(
        out.path().join("checkpoint"),
        out.path().join("checkpoint.tmp-4242"),
    )
    .unwrap();
    let saved = JobConfig::load(out.path().join(JOB_FILE), &["job.steps=3".into()]).unwrap();
    let summary = common::train_job(&saved, true).await.unwrap();
    assert_eq!(summary.steps, 3);
    assert_eq!(
        metrics_lines(out.path()),
        3,
        "steps 1-2 kept, step 3 appended"
    );
    assert_eq!(names(out.path()), ["checkpoint"]);
}

/// Regression: `--resume` into the directory of another run silently mixed the two.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resuming_into_the_directory_of_another_run_is_refused_naming_the_keys() {
    let out = tempfile::tempdir().unwrap();
    common::train_job(&demo(out.path(), &["job.steps=1"]), false)
        .await
        .unwrap();
    let before = std::fs::read_to_string(out.path().join(JOB_FILE)).unwrap();
    // job.steps, checkpoint.every and the placement's node names may change.
    let other = demo(
        out.path(),
        &[
            "job.steps=2",
            "optim.lr=0.01",
            "data.samples_per_prompt=4",
            "checkpoint.every=1",
            "placement.reward=\"elsewhere\"",
        ],
    );
    let e = common::train_job(&other, true)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("2 key(s)")
            && e.contains("optim.lr (run: 0.003, this job: 0.01)")
            && e.contains("data.samples_per_prompt (run: 8, this job: 4)")
            && !e.contains("checkpoint.every (")
            && e.contains("use a new job.output_dir"),
        "{e}"
    );
    assert_eq!(
        std::fs::read_to_string(out.path().join(JOB_FILE)).unwrap(),
        before,
        "the run's job.toml is untouched"
    );
    assert_eq!(metrics_lines(out.path()), 1);
    // The same run with more steps resumes.
    let same = demo(
        out.path(),
        &[
            "job.steps=2",
            "checkpoint.every=1",
            "placement.reward=\"elsewhere\"",
        ],
    );
    assert_eq!(common::train_job(&same, true).await.unwrap().steps, 2);
    assert_eq!(metrics_lines(out.path()), 2);
}

/// `[timeouts]` reach the controller's calls: a generation deadline too short for any
/// batch fails the step with the stage, the role and the deadline, and the error says
/// what the run can be resumed from (here: the checkpoint of step 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_past_its_configured_deadline_fails_the_step_and_names_the_checkpoint() {
    let out = tempfile::tempdir().unwrap();
    let first = demo(out.path(), &["job.steps=2"]);
    common::train_job(&first, false).await.unwrap();
    let tight = demo(out.path(), &["job.steps=4", "timeouts.generate_s=1e-6"]);
    let err = common::train_job(&tight, true)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("step 3") && err.contains("rollout") && err.contains("no reply"),
        "{err}"
    );
    assert!(
        err.contains("last checkpoint is at step 2") && err.contains("--resume"),
        "{err}"
    );
    assert_eq!(
        metrics_lines(out.path()),
        2,
        "nothing after the failed step is recorded"
    );
    // A run that saved nothing says so, and how to make it save.
    let fresh = tempfile::tempdir().unwrap();
    let none = demo(fresh.path(), &["job.steps=2", "timeouts.generate_s=1e-6"]);
    let err = common::train_job(&none, false)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("no checkpoint was saved") && err.contains("checkpoint.every"),
        "{err}"
    );
    // Deadlines must be positive.
    let err = common::load_demo(out.path(), &["timeouts.train_s=0".to_string()]).unwrap_err();
    assert!(err.to_string().contains("timeouts.train_s"), "{err}");
}

/// Regression: `job.steps` was always resumable, but a cosine schedule decays over it, so
/// a resume with another total silently changed the learning rate of every later step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cosine_run_cannot_resume_with_another_step_total() {
    let out = tempfile::tempdir().unwrap();
    let cosine = ["optim.schedule=\"cosine\""];
    let first = demo(out.path(), &[&["job.steps=1"][..], &cosine].concat());
    common::train_job(&first, false).await.unwrap();
    let longer = demo(out.path(), &[&["job.steps=2"][..], &cosine].concat());
    let e = common::train_job(&longer, true)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("job.steps (run: 1, this job: 2; optim.schedule"),
        "{e}"
    );
    // With a constant schedule the total may change.
    let out = tempfile::tempdir().unwrap();
    common::train_job(&demo(out.path(), &["job.steps=1"]), false)
        .await
        .unwrap();
    common::train_job(&demo(out.path(), &["job.steps=2"]), true)
        .await
        .unwrap();
}

/// The demo's tiny model on one-digit addition, which has held-out prompts to evaluate.
fn addition_demo(out: &Path, sets: &[&str]) -> JobConfig {
    let mut all = vec![
        "data.task=\"addition\"",
        "data.length=1",
        "model.max_seq_len=64",
        "reward.kind=\"numeric\"",
        "algorithm.kl_mode=\"none\"",
    ];
    all.extend_from_slice(sets);
    demo(out, &all)
}

/// `[eval]` scores the policy's checkpoint every N steps and after the last one into
/// `eval.jsonl`, as `yatt eval --checkpoint` would, and the training is the same as
/// without it, step for step.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eval_during_training_writes_eval_jsonl_and_changes_nothing_else() {
    let plain = tempfile::tempdir().unwrap();
    let evaluated = tempfile::tempdir().unwrap();
    common::train_job(&addition_demo(plain.path(), &["job.steps=3"]), false)
        .await
        .unwrap();
    let job = addition_demo(
        evaluated.path(),
        &["job.steps=3", "eval.every=2", "eval.prompts=8"],
    );
    common::train_job(&job, false).await.unwrap();
    let read = |dir: &Path, file: &str| std::fs::read_to_string(dir.join(file)).unwrap();
    let metrics = |dir: &Path| -> Vec<_> {
        read(dir, "metrics.jsonl")
            .lines()
            .map(common::deterministic_metrics)
            .collect()
    };
    assert_eq!(metrics(plain.path()), metrics(evaluated.path()));
    assert!(!plain.path().join("eval.jsonl").exists());
    let evals: Vec<serde_json::Value> = read(evaluated.path(), "eval.jsonl")
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    // Step 2 (every 2) and step 3 (the last).
    let steps: Vec<u64> = evals.iter().map(|v| v["step"].as_u64().unwrap()).collect();
    assert_eq!(steps, [2, 3], "{evals:?}");
    // The same figure as `yatt eval --checkpoint` on the final weights.
    let options = yatt_trainer::EvalOptions {
        prompts: 8,
        checkpoint: Some(evaluated.path().join("checkpoint")),
        ..Default::default()
    };
    let direct = yatt_trainer::evaluate(&job, &options).unwrap();
    assert_eq!(evals[1]["eval/accuracy"].as_f64(), Some(direct.accuracy));
    assert_eq!(evals[1]["eval/prompts"].as_u64(), Some(8));
    for v in &evals {
        let a = v["eval/accuracy"].as_f64().unwrap();
        assert!((0.0..=1.0).contains(&a), "{v}");
    }
}

/// Regression: a fresh run into a directory that held another run's `eval.jsonl`
/// appended to it, so two runs' curves were drawn as one. A fresh run now replaces the
/// file (as it does `metrics.jsonl`), `eval.before_train` writes the starting weights'
/// accuracy as step 0, and a resumed run drops lines past its checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_run_replaces_eval_jsonl_and_a_resumed_one_keeps_it_to_its_checkpoint() {
    let out = tempfile::tempdir().unwrap();
    let log = out.path().join("eval.jsonl");
    std::fs::write(&log, "{\"step\": 99, \"eval/accuracy\": 1.0}\n").unwrap();
    let steps = |n: &str| {
        addition_demo(
            out.path(),
            &[
                n,
                "eval.every=2",
                "eval.prompts=8",
                "eval.before_train=true",
            ],
        )
    };
    let job = steps("job.steps=2");
    common::train_job(&job, false).await.unwrap();
    let read = || -> Vec<serde_json::Value> {
        std::fs::read_to_string(&log)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let logged = |v: &[serde_json::Value]| -> Vec<u64> {
        v.iter().map(|e| e["step"].as_u64().unwrap()).collect()
    };
    let first = read();
    assert_eq!(logged(&first), [0, 2], "{first:?}");
    // Step 0 is the starting weights: what `yatt eval` without a checkpoint measures.
    let options = yatt_trainer::EvalOptions {
        prompts: 8,
        ..Default::default()
    };
    let start = yatt_trainer::evaluate(&job, &options).unwrap();
    assert_eq!(first[0]["eval/accuracy"].as_f64(), Some(start.accuracy));
    // A line past the checkpoint (step 2), as a run killed after evaluating leaves it.
    let mut text = std::fs::read_to_string(&log).unwrap();
    text.push_str("{\"step\": 3, \"eval/accuracy\": 0.0}\n");
    std::fs::write(&log, text).unwrap();
    common::train_job(&steps("job.steps=4"), true)
        .await
        .unwrap();
    let resumed = read();
    assert_eq!(logged(&resumed), [0, 2, 4], "{resumed:?}");
    assert_eq!(
        resumed[..2],
        first[..],
        "the resumed run rewrote earlier lines"
    );
}

/// An `[eval]` that cannot draw its prompts is refused before the first step, naming
/// the key and what to change.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_eval_without_enough_held_out_prompts_is_refused_before_training() {
    let out = tempfile::tempdir().unwrap();
    // One-digit addition has 100 questions; 16 train, so 84 are held out.
    let job = addition_demo(
        out.path(),
        &["job.steps=2", "eval.every=1", "eval.prompts=90"],
    );
    let e = common::train_job(&job, false)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("eval") && e.contains("held-out") && e.contains("eval.prompts"),
        "{e}"
    );
    assert!(
        !out.path().join("metrics.jsonl").exists(),
        "it trained first"
    );
}

/// Regression: a job left its roles running on the node when it ended (and a build that
/// failed part-way, those it had started), holding their models and names: a second job
/// on the same node (a service that trains twice) failed with "rollout/0 is already
/// running on this node". Now the job's roles stop when it ends, finished or failed,
/// and a failed build stops what it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_run_back_to_back_on_one_node_and_leave_nothing_running() {
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("n0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = demo(out.path(), &["job.steps=1"]);
    for run in 0..2 {
        let summary = train(&job, &node, |_| {}).await;
        assert_eq!(summary.unwrap().steps, 1, "run {run}");
        assert_eq!(node.hosted(), Vec::new(), "run {run} left roles running");
    }
    // A step that fails ends the job too.
    let other = tempfile::tempdir().unwrap();
    let failing = demo(other.path(), &["job.steps=1", "timeouts.generate_s=1e-6"]);
    assert!(train(&failing, &node, |_| {}).await.is_err());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !node.hosted().is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "a failed job left {:?} running",
            node.hosted()
        );
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    // A build that fails after its roles started (the checkpoint has one head, the job
    // two) stops them before it answers.
    let two_heads = demo(out.path(), &["job.steps=2", "job.controllers=2"]);
    let e = build_embedded_with(&two_heads, &node, Some(out.path()), &CustomRoles::default())
        .await
        .err()
        .expect("a resume with another number of heads was accepted")
        .to_string();
    assert!(e.contains("controller(s)"), "{e}");
    assert_eq!(
        node.hosted(),
        Vec::new(),
        "the failed build left roles running"
    );
    let resumed = demo(out.path(), &["job.steps=2"]);
    let controllers =
        build_embedded_with(&resumed, &node, Some(out.path()), &CustomRoles::default())
            .await
            .unwrap();
    assert_eq!(controllers[0].step_count(), 1);
    drop(controllers);
    node.shutdown().await;
}

/// Regression: a job whose `[roles]` failed part-way through spawning (here its stage
/// names a role no node registers) left the roles spawned before (its reward) running
/// on the node, holding their names: the same job, mended, then failed with "already
/// running". Now the spawns that succeeded are stopped before the error is returned.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_roles_section_that_fails_part_way_leaves_nothing_running() {
    use yatt_roles::{DeviceGroup, RoleActor, RoleError};
    use yatt_trainer::{reward_role, StageAt, UserRole, UserStage};

    let out = tempfile::tempdir().unwrap();
    let mut job = demo(out.path(), &["job.steps=1"]);
    job.roles.reward = Some(UserRole {
        role: "my-reward".into(),
        node: String::new(),
        args: Default::default(),
    });
    job.roles.stages = vec![UserStage {
        role: "no-such-stage".into(),
        name: String::new(),
        after: StageAt::Reward,
        node: String::new(),
        args: Default::default(),
        timeout_s: 30.0,
    }];
    let for_reward = job.clone();
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("n0")
        .dev_certs(certs.path())
        .factory_async("my-reward", move |_: serde_json::Value| {
            let job = for_reward.clone();
            async move {
                let make = move || reward_role(&job).map_err(|e| RoleError::Failed(e.to_string()));
                RoleActor::build("my-reward", make, DeviceGroup::cpu("my-reward"), 4)
                    .await
                    .map_err(|e| e.to_string())
            }
        })
        .start()
        .await
        .unwrap();
    let e = train(&job, &node, |_| {})
        .await
        .err()
        .expect("a stage no node registers was spawned")
        .to_string();
    assert!(e.contains("roles.stages[0].role"), "{e}");
    assert_eq!(
        node.hosted(),
        Vec::new(),
        "the failed [roles] left its reward running"
    );
    // Mended, the same job on the same node takes the reward's name again and trains.
    job.roles.stages.clear();
    assert_eq!(train(&job, &node, |_| {}).await.unwrap().steps, 1);
    node.shutdown().await;
}
