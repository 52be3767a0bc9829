//! Roles on other nodes.
//!
//! What belongs here: the factories `yatt-node` registers for the built-in roles
//! ([`register`]), the `[placement]` section of a job ([`PlacementSection`]), and
//! [`build_cluster`], which spawns a job's roles on the nodes its placement names and
//! builds controllers over the remote references.
//!
//! A node builds a role from the job config itself ([`RoleArgs`]): the model is
//! loaded (or, for `tiny`, initialised) on the role's own thread, so the node's
//! executor never blocks. Before the first step the policy's weights are pushed to
//! every rollout replica and to the reference, so all of them start from the same
//! model whichever process built it. After that the controllers' weight sync carries
//! each update over the runtime. Roles are spawned linked to the controller's node:
//! when that node leaves the cluster or dies, the nodes release them.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_runtime::actor::{ActorRef, CallError};
use yatt_runtime::directory::Directory;
use yatt_runtime::message::Message;
use yatt_runtime::node::{Node, NodeBuilder, NodeError};

use crate::builtin::{PolicyRequest, PolicyResponse};
use crate::controller::{
    variant, Controller, ControllerError, PolicyRef, RoleRefs, RolloutRef, SamplesRef, Timeouts,
};
use crate::job::{
    base_model, controllers, invalid, one_of, policy_role, positive, reference_role, reward_role,
    rollout_role, JobConfig, JobError,
};
use crate::role::{DeviceGroup, Role, RoleActor, RoleError, RoleRequest, RoleResponse};

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
    /// Node of the policy (the trainer).
    pub policy: String,
    /// Node of the reference policy.
    pub reference: String,
    /// Node of the reward functions.
    pub reward: String,
    /// Deadline for a node to build a role, model load included, seconds.
    pub spawn_timeout_s: u64,
    /// Run the live placement actor (embedded mode only): the roles sit on `groups`
    /// virtual device groups of one libtorch thread each and groups move between the
    /// rollout and the policy as the load shifts (see `crate::placement_live`).
    pub live: bool,
    /// Virtual device groups of the live placement (`job.controllers` + 1).
    pub groups: usize,
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
            policy: String::new(),
            reference: String::new(),
            reward: String::new(),
            spawn_timeout_s: 300,
            live: false,
            groups: 3,
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

impl PlacementSection {
    /// The node named for `role` (one of [`ROLES`]).
    pub fn node_of(&self, role: &str) -> &str {
        match role {
            "rollout" => &self.rollout,
            "policy" => &self.policy,
            "reference" => &self.reference,
            _ => &self.reward,
        }
    }

