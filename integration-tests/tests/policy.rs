//! GRPO on real `yatt-node` processes with one policy and no replica, whose policy's
//! node is lost twice: the policy is started again on a surviving node from the last
//! checkpoint and given the updates since, and the run ends with the metrics and the
//! final checkpoint of an undisturbed run.

use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_same_run, metric_of_steps, placed, undisturbed_run, wait_for_steps, Cluster,
};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
const STEPS: u64 = 10;

/// The job: rollout, reward and reference on node 0, the policy on node 1, node 2
/// spare; a checkpoint every 3 steps. Two optimizer steps per update
/// (`optim.mini_batches = 2`): update `k` brings the policy to step `2k`.
fn grpo(prefix: &str) -> Vec<String> {
    let roles = [
        ("rollout", 0),
        ("reward", 0),
        ("reference", 0),
        ("policy", 1),
    ];
    placed(prefix, STEPS, &roles)
}

/// First the policy's process exits right after it took update 5, before it answers
/// (`YATT_FAULT_EXIT_AFTER_UPDATE=10`): an update the controller never heard of went
/// with it. A new policy on the spare takes the step-3 checkpoint and update 4, and
/// step 5 runs again. Then the new policy's node is killed (`kill -9`) after step 7,
/// at whatever point of a step that lands: a new policy again, on the last node, from
/// the step-6 checkpoint plus what followed.
#[test]
fn losing_the_policys_node_after_its_update_and_again_later_changes_nothing() {
    let t0 = Instant::now();
    let quiet = tempfile::tempdir().unwrap();
    undisturbed_run("pq", 3, CONFIG, &grpo("pq"), quiet.path());

    let mut cluster = Cluster::start_with_env(
        "pr",
        &[&[][..]; 3],
        &[(1, "YATT_FAULT_EXIT_AFTER_UPDATE", "10")],
    );
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &grpo("pr"), out.path(), false);
    wait_for_steps(out.path(), 7, &run, &cluster);
    assert!(
        out.path().join("policy-updates.bin").exists(),
        "the policy's updates since the step-6 checkpoint are not on disk"
    );
    let host = cluster
        .node_hosting("policy")
        .expect("a node hosts the policy");
    assert_eq!(
        host,
        2,
        "the new policy is not on the spare:\n{}",
        run.printed()
    );
    cluster.nodes[host].kill9();
    let printed = run.wait_success(Duration::from_secs(120), &cluster);
    let replayed = metric_of_steps(out.path(), "recovery/policy_replayed");
    // Step 5's policy started from the step-3 checkpoint and took update 4 again.
    assert_eq!(replayed.first(), Some(&(5, 1.0)), "{replayed:?}\n{printed}");
    // The second started from the step-6 checkpoint and took 7, and 8 if it was done
    // (none when the kill landed after the step-9 checkpoint).
    assert!(
        replayed[1..]
            .iter()
            .all(|&(step, n)| step >= 8 && (1.0..=2.0).contains(&n)),
        "{replayed:?}"
    );
    let recoveries = metric_of_steps(out.path(), "recovery/respawned_roles");
    assert_eq!(recoveries.len(), 2, "{recoveries:?}\n{printed}");
    assert_same_run(quiet.path(), out.path(), &printed);
    assert!(
        !out.path().join("policy-updates.bin").exists(),
        "the policy's log outlived the job"
    );
    let mut steps_s: Vec<f64> = metric_of_steps(out.path(), "timing_s/step")
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    let stalls: Vec<f64> = recoveries.iter().map(|(i, _)| steps_s[i - 1]).collect();
    steps_s.sort_by(f64::total_cmp);
    eprintln!(
        "the policy's node lost twice; replayed {replayed:?}; those steps took {stalls:.2?} s (median step {:.3} s); both runs in {:.2?}",
        steps_s[steps_s.len() / 2],
        t0.elapsed()
    );
}

/// The policy's process exits as it is asked to save the step-3 checkpoint
/// (`YATT_FAULT_EXIT_IN_POLICY_SAVE=1`): a new policy on the spare takes the job's
/// model and updates 1 to 3, the checkpoint is saved again, and the run ends as an
/// undisturbed one.
#[test]
fn losing_the_policys_node_in_a_checkpoint_save_saves_it_again_and_changes_nothing() {
    let quiet = tempfile::tempdir().unwrap();
    undisturbed_run("pc", 3, CONFIG, &grpo("pc"), quiet.path());

    let mut cluster = Cluster::start_with_env(
        "ps",
        &[&[][..]; 3],
        &[(1, "YATT_FAULT_EXIT_IN_POLICY_SAVE", "1")],
    );
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &grpo("ps"), out.path(), false);
    let printed = run.wait_success(Duration::from_secs(120), &cluster);
    assert!(
        cluster.nodes[1].exited(),
        "the policy's node should have exited in its save:\n{printed}"
    );
    assert!(
        printed.contains("a node was lost during the checkpoint"),
        "{printed}"
    );
    // The first step after the save reports the three updates given again.
    let replayed = metric_of_steps(out.path(), "recovery/policy_replayed");
    assert_eq!(replayed, [(4, 3.0)], "{printed}");
    assert_same_run(quiet.path(), out.path(), &printed);
}
