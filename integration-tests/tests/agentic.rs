//! Environments as actors on a loopback cluster of real `yatt-node` processes: the
//! rollout (with the policy, the reference and the reward) on one node, the rollout's
//! pool of environment actors on another. Multi-turn episodes of the guess-number game
//! go over QUIC; then the environment node is killed (SIGKILL) and started again, and
//! the next step's episodes are retried on environment actors the rollout's pool
//! spawned again there. A second test hosts the environment actors on the test's own
//! node, where one of them crashes in the middle of an episode: the episodes that actor
//! held fail, the others finish, and the pool starts a new actor in its place.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use yatt_integration_tests::{cluster_logs, join, poll, Cluster};
use yatt_roles::{
    DeviceGroup, Env, EnvError, EnvFactory, EnvRole, EnvStep, GuessNumberEnv, Prompt, RoleActor,
};
use yatt_runtime::Node;
use yatt_trainer::{build_cluster, JobConfig, RoleArgs};

fn guessing_job(out: &std::path::Path) -> JobConfig {
    guessing_job_on(out, "ag-0", "ag-1")
}

/// The guessing job with every role on `roles` and the environment actors on `envs`.
fn guessing_job_on(out: &std::path::Path, roles: &str, envs: &str) -> JobConfig {
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        format!("job.output_dir=\"{}\"", out.display()),
        "job.steps=3".into(),
        "model.max_seq_len=320".into(),
        "data.prompts_per_step=2".into(),
        "data.samples_per_prompt=4".into(),
        "rollout.max_new_tokens=160".into(),
        "rollout.env={ kind = \"guess-number\", max_turns = 3, max_turn_tokens = 4, max_env_tokens = 40, timeout_s = 5, pool = 2 }".into(),
        "placement.mode=\"disaggregated\"".into(),
        format!("placement.rollout={roles:?}"),
        format!("placement.policy={roles:?}"),
        format!("placement.reference={roles:?}"),
        format!("placement.reward={roles:?}"),
        format!("placement.env={envs:?}"),
        "placement.spawn_timeout_s=10".into(),
    ];
    JobConfig::load(config, &sets).unwrap()
}

