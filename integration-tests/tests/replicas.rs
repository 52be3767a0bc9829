//! A data-parallel policy (two replicas, one per head, averaging gradients in a ring)
//! on real `yatt-node` processes: losing a replica's node (`kill -9`) mid-run hands a
//! surviving replica's trainer state to a replacement on another node, the ring is
//! rebuilt and the step runs again; the run ends with the metrics and the final
//! weights of an undisturbed run. Losing every replica stops the run with the way to
//! resume.

use std::path::Path;
use std::time::{Duration, Instant};

use yatt_integration_tests::{
    checkpoint_digest, cluster_logs, metric_of_steps, poll, run_trajectory, steps_done, Cluster,
};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");

/// GRPO on the letters task with two heads, each with its policy replica on its node.
/// The disturbed run in `out` has the undisturbed run's (`quiet`) metrics step for step
/// and its final checkpoint bytes (weights and AdamW state).
///
/// A kill that lands after the surviving replica took the step's update but before it
/// answered keeps that update and runs the step again for its ledger only
/// (`recovery/update_committed` = 1): that step's metrics are by design not the
/// undisturbed run's, so it is left out of the comparison; the weights must still match.
fn assert_same_run(quiet: &Path, out: &Path) {
    let committed: Vec<usize> = metric_of_steps(out, "recovery/update_committed")
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .map(|(s, _)| s)
        .collect();
    let without_committed = |t: Vec<Vec<(String, String)>>| -> Vec<Vec<(String, String)>> {
        t.into_iter()
            .enumerate()
            .filter(|(i, _)| !committed.contains(&(i + 1)))
            .map(|(_, m)| m)
            .collect()
    };
    assert_eq!(
        without_committed(run_trajectory(quiet)),
        without_committed(run_trajectory(out)),
        "the disturbed run's trajectory differs (steps with a committed update left out: {committed:?})"
    );
    assert_eq!(
        checkpoint_digest(quiet),
        checkpoint_digest(out),
        "the disturbed run ends with other weights or optimizer state"
    );
}

/// The wall time of each step in `recovered` (`(step, roles respawned)`).
fn recovered_step_times(out: &Path, recovered: &[(usize, f64)]) -> Vec<String> {
    metric_of_steps(out, "timing_s/step")
        .into_iter()
        .filter(|(s, _)| recovered.iter().any(|(r, _)| r == s))
        .map(|(s, t)| format!("step {s}: {t:.2} s"))
        .collect()
}

fn replicated(steps: u64, rollout: &str, policy: [&str; 2]) -> Vec<String> {
    vec![
        format!("job.steps={steps}"),
        "job.controllers=2".into(),
        "job.policy_replicas=2".into(),
        "data.prompts_per_step=4".into(),
        "placement.mode=disaggregated".into(),
        format!("placement.rollout={rollout}"),
        format!("placement.reward={rollout}"),
        format!("placement.reference={rollout}"),
        format!("placement.policy=[\"{}\", \"{}\"]", policy[0], policy[1]),
    ]
}

#[test]
fn losing_a_policy_replicas_node_hands_its_state_to_a_replacement_and_changes_nothing() {
    let t0 = Instant::now();
    // pr-0 leads the directory and hosts nothing at first, pr-4 is a spare.
    let cluster = Cluster::start("pr", 5);
    let sets = replicated(24, "pr-3", ["pr-1", "pr-2"]);
    let quiet = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &sets, quiet.path(), false);
    let status = run.wait(Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        run.printed()
    );
    let undisturbed = t0.elapsed();

    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let mut cluster = cluster;
    // Replica 1's node, then replica 0's.
    for (victim, after) in [(2, 6), (1, 14)] {
        let reached = poll(Duration::from_secs(90), || {
            (steps_done(out.path()) >= after).then_some(())
        });
        assert!(
            reached.is_some(),
            "the run did not reach step {after}:\n{}\n{}",
            run.printed(),
            cluster_logs(&cluster)
        );
        cluster.nodes[victim].kill9();
    }
    let status = run.wait(Duration::from_secs(120));
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{printed}\n{}",
        cluster_logs(&cluster)
    );
    let recovered = metric_of_steps(out.path(), "recovery/respawned_roles");
    assert_eq!(
        recovered.iter().map(|(_, n)| *n).collect::<Vec<_>>(),
        [1.0, 1.0],
        "one replica replaced after each kill: {recovered:?}\n{printed}"
    );
    assert!(
        printed.contains("policy replica 1: pr-2 ->")
            && printed.contains("policy replica 0: pr-1 ->"),
        "{printed}"
    );
    assert_eq!(run_trajectory(quiet.path()).len(), 24);
    assert_same_run(quiet.path(), out.path());
    let stalls = recovered_step_times(out.path(), &recovered);
    eprintln!(
        "2 replica nodes killed; recovered steps {stalls:?}; undisturbed run {undisturbed:.1?}, all {:.1?}",
        t0.elapsed()
    );
    drop(cluster);
}

