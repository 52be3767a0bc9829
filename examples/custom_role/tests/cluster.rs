//! The example's daemon on a 3-node loopback cluster: two `custom-yatt-node` processes
//! (`yatt::node::main_with` with the example's roles) and this test process as the
//! trainer. The trainer spawns `length-format-reward` on the second daemon and
//! `repeat-filter` on the first by name, trains the demo job with them as the reward
//! and as an extra stage after it, and the daemon answers `/health` with the role
//! hosted, then shuts down on SIGTERM.

use std::time::Duration;

use custom_role::{LengthFormatReward, RepeatFilter, FILTER_NAME, ROLE_NAME};
use yatt_integration_tests::{cluster_logs, join, poll, Cluster};
use yatt_roles::{RoleRequest, RoleResponse, Sample};
use yatt_trainer::{train_with, CustomRoles, ExtraStage, JobConfig, StageAt, TrainOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_reward_on_main_with_daemons_trains_a_job() {
    // Cluster starts the daemon binary YATT_NODE_BIN names: this example's.
    std::env::set_var("YATT_NODE_BIN", env!("CARGO_BIN_EXE_custom-yatt-node"));
    let mut cluster = tokio::task::spawn_blocking(|| Cluster::start("custom", 2))
        .await
        .unwrap();
    let trainer = join(&cluster, "custom-trainer").await;
    let all_three = trainer
        .directory()
        .wait_until(Duration::from_secs(20), |d| d.alive_nodes().count() == 3)
        .await;
    assert!(
        all_three,
        "the trainer did not see both daemons:\n{}",
        cluster_logs(&cluster)
    );

    let host = cluster.nodes[1].name.clone();
    let reward = trainer
        .spawn_remote_linked::<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>, _>(
            &host,
            ROLE_NAME,
            &LengthFormatReward {
                min_len: 4,
                max_len: 6,
                alphabet: "aeiou".into(),
            },
            Duration::from_secs(20),
        )
        .await
        .unwrap_or_else(|e| {
            panic!(
                "spawning {ROLE_NAME} on {host}: {e}\n{}",
                cluster_logs(&cluster)
            )
        });
    // The daemon hosts it, as its /health says.
    let hosted = poll(Duration::from_secs(10), || {
        let h = cluster.nodes[1].health()?;
        h["hosted"]
            .as_array()?
            .iter()
            .any(|a| a.to_string().contains(ROLE_NAME))
            .then_some(())
    });
    assert!(hosted.is_some(), "{:?}", cluster.nodes[1].health());
    // A role the daemon does not register is refused, naming what it has.
    let e = trainer
        .spawn_remote::<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>, _>(
            &host,
            "no-such-role",
            &(),
            Duration::from_secs(20),
        )
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains(ROLE_NAME) && e.contains("reward"), "{e}");
    let filter = trainer
        .spawn_remote_linked::<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>, _>(
            &cluster.nodes[0].name,
            FILTER_NAME,
            &RepeatFilter { max_run: 2 },
            Duration::from_secs(20),
        )
        .await
        .unwrap_or_else(|e| panic!("spawning {FILTER_NAME}: {e}\n{}", cluster_logs(&cluster)));

    let out = tempfile::tempdir().unwrap();
    let config = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/demo-letters.toml"
    );
    let sets = [format!(
        "job.output_dir={:?}",
        out.path().display().to_string()
    )];
    let job = JobConfig::load(config, &sets).unwrap();
    let options = TrainOptions {
        roles: CustomRoles {
            reward: Some(reward),
            stages: vec![ExtraStage::new(FILTER_NAME, StageAt::Reward, filter)],
            ..Default::default()
        },
        ..Default::default()
    };
    let summary = train_with(&job, &trainer, options, |_| {}).await.unwrap();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let r = &summary.rewards;
    let (first, last) = (mean(&r[..5]), mean(&r[r.len() - 5..]));
    assert!(last > first + 0.2, "reward {first:.3} → {last:.3}");
    // The filter ran every step, and dropped responses once the model repeats vowels.
    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let dropped: Vec<f64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["stage/repeat-filter/dropped"].as_f64().unwrap()
        })
        .collect();
    assert_eq!(dropped.len() as u64, summary.steps);
    assert!(dropped.iter().sum::<f64>() > 0.0, "{dropped:?}");
    trainer.shutdown().await;

    for node in cluster.nodes.iter_mut().rev() {
        let code = node.terminate(Duration::from_secs(20));
        assert_eq!(
            code,
            Some(0),
            "{} did not stop cleanly:\n{}",
            node.name,
            node.log()
        );
    }
}

