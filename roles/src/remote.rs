//! Roles on other nodes.
//!
//! What belongs here: the factories `yatt-node` registers for the built-in roles
//! ([`register`]), the `[placement]` section of a job ([`PlacementSection`]), and
//! [`build_cluster`], which spawns a job's roles on the nodes its placement names and
//! builds controllers over the remote references.
//!
//! A node builds a role from the job config itself ([`RoleArgs`]): the model is
//! loaded (or, for `tiny`, initialised) on the role's own thread, so the node's
//! executor never blocks. Before the first step the (first) policy's weights are
//! pushed to every rollout replica, to the reference and to the other policy replicas,
//! so all of them start from the same model whichever process built it. After that
//! the controllers' weight sync carries each update over the runtime, and the policy
//! replicas average their gradients in a ring all-reduce between their nodes. Roles
//! are spawned linked to the controller's node: when that node leaves the cluster or
//! dies, the nodes release them (a replica's ring inbox goes with it).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_runtime::ActorName;
use yatt_runtime::Directory;
use yatt_runtime::Message;
use yatt_runtime::RING_CHUNK_BYTES;
use yatt_runtime::{ActorRef, CallError};
use yatt_runtime::{Node, NodeBuilder, NodeError};

use crate::builtin::{PolicyRequest, PolicyResponse};
use crate::controller::{
    join_policy_ring, variant, Controller, ControllerError, PolicyRef, RoleRefs, RolloutRef,
    SamplesRef, Timeouts,
};
use crate::job::{
    base_model, controllers, critic_role, invalid, one_of, policy_ring, policy_role, positive,
    reference_role, reward_role, rollout_role, JobConfig, JobError,
};
use crate::role::{DeviceGroup, Role, RoleActor, RoleError, RoleRequest, RoleResponse};
use crate::sample::Sample;

/// Requests a role's thread queues before its actor's mailbox takes the backpressure.
const ROLE_QUEUE: usize = 4;

/// How long a cluster build waits for the nodes its placement names to join.
const NODES_WAIT: Duration = Duration::from_secs(10);

/// The roles of a job, by the key that places them.
pub const ROLES: [&str; 4] = ["rollout", "policy", "reference", "reward"];

/// `[placement]`: where a job's roles run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementSection {
    /// `colocate`: every role in the training process (the nodes below are not used).
    /// `disaggregated`: each role on the cluster node named below (`yatt train CONFIG
    /// --cluster SEED_ADDR`).
    pub mode: String,
    /// Node of the rollout replicas (one per controller).
    pub rollout: String,
    /// Node of the policy (the trainer): one name for every replica, or a list with
    /// one node per replica (`job.policy_replicas`), replica `i` on entry `i`.
    pub policy: NodeNames,
    /// Node of the reference policy.
    pub reference: String,
    /// Node of the reward functions.
    pub reward: String,
    /// Node of the critic (`algorithm.name = "ppo"` only).
    pub critic: String,
    /// Deadline for a node to build a role, model load included, seconds.
    pub spawn_timeout_s: u64,
    /// Run the live placement actor: the rollout and the policy sit on device groups
    /// and groups move between them as the load shifts (see `crate::placement_live`).
    /// Embedded (`colocate`): `groups` virtual groups of this process; on a cluster
    /// (`disaggregated`): the devices the nodes in `nodes` advertise.
    pub live: bool,
    /// Virtual device groups of the embedded live placement (`job.controllers` + 1).
    pub groups: usize,
    /// Live placement on a cluster: the nodes whose devices (one group each, as
    /// membership advertises them) the rollout and the policy share. `rollout` and
    /// `policy` are not used then; `reward` and `reference` still place those roles.
    pub nodes: Vec<String>,
    /// Groups the rollout starts with (1 or `job.controllers`); the policy gets the rest.
    pub rollout_groups: usize,
    /// The placement policy's knobs (`[placement.replan]`: replan_every, warmup_steps,
    /// min_gain, confirmations, horizon_steps, payback, cooldown_steps,
    /// lookahead_steps, simulate_candidates, simulate_steps).
    pub replan: yatt_placement::PolicyConfig,
}

