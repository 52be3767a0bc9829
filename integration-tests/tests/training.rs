//! A training job across three real `yatt-node` processes: the rollout on one, the
//! policy and the reference on another, the reward on the third. The controller runs
//! in this process, which joins the cluster as a fourth node, or in a `yatt train
//! --cluster` child process; everything talks QUIC with mutual TLS over loopback. Tiny
//! model, the letters task of `config/demo-letters.toml`.

use std::collections::BTreeSet;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_roles_released, cluster_logs, deterministic_metrics, join, replica_weights,
    run_trajectory, steps_done, Cluster, UdpRelay,
};
use yatt_runtime::Node;
use yatt_trainer::Stage;
use yatt_trainer::{build_cluster, NodeNames};
use yatt_trainer::{build_embedded, JobConfig};
use yatt_trainer::{step_data_parallel, PolicyRef};

const STEPS: u64 = 10;

fn letters_job(out: &std::path::Path, placement: &[(&str, &str)]) -> JobConfig {
    letters_job_with(out, placement, &[])
}

fn letters_job_with(
    out: &std::path::Path,
    placement: &[(&str, &str)],
    extra: &[&str],
) -> JobConfig {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let mut sets = vec![
        format!("job.steps={STEPS}"),
        format!("job.output_dir=\"{}\"", out.display()),
    ];
    sets.extend(extra.iter().map(|s| s.to_string()));
    for (k, v) in placement {
        sets.push(format!("placement.{k}=\"{v}\""));
    }
    JobConfig::load(config, &sets).unwrap()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_trains_with_its_roles_on_three_nodes() {
    let t0 = Instant::now();
    let cluster = Cluster::start("tr", 3);
    let logs = || cluster_logs(&cluster);
    let node = join(&cluster, "tr-controller").await;
    let out = tempfile::tempdir().unwrap();
    let job = letters_job(
        out.path(),
        &[
            ("mode", "disaggregated"),
            ("rollout", "tr-0"),
            ("policy", "tr-1"),
            ("reference", "tr-1"),
            ("reward", "tr-2"),
        ],
    );
    let mut controllers = build_cluster(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", logs()));
    let built = t0.elapsed();
    assert_eq!(controllers.len(), 1);
    let c = &mut controllers[0];
    let r = c.roles();
    let reference = r.reference.as_ref().expect("a reference role");
    let placed = [
        (r.rollout.id(), r.rollout.is_local()),
        (r.policy.id(), r.policy.is_local()),
        (reference.id(), reference.is_local()),
        (r.reward.id(), r.reward.is_local()),
    ];
    let nodes: Vec<&str> = placed.iter().map(|(id, _)| id.name.node.as_str()).collect();
    assert_eq!(nodes, ["tr-0", "tr-1", "tr-1", "tr-2"]);
    assert!(placed.iter().all(|(_, local)| !local), "{placed:?}");

    let per_step = (job.data.prompts_per_step * job.data.samples_per_prompt as usize) as u64;
    let mut rewards = Vec::new();
    let mut versions = Vec::new();
    for step in 0..STEPS {
        let report = c
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        // The ledger closed clean: every sample passed every stage exactly once.
        let l = &report.ledger;
        assert_eq!((l.step, l.samples as u64, l.requeued), (step, per_step, 0));
        // Every stage of a GRPO step with a reference (no critic, no dynamic sampling).
        for stage in Stage::ALL
            .into_iter()
            .filter(|s| !matches!(s, Stage::Valued | Stage::CriticTrained))
        {
            assert!(l.stages.contains(&stage), "step {step}: {stage:?} missing");
        }
        assert_eq!(l.dropped, 0);
        let ids: BTreeSet<_> = report.samples.iter().map(|s| s.id).collect();
        assert_eq!(ids.len() as u64, per_step, "step {step}: duplicate samples");
        assert_eq!(report.samples.len() as u64, per_step);
        assert!(ids.iter().all(|id| id.step == step));
        assert!(report
            .samples
            .iter()
            .all(|s| s.reward.is_some() && s.ref_logprobs.is_some()));
        // The rollout node stamps each sample with the weights it generated it with.
        let v = report.samples[0].weights_version;
        assert!(report.samples.iter().all(|s| s.weights_version == v));
        versions.push(v);
        rewards.push(report.metrics.get("critic/rewards/mean").unwrap());
    }
    let trained = t0.elapsed() - built;
    assert_eq!(versions[0], 0, "{versions:?}");
    assert!(
        versions.windows(2).all(|w| w[1] > w[0]),
        "weights versions did not advance on the rollout node: {versions:?}"
    );
    let (first, last) = (mean(&rewards[..3]), mean(&rewards[rewards.len() - 3..]));
    assert!(
        last > first + 0.1,
        "reward did not move up: {rewards:?} (first 3 {first:.3}, last 3 {last:.3})"
    );

    // The same job in one process gives the same rewards: the remote path changes
    // where the roles run, not what they compute.
    let embedded = Node::builder("tr-embedded")
        .dev_certs(out.path().join("ca"))
        .start()
        .await
        .unwrap();
    let mut local = build_embedded(&letters_job(out.path(), &[]), &embedded)
        .await
        .unwrap();
    let mut local_rewards = Vec::new();
    for _ in 0..STEPS {
        let r = local[0].step().await.unwrap();
        local_rewards.push(r.metrics.get("critic/rewards/mean").unwrap());
    }
    for (step, (a, b)) in rewards.iter().zip(&local_rewards).enumerate() {
        assert!(
            (a - b).abs() < 1e-6,
            "step {step}: cluster reward {a} but embedded {b}\ncluster {rewards:?}\nembedded {local_rewards:?}"
        );
    }
    drop(local);
    embedded.shutdown().await;

    // Leaving the cluster releases the roles this controller spawned.
    drop(controllers);
    node.shutdown().await;
    assert_roles_released(&cluster);
    eprintln!(
        "roles built in {built:.2?}, {STEPS} steps in {trained:.2?}, total {:.2?}; rewards {rewards:.3?}",
        t0.elapsed()
    );
}

#[test]
fn yatt_train_cluster_runs_the_demo_on_three_nodes() {
    let t0 = Instant::now();
    let cluster = Cluster::start("tc", 3);
    let out = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let printed = cluster.yatt_train(
        config,
        &[
            "job.steps=4",
            "placement.mode=disaggregated",
            "placement.rollout=tc-0",
            "placement.policy=tc-1",
            "placement.reference=tc-1",
            "placement.reward=tc-2",
        ],
        out.path(),
        Duration::from_secs(60),
    );
    assert!(
        printed.contains("rollout on tc-0, policy on tc-1, reference on tc-1, reward on tc-2")
            && printed.contains("done: 4 steps"),
        "{printed}"
    );
    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 4, "{metrics}");
    assert!(out
        .path()
        .join("checkpoint")
        .read_dir()
        .unwrap()
        .next()
        .is_some());
    assert_roles_released(&cluster);
    eprintln!("yatt train --cluster: 4 steps, {:.2?} in all", t0.elapsed());
}

/// A real cluster's certificates, issued with `yatt-node cert`: the trainer's
/// (`--kind trainer`) places the roles; a client certificate under `yatt train` is
/// refused at its first spawn, saying which kind it needs.
#[test]
fn a_trainer_needs_a_trainer_certificate_issued_by_the_cluster_ca() {
    let cluster = Cluster::start("kc", 2);
    let certs = tempfile::tempdir().unwrap();
    let issue = |name: &str, kind: &str| {
        let out = std::process::Command::new(yatt_integration_tests::yatt_node_bin())
            .args(["cert", "--ca-dir"])
            .arg(cluster.ca_dir())
            .args(["--name", name, "--kind", kind, "--out"])
            .arg(certs.path())
            .output()
            .unwrap();
        let said = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(out.status.success() && said.contains(kind), "{said}{out:?}");
    };
    issue("train", "trainer");
    issue("ops", "client");
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        "job.steps=2",
        "placement.mode=disaggregated",
        "placement.rollout=kc-0",
        "placement.policy=kc-1",
        "placement.reference=kc-1",
        "placement.reward=kc-0",
    ];
    let t = Duration::from_secs(120);
    let out = tempfile::tempdir().unwrap();
    let (ok, printed) =
        cluster.try_yatt_train_as(config, &sets, out.path(), (certs.path(), "train"), t);
    assert!(ok && printed.contains("done: 2 steps"), "{printed}");
    let out = tempfile::tempdir().unwrap();
    let (ok, printed) =
        cluster.try_yatt_train_as(config, &sets, out.path(), (certs.path(), "ops"), t);
    assert!(!ok, "{printed}");
    assert!(
        printed.contains("holds a client certificate") && printed.contains("--kind trainer"),
        "{printed}"
    );
}