/// The stock `yatt train` runs `job.toml`, whose `[roles]` name the example's roles: it
/// links none of their code, spawns them on the daemons that register them with the
/// config's arguments, trains with them, and spawns them again on a resume (one moved to
/// the other daemon); a role no daemon registers, or arguments that do not fit the
/// role's type, are refused naming the key.
#[test]
fn the_stock_trainer_spawns_the_roles_a_job_config_names() {
    std::env::set_var("YATT_NODE_BIN", env!("CARGO_BIN_EXE_custom-yatt-node"));
    let cluster = Cluster::start("cfgroles", 2);
    let (host_0, host_1) = (&cluster.nodes[0].name, &cluster.nodes[1].name);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/job.toml");
    let placed = [
        format!("placement.rollout={host_0:?}"),
        format!("placement.policy={host_1:?}"),
        format!("placement.reference={host_1:?}"),
        format!("placement.reward={host_0:?}"),
        format!("roles.stages.0.node={host_0:?}"),
    ];
    let with = |extra: &[&str]| -> Vec<String> {
        placed
            .iter()
            .cloned()
            .chain(extra.iter().map(|s| s.to_string()))
            .collect()
    };
    let refused = |extra: &[&str]| {
        let out = tempfile::tempdir().unwrap();
        let sets = with(extra);
        let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
        let (ok, printed) =
            cluster.try_yatt_train(config, &sets, out.path(), Duration::from_secs(60));
        assert!(!ok, "{printed}");
        eprintln!("refused as expected:\n{printed}");
        printed
    };
    let e = refused(&[
        "roles.reward.role=\"no-such-role\"",
        &format!("roles.reward.node={host_1:?}"),
    ]);
    assert!(
        e.contains("roles.reward.role") && e.contains(ROLE_NAME),
        "{e}"
    );
    let e = refused(&["roles.reward.args.min_len=\"four\""]);
    assert!(
        e.contains("roles.reward.args") && e.contains("invalid type"),
        "{e}"
    );

    let out = tempfile::tempdir().unwrap();
    let sets = with(&["job.steps=20"]);
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    // While it trains, a daemon hosts the reward the config named.
    let printed = std::thread::scope(|s| {
        let run =
            s.spawn(|| cluster.yatt_train(config, &sets, out.path(), Duration::from_secs(300)));
        let hosted = poll(Duration::from_secs(120), || {
            cluster.nodes.iter().find_map(|n| {
                let h = n.health()?;
                let all = h["hosted"].to_string();
                (all.contains(ROLE_NAME) && all.contains(FILTER_NAME)).then_some(())
            })
        });
        let printed = run.join().unwrap();
        assert!(hosted.is_some(), "no daemon hosted both roles:\n{printed}");
        printed
    });
    assert!(printed.contains("done: 20 steps"), "{printed}");
    // Resumed to 30 steps with the reward on the other daemon: the roles are spawned
    // again from the run's job.toml, and where they run may change.
    let moved = format!("roles.reward.node={host_1:?}");
    let printed = cluster.yatt_resume(
        out.path(),
        &["job.steps=30", &moved],
        Duration::from_secs(300),
    );
    assert!(printed.contains("done: 30 steps"), "{printed}");
    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let rows: Vec<serde_json::Value> = metrics
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let rewards: Vec<f64> = rows
        .iter()
        .map(|v| v["critic/rewards/mean"].as_f64().unwrap())
        .collect();
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let (first, last) = (mean(&rewards[..5]), mean(&rewards[rewards.len() - 5..]));
    assert!(last > first + 0.2, "reward {first:.3} → {last:.3}");
    let dropped: f64 = rows
        .iter()
        .map(|v| v["stage/repeat-filter/dropped"].as_f64().unwrap())
        .sum();
    assert!(dropped > 0.0, "the filter dropped nothing");
}

