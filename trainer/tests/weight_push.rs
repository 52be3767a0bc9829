//! Weight sync from a policy in another process than the controller's, on three
//! in-process nodes joined over loopback QUIC (the trainer, the policy's, the
//! rollout's):
//! - a policy hosted by a `PushingPolicy` sends the buckets to the rollout itself, one
//!   hop (`perf/weight_sync_direct`), and its role is never asked `PushWeights`;
//! - a user's policy actor without it is asked once, answers that it cannot, and the
//!   controller relays the buckets from then on;
//! - a rollout only the controller's process can reach (`spawn_role`) gets them from
//!   the controller, and the job trains; so does one the policy's node failed to load;
//! - the policy answers other requests while its push loads the rollouts.

use crate::common;

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::demo_config;
use tch::{Device, Kind};
use yatt_roles::{
    DeviceGroup, PolicyRequest, PolicyResponse, PolicyRole, PushReport, PushTarget, PushingPolicy,
    ResourceProfile, Role, RoleActor, RoleError, RoleRequest, RoleResponse, RolloutRequest,
    RolloutResponse, RolloutRole, WeightsUpdate,
};
use yatt_runtime::ActorRef;

type RolloutRef = ActorRef<RoleRequest<RolloutRequest>, RoleResponse<RolloutResponse>>;
type PolicyRef = ActorRef<RoleRequest<PolicyRequest>, RoleResponse<PolicyResponse>>;
use yatt_runtime::Node;
use yatt_trainer::{
    base_model, policy_role, rollout_role, spawn_role, train_with, CustomRoles, JobConfig,
    TrainOptions,
};

/// A user's policy: the built-in one, counting the `PushWeights` and `ExportWeights`
/// requests that reach it.
struct Watched {
    inner: PolicyRole,
    pushes: Arc<AtomicUsize>,
    exports: Arc<AtomicUsize>,
}

impl Role for Watched {
    type Request = PolicyRequest;
    type Response = PolicyResponse;

    fn name(&self) -> &str {
        "my-policy"
    }

    fn profile(&self) -> ResourceProfile {
        self.inner.profile()
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.inner.start(group)
    }

    fn serve(&mut self, request: PolicyRequest) -> Result<PolicyResponse, RoleError> {
        if matches!(request, PolicyRequest::PushWeights { .. }) {
            self.pushes.fetch_add(1, Ordering::SeqCst);
        }
        if matches!(request, PolicyRequest::ExportWeights) {
            self.exports.fetch_add(1, Ordering::SeqCst);
        }
        self.inner.serve(request)
    }

    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        self.inner.load_weights(update)
    }

    fn stop(&mut self) {
        self.inner.stop()
    }
}

struct Nodes {
    trainer: Node,
    policy: Node,
    rollout: Node,
    _certs: tempfile::TempDir,
}

async fn three_nodes() -> Nodes {
    let certs = tempfile::tempdir().unwrap();
    let start = |name: &'static str, seed: Option<std::net::SocketAddr>| {
        let mut b = Node::builder(name).dev_certs(certs.path());
        if let Some(s) = seed {
            b = b.seed(s);
        }
        b.start()
    };
    let trainer = start("wp-trainer", None).await.unwrap();
    let policy = start("wp-policy", Some(trainer.addr())).await.unwrap();
    let rollout = start("wp-rollout", Some(trainer.addr())).await.unwrap();
    Nodes {
        trainer,
        policy,
        rollout,
        _certs: certs,
    }
}

/// How the policy's actor is hosted.
#[derive(Clone, Copy, PartialEq, Debug)]
enum Host {
    /// `PushingPolicy`, as a `yatt-node` hosts the built-in policy.
    Pushing,
    /// A plain `RoleActor`, as a user may spawn a policy of their own.
    Plain,
}

/// Where the rollout runs.
#[derive(Clone, Copy, PartialEq, Debug)]
enum RolloutAt {
    /// Its own node, reachable from the others.
    OwnNode,
    /// Its own node, refusing the first weights it is sent (as when the policy's node
    /// cannot reach it).
    OwnNodeRefusingOnce,
    /// The trainer's process, reachable from it only.
    TrainerOnly,
}

