//! Live placement on a cluster of real `yatt-node` processes: `P-0` runs the reward,
//! `P-1` (two virtual devices) and `P-2` (one) offer the three groups the rollout and
//! the policy share; the controllers and the placement actor run in this process, which
//! joins as a fourth node. The job is `config/live-placement-cluster.toml` (a tiny
//! Llama, 2 heads). With responses growing, the actor must move a group from training
//! to the rollout on a remote node; with responses shrinking, the other way round, with
//! the new policy replica continuing from a survivor's state. Training goes on with
//! clean ledgers throughout.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_roles_released, cluster_logs, join, poll, replica_weights, yatt_bin, Cluster,
};
use yatt_placement::GroupId;
use yatt_placement::Reason;
use yatt_placement::Role;
use yatt_placement::{after_move, parse_records, render_records, Record};
use yatt_runtime::{ActorId, Node};
use yatt_trainer::JobConfig;
use yatt_trainer::JobError;
use yatt_trainer::LivePlacement;
use yatt_trainer::{GenProbe, PolicyRef, StepMetrics};

/// What runs on each group, as [`LivePlacement::replicas`] lists it.
type Replicas = Vec<(GroupId, String, &'static str, ActorId)>;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Whether `node`'s `/health` lists the actor `id` among those it hosts.
fn hosts(cluster: &Cluster, node: &str, id: &str) -> Option<bool> {
    let n = cluster.nodes.iter().find(|n| n.name == node)?;
    let h = n.health()?;
    Some(h["hosted"].as_array()?.iter().any(|a| a == id))
}

/// Each group's node and role, in group order.
fn layout(replicas: &Replicas) -> Vec<(&str, &str)> {
    replicas
        .iter()
        .map(|(_, n, role, _)| (n.as_str(), *role))
        .collect()
}

/// A live placement built on a fresh cluster.
struct Run {
    cluster: Cluster,
    node: Node,
    job: JobConfig,
    live: LivePlacement,
    _out: tempfile::TempDir,
}

/// Starts the cluster (`prefix-0..2`), joins it and builds the live placement of the
/// example config with `sets` on top; checks each replica runs on its group's node.
async fn start(prefix: &str, sets: &[&str]) -> Run {
    start_on(prefix, &[&[], &["--virtual-devices", "2"], &[]], sets).await
}

/// [`start`] on nodes `prefix-0..` started with `nodes[i]`'s extra arguments.
async fn start_on(prefix: &str, nodes: &[&[&str]], sets: &[&str]) -> Run {
    let cluster = Cluster::start_with(prefix, nodes);
    let node = join(&cluster, &format!("{prefix}-train")).await;
    let out = tempfile::tempdir().unwrap();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/live-placement-cluster.toml"
    );
    let mut all = vec![
        format!("job.output_dir=\"{}\"", out.path().display()),
        format!("placement.nodes=[\"{prefix}-1\", \"{prefix}-2\"]"),
        format!("placement.reward=\"{prefix}-0\""),
    ];
    all.extend(sets.iter().map(|s| s.to_string()));
    let job = JobConfig::load(config, &all).unwrap();
    let live = LivePlacement::build(&job, &node).await.unwrap_or_else(|e| {
        panic!(
            "building the live placement: {e}\n{}",
            cluster_logs(&cluster)
        )
    });
    for (g, n, _, id) in live.replicas() {
        assert_eq!(id.name.node, n, "{g}");
        assert_ne!(n, node.name(), "{g}");
    }
    Run {
        cluster,
        node,
        job,
        live,
        _out: out,
    }
}

/// Runs every step of the job, checking after each that every head's ledger closed
/// clean (each of its samples passed every stage once, none requeued or dropped), and
/// calls `each` with the step, its metrics and the bulk bytes this process sent during
/// it. Returns the step after which the first migration happened and the replicas then.
async fn run_all(
    r: &mut Run,
    mut each: impl FnMut(u64, &LivePlacement, &StepMetrics, u64),
) -> (u64, Replicas) {
    let per_head = (r.job.data.prompts_per_step * r.job.data.samples_per_prompt as usize) as u64;
    let bulk_sent = |n: &Node| n.transport_stats().bulk_bytes_sent.load(Ordering::Relaxed);
    let mut moved = None;
    for step in 0..r.job.job.steps {
        let sent = bulk_sent(&r.node);
        let m = r
            .live
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", cluster_logs(&r.cluster)));
        let sent = bulk_sent(&r.node) - sent;
        let ledgers = r.live.last_ledgers();
        assert_eq!(ledgers.len(), r.job.job.controllers);
        for l in ledgers {
            assert_eq!(
                (l.step, l.samples as u64, l.requeued, l.dropped),
                (step, per_head, 0, 0),
                "step {step}"
            );
        }
        if moved.is_none() && r.live.routing_version() > 1 {
            moved = Some((step, r.live.replicas()));
        }
        each(step, &r.live, &m, sent);
    }
    moved.expect("a migration")
}

