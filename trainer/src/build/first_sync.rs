//! A cluster job's first weight sync: every rollout, the reference and the other policy
//! replicas start from the first replica's model (version 0), whichever node built it.
//!
//! Where the policy runs on a node, its actor loads the roles in other processes itself
//! ([`PolicyRequest::PushWeights`]), so the bytes cross the wire once and this process
//! never holds a copy of the model (a 7B model in bf16 would be 14 GB here). The roles
//! in this process, those the policy's node failed to load, every role with
//! `rollout.weight_sync = "relay"` and every role of a policy that cannot push (a
//! user's) get the weights from this process instead: two hops, as before.

use std::time::Duration;

use yatt_roles::{PolicyRequest, PolicyResponse, PushTarget, RoleRequest, RoleResponse};
use yatt_runtime::{ActorRef, CallError, Message};

use crate::controller::config::WeightSync;
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, PolicyRef, RolloutRef, SamplesRef};
use crate::controller::weights_ipc::variant_of;

const STAGE: &str = "initial_weight_sync";

/// The roles that still need the weights.
#[derive(Default)]
struct Left<'a> {
    rollouts: Vec<&'a RolloutRef>,
    policies: Vec<&'a PolicyRef>,
    reference: Option<&'a SamplesRef>,
}

impl Left<'_> {
    fn is_empty(&self) -> bool {
        self.rollouts.is_empty() && self.policies.is_empty() && self.reference.is_none()
    }
}

/// Pushes the first policy replica's weights (version 0) to every rollout, to the
/// reference and to the other replicas (see the module).
pub(crate) async fn initial_weight_sync(
    policies: &[PolicyRef],
    rollouts: &[RolloutRef],
    reference: Option<&SamplesRef>,
    mode: WeightSync,
    timeout: Duration,
) -> Result<(), ControllerError> {
    let all = Left {
        rollouts: rollouts.iter().collect(),
        policies: policies[1..].iter().collect(),
        reference,
    };
    let left = if policies[0].is_local() || mode == WeightSync::Relay {
        all
    } else {
        push_from_policy(&policies[0], all, timeout).await?
    };
    relay(&policies[0], left, timeout).await
}

/// Has the policy's actor load the roles of `all` in other processes; answers the
/// roles it did not load.
async fn push_from_policy<'a>(
    policy: &PolicyRef,
    all: Left<'a>,
    timeout: Duration,
) -> Result<Left<'a>, ControllerError> {
    // A role in this process may be reachable from this process only
    // (`Node::spawn_local`), and its load moves no bytes over the wire anyway.
    let mut left = Left::default();
    let mut to = Vec::new();
    for r in all.rollouts {
        match r.is_local() {
            true => left.rollouts.push(r),
            false => to.push((PushTarget::Rollout(r.id().clone()), Pending::Rollout(r))),
        }
    }
    for p in all.policies {
        match p.is_local() {
            true => left.policies.push(p),
            false => to.push((PushTarget::Policy(p.id().clone()), Pending::Policy(p))),
        }
    }
    if let Some(r) = all.reference {
        match r.is_local() {
            true => left.reference = Some(r),
            false => to.push((PushTarget::Reference(r.id().clone()), Pending::Reference(r))),
        }
    }
    if to.is_empty() {
        return Ok(left);
    }
    let request = PolicyRequest::PushWeights {
        to: to.iter().map(|(t, _)| t.clone()).collect(),
        timeout,
    };
    // The export and the loads each have the sync's deadline, as over two hops; the
    // margin lets the policy's answer about a late role arrive before this one.
    let whole = timeout * 2 + timeout / 4;
    let report = match policy.ask(RoleRequest::Serve(request), whole).await {
        Ok(RoleResponse::Served(PolicyResponse::Pushed(report))) => report,
        Ok(RoleResponse::Served(PolicyResponse::PushUnavailable(why))) => {
            tracing::info!(reason = %why, "initial weight sync: the policy cannot send its weights itself, so they go through this process");
            return Ok(everything(left, to));
        }
        // A user's policy actor that does not know the request: the two hops.
        Err(CallError::Handler { error, .. }) => {
            tracing::warn!(error = %error, "initial weight sync: the policy refused PushWeights, so the weights go through this process");
            return Ok(everything(left, to));
        }
        Ok(RoleResponse::Served(other)) => {
            return Err(protocol("policy", "PushWeights", variant_of(&other)))
        }
        Ok(other) => return Err(protocol("policy", "PushWeights", variant(&other))),
        Err(source) => return Err(call("policy")(source)),
    };
    let asked = to.len();
    let loaded = asked - report.failed.len();
    tracing::info!(
        bytes = report.bytes,
        "initial weight sync: the policy's node loaded {loaded} of {asked} roles in other processes itself (one hop)"
    );
    for (target, pending) in to {
        let Some((_, e)) = report.failed.iter().find(|(id, _)| id == target.id()) else {
            continue;
        };
        // The policy's node may not reach a role this one does: it gets the weights from
        // here, and that load's failure is the job's error.
        tracing::warn!(role = %target.id(), error = %e, "initial weight sync: the policy's node could not load this role, so it gets the weights through this process; set rollout.weight_sync = \"relay\" if the policy's node cannot reach the other nodes");
        left.add(pending);
    }
    Ok(left)
}

