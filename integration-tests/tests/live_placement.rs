//! Live placement on a cluster of real `yatt-node` processes: `lv-0` runs the reward,
//! `lv-1` (two virtual devices) and `lv-2` (one) offer the three groups the rollout and
//! the policy share; the controllers and the placement actor run in this process, which
//! joins as a fourth node. The job is `config/live-placement-cluster.toml` (a tiny
//! Llama, responses growing from 4 to 64 tokens): the actor must move a group from
//! training to the rollout on a remote node, keep training with clean ledgers, and run
//! faster after the move than the cost model predicts for the old plan.

use std::time::{Duration, Instant};

use std::sync::atomic::Ordering;
use yatt_integration_tests::{poll, Cluster};
use yatt_placement::profile::Role;
use yatt_placement::record::{parse, render, Record};

use yatt_roles::builtin::{PolicyRequest, PolicyResponse};
use yatt_roles::controller::PolicyRef;
use yatt_roles::job::JobConfig;
use yatt_roles::placement_live::LivePlacement;
use yatt_roles::role::{RoleRequest, RoleResponse, WeightsUpdate};
use yatt_runtime::Node;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Every node's log so far, for a failure message.
fn cluster_logs(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| format!("--- {} ---\n{}", n.name, n.log()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Whether `node`'s `/health` lists the actor `id` among those it hosts.
fn hosts(cluster: &Cluster, node: &str, id: &str) -> Option<bool> {
    let n = cluster.nodes.iter().find(|n| n.name == node)?;
    let h = n.health()?;
    Some(h["hosted"].as_array()?.iter().any(|a| a == id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_placement_moves_a_group_from_training_to_rollout_on_a_remote_node() {
    let t0 = Instant::now();
    let cluster = Cluster::start_with("lv", &[&[], &["--virtual-devices", "2"], &[]]);
    let logs = || cluster_logs(&cluster);
    let node = Node::builder("lv-train")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .start()
        .await
        .expect("the controller joins");
    let out = tempfile::tempdir().unwrap();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/live-placement-cluster.toml"
    );
    let sets = [
        format!("job.output_dir=\"{}\"", out.path().display()),
        "placement.nodes=[\"lv-1\", \"lv-2\"]".to_string(),
        "placement.reward=\"lv-0\"".to_string(),
    ];
    let job = JobConfig::load(config, &sets).unwrap();
    let mut live = LivePlacement::build(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building the live placement: {e}\n{}", logs()));
    let built = t0.elapsed();

    // The groups are the nodes' advertised devices: lv-1's two, then lv-2's one; each
    // replica runs on its group's node, none in this process.
    let before = live.replicas();
    let layout: Vec<(&str, &str)> = before
        .iter()
        .map(|(_, n, role, _)| (n.as_str(), *role))
        .collect();
    assert_eq!(
        layout,
        [("lv-1", "rollout"), ("lv-1", "policy"), ("lv-2", "policy")]
    );
    for (g, n, _, id) in &before {
        assert_eq!(&id.name.node, n, "{g}");
    }

    let per_head = (job.data.prompts_per_step * job.data.samples_per_prompt as usize) as u64;
    let mut moved = None;
    let mut steps_s = Vec::new();
    for step in 0..job.job.steps {
        let m = live
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        steps_s.push(m.get("timing_s/step_wall").unwrap());
        // Every head's ledger closed clean: each of its samples passed every stage
        // once, none requeued or dropped, across the move too.
        let ledgers = live.last_ledgers();
        assert_eq!(ledgers.len(), job.job.controllers);
        for l in ledgers {
            assert_eq!(
                (l.step, l.samples as u64, l.requeued, l.dropped),
                (step, per_head, 0, 0),
                "step {step}"
            );
        }
        if moved.is_none() && live.routing_version() > 1 {
            moved = Some((step, live.replicas()));
        }
    }
    let trained = t0.elapsed() - built;
    let (moved_after, after) = moved.expect("a migration");

    let text = std::fs::read_to_string(live.log_path()).unwrap();
    let records = parse(&text).unwrap();
    eprintln!("{}", render(&records, 5, 5).unwrap());

    // A group moved from training to the rollout, and the migration completed.
    let (decided_at, id, group) = records
        .iter()
        .find_map(|r| match r {
            Record::Decision {
                step, id, moves, ..
            } => moves
                .iter()
                .find(|m| m.from.contains(Role::Policy) && m.to.contains(Role::Rollout))
                .map(|m| (*step, *id, m.group)),
            _ => None,
        })
        .expect("a move from the policy to the rollout");
    let migration_s = records
        .iter()
        .find_map(|r| match r {
            Record::Migrated {
                id: i,
                ok: true,
                seconds,
                ..
            } if *i == id => Some(*seconds),
            _ => None,
        })
        .expect("the migration completed");

    // The group's new rollout replica runs on the group's (remote) node, and the
    // policy replica it replaced is gone from that node.
    let (_, node_of_group, _, old_policy) = before
        .iter()
        .find(|(g, _, role, _)| *g == group && *role == "policy")
        .expect("the moved group ran a policy replica");
    let (_, _, role, new_rollout) = after
        .iter()
        .find(|(g, ..)| *g == group)
        .expect("the moved group runs a replica");
    assert_eq!(*role, "rollout");
    assert_eq!(&new_rollout.name.node, node_of_group);
    assert_ne!(new_rollout.name.node, node.name());
    let old = old_policy.to_string();
    let gone = poll(Duration::from_secs(10), || {
        (hosts(&cluster, node_of_group, &old)? == false).then_some(())
    });
    assert!(gone.is_some(), "{old} still hosted on {node_of_group}");
    assert_eq!(
        hosts(&cluster, node_of_group, &new_rollout.to_string()),
        Some(true)
    );
    // The heads follow the new routing: some head generates on the new replica.
    assert!(live
        .controllers()
        .iter()
        .any(|c| c.roles().rollout.id() == new_rollout));

    // Each move published a new plan at a later directory epoch.
    let epochs: Vec<(u64, u64)> = records
        .iter()
        .filter_map(|r| match r {
            Record::Plan {
                routing_version,
                directory_epoch,
                ..
            } => Some((*routing_version, *directory_epoch)),
            _ => None,
        })
        .collect();
    assert!(epochs.len() >= 2, "{epochs:?}");
    assert!(
        epochs
            .windows(2)
            .all(|w| w[1].0 > w[0].0 && w[1].1 > w[0].1),
        "routing versions and directory epochs {epochs:?}"
    );

    // After the move (skipping the first step on the new plan), the measured step is
    // shorter than the model's prediction for the old plan at the same workload.
    assert!(
        decided_at + 5 < job.job.steps,
        "moved too late: step {decided_at}"
    );
    let (measured, no_move): (Vec<f64>, Vec<f64>) = records
        .iter()
        .filter_map(|r| match r {
            Record::Step {
                step,
                step_s,
                no_move_s: Some(n),
                ..
            } if *step > decided_at + 1 => Some((*step_s, *n)),
            _ => None,
        })
        .unzip();
    assert!(
        measured.len() >= 3,
        "{} steps after the move",
        measured.len()
    );
    let (m, n) = (median(measured), median(no_move));
    let before_s =
        median(steps_s[moved_after.saturating_sub(5) as usize..=moved_after as usize].to_vec());
    eprintln!(
        "built in {built:.2?}, {} steps in {trained:.2?}; move decided at step {decided_at}, migration {migration_s:.3}s; step before the move {before_s:.3}s, after {m:.3}s, predicted without the move {n:.3}s",
        job.job.steps
    );
    assert!(m < n, "measured {m:.3}s, no-move prediction {n:.3}s");

    // Leaving the cluster releases every replica the run started.
    drop(live);
    node.shutdown().await;
    for n in &cluster.nodes {
        let released = poll(Duration::from_secs(10), || {
            n.health()?["hosted"].as_array()?.is_empty().then_some(())
        });
        assert!(
            released.is_some(),
            "{} still hosts {:?}",
            n.name,
            n.health()
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
}

/// A policy replica's weights now: its version and its exported buckets.
async fn replica_weights(policy: &PolicyRef) -> WeightsUpdate {
    let t = Duration::from_secs(30);
    match policy
        .ask(RoleRequest::Serve(PolicyRequest::ExportWeights), t)
        .await
        .expect("the replica exports its weights")
    {
        RoleResponse::Served(PolicyResponse::Weights(u)) => u,
        other => panic!("ExportWeights answered {other:?}"),
    }
}

/// The other way round: responses shrink from 64 tokens to 4, so training comes to
/// dominate, and the actor gives a rollout group to the policy. The new policy replica
/// starts on its node from a surviving replica's weights and optimizer state (sent as
/// bytes: the nodes share no disk), the two replicas join a new gradient ring, and
/// from then on they stay bit-identical while the gradients go replica to replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_responses_move_a_group_to_a_new_policy_replica_on_a_remote_node() {
    let t0 = Instant::now();
    let cluster = Cluster::start_with("ls", &[&[], &["--virtual-devices", "2"], &[]]);
    let logs = || cluster_logs(&cluster);
    let node = Node::builder("ls-train")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .start()
        .await
        .expect("the controller joins");
    let out = tempfile::tempdir().unwrap();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/live-placement-cluster.toml"
    );
    let sets = [
        format!("job.output_dir=\"{}\"", out.path().display()),
        "placement.nodes=[\"ls-1\", \"ls-2\"]".to_string(),
        "placement.reward=\"ls-0\"".to_string(),
        "placement.rollout_groups=2".to_string(),
        "data.length=16".to_string(),
        "data.length_end=4".to_string(),
        "rollout.max_batch=0".to_string(),
    ];
    let job = JobConfig::load(config, &sets).unwrap();
    let mut live = LivePlacement::build(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building the live placement: {e}\n{}", logs()));
    let before = live.replicas();
    let layout: Vec<(&str, &str)> = before
        .iter()
        .map(|(_, n, role, _)| (n.as_str(), *role))
        .collect();
    assert_eq!(
        layout,
        [("ls-1", "rollout"), ("ls-1", "rollout"), ("ls-2", "policy")]
    );
    let weight_bytes: u64 = replica_weights(&live.controllers()[0].roles().policy)
        .await
        .buckets
        .iter()
        .map(|b| b.data.len() as u64)
        .sum();

    let per_head = (job.data.prompts_per_step * job.data.samples_per_prompt as usize) as u64;
    let mut moved = None;
    for step in 0..job.job.steps {
        let sent = node
            .transport_stats()
            .bulk_bytes_sent
            .load(Ordering::Relaxed);
        live.step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        let sent = node
            .transport_stats()
            .bulk_bytes_sent
            .load(Ordering::Relaxed)
            - sent;
        for l in live.last_ledgers() {
            assert_eq!(
                (l.step, l.samples as u64, l.requeued, l.dropped),
                (step, per_head, 0, 0),
                "step {step}"
            );
        }
        match moved {
            None if live.routing_version() > 1 => moved = Some((step, live.replicas())),
            // On the new plan each head has its own replica; the replicas average their
            // gradients in their ring, so this process sends weights to the two
            // rollouts only (through the controllers it would send four gradient shards
            // as well, each as large as the weights).
            Some(_) => assert!(
                sent < 3 * weight_bytes,
                "step {step}: the controller sent {sent} bulk bytes for weights of {weight_bytes}"
            ),
            None => {}
        }
    }
    let records = parse(&std::fs::read_to_string(live.log_path()).unwrap()).unwrap();
    eprintln!("{}", render(&records, 5, 5).unwrap());
    let (moved_at, after) = moved.expect("a migration");
    let (id, group) = records
        .iter()
        .find_map(|r| match r {
            Record::Decision { id, moves, .. } => moves
                .iter()
                .find(|m| m.from.contains(Role::Rollout) && m.to.contains(Role::Policy))
                .map(|m| (*id, m.group)),
            _ => None,
        })
        .expect("a move from the rollout to the policy");
    let migration_s = records
        .iter()
        .find_map(|r| match r {
            Record::Migrated {
                id: i,
                ok: true,
                seconds,
                ..
            } if *i == id => Some(*seconds),
            _ => None,
        })
        .expect("the migration completed");

    // The new policy replica runs on the group's node; the rollout it replaced is gone.
    let (_, node_of_group, _, old_rollout) = before
        .iter()
        .find(|(g, _, role, _)| *g == group && *role == "rollout")
        .expect("the moved group ran a rollout replica");
    let (_, _, role, new_policy) = after
        .iter()
        .find(|(g, ..)| *g == group)
        .expect("the moved group runs a replica");
    assert_eq!(*role, "policy");
    assert_eq!(&new_policy.name.node, node_of_group);
    let old = old_rollout.to_string();
    let gone = poll(Duration::from_secs(10), || {
        (hosts(&cluster, node_of_group, &old)? == false).then_some(())
    });
    assert!(gone.is_some(), "{old} still hosted on {node_of_group}");

    // Both replicas took every update since the move, from the same state: same
    // version, bit-identical weights (a replica with fresh optimizer moments would
    // have drifted at the first update).
    let policies: Vec<PolicyRef> = live
        .controllers()
        .iter()
        .map(|c| c.roles().policy.clone())
        .collect();
    assert_eq!(policies.len(), 2);
    assert_ne!(policies[0].id(), policies[1].id());
    assert!(policies.iter().any(|p| p.id() == new_policy));
    let (a, b) = (
        replica_weights(&policies[0]).await,
        replica_weights(&policies[1]).await,
    );
    assert_eq!((a.version, b.version), (job.job.steps, job.job.steps));
    assert!(a.buckets == b.buckets, "the replicas' weights differ");
    eprintln!(
        "moved after step {moved_at} in {migration_s:.3}s (policy state hand-off included); {} steps, {:.2?} in all",
        job.job.steps,
        t0.elapsed()
    );

    drop(policies);
    drop(live);
    node.shutdown().await;
    for n in &cluster.nodes {
        let released = poll(Duration::from_secs(10), || {
            n.health()?["hosted"].as_array()?.is_empty().then_some(())
        });
        assert!(
            released.is_some(),
            "{} still hosts {:?}",
            n.name,
            n.health()
        );
    }
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "{:?}",
        t0.elapsed()
    );
}