/// A network partition between the trainer and a node: every datagram to the reward
/// node's advertised address (a relay) is dropped mid-run, while that node still
/// heartbeats the leader over the connection it dialled itself, so the cluster keeps
/// it alive. The run ends within 30 s, with an error naming the node as cut off yet
/// alive, or by recovering; it never hangs.
#[test]
fn a_partition_between_the_trainer_and_a_node_ends_within_30_s_naming_it() {
    let relay = UdpRelay::start();
    let advertise = relay.addr.to_string();
    let cluster = Cluster::start_with("pt", &[&[], &[], &["--advertise", &advertise]]);
    relay.forward_to(cluster.nodes[2].listen);
    assert_eq!(cluster.nodes[2].addr, relay.addr);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets: Vec<String> = [
        "job.steps=400",
        "placement.mode=disaggregated",
        "placement.rollout=\"pt-0\"",
        "placement.policy=\"pt-1\"",
        "placement.reference=\"pt-1\"",
        "placement.reward=\"pt-2\"",
    ]
    .map(String::from)
    .to_vec();
    let out = tempfile::tempdir().unwrap();
    let mut train = cluster.spawn_train(config, &sets, out.path(), false);
    let started = yatt_integration_tests::poll(Duration::from_secs(120), || {
        (steps_done(out.path()) >= 3).then_some(())
    });
    assert!(started.is_some(), "{}", train.printed());
    relay.cut();
    let cut = Instant::now();
    let status = train.wait(Duration::from_secs(60));
    let took = cut.elapsed();
    let printed = train.printed();
    let status = status.unwrap_or_else(|| panic!("still running 60 s after the cut:\n{printed}"));
    let said: Vec<&str> = printed.lines().rev().take(3).collect();
    eprintln!(
        "partition: the run ended {took:.2?} after the cut ({status}), at step {}: {said:?}",
        steps_done(out.path())
    );
    assert!(took < Duration::from_secs(30), "{took:?}\n{printed}");
    if !status.success() {
        // It names the node, and says that the cluster still hears it: no respawn
        // mends a broken network, so the user is told to look there.
        assert!(
            printed.contains("the cluster still hears pt-2"),
            "the error names the node and the partition:\n{printed}"
        );
    }
    // The node was cut off, not dead: the leader still hears it.
    assert_eq!(cluster.nodes[0].sees_alive("pt-2"), Some(true));
}

