//! A training job across three real `yatt-node` processes: the rollout on one, the
//! policy and the reference on another, the reward on the third. The controller runs
//! in this process, which joins the cluster as a fourth node, or in a `yatt train
//! --cluster` child process; everything talks QUIC with mutual TLS over loopback. Tiny
//! model, the letters task of `config/demo-letters.toml`.

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use yatt_integration_tests::{poll, yatt_bin, Cluster};
use yatt_roles::job::{build_embedded, JobConfig};
use yatt_roles::ledger::Stage;
use yatt_roles::remote::build_cluster;
use yatt_runtime::Node;

const STEPS: u64 = 10;

fn letters_job(out: &std::path::Path, placement: &[(&str, &str)]) -> JobConfig {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let mut sets = vec![
        format!("job.steps={STEPS}"),
        format!("job.output_dir=\"{}\"", out.display()),
    ];
    for (k, v) in placement {
        sets.push(format!("placement.{k}=\"{v}\""));
    }
    JobConfig::load(config, &sets).unwrap()
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

/// Waits until no node hosts an actor: the roles a departed controller spawned are gone.
fn assert_roles_released(cluster: &Cluster) {
    for n in &cluster.nodes {
        let released = poll(Duration::from_secs(10), || {
            let h = n.health()?;
            h["hosted"].as_array()?.is_empty().then_some(())
        });
        assert!(
            released.is_some(),
            "{} still hosts roles: {:?}",
            n.name,
            n.health()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_trains_with_its_roles_on_three_nodes() {
    let t0 = Instant::now();
    let cluster = Cluster::start("tr", 3);
    let logs = || {
        cluster
            .nodes
            .iter()
            .map(|n| format!("--- {} ---\n{}", n.name, n.log()))
            .collect::<Vec<_>>()
            .join("\n")
    };
    let node = Node::builder("tr-controller")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .start()
        .await
        .expect("the controller joins");
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
    assert!(t0.elapsed() < Duration::from_secs(60), "{:?}", t0.elapsed());
}

#[test]
fn yatt_train_cluster_runs_the_demo_on_three_nodes() {
    let t0 = Instant::now();
    let cluster = Cluster::start("tc", 3);
    let out = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let log = out.path().join("train.log");
    let mut child = Command::new(yatt_bin())
        .arg("train")
        .arg(config)
        .args([
            "--set",
            "job.steps=4",
            "--set",
            "placement.mode=disaggregated",
        ])
        .args([
            "--set",
            "placement.rollout=tc-0",
            "--set",
            "placement.policy=tc-1",
        ])
        .args([
            "--set",
            "placement.reference=tc-1",
            "--set",
            "placement.reward=tc-2",
        ])
        .arg("--set")
        .arg(format!("job.output_dir=\"{}\"", out.path().display()))
        .arg("--cluster")
        .arg(cluster.nodes[0].addr.to_string())
        .arg("--dev")
        .arg("--certs")
        .arg(cluster.ca_dir())
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start yatt train");
    let status = poll(Duration::from_secs(60), || child.try_wait().ok().flatten());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let printed = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()),
        "yatt train --cluster: {status:?}\n{printed}"
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
