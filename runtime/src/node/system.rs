//! Serving and sending the system protocol between nodes.

use std::sync::atomic::Ordering;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::state::Node;
use crate::actor::{CallError, ExitReason};
use crate::addr::ActorName;
use crate::directory::{Change, DirectoryError, Liveness};
use crate::message::{Message, Wire};
use crate::transport::Target;

impl Node {
    pub(super) async fn system_call(
        &self,
        node: &str,
        req: SysRequest,
    ) -> Result<SysResponse, NodeError> {
        let wire = req
            .into_wire()
            .map_err(|e| CallError::Codec(e.to_string()))?;
        let reply = self
            .inner
            .transport
            .ask(node, Target::System, wire, self.inner.config.system_timeout)
            .await?;
        Ok(SysResponse::from_wire(reply).map_err(|e| CallError::Codec(e.to_string()))?)
    }

    pub(super) async fn system_tell(&self, node: &str, req: SysRequest) {
        let Ok(wire) = req.into_wire() else { return };
        if let Err(e) = self
            .inner
            .transport
            .tell(node, Target::System, wire, true)
            .await
        {
            tracing::debug!(%node, error = %e, "system message not sent");
        }
    }

    pub(super) async fn system_ask(&self, from: &str, wire: Wire) -> Result<Wire, CallError> {
        let req = SysRequest::from_wire(wire).map_err(|e| CallError::Codec(e.to_string()))?;
        self.handle_system(from, req)
            .await
            .into_wire()
            .map_err(|e| CallError::Codec(e.to_string()))
    }

    pub(super) async fn handle_system(&self, from: &str, req: SysRequest) -> SysResponse {
        let dir = &self.inner.directory;
        match req {
            SysRequest::Join(info) => {
                if !self.is_leader() {
                    return SysResponse::Error(format!(
                        "not the leader; join through {}",
                        self.leader()
                    ));
                }
                if info.name != from {
                    return SysResponse::Error(format!(
                        "certificate says {from:?} but join says {:?}",
                        info.name
                    ));
                }
                self.lock_detector()
                    .heard(&info.name, tokio::time::Instant::now());
                match dir.apply(Change::NodeUp(info)) {
                    Ok(Some(update)) => self.broadcast(update).await,
                    Ok(None) => {}
                    Err(e) => return SysResponse::Error(e.to_string()),
                }
                SysResponse::Directory(dir.snapshot())
            }
            SysRequest::Heartbeat { node, incarnation } => {
                let known = dir.read(|d| {
                    d.node(&node).is_some_and(|e| {
                        e.liveness == Liveness::Alive && e.info.incarnation == incarnation
                    })
                });
                if known || node == self.leader() {
                    self.lock_detector()
                        .heard(&node, tokio::time::Instant::now());
                }
                SysResponse::Ack
            }
            SysRequest::Update(update) => {
                if let Err(DirectoryError::Gap { .. }) = dir.apply_update(&update) {
                    let node = self.clone();
                    tokio::spawn(async move { node.resync().await });
                }
                self.follow_update(&update);
                SysResponse::Ack
            }
            SysRequest::Propose(change) => {
                if !self.is_leader() {
                    return SysResponse::Error("not the leader".into());
                }
                match dir.apply(change) {
                    Ok(Some(update)) => {
                        self.broadcast(update).await;
                        SysResponse::Ack
                    }
                    Ok(None) => SysResponse::Ack,
                    Err(e) => SysResponse::Error(e.to_string()),
                }
            }
            SysRequest::Snapshot => SysResponse::Directory(dir.snapshot()),
            SysRequest::Spawn {
                role,
                replica,
                args,
                linked,
            } => {
                if self.inner.stopping.load(Ordering::Acquire) {
                    return SysResponse::Error("node is shutting down".into());
                }
                let Some(factory) = self.inner.factories.get(&role).cloned() else {
                    return SysResponse::Error(format!(
                        "no factory:{}",
                        self.factory_roles().join(",")
                    ));
                };
                let replica = replica.unwrap_or_else(|| self.next_free_replica(&role));
                let name = match ActorName::new(self.name(), &role, replica) {
                    Ok(n) => n,
                    Err(e) => return SysResponse::Error(e.to_string()),
                };
                match factory(self, name, &args).await {
                    Ok(id) => {
                        if linked && from != self.name() {
                            if let Some(h) = self.lock_hosted().get_mut(&id.name) {
                                h.owner = Some(from.to_string());
                            }
                        }
                        // Answer once the leader has the registration, so the caller
                        // can resolve it right away.
                        let want = id.clone();
                        dir.wait_until(self.inner.config.system_timeout, |d| {
                            d.resolve(&want.name) == Some(&want)
                        })
                        .await;
                        SysResponse::Spawned(id)
                    }
                    Err(e) => SysResponse::Error(e),
                }
            }
            SysRequest::Leave { node } => {
                if self.is_leader() {
                    self.lock_detector().forget(&node);
                    let change = Change::NodeDown {
                        node,
                        reason: ExitReason::Normal,
                    };
                    if let Ok(Some(update)) = dir.apply(change) {
                        self.broadcast(update).await;
                    }
                }
                SysResponse::Ack
            }
        }
    }

    pub(super) fn next_free_replica(&self, role: &str) -> u32 {
        loop {
            let r = self.inner.next_replica.fetch_add(1, Ordering::Relaxed);
            let taken = ActorName::new(self.name(), role, r)
                .map(|n| self.lock_hosted().contains_key(&n))
                .unwrap_or(false);
            if !taken {
                return r;
            }
        }
    }
}