/// The environment actors node `i` hosts.
fn env_actors(cluster: &Cluster, i: usize) -> Vec<String> {
    cluster.nodes[i]
        .health()
        .and_then(|h| {
            h["hosted"].as_array().map(|a| {
                a.iter()
                    .filter_map(|v| v.as_str())
                    .filter(|s| s.contains("/env/"))
                    .map(String::from)
                    .collect()
            })
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_run_on_environment_actors_of_another_node_and_survive_its_crash() {
    let mut cluster = Cluster::start("ag", 2);
    let node = join(&cluster, "ag-controller").await;
    let out = tempfile::tempdir().unwrap();
    let job = guessing_job(out.path());
    let mut controllers = build_cluster(&job, &node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", cluster_logs(&cluster)));
    let c = &mut controllers[0];
    let before = env_actors(&cluster, 1);
    assert_eq!(before.len(), 2, "the pool's actors on ag-1: {before:?}");
    assert!(env_actors(&cluster, 0).is_empty());

    let check = |report: &yatt_trainer::StepReport, step: u64| {
        let m = |k: &str| report.metrics.get(k).unwrap_or(f64::NAN);
        assert_eq!(report.samples.len(), 8, "step {step}");
        // Every episode took its three turns, on the remote environments, none failed.
        assert_eq!(m("env/turns_mean"), 3.0, "step {step}");
        assert_eq!(m("env/episodes_failed"), 0.0, "step {step}");
        let share = m("env/model_token_share");
        assert!(share > 0.0 && share < 1.0, "step {step}: {share}");
        for s in &report.samples {
            let info = s.episode.as_ref().unwrap();
            assert_eq!(info.env_failed, None, "{}", s.id);
            // The game's answers are in the response, masked out of the loss.
            assert!(s.loss_mask.as_ref().unwrap().contains(&0), "{}", s.id);
            assert!(
                s.response_text.contains("number") || s.response_text.contains("er."),
                "{}",
                s.response_text
            );
        }
    };
    let first = c
        .step()
        .await
        .unwrap_or_else(|e| panic!("step 0: {e}\n{}", cluster_logs(&cluster)));
    check(&first, 0);

    // The environment node crashes and comes back as a new process: the pool's actor
    // references are dead; the next step's resets fail, are retried, and the pool
    // spawns its actors again on the restarted node.
    cluster.nodes[1].kill9();
    let seen_dead = poll(Duration::from_secs(20), || {
        (cluster.nodes[0].sees_alive("ag-1") == Some(false)).then_some(())
    });
    assert!(
        seen_dead.is_some(),
        "ag-0 never saw ag-1 die\n{}",
        cluster_logs(&cluster)
    );
    cluster.restart(1, &[]);
    assert!(env_actors(&cluster, 1).is_empty());
    let second = c
        .step()
        .await
        .unwrap_or_else(|e| panic!("step 1 after the crash: {e}\n{}", cluster_logs(&cluster)));
    check(&second, 1);
    let after = poll(Duration::from_secs(10), || {
        let a = env_actors(&cluster, 1);
        (a.len() == 2).then_some(a)
    })
    .unwrap_or_else(|| {
        panic!(
            "the pool did not restart its actors on ag-1: {:?}",
            env_actors(&cluster, 1)
        )
    });
    assert!(
        after.iter().all(|a| !before.contains(a)),
        "{before:?} -> {after:?}"
    );
}

/// The guessing game, except that the `crash_at`-th guess of the whole node (counted in
/// `guesses`) crashes the actor it runs in: a panic mid-episode.
struct CrashOnce {
    game: GuessNumberEnv,
    guesses: Arc<AtomicUsize>,
    crash_at: usize,
}

impl Env for CrashOnce {
    fn reset(&mut self, prompt: &Prompt) -> Result<String, EnvError> {
        self.game.reset(prompt)
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
        if self.guesses.fetch_add(1, Ordering::SeqCst) + 1 == self.crash_at {
            panic!("the tool crashed mid-episode");
        }
        self.game.step(action)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_environment_actor_that_crashes_mid_episode_fails_only_its_episodes() {
    let cluster = Cluster::start("agc", 1);
    // The test's node hosts the environment actors the rollout (on agc-0) spawns: the
    // guessing game, crashing on the 3rd guess it is asked for (the 1st turn of every
    // episode is a guess, so that is mid-episode).
    let guesses = Arc::new(AtomicUsize::new(0));
    let counted = guesses.clone();
    let env_node = Node::builder("agc-env")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .factory_async("env", move |_: RoleArgs| {
            let guesses = counted.clone();
            async move {
                let factory: Arc<dyn EnvFactory> =
                    Arc::new(move |p: &Prompt| -> Result<Box<dyn Env>, EnvError> {
                        Ok(Box::new(CrashOnce {
                            game: GuessNumberEnv::for_prompt(p),
                            guesses: guesses.clone(),
                            crash_at: 3,
                        }))
                    });
                RoleActor::build(
                    "env",
                    move || Ok(EnvRole::new(factory)),
                    DeviceGroup::cpu("agc-env"),
                    64,
                )
                .await
                .map_err(|e| e.to_string())
            }
        })
        .start()
        .await
        .unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = guessing_job_on(out.path(), "agc-0", "agc-env");
    let mut controllers = build_cluster(&job, &env_node)
        .await
        .unwrap_or_else(|e| panic!("building on the cluster: {e}\n{}", cluster_logs(&cluster)));
    let c = &mut controllers[0];
    let report = c
        .step()
        .await
        .unwrap_or_else(|e| panic!("the step with a crash: {e}\n{}", cluster_logs(&cluster)));
    let failed: Vec<_> = report
        .samples
        .iter()
        .filter(|s| s.episode.as_ref().unwrap().env_failed.is_some())
        .collect();
    // The pool deals the 8 episodes round-robin to its 2 actors: the crash takes the 4
    // the crashed actor held (the one whose guess crashed it, and the 3 others at their
    // next call); the other actor's 4 play on (a game ends early only on a right guess).
    assert_eq!(report.samples.len(), 8);
    assert_eq!(
        failed.len(),
        4,
        "the crashed actor's episodes fail, and no other"
    );
    assert_eq!(report.metrics.get("env/episodes_failed"), Some(4.0));
    let played: u32 = report
        .samples
        .iter()
        .filter(|s| !failed.contains(s))
        .map(|s| s.episode.as_ref().unwrap().turns)
        .sum();
    assert!(
        played >= 4 * 2,
        "the surviving episodes played {played} turns"
    );
    // The next step runs clean on the actor the pool started in place of the crashed one.
    let next = c.step().await.unwrap();
    assert_eq!(next.metrics.get("env/episodes_failed"), Some(0.0));
    assert!(next
        .samples
        .iter()
        .all(|s| s.episode.as_ref().unwrap().env_failed.is_none()));
    drop(controllers);
    env_node.shutdown().await;
}