/// The placement log, printed.
fn records(live: &LivePlacement) -> Vec<Record> {
    let records = parse_records(&std::fs::read_to_string(live.log_path()).unwrap()).unwrap();
    eprintln!("{}", render_records(&records, 5, 5).unwrap());
    records
}

/// The first decision that moves a group from `from` to `to`: its step, the group and
/// the seconds its (completed) migration took.
fn find_move(records: &[Record], from: Role, to: Role) -> (u64, GroupId, f64) {
    let (step, id, group) = records
        .iter()
        .find_map(|r| match r {
            Record::Decision {
                step, id, moves, ..
            } => moves
                .iter()
                .find(|m| m.from.contains(from) && m.to.contains(to))
                .map(|m| (*step, *id, m.group)),
            _ => None,
        })
        .unwrap_or_else(|| panic!("no move from {from:?} to {to:?}"));
    let seconds = records
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
    (step, group, seconds)
}

/// Checks that `group` ran a `was` replica before and runs a `now` replica after, on
/// the same node, and that the node no longer hosts the old one. Returns the new one.
fn assert_replaced(
    cluster: &Cluster,
    (before, after): (&Replicas, &Replicas),
    group: GroupId,
    was: &str,
    now: &str,
) -> ActorId {
    let (_, node, _, old_id) = before
        .iter()
        .find(|(g, _, role, _)| *g == group && *role == was)
        .unwrap_or_else(|| panic!("{group} ran no {was} replica: {before:?}"));
    let (_, _, role, new) = after
        .iter()
        .find(|(g, ..)| *g == group)
        .expect("the moved group runs a replica");
    assert_eq!(*role, now);
    assert_eq!(&new.name.node, node);
    let old = old_id.to_string();
    let gone = poll(Duration::from_secs(10), || {
        (!hosts(cluster, node, &old)?).then_some(())
    });
    assert!(gone.is_some(), "{old} still hosted on {node}");
    assert_eq!(hosts(cluster, node, &new.to_string()), Some(true));
    if was == "policy" {
        // Its end of the gradient ring went with it.
        let ring = format!("{node}/policy-ring/{}#", old_id.name.replica);
        let closed = poll(Duration::from_secs(10), || {
            let n = cluster.nodes.iter().find(|n| &n.name == node)?;
            let hosted = n.health()?["hosted"].as_array()?.clone();
            (!hosted
                .iter()
                .any(|a| a.as_str().is_some_and(|a| a.starts_with(&ring))))
            .then_some(())
        });
        assert!(closed.is_some(), "{ring}* still hosted on {node}");
    }
    new.clone()
}

