//! The glue between the transport and the node: routing peers' calls to hosted
//! actors, resolving peers' addresses, remote actor references, supervision hooks.

use std::marker::PhantomData;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::state::{Node, NodeInner};
use crate::actor::{ActorRef, BoxFuture, CallError, ExitReason, RemoteRoute, TellError};
use crate::addr::ActorId;
use crate::cert_kind::CertKind;
use crate::directory::Liveness;
use crate::membership::DeviceClaim;
use crate::message::{Message, Wire};
use crate::supervisor::Lifecycle;
use crate::transport::{Dispatch, PeerBook, Target};

pub(super) struct NodeDispatch(pub(super) std::sync::Weak<NodeInner>);
pub(super) struct NodeBook(pub(super) std::sync::Weak<NodeInner>);

impl PeerBook for NodeBook {
    fn lookup(&self, node: &str) -> Result<(SocketAddr, String), CallError> {
        let inner = self
            .0
            .upgrade()
            .ok_or_else(|| CallError::NodeDown { node: node.into() })?;
        inner.directory.read(|d| match d.node(node) {
            Some(e) if e.liveness == Liveness::Alive => Ok((e.info.addr, e.info.host_id.clone())),
            Some(_) => Err(CallError::NodeDown { node: node.into() }),
            None => Err(CallError::Transport {
                node: node.into(),
                reason: "unknown node (not in the directory)".into(),
            }),
        })
    }
}

impl Dispatch for NodeDispatch {
    fn ask(
        &self,
        from: &str,
        kind: CertKind,
        target: Target,
        wire: Wire,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<Wire, CallError>> {
        let Some(inner) = self.0.upgrade() else {
            return Box::pin(async {
                Err(CallError::Unavailable {
                    node: String::new(),
                    reason: "node stopped".into(),
                })
            });
        };
        let node = Node { inner };
        let from = from.to_string();
        Box::pin(async move {
            if node.inner.stopping.load(Ordering::Acquire) {
                return Err(CallError::Unavailable {
                    node: node.name().to_string(),
                    reason: "node is shutting down".into(),
                });
            }
            node.inner.in_flight.fetch_add(1, Ordering::AcqRel);
            let result = match target {
                Target::System => node.system_ask(&from, kind, wire).await,
                Target::Actor(id) => match node.inbox(&id) {
                    Ok(inbox) => inbox.ask(wire, timeout).await,
                    Err(e) => Err(e),
                },
                // The transport handles its own messages; none should reach here.
                Target::Transport => Err(CallError::Codec(
                    "transport message dispatched to the node".into(),
                )),
            };
            node.inner.in_flight.fetch_sub(1, Ordering::AcqRel);
            result
        })
    }

    fn tell(
        &self,
        from: &str,
        kind: CertKind,
        target: Target,
        wire: Wire,
    ) -> BoxFuture<'static, ()> {
        let Some(inner) = self.0.upgrade() else {
            return Box::pin(async {});
        };
        let node = Node { inner };
        let from = from.to_string();
        Box::pin(async move {
            match target {
                Target::System => {
                    let _ = node.system_ask(&from, kind, wire).await;
                }
                Target::Actor(id) => match node.inbox(&id) {
                    Ok(inbox) => inbox.tell(wire).await,
                    Err(e) => tracing::debug!(%id, error = %e, "dropped a tell"),
                },
                Target::Transport => {}
            }
        })
    }
}

pub(super) struct RemoteActor<Req, Resp> {
    pub(super) node: Node,
    pub(super) id: ActorId,
    pub(super) _types: PhantomData<fn(Req) -> Resp>,
}

impl<Req: Message, Resp: Message> RemoteRoute<Req, Resp> for RemoteActor<Req, Resp> {
    fn ask(&self, request: Req, timeout: Duration) -> BoxFuture<'static, Result<Resp, CallError>> {
        let (node, id) = (self.node.clone(), self.id.clone());
        Box::pin(async move {
            let wire = request
                .into_wire()
                .map_err(|e| CallError::Codec(e.to_string()))?;
            let t = &node.inner.transport;
            let reply = t
                .ask(&id.name.node, Target::Actor(id.clone()), wire, timeout)
                .await?;
            Resp::from_wire(reply).map_err(|e| CallError::Codec(e.to_string()))
        })
    }
    fn tell(&self, request: Req) -> BoxFuture<'static, Result<(), TellError<Req>>> {
        let (node, id) = (self.node.clone(), self.id.clone());
        Box::pin(async move {
            let t = &node.inner.transport;
            if let Err(e) = t.reachable(&id.name.node).await {
                return Err(TellError::Unreachable(request, e));
            }
            let wire = match request.into_wire() {
                Ok(w) => w,
                Err(e) => return Err(TellError::Lost(CallError::Codec(e.to_string()))),
            };
            t.tell(&id.name.node, Target::Actor(id.clone()), wire, false)
                .await
                .map_err(TellError::Lost)
        })
    }
}

/// Registers and unregisters supervised incarnations with the node.
pub(super) struct NodeHooks(pub(super) Node);

impl<Req: Message, Resp: Message> Lifecycle<Req, Resp> for NodeHooks {
    fn started(&self, actor: &ActorRef<Req, Resp>, claim: Option<&DeviceClaim>) {
        if let Err(e) = self.0.register(actor.clone(), claim.cloned()) {
            tracing::error!(actor = %actor.id(), error = %e, "could not register a restarted actor");
        }
    }
    fn exited(&self, id: &ActorId, reason: &ExitReason) {
        self.0.unregister(id, reason.clone());
    }
}