/// A user's rollout: the built-in one, with `before_load` run before each load (an
/// error refuses that load).
struct HookedRollout {
    inner: RolloutRole,
    before_load: Box<dyn FnMut() -> Result<(), RoleError> + Send>,
}

impl Role for HookedRollout {
    type Request = RolloutRequest;
    type Response = RolloutResponse;

    fn name(&self) -> &str {
        "my-rollout"
    }

    fn profile(&self) -> ResourceProfile {
        self.inner.profile()
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.inner.start(group)
    }

    fn serve(&mut self, request: RolloutRequest) -> Result<RolloutResponse, RoleError> {
        self.inner.serve(request)
    }

    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        (self.before_load)()?;
        self.inner.load_weights(update)
    }

    fn stop(&mut self) {
        self.inner.stop()
    }
}

/// Trains `job` with the user's policy on the policy node and the rollout where `at`
/// says; returns the `PushWeights` requests the policy role saw.
async fn train(nodes: &Nodes, job: &JobConfig, host: Host, at: RolloutAt, case: u32) -> usize {
    let (model, codec, pad_id) = base_model(job).unwrap();
    let copy = |m: &yatt_engine::Llama| m.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let pushes = Arc::new(AtomicUsize::new(0));
    let role = Watched {
        inner: policy_role(job, copy(&model), pad_id).unwrap(),
        pushes: pushes.clone(),
        exports: Arc::default(),
    };
    let group = DeviceGroup::cpu(nodes.policy.name());
    let actor = RoleActor::start(role, group, 4).await.unwrap();
    let policy = match host {
        Host::Pushing => {
            let actor = PushingPolicy::new(actor, nodes.policy.downgrade());
            nodes.policy.spawn("my-policy", case, actor).unwrap()
        }
        Host::Plain => nodes.policy.spawn("my-policy", case, actor).unwrap(),
    };
    let policy = nodes.trainer.actor_ref(policy.id()).unwrap();
    let rollout = rollout_role(job, model, codec);
    let group = DeviceGroup::cpu(nodes.rollout.name());
    let remote = |r: &RolloutRef| -> RolloutRef { nodes.trainer.actor_ref(r.id()).unwrap() };
    let rollout = match at {
        RolloutAt::OwnNode => {
            let actor = RoleActor::start(rollout, group, 4).await.unwrap();
            remote(&nodes.rollout.spawn("my-rollout", case, actor).unwrap())
        }
        RolloutAt::OwnNodeRefusingOnce => {
            let mut refused = false;
            let role = HookedRollout {
                inner: rollout,
                before_load: Box::new(move || {
                    if refused {
                        return Ok(());
                    }
                    refused = true;
                    Err(RoleError::Failed("refused once".into()))
                }),
            };
            let actor = RoleActor::start(role, group, 4).await.unwrap();
            remote(&nodes.rollout.spawn("my-rollout", case, actor).unwrap())
        }
        RolloutAt::TrainerOnly => {
            let group = DeviceGroup::cpu(nodes.trainer.name());
            spawn_role(&nodes.trainer, rollout, case, group)
                .await
                .unwrap()
        }
    };
    let options = TrainOptions {
        roles: CustomRoles {
            rollouts: vec![rollout],
            policy: Some(policy),
            ..Default::default()
        },
        ..Default::default()
    };
    let summary = train_with(job, &nodes.trainer, options, |_| {})
        .await
        .unwrap_or_else(|e| panic!("{host:?} policy, rollout {at:?}: {e}"));
    assert_eq!(summary.steps, 2);
    pushes.load(Ordering::SeqCst)
}