/// `--resume` of a disaggregated run (it was refused): the policy's trainer state, the
/// controller's position and the rollout's weights come from the checkpoint, the
/// reference stays the initial model, and the roles may land on other nodes. The
/// resumed run's metrics equal an uninterrupted run's step for step.
#[test]
fn a_disaggregated_run_resumes_on_other_nodes_with_the_uninterrupted_metrics() {
    let cluster = Cluster::start("rz", 4);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let on = |rollout: &str, policy: &str| {
        vec![
            "placement.mode=disaggregated".to_string(),
            format!("placement.rollout={rollout}"),
            format!("placement.policy={policy}"),
            format!("placement.reference={policy}"),
            "placement.reward=rz-2".to_string(),
        ]
    };
    let with_steps = |steps: u64, place: Vec<String>| {
        let mut v = vec![format!("job.steps={steps}")];
        v.extend(place);
        v
    };
    let full = tempfile::tempdir().unwrap();
    let first = with_steps(6, on("rz-0", "rz-1"));
    cluster.yatt_train(
        config,
        &borrow(&first),
        full.path(),
        Duration::from_secs(90),
    );
    let part = tempfile::tempdir().unwrap();
    let interrupted = with_steps(3, on("rz-0", "rz-1"));
    cluster.yatt_train(
        config,
        &borrow(&interrupted),
        part.path(),
        Duration::from_secs(90),
    );
    // The same run, continued with its rollout, policy and reference on other nodes.
    let resumed = with_steps(6, on("rz-1", "rz-3"));
    let printed = cluster.yatt_resume(part.path(), &borrow(&resumed), Duration::from_secs(90));
    assert!(printed.contains("policy on rz-3"), "{printed}");
    let lines = |dir: &Path| -> Vec<Vec<(String, String)>> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(deterministic_metrics)
            .collect()
    };
    let (a, b) = (lines(full.path()), lines(part.path()));
    assert_eq!(a.len(), 6);
    assert_eq!(
        a, b,
        "a resumed disaggregated run differs from the uninterrupted one"
    );
    assert_roles_released(&cluster);
}

