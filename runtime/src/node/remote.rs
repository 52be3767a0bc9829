//! Actors elsewhere: typed references, monitoring, resolution by name, remote spawn.

use std::marker::PhantomData;
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use super::config::NodeError;
use super::dispatch::RemoteActor;
use super::protocol::{SpawnArgs, SysRequest, SysResponse};
use super::state::{Inbox, Node};
use crate::actor::{ActorError, ActorRef, CallError, ExitReason};
use crate::addr::{next_incarnation, validate_segment, ActorId, ActorName};
use crate::directory::{Directory, Liveness};
use crate::message::Message;
use crate::transport::Target;

impl Node {
    /// A typed reference to an actor by identity: in-process when it lives here, over
    /// QUIC otherwise. Types are checked for local actors; for remote ones a mismatch
    /// surfaces as a codec error on the first call.
    pub fn actor_ref<Req: Message, Resp: Message>(
        &self,
        id: &ActorId,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        if id.name.node == self.name() {
            let hosted = self.lock_hosted();
            let h = hosted
                .get(&id.name)
                .filter(|h| h.id == *id)
                .ok_or_else(|| CallError::Stale {
                    target: id.clone(),
                    current: hosted.get(&id.name).map(|h| h.id.incarnation),
                })?;
            return h
                .typed
                .downcast_ref::<ActorRef<Req, Resp>>()
                .cloned()
                .ok_or(NodeError::WrongType {
                    id: id.clone(),
                    req: std::any::type_name::<Req>(),
                    resp: std::any::type_name::<Resp>(),
                });
        }
        Ok(ActorRef::remote(
            id.clone(),
            Arc::new(RemoteActor {
                node: self.clone(),
                id: id.clone(),
                _types: PhantomData,
            }),
        ))
    }