impl Default for PlacementSection {
    fn default() -> Self {
        PlacementSection {
            mode: "colocate".into(),
            rollout: String::new(),
            policy: NodeNames::default(),
            reference: String::new(),
            reward: String::new(),
            critic: String::new(),
            spawn_timeout_s: 300,
            live: false,
            groups: 3,
            nodes: Vec::new(),
            rollout_groups: 1,
            replan: yatt_placement::PolicyConfig {
                // The live executor trusts the analytic model: simulating candidates
                // costs more than a CPU step.
                simulate_candidates: 0,
                ..Default::default()
            },
        }
    }
}

/// `placement.policy`: one node name, or a list of them (one per replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeNames {
    /// Every replica on this node.
    One(String),
    /// Replica `i` on entry `i`.
    Each(Vec<String>),
}

impl Default for NodeNames {
    fn default() -> Self {
        NodeNames::One(String::new())
    }
}

impl From<&str> for NodeNames {
    fn from(name: &str) -> Self {
        NodeNames::One(name.to_string())
    }
}

impl std::fmt::Display for NodeNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeNames::One(n) => f.write_str(n),
            NodeNames::Each(ns) => write!(f, "[{}]", ns.join(", ")),
        }
    }
}

impl Serialize for NodeNames {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            NodeNames::One(n) => s.serialize_str(n),
            NodeNames::Each(ns) => ns.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = NodeNames;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name, or a list of node names (one per policy replica)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NodeNames, E> {
                Ok(NodeNames::One(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<NodeNames, A::Error> {
                let mut names = Vec::new();
                while let Some(n) = seq.next_element::<String>()? {
                    names.push(n);
                }
                Ok(NodeNames::Each(names))
            }
        }
        d.deserialize_any(Names)
    }
}

impl PlacementSection {
    /// The node named for `role` (one of [`ROLES`]); for a policy placed replica by
    /// replica, the first replica's.
    pub fn node_of(&self, role: &str) -> &str {
        match role {
            "rollout" => &self.rollout,
            "policy" => match &self.policy {
                NodeNames::One(n) => n,
                NodeNames::Each(ns) => ns.first().map_or("", String::as_str),
            },
            "reference" => &self.reference,
            "critic" => &self.critic,
            _ => &self.reward,
        }
    }

    /// The node of each of `replicas` policy replicas, in replica order.
    pub fn policy_nodes(&self, replicas: usize) -> Vec<String> {
        match &self.policy {
            NodeNames::One(n) => vec![n.clone(); replicas],
            NodeNames::Each(ns) => ns.clone(),
        }
    }

    /// Every `(key, node)` the section names for a job with `replicas` policy replicas
    /// (one by one) and, with `critic`, a critic.
    fn named_nodes(&self, replicas: usize, critic: bool) -> Vec<(String, String)> {
        let mut v = Vec::new();
        if critic {
            v.push(("placement.critic".to_string(), self.critic.clone()));
        }
        for role in ROLES {
            if role == "policy" {
                for (i, n) in self.policy_nodes(replicas).into_iter().enumerate() {
                    let key = match self.policy {
                        NodeNames::One(_) => "placement.policy".to_string(),
                        NodeNames::Each(_) => format!("placement.policy[{i}]"),
                    };
                    v.push((key, n));
                }
            } else {
                v.push((format!("placement.{role}"), self.node_of(role).to_string()));
            }
        }
        v
    }