/// Nodes die mid-run and the run goes on with the metrics of an undisturbed one, step
/// for step. First the directory leader (ls-0, hosting no role) is killed: the oldest
/// member takes over and the run does not notice. Then the rollout's node and later the
/// reward's (which by then also hosts the respawned rollout): `yatt train --cluster`
/// spawns the lost stateless roles again on a surviving node and runs the step again
/// (nothing was trained in a failed step, and sampling is seeded per sample). Every
/// kill is `kill -9`.
#[test]
fn losing_the_leader_then_the_rollout_and_reward_nodes_mid_run_changes_nothing() {
    let mut cluster = Cluster::start("ls", 4);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        "job.steps=40",
        "placement.mode=disaggregated",
        "placement.rollout=ls-3",
        "placement.policy=ls-1",
        "placement.reference=ls-1",
        "placement.reward=ls-2",
    ];
    let quiet = tempfile::tempdir().unwrap();
    cluster.yatt_train(config, &sets, quiet.path(), Duration::from_secs(120));

    let out = tempfile::tempdir().unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let mut train = cluster.spawn_train(config, &sets, out.path(), false);
    let t0 = Instant::now();
    for (victim, after) in [(0, 3), (3, 10), (2, 22)] {
        let reached = yatt_integration_tests::poll(Duration::from_secs(60), || {
            (steps_done(out.path()) >= after).then_some(())
        });
        assert!(
            reached.is_some(),
            "the run did not reach step {after}:\n{}",
            cluster_logs(&cluster)
        );
        cluster.nodes[victim].kill9();
    }
    let status = train.wait(Duration::from_secs(120));
    let printed = train.printed();
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{printed}\n{}",
        cluster_logs(&cluster)
    );
    let text = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let recovered: Vec<f64> = text
        .lines()
        .filter_map(|l| {
            serde_json::from_str::<serde_json::Value>(l).ok()?["recovery/respawned_roles"].as_f64()
        })
        .collect();
    // The leader held no role; then the rollout went to ls-2, and killing ls-2 took the
    // reward and that rollout, both respawned on ls-1.
    assert_eq!(
        recovered,
        [1.0, 2.0],
        "roles respawned after each kill:\n{printed}"
    );
    assert_eq!(
        run_trajectory(quiet.path()),
        run_trajectory(out.path()),
        "the disturbed run's trajectory differs"
    );
    let step_s = |recovered: bool| -> Vec<f64> {
        text.lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v.get("recovery/respawned_roles").is_some() == recovered)
            .filter_map(|v| v["timing_s/step"].as_f64())
            .collect()
    };
    // A kill stalls the step that meets it (a call to the dead node ends when the
    // node is declared dead) and the step that respawns its roles.
    let mut all: Vec<f64> = step_s(false).into_iter().chain(step_s(true)).collect();
    all.sort_by(f64::total_cmp);
    eprintln!(
        "3 node kills survived; slowest steps {:.2?} s, median {:.3} s; 40 steps in {:.2?}",
        &all[all.len() - 3..],
        all[all.len() / 2],
        t0.elapsed()
    );
}

