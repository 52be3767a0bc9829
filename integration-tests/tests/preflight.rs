//! A job that will fail fails before its first step: the preflight checks on real
//! `yatt-node` daemons (paths under the data-directory rule, the model's hash, a Python
//! reward's import, the prompts, the disk, the trainer's certificate), `yatt train
//! --dry-run` on the shipped configs, and a refused end-of-run save that keeps the
//! weights.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use yatt_integration_tests::{
    assert_roles_released, cluster_logs, placed, poll, steps_done, yatt_bin, yatt_node_bin, Cluster,
};

const DEMO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
const LIVE_CLUSTER: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../config/live-placement-cluster.toml"
);

/// `placed` with the run's placement on PREFIX-0 (rollout), -1 (policy, reference),
/// -2 (reward).
fn demo_placed(prefix: &str, steps: u64) -> Vec<String> {
    let mut sets = placed(
        prefix,
        steps,
        &[
            ("rollout", 0),
            ("policy", 1),
            ("reference", 1),
            ("reward", 2),
        ],
    );
    sets.retain(|s| !s.starts_with("checkpoint.every"));
    sets
}

fn refs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `yatt train CONFIG --dry-run` against `cluster` (None: embedded), output in `out`:
/// whether it exited 0, and what it printed.
fn dry_run(cluster: Option<&Cluster>, config: &str, sets: &[String], out: &Path) -> (bool, String) {
    dry_run_in(cluster, config, sets, out, None)
}

