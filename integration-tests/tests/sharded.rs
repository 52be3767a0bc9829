//! A sharded policy (`job.policy_shards`) on real `yatt-node` processes: rank `r` on
//! the node `placement.policy[r]` names, the ranks talking over QUIC. Four ranks on
//! four nodes take the steps of the whole policy on one; a critic sharded beside the
//! policy's ranks takes the whole critic's steps; a rank's node killed mid-step
//! stops the run within its deadline with the checkpoint to resume from, and never
//! hangs it.

use std::time::{Duration, Instant};

use yatt_integration_tests::{metric_of_steps, placed, poll, Cluster, TrainProc};

const CONFIG: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");

/// The job on nodes `PREFIX-0..`: rollout, reward and reference on node 0, the policy's
/// ranks on nodes 1..=shards (the whole policy on node 1 at one shard).
fn sharded(prefix: &str, steps: u64, shards: usize) -> Vec<String> {
    policy_on(prefix, steps, shards, shards)
}

/// [`sharded`] with the policy's ranks (of every replica) on nodes 1..=nodes, each
/// replica over `shards` of them.
fn policy_on(prefix: &str, steps: u64, nodes: usize, shards: usize) -> Vec<String> {
    let mut sets = placed(
        prefix,
        steps,
        &[("rollout", 0), ("reward", 0), ("reference", 0)],
    );
    let nodes: Vec<String> = (1..=nodes).map(|i| format!("\"{prefix}-{i}\"")).collect();
    sets.push(format!("placement.policy=[{}]", nodes.join(", ")));
    sets.push(format!("job.policy_shards={shards}"));
    sets
}

/// Relative difference against a floor for values near zero.
fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / a.abs().max(b.abs()).max(1e-3)
}

/// Every step's `keys` of run `got` within 1e-4 relative of run `want`'s, in each of
/// `steps` steps (a metric left out of a step's line counts as 0).
fn same_steps(want: &std::path::Path, got: &std::path::Path, keys: &[&str], steps: u64) {
    for key in keys {
        let of = |run| -> std::collections::BTreeMap<usize, f64> {
            metric_of_steps(run, key).into_iter().collect()
        };
        let (want, got) = (of(want), of(got));
        eprintln!("{key}: {want:?} vs {got:?}");
        for step in 1..=steps as usize {
            let (a, b) = (
                want.get(&step).copied().unwrap_or(0.0),
                got.get(&step).copied().unwrap_or(0.0),
            );
            assert!(rel(a, b) <= 1e-4, "{key} at step {step}: {a} vs {b}");
        }
    }
}

/// [`same_steps`] for two runs that each logged every one of `steps` steps.
fn same_runs(want: &std::path::Path, got: &std::path::Path, steps: u64) {
    for run in [want, got] {
        assert_eq!(metric_of_steps(run, STEP_KEYS[0]).len(), steps as usize);
    }
    same_steps(want, got, &STEP_KEYS, steps);
}

/// Waits until every node of `nodes` hosts an actor whose id contains one of `roles`
/// (its `/health`'s `hosted` list); fails with the run's output otherwise.
fn wait_hosted(
    cluster: &Cluster,
    run: &TrainProc,
    nodes: std::ops::RangeInclusive<usize>,
    roles: &[&str],
) {
    let hosted = poll(Duration::from_secs(60), || {
        nodes
            .clone()
            .all(|i| {
                cluster.nodes[i].health().is_some_and(|h| {
                    let hosted = h["hosted"].to_string();
                    roles.iter().any(|r| hosted.contains(r))
                })
            })
            .then_some(())
    });
    assert!(
        hosted.is_some(),
        "the ranks are not on their nodes\n{}",
        run.printed()
    );
}

const STEP_KEYS: [&str; 3] = ["actor/pg_loss", "actor/grad_norm", "critic/rewards/mean"];