    /// Checks the section on its own (which nodes exist is checked against the cluster
    /// by [`build_cluster`]).
    pub fn validate(&self) -> Result<(), JobError> {
        one_of("placement.mode", &self.mode, &["colocate", "disaggregated"])?;
        positive(
            "placement.spawn_timeout_s",
            self.spawn_timeout_s as f64,
            "e.g. spawn_timeout_s = 300",
        )?;
        if self.live && self.mode != "colocate" {
            return Err(JobError::NotImplemented {
                key: "placement.live".into(),
                found: "true with mode = \"disaggregated\"".into(),
                fix: "live placement runs embedded only for now: set mode = \"colocate\" or live = false".into(),
            });
        }
        if self.mode == "colocate" {
            return Ok(());
        }
        for role in ROLES {
            if self.node_of(role).is_empty() {
                return Err(invalid(
                    &format!("placement.{role}"),
                    "the name of the cluster node that runs this role",
                    "nothing",
                    &format!(
                        "add {role} = \"NODE\" under [placement] (a `yatt-node run --name NODE`)"
                    ),
                ));
            }
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

/// Registers the built-in roles (rollout, policy, reference, reward) as factories that
/// take [`RoleArgs`].
pub fn register(builder: NodeBuilder) -> NodeBuilder {
    builder
        .factory_async("rollout", |a: RoleArgs| {
            start_role(a, "rollout", |job| {
                let (model, codec, _) = base_model(job)?;
                Ok(rollout_role(job, model, codec))
            })
        })
        .factory_async("policy", |a: RoleArgs| {
            start_role(a, "policy", |job| {
                let (model, _, pad_id) = base_model(job)?;
                policy_role(job, model, pad_id)
            })
        })
        .factory_async("reference", |a: RoleArgs| {
            start_role(a, "reference", |job| {
                let (model, _, pad_id) = base_model(job)?;
                Ok(reference_role(job, model, pad_id))
            })
        })
        .factory_async("reward", |a: RoleArgs| start_role(a, "reward", reward_role))
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

/// Spawns `role` of the job on the node `job.placement` names for it.
async fn spawn<Req: Message, Resp: Message>(
    job: &JobConfig,
    text: &str,
    node: &Node,
    role: &'static str,
) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, ControllerError> {
    let target = job.placement.node_of(role);
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
/// the node `[placement]` names (one rollout replica per controller), pushes the
/// policy's initial weights to the rollouts and the reference, and returns one
/// controller per rollout, driving the roles over QUIC.
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
    if job.algorithm.name == "ppo" || job.job.policy_replicas > 1 {
        return Err(JobError::NotImplemented {
            key: "algorithm.name / job.policy_replicas".into(),
            found: format!(
                "{} / {}",
                job.algorithm.name, job.job.policy_replicas
            ),
            fix: "on a cluster, use grpo, rloo, reinforce++ or dapo with one policy replica; ppo's critic and policy replicas run with placement.mode = \"colocate\"".into(),
        });
    }
    // Nodes started just before the run may still be joining: wait for them, briefly.
    let named = |d: &Directory| {
        ROLES
            .iter()
            .all(|r| d.alive_nodes().any(|n| n.name == p.node_of(r)))
    };
    if !node.directory().read(named) {
        tracing::info!(wait = ?NODES_WAIT, "waiting for the placement's nodes to join");
        node.directory().wait_until(NODES_WAIT, named).await;
    }
    let mut alive: Vec<String> = node
        .directory()
        .read(|d| d.alive_nodes().map(|n| n.name.clone()).collect());
    alive.sort();
    for role in ROLES {
        let want = p.node_of(role);
        if !alive.iter().any(|n| n == want) {
            return Err(invalid(
                &format!("placement.{role}"),
                &format!("a node of the cluster: {}", alive.join(", ")),
                &format!("{want:?}"),
                &format!("start it (`yatt-node run --name {want} --seed ...`) or name one of the nodes above"),
            ));
        }
    }
    // postcard cannot carry the config's untagged values; TOML can, and the node
    // validates what it gets.
    let text = toml::to_string(job).map_err(|e| JobError::Parse {
        origin: "the job config".into(),
        message: format!("cannot encode it for the nodes: {e}"),
    })?;
    let rollouts = async {
        let mut v = Vec::with_capacity(job.job.controllers);
        for _ in 0..job.job.controllers {
            v.push(spawn(job, &text, node, "rollout").await?);
        }
        Ok::<Vec<RolloutRef>, ControllerError>(v)
    };
    let (rollouts, reward, reference, policy) = tokio::try_join!(
        rollouts,
        spawn(job, &text, node, "reward"),
        spawn(job, &text, node, "reference"),
        spawn(job, &text, node, "policy"),
    )?;
    initial_weight_sync(&policy, &rollouts, &reference, Timeouts::default().sync).await?;
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward,
        reference: Some(reference),
        policy,
        critic: None,
    };
    controllers(job, shared, rollouts, Vec::new())
}

/// Pushes the policy's weights (version 0) to every rollout and to the reference.
async fn initial_weight_sync(
    policy: &PolicyRef,
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
    let update = match policy
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
        let e = JobConfig::parse(DEMO, "d", &["placement.mode=\"spread\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.mode") && e.contains("\"colocate\", \"disaggregated\""),
            "{e}"
        );
    }
}
