//! Loading weight updates into roles through a node: the policy's one-hop push
//! ([`crate::PushingPolicy`]) and a sharded policy's ranks, each sending its own slice
//! ([`SlicePusher`]), share it.

use std::time::Duration;

use yatt_runtime::{ActorError, ActorId, CallError, Message, WeakNode};

use super::protocol::{PolicyRequest, PolicyResponse, PushReport, PushTarget};
use crate::builtin::rollout::{RolloutRequest, RolloutResponse};
use crate::role::{RoleRequest, RoleResponse, WeightsUpdate};
use crate::sample::Sample;

/// Loads weight updates into roles from a thread outside the node's runtime: a rank of
/// a sharded policy sends its own slice this way ([`crate::RankRequest::PushSlice`]),
/// so no process gathers the model to sync it.
#[derive(Clone)]
pub struct SlicePusher {
    node: WeakNode,
    runtime: tokio::runtime::Handle,
}

impl SlicePusher {
    /// Loads through `node` (the one the rank's actor is on), on its `runtime`.
    pub fn new(node: WeakNode, runtime: tokio::runtime::Handle) -> Self {
        SlicePusher { node, runtime }
    }

    /// Loads `update` into every role of `to` at once, each within `timeout`; blocks
    /// the calling thread (never one of the runtime's) until all have answered.
    pub fn push(&self, update: WeightsUpdate, to: &[PushTarget], timeout: Duration) -> PushReport {
        let (version, bytes) = (update.version, update.bytes());
        let Some(node) = self.node.upgrade() else {
            let gone = |t: &PushTarget| {
                let e = ActorError::Unavailable("the policy rank's node has stopped".into());
                (
                    t.id().clone(),
                    CallError::Handler {
                        target: t.id().clone(),
                        error: e,
                    },
                )
            };
            return PushReport {
                version,
                bytes,
                failed: to.iter().map(gone).collect(),
            };
        };
        let failed = self
            .runtime
            .block_on(load_all(node, update, to.to_vec(), timeout));
        PushReport {
            version,
            bytes,
            failed,
        }
    }
}

/// Loads `update` into every role of `to` at once, each within `timeout`: the roles
/// that did not load it, and why.
pub(crate) async fn load_all(
    node: yatt_runtime::Node,
    update: WeightsUpdate,
    to: Vec<PushTarget>,
    timeout: Duration,
) -> Vec<(ActorId, CallError)> {
    let loads = to.into_iter().map(|target| {
        let (node, update) = (&node, update.clone());
        async move {
            load_into(node, &target, update, timeout)
                .await
                .err()
                .map(|e| (target.id().clone(), e))
        }
    });
    let failed = futures::future::join_all(loads).await;
    failed.into_iter().flatten().collect()
}

/// Loads `update` into `target`, by the message types of its kind.
async fn load_into(
    node: &yatt_runtime::Node,
    target: &PushTarget,
    update: WeightsUpdate,
    timeout: Duration,
) -> Result<(), CallError> {
    match target {
        PushTarget::Rollout(id) => {
            load::<RolloutRequest, RolloutResponse>(node, id, update, timeout).await
        }
        PushTarget::Reference(id) => {
            load::<Vec<Sample>, Vec<Sample>>(node, id, update, timeout).await
        }
        PushTarget::Policy(id) => {
            load::<PolicyRequest, PolicyResponse>(node, id, update, timeout).await
        }
    }
}

/// Loads `update` into the role `id`, whose actor serves `RoleRequest<Req>`.
async fn load<Req, Resp>(
    node: &yatt_runtime::Node,
    id: &ActorId,
    update: WeightsUpdate,
    timeout: Duration,
) -> Result<(), CallError>
where
    RoleRequest<Req>: Message,
    RoleResponse<Resp>: Message,
{
    let role = node
        .actor_ref::<RoleRequest<Req>, RoleResponse<Resp>>(id)
        .map_err(|e| match e {
            yatt_runtime::NodeError::Call(e) => e,
            other => handler_error(id, other.to_string()),
        })?;
    match role.ask(RoleRequest::LoadWeights(update), timeout).await? {
        RoleResponse::Done => Ok(()),
        _ => Err(handler_error(
            id,
            "the role answered LoadWeights with something other than Done".into(),
        )),
    }
}

fn handler_error(id: &ActorId, why: String) -> CallError {
    CallError::Handler {
        target: id.clone(),
        error: ActorError::Failed(why),
    }
}