    /// Checks the section on its own, for a job with `policy_replicas` policy replicas
    /// and, with `critic` (PPO), a critic (which nodes exist is checked against the
    /// cluster by [`build_cluster`]).
    pub fn validate(&self, policy_replicas: usize, critic: bool) -> Result<(), JobError> {
        one_of("placement.mode", &self.mode, &["colocate", "disaggregated"])?;
        positive(
            "placement.spawn_timeout_s",
            self.spawn_timeout_s as f64,
            "e.g. spawn_timeout_s = 300",
        )?;
        let live_cluster = self.live && self.mode == "disaggregated";
        if !self.nodes.is_empty() && !live_cluster {
            return Err(invalid(
                "placement.nodes",
                "nothing unless live = true and mode = \"disaggregated\"",
                &format!("{:?}", self.nodes),
                "remove placement.nodes, or set live = true and mode = \"disaggregated\" to run the live placement over those nodes' devices",
            ));
        }
        if self.mode == "colocate" {
            return Ok(());
        }
        if self.live {
            return self.validate_live_cluster();
        }
        if let NodeNames::Each(ns) = &self.policy {
            if ns.len() != policy_replicas {
                let example: Vec<String> = (0..policy_replicas.max(1))
                    .map(|i| format!("\"node-{i}\""))
                    .collect();
                return Err(invalid(
                    "placement.policy",
                    &format!(
                        "one node per policy replica: {policy_replicas} name(s), as job.policy_replicas = {policy_replicas}"
                    ),
                    &format!("{} name(s): {}", ns.len(), self.policy),
                    &format!(
                        "list one node per replica, e.g. policy = [{}] (a node may be listed twice), or give one name to put every replica on that node",
                        example.join(", ")
                    ),
                ));
            }
        }
        for (key, node) in self.named_nodes(policy_replicas, critic) {
            if node.is_empty() {
                let role = key.trim_start_matches("placement.");
                let fix = if role.contains('[') {
                    "put a node name at that position of policy = [...] (a `yatt-node run --name NODE`)".to_string()
                } else {
                    format!(
                        "add {role} = \"NODE\" under [placement] (a `yatt-node run --name NODE`)"
                    )
                };
                return Err(invalid(
                    &key,
                    "the name of the cluster node that runs this role",
                    "nothing",
                    &fix,
                ));
            }
        }
        Ok(())
    }

    /// The live placement on a cluster: the nodes offering groups, once each, and the
    /// reward's node (the reference's is checked against `algorithm.kl_mode` when the
    /// job is built).
    fn validate_live_cluster(&self) -> Result<(), JobError> {
        if self.nodes.is_empty() {
            return Err(invalid(
                "placement.nodes",
                "the nodes whose devices the rollout and the policy share, with placement.live = true on a cluster",
                "nothing",
                "add nodes = [\"gpu-0\", \"gpu-1\"] under [placement] (`yatt-node run --name NODE`; each offers its GPUs, or --virtual-devices N without GPUs)",
            ));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.is_empty() || self.nodes[..i].contains(n) {
                return Err(invalid(
                    &format!("placement.nodes[{i}]"),
                    "a node name, each node once",
                    &format!("{n:?} in {:?}", self.nodes),
                    "list each node once; a node offers all its devices",
                ));
            }
        }
        if self.reward.is_empty() {
            return Err(invalid(
                "placement.reward",
                "the name of the cluster node that runs this role",
                "nothing",
                "add reward = \"NODE\" under [placement] (a `yatt-node run --name NODE`)",
            ));
        }
        Ok(())
    }
}

/// What a node needs to build one of a job's roles.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoleArgs {
    /// The job config as TOML (postcard cannot carry its untagged values).
    pub job: String,
    /// The node the role runs on.
    pub node: String,
}

/// Registers the built-in roles (rollout, policy, reference, reward, critic) as factories that
/// take [`RoleArgs`]. A policy spawned for a job with several replicas also starts its
/// ring inbox on the node, as `node/policy-ring/REPLICA` (see [`crate::job::POLICY_RING`]).
pub fn register(builder: NodeBuilder) -> NodeBuilder {
    builder
        .factory_async("rollout", |a: RoleArgs| {
            start_role(a, "rollout", |job| {
                let (model, codec, _) = base_model(job)?;
                Ok(rollout_role(job, model, codec))
            })
        })
        .factory_with_node("policy", |node: &Node, name: &ActorName, a: RoleArgs| {
            let replicated = JobConfig::parse(&a.job, "the job config sent by the controller", &[])
                .is_ok_and(|job| job.job.policy_replicas > 1);
            let ring_on = replicated.then(|| (node.clone(), name.replica));
            async move {
                let ring = match ring_on {
                    Some((node, replica)) => {
                        Some(policy_ring(&node, replica).map_err(|e| e.to_string())?)
                    }
                    None => None,
                };
                start_role(a, "policy", move |job| {
                    let (model, _, pad_id) = base_model(job)?;
                    let role = policy_role(job, model, pad_id)?;
                    Ok(match ring {
                        Some(r) => role.with_ring(r),
                        None => role,
                    })
                })
                .await
            }
        })
        .factory_async("reference", |a: RoleArgs| {
            start_role(a, "reference", |job| {
                let (model, _, pad_id) = base_model(job)?;
                Ok(reference_role(job, model, pad_id))
            })
        })
        .factory_async("reward", |a: RoleArgs| {
            start_role(a, "reward", JobReward::of)
        })
        .factory_async("critic", |a: RoleArgs| {
            start_role(a, "critic", |job| {
                let (model, _, pad_id) = base_model(job)?;
                critic_role(job, model, None, pad_id)
            })
        })
}

