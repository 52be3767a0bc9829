//! A user's stages added to the step (`CustomRoles::stages`): a filter after the
//! reward drops samples through the ledger (they are never trained), a stage before
//! the advantages sees what the built-in stages filled in and only the samples the
//! filter kept, each reports its time and drops, and a stage that gives back a
//! sample it was not given fails the step naming itself.

use crate::common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError, Sample, SampleId};
use yatt_runtime::Node;
use yatt_trainer::{
    build_embedded_with, spawn_role, step_data_parallel, train_with, CustomRoles, ExtraStage,
    StageAt, TrainOptions,
};

/// A user's stage: `f` over the samples.
struct Stage<F> {
    name: String,
    f: F,
}

impl<F> Role for Stage<F>
where
    F: FnMut(Vec<Sample>) -> Result<Vec<Sample>, RoleError> + Send + 'static,
{
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        &self.name
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        (self.f)(samples)
    }
}

async fn stage<F>(node: &Node, name: &str, at: StageAt, f: F) -> ExtraStage
where
    F: FnMut(Vec<Sample>) -> Result<Vec<Sample>, RoleError> + Send + 'static,
{
    let role = Stage {
        name: name.to_string(),
        f,
    };
    let role = spawn_role(node, role, 0, DeviceGroup::cpu(node.name()))
        .await
        .unwrap();
    ExtraStage::new(name, at, role)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_filter_and_a_probe_run_in_their_places_and_dropped_samples_never_train() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let job = common::demo_config(out.path(), &["job.steps=3".into()]);
    let node = Node::builder("stages-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    // After the reward: drop every group's second sample, and see rewards set.
    let filter = stage(&node, "drop-second", StageAt::Reward, |s: Vec<Sample>| {
        assert!(s.iter().all(|x| x.reward.is_some()), "reward not set yet");
        Ok(s.into_iter().filter(|x| x.id.k != 1).collect())
    })
    .await;
    // Before the advantages: record what arrives; old log-probs must be there.
    let seen: Arc<Mutex<Vec<SampleId>>> = Default::default();
    let log = seen.clone();
    let probe = stage(
        &node,
        "probe",
        StageAt::OldLogProbs,
        move |s: Vec<Sample>| {
            for x in &s {
                if x.old_logprobs.is_none() || x.advantages.is_some() {
                    return Err(RoleError::Failed(format!("{:?} out of order", x.id)));
                }
            }
            log.lock().unwrap().extend(s.iter().map(|x| x.id));
            Ok(s)
        },
    )
    .await;
    let custom = CustomRoles {
        stages: vec![filter, probe],
        ..Default::default()
    };
    let mut controllers = build_embedded_with(&job, &node, None, &custom)
        .await
        .unwrap();
    let mut trained = BTreeSet::new();
    for _ in 0..3 {
        let reports = step_data_parallel(&mut controllers).await.unwrap();
        for r in &reports {
            trained.extend(r.train.trained.iter().copied());
            let m = &r.metrics;
            let prompts = job.data.prompts_per_step as f64;
            assert_eq!(m.get("stage/drop-second/dropped"), Some(prompts), "{m:?}");
            assert_eq!(m.get("stage/probe/dropped"), Some(0.0));
            assert!(m.get("timing_s/stage/probe").is_some());
        }
    }
    let seen: BTreeSet<SampleId> = seen.lock().unwrap().iter().copied().collect();
    assert_eq!(seen, trained);
    assert!(trained.iter().all(|id| id.k != 1));
    let per_step = job.data.prompts_per_step * (job.data.samples_per_prompt as usize - 1);
    assert_eq!(trained.len(), 3 * per_step);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stage_that_gives_back_a_sample_it_was_not_given_fails_the_step() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let job = common::demo_config(out.path(), &["job.steps=1".into()]);
    let node = Node::builder("stages-1")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let forger = stage(&node, "forger", StageAt::Reference, |mut s: Vec<Sample>| {
        let mut extra = s[0].clone();
        extra.id.k = 999;
        s.push(extra);
        Ok(s)
    })
    .await;
    let custom = CustomRoles {
        stages: vec![forger],
        ..Default::default()
    };
    let mut controllers = build_embedded_with(&job, &node, None, &custom)
        .await
        .unwrap();
    let e = step_data_parallel(&mut controllers)
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("forger") && e.contains("not given"), "{e}");
    node.shutdown().await;
}

/// Live placement builds and moves the rollout and policy replicas itself, but a user's
/// reward and stages sit outside its groups: they join every head it routes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_roles_outside_the_groups_run_under_live_placement() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let job = common::demo_config(
        out.path(),
        &[
            "job.steps=3".into(),
            "job.controllers=2".into(),
            "placement.live=true".into(),
        ],
    );
    let node = Node::builder("stages-live")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    // The user's reward: 1 for every response, counting what it scores.
    let scored = Arc::new(Mutex::new(0usize));
    let count = scored.clone();
    let reward = stage(
        &node,
        "all-ones",
        StageAt::Reward,
        move |mut s: Vec<Sample>| {
            *count.lock().unwrap() += s.len();
            for x in &mut s {
                x.reward = Some(1.0);
            }
            Ok(s)
        },
    )
    .await
    .role;
    let filter = stage(&node, "drop-second", StageAt::Reward, |s: Vec<Sample>| {
        Ok(s.into_iter().filter(|x| x.id.k != 1).collect())
    })
    .await;
    let options = TrainOptions {
        roles: CustomRoles {
            reward: Some(reward),
            stages: vec![filter],
            ..Default::default()
        },
        ..Default::default()
    };
    let summary = train_with(&job, &node, options, |_| {}).await.unwrap();
    assert_eq!(summary.steps, 3);
    assert_eq!(summary.rewards, vec![1.0; 3]);
    let per_step = 2 * job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    assert_eq!(*scored.lock().unwrap(), 3 * per_step);
    let metrics = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    for line in metrics.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(
            v["stage/drop-second/dropped"].as_f64(),
            Some(job.data.prompts_per_step as f64),
            "{line}"
        );
    }
    node.shutdown().await;
}