/// A role the policy was asked to load.
enum Pending<'a> {
    Rollout(&'a RolloutRef),
    Policy(&'a PolicyRef),
    Reference(&'a SamplesRef),
}

impl<'a> Left<'a> {
    fn add(&mut self, pending: Pending<'a>) {
        match pending {
            Pending::Rollout(r) => self.rollouts.push(r),
            Pending::Policy(p) => self.policies.push(p),
            Pending::Reference(r) => self.reference = Some(r),
        }
    }
}

fn everything<'a>(mut left: Left<'a>, to: Vec<(PushTarget, Pending<'a>)>) -> Left<'a> {
    for (_, pending) in to {
        left.add(pending);
    }
    left
}

/// Exports the policy's weights here and loads them into every role of `left`.
async fn relay(
    policy: &PolicyRef,
    left: Left<'_>,
    timeout: Duration,
) -> Result<(), ControllerError> {
    if left.is_empty() {
        return Ok(());
    }
    let update = match policy
        .ask(RoleRequest::Serve(PolicyRequest::ExportWeights), timeout)
        .await
        .map_err(call("policy"))?
    {
        RoleResponse::Served(PolicyResponse::Weights(u)) => u,
        other => return Err(protocol("policy", "ExportWeights", variant(&other))),
    };
    for r in left.rollouts {
        load(r, update.clone(), "rollout", timeout).await?;
    }
    for p in left.policies {
        load(p, update.clone(), "policy", timeout).await?;
    }
    if let Some(r) = left.reference {
        load(r, update, "reference", timeout).await?;
    }
    Ok(())
}

async fn load<Req, Resp>(
    role: &ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    update: yatt_roles::WeightsUpdate,
    name: &'static str,
    timeout: Duration,
) -> Result<(), ControllerError>
where
    RoleRequest<Req>: Message,
    RoleResponse<Resp>: Message,
{
    match role
        .ask(RoleRequest::LoadWeights(update), timeout)
        .await
        .map_err(call(name))?
    {
        RoleResponse::Done => Ok(()),
        other => Err(protocol(name, "LoadWeights", variant(&other))),
    }
}

fn call(role: &'static str) -> impl Fn(CallError) -> ControllerError {
    move |source| ControllerError::Call {
        step: 0,
        stage: STAGE,
        role,
        source,
    }
}

fn protocol(role: &'static str, asked: &'static str, got: String) -> ControllerError {
    ControllerError::Protocol {
        step: 0,
        role,
        asked,
        got,
    }
}
