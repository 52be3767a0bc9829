//! Weight sync in one hop: the actor that hosts a policy on a node exports its weights
//! in process and loads them into the rollouts itself ([`PolicyRequest::PushWeights`]),
//! and, for a job's first sync, into the reference and the other policy replicas.
//!
//! Without it a controller in another process asks the policy for its buckets and sends
//! them on: every byte crosses the wire twice (policy → controller → rollout), and the
//! controller's process holds a copy. The role itself cannot send (it runs on its own
//! thread and knows no node), so the actor around it does.
//!
//! Only the export holds the actor. The loads run as a deferred answer
//! ([`Handled::Later`]), so the policy serves other callers (another controller's
//! requests, its own next step) while the rollouts load; one export is held at a time.
//! A push that comes while another's loads are in flight, with no request since that
//! may have changed the weights (every head pushing after the one shared update), loads
//! the same export at once; a push of changed weights waits for the held export's loads
//! to end before it exports its own.

use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use yatt_runtime::{Actor, ActorError, Context, DeviceClaim, Handled, WeakNode};

use crate::builtin::policy::{load_all, PolicyRequest, PolicyResponse, PushReport, PushTarget};
use crate::role::{Role, RoleActor, RoleRequest, RoleResponse, WeightsUpdate};

/// The actor around a policy role on a node: it serves every request as
/// [`RoleActor`] does, and also [`PolicyRequest::PushWeights`].
pub struct PushingPolicy<R: Role<Request = PolicyRequest, Response = PolicyResponse>> {
    role: RoleActor<R>,
    /// Weak: the node owns its actors, so a strong handle would keep it alive.
    node: WeakNode,
    /// One permit: the export whose loads are in flight holds it.
    loading: Arc<Semaphore>,
    /// Counts the requests that may have changed the weights ([`changes_weights`]).
    generation: u64,
    /// The export whose loads are in flight, and the generation it was made at: a push
    /// at the same generation loads it too. Weak, so the export's bytes are freed as its
    /// last push's loads end, not when the next request comes.
    in_flight: Option<(u64, Weak<HeldExport>)>,
}

/// An export the loads of one or more pushes share. Dropped with the last of them,
/// which frees the bytes and lets the next export start.
struct HeldExport {
    update: WeightsUpdate,
    _permit: OwnedSemaphorePermit,
}

/// Whether `request` may change the policy's weights, which ends the sharing of an
/// export in flight. Unknown to be harmless means it may: a user's role behind
/// `PushingPolicy` may give any request any effect, so only the protocol's reads pass.
fn changes_weights(request: &RoleRequest<PolicyRequest>) -> bool {
    !matches!(
        request,
        RoleRequest::Profile
            | RoleRequest::Drain
            | RoleRequest::Serve(
                PolicyRequest::PushWeights { .. }
                    | PolicyRequest::OldLogProbs(_)
                    | PolicyRequest::ExportWeights
                    | PolicyRequest::ExportLocalWeights
                    | PolicyRequest::ExportDeviceWeights
                    | PolicyRequest::ExportState
                    | PolicyRequest::SaveCheckpoint(_)
                    | PolicyRequest::RingInbox
            )
    )
}

impl<R: Role<Request = PolicyRequest, Response = PolicyResponse>> PushingPolicy<R> {
    /// Wraps a started policy role; `node` is the node the actor is spawned on.
    pub fn new(role: RoleActor<R>, node: WeakNode) -> Self {
        PushingPolicy {
            role,
            node,
            loading: Arc::new(Semaphore::new(1)),
            generation: 0,
            in_flight: None,
        }
    }

    /// The export in flight, if the weights have not changed since it was made.
    fn shared_export(&self) -> Option<Arc<HeldExport>> {
        match &self.in_flight {
            Some((generation, held)) if *generation == self.generation => held.upgrade(),
            _ => None,
        }
    }