/// Leaves the cluster and checks every replica the run started is released.
async fn finish(r: Run) {
    drop(r.live);
    r.node.shutdown().await;
    assert_roles_released(&r.cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_placement_moves_a_group_from_training_to_rollout_on_a_remote_node() {
    let t0 = Instant::now();
    let mut r = start("lv", &[]).await;
    let built = t0.elapsed();
    // The groups are the nodes' advertised devices: lv-1's two, then lv-2's one.
    let before = r.live.replicas();
    assert_eq!(
        layout(&before),
        [("lv-1", "rollout"), ("lv-1", "policy"), ("lv-2", "policy")]
    );
    let mut steps_s = Vec::new();
    let (moved_after, after) = run_all(&mut r, |_, _, m, _| {
        steps_s.push(m.get("timing_s/step_wall").unwrap())
    })
    .await;
    let trained = t0.elapsed() - built;
    let records = records(&r.live);
    let (decided_at, group, migration_s) = find_move(&records, Role::Policy, Role::Rollout);
    let new_rollout = assert_replaced(&r.cluster, (&before, &after), group, "policy", "rollout");
    // The heads follow the new routing: some head generates on the new replica.
    assert!(r
        .live
        .controllers()
        .iter()
        .any(|c| c.roles().rollout.id() == &new_rollout));

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

    // After the move (skipping the first step on the new plan), the measured step and
    // the model's prediction for the old plan are printed, not asserted: the gain is a
    // benchmark's figure (docs/benchmarks.md, live placement), and a timed assertion
    // fails on a loaded machine.
    assert!(
        decided_at + 5 < r.job.job.steps,
        "moved too late: step {decided_at}"
    );
    let (measured, no_move) = after_move(&records, decided_at + 1);
    assert!(
        measured.len() >= 3,
        "{} steps after the move",
        measured.len()
    );
    let (m, n) = (median(measured), median(no_move));
    let last = moved_after as usize;
    let before_s = median(steps_s[last.saturating_sub(5)..=last].to_vec());
    eprintln!(
        "built in {built:.2?}, {} steps in {trained:.2?}; move decided at step {decided_at}, migration {migration_s:.3}s; step before the move {before_s:.3}s, after {m:.3}s, predicted without the move {n:.3}s",
        r.job.job.steps
    );
    finish(r).await;
}

/// The other way round: responses shrink from 16 tokens to 4 and every sequence of a
/// step decodes at once, so training dominates, and the actor gives a rollout group to
/// the policy. The new policy replica starts on its node from a surviving replica's
/// weights and optimizer state (sent as bytes: the nodes share no disk), the two
/// replicas join a new gradient ring, and from then on they stay bit-identical while
/// the gradients go replica to replica.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shrinking_responses_move_a_group_to_a_new_policy_replica_on_a_remote_node() {
    let t0 = Instant::now();
    let sets = [
        "placement.rollout_groups=2",
        "data.length=16",
        "data.length_end=4",
        "rollout.max_batch=0",
    ];
    let mut r = start("ls", &sets).await;
    let before = r.live.replicas();
    assert_eq!(
        layout(&before),
        [("ls-1", "rollout"), ("ls-1", "rollout"), ("ls-2", "policy")]
    );
    let weight_bytes: u64 = replica_weights(&r.live.controllers()[0].roles().policy)
        .await
        .buckets
        .iter()
        .map(|b| b.data.len() as u64)
        .sum();
    let mut moved = false;
    let (moved_after, after) = run_all(&mut r, |step, live, _, sent| {
        // On the new plan each head has its own replica; the replicas average their
        // gradients in their ring, so this process sends weights to the two rollouts
        // only (through the controllers it would send four gradient shards as well,
        // each as large as the weights). The step that ends with the move also carries
        // the trainer state through this process.
        let on_new_plan = moved;
        moved = live.routing_version() > 1;
        if on_new_plan {
            assert!(
                sent < 3 * weight_bytes,
                "step {step}: the controller sent {sent} bulk bytes for weights of {weight_bytes}"
            );
        }
    })
    .await;
    let records = records(&r.live);
    let (_, group, migration_s) = find_move(&records, Role::Rollout, Role::Policy);
    let new_policy = assert_replaced(&r.cluster, (&before, &after), group, "rollout", "policy");

    // Both replicas took every update since the move, from the same state: same
    // version, bit-identical weights (a replica with fresh optimizer moments would
    // have drifted at the first update).
    let policies: Vec<PolicyRef> = r
        .live
        .controllers()
        .iter()
        .map(|c| c.roles().policy.clone())
        .collect();
    assert_eq!(policies.len(), 2);
    assert_ne!(policies[0].id(), policies[1].id());
    assert!(policies.iter().any(|p| p.id() == &new_policy));
    let (a, b) = (
        replica_weights(&policies[0]).await,
        replica_weights(&policies[1]).await,
    );
    let steps = r.job.job.steps;
    assert_eq!((a.version, b.version), (steps, steps));
    assert!(a.buckets == b.buckets, "the replicas' weights differ");
    eprintln!(
        "moved after step {moved_after} in {migration_s:.3}s (policy state hand-off included); {steps} steps, {:.2?} in all",
        t0.elapsed()
    );
    drop(policies);
    finish(r).await;
}

/// `yatt train CONFIG --cluster` runs the live placement on the cluster's nodes, and
/// `yatt placement show` renders what it did from the run directory.
#[test]
fn yatt_train_cluster_runs_the_live_placement_and_placement_show_reads_it() {
    let t0 = Instant::now();
    let cluster = Cluster::start_with("lt", &[&[], &["--virtual-devices", "2"], &[]]);
    let out = tempfile::tempdir().unwrap();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/live-placement-cluster.toml"
    );
    let sets = [
        "job.steps=8",
        "placement.nodes=[\"lt-1\", \"lt-2\"]",
        "placement.reward=\"lt-0\"",
    ];
    let printed = cluster.yatt_train(config, &sets, out.path(), Duration::from_secs(60));
    assert!(
        printed.contains("live placement over the devices of lt-1, lt-2, reward on lt-0")
            && printed.contains("done: 8 steps"),
        "{printed}"
    );
    let show = std::process::Command::new(yatt_bin())
        .args(["placement", "show"])
        .arg(out.path())
        .output()
        .expect("yatt placement show");
    let shown = String::from_utf8_lossy(&show.stdout);
    assert!(show.status.success(), "{shown}");
    assert!(
        shown.contains("plan: rollout:1 policy:2") && shown.contains("last step 7"),
        "{shown}"
    );
    assert_roles_released(&cluster);
    eprintln!(
        "yatt train --cluster with live placement: 8 steps, {:.2?} in all",
        t0.elapsed()
    );
}