/// [`dry_run`] with the trainer in the working directory `cwd`.
fn dry_run_in(
    cluster: Option<&Cluster>,
    config: &str,
    sets: &[String],
    out: &Path,
    cwd: Option<&Path>,
) -> (bool, String) {
    let mut cmd = Command::new(yatt_bin());
    if let Some(d) = cwd {
        cmd.current_dir(d);
    }
    cmd.arg("train").arg(config).arg("--dry-run");
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.arg("--set")
        .arg(format!("job.output_dir=\"{}\"", out.display()));
    if let Some(c) = cluster {
        cmd.arg("--cluster")
            .arg(c.nodes[0].addr.to_string())
            .arg("--dev")
            .arg("--certs")
            .arg(c.ca_dir());
    }
    let o = cmd
        .env("RUST_LOG", "warn")
        .output()
        .expect("run yatt train --dry-run");
    (
        o.status.success(),
        format!(
            "{:?}\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        ),
    )
}

/// The scenario: the daemons' data directories do not hold `job.output_dir`.
/// It fails before step 1, within 10 s, naming the policy's node, the key, its data
/// directory and both fixes, and leaves nothing running.
#[test]
fn an_output_dir_outside_the_nodes_data_directories_fails_before_step_1() {
    let base = tempfile::tempdir().unwrap();
    let data: Vec<PathBuf> = (0..3)
        .map(|i| base.path().join(format!("data-{i}")))
        .collect();
    let args: Vec<Vec<String>> = data
        .iter()
        .map(|d| vec!["--data-dir".to_string(), d.display().to_string()])
        .collect();
    let args: Vec<Vec<&str>> = args.iter().map(|a| refs(a)).collect();
    let args: Vec<&[&str]> = args.iter().map(Vec::as_slice).collect();
    let cluster = Cluster::start_with("pfa", &args);
    let out = base.path().join("elsewhere/run");
    std::fs::create_dir_all(&out).unwrap();
    let sets = demo_placed("pfa", 300);
    let t = Instant::now();
    let (ok, printed) = cluster.try_yatt_train(DEMO, &refs(&sets), &out, Duration::from_secs(60));
    let took = t.elapsed();
    assert!(!ok, "{printed}");
    assert!(took < Duration::from_secs(10), "took {took:?}\n{printed}");
    let data1 = data[1].canonicalize().unwrap();
    for want in [
        "preflight",
        "pfa-1",
        "job.output_dir",
        &data1.display().to_string(),
        "set job.output_dir under it",
        "start the node with a data directory",
    ] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert_eq!(steps_done(&out), 0, "{printed}");
    assert_roles_released(&cluster);
}

/// One byte of the model differs between the rollout's node and the policy's: the
/// preflight names both nodes and refuses to start.
#[test]
fn a_model_differing_by_one_byte_between_nodes_fails() {
    let base = tempfile::tempdir().unwrap();
    let cwd: Vec<(usize, PathBuf)> = (0..3)
        .map(|i| {
            let d = base.path().join(format!("node-{i}"));
            let m = d.join("model");
            std::fs::create_dir_all(&m).unwrap();
            std::fs::write(m.join("config.json"), "{}").unwrap();
            let mut w = vec![1u8; 64 << 10];
            if i == 0 {
                w[1234] = 2;
            }
            std::fs::write(m.join("model.safetensors"), w).unwrap();
            (i, d)
        })
        .collect();
    let cluster = Cluster::start_in("pfm", &[&[], &[], &[]], &[], &cwd);
    let out = tempfile::tempdir().unwrap();
    let mut sets = demo_placed("pfm", 5);
    sets.push("model.source=\"model\"".into());
    // The trainer (which validates the path) sees node 1's copy.
    let (ok, printed) = dry_run_in(
        Some(&cluster),
        DEMO,
        &sets,
        &out.path().join("run"),
        Some(&cwd[1].1),
    );
    assert!(!ok, "{printed}");
    for want in [
        "model.source",
        "differs between the nodes",
        "pfm-0",
        "pfm-1",
        "rsync",
    ] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert_roles_released(&cluster);
}

/// A Python reward that raises on import fails the preflight on the reward's node.
#[test]
fn a_python_reward_that_raises_on_import_fails_on_its_node() {
    let cluster = Cluster::start("pfp", 3);
    let out = tempfile::tempdir().unwrap();
    let reward = out.path().join("bad_reward.py");
    std::fs::write(
        &reward,
        "raise RuntimeError('no such module: rewardlib')\ndef score(prompt, response, reference):\n    return 0.0\n",
    )
    .unwrap();
    let mut sets = demo_placed("pfp", 5);
    sets.push("reward.kind=\"python\"".into());
    sets.push(format!("reward.function=\"{}:score\"", reward.display()));
    let (ok, printed) =
        cluster.try_yatt_train(DEMO, &refs(&sets), out.path(), Duration::from_secs(90));
    assert!(!ok, "{printed}");
    for want in ["pfp-2", "reward.function", "rewardlib"] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert_roles_released(&cluster);
}

/// A prompt longer than `model.max_seq_len` leaves for it: named, before anything runs.
#[test]
fn a_prompt_that_does_not_fit_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("prompts.jsonl");
    let long = "x".repeat(200);
    let rows: Vec<String> = (0..16)
        .map(|i| match i {
            1 => format!("{{\"prompt\": \"{long}\"}}"),
            i => format!("{{\"prompt\": \"q{i}:\"}}"),
        })
        .collect();
    std::fs::write(&data, rows.join("\n") + "\n").unwrap();
    let sets = vec![format!("data.jsonl=\"{}\"", data.display())];
    let out = dir.path().join("run");
    let (ok, printed) = dry_run(None, DEMO, &sets, &out);
    assert!(!ok, "{printed}");
    for want in ["model.max_seq_len", "row 1", "FAIL"] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert!(!out.exists(), "the dry run left {}", out.display());
}

/// A disk too small for the checkpoints (the free-space figure faked on the policy's
/// node through the test hook) is a warning naming the node, the key and the sizes.
#[test]
fn a_disk_too_small_for_the_checkpoints_warns() {
    let cluster = Cluster::start_with_env(
        "pfd",
        &[&[], &[], &[]],
        &[(1, yatt_trainer::FREE_BYTES_TEST_HOOK, "1000")],
    );
    let out = tempfile::tempdir().unwrap();
    let run = out.path().join("run");
    let (ok, printed) = dry_run(Some(&cluster), DEMO, &demo_placed("pfd", 5), &run);
    assert!(ok, "{printed}\n{}", cluster_logs(&cluster));
    let warn = printed
        .lines()
        .find(|l| l.contains("warn pfd-1: free space (job.output_dir)"))
        .unwrap_or_else(|| panic!("no free-space warning:\n{printed}"));
    assert!(
        warn.contains("0.0 MiB free") && warn.contains("larger disk"),
        "{warn}"
    );
    assert_roles_released(&cluster);
}