/// `yatt train job.toml --dry-run` on the example's daemons: every preflight check
/// passes (the roles `[roles]` names are registered on the daemons it places them on),
/// one step runs through them, and no actor is left on either daemon.
#[test]
fn a_dry_run_of_the_job_config_passes_and_leaves_no_actor() {
    std::env::set_var("YATT_NODE_BIN", env!("CARGO_BIN_EXE_custom-yatt-node"));
    let cluster = Cluster::start("cfgdry", 2);
    let (host_0, host_1) = (&cluster.nodes[0].name, &cluster.nodes[1].name);
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/job.toml");
    let sets = [
        format!("placement.rollout={host_0:?}"),
        format!("placement.policy={host_1:?}"),
        format!("placement.reference={host_1:?}"),
        format!("placement.reward={host_0:?}"),
        format!("roles.stages.0.node={host_0:?}"),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let out = tempfile::tempdir().unwrap();
    let (ok, printed) =
        cluster.try_yatt_dry_run(config, &sets, out.path(), Duration::from_secs(180));
    assert!(ok, "{printed}\n{}", cluster_logs(&cluster));
    assert!(printed.contains("dry run passed"), "{printed}");
    yatt_integration_tests::assert_roles_released(&cluster);
}

/// A daemon dies (`kill -9`) mid-run with the reward and the stage that `[roles]` named
/// on it: the stock trainer spawns both again, by name, on a daemon that registers
/// them, the step runs again, and the run completes.
#[test]
fn roles_a_job_config_names_are_spawned_again_when_their_daemon_dies() {
    std::env::set_var("YATT_NODE_BIN", env!("CARGO_BIN_EXE_custom-yatt-node"));
    let cluster = Cluster::start("cfgloss", 3);
    let names: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();
    let victim = cluster.nodes[2].pid;
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/job.toml");
    let sets = [
        format!("placement.rollout={:?}", names[0]),
        format!("placement.policy={:?}", names[1]),
        format!("placement.reference={:?}", names[1]),
        format!("placement.reward={:?}", names[0]),
        format!("roles.reward.node={:?}", names[2]),
        format!("roles.stages.0.node={:?}", names[2]),
    ];
    let sets: Vec<&str> = sets.iter().map(String::as_str).collect();
    let out = tempfile::tempdir().unwrap();
    let metrics = out.path().join("metrics.jsonl");
    let printed = std::thread::scope(|s| {
        let run =
            s.spawn(|| cluster.yatt_train(config, &sets, out.path(), Duration::from_secs(300)));
        let started = poll(Duration::from_secs(120), || {
            if run.is_finished() {
                return Some(false);
            }
            let text = std::fs::read_to_string(&metrics).ok()?;
            (text.lines().count() >= 5).then_some(true)
        });
        if started != Some(true) {
            let ended = run.join();
            panic!("the run did not reach step 5: {ended:?}");
        }
        let killed = std::process::Command::new("kill")
            .args(["-9", &victim.to_string()])
            .status()
            .unwrap();
        assert!(killed.success());
        run.join().unwrap()
    });
    assert!(printed.contains("done: 30 steps"), "{printed}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 30);
    let respawned: f64 = rows
        .iter()
        .filter_map(|v| v["recovery/respawned_roles"].as_f64())
        .sum();
    assert_eq!(respawned, 2.0, "the reward and the stage, once each");
    // The filter reported at every step, before and after its daemon died.
    assert!(rows
        .iter()
        .all(|v| v["stage/repeat-filter/dropped"].as_f64().is_some()));
}
