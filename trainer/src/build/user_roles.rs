//! Spawning the roles `[roles]` names: each by its registered name, on its node or on
//! the first alive node that registers it, with its TOML arguments sent as JSON (the
//! trainer does not link the user's types; the hosting node decodes them into its own).

use std::collections::BTreeMap;
use std::time::Duration;

use yatt_runtime::{ActorId, ActorRef, Message, Node, NodeError};

use crate::build::custom::CustomRoles;
use crate::build::remote::wait_for_nodes;
use crate::config::checks::invalid;
use crate::config::sections::JobConfig;
use crate::config::user_roles::UserRole;
use crate::controller::extra_stages::ExtraStage;
use crate::controller::refs::{RolloutRef, SamplesRef};
use crate::controller::release::{stop_if_failed, StartedRoles};
use crate::error::JobError;

/// How long a role with no `node` waits for a node that registers it to join.
const JOIN_WAIT: Duration = Duration::from_secs(10);

/// The stateless roles `[roles]` named (reward, reference, rollouts, stages), by the
/// actor each is now: what a node-loss recovery needs to spawn one again elsewhere.
#[derive(Debug, Clone, Default)]
pub(crate) struct NamedRoles {
    by_actor: BTreeMap<ActorId, NamedRole>,
}

#[derive(Debug, Clone)]
struct NamedRole {
    key: String,
    spec: UserRole,
    nth: usize,
}

impl NamedRoles {
    fn add(&mut self, id: &ActorId, key: &str, spec: &UserRole, nth: usize) {
        let named = NamedRole {
            key: key.to_string(),
            spec: spec.clone(),
            nth,
        };
        self.by_actor.insert(id.clone(), named);
    }

    /// Whether `id` is one of them.
    pub(crate) fn contains(&self, id: &ActorId) -> bool {
        self.by_actor.contains_key(id)
    }

    /// Spawns the role `old` was again, away from the nodes `lost` names (a role pinned
    /// to a lost node goes to any node that registers it), and records the new actor in
    /// its place.
    pub(crate) async fn respawn<Req: Message, Resp: Message>(
        &mut self,
        node: &Node,
        old: &ActorId,
        timeout: Duration,
    ) -> Result<ActorRef<Req, Resp>, JobError> {
        let Some(mut named) = self.by_actor.remove(old) else {
            return Err(invalid(
                "[roles]",
                "a role the job config names",
                &old.to_string(),
                "this is a bug: the recovery asked for a role it did not spawn",
            ));
        };
        let pinned_alive = node
            .directory()
            .read(|d| d.alive_nodes().any(|n| n.name == named.spec.node));
        if !pinned_alive {
            named.spec.node.clear();
        }
        let r = spawn_user(node, &named.key, &named.spec, named.nth, timeout).await?;
        self.by_actor.insert(r.id().clone(), named);
        Ok(r)
    }
}

/// The roles `job.roles` names, spawned and linked to `node` (they stop when this
/// trainer leaves), merged with the ones the program brought in `given`, and the
/// stateless ones among them by actor. A slot both name is refused.
pub(crate) async fn with_config_roles(
    job: &JobConfig,
    node: &Node,
    given: &CustomRoles,
) -> Result<(CustomRoles, NamedRoles), JobError> {
    let roles = &job.roles;
    let out = given.clone();
    let named = NamedRoles::default();
    if roles.is_empty() {
        return Ok((out, named));
    }
    let timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    let taken = given.slots();
    for (key, _) in roles.slots() {
        let slot = key.trim_start_matches("roles.");
        if taken.contains(&slot) {
            return Err(invalid(
                key,
                "nothing when the program passes its own role for the slot (CustomRoles)",
                slot,
                &format!("remove [{key}], or leave CustomRoles::{slot} empty"),
            ));
        }
    }
    // One that fails part-way stops the roles it had spawned before it answers.
    stop_if_failed(node, job, |started| {
        spawn_config_roles(job, node, out, named, timeout, started)
    })
    .await
}