/// A trainer certificate issued already expired is refused before joining, naming it
/// and the command that issues a new one.
#[test]
fn an_expired_trainer_certificate_is_refused_with_the_fix() {
    let cluster = Cluster::start("pfc", 3);
    let certs = tempfile::tempdir().unwrap();
    let issued = Command::new(yatt_node_bin())
        .arg("cert")
        .arg("--ca-dir")
        .arg(cluster.ca_dir())
        .args([
            "--name",
            "train",
            "--kind",
            "trainer",
            "--valid-until",
            "2020-01-01",
        ])
        .arg("--out")
        .arg(certs.path())
        .output()
        .unwrap();
    assert!(issued.status.success(), "{issued:?}");
    let out = tempfile::tempdir().unwrap();
    let t = Instant::now();
    let (ok, printed) = cluster.try_yatt_train_as(
        DEMO,
        &refs(&demo_placed("pfc", 5)),
        out.path(),
        (certs.path(), "train"),
        Duration::from_secs(60),
    );
    assert!(!ok, "{printed}");
    assert!(t.elapsed() < Duration::from_secs(10), "{printed}");
    for want in ["train.pem", "expired", "yatt-node cert", "--kind trainer"] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
}

/// `yatt train --dry-run` on the demo, embedded: every check passes, one step runs,
/// and no run directory is left.
#[test]
fn dry_run_of_the_demo_embedded_passes_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, printed) = dry_run(None, DEMO, &[], &out);
    assert!(ok, "{printed}");
    for want in [
        "would run:",
        "ok   ",
        "one step through every stage",
        "dry run passed",
    ] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert!(!printed.contains("FAIL"), "{printed}");
    assert!(!out.exists(), "the dry run left {}", out.display());
}

/// `yatt train --dry-run` of the demo disaggregated over three daemons: it passes,
/// says what runs where, and no actor is left on any daemon.
#[test]
fn dry_run_of_the_demo_on_a_cluster_passes_and_leaves_no_actor() {
    let cluster = Cluster::start("pfr", 3);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let (ok, printed) = dry_run(Some(&cluster), DEMO, &demo_placed("pfr", 30), &out);
    assert!(ok, "{printed}\n{}", cluster_logs(&cluster));
    for want in [
        "rollout: pfr-0",
        "policy: pfr-1",
        "reward: pfr-2",
        "ok   pfr-1: checkpoint path (job.output_dir)",
        "dry run passed",
    ] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert_roles_released(&cluster);
    assert!(!out.exists(), "the dry run left {}", out.display());
}

/// `yatt train --dry-run` of config/live-placement-cluster.toml on its three daemons
/// (one with two virtual devices): it passes and leaves no actor.
#[test]
fn dry_run_of_the_live_placement_cluster_config_passes_and_leaves_no_actor() {
    let cluster = Cluster::start_with("pfl", &[&[], &["--virtual-devices", "2"], &[]]);
    let dir = tempfile::tempdir().unwrap();
    let sets = vec![
        "placement.nodes=[\"pfl-1\", \"pfl-2\"]".to_string(),
        "placement.reward=\"pfl-0\"".into(),
        "placement.reference=\"pfl-0\"".into(),
    ];
    let (ok, printed) = dry_run(Some(&cluster), LIVE_CLUSTER, &sets, &dir.path().join("run"));
    assert!(ok, "{printed}\n{}", cluster_logs(&cluster));
    assert!(
        printed.contains("live placement over the devices of pfl-1, pfl-2"),
        "{printed}"
    );
    assert_roles_released(&cluster);
}

