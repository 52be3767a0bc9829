//! A disaggregated run that loses a node goes on when nothing only that node held is
//! needed: its stateless roles (rollout, reward, reference) are spawned again on a
//! surviving node, and a lost policy replica is replaced by a new one that takes a
//! surviving replica's whole trainer state (weights, AdamW moments, step; see
//! [`crate::build::replica`]). The heads go back to before the failed step, the ring
//! is rebuilt with every replica at its old rank, and the step runs again. Nothing was
//! trained in the failed step, sampling is seeded per sample and the ring sums in rank
//! order, so the run's trajectory is the one it would have had without the loss.
//!
//! A lost built-in critic is started again from its last saved state and given the
//! updates since (`controller/critic_log.rs`), and so is a lost policy that has no
//! replica, with one head (`build/policy_rebuild.rs`). The last of several policy
//! replicas, a policy that already took the failed step's update, or a critic lost
//! during the update that a replacement could not take over, hold trainer state no
//! other node has: the run stops, and the error names the last checkpoint to
//! `--resume` from.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use yatt_roles::{RoleRequest, RoleResponse};
use yatt_runtime::{ActorId, ActorRef, Directory, Liveness, Message, Node};

use crate::build::policy_rebuild::{rebuild_lost_policy, why_not_rebuilt};
use crate::build::remote::{job_text, spawn};
use crate::build::replica::{replace_lost_replicas, Hosting};
use crate::build::user_roles::NamedRoles;
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::error::{unreached_node, ControllerError};
use crate::controller::refs::SamplesRef;
use crate::controller::report::ControllerState;
use crate::error::JobError;

/// The roles whose loss a step survives: none holds state the run needs back.
const STATELESS: [&str; 3] = ["rollout", "reward", "reference"];

/// The stages that run after the update: a failure there leaves the policy a version
/// ahead of the heads, so the step cannot simply run again.
const AFTER_UPDATE: [&str; 1] = ["weight_sync"];

/// The update's stages: the policy and the critic train side by side, so a failure in
/// either may come after the other took the step's update.
const UPDATE: [&str; 2] = ["update_actor", "update_critic"];

/// Whether the actor `id` is gone: its entry is dead, or its name now belongs to a
/// newer incarnation (its node restarted); with no entry, whether its node is gone.
pub(crate) fn actor_lost(d: &Directory, id: &ActorId) -> bool {
    match d.actor(&id.name) {
        Some(e) => e.id != *id || e.liveness != Liveness::Alive,
        None => !d.alive_nodes().any(|n| n.name == id.name.node),
    }
}

/// Waits until `lost` holds of the directory, at most twice the failure-detection
/// bound plus a second: a call can fail on a dead node before the directory declares
/// it dead. Returns that wait's bound.
pub(crate) async fn wait_for_loss(node: &Node, lost: impl Fn(&Directory) -> bool) -> Duration {
    let bound = node.config().failure_timeout * 2 + Duration::from_secs(1);
    if !node.directory().read(&lost) {
        node.directory().wait_until(bound, lost).await;
    }
    bound
}

/// If `failed` is a call that a lost role may explain (a stateless role before the
/// update, or any call to a replicated policy) and the cluster declares one of the
/// job's roles lost (waiting at most twice the failure-detection bound for that),
/// spawns every lost stateless role again on a surviving node, replaces every lost
/// policy replica, puts the heads back to `before` and gives the rollouts the current
/// weights. Returns what moved (`role: old node -> new node`), or why the step cannot
/// be recovered this way.
///
/// A recovery that meets a loss itself (a node that was to host a role dies too) is
/// tried again once the membership has changed, up to [`RECOVERY_TRIES`] times: each
/// try finds what is lost anew. What an earlier try moved stays moved and is reported
/// with the rest.
pub(crate) async fn respawn_lost_roles(
    job: &JobConfig,
    node: &Node,
    controllers: &mut [Controller],
    before: &[ControllerState],
    failed: &JobError,
    custom: &BTreeSet<ActorId>,
    named: &mut NamedRoles,
) -> Result<Recovered, JobError> {
    let mut tries = 1;
    let mut moved = Vec::new();
    loop {
        let once = respawn_once(
            job,
            node,
            controllers,
            before,
            failed,
            custom,
            named,
            &mut moved,
        )
        .await;
        match once {
            Err(e) if tries < RECOVERY_TRIES && met_a_loss(&e) => {
                tracing::warn!(tries, error = %e, "recovering from a node loss failed; trying again once the membership changes");
                tries += 1;
                // The node it met is dying, stalled or rejoining: let the directory
                // say so (a node declared dead, back, or a new leader) before the next
                // try, at most two failure bounds.
                let epoch = node.directory().read(|d| d.version());
                let settle = node.config().failure_timeout * 2;
                node.directory()
                    .wait_until(settle, |d| d.version() != epoch)
                    .await;
            }
            Ok(Recovered::Moved(())) => return Ok(Recovered::Moved(moved)),
            // A later try that finds nothing lost any more still reports what the
            // earlier ones moved.
            Ok(Recovered::NotMoved(None)) if !moved.is_empty() => {
                return Ok(Recovered::Moved(moved))
            }
            Ok(Recovered::NotMoved(e)) => return Ok(Recovered::NotMoved(e)),
            Err(e) => return Err(e),
        }
    }
}