/// Both replicas on one node: when it dies no replica is left to copy from, and the
/// run stops naming what was lost and the checkpoint to resume from.
#[test]
fn losing_every_policy_replica_stops_the_run_with_the_resume_hint() {
    let mut cluster = Cluster::start("pl", 3);
    let mut sets = replicated(200, "pl-2", ["pl-1", "pl-1"]);
    sets.push("checkpoint.every=2".into());
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let reached = poll(Duration::from_secs(90), || {
        (steps_done(out.path()) >= 5).then_some(())
    });
    assert!(reached.is_some(), "{}", run.printed());
    cluster.nodes[1].kill9();
    let status = run.wait(Duration::from_secs(60));
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| !s.success()),
        "{status:?}\n{printed}"
    );
    assert!(
        printed.contains("every policy replica was lost")
            && printed.contains("the last checkpoint is at step")
            && printed.contains("--resume"),
        "{printed}"
    );
}

/// Regression (the chaos run of seed 1795695693460619874 stopped here): a replica that
/// dies after the ring gave its peer every gradient, so that the peer took the step's
/// update, but before it answered. The survivor is one version past the step: the
/// update is kept (the replacement takes the survivor's state), the step runs again
/// for its ledger without a second update, and the run ends with the weights of an
/// undisturbed one. `YATT_FAULT_EXIT_AFTER_UPDATE` puts the death in that window.
#[test]
fn a_replica_lost_after_its_peer_took_the_update_keeps_the_update_and_the_weights() {
    const STEPS: u64 = 8;
    const COMMITTED: usize = 4;
    let sets = replicated(STEPS, "pc-3", ["pc-1", "pc-2"]);
    let quiet = tempfile::tempdir().unwrap();
    let undisturbed = Cluster::start("pc", 5);
    let mut run = undisturbed.spawn_train(CONFIG, &sets, quiet.path(), false);
    let status = run.wait(Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        run.printed()
    );
    drop(undisturbed);

    // Replica 1's node exits right after taking update 4 (step 4), before answering.
    let version = COMMITTED.to_string();
    let cluster = Cluster::start_with_env(
        "pc",
        &[&[][..]; 5],
        &[(2, "YATT_FAULT_EXIT_AFTER_UPDATE", &version)],
    );
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let status = run.wait(Duration::from_secs(180));
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{printed}\n{}",
        cluster_logs(&cluster)
    );
    assert_eq!(
        metric_of_steps(out.path(), "recovery/update_committed"),
        [(COMMITTED, 1.0)],
        "{printed}"
    );
    assert_eq!(
        metric_of_steps(out.path(), "recovery/respawned_roles"),
        [(COMMITTED, 1.0)],
        "{printed}"
    );
    let trained = metric_of_steps(out.path(), "ledger/samples_trained");
    assert_eq!(trained.len() as u64, STEPS, "{trained:?}");
    assert!(trained.iter().all(|(_, n)| *n == 64.0), "{trained:?}");
    // The step that ran again generated its batch anew on the updated weights; every
    // other step is the undisturbed run's.
    let (a, b) = (run_trajectory(quiet.path()), run_trajectory(out.path()));
    assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        if i + 1 == COMMITTED {
            assert!(y.iter().all(|(k, _)| !k.starts_with("actor/")), "{y:?}");
        } else {
            assert_eq!(x, y, "step {} differs", i + 1);
        }
    }
    assert_eq!(
        checkpoint_digest(quiet.path()),
        checkpoint_digest(out.path()),
        "the disturbed run ends with other weights or optimizer state"
    );
}

/// Two nodes killed in the same instant: the directory leader, which holds the rollout,
/// reward and reference, and replica 1's node. The members elect a new leader, the
/// stateless roles and the replica are respawned on the two spares (the replica from
/// replica 0's state), and the run ends with the undisturbed run's metrics and weights.
#[test]
fn two_nodes_killed_at_once_the_leader_and_a_replicas_node_are_both_replaced_and_change_nothing() {
    const STEPS: u64 = 24;
    let t0 = Instant::now();
    let sets = replicated(STEPS, "pd-0", ["pd-1", "pd-2"]);
    let quiet = tempfile::tempdir().unwrap();
    let undisturbed = Cluster::start("pd", 5);
    let mut run = undisturbed.spawn_train(CONFIG, &sets, quiet.path(), false);
    let status = run.wait(Duration::from_secs(120));
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        run.printed()
    );
    drop(undisturbed);

    let mut cluster = Cluster::start("pd", 5);
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let reached = poll(Duration::from_secs(90), || {
        (steps_done(out.path()) >= 6).then_some(())
    });
    assert!(reached.is_some(), "{}", run.printed());
    cluster.nodes[0].kill9();
    cluster.nodes[2].kill9();
    let status = run.wait(Duration::from_secs(180));
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{printed}\n{}",
        cluster_logs(&cluster)
    );
    let recovered = metric_of_steps(out.path(), "recovery/respawned_roles");
    let respawned: f64 = recovered.iter().map(|(_, n)| *n).sum();
    assert!(
        respawned >= 4.0,
        "the rollout, reward, reference and replica 1 respawned: {recovered:?}\n{printed}"
    );
    let trained = metric_of_steps(out.path(), "ledger/samples_trained");
    assert_eq!(trained.len() as u64, STEPS, "{trained:?}");
    assert!(trained.iter().all(|(_, n)| *n == 64.0), "{trained:?}");
    assert_same_run(quiet.path(), out.path());
    let stalls = recovered_step_times(out.path(), &recovered);
    eprintln!(
        "leader and replica node killed at once; recovered {recovered:?}, steps {stalls:?}; all {:.1?}",
        t0.elapsed()
    );
}
