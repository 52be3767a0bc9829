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

use yatt_roles::{
    PolicyRequest, PolicyResponse, PushTarget, RoleRequest, RoleResponse, WeightsUpdate,
};
use yatt_runtime::{ActorRef, CallError, Message};

use crate::controller::config::WeightSync;
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, PolicyRef, RolloutRef, SamplesRef};
use crate::controller::weights_direct::push_deadline;
use crate::controller::weights_ipc::variant_of;

const STAGE: &str = "initial_weight_sync";

/// A role that takes the first weights.
#[derive(Clone, Copy)]
enum Target<'a> {
    Rollout(&'a RolloutRef),
    Policy(&'a PolicyRef),
    Reference(&'a SamplesRef),
}

impl Target<'_> {
    fn is_local(&self) -> bool {
        match self {
            Target::Rollout(r) => r.is_local(),
            Target::Policy(p) => p.is_local(),
            Target::Reference(r) => r.is_local(),
        }
    }

    /// How the policy's actor is asked to load it.
    fn push_target(&self) -> PushTarget {
        match self {
            Target::Rollout(r) => PushTarget::Rollout(r.id().clone()),
            Target::Policy(p) => PushTarget::Policy(p.id().clone()),
            Target::Reference(r) => PushTarget::Reference(r.id().clone()),
        }
    }

    /// Loads `update` from this process.
    async fn load(&self, update: WeightsUpdate, timeout: Duration) -> Result<(), ControllerError> {
        match self {
            Target::Rollout(r) => load(*r, update, "rollout", timeout).await,
            Target::Policy(p) => load(*p, update, "policy", timeout).await,
            Target::Reference(r) => load(*r, update, "reference", timeout).await,
        }
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
    let all: Vec<Target> = (rollouts.iter().map(Target::Rollout))
        .chain(policies[1..].iter().map(Target::Policy))
        .chain(reference.map(Target::Reference))
        .collect();
    let left = if policies[0].is_local() || mode == WeightSync::Relay {
        all
    } else {
        push_from_policy(&policies[0], all, timeout).await?
    };
    relay(&policies[0], &left, timeout).await
}

/// Has the policy's actor load the roles of `all` in other processes; answers the
/// roles it did not load.
async fn push_from_policy<'a>(
    policy: &PolicyRef,
    all: Vec<Target<'a>>,
    timeout: Duration,
) -> Result<Vec<Target<'a>>, ControllerError> {
    // A role in this process may be reachable from this process only
    // (`Node::spawn_local`), and its load moves no bytes over the wire anyway.
    let (mut left, to): (Vec<Target>, Vec<Target>) = all.into_iter().partition(Target::is_local);
    if to.is_empty() {
        return Ok(left);
    }
    let request = PolicyRequest::PushWeights {
        to: to.iter().map(Target::push_target).collect(),
        timeout,
    };
    let answer = policy
        .ask(RoleRequest::Serve(request), push_deadline(timeout))
        .await;
    let report = match answer {
        Ok(RoleResponse::Served(PolicyResponse::Pushed(report))) => report,
        Ok(RoleResponse::Served(PolicyResponse::PushUnavailable(why))) => {
            tracing::info!(reason = %why, "initial weight sync: the policy cannot send its weights itself, so they go through this process");
            left.extend(to);
            return Ok(left);
        }
        // A user's policy actor that does not know the request: the two hops.
        Err(CallError::Handler { error, .. }) => {
            tracing::warn!(error = %error, "initial weight sync: the policy refused PushWeights, so the weights go through this process");
            left.extend(to);
            return Ok(left);
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
    for target in to {
        let id = target.push_target();
        let Some((_, e)) = report.failed.iter().find(|(failed, _)| failed == id.id()) else {
            continue;
        };
        // The policy's node may not reach a role this one does: it gets the weights from
        // here, and that load's failure is the job's error.
        tracing::warn!(role = %id.id(), error = %e, "initial weight sync: the policy's node could not load this role, so it gets the weights through this process; set rollout.weight_sync = \"relay\" if the policy's node cannot reach the other nodes");
        left.push(target);
    }
    Ok(left)
}

/// Exports the policy's weights here and loads them into every role of `left`.
async fn relay(
    policy: &PolicyRef,
    left: &[Target<'_>],
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
    for target in left {
        target.load(update.clone(), timeout).await?;
    }
    Ok(())
}

async fn load<Req, Resp>(
    role: &ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    update: WeightsUpdate,
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