/// `perf/weight_sync_direct` of every step.
fn direct(out: &Path) -> Vec<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    text.lines()
        .map(|l| {
            let row: serde_json::Value = serde_json::from_str(l).unwrap();
            row["perf/weight_sync_direct"].as_f64().unwrap()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_in_another_process_sends_the_weights_to_the_rollouts_itself() {
    let nodes = three_nodes().await;
    let cases = [
        (Host::Pushing, RolloutAt::OwnNode, [1.0, 1.0], 0),
        // Asked once; the controller relays from then on.
        (Host::Plain, RolloutAt::OwnNode, [0.0, 0.0], 1),
        // Regression: the policy's node was sent to a rollout it cannot reach.
        (Host::Pushing, RolloutAt::TrainerOnly, [0.0, 0.0], 0),
        // A rollout the policy's node could not load gets the weights from the
        // controller in the same sync.
        (Host::Pushing, RolloutAt::OwnNodeRefusingOnce, [0.0, 1.0], 0),
    ];
    for (case, (host, at, want, pushes)) in cases.into_iter().enumerate() {
        let out = tempfile::tempdir().unwrap();
        let job = demo_config(out.path(), &["job.steps=2".into()]);
        let seen = train(&nodes, &job, host, at, case as u32).await;
        assert_eq!(direct(out.path()), want, "{host:?} policy, rollout {at:?}");
        assert_eq!(seen, pushes, "{host:?} policy, rollout {at:?}");
    }
    for n in [nodes.rollout, nodes.policy, nodes.trainer] {
        n.shutdown().await;
    }
}

// Regression: the push held the policy's actor until every rollout had loaded, so every
// other request to the policy (another controller's, say) waited out the slowest load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_policy_answers_other_requests_while_its_push_loads_the_rollouts() {
    let nodes = three_nodes().await;
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &[]);
    let (model, codec, pad_id) = base_model(&job).unwrap();
    let copy = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let role = policy_role(&job, copy, pad_id).unwrap();
    let policy = pushing_policy(&nodes, role).await;
    let held = held_rollout(&nodes, &job, model, codec, 0).await;
    let rollout = &held.id;
    let to = vec![PushTarget::Rollout(rollout.clone())];
    let t = Duration::from_secs(60);
    let push = tokio::spawn({
        let policy = policy.clone();
        let request = PolicyRequest::PushWeights { to, timeout: t };
        async move { policy.ask(RoleRequest::Serve(request), t).await }
    });
    held.wait_started().await;
    // The rollout is loading and will not finish until released: a policy held by the
    // push would not answer until then.
    let answer = policy
        .ask(RoleRequest::Profile, Duration::from_secs(20))
        .await;
    assert!(
        matches!(answer, Ok(RoleResponse::Profile(_))),
        "the policy did not answer while its push was loading: {answer:?}"
    );
    assert!(!push.is_finished());
    held.release.send(()).unwrap();
    pushed(push.await.unwrap());
    for n in [nodes.rollout, nodes.policy, nodes.trainer] {
        n.shutdown().await;
    }
}

/// A rollout on the rollout node whose loads say so on `started` and then wait for
/// `release`; the role runs on a thread of its own, so blocking it holds only this
/// rollout.
struct HeldRollout {
    id: yatt_runtime::ActorId,
    started: mpsc::Receiver<()>,
    release: mpsc::Sender<()>,
}

