//! PPO on real `yatt-node` processes whose critic's node is lost twice: the critic,
//! which has no replica, is started again on a surviving node from the last
//! checkpoint and given the updates since, and the run ends with the metrics and the
//! final checkpoint (the critic's included) of an undisturbed run.

use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_same_run, metric_of_steps, placed, undisturbed_run, wait_for_steps, Cluster,
};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
const STEPS: u64 = 10;

/// The PPO job: rollout and reward on node 0, policy and reference on node 1, the
/// critic on node 2, a checkpoint every 3 steps.
fn ppo(prefix: &str) -> Vec<String> {
    let roles = [
        ("rollout", 0),
        ("reward", 0),
        ("policy", 1),
        ("reference", 1),
        ("critic", 2),
    ];
    let mut sets = placed(prefix, STEPS, &roles);
    sets.push("algorithm.name=\"ppo\"".into());
    sets
}

/// First the critic's process exits as it is asked for update 5, while the policy
/// takes the same step's update (`YATT_FAULT_EXIT_IN_CRITIC_UPDATE`): the call is
/// answered by a new critic built from the step-3 checkpoint plus update 4. Then the
/// new critic's node is killed (`kill -9`) after step 7, at whatever point of a step
/// that lands: a new critic again, from the step-6 checkpoint plus what followed.
#[test]
fn losing_the_critics_node_in_its_update_and_again_later_changes_nothing() {
    let t0 = Instant::now();
    let quiet = tempfile::tempdir().unwrap();
    undisturbed_run("cq", 5, CONFIG, &ppo("cq"), quiet.path());

    let mut cluster = Cluster::start_with_env(
        "cr",
        &[&[][..]; 5],
        &[(2, "YATT_FAULT_EXIT_IN_CRITIC_UPDATE", "5")],
    );
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &ppo("cr"), out.path(), false);
    wait_for_steps(out.path(), 7, &run, &cluster);
    assert!(
        out.path().join("critic-updates.bin").exists(),
        "the critic's updates since the step-6 checkpoint are not on disk"
    );
    let host = cluster
        .node_hosting("critic")
        .expect("a node hosts the critic");
    assert!(
        host != 2,
        "the critic is still on its first node:\n{}",
        run.printed()
    );
    cluster.nodes[host].kill9();
    let printed = run.wait_success(Duration::from_secs(120), &cluster);
    let replayed = metric_of_steps(out.path(), "recovery/critic_replayed");
    assert_eq!(replayed.len(), 2, "{replayed:?}\n{printed}");
    // Step 5's critic started from the step-3 checkpoint and took update 4 again.
    assert_eq!(replayed[0], (5, 1.0), "{printed}");
    // The second started from the step-6 checkpoint and took 7, and 8 if it had begun.
    let (step, n) = replayed[1];
    assert!(step >= 8 && (1.0..=2.0).contains(&n), "{replayed:?}");
    assert_same_run(quiet.path(), out.path(), &printed);
    let mut steps_s: Vec<f64> = metric_of_steps(out.path(), "timing_s/step")
        .into_iter()
        .map(|(_, s)| s)
        .collect();
    let stalls: Vec<f64> = replayed.iter().map(|(i, _)| steps_s[i - 1]).collect();
    steps_s.sort_by(f64::total_cmp);
    eprintln!(
        "the critic's node lost twice; replayed {replayed:?}; those steps took {stalls:.2?} s (median step {:.3} s); both runs in {:.2?}",
        steps_s[steps_s.len() / 2],
        t0.elapsed()
    );
}

/// The critic's process exits as it is asked for update 5, and so does the process of
/// the first new critic as it takes the logged update 4 (the spare node 3, the least
/// loaded, where it lands): a second new critic, on a node that already hosts roles,
/// takes the log and answers update 5, and the run ends as an undisturbed one.
#[test]
fn a_new_critic_lost_while_it_takes_the_log_is_replaced_again_and_changes_nothing() {
    let quiet = tempfile::tempdir().unwrap();
    undisturbed_run("cu", 4, CONFIG, &ppo("cu"), quiet.path());

    let mut cluster = Cluster::start_with_env(
        "cs",
        &[&[][..]; 4],
        &[
            (2, "YATT_FAULT_EXIT_IN_CRITIC_UPDATE", "5"),
            (3, "YATT_FAULT_EXIT_IN_CRITIC_UPDATE", "1"),
        ],
    );
    let out = tempfile::tempdir().unwrap();
    let mut run = cluster.spawn_train(CONFIG, &ppo("cs"), out.path(), false);
    let printed = run.wait_success(Duration::from_secs(120), &cluster);
    assert!(
        cluster.nodes[2].exited() && cluster.nodes[3].exited(),
        "the first critic's node and the spare should both have exited in a critic update:\n{printed}"
    );
    assert!(
        printed.contains("the new critic's node was lost while it took the logged updates"),
        "{printed}"
    );
    // Only the new critic that took the whole log counts.
    let replayed = metric_of_steps(out.path(), "recovery/critic_replayed");
    assert_eq!(replayed, [(5, 1.0)], "{printed}");
    assert_same_run(quiet.path(), out.path(), &printed);
    assert!(
        !out.path().join("critic-updates.bin").exists(),
        "the critic's log outlived the job"
    );
}