/// Whether the directory of `node` lists `name` alive.
fn alive(node: &Node, name: &str) -> bool {
    node.directory()
        .read(|d| d.alive_nodes().any(|n| n.name == name))
}

/// Runs a step of `r` during which node `i` is killed (`kill -9`) once the probe shows
/// a generation request in flight to `victim` on it; the node is stopped (SIGSTOP)
/// before the step so that its answer cannot beat the kill. Returns the step's outcome,
/// how long after the kill this process's directory declared the node dead, and how
/// long after it stopped answering.
async fn step_killing(
    r: &mut Run,
    i: usize,
    victim: &ActorId,
    probe: &GenProbe,
) -> (Result<StepMetrics, JobError>, Duration, Duration) {
    let proc = &mut r.cluster.nodes[i];
    let name = proc.name.clone();
    // SAFETY: plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(proc.pid as i32, libc::SIGSTOP);
    }
    let stopped = Instant::now();
    let node = r.node.clone();
    let killer = async {
        let end = Instant::now() + Duration::from_secs(30);
        while !probe.in_flight(victim) {
            assert!(Instant::now() < end, "no generation in flight on {victim}");
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        proc.kill9();
        let killed = Instant::now();
        while alive(&node, &name) {
            assert!(
                killed.elapsed() < Duration::from_secs(30),
                "{name} never declared dead"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        (killed.elapsed(), stopped.elapsed())
    };
    let (m, (detected, since_stop)) = tokio::join!(r.live.step(), killer);
    (m, detected, since_stop)
}

/// Runs every step of `r`, step 1 with node `i` killed (see [`step_killing`]) while
/// `victim` generates. After each step, checks that every head's ledger closed on all
/// of its samples, none dropped, and calls `each` with the step, the placement, the
/// metrics and the step's seconds.
async fn run_killing_in_step_1(
    r: &mut Run,
    i: usize,
    victim: &ActorId,
    mut each: impl FnMut(u64, &LivePlacement, &StepMetrics, f64),
) {
    let per_head = (r.job.data.prompts_per_step * r.job.data.samples_per_prompt as usize) as u64;
    let probe = r.live.gen_probe();
    for step in 0..r.job.job.steps {
        let t = Instant::now();
        let m = match step {
            1 => step_killing(r, i, victim, &probe).await.0,
            _ => r.live.step().await,
        };
        let m = m.unwrap_or_else(|e| panic!("step {step}: {e}\n{}", cluster_logs(&r.cluster)));
        for l in r.live.last_ledgers() {
            assert_eq!(
                (l.step, l.samples as u64, l.dropped),
                (step, per_head, 0),
                "step {step}"
            );
        }
        each(step, &r.live, &m, t.elapsed().as_secs_f64());
    }
}

/// Node loss mid-step, then the node's return. `nl-2` (one device) hosts head 0's
/// rollout replica, `nl-1` (two) head 1's rollout and the policy. During step 2, while
/// head 0's generation request is in flight on `nl-2`, `nl-2` is killed (`kill -9`;
/// it is stopped with SIGSTOP before the step so its answer cannot beat the kill: the
/// kill comes once the heads' probe shows the request in flight). The call fails when
/// the directory declares `nl-2` dead, the request's samples are requeued in head 0's
/// ledger and generated on head 1's replica, and the step completes with every sample
/// trained once. The shell then feeds the loss to the policy, which drops the lost
/// group (`NodeLost`), and training goes on over the two groups left. Then `nl-2`
/// starts again and joins: its device is a group of the inventory again, and the
/// placement log says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_rollout_node_mid_step_requeues_its_samples_and_training_goes_on() {
    let t0 = Instant::now();
    let sets = [
        "placement.nodes=[\"nl-2\", \"nl-1\"]",
        "placement.rollout_groups=2",
        "job.steps=9",
    ];
    let mut r = start("nl", &sets).await;
    let before = r.live.replicas();
    assert_eq!(
        layout(&before),
        [("nl-2", "rollout"), ("nl-1", "rollout"), ("nl-1", "policy")]
    );
    let victim = before[0].3.clone();
    let per_head = (r.job.data.prompts_per_step * r.job.data.samples_per_prompt as usize) as u64;
    let probe = r.live.gen_probe();
    let (lost_at, rejoin_at) = (2u64, 5u64);
    let mut normal_s = Vec::new();
    let (mut lost_step_s, mut detected, mut since_stop) = (0.0, Duration::ZERO, Duration::ZERO);
    for step in 0..r.job.job.steps {
        if step == rejoin_at {
            r.cluster.restart(2, &[]);
            let back = poll(Duration::from_secs(20), || {
                alive(&r.node, "nl-2").then_some(())
            });
            assert!(back.is_some(), "the train node never saw nl-2 again");
        }
        let t = Instant::now();
        let m = if step == lost_at {
            let (m, d, s) = step_killing(&mut r, 2, &victim, &probe).await;
            (detected, since_stop) = (d, s);
            m
        } else {
            r.live.step().await
        };
        let m = m.unwrap_or_else(|e| panic!("step {step}: {e}\n{}", cluster_logs(&r.cluster)));
        let secs = t.elapsed().as_secs_f64();
        let ledgers = r.live.last_ledgers();
        assert_eq!(ledgers.len(), 2);
        // Every sample of each head trained once (the ledger closes only then), none
        // dropped; the lost step requeued head 0's samples.
        for (head, l) in ledgers.iter().enumerate() {
            let requeued = match (step == lost_at, head) {
                (true, 0) => per_head,
                _ => 0,
            };
            assert_eq!(
                (l.step, l.samples as u64, l.requeued, l.dropped),
                (step, per_head, requeued, 0),
                "step {step}, head {head}"
            );
        }
        assert_eq!(
            m.get("placement/requeued"),
            Some(ledgers[0].requeued as f64)
        );
        match step == lost_at {
            true => lost_step_s = secs,
            false => normal_s.push(secs),
        }
        if step == lost_at {
            // The lost group left the plan; both heads generate on nl-1's replica.
            let now = r.live.replicas();
            assert_eq!(layout(&now), [("nl-1", "rollout"), ("nl-1", "policy")]);
            assert_eq!(r.live.routing_version(), 2);
            for c in r.live.controllers() {
                assert_eq!(c.roles().rollout.id(), &now[0].3);
            }
        }
    }
    let records = records(&r.live);
    // The loss: a NodeLost decision dropping nl-2's group, carried out.
    let (id, moves) = records
        .iter()
        .find_map(|r| match r {
            Record::Decision {
                step,
                id,
                reason: Reason::NodeLost,
                moves,
                ..
            } if *step == lost_at => Some((*id, moves.clone())),
            _ => None,
        })
        .expect("a NodeLost decision after the lost step");
    assert_eq!(moves.len(), 1, "{moves:?}");
    assert_eq!(
        (moves[0].group, moves[0].to.is_empty()),
        (before[0].0, true)
    );
    assert!(records
        .iter()
        .any(|r| matches!(r, Record::Migrated { id: i, ok: true, .. } if *i == id)));
    let said = |what: &str| {
        records.iter().any(|r| {
            matches!(r, Record::Search { line, .. } if line.starts_with(&format!("node nl-2 {what}")))
        })
    };
    assert!(said("left"), "the loss is not in the placement log");
    // The return: nl-2's device is a group again (the policy may or may not use it).
    assert!(said("joined"), "the join is not in the placement log");
    let inventory = r.live.policy().inventory();
    assert_eq!(inventory.len(), 3);
    assert_eq!(inventory.groups().filter(|g| g.node == "nl-2").count(), 1);
    // Losing the policy's node is not recovered from: the step fails, naming the node
    // and the replica lost with it.
    let policy_node = r
        .live
        .replicas()
        .into_iter()
        .find(|(.., role, _)| *role == "policy")
        .map(|(_, n, ..)| n)
        .unwrap();
    let i = r
        .cluster
        .nodes
        .iter()
        .position(|n| n.name == policy_node)
        .unwrap();
    r.cluster.nodes[i].kill9();
    let err = r
        .live
        .step()
        .await
        .expect_err("a step without its policy")
        .to_string();
    assert!(
        err.contains(&format!("node(s) {policy_node} left"))
            && err.contains("policy on")
            && err.contains("cannot be recovered"),
        "{err}"
    );
    eprintln!("losing the policy's node: {err}");
    let normal = median(normal_s);
    eprintln!(
        "nl-2 declared dead {detected:.2?} after kill -9 ({since_stop:.2?} after it stopped answering); the step that lost it took {lost_step_s:.3}s against {normal:.3}s (median of the others); {per_head} samples requeued; {:.2?} in all",
        t0.elapsed()
    );
    drop(r.live);
    r.node.shutdown().await;
    r.cluster.nodes.remove(i);
    assert_roles_released(&r.cluster);
}

/// With a single rollout group there is no spare: when its node (`n1-2`) dies while
/// step 1 generates there, the step's generation fails, the heads go back to before
/// the step, the policy's `NodeLost` plan turns one of the two policy groups into the
/// rollout (its replica stops; the other keeps training alone), and the step runs
/// again on the new plan and completes with every sample trained once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_only_rollout_node_mid_step_turns_a_policy_group_into_the_rollout() {
    let t0 = Instant::now();
    let sets = ["placement.nodes=[\"n1-2\", \"n1-1\"]", "job.steps=5"];
    let mut r = start("n1", &sets).await;
    let before = r.live.replicas();
    assert_eq!(
        layout(&before),
        [("n1-2", "rollout"), ("n1-1", "policy"), ("n1-1", "policy")]
    );
    let victim = before[0].3.clone();
    run_killing_in_step_1(&mut r, 2, &victim, |step, live, m, _| {
        if step == 1 {
            // Regression: the recovered step was recorded at the rerun's time alone
            // (0.27 s for a step of 2.25 s): it counts the detection and re-plan too.
            let (recorded, wall) = (m.get("timing_s/step"), m.get("timing_s/step_wall"));
            assert!(
                recorded == wall && wall > Some(1.0),
                "{recorded:?} {wall:?}"
            );
            let replicas = live.replicas();
            let mut now = layout(&replicas);
            now.sort();
            assert_eq!(now, [("n1-1", "policy"), ("n1-1", "rollout")]);
        }
    })
    .await;
    let records = records(&r.live);
    let moves = records
        .iter()
        .find_map(|r| match r {
            Record::Decision {
                reason: Reason::NodeLost,
                moves,
                ..
            } => Some(moves.clone()),
            _ => None,
        })
        .expect("a NodeLost decision");
    assert!(
        moves
            .iter()
            .any(|m| m.from.contains(Role::Policy) && m.to.contains(Role::Rollout))
            && moves
                .iter()
                .any(|m| m.group == before[0].0 && m.to.is_empty()),
        "{moves:?}"
    );
    eprintln!(
        "the only rollout node lost mid-step: a policy group took over; {} steps in {:.2?}",
        r.job.job.steps,
        t0.elapsed()
    );
    drop(r.live);
    r.node.shutdown().await;
    r.cluster.nodes.remove(2);
    assert_roles_released(&r.cluster);
}