impl HeldRollout {
    /// Waits until a load has reached the rollout.
    async fn wait_started(&self) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while self.started.try_recv().is_err() {
            assert!(
                Instant::now() < deadline,
                "the push never reached the rollout"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

async fn held_rollout(
    nodes: &Nodes,
    job: &JobConfig,
    model: yatt_engine::Llama,
    codec: Arc<dyn yatt_roles::TextCodec>,
    replica: u32,
) -> HeldRollout {
    let (started, started_rx) = mpsc::channel();
    let (release, release_rx) = mpsc::channel();
    let role = HookedRollout {
        inner: rollout_role(job, model, codec),
        before_load: Box::new(move || {
            let _ = started.send(());
            let released = release_rx.recv_timeout(Duration::from_secs(60));
            released.map_err(|e| RoleError::Failed(format!("never released: {e}")))
        }),
    };
    let actor = RoleActor::start(role, DeviceGroup::cpu(nodes.rollout.name()), 4)
        .await
        .unwrap();
    let id = nodes.rollout.spawn("rollout", replica, actor).unwrap();
    HeldRollout {
        id: id.id().clone(),
        started: started_rx,
        release,
    }
}

/// `role` on the policy node, hosted as a `yatt-node` hosts the built-in policy, as the
/// trainer node reaches it.
async fn pushing_policy<R>(nodes: &Nodes, role: R) -> PolicyRef
where
    R: Role<Request = PolicyRequest, Response = PolicyResponse>,
{
    let actor = RoleActor::start(role, DeviceGroup::cpu(nodes.policy.name()), 4)
        .await
        .unwrap();
    let actor = PushingPolicy::new(actor, nodes.policy.downgrade());
    let policy = nodes.policy.spawn("policy", 0, actor).unwrap();
    nodes.trainer.actor_ref(policy.id()).unwrap()
}

/// The report of a push that reached every role.
fn pushed(answer: Result<RoleResponse<PolicyResponse>, yatt_runtime::CallError>) -> PushReport {
    match answer {
        Ok(RoleResponse::Served(PolicyResponse::Pushed(report))) => {
            assert!(report.failed.is_empty(), "{:?}", report.failed);
            assert!(report.bytes > 0);
            report
        }
        other => panic!("expected a push's report, got {other:?}"),
    }
}

// Regression: with several heads on one policy every head pushes after the one shared
// update, and each push waited for the previous push's loads to end and then exported
// the same weights again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushes_of_unchanged_weights_share_one_export_without_waiting_for_each_other() {
    let nodes = three_nodes().await;
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &[]);
    let (model, codec, pad_id) = base_model(&job).unwrap();
    let copy = |m: &yatt_engine::Llama| m.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let exports = Arc::new(AtomicUsize::new(0));
    let role = Watched {
        inner: policy_role(&job, copy(&model), pad_id).unwrap(),
        pushes: Arc::default(),
        exports: exports.clone(),
    };
    let policy = pushing_policy(&nodes, role).await;
    let held = held_rollout(&nodes, &job, copy(&model), codec.clone(), 0).await;
    let actor = RoleActor::start(
        rollout_role(&job, model, codec),
        DeviceGroup::cpu(nodes.rollout.name()),
        4,
    )
    .await
    .unwrap();
    let free = nodes
        .rollout
        .spawn("rollout", 1, actor)
        .unwrap()
        .id()
        .clone();
    let t = Duration::from_secs(60);
    let push = |to: &yatt_runtime::ActorId| {
        let (policy, to) = (policy.clone(), vec![PushTarget::Rollout(to.clone())]);
        let request = PolicyRequest::PushWeights { to, timeout: t };
        tokio::spawn(async move { policy.ask(RoleRequest::Serve(request), t).await })
    };
    let first = push(&held.id);
    held.wait_started().await;
    // The first push's loads are held; the second loads its export into the other
    // rollout at once.
    let second = tokio::time::timeout(Duration::from_secs(30), push(&free)).await;
    let second = pushed(
        second
            .expect("the second push waited for the first")
            .unwrap(),
    );
    assert_eq!(
        exports.load(Ordering::SeqCst),
        1,
        "the second push exported again"
    );

    // Weights loaded into the policy (as a request that may change them) end the
    // sharing: the next push exports anew once the held export's loads end.
    let update = match policy
        .ask(RoleRequest::Serve(PolicyRequest::ExportWeights), t)
        .await
    {
        Ok(RoleResponse::Served(PolicyResponse::Weights(u))) => u,
        other => panic!("expected the weights, got {other:?}"),
    };
    let loaded = policy.ask(RoleRequest::LoadWeights(update), t).await;
    assert!(matches!(loaded, Ok(RoleResponse::Done)), "{loaded:?}");
    let third = push(&free);
    held.release.send(()).unwrap();
    let first = pushed(first.await.unwrap());
    let third = pushed(third.await.unwrap());
    assert_eq!(first.version, second.version);
    assert_eq!(first.bytes, second.bytes);
    assert_eq!(third.bytes, first.bytes);
    assert_eq!(
        exports.load(Ordering::SeqCst),
        3,
        "the push after LoadWeights shared the export of weights it replaced"
    );
    for n in [nodes.rollout, nodes.policy, nodes.trainer] {
        n.shutdown().await;
    }
}