/// A job's reward role as a node builds it: the `growing` task's length reward, or the
/// job's reward functions (as [`crate::job::spawn_reward`] picks in process).
enum JobReward {
    Growing(crate::placement_live::GrowingLengthReward),
    Functions(crate::builtin::RewardRole),
}

impl JobReward {
    fn of(job: &JobConfig) -> Result<Self, JobError> {
        if job.data.jsonl.is_empty() && job.data.task == "growing" {
            let task = crate::job::growing_task(job);
            return Ok(JobReward::Growing(
                crate::placement_live::GrowingLengthReward(task),
            ));
        }
        Ok(JobReward::Functions(reward_role(job)?))
    }

    fn role(&mut self) -> &mut dyn Role<Request = Vec<Sample>, Response = Vec<Sample>> {
        match self {
            JobReward::Growing(r) => r,
            JobReward::Functions(r) => r,
        }
    }
}

impl Role for JobReward {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> crate::role::ResourceProfile {
        match self {
            JobReward::Growing(r) => r.profile(),
            JobReward::Functions(r) => r.profile(),
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.role().start(group)
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        self.role().serve(samples)
    }

    fn stop(&mut self) {
        self.role().stop()
    }
}

/// Builds a role from the job in `args` on the role's own thread and starts it there.
async fn start_role<R: Role>(
    args: RoleArgs,
    name: &'static str,
    make: impl FnOnce(&JobConfig) -> Result<R, JobError> + Send + 'static,
) -> Result<RoleActor<R>, String> {
    let job = JobConfig::parse(&args.job, "the job config sent by the controller", &[])
        .map_err(|e| e.to_string())?;
    let build = move || make(&job).map_err(|e| RoleError::Failed(e.to_string()));
    RoleActor::build(name, build, DeviceGroup::cpu(&args.node), ROLE_QUEUE)
        .await
        .map_err(|e| e.to_string())
}

/// Spawns `role` of the job (`text`: its config as TOML) on the node `target`, linked
/// to `node`, with the `placement.spawn_timeout_s` deadline.
pub(crate) async fn spawn<Req: Message, Resp: Message>(
    job: &JobConfig,
    text: &str,
    node: &Node,
    role: &'static str,
    target: &str,
) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, ControllerError> {
    let args = RoleArgs {
        job: text.to_string(),
        node: target.to_string(),
    };
    let timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    node.spawn_remote_linked(target, role, &args, timeout)
        .await
        .map_err(|e| ControllerError::Spawn {
            role: format!("{role} on node {target}"),
            reason: match e {
                NodeError::NoFactory { known, .. } => format!(
                    "that node cannot spawn it (it registers {known:?}); run a yatt-node of this yatt build there"
                ),
                other => other.to_string(),
            },
        })
}

/// Builds a `disaggregated` job on the cluster `node` has joined: spawns each role on
/// the node `[placement]` names (one rollout replica per controller; with
/// `job.policy_replicas > 1` one policy replica per controller, each on its node of
/// `placement.policy`; for PPO the critic on `placement.critic`), gives every rollout, the reference and every policy replica
/// the first replica's initial weights, joins the replicas' gradient all-reduce ring,
/// and returns one controller per rollout, driving the roles over QUIC.
pub async fn build_cluster(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    job.validate()?;
    let p = &job.placement;
    if p.mode != "disaggregated" {
        return Err(invalid(
            "placement.mode",
            "\"disaggregated\" to run roles on cluster nodes",
            &format!("{:?}", p.mode),
            "set placement.mode = \"disaggregated\" and name a node per role, or run without --cluster",
        ));
    }
    let ppo = job.algorithm.name == "ppo";
    let replicas = job.job.policy_replicas;
    wait_for_nodes(node, &p.named_nodes(replicas, ppo)).await?;
    let text = job_text(job)?;
    let rollouts = async {
        let mut v = Vec::with_capacity(job.job.controllers);
        for _ in 0..job.job.controllers {
            v.push(spawn(job, &text, node, "rollout", &p.rollout).await?);
        }
        Ok::<Vec<RolloutRef>, ControllerError>(v)
    };
    let policy_nodes = p.policy_nodes(replicas);
    let policies = futures::future::try_join_all(
        policy_nodes
            .iter()
            .map(|target| spawn(job, &text, node, "policy", target)),
    );
    let critic = async {
        match ppo {
            true => Ok(Some(spawn(job, &text, node, "critic", &p.critic).await?)),
            false => Ok::<_, ControllerError>(None),
        }
    };
    let (rollouts, reward, reference, policies, critic) = tokio::try_join!(
        rollouts,
        spawn(job, &text, node, "reward", &p.reward),
        spawn(job, &text, node, "reference", &p.reference),
        policies,
        critic,
    )?;
    initial_weight_sync(&policies, &rollouts, &reference, Timeouts::default().sync).await?;
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward,
        reference: Some(reference),
        policy: policies[0].clone(),
        critic,
    };
    let per_head = if replicas > 1 { policies } else { Vec::new() };
    let mut controllers = controllers(job, shared, rollouts, per_head)?;
    if replicas > 1 {
        join_policy_ring(&mut controllers, RING_CHUNK_BYTES).await?;
    }
    Ok(controllers)
}

