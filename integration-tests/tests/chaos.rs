//! The chaos run (issue 14): GRPO with two policy replicas on five real `yatt-node`
//! processes, one of them a spare, while the harness (`yatt_integration_tests::inflict`)
//! kills random nodes (`kill -9`, each restarted a little later), kills the directory
//! leader once and freezes a node once (SIGSTOP past the failure bound, then SIGCONT).
//! Separately, the trainer itself is killed (`kill -9`) and the run continued with
//! `yatt train --resume`. Both runs must end with the metrics, step for step, and the
//! final weights and optimizer state of an undisturbed run with the same seed, and every
//! step's ledgers must have closed on every sample of the step.
//!
//! CI runs the short version (6 kills in 400 steps, one fixed schedule seed, printed).
//! `YATT_CHAOS_SEED=N` replays a schedule, `YATT_CHAOS_SEED=random` draws one; `YATT_CHAOS_KILLS` and
//! `YATT_CHAOS_STEPS` make a longer run (`scripts/chaos.sh`). A value that does not
//! parse, or too few kills or steps, fails the test.

use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_roles_released, checkpoint_digest, cluster_logs, inflict, metric_of_steps, poll,
    run_trajectory, schedule, steps_done, table_header, ChaosConfig, ChaosRng, Cluster,
    FaultRecord,
};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");

/// Samples one step trains: 2 heads × 4 prompts × 8 samples.
const PER_STEP: f64 = 64.0;

fn job(steps: u64) -> Vec<String> {
    vec![
        format!("job.steps={steps}"),
        "job.controllers=2".into(),
        "job.policy_replicas=2".into(),
        "data.prompts_per_step=4".into(),
        "checkpoint.every=5".into(),
        "placement.mode=disaggregated".into(),
        "placement.rollout=ch-3".into(),
        "placement.reward=ch-3".into(),
        "placement.reference=ch-3".into(),
        "placement.policy=[\"ch-1\", \"ch-2\"]".into(),
    ]
}

