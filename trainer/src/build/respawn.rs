//! A disaggregated run that loses a node hosting only stateless roles (rollout,
//! reward, reference) goes on: the lost roles are spawned again on a surviving node,
//! the heads go back to before the failed step and the step runs again. Nothing was
//! trained in it (these roles all serve before the update), and sampling is seeded per
//! sample, so the run's trajectory is the one it would have had without the loss.
//!
//! A lost policy or critic holds trainer state no other node has: the run stops, and the
//! error names the last checkpoint to `--resume` from.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use yatt_runtime::{ActorId, Node};

use crate::build::cluster::{job_text, spawn};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::error::ControllerError;
use crate::controller::report::ControllerState;
use crate::error::JobError;

/// The roles whose loss a step survives: none holds state the run needs back.
const STATELESS: [&str; 3] = ["rollout", "reward", "reference"];

/// The stages that run after the update: a failure there leaves the policy a version
/// ahead of the heads, so the step cannot simply run again.
const AFTER_UPDATE: [&str; 1] = ["weight_sync"];

/// If `failed` is a call to a stateless role whose node the cluster has declared dead
/// (waiting at most twice the failure-detection bound for that), spawns every lost
/// stateless role again on a surviving node, puts the heads back to `before` and gives
/// the new rollouts the current weights. Returns what moved (`role: old node -> new
/// node`), or an empty list when the step cannot be recovered this way (the caller
/// returns `failed` then).
pub(crate) async fn respawn_lost_roles(
    job: &JobConfig,
    node: &Node,
    controllers: &mut [Controller],
    before: &[ControllerState],
    failed: &JobError,
    custom: &BTreeSet<ActorId>,
) -> Result<Vec<String>, JobError> {
    let JobError::Controller(e) = failed else {
        return Ok(Vec::new());
    };
    let ControllerError::Call { role, stage, .. } = e.as_ref() else {
        return Ok(Vec::new());
    };
    if !STATELESS.contains(role) || AFTER_UPDATE.contains(stage) {
        return Ok(Vec::new());
    }
    let hosts = role_hosts(controllers);
    let bound = node.config().failure_timeout * 2 + Duration::from_secs(1);
    let dead = |d: &yatt_runtime::Directory| -> BTreeSet<String> {
        let alive: BTreeSet<&str> = d.alive_nodes().map(|n| n.name.as_str()).collect();
        hosts
            .keys()
            .filter(|n| !alive.contains(n.as_str()))
            .cloned()
            .collect()
    };
    if node.directory().read(|d| dead(d).is_empty()) {
        node.directory()
            .wait_until(bound, |d| !dead(d).is_empty())
            .await;
    }
    let lost = node.directory().read(dead);
    if lost.is_empty() {
        return Ok(Vec::new());
    }
    // A user's role went with it: the trainer cannot make another, and a built-in one
    // in its place would silently change the run.
    if custom.iter().any(|id| lost.contains(&id.name.node)) {
        return Ok(Vec::new());
    }
    // Trainer state went with a policy or critic: nothing here can bring it back.
    if lost
        .iter()
        .any(|n| hosts[n].iter().any(|r| !STATELESS.contains(&r.as_str())))
    {
        return Ok(Vec::new());
    }
    let mut load: BTreeMap<String, usize> = hosts
        .iter()
        .filter(|(n, _)| !lost.contains(*n))
        .map(|(n, roles)| (n.clone(), roles.len()))
        .collect();
    let candidates: Vec<String> = node.directory().read(|d| {
        d.alive_nodes()
            .map(|n| n.name.clone())
            .filter(|n| n != node.name())
            .collect()
    });
    for c in &candidates {
        load.entry(c.clone()).or_insert(0);
    }
    let text = job_text(job)?;
    let mut moved = Vec::new();
    // The least loaded surviving node (then the first by name) takes each lost role.
    let pick = |load: &mut BTreeMap<String, usize>| -> Result<String, JobError> {
        let target = load
            .iter()
            .filter(|(n, _)| candidates.contains(n))
            .min_by_key(|(n, k)| (**k, (*n).clone()))
            .map(|(n, _)| n.clone())
            .ok_or_else(|| JobError::Placement {
                what: format!("no surviving node can host the roles lost with {lost:?}"),
                fix: "start a yatt-node that joins the cluster, then `yatt train --resume`".into(),
            })?;
        *load.entry(target.clone()).or_insert(0) += 1;
        Ok(target)
    };
    let is_lost = |id: &yatt_runtime::ActorId| lost.contains(&id.name.node);
    // Shared roles: one new actor for every head.
    if let Some(c) = controllers.first() {
        if is_lost(c.roles.reward.id()) {
            let target = pick(&mut load)?;
            let r = spawn(job, &text, node, "reward", &target, None).await?;
            moved.push(format!(
                "reward: {} -> {target}",
                c.roles.reward.id().name.node
            ));
            for c in controllers.iter_mut() {
                c.roles.reward = r.clone();
            }
        }
    }
    if let Some(old) = controllers
        .first()
        .and_then(|c| c.roles.reference.as_ref())
        .filter(|r| is_lost(r.id()))
        .map(|r| r.id().name.node.clone())
    {
        let target = pick(&mut load)?;
        let r = spawn(job, &text, node, "reference", &target, None).await?;
        moved.push(format!("reference: {old} -> {target}"));
        for c in controllers.iter_mut() {
            c.roles.reference = Some(r.clone());
        }
    }
    for c in controllers.iter_mut() {
        if is_lost(c.roles.rollout.id()) {
            let target = pick(&mut load)?;
            let old = c.roles.rollout.id().name.node.clone();
            c.roles.rollout = spawn(job, &text, node, "rollout", &target, None).await?;
            moved.push(format!("rollout: {old} -> {target}"));
        }
        for r in c.roles.extra_rollouts.iter_mut() {
            if is_lost(r.id()) {
                let target = pick(&mut load)?;
                let old = r.id().name.node.clone();
                *r = spawn(job, &text, node, "rollout", &target, None).await?;
                moved.push(format!("rollout: {old} -> {target}"));
            }
        }
        c.lost_rollouts.clear();
    }
    for (c, s) in controllers.iter_mut().zip(before) {
        c.restore(s.clone())?;
        c.sync_weights().await?;
    }
    Ok(moved)
}

/// Which of the job's roles each node hosts.
fn role_hosts(controllers: &[Controller]) -> BTreeMap<String, Vec<String>> {
    let mut hosts: BTreeMap<String, Vec<String>> = BTreeMap::new();
    let mut add = |id: &yatt_runtime::ActorId| {
        hosts
            .entry(id.name.node.clone())
            .or_default()
            .push(id.name.role.clone());
    };
    for c in controllers {
        let r = &c.roles;
        add(r.rollout.id());
        r.extra_rollouts.iter().for_each(|x| add(x.id()));
        add(r.reward.id());
        if let Some(x) = &r.reference {
            add(x.id());
        }
        add(r.policy.id());
        if let Some(x) = &r.critic {
            add(x.id());
        }
    }
    hosts
}