/// Waits (briefly: nodes started just before the run may still be joining) until every
/// `(key, node)` of `named` is alive in the cluster `node` belongs to; otherwise names
/// the key, the missing node and the nodes there are.
pub(crate) async fn wait_for_nodes(
    node: &Node,
    named: &[(String, String)],
) -> Result<(), JobError> {
    let all_alive = |d: &Directory| {
        named
            .iter()
            .all(|(_, want)| d.alive_nodes().any(|n| n.name == *want))
    };
    if !node.directory().read(all_alive) {
        tracing::info!(wait = ?NODES_WAIT, "waiting for the placement's nodes to join");
        node.directory().wait_until(NODES_WAIT, all_alive).await;
    }
    let mut alive: Vec<String> = node
        .directory()
        .read(|d| d.alive_nodes().map(|n| n.name.clone()).collect());
    alive.sort();
    for (key, want) in named {
        if !alive.iter().any(|n| n == want) {
            return Err(invalid(
                key,
                &format!("a node of the cluster: {}", alive.join(", ")),
                &format!("{want:?}"),
                &format!("start it (`yatt-node run --name {want} --seed ...`) or name one of the nodes above"),
            ));
        }
    }
    Ok(())
}

/// The job config as the nodes' factories take it: postcard cannot carry the config's
/// untagged values; TOML can, and the node validates what it gets.
pub(crate) fn job_text(job: &JobConfig) -> Result<String, JobError> {
    toml::to_string(job).map_err(|e| JobError::Parse {
        origin: "the job config".into(),
        message: format!("cannot encode it for the nodes: {e}"),
    })
}

/// Pushes the first policy replica's weights (version 0) to every rollout, to the
/// reference and to the other replicas, so all of them start from the same model
/// whichever node built it.
async fn initial_weight_sync(
    policies: &[PolicyRef],
    rollouts: &[RolloutRef],
    reference: &SamplesRef,
    timeout: Duration,
) -> Result<(), ControllerError> {
    const STAGE: &str = "initial_weight_sync";
    let call = |role: &'static str| {
        move |source: CallError| ControllerError::Call {
            step: 0,
            stage: STAGE,
            role,
            source,
        }
    };
    let update = match policies[0]
        .ask(RoleRequest::Serve(PolicyRequest::ExportWeights), timeout)
        .await
        .map_err(call("policy"))?
    {
        RoleResponse::Served(PolicyResponse::Weights(u)) => u,
        other => return Err(protocol("policy", "ExportWeights", variant(&other))),
    };
    for r in rollouts {
        let answer = r
            .ask(RoleRequest::LoadWeights(update.clone()), timeout)
            .await
            .map_err(call("rollout"))?;
        loaded(answer, "rollout")?;
    }
    for p in &policies[1..] {
        let answer = p
            .ask(RoleRequest::LoadWeights(update.clone()), timeout)
            .await
            .map_err(call("policy"))?;
        loaded(answer, "policy")?;
    }
    let answer = reference
        .ask(RoleRequest::LoadWeights(update), timeout)
        .await
        .map_err(call("reference"))?;
    loaded(answer, "reference")
}