/// The reward and the reference run outside the groups, on `nr-0`. When `nr-0` dies
/// (`kill -9`, stopped before the step so that the kill lands while step 1 generates),
/// the step's reward or reference call fails, both start again on a live node from the
/// job's config (the reference is the initial model), the heads go back to before the
/// step and it runs again: every sample trained once, and training goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_the_reward_and_reference_node_mid_step_starts_them_again_and_training_goes_on() {
    let t0 = Instant::now();
    let sets = [
        "placement.nodes=[\"nr-2\", \"nr-1\"]",
        "placement.reference=\"nr-0\"",
        "algorithm.kl_mode=\"loss\"",
        "job.steps=5",
    ];
    let mut r = start("nr", &sets).await;
    let victim = r.live.replicas()[0].3.clone();
    let mut lost_step_s = 0.0;
    let node = r.node.clone();
    run_killing_in_step_1(&mut r, 0, &victim, |step, live, m, secs| {
        let respawned = m.get("recovery/respawned_roles");
        if step == 1 {
            lost_step_s = secs;
            assert_eq!(respawned, Some(2.0), "the reward and the reference");
            for c in live.controllers() {
                let roles = c.roles();
                let reference = roles.reference.as_ref().expect("a reference");
                for id in [roles.reward.id(), reference.id()] {
                    assert_ne!(id.name.node, "nr-0", "{id}");
                    assert!(alive(&node, &id.name.node), "{id}");
                }
            }
        } else {
            assert_eq!(respawned, None, "step {step}");
        }
    })
    .await;
    let said = records(&r.live).iter().any(|rec| {
        matches!(rec, Record::Search { line, .. }
            if line.contains("lost with its node, started again: reward: nr-0 -> ")
                && line.contains("reference: nr-0 -> "))
    });
    assert!(said, "the restart is not in the placement log");
    eprintln!(
        "the reward and reference node lost mid-step: both started again, the step took {lost_step_s:.2} s; {} steps in {:.2?}",
        r.job.job.steps,
        t0.elapsed()
    );
    drop(r.live);
    r.node.shutdown().await;
    r.cluster.nodes.remove(0);
    assert_roles_released(&r.cluster);
}