/// What a recovery did. `M` is what moved: `role: old node -> new node` for each (one
/// try of [`respawn_once`] pushes its moves into the caller's list instead).
pub(crate) enum Recovered<M = Vec<String>> {
    /// The lost roles run elsewhere now.
    Moved(M),
    /// Nothing moved. `Some` is the error the run stops with instead of the failure
    /// itself: the failure plus why it cannot be recovered in place (state that went
    /// with the node, or a node the cluster still hears: a partition). `None`: the
    /// failure was not a lost node's, and stands as it is.
    NotMoved(Option<JobError>),
}

/// Why a failed step cannot be recovered in place: `failed`, what went wrong with the
/// recovery, and what to do (the run's stop message adds how to resume).
fn unrecoverable<M>(failed: &JobError, why: String, fix: &str) -> Recovered<M> {
    Recovered::NotMoved(Some(JobError::Recovery {
        what: format!("{failed}; {why}"),
        fix: fix.into(),
    }))
}

/// How often a recovery is tried.
const RECOVERY_TRIES: usize = 5;

/// Whether a failed recovery met another loss (a call or a spawn that failed), rather
/// than a refusal (no node can host, the state is gone).
fn met_a_loss(e: &JobError) -> bool {
    match e {
        JobError::Controller(c) => {
            matches!(
                c.as_ref(),
                ControllerError::Call { .. } | ControllerError::Spawn { .. }
            )
        }
        _ => false,
    }
}