    /// Waits until the directory marks `id` dead and returns why: its own exit, or
    /// [`ExitReason::NodeDown`] when its node died (missed heartbeats) or left. This is
    /// how a supervisor hears about children on other nodes. Resolves at once if `id`
    /// is already dead or was replaced.
    pub async fn monitor(&self, id: &ActorId) -> ExitReason {
        let (snapshot, mut events) = self.inner.directory.subscribe();
        let check = |d: &Directory| -> Option<ExitReason> {
            match d.actor(&id.name) {
                Some(e) if e.id == *id => match &e.liveness {
                    Liveness::Alive => None,
                    Liveness::Dead(reason) => Some(reason.clone()),
                },
                Some(e) if e.id.incarnation > id.incarnation => Some(ExitReason::NodeDown(
                    format!("replaced by incarnation {}", e.id.incarnation),
                )),
                // Not registered yet (or unknown): wait for news.
                _ => match d.node(&id.name.node) {
                    Some(n) if n.liveness != Liveness::Alive => Some(ExitReason::NodeDown(
                        format!("node {} is down", id.name.node),
                    )),
                    _ => None,
                },
            }
        };
        if let Some(r) = check(&snapshot) {
            return r;
        }
        loop {
            match events.recv().await {
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {
                    if let Some(r) = self.inner.directory.read(check) {
                        return r;
                    }
                }
                Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                    return ExitReason::NodeDown("this node stopped".into());
                }
            }
        }
    }

    /// Resolves a name through the directory to a typed reference of its live incarnation.
    pub fn resolve<Req: Message, Resp: Message>(
        &self,
        name: &ActorName,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        let id = self
            .inner
            .directory
            .read(|d| d.resolve(name).cloned())
            .ok_or_else(|| CallError::Stale {
                target: ActorId {
                    name: name.clone(),
                    incarnation: 0,
                },
                current: None,
            })?;
        self.actor_ref(&id)
    }

    /// Asks `node` to spawn `role` from its factory registry with `args`; returns a
    /// typed reference once the actor runs and is in the directory. A spawn that does
    /// not return the actor (its `timeout` passed, or this future was dropped) is
    /// cancelled on `node`, which releases the actor if it started it: a caller that
    /// gave up leaves nothing running.
    pub async fn spawn_remote<Req: Message, Resp: Message, Args: Serialize>(
        &self,
        node: &str,
        role: &str,
        args: &Args,
        timeout: Duration,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        self.spawn_remote_as(node, role, args, timeout, false).await
    }

    /// Like [`Node::spawn_remote`], but the actor lives only as long as this node is in
    /// the cluster: when this node leaves or is declared dead, the hosting node drops
    /// its references to the actor, which then stops once its in-flight requests are
    /// done. A driver that finishes or crashes leaves nothing running behind it.
    pub async fn spawn_remote_linked<Req: Message, Resp: Message, Args: Serialize>(
        &self,
        node: &str,
        role: &str,
        args: &Args,
        timeout: Duration,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        self.spawn_remote_as(node, role, args, timeout, true).await
    }

    /// Like [`Node::spawn_remote_linked`], with the arguments as a JSON document of the
    /// factory's argument type: for a caller that does not link the role's type (a job
    /// config naming a user's role). Arguments that do not fit are refused by the hosting
    /// node, which says what did not fit.
    pub async fn spawn_remote_linked_json<Req: Message, Resp: Message>(
        &self,
        node: &str,
        role: &str,
        args_json: &str,
        timeout: Duration,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        let args = SpawnArgs::Json(args_json.to_string());
        self.spawn_remote_with(node, role, args, timeout, true)
            .await
    }

    pub(super) async fn spawn_remote_as<Req: Message, Resp: Message, Args: Serialize>(
        &self,
        node: &str,
        role: &str,
        args: &Args,
        timeout: Duration,
        linked: bool,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        let args = postcard::to_stdvec(args).map_err(|e| CallError::Codec(e.to_string()))?;
        self.spawn_remote_with(node, role, SpawnArgs::Postcard(args), timeout, linked)
            .await
    }

    async fn spawn_remote_with<Req: Message, Resp: Message>(
        &self,
        node: &str,
        role: &str,
        args: SpawnArgs,
        timeout: Duration,
        linked: bool,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        validate_segment("role", role)?;
        let ticket = next_incarnation();
        let req = SysRequest::Spawn {
            role: role.to_string(),
            replica: None,
            args,
            linked,
            ticket,
        };
        // Until this returns the actor, giving up (a timeout, or this future dropped)
        // undoes the spawn on its node.
        let mut undo = CancelOnDrop {
            node: Some(self.clone()),
            host: node.to_string(),
            ticket,
        };
        let answer = if node == self.name() {
            self.handle_system(self.name(), self.info().kind, req).await
        } else {
            let wire = req
                .into_wire()
                .map_err(|e| CallError::Codec(e.to_string()))?;
            let reply = self
                .inner
                .transport
                .ask(node, Target::System, wire, timeout)
                .await?;
            SysResponse::from_wire(reply).map_err(|e| CallError::Codec(e.to_string()))?
        };
        let id = match answer {
            SysResponse::Spawned(id) => id,
            // Refused there: nothing to undo.
            SysResponse::Error(e) => {
                undo.node = None;
                return Err(self.spawn_error(node, role, e));
            }
            other => return Err(self.spawn_error(node, role, format!("{other:?}"))),
        };
        // Return once this node's directory replica shows it, so resolve() works at once.
        let want = id.clone();
        self.inner
            .directory
            .wait_until(timeout, |d| d.resolve(&want.name) == Some(&want))
            .await;
        let actor = self.actor_ref(&id);
        if actor.is_ok() {
            undo.node = None;
        }
        actor
    }

    /// Undoes this node's spawn `ticket` on `host` (see `spawn_tickets.rs`).
    fn cancel_spawn(&self, host: &str, ticket: u64) {
        if host == self.name() {
            return self.cancel_spawn_of(self.name(), ticket);
        }
        // Dropped outside a runtime (the process is ending): the host releases a linked
        // actor when this node leaves.
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            let (node, host) = (self.clone(), host.to_string());
            rt.spawn(async move {
                node.system_tell(&host, SysRequest::CancelSpawn { ticket })
                    .await
            });
        }
    }

    pub(super) fn spawn_error(&self, node: &str, role: &str, e: String) -> NodeError {
        if let Some(known) = e.strip_prefix("no factory:") {
            return NodeError::NoFactory {
                node: node.to_string(),
                role: role.to_string(),
                known: known
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(String::from)
                    .collect(),
            };
        }
        NodeError::Call(CallError::Handler {
            target: ActorId {
                name: ActorName {
                    node: node.to_string(),
                    role: role.to_string(),
                    replica: 0,
                },
                incarnation: 0,
            },
            error: ActorError::Failed(e),
        })
    }

    pub(super) fn inbox(&self, id: &ActorId) -> Result<Arc<dyn Inbox>, CallError> {
        let hosted = self.lock_hosted();
        match hosted.get(&id.name) {
            Some(h) if h.id == *id => h.inbox.clone().ok_or_else(|| CallError::Stale {
                target: id.clone(),
                current: None,
            }),
            Some(h) => Err(CallError::Stale {
                target: id.clone(),
                current: Some(h.id.incarnation),
            }),
            None => Err(CallError::Stale {
                target: id.clone(),
                current: None,
            }),
        }
    }
}

/// A remote spawn in flight: dropped before it is disarmed (`node = None`), it cancels
/// the spawn on its host.
struct CancelOnDrop {
    node: Option<Node>,
    host: String,
    ticket: u64,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if let Some(node) = self.node.take() {
            node.cancel_spawn(&self.host, self.ticket);
        }
    }
}