/// A node writes only under its data directory: a trainer whose run directory lies
/// outside the policy node's is refused at the checkpoint, with the reason and the fix.
#[test]
fn a_node_refuses_to_write_a_checkpoint_outside_its_data_directory() {
    let fenced = tempfile::tempdir().unwrap();
    let fence = fenced.path().to_str().unwrap();
    let cluster = Cluster::start_with("wd", &[&[], &["--data-dir", fence]]);
    let out = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        "job.steps=1",
        "placement.mode=disaggregated",
        "placement.rollout=wd-0",
        "placement.policy=wd-1",
        "placement.reference=wd-0",
        "placement.reward=wd-0",
    ];
    let (ok, printed) = cluster.try_yatt_train(config, &sets, out.path(), Duration::from_secs(60));
    assert!(!ok, "{printed}");
    assert!(
        printed.contains("outside")
            && printed.contains("data directory")
            && printed.contains("--data-dir"),
        "{printed}"
    );
    assert!(!std::fs::read_dir(out.path().join("checkpoint"))
        .map(|mut d| d.any(|e| e.unwrap().file_name() != "run_state.json"))
        .unwrap_or(false));
}

/// Regression: a cluster build whose spawn failed (here the reward's, on the trainer's
/// own node) dropped its sibling spawns mid-flight, so a role a daemon was starting for
/// one of them was recorded nowhere and ran until the trainer left. Now a dropped spawn
/// is cancelled on its daemon, which releases the role once it has started; nothing is
/// left while the trainer stays in the cluster.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cluster_build_that_fails_while_its_other_roles_spawn_leaves_nothing_running() {
    let cluster = Cluster::start("bf", 2);
    // Refused the moment a role's registration on bf-1 reaches this node: its daemon
    // has started it and is about to answer the spawn, which the failure then drops.
    let refuse = |node: &Node, _: &yatt_runtime::ActorName, _: yatt_trainer::RoleArgs| {
        let node = node.clone();
        async move {
            let seen = || {
                node.directory().read(|d| {
                    d.actors().any(|a| {
                        a.id.name.node == "bf-1" && a.liveness == yatt_runtime::Liveness::Alive
                    })
                })
            };
            let t = std::time::Instant::now();
            while !seen() && t.elapsed() < Duration::from_secs(30) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            Err::<yatt_roles::RoleActor<yatt_roles::RewardRole>, _>(
                "refused by the test".to_string(),
            )
        }
    };
    let trainer = Node::builder("bf-trainer")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .factory_with_node("reward", refuse)
        .start()
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = letters_job(
        out.path(),
        &[
            ("mode", "disaggregated"),
            ("rollout", "bf-0"),
            ("policy", "bf-1"),
            ("reference", "bf-1"),
            ("reward", "bf-trainer"),
        ],
    );
    let e = build_cluster(&job, &trainer)
        .await
        .err()
        .expect("a refused reward was spawned")
        .to_string();
    assert!(e.contains("refused by the test"), "{e}");
    assert_roles_released(&cluster);
    trainer.shutdown().await;
}

/// Asynchronous RL on the cluster: with `rollout.staleness = 1` the rollout node
/// generates the next batch while the policy node trains; each sample trains once, one
/// version behind, and the rewards are those of the same job in one process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_trains_one_step_off_policy_on_three_nodes() {
    trains_off_policy_on_three_nodes("as", 1).await;
}

/// The same with `rollout.staleness = 2`: two batches ahead, samples up to two versions
/// behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_trains_two_steps_off_policy_on_three_nodes() {
    trains_off_policy_on_three_nodes("as2", 2).await;
}