#[test]
fn four_ranks_on_four_nodes_take_the_steps_of_the_whole_policy() {
    const STEPS: u64 = 4;
    let mut runs = Vec::new();
    for shards in [1, 4] {
        let prefix = format!("sh{shards}");
        let cluster = Cluster::start(&prefix, shards + 1);
        let out = tempfile::tempdir().unwrap();
        let mut run =
            cluster.spawn_train(CONFIG, &sharded(&prefix, STEPS, shards), out.path(), false);
        if shards > 1 {
            // Every rank lives on its own node while the run trains.
            wait_hosted(
                &cluster,
                &run,
                1..=shards,
                &["/policy-rank/", "/policy-sharded/"],
            );
        }
        run.wait_success(Duration::from_secs(240), &cluster);
        runs.push(out);
    }
    same_runs(runs[0].path(), runs[1].path(), STEPS);
    let state = metric_of_steps(runs[1].path(), "memory/train_state_bytes");
    assert_eq!(state.len(), STEPS as usize, "{state:?}");
    // Every step's sync reached the rollout from the ranks themselves (each sends its
    // slice), not through the controller.
    let direct = metric_of_steps(runs[1].path(), "perf/weight_sync_direct");
    assert_eq!(direct.len(), STEPS as usize, "{direct:?}");
    assert!(direct.iter().all(|(_, v)| *v == 1.0), "{direct:?}");
}

/// HSDP on daemons: two heads, each with a replica of the policy sharded over two
/// ranks on nodes of their own (four policy nodes), take the steps of two heads with a
/// replica of the whole policy each (two policy nodes); rank `r` of each replica
/// averages its gradient shards with rank `r` of the other over QUIC.
#[test]
fn two_replicas_of_two_ranks_take_the_steps_of_two_whole_replicas() {
    const STEPS: u64 = 4;
    let mut runs = Vec::new();
    for shards in [1, 2] {
        let prefix = format!("hsdp{shards}");
        let nodes = 2 * shards;
        let cluster = Cluster::start(&prefix, nodes + 1);
        let out = tempfile::tempdir().unwrap();
        let mut sets = policy_on(&prefix, STEPS, nodes, shards);
        sets.extend([
            "job.controllers=2".to_string(),
            "job.policy_replicas=2".into(),
            "data.prompts_per_step=4".into(),
        ]);
        let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
        wait_hosted(
            &cluster,
            &run,
            1..=nodes,
            &["/policy/", "/policy-rank/", "/policy-sharded/"],
        );
        run.wait_success(Duration::from_secs(300), &cluster);
        runs.push(out);
    }
    same_runs(runs[0].path(), runs[1].path(), STEPS);
    let sent = metric_of_steps(runs[1].path(), "perf/shard_replica_bytes");
    assert_eq!(sent.len(), STEPS as usize, "{sent:?}");
    assert!(sent.iter().all(|(_, v)| *v > 0.0), "{sent:?}");
}

/// A reference sharded over two ranks, beside the policy's two ranks on nodes 1 and 2,
/// scores as a whole reference on node 0 does: the same steps, the KL included.
#[test]
fn a_reference_sharded_beside_the_policys_ranks_scores_as_a_whole_one() {
    const STEPS: u64 = 3;
    let mut runs = Vec::new();
    for reference_shards in [1, 2] {
        let prefix = format!("ref{reference_shards}");
        let cluster = Cluster::start(&prefix, 3);
        let out = tempfile::tempdir().unwrap();
        let mut sets = sharded(&prefix, STEPS, 2);
        sets.extend([
            "algorithm.kl_coef=0.5".to_string(),
            "algorithm.kl_mode=\"loss\"".into(),
            format!("job.reference_shards={reference_shards}"),
        ]);
        let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
        if reference_shards > 1 {
            // Rank 0 on the policy's first node, rank 1 beside the policy's rank 1.
            let hosted = poll(Duration::from_secs(60), || {
                let on = |i: usize| {
                    cluster.nodes[i]
                        .health()
                        .map(|h| h["hosted"].to_string())
                        .unwrap_or_default()
                };
                (on(1).contains("/reference-sharded/")
                    && on(2).matches("/policy-rank/").count() == 2)
                    .then_some(())
            });
            assert!(
                hosted.is_some(),
                "the reference's ranks are not beside the policy's\n{}",
                run.printed()
            );
        }
        run.wait_success(Duration::from_secs(240), &cluster);
        runs.push(out);
    }
    let mut keys = STEP_KEYS.to_vec();
    keys.push("actor/kl_loss");
    same_steps(runs[0].path(), runs[1].path(), &keys, STEPS);
    let kl = metric_of_steps(runs[0].path(), "actor/kl_loss");
    assert!(kl.iter().any(|(_, k)| *k > 0.0), "no KL to compare: {kl:?}");
}

