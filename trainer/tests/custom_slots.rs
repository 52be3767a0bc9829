//! User roles in every slot of an embedded job: a user's rollout, reference, policy,
//! reward and (PPO) critic, each a role of the user's own type (here a wrapper that
//! counts its requests around a built-in role), take their slots and are driven by the
//! controllers; slots the job cannot use are refused with the reason.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use common::demo_config;
use tch::{Device, Kind};
use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError, WeightsUpdate};
use yatt_runtime::Node;
use yatt_trainer::{
    base_model, critic_role, policy_role, reference_role, reward_role, rollout_role, spawn_role,
    train_with, CustomRoles, JobConfig, TrainOptions,
};

/// A user's role: `inner` under the user's own name, counting the requests it serves.
struct Counted<R> {
    name: &'static str,
    inner: R,
    served: Arc<AtomicUsize>,
}

impl<R: Role> Role for Counted<R> {
    type Request = R::Request;
    type Response = R::Response;

    fn name(&self) -> &str {
        self.name
    }

    fn profile(&self) -> ResourceProfile {
        self.inner.profile()
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.inner.start(group)
    }

    fn serve(&mut self, request: R::Request) -> Result<R::Response, RoleError> {
        self.served.fetch_add(1, Ordering::SeqCst);
        self.inner.serve(request)
    }

    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        self.inner.load_weights(update)
    }

    fn stop(&mut self) {
        self.inner.stop()
    }
}

fn counted<R>(name: &'static str, inner: R) -> (Counted<R>, Arc<AtomicUsize>) {
    let served = Arc::new(AtomicUsize::new(0));
    (
        Counted {
            name,
            inner,
            served: served.clone(),
        },
        served,
    )
}

async fn node(name: &str, certs: &std::path::Path) -> Node {
    Node::builder(name).dev_certs(certs).start().await.unwrap()
}