#[test]
fn a_chaos_run_ends_with_the_weights_of_an_undisturbed_one() {
    let config = ChaosConfig::from_env();
    eprintln!(
        "chaos seed {} ({} kills, {} steps): replay with YATT_CHAOS_SEED={}",
        config.seed, config.kills, config.steps, config.seed
    );
    let t_all = Instant::now();
    // ch-0 leads the directory, ch-1 and ch-2 hold the replicas, ch-3 the rollouts,
    // the reward and the reference; ch-4 is a spare.
    let sets = job(config.steps);
    let limit = Duration::from_secs(60 + 10 * config.steps);

    // The undisturbed run on a cluster of its own: the release of its roles when it
    // ends is not part of the chaos.
    let quiet = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let undisturbed = Cluster::start("ch", 5);
    let mut run = undisturbed.spawn_train(CONFIG, &sets, quiet.path(), false);
    let status = run.wait(limit);
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        run.printed()
    );
    drop(undisturbed);
    let undisturbed_s = t.elapsed().as_secs_f64();
    let want = run_trajectory(quiet.path());
    let want_weights = checkpoint_digest(quiet.path());
    assert_eq!(want.len() as u64, config.steps);

    let mut cluster = Cluster::start("ch", 5);
    let plan = schedule(&config, cluster.nodes.len());
    eprintln!("chaos schedule: {plan:?}");
    let out = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let mut records = inflict(&mut cluster, &mut run, out.path(), t0, &plan);
    let status = run.wait(limit);
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{printed}\n{}",
        cluster_logs(&cluster)
    );
    let chaos_s = t0.elapsed().as_secs_f64();
    let trained = metric_of_steps(out.path(), "ledger/samples_trained");
    assert_eq!(trained.len() as u64, config.steps, "{trained:?}");
    assert!(trained.iter().all(|(_, n)| *n == PER_STEP), "{trained:?}");
    // A step whose update a surviving replica took before its peer died ran again on
    // a batch generated anew (`recovery/update_committed`): every other step is the
    // undisturbed run's.
    let committed: Vec<usize> = metric_of_steps(out.path(), "recovery/update_committed")
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    let got = run_trajectory(out.path());
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!(
            committed.contains(&(i + 1)) || g == w,
            "the chaos run's step {} differs (seed {})",
            i + 1,
            config.seed
        );
    }
    assert_eq!(
        checkpoint_digest(out.path()),
        want_weights,
        "the chaos run ends with other weights (seed {})",
        config.seed
    );

    assert_roles_released(&cluster);
    // Every node up and seen alive by every other (a woken or restarted node may still
    // be rejoining) before the next run is built.
    let names: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();
    let settled = poll(Duration::from_secs(60), || {
        cluster
            .nodes
            .iter()
            .all(|n| names.iter().all(|m| n.sees_alive(m) == Some(true)))
            .then_some(())
    });
    assert!(
        settled.is_some(),
        "the cluster did not settle after the chaos:\n{}",
        cluster_logs(&cluster)
    );
    // The trainer itself: killed at a random point, then resumed from its checkpoint.
    let mut rng = ChaosRng::new(config.seed ^ 0x7a11);
    let kill_at = (config.steps / 3 + rng.below(config.steps / 3)) as usize;
    let resumed = tempfile::tempdir().unwrap();
    let t0 = Instant::now();
    let mut run = cluster.spawn_train(CONFIG, &sets, resumed.path(), false);
    let reached = poll(limit, || {
        if let Ok(Some(status)) = run.child.try_wait() {
            panic!(
                "the run to kill stopped by itself ({status}):\n{}\n{}",
                run.printed(),
                cluster_logs(&cluster)
            );
        }
        (steps_done(resumed.path()) >= kill_at).then_some(())
    });
    assert!(reached.is_some(), "{}", run.printed());
    let delay = Instant::now();
    let ms = Duration::from_millis(rng.below(120));
    poll(ms + Duration::from_secs(1), || {
        (delay.elapsed() >= ms).then_some(())
    });
    let at_s = t0.elapsed().as_secs_f64();
    run.kill9();
    let struck = Instant::now();
    let at_step = steps_done(resumed.path());
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(resumed.path().join("checkpoint/run_state.json")).unwrap(),
    )
    .unwrap();
    let saved = state["controllers"][0]["step"].as_u64().unwrap() as usize;
    let mut again = cluster.spawn_train(CONFIG, &[], resumed.path(), true);
    let next = poll(limit, || {
        (steps_done(resumed.path()) > at_step).then_some(())
    });
    let recovered_s = next.map(|()| struck.elapsed().as_secs_f64());
    let status = again.wait(limit);
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}\n{}",
        again.printed(),
        cluster_logs(&cluster)
    );
    assert_eq!(
        run_trajectory(resumed.path()),
        want,
        "the resumed run's trajectory differs"
    );
    assert_eq!(
        checkpoint_digest(resumed.path()),
        want_weights,
        "the resumed run ends with other weights"
    );
    let wall = metric_of_steps(resumed.path(), "timing_s/step")
        .into_iter()
        .find(|(s, _)| *s == at_step + 1)
        .map_or(f64::NAN, |(_, t)| t);
    records.push(FaultRecord {
        what: "kill -9 (trainer), then --resume".into(),
        node: "the trainer".into(),
        roles: vec!["controllers".into()],
        at_s,
        at_step,
        detected_s: None,
        recovered_s,
        recovered_step: Some((at_step + 1, wall)),
        steps_lost: at_step - saved,
    });

    eprintln!(
        "\nchaos seed {}: {} faults survived; undisturbed run {undisturbed_s:.1} s, chaos run {chaos_s:.1} s, all {:.1} s\n{}\n{}",
        config.seed,
        records.len(),
        t_all.elapsed().as_secs_f64(),
        table_header(),
        records.iter().map(FaultRecord::row).collect::<Vec<_>>().join("\n")
    );
}