/// PPO's critic sharded over 2 ranks beside the policy's 2 (rank r on the node
/// `placement.policy[r]` names) takes the steps of the whole critic on one node: the
/// value loss, the critic's gradient norm and the policy's steps within 1e-4.
#[test]
fn a_critic_sharded_beside_the_policys_ranks_takes_the_whole_critics_steps() {
    const STEPS: u64 = 3;
    let mut runs = Vec::new();
    for critic_shards in [1, 2] {
        let prefix = format!("crit{critic_shards}");
        let cluster = Cluster::start(&prefix, 3);
        let out = tempfile::tempdir().unwrap();
        let mut sets = sharded(&prefix, STEPS, 2);
        sets.extend([
            "algorithm.name=\"ppo\"".to_string(),
            format!("placement.critic=\"{prefix}-0\""),
            format!("job.critic_shards={critic_shards}"),
        ]);
        let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
        if critic_shards > 1 {
            // Rank 0 on the policy's first node, rank 1 beside the policy's rank 1.
            let hosted = poll(Duration::from_secs(60), || {
                let on = |i: usize| {
                    cluster.nodes[i]
                        .health()
                        .map(|h| h["hosted"].to_string())
                        .unwrap_or_default()
                };
                (on(1).contains("/critic-sharded/") && on(2).matches("/policy-rank/").count() == 2)
                    .then_some(())
            });
            assert!(
                hosted.is_some(),
                "the critic's ranks are not beside the policy's\n{}",
                run.printed()
            );
        }
        run.wait_success(Duration::from_secs(240), &cluster);
        runs.push(out);
    }
    let mut keys = STEP_KEYS.to_vec();
    keys.extend(["critic/vf_loss", "critic/grad_norm", "critic/values/mean"]);
    same_steps(runs[0].path(), runs[1].path(), &keys, STEPS);
    let vf = metric_of_steps(runs[0].path(), "critic/vf_loss");
    assert!(
        vf.iter().all(|(_, v)| *v > 0.0),
        "no value loss to compare: {vf:?}"
    );
}

/// A rank's node killed mid-step (`kill -9`, after step 4, at whatever point of a step
/// that lands) stops the run within its deadline, naming the checkpoint and how to
/// resume; resumed on the three nodes left, at 3 shards, the run ends as an
/// uninterrupted one at 4 shards does.
#[test]
fn a_ranks_node_killed_mid_step_stops_the_run_and_it_resumes_on_three_ranks() {
    const STEPS: u64 = 12;
    let deadlines = [
        "timeouts.collective_s=15".to_string(),
        "timeouts.train_s=30".into(),
    ];
    let quiet = tempfile::tempdir().unwrap();
    {
        let cluster = Cluster::start("shq", 5);
        let mut sets = sharded("shq", STEPS, 4);
        sets.extend(deadlines.iter().cloned());
        let mut run = cluster.spawn_train(CONFIG, &sets, quiet.path(), false);
        run.wait_success(Duration::from_secs(240), &cluster);
    }
    let mut cluster = Cluster::start("shk", 5);
    let out = tempfile::tempdir().unwrap();
    let mut sets = sharded("shk", STEPS, 4);
    sets.extend(deadlines.iter().cloned());
    let mut run = cluster.spawn_train(CONFIG, &sets, out.path(), false);
    let ready = poll(Duration::from_secs(120), || {
        (metric_of_steps(out.path(), "actor/pg_loss").len() >= 4).then_some(())
    });
    assert!(
        ready.is_some(),
        "the run did not reach step 4\n{}",
        run.printed()
    );
    cluster.nodes[3].kill9();
    let killed = Instant::now();
    let status = run.wait(Duration::from_secs(120));
    let printed = run.printed();
    assert!(
        status.is_some_and(|s| !s.success()),
        "the run did not stop with an error: {status:?}\n{printed}"
    );
    let took = killed.elapsed();
    assert!(
        took < Duration::from_secs(45),
        "the stop took {took:?}\n{printed}"
    );
    assert!(
        printed.contains(&format!("yatt train --resume {}", out.path().display())),
        "no resume hint naming the run:\n{printed}"
    );
    assert!(
        printed.contains("the last checkpoint is at step"),
        "no checkpoint named:\n{printed}"
    );
    eprintln!("stopped {took:?} after the kill");

    let mut sets = vec![
        "job.policy_shards=3".to_string(),
        "placement.policy=[\"shk-1\", \"shk-2\", \"shk-4\"]".into(),
    ];
    sets.extend(deadlines.iter().cloned());
    let mut resumed = cluster.spawn_train(CONFIG, &sets, out.path(), true);
    resumed.wait_success(Duration::from_secs(240), &cluster);
    same_runs(quiet.path(), out.path(), STEPS);
}