async fn respawn_once(
    job: &JobConfig,
    node: &Node,
    controllers: &mut [Controller],
    before: &[ControllerState],
    failed: &JobError,
    custom: &BTreeSet<ActorId>,
    named: &mut NamedRoles,
    moved: &mut Vec<String>,
) -> Result<Recovered<()>, JobError> {
    let not_moved = Ok(Recovered::NotMoved(None));
    let JobError::Controller(e) = failed else {
        return not_moved;
    };
    let ControllerError::Call {
        role,
        stage,
        source,
        ..
    } = e.as_ref()
    else {
        return not_moved;
    };
    let unreached = unreached_node(source);
    // Replicas of a sharded policy (HSDP) hand no trainer state to a new replica.
    let sharded = job.job.policy_shards > 1;
    let replicated =
        !sharded && controllers.len() > 1 && controllers.iter().all(|c| c.in_policy_ring);
    // The user's stages that `[roles]` named are stateless too: spawned again by name.
    let named_stage = controllers.first().is_some_and(|c| {
        c.extra
            .iter()
            .any(|s| s.name == *role && named.contains(s.role.id()))
    });
    let stateless = (STATELESS.contains(role) || named_stage) && !AFTER_UPDATE.contains(stage);
    let past_update = UPDATE.contains(stage) || AFTER_UPDATE.contains(stage);
    // A critic the controller can replace (a built-in one) is, before the update: once
    // it has begun, the policy may have taken the step's update.
    let critic_replaceable =
        controllers.iter().any(|c| c.critic_recovery.is_some()) && !past_update;
    // A single policy is rebuilt from its log, and the whole step runs again.
    let policy_rebuildable = !replicated && why_not_rebuilt(controllers, past_update).is_none();
    let recoverable = stateless
        || (*role == "critic" && critic_replaceable)
        || (*role == "policy" && (replicated || policy_rebuildable));
    // A critic a call replaced during the failed step is the one to check.
    for c in controllers.iter_mut() {
        c.adopt_replaced_critic();
    }
    // A role's own error, to a role whose loss would not be survived anyway: as it is.
    if !recoverable && unreached.is_none() {
        return not_moved;
    }
    let ids = role_ids(controllers);
    let bound = wait_for_loss(node, |d| ids.iter().any(|(id, _)| actor_lost(d, id))).await;
    let lost: BTreeSet<ActorId> = node.directory().read(|d| {
        ids.iter()
            .filter(|(id, _)| actor_lost(d, id))
            .map(|(id, _)| id.clone())
            .collect()
    });
    if lost.is_empty() {
        return Ok(match unreached {
            // The call could not reach a node the cluster still hears: this process's
            // way to it is broken, which no respawn mends.
            Some(n) => unrecoverable(
                failed,
                format!("but the cluster still hears {n} (its directory did not declare it dead within {bound:?}): this process cannot reach a live node, a network partition or a firewall between them"),
                &format!("mend the network between this process and {n} (the other nodes reach it), then resume"),
            ),
            None => Recovered::NotMoved(None),
        });
    }
    let lost_on = |role: &str| -> Option<String> {
        let nodes: BTreeSet<&str> = ids
            .iter()
            .filter(|(id, r)| *r == role && lost.contains(id))
            .map(|(id, _)| id.name.node.as_str())
            .collect();
        (!nodes.is_empty()).then(|| nodes.into_iter().collect::<Vec<_>>().join(", "))
    };
    // A role the program brought went with it: the trainer cannot make another, and a
    // built-in one in its place would silently change the run. (One `[roles]` names is
    // spawned again by its name.)
    let lost_custom = node
        .directory()
        .read(|d| custom.iter().find(|id| actor_lost(d, id)).cloned());
    if let Some(id) = lost_custom {
        return Ok(unrecoverable(
            failed,
            format!("{} was lost with {}, and it is a role the program brought, which the trainer cannot start again", id.name, id.name.node),
            "name the role in [roles] so that the trainer can start it again, or start the program again",
        ));
    }
    // A critic the program brought went above; the built-in one is started again from
    // its log below.
    if let Some(n) = lost_on("critic") {
        if !critic_replaceable {
            return Ok(unrecoverable(
                failed,
                format!("the critic was lost with {n} after this step's update began ({stage}), and its weights and optimizer state went with it"),
                "resume from the last checkpoint",
            ));
        }
    }
    let policy_lost = lost_on("policy").filter(|_| !replicated);
    if let (Some(n), true) = (&policy_lost, sharded) {
        return Ok(unrecoverable(
            failed,
            format!("a rank of the sharded policy was lost with {n}, and a sharded policy is not rebuilt in place"),
            "resume from the last checkpoint, at any job.policy_shards, on the nodes that are left",
        ));
    }
    if let Some((n, why)) = policy_lost
        .as_ref()
        .zip(why_not_rebuilt(controllers, past_update))
    {
        return Ok(unrecoverable(
            failed,
            format!("the policy was lost with {n}, and its trainer state went with it ({why})"),
            "resume from the last checkpoint; job.policy_replicas = job.controllers keeps a copy on every head, and the run survives the loss of all but one",
        ));
    }
    if !recoverable && policy_lost.is_none() {
        return Ok(unrecoverable(
            failed,
            format!("{role} failed after this step's update began ({stage}), so the step cannot simply run again"),
            "resume from the last checkpoint",
        ));
    }
    let mut hosting = Hosting::new(node, &ids, &lost);
    let text = job_text(job)?;
    let spawn_timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    let again = Again {
        job,
        text: &text,
        node,
        lost: &lost,
        timeout: spawn_timeout,
    };
    let is_lost = |id: &ActorId| lost.contains(id);
    // Shared roles: one new actor for every head.
    if let Some(id) = controllers
        .first()
        .map(|c| c.roles.reward.id().clone())
        .filter(|id| is_lost(id))
    {
        let r = again.spawn(named, &mut hosting, &id, "reward").await?;
        moved.push(format!("reward: {} -> {}", id.name.node, r.id().name.node));
        for c in controllers.iter_mut() {
            c.roles.reward = r.clone();
        }
    }
    if let Some(id) = controllers
        .first()
        .and_then(|c| c.roles.reference.as_ref())
        .map(|r| r.id().clone())
        .filter(|id| is_lost(id))
    {
        let r = again.spawn(named, &mut hosting, &id, "reference").await?;
        moved.push(format!(
            "reference: {} -> {}",
            id.name.node,
            r.id().name.node
        ));
        for c in controllers.iter_mut() {
            c.roles.reference = Some(r.clone());
        }
    }
    for c in controllers.iter_mut() {
        if is_lost(c.roles.rollout.id()) {
            let id = c.roles.rollout.id().clone();
            c.roles.rollout = again.spawn(named, &mut hosting, &id, "rollout").await?;
            let new = &c.roles.rollout.id().name.node;
            moved.push(format!("rollout: {} -> {new}", id.name.node));
        }
        for r in c.roles.extra_rollouts.iter_mut() {
            if is_lost(r.id()) {
                let target = hosting.pick(&lost)?;
                let old = r.id().name.node.clone();
                *r = spawn(job, &text, node, "rollout", &target, None).await?;
                moved.push(format!("rollout: {old} -> {target}"));
            }
        }
        c.lost_rollouts.clear();
    }
    // The user's named stages: one new actor for every head, as the heads share them.
    let lost_stages: Vec<(&'static str, ActorId)> = controllers.first().map_or(Vec::new(), |c| {
        c.extra
            .iter()
            .filter(|s| is_lost(s.role.id()))
            .map(|s| (s.name, s.role.id().clone()))
            .collect()
    });
    for (name, old) in lost_stages {
        let r: SamplesRef = named.respawn(node, &old, again.timeout).await?;
        moved.push(format!("{name}: {} -> {}", old.name.node, r.id().name.node));
        for c in controllers.iter_mut() {
            for s in c.extra.iter_mut().filter(|s| *s.role.id() == old) {
                s.role = r.clone();
            }
        }
    }
    if let Some(c) = controllers
        .first_mut()
        .filter(|c| policy_lost.is_some() && is_lost(c.roles.policy.id()))
    {
        let completed = before.first().map_or(c.step, |s| s.step);
        let rebuilt =
            rebuild_lost_policy(job, &text, node, c, completed, &mut hosting, &lost).await?;
        moved.push(rebuilt);
    }
    if replicated {
        let replaced =
            replace_lost_replicas(job, &text, node, controllers, before, &lost, &mut hosting)
                .await?;
        moved.extend(replaced);
    }
    if let Some((c, old)) = controllers.first().zip(controllers[0].roles.critic.clone()) {
        if is_lost(old.id()) {
            // The step runs again from `before`: an update it made is undone first.
            if let (Some(r), Some(s)) = (&c.critic_recovery, before.first()) {
                r.lock_log().rewind(s.step);
            }
            let new = c
                .recover_critic(&old)
                .await?
                .ok_or_else(|| JobError::Recovery {
                    what: format!(
                        "{failed}; the critic on {} could not be replaced",
                        old.id().name.node
                    ),
                    fix: "resume from the last checkpoint".into(),
                })?;
            moved.push(format!(
                "critic: {} -> {}",
                old.id().name.node,
                new.id().name.node
            ));
            for c in controllers.iter_mut() {
                c.adopt_replaced_critic();
            }
        }
    }
    for (c, s) in controllers.iter_mut().zip(before) {
        c.restore(s.clone())?;
        c.sync_weights().await?;
    }
    Ok(Recovered::Moved(()))
}

/// What spawning a lost role again needs: a role `[roles]` named goes back by its name,
/// a built-in one to the node [`Hosting`] picks.
struct Again<'a> {
    job: &'a JobConfig,
    text: &'a str,
    node: &'a Node,
    lost: &'a BTreeSet<ActorId>,
    timeout: Duration,
}

impl Again<'_> {
    async fn spawn<Req: Message, Resp: Message>(
        &self,
        named: &mut NamedRoles,
        hosting: &mut Hosting,
        id: &ActorId,
        role: &'static str,
    ) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, JobError> {
        if named.contains(id) {
            return named.respawn(self.node, id, self.timeout).await;
        }
        let target = hosting.pick(self.lost)?;
        Ok(spawn(self.job, self.text, self.node, role, &target, None).await?)
    }
}

/// The job's role actors and their roles (a shared role once per head).
pub(crate) fn role_ids(controllers: &[Controller]) -> Vec<(ActorId, &'static str)> {
    let ids: BTreeMap<ActorId, &'static str> =
        controllers.iter().flat_map(Controller::role_ids).collect();
    ids.into_iter().collect()
}