/// Two policy replicas on nodes of their own (`np-1`, `np-2`), the rollout on `np-3`.
/// When a replica's node dies (`kill -9` while step 1 generates), the step fails at
/// the policy, the survivor's version is checked, the policy's `NodeLost` re-plan runs
/// the heads on the groups left, and the step runs again: every sample trained once,
/// the global batch unchanged, and training goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_a_policy_replicas_node_runs_the_heads_on_the_survivor_and_training_goes_on() {
    let t0 = Instant::now();
    let sets = [
        "placement.nodes=[\"np-1\", \"np-2\", \"np-3\"]",
        "placement.rollout_groups=1",
        "job.steps=5",
    ];
    let mut r = start_on("np", &[&[], &[], &[], &[]], &sets).await;
    let before = r.live.replicas();
    let policy_nodes: Vec<String> = before
        .iter()
        .filter(|(.., role, _)| *role == "policy")
        .map(|(_, n, ..)| n.clone())
        .collect();
    assert_eq!(policy_nodes.len(), 2, "{:?}", layout(&before));
    assert_ne!(policy_nodes[0], policy_nodes[1], "{:?}", layout(&before));
    let victim_node = policy_nodes[1].clone();
    let i = r
        .cluster
        .nodes
        .iter()
        .position(|n| n.name == victim_node)
        .unwrap();
    let rollout = before
        .iter()
        .find(|(.., role, _)| *role == "rollout")
        .map(|(.., id)| id.clone())
        .unwrap();
    let mut lost_step_s = 0.0;
    run_killing_in_step_1(&mut r, i, &rollout, |step, live, m, secs| {
        assert!(
            m.get("actor/pg_loss").is_some() || m.get("recovery/update_committed").is_some(),
            "step {step}: {m:?}"
        );
        if step == 1 {
            lost_step_s = secs;
            let now = live.replicas();
            assert!(
                now.iter().all(|(_, n, ..)| *n != victim_node),
                "{:?}",
                layout(&now)
            );
            assert!(
                now.iter().any(|(.., role, _)| *role == "policy"),
                "{:?}",
                layout(&now)
            );
        }
    })
    .await;
    // One optimizer step per step: the failed attempt took none, the rerun one.
    for c in r.live.controllers() {
        assert_eq!(c.state().weights_version, r.job.job.steps);
    }
    let records = records(&r.live);
    assert!(
        records.iter().any(|rec| matches!(
            rec,
            Record::Decision {
                reason: Reason::NodeLost,
                ..
            }
        )),
        "a NodeLost re-plan"
    );
    eprintln!(
        "a policy replica's node lost mid-step: the heads went on with {:?}; the step took {lost_step_s:.2} s; {} steps in {:.2?}",
        layout(&r.live.replicas()),
        r.job.job.steps,
        t0.elapsed()
    );
    drop(r.live);
    r.node.shutdown().await;
    r.cluster.nodes.remove(i);
    assert_roles_released(&r.cluster);
}