fn protocol(role: &'static str, asked: &'static str, got: String) -> ControllerError {
    ControllerError::Protocol {
        step: 0,
        role,
        asked,
        got,
    }
}

fn loaded<T>(answer: RoleResponse<T>, role: &'static str) -> Result<(), ControllerError> {
    match answer {
        RoleResponse::Done => Ok(()),
        other => Err(protocol(role, "LoadWeights", variant(&other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DEMO: &str = include_str!("../../config/demo-letters.toml");

    fn disaggregated() -> Vec<String> {
        vec![
            "placement.mode=\"disaggregated\"".into(),
            "placement.rollout=\"node-a\"".into(),
            "placement.policy=\"node-b\"".into(),
            "placement.reference=\"node-b\"".into(),
            "placement.reward=\"node-c\"".into(),
        ]
    }

    #[test]
    fn a_disaggregated_placement_parses_and_travels_as_toml() {
        let job = JobConfig::parse(DEMO, "d", &disaggregated()).unwrap();
        assert_eq!(job.placement.node_of("reward"), "node-c");
        // The shipped demo names its nodes and runs colocated unless told otherwise.
        let demo = JobConfig::parse(DEMO, "d", &[]).unwrap();
        assert_eq!(demo.placement.mode, "colocate");
        assert_eq!(demo.placement.node_of("policy"), "node-b");
        let text = toml::to_string(&job).unwrap();
        assert_eq!(JobConfig::parse(&text, "t", &[]).unwrap(), job);
    }

    fn two_replicas(policy: &str) -> Vec<String> {
        let mut sets = disaggregated();
        sets.retain(|s| !s.starts_with("placement.policy"));
        sets.extend([
            format!("placement.policy={policy}"),
            "job.controllers=2".into(),
            "job.policy_replicas=2".into(),
        ]);
        sets
    }

    #[test]
    fn policy_replicas_are_placed_one_node_each_or_all_on_one() {
        let job = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\", \"node-d\"]")).unwrap();
        assert_eq!(job.placement.policy_nodes(2), ["node-b", "node-d"]);
        assert_eq!(job.placement.node_of("policy"), "node-b");
        assert_eq!(job.placement.policy.to_string(), "[node-b, node-d]");
        // The list travels to the nodes as TOML.
        let text = toml::to_string(&job).unwrap();
        assert_eq!(JobConfig::parse(&text, "t", &[]).unwrap(), job);
        // One name puts every replica on that node.
        let job = JobConfig::parse(DEMO, "d", &two_replicas("\"node-b\"")).unwrap();
        assert_eq!(job.placement.policy_nodes(2), ["node-b", "node-b"]);
        assert_eq!(job.placement.policy.to_string(), "node-b");
    }

    #[test]
    fn a_policy_placement_that_does_not_fit_the_replicas_says_how_to_fix_it() {
        let e = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy")
                && e.contains("job.policy_replicas = 2")
                && e.contains("1 name(s): [node-b]")
                && e.contains("policy = [\"node-0\", \"node-1\"]"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\", \"\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy[1]") && e.contains("put a node name at that position"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &two_replicas("3"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy") && e.contains("a list of node names"),
            "{e}"
        );
    }

    #[test]
    fn placement_errors_name_the_key_and_the_fix() {
        let sets = [
            "placement.mode=\"disaggregated\"".into(),
            "placement.reward=\"\"".into(),
        ];
        let e = JobConfig::parse(DEMO, "d", &sets).unwrap_err().to_string();
        assert!(
            e.contains("placement.reward") && e.contains("add reward = \"NODE\""),
            "{e}"
        );
        // PPO on a cluster needs a node for its critic.
        let mut sets = disaggregated();
        sets.push("algorithm.name=\"ppo\"".into());
        let e = JobConfig::parse(DEMO, "d", &sets).unwrap_err().to_string();
        assert!(
            e.contains("placement.critic") && e.contains("add critic = \"NODE\""),
            "{e}"
        );
        sets.push("placement.critic=\"node-c\"".into());
        let job = JobConfig::parse(DEMO, "d", &sets).unwrap();
        assert_eq!(job.placement.node_of("critic"), "node-c");
        let e = JobConfig::parse(DEMO, "d", &["placement.mode=\"spread\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.mode") && e.contains("\"colocate\", \"disaggregated\""),
            "{e}"
        );
    }
}
