//! User roles in a disaggregated job on stock `yatt-node`s: the built-in rollout, policy
//! and reference run on two daemons as [placement] names them, while the user's reward
//! (a role of the user's own type) and an extra stage run in the trainer's process. The
//! job trains; the user's roles serve every step, and the stage's metrics are recorded.
//! With no KL term (`algorithm.kl_mode = "none"`) no reference is spawned, as embedded.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use yatt_integration_tests::{cluster_logs, join, Cluster};
use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError, Sample};
use yatt_trainer::{
    reward_role, spawn_role, train_with, CustomRoles, ExtraStage, JobConfig, StageAt, TrainOptions,
};

/// The user's role: `inner` under the user's own name, counting what it serves.
struct Counted<R> {
    name: &'static str,
    inner: R,
    served: Arc<AtomicUsize>,
}

impl<R: Role<Request = Vec<Sample>, Response = Vec<Sample>>> Role for Counted<R> {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        self.name
    }

    fn profile(&self) -> ResourceProfile {
        self.inner.profile()
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.inner.start(group)
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        self.served.fetch_add(samples.len(), Ordering::SeqCst);
        self.inner.serve(samples)
    }
}

/// A stage that passes every sample on.
struct PassThrough;

impl Role for PassThrough {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "pass-through"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        Ok(samples)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_roles_join_a_disaggregated_job_on_stock_daemons() {
    let cluster = Cluster::start("cr", 2);
    let trainer = join(&cluster, "cr-trainer").await;
    let out = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        format!("job.output_dir={:?}", out.path().display().to_string()),
        "job.steps=12".into(),
        "placement.mode=\"disaggregated\"".into(),
        "placement.rollout=\"cr-0\"".into(),
        "placement.policy=\"cr-1\"".into(),
        "placement.reference=\"cr-1\"".into(),
        "algorithm.kl_mode=\"none\"".into(),
        // Named, but the user's reward takes the slot (and there is no KL term for a
        // reference): nothing is spawned for them.
        "placement.reward=\"cr-0\"".into(),
    ];
    let job = JobConfig::load(config, &sets).unwrap();
    let here = || DeviceGroup::cpu(trainer.name());
    let served = Arc::new(AtomicUsize::new(0));
    let reward = Counted {
        name: "my-reward",
        inner: reward_role(&job).unwrap(),
        served: served.clone(),
    };
    let reward = spawn_role(&trainer, reward, 0, here()).await.unwrap();
    let stage = spawn_role(&trainer, PassThrough, 0, here()).await.unwrap();
    let options = TrainOptions {
        roles: CustomRoles {
            reward: Some(reward),
            stages: vec![ExtraStage::new("pass-through", StageAt::Reward, stage)],
            ..Default::default()
        },
        ..Default::default()
    };
    // While the job runs, the daemons host the built-in rollout and policy, and neither
    // a reward (the user's took the slot) nor a reference (no KL term).
    let mut hosted = Vec::new();
    let summary = train_with(&job, &trainer, options, |p| {
        if p.step == 1 {
            hosted = cluster
                .nodes
                .iter()
                .map(|n| {
                    n.health()
                        .map(|h| h["hosted"].to_string())
                        .unwrap_or_default()
                })
                .collect();
        }
    })
    .await
    .unwrap_or_else(|e| panic!("{e}\n{}", cluster_logs(&cluster)));
    assert_eq!(summary.steps, 12);
    // Every sample of every step went through the user's reward (64 a step).
    assert_eq!(served.load(Ordering::SeqCst), 12 * 64);
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
    let r = &summary.rewards;
    assert!(
        mean(&r[r.len() - 3..]) > mean(&r[..3]),
        "the job did not learn: {r:?}"
    );
    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let dropped: Vec<f64> = metrics
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["stage/pass-through/dropped"].as_f64().unwrap()
        })
        .collect();
    assert_eq!(dropped, vec![0.0; 12]);
    assert!(
        hosted[0].contains("cr-0/rollout/")
            && hosted[1].contains("cr-1/policy/")
            && hosted
                .iter()
                .all(|h| !h.contains("/reward/") && !h.contains("/reference/")),
        "{hosted:?}"
    );
    // The job over, the trainer still in the cluster: the roles the job started on the
    // daemons have stopped, and the user's own (on the trainer's node) still run.
    let after: Vec<String> = cluster
        .nodes
        .iter()
        .map(|n| match n.health() {
            Some(h) => h["hosted"].to_string(),
            None => panic!("a daemon's /health did not answer"),
        })
        .collect();
    assert!(
        after
            .iter()
            .all(|h| !h.contains("/rollout/") && !h.contains("/policy/")),
        "the job left roles on the daemons: {after:?}"
    );
    assert_eq!(trainer.hosted().len(), 2, "{:?}", trainer.hosted());
    trainer.shutdown().await;
}