/// The end-of-run save is refused by the policy's node (the run's directory was moved
/// outside its data directory mid-run): the weights are saved under that node's data
/// directory instead, the path printed, and the error names the end-of-run save.
#[test]
fn a_refused_end_of_run_save_keeps_the_weights() {
    let cluster = Cluster::start("pfs", 3);
    // Under the daemons' data directory (the system temporary directory)...
    let base = tempfile::tempdir().unwrap();
    let out = base.path().join("run");
    std::fs::create_dir_all(&out).unwrap();
    // ... and a place outside it.
    let outside = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    // Enough steps that the directory is swapped long before the end, however fast
    // the machine: at 60 a quiet machine ran every step in 2.6 s and saved before the
    // swap (a clean-clone CI run, 2026-12-07).
    let steps = 400;
    let run = cluster.spawn_train(DEMO, &demo_placed("pfs", steps), &out, false);
    let stepped = poll(Duration::from_secs(60), || {
        (steps_done(&out) >= 1).then_some(())
    });
    assert!(
        stepped.is_some(),
        "{}\n{}",
        run.printed(),
        cluster_logs(&cluster)
    );
    std::fs::rename(&out, base.path().join("moved")).unwrap();
    std::os::unix::fs::symlink(outside.path(), &out).unwrap();
    let mut run = run;
    let status = run.wait(Duration::from_secs(300));
    // The log files moved with the directory.
    let printed = std::fs::read_to_string(base.path().join("moved/train.log")).unwrap_or_default()
        + &std::fs::read_to_string(base.path().join("moved/train.err")).unwrap_or_default();
    assert!(
        status.is_some_and(|s| !s.success()),
        "{status:?}\n{printed}"
    );
    assert!(
        printed.contains(&format!(
            "the end-of-run save (after step {steps} of {steps})"
        )),
        "{printed}"
    );
    assert!(
        !printed.contains(&format!("step {}", steps + 1)),
        "{printed}"
    );
    let line = printed
        .lines()
        .find(|l| l.contains("the weights were saved instead on"))
        .unwrap_or_else(|| panic!("no rescue:\n{printed}"));
    let at = line
        .split(" at ")
        .nth(1)
        .and_then(|r| r.split(['(', ';']).next())
        .map(|p| PathBuf::from(p.trim()))
        .unwrap_or_else(|| panic!("no path in {line}"));
    let files: Vec<String> = std::fs::read_dir(&at)
        .unwrap_or_else(|e| panic!("{}: {e}\n{printed}", at.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.iter().any(|f| f.ends_with(".safetensors"))
            && files.contains(&"run_state.json".to_string()),
        "{files:?}"
    );
    let _ = std::fs::remove_dir_all(&at);
    assert_roles_released(&cluster);
}

/// Roles whose resident estimate exceeds the configured device budget fail the
/// preflight, naming the check, the key and the numbers.
#[test]
fn roles_beyond_the_memory_budget_fail_naming_the_budget() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let sets = vec!["placement.device_memory_gb=0.000001".to_string()];
    let (ok, printed) = dry_run(None, DEMO, &sets, &out);
    assert!(!ok, "{printed}");
    for want in ["memory", "placement.device_memory_gb", "resident", "FAIL"] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert!(!out.exists(), "the dry run left {}", out.display());
}

/// A rollout's KV cache budget counts in its resident estimate: one that does not fit
/// the device budget fails the preflight, naming the key to lower.
#[test]
fn a_kv_cache_budget_beyond_the_device_fails_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let sets = vec![
        "placement.device_memory_gb=1".to_string(),
        "rollout.kv_cache_bytes=4000000000".to_string(),
    ];
    let (ok, printed) = dry_run(None, DEMO, &sets, &out);
    assert!(!ok, "{printed}");
    for want in [
        "memory",
        "rollout.kv_cache_bytes",
        "rollout 3.7 GiB",
        "FAIL",
    ] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
}

/// An HTTP reward that does not answer fails the preflight before step 1, naming
/// `reward.url`.
#[test]
fn an_http_reward_that_does_not_answer_fails_naming_its_url() {
    // A port nothing listens on: bound, then closed.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("run");
    let sets = vec![
        "reward.kind=\"http\"".to_string(),
        format!("reward.url=\"http://127.0.0.1:{port}/score\""),
        "reward.timeout_s=2".into(),
        "reward.max_retries=0".into(),
    ];
    let (ok, printed) = dry_run(None, DEMO, &sets, &out);
    assert!(!ok, "{printed}");
    for want in ["reward.url", "FAIL"] {
        assert!(printed.contains(want), "missing {want:?}:\n{printed}");
    }
    assert!(!out.exists(), "the dry run left {}", out.display());
}

/// Regression: a run started while a node its placement names was still joining waited
/// for it in the build, but the preflight before it asked the node at once and failed
/// with "unknown node (not in the directory)".
#[test]
fn a_run_started_before_its_policys_node_joins_waits_for_it() {
    let mut cluster = Cluster::start("late", 1);
    let out = tempfile::tempdir().unwrap();
    let roles = [
        ("rollout", 0),
        ("reward", 0),
        ("reference", 0),
        ("policy", 1),
    ];
    let mut run = cluster.spawn_train(DEMO, &placed("late", 2, &roles), out.path(), false);
    let joined = poll(Duration::from_secs(60), || {
        run.printed().contains("cluster: joined as").then_some(())
    });
    assert!(joined.is_some(), "the run did not join:\n{}", run.printed());
    cluster.add_node();
    run.wait_success(Duration::from_secs(120), &cluster);
}