fn copy(m: &yatt_engine::Llama) -> yatt_engine::Llama {
    m.deep_copy(Device::Cpu, Kind::Float).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn user_roles_take_the_rollout_reference_policy_and_reward_slots() {
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(
        out.path(),
        &["job.steps=2".into(), "algorithm.kl_coef=0.01".into()],
    );
    let certs = tempfile::tempdir().unwrap();
    let node = node("slots-0", certs.path()).await;
    let (model, codec, pad_id) = base_model(&job).unwrap();
    let g = || DeviceGroup::cpu("slots-0");
    let (rollout, rollouts_served) = counted("my-rollout", rollout_role(&job, copy(&model), codec));
    let (reference, reference_served) =
        counted("my-reference", reference_role(&job, copy(&model), pad_id));
    let (policy, policy_served) = counted(
        "my-policy",
        policy_role(&job, copy(&model), pad_id).unwrap(),
    );
    let (reward, reward_served) = counted("my-reward", reward_role(&job).unwrap());
    let roles = CustomRoles {
        rollouts: vec![spawn_role(&node, rollout, 0, g()).await.unwrap()],
        reference: Some(spawn_role(&node, reference, 0, g()).await.unwrap()),
        policy: Some(spawn_role(&node, policy, 0, g()).await.unwrap()),
        reward: Some(spawn_role(&node, reward, 0, g()).await.unwrap()),
        critic: None,
        stages: Vec::new(),
    };
    assert_eq!(
        roles.slots(),
        vec!["reward", "rollout", "reference", "policy"]
    );
    let options = TrainOptions {
        roles,
        ..Default::default()
    };
    let summary = train_with(&job, &node, options, |_| {}).await.unwrap();
    assert_eq!(summary.steps, 2);
    // every step asked each user role at least once (the policy: old log-probs and the
    // update, and the weights and the checkpoint)
    for (slot, served, at_least) in [
        ("rollout", &rollouts_served, 2),
        ("reference", &reference_served, 2),
        ("reward", &reward_served, 2),
        ("policy", &policy_served, 4),
    ] {
        let n = served.load(Ordering::SeqCst);
        assert!(n >= at_least, "the user's {slot} served {n} requests");
    }
    assert!(out.path().join("checkpoint").is_dir());
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_critic_serves_ppo() {
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(
        out.path(),
        &["job.steps=2".into(), "algorithm.name=\"ppo\"".into()],
    );
    let certs = tempfile::tempdir().unwrap();
    let node = node("slots-1", certs.path()).await;
    let (model, _, pad_id) = base_model(&job).unwrap();
    let (critic, served) = counted("my-critic", critic_role(&job, model, None, pad_id).unwrap());
    let options = TrainOptions {
        roles: CustomRoles {
            critic: Some(
                spawn_role(&node, critic, 0, DeviceGroup::cpu("slots-1"))
                    .await
                    .unwrap(),
            ),
            ..Default::default()
        },
        ..Default::default()
    };
    let summary = train_with(&job, &node, options, |_| {}).await.unwrap();
    assert_eq!(summary.steps, 2);
    // values and a value update per step
    assert!(served.load(Ordering::SeqCst) >= 4, "{served:?}");
    node.shutdown().await;
}

async fn refused(job: &JobConfig, node: &Node, roles: CustomRoles) -> String {
    let options = TrainOptions {
        roles,
        ..Default::default()
    };
    match train_with(job, node, options, |_| {}).await {
        Ok(_) => panic!("the job ran with custom roles it cannot use"),
        Err(e) => e.to_string(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_a_job_cannot_use_are_refused_with_the_reason() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let node = node("slots-2", certs.path()).await;
    let grpo = demo_config(out.path(), &["job.steps=1".into()]);
    let (model, codec, pad_id) = base_model(&grpo).unwrap();
    let g = || DeviceGroup::cpu("slots-2");
    let critic = spawn_role(
        &node,
        critic_role(&grpo, copy(&model), None, pad_id).unwrap(),
        0,
        g(),
    )
    .await
    .unwrap();
    let e = refused(
        &grpo,
        &node,
        CustomRoles {
            critic: Some(critic),
            ..Default::default()
        },
    )
    .await;
    assert!(e.contains("algorithm.name") && e.contains("ppo"), "{e}");

    let rollout = spawn_role(&node, rollout_role(&grpo, copy(&model), codec), 0, g())
        .await
        .unwrap();
    let two_heads = demo_config(
        out.path(),
        &["job.steps=1".into(), "job.controllers=2".into()],
    );
    let e = refused(
        &two_heads,
        &node,
        CustomRoles {
            rollouts: vec![rollout.clone()],
            ..Default::default()
        },
    )
    .await;
    assert!(
        e.contains("job.controllers") && e.contains("one custom rollout per head"),
        "{e}"
    );

    let live = demo_config(
        out.path(),
        &[
            "job.steps=1".into(),
            "job.controllers=2".into(),
            "placement.live=true".into(),
        ],
    );
    let e = refused(
        &live,
        &node,
        CustomRoles {
            rollouts: vec![rollout],
            ..Default::default()
        },
    )
    .await;
    assert!(
        e.contains("placement.live") && e.contains("[\"rollout\"]"),
        "{e}"
    );

    let policy = spawn_role(
        &node,
        policy_role(&grpo, copy(&model), pad_id).unwrap(),
        0,
        g(),
    )
    .await
    .unwrap();
    let replicated = demo_config(
        out.path(),
        &[
            "job.steps=1".into(),
            "job.controllers=2".into(),
            "job.policy_replicas=2".into(),
        ],
    );
    let e = refused(
        &replicated,
        &node,
        CustomRoles {
            policy: Some(policy),
            ..Default::default()
        },
    )
    .await;
    assert!(
        e.contains("job.policy_replicas") && e.contains("all-reduce"),
        "{e}"
    );
    node.shutdown().await;
}