    /// Exports the weights once the previous export's loads have ended.
    async fn export(
        &mut self,
        timeout: Duration,
        ctx: &mut Context,
    ) -> Result<Arc<HeldExport>, ActorError> {
        let permit = tokio::time::timeout(timeout, self.loading.clone().acquire_owned());
        let permit: OwnedSemaphorePermit = match permit.await {
            Err(_) => {
                return Err(ActorError::Failed(format!(
                    "the previous push was still loading the rollouts after the sync's {timeout:?}"
                )))
            }
            Ok(Err(closed)) => return Err(ActorError::Failed(format!("push: {closed}"))),
            Ok(Ok(permit)) => permit,
        };
        let export = self
            .role
            .handle(RoleRequest::Serve(PolicyRequest::ExportWeights), ctx);
        let update = match tokio::time::timeout(timeout, export).await {
            Err(_) => {
                return Err(ActorError::Failed(format!(
                    "exporting the weights took longer than the sync's {timeout:?}"
                )))
            }
            Ok(Ok(RoleResponse::Served(PolicyResponse::Weights(u)))) => u,
            Ok(Ok(_)) => {
                return Err(ActorError::Failed(
                    "the policy answered ExportWeights with something other than weights".into(),
                ))
            }
            Ok(Err(e)) => return Err(e),
        };
        let held = Arc::new(HeldExport {
            update,
            _permit: permit,
        });
        self.in_flight = Some((self.generation, Arc::downgrade(&held)));
        Ok(held)
    }

    /// Exports the weights (the part that needs the role) and gives the loads into the
    /// rollouts as a future that needs neither.
    async fn start_push(
        &mut self,
        to: Vec<PushTarget>,
        timeout: Duration,
        ctx: &mut Context,
    ) -> Result<impl Future<Output = PushReport> + Send + 'static, ActorError> {
        let held = match self.shared_export() {
            Some(held) => held,
            None => self.export(timeout, ctx).await?,
        };
        let node = self
            .node
            .upgrade()
            .ok_or_else(|| ActorError::Unavailable("the policy's node has stopped".into()))?;
        let (version, bytes) = (held.update.version, held.update.bytes());
        let loads = load_all(node, held.update.clone(), to, timeout);
        Ok(async move {
            let failed = loads.await;
            drop(held);
            PushReport {
                version,
                bytes,
                failed,
            }
        })
    }
}

impl<R: Role<Request = PolicyRequest, Response = PolicyResponse>> Actor for PushingPolicy<R> {
    type Request = RoleRequest<PolicyRequest>;
    type Response = RoleResponse<PolicyResponse>;

    async fn handle(
        &mut self,
        request: Self::Request,
        ctx: &mut Context,
    ) -> Result<Self::Response, ActorError> {
        self.generation += u64::from(changes_weights(&request));
        match request {
            RoleRequest::Serve(PolicyRequest::PushWeights { to, timeout }) => {
                let report = self.start_push(to, timeout, ctx).await?.await;
                Ok(RoleResponse::Served(PolicyResponse::Pushed(report)))
            }
            other => self.role.handle(other, ctx).await,
        }
    }

    async fn handle_deferred(
        &mut self,
        request: Self::Request,
        ctx: &mut Context,
    ) -> Handled<Self::Response> {
        self.generation += u64::from(changes_weights(&request));
        match request {
            RoleRequest::Serve(PolicyRequest::PushWeights { to, timeout }) => {
                match self.start_push(to, timeout, ctx).await {
                    Ok(loads) => Handled::Later(Box::pin(async move {
                        Ok(RoleResponse::Served(PolicyResponse::Pushed(loads.await)))
                    })),
                    Err(e) => Handled::Now(Err(e)),
                }
            }
            other => Handled::Now(self.role.handle(other, ctx).await),
        }
    }

    async fn stopped(&mut self) {
        self.role.stopped().await;
    }

    fn device_claim(&self) -> Option<DeviceClaim> {
        self.role.device_claim()
    }
}