/// Spawns each role `job.roles` names into `out`'s slots, recording each in `started`.
async fn spawn_config_roles(
    job: &JobConfig,
    node: &Node,
    mut out: CustomRoles,
    mut named: NamedRoles,
    timeout: Duration,
    started: StartedRoles,
) -> Result<(CustomRoles, NamedRoles), JobError> {
    let roles = &job.roles;
    if let Some(r) = &roles.reward {
        let a: SamplesRef = started.keep(spawn_user(node, "roles.reward", r, 0, timeout).await?);
        named.add(a.id(), "roles.reward", r, 0);
        out.reward = Some(a);
    }
    if let Some(r) = &roles.reference {
        let a: SamplesRef = started.keep(spawn_user(node, "roles.reference", r, 0, timeout).await?);
        named.add(a.id(), "roles.reference", r, 0);
        out.reference = Some(a);
    }
    if let Some(r) = &roles.critic {
        out.critic = Some(started.keep(spawn_user(node, "roles.critic", r, 0, timeout).await?));
    }
    if let Some(r) = &roles.policy {
        out.policy = Some(started.keep(spawn_user(node, "roles.policy", r, 0, timeout).await?));
    }
    if let Some(r) = &roles.rollout {
        for head in 0..job.job.controllers {
            let a: RolloutRef =
                started.keep(spawn_user(node, "roles.rollout", r, head, timeout).await?);
            named.add(a.id(), "roles.rollout", r, head);
            out.rollouts.push(a);
        }
    }
    for (i, s) in roles.stages.iter().enumerate() {
        let key = format!("roles.stages[{i}]");
        let as_role = UserRole {
            role: s.role.clone(),
            node: s.node.clone(),
            args: s.args.clone(),
        };
        let role: SamplesRef = started.keep(spawn_user(node, &key, &as_role, 0, timeout).await?);
        named.add(role.id(), &key, &as_role, 0);
        out.stages.push(
            ExtraStage::new(s.stage_name(), s.after, role)
                .with_timeout(Duration::from_secs_f64(s.timeout_s)),
        );
    }
    Ok((out, named))
}

/// Spawns `r` (the `nth` of its kind: replicas of a slot start their search on
/// different nodes, so they spread) and gives back its typed reference.
async fn spawn_user<Req: Message, Resp: Message>(
    node: &Node,
    key: &str,
    r: &UserRole,
    nth: usize,
    timeout: Duration,
) -> Result<ActorRef<Req, Resp>, JobError> {
    let args = serde_json::to_string(&r.args).map_err(|e| {
        invalid(
            &format!("{key}.args"),
            "a table of plain values",
            &format!("{:?}", r.args),
            &e.to_string(),
        )
    })?;
    let refused = |host: &str, e: NodeError| {
        invalid(
            &format!("{key}.args"),
            &format!("arguments role {:?} on {host} accepts", r.role),
            &format!("[{key}] args"),
            &e.to_string(),
        )
    };
    if !r.node.is_empty() {
        wait_for_nodes(node, &[(format!("{key}.node"), r.node.clone())]).await?;
        return match node
            .spawn_remote_linked_json(&r.node, &r.role, &args, timeout)
            .await
        {
            Ok(a) => Ok(a),
            Err(NodeError::NoFactory { known, .. }) => Err(invalid(
                &format!("{key}.role"),
                &format!("a role node {} registers: {}", r.node, known.join(", ")),
                &format!("{:?}", r.role),
                "register it in that node's daemon (yatt::node::main_with(|r| r.role::<MyRole>(NAME))), or name a node that does",
            )),
            Err(e) => Err(refused(&r.node, e)),
        };
    }
    let mut tried: Vec<(String, Vec<String>)> = Vec::new();
    for round in 0..2 {
        let mut alive: Vec<String> = node
            .directory()
            .read(|d| d.alive_nodes().map(|n| n.name.clone()).collect());
        alive.sort();
        alive.retain(|n| !tried.iter().any(|(t, _)| t == n));
        if !alive.is_empty() {
            let turn = nth % alive.len();
            alive.rotate_left(turn);
        }
        for host in alive {
            match node
                .spawn_remote_linked_json(&host, &r.role, &args, timeout)
                .await
            {
                Ok(a) => return Ok(a),
                Err(NodeError::NoFactory { known, .. }) => tried.push((host, known)),
                Err(e) => return Err(refused(&host, e)),
            }
        }
        if round == 0 {
            // Daemons started just before the run may still be joining.
            let seen = tried.len();
            node.directory()
                .wait_until(JOIN_WAIT, |d| d.alive_nodes().count() > seen)
                .await;
        }
    }
    let what: Vec<String> = tried
        .iter()
        .map(|(n, known)| format!("{n} ({})", known.join(", ")))
        .collect();
    Err(invalid(
        &format!("{key}.role"),
        &format!("a role some alive node registers; they register: {}", what.join("; ")),
        &format!("{:?}", r.role),
        "start a daemon that registers it (yatt::node::main_with(|r| r.role::<MyRole>(NAME))) and join it to this cluster, or fix the name",
    ))
}