async fn trains_off_policy_on_three_nodes(prefix: &str, staleness: u64) {
    let cluster = Cluster::start(prefix, 3);
    let logs = || cluster_logs(&cluster);
    let node = join(&cluster, &format!("{prefix}-controller")).await;
    let [n0, n1, n2] = [0, 1, 2].map(|i| format!("{prefix}-{i}"));
    let out = tempfile::tempdir().unwrap();
    let placement = [
        ("mode", "disaggregated"),
        ("rollout", n0.as_str()),
        ("policy", n1.as_str()),
        ("reference", n1.as_str()),
        ("reward", n2.as_str()),
    ];
    let stale = format!("rollout.staleness={staleness}");
    let async_job =
        |placement: &[(&str, &str)]| letters_job_with(out.path(), placement, &[stale.as_str()]);
    let mut controllers = build_cluster(&async_job(&placement), &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", logs()));
    let mut rewards = Vec::new();
    let mut seen = BTreeSet::new();
    for step in 0..STEPS {
        let report = controllers[0]
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        assert_eq!(report.ledger.step, step);
        assert!(report
            .samples
            .iter()
            .all(|s| s.id.step == step && seen.insert(s.id)));
        let m = &report.metrics;
        assert_eq!(
            m.get("async/staleness_max"),
            Some(step.min(staleness) as f64)
        );
        assert_eq!(m.get("async/pending_batches"), Some(staleness as f64));
        rewards.push(m.get("critic/rewards/mean").unwrap());
    }
    let (first, last) = (mean(&rewards[..3]), mean(&rewards[rewards.len() - 3..]));
    assert!(last > first + 0.1, "reward did not move up: {rewards:?}");
    drop(controllers);
    node.shutdown().await;
    assert_roles_released(&cluster);

    let embedded = Node::builder(&format!("{prefix}-embedded"))
        .dev_certs(out.path().join("ca"))
        .start()
        .await
        .unwrap();
    let mut local = build_embedded(&async_job(&[]), &embedded).await.unwrap();
    for (step, want) in rewards.iter().enumerate() {
        let got = local[0].step().await.unwrap();
        let got = got.metrics.get("critic/rewards/mean").unwrap();
        assert!(
            (got - want).abs() < 1e-6,
            "step {step}: embedded {got}, cluster {want}"
        );
    }
    drop(local);
    embedded.shutdown().await;
}

/// Partial rollouts with the rollout on its own node: each response decodes in chunks
/// of 2 tokens, the later chunks through `Continue` requests over QUIC. Regression:
/// `Continue` failed to decode on the remote rollout (a serde-skipped variant before it
/// shifted postcard's variant numbers), so no such job got past its first chunk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_rollouts_continue_on_a_remote_rollout() {
    let cluster = Cluster::start("pr", 3);
    let logs = || cluster_logs(&cluster);
    let node = join(&cluster, "pr-controller").await;
    let out = tempfile::tempdir().unwrap();
    let placement = [
        ("mode", "disaggregated"),
        ("rollout", "pr-0"),
        ("policy", "pr-1"),
        ("reference", "pr-1"),
        ("reward", "pr-2"),
    ];
    let extra = [
        "rollout.staleness=1",
        "rollout.partial_rollout={ chunk_tokens = 2, resume = \"reprefill\" }",
    ];
    let mut job = letters_job_with(out.path(), &placement, &extra);
    job.job.steps = 4;
    let budget = job.rollout.max_new_tokens;
    assert!(budget > 2, "the responses must need more than one chunk");
    let mut controllers = build_cluster(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", logs()));
    for step in 0..job.job.steps {
        let report = controllers[0]
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        // `ignore_eos`: only chunks continued on the remote rollout reach the budget.
        assert!(!report.samples.is_empty());
        for s in &report.samples {
            assert_eq!(s.response_len(), budget, "step {step}: {:?}", s.id);
        }
        assert!(report.metrics.get("async/samples_interrupted").is_some());
    }
    drop(controllers);
    node.shutdown().await;
    assert_roles_released(&cluster);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn policy_replicas_on_two_nodes_all_reduce_to_identical_weights() {
    const DP_STEPS: u64 = 6;
    let t0 = Instant::now();
    let cluster = Cluster::start("dp", 3);
    let logs = || cluster_logs(&cluster);
    let node = join(&cluster, "dp-controller").await;
    let out = tempfile::tempdir().unwrap();
    let dp = |placement: &[(&str, &str)]| {
        let mut job = letters_job(out.path(), placement);
        job.job.steps = DP_STEPS;
        job.job.controllers = 2;
        job.job.policy_replicas = 2;
        job.data.prompts_per_step = 4;
        job
    };
    let mut job = dp(&[
        ("mode", "disaggregated"),
        ("rollout", "dp-0"),
        ("reference", "dp-0"),
        ("reward", "dp-0"),
    ]);
    job.placement.policy = NodeNames::Each(vec!["dp-1".into(), "dp-2".into()]);
    let mut heads = build_cluster(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", logs()));
    assert_eq!(heads.len(), 2);
    let replicas: Vec<PolicyRef> = heads.iter().map(|h| h.roles().policy.clone()).collect();
    let placed: Vec<&str> = replicas.iter().map(|r| r.id().name.node.as_str()).collect();
    assert_eq!(placed, ["dp-1", "dp-2"]);
    // Each replica's ring inbox runs on its replica's node.
    for (n, name) in [(1, "dp-1"), (2, "dp-2")] {
        let hosted = cluster.nodes[n].health().expect("health")["hosted"].to_string();
        assert!(hosted.contains(&format!("{name}/policy-ring/")), "{hosted}");
    }
    let (a, b) = (
        replica_weights(&replicas[0]).await,
        replica_weights(&replicas[1]).await,
    );
    assert_eq!((a.version, b.version), (0, 0));
    assert!(
        a.buckets == b.buckets,
        "the replicas start from different weights"
    );
    let weight_bytes: u64 = a.buckets.iter().map(|b| b.data.len() as u64).sum();

    let per_head = (job.data.prompts_per_step * job.data.samples_per_prompt as usize) as u64;
    let mut rewards = Vec::new();
    for step in 0..DP_STEPS {
        let sent = node
            .transport_stats()
            .bulk_bytes_sent
            .load(Ordering::Relaxed);
        let reports = step_data_parallel(&mut heads)
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        // The gradients went replica to replica: what this process sent in bulk is the
        // weight sync to the two rollouts (a controller-mediated exchange would add
        // four gradient shards, each as large as the weights).
        let sent = node
            .transport_stats()
            .bulk_bytes_sent
            .load(Ordering::Relaxed)
            - sent;
        assert!(
            sent < 3 * weight_bytes,
            "step {step}: the controller sent {sent} bulk bytes for weights of {weight_bytes}"
        );
        let mut ids = BTreeSet::new();
        for r in &reports {
            let l = &r.ledger;
            assert_eq!(
                (l.step, l.samples as u64, l.requeued, l.dropped),
                (step, per_head, 0, 0)
            );
            assert!(
                l.stages.contains(&Stage::Trained),
                "step {step}: {:?}",
                l.stages
            );
            ids.extend(r.samples.iter().map(|s| s.id));
        }
        assert_eq!(
            ids.len() as u64,
            2 * per_head,
            "step {step}: the heads shared samples"
        );
        // Both replicas took the same update: same version, bit-identical weights.
        let (a, b) = (
            replica_weights(&replicas[0]).await,
            replica_weights(&replicas[1]).await,
        );
        assert_eq!((a.version, b.version), (step + 1, step + 1));
        assert!(
            a.buckets == b.buckets,
            "step {step}: the replicas' weights differ"
        );
        let r: Vec<f64> = reports
            .iter()
            .map(|r| r.metrics.get("critic/rewards/mean").unwrap())
            .collect();
        rewards.push(r.iter().sum::<f64>() / r.len() as f64);
    }
    let trained = t0.elapsed();
    assert!(
        rewards[DP_STEPS as usize - 1] > rewards[0],
        "reward did not move up: {rewards:?}"
    );

    // The same job in one process (its replicas' ring in the mailbox) gives the same
    // rewards: the cluster changes where the replicas run, not what they compute.
    let embedded = Node::builder("dp-embedded")
        .dev_certs(out.path().join("ca"))
        .start()
        .await
        .unwrap();
    let mut local = build_embedded(&dp(&[]), &embedded).await.unwrap();
    for (step, want) in rewards.iter().enumerate() {
        let reports = step_data_parallel(&mut local).await.unwrap();
        let r: Vec<f64> = reports
            .iter()
            .map(|r| r.metrics.get("critic/rewards/mean").unwrap())
            .collect();
        let got = r.iter().sum::<f64>() / r.len() as f64;
        assert!(
            (got - want).abs() < 1e-6,
            "step {step}: embedded reward {got}, cluster {want} ({rewards:?})"
        );
    }
    drop(local);
    embedded.shutdown().await;

    // Leaving the cluster releases the replicas and their ring inboxes.
    drop(heads);
    drop(replicas);
    node.shutdown().await;
    assert_roles_released(&cluster);
    eprintln!(
        "{DP_STEPS} data-parallel steps on two replica nodes in {trained:.2?} (total {:.2?}); rewards {rewards:.3?}",
        t0.elapsed()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ppo_job_trains_with_its_critic_on_a_node() {
    const PPO_STEPS: u64 = 4;
    let t0 = Instant::now();
    let cluster = Cluster::start("pp", 3);
    let logs = || cluster_logs(&cluster);
    let node = join(&cluster, "pp-controller").await;
    let out = tempfile::tempdir().unwrap();
    let ppo = |placement: &[(&str, &str)]| {
        let mut job = letters_job(out.path(), placement);
        job.job.steps = PPO_STEPS;
        job.algorithm.name = yatt_roles::Algorithm::Ppo;
        job
    };
    let job = ppo(&[
        ("mode", "disaggregated"),
        ("rollout", "pp-0"),
        ("policy", "pp-1"),
        ("reference", "pp-1"),
        ("reward", "pp-0"),
        ("critic", "pp-2"),
    ]);
    let mut controllers = build_cluster(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", logs()));
    let c = &mut controllers[0];
    let critic = c.roles().critic.clone().expect("a critic role");
    assert_eq!(critic.id().name.node, "pp-2");
    assert!(!critic.is_local());
    let mut rewards = Vec::new();
    for step in 0..PPO_STEPS {
        let report = c
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}\n{}", logs()));
        let l = &report.ledger;
        assert_eq!((l.step, l.requeued, l.dropped), (step, 0, 0));
        for stage in [Stage::Valued, Stage::CriticTrained, Stage::Trained] {
            assert!(l.stages.contains(&stage), "step {step}: {stage:?} missing");
        }
        assert!(report.samples.iter().all(|s| s.values.is_some()));
        assert!(report.critic.is_some_and(|r| r.vf_loss.is_finite()));
        rewards.push(report.metrics.get("critic/rewards/mean").unwrap());
    }
    // The same PPO job in one process gives the same rewards.
    let embedded = Node::builder("pp-embedded")
        .dev_certs(out.path().join("ca"))
        .start()
        .await
        .unwrap();
    let mut local = build_embedded(&ppo(&[]), &embedded).await.unwrap();
    for (step, want) in rewards.iter().enumerate() {
        let got = local[0].step().await.unwrap();
        let got = got.metrics.get("critic/rewards/mean").unwrap();
        assert!(
            (got - want).abs() < 1e-6,
            "step {step}: embedded reward {got}, cluster {want} ({rewards:?})"
        );
    }
    drop(local);
    embedded.shutdown().await;
    drop(critic);
    drop(controllers);
    node.shutdown().await;
    assert_roles_released(&cluster);
    eprintln!(
        "{PPO_STEPS} PPO steps with the critic on a node: {:.2?}",
        t0.elapsed()
    );
}

fn borrow(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}
