//! The node's own actors: accessors, local spawn and supervision, registration in the
//! directory.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use super::builder::NodeBuilder;
use super::config::{NodeConfig, NodeError};
use super::dispatch::NodeHooks;
use super::protocol::{SysRequest, SysResponse};
use super::spawn_tickets::SpawnTickets;
use super::state::{Hosted, Node, TypedInbox, WeakNode};
use crate::actor::{spawn_with_id, Actor, ActorRef, ExitReason};
use crate::addr::{next_incarnation, ActorId, ActorName};
use crate::cert_kind::CertKind;
use crate::directory::{Change, DirectoryHandle};
use crate::membership::{DeviceClaim, Membership, NodeInfo};
use crate::message::Message;
use crate::supervisor::{supervise, RestartPolicy, Supervised};

impl Node {
    /// Starts building a node called `name` (also its certificate's name).
    pub fn builder(name: &str) -> NodeBuilder {
        NodeBuilder {
            name: name.to_string(),
            config: NodeConfig::default(),
            identity: None,
            dev_ca_dir: None,
            dev_kind: CertKind::Node,
            factories: HashMap::new(),
        }
    }

    /// A reference that does not keep this node alive.
    pub fn downgrade(&self) -> WeakNode {
        WeakNode(Arc::downgrade(&self.inner))
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// What this node reports to the cluster (its incarnation changes when it rejoins
    /// after being declared dead).
    pub fn info(&self) -> NodeInfo {
        self.inner
            .info
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Which life of this node the cluster knows.
    pub fn incarnation(&self) -> u64 {
        self.inner
            .info
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .incarnation
    }

    /// The address peers reach this node at.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// The address this node's endpoint is bound to: [`Node::addr`] unless it
    /// advertises another (behind NAT or a proxy).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.transport.local_addr()
    }

    /// Member, or rejoining after having been declared dead.
    pub fn membership(&self) -> Membership {
        self.inner.membership.borrow().clone()
    }

    /// Every change of [`Node::membership`] from now on.
    pub fn watch_membership(&self) -> tokio::sync::watch::Receiver<Membership> {
        self.inner.membership.subscribe()
    }

    /// The directory replica.
    pub fn directory(&self) -> &DirectoryHandle {
        &self.inner.directory
    }

    /// The node that leads the directory.
    pub fn leader(&self) -> String {
        self.lock_lead().leader.clone()
    }

    /// The directory leader's term: 1 for the founding seed, one more per fail-over.
    pub fn term(&self) -> u64 {
        self.lock_lead().term
    }

    /// Whether this node leads the directory. Not while it is still joining (term 0):
    /// a joining node names itself until it learns the leader, and must not take a
    /// join meanwhile (two nodes joining through each other would each admit the other).
    pub fn is_leader(&self) -> bool {
        self.lock_lead().held_by(self.name())
    }

    /// Transport counters.
    pub fn transport_stats(&self) -> &crate::transport::TransportStats {
        &self.inner.transport.stats
    }

    /// Roles this node can spawn on request.
    pub fn factory_roles(&self) -> Vec<String> {
        let mut v: Vec<String> = self.inner.factories.keys().cloned().collect();
        v.sort();
        v
    }

    /// The actors this node hosts now, in name order.
    pub fn hosted(&self) -> Vec<ActorId> {
        let mut v: Vec<ActorId> = self.lock_hosted().values().map(|h| h.id.clone()).collect();
        v.sort();
        v
    }

    /// The actors this node hosts now that hold devices, with what each holds, in name
    /// order: those only this process reaches ([`Node::spawn_local`]) too, which the
    /// directory does not list.
    pub fn hosted_claims(&self) -> Vec<(ActorId, DeviceClaim)> {
        let mut v: Vec<(ActorId, DeviceClaim)> = self
            .lock_hosted()
            .values()
            .filter_map(|h| Some((h.id.clone(), h.claim.clone()?)))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.inner.stopping.load(Ordering::Acquire)
    }

    /// The configuration the node runs with.
    pub fn config(&self) -> &NodeConfig {
        &self.inner.config
    }

    /// Requests being handled for peers right now.
    pub fn in_flight(&self) -> u64 {
        self.inner.in_flight.load(Ordering::Acquire)
    }

    /// Spawns an actor reachable from other nodes, as `this-node/role/replica`.
    pub fn spawn<A>(
        &self,
        role: &str,
        replica: u32,
        actor: A,
    ) -> Result<ActorRef<A::Request, A::Response>, NodeError>
    where
        A: Actor,
        A::Request: Message,
        A::Response: Message,
    {
        self.spawn_named(ActorName::new(self.name(), role, replica)?, actor)
    }

    pub(super) fn spawn_named<A>(
        &self,
        name: ActorName,
        actor: A,
    ) -> Result<ActorRef<A::Request, A::Response>, NodeError>
    where
        A: Actor,
        A::Request: Message,
        A::Response: Message,
    {
        self.check_free(&name)?;
        let id = ActorId {
            name,
            incarnation: next_incarnation(),
        };
        let claim = actor.device_claim();
        let running = spawn_with_id(id, actor, self.inner.config.mailbox_capacity);
        self.register(running.actor_ref.clone(), claim)?;
        let (node, id) = (self.clone(), running.actor_ref.id().clone());
        let exit = running.exit;
        tokio::spawn(async move {
            let reason = exit
                .await
                .unwrap_or_else(|e| ExitReason::Panicked(e.to_string()));
            node.unregister(&id, reason);
        });
        Ok(running.actor_ref)
    }

    /// Spawns an actor only this process can reach. Its messages need not be
    /// serializable: tensors and channels can move through its mailbox as they are.
    pub fn spawn_local<A: Actor>(
        &self,
        role: &str,
        replica: u32,
        actor: A,
    ) -> Result<ActorRef<A::Request, A::Response>, NodeError> {
        let name = ActorName::new(self.name(), role, replica)?;
        self.check_free(&name)?;
        let claim = actor.device_claim();
        let running = crate::actor::spawn(name.clone(), actor, self.inner.config.mailbox_capacity);
        let r = running.actor_ref.clone();
        self.lock_hosted().insert(
            name,
            Hosted {
                id: r.id().clone(),
                typed: Box::new(r.clone()),
                inbox: None,
                owner: None,
                claim,
            },
        );
        let (node, id, exit) = (self.clone(), r.id().clone(), running.exit);
        tokio::spawn(async move {
            let reason = exit
                .await
                .unwrap_or_else(|e| ExitReason::Panicked(e.to_string()));
            node.unregister(&id, reason);
        });
        Ok(r)
    }

    /// Runs `make()` under a supervisor as `this-node/role/replica`; each restart is a
    /// new incarnation, registered in the directory.
    pub fn supervise<A, F>(
        &self,
        role: &str,
        replica: u32,
        policy: RestartPolicy,
        make: F,
    ) -> Result<Supervised<A::Request, A::Response>, NodeError>
    where
        A: Actor,
        A::Request: Message,
        A::Response: Message,
        F: Fn() -> A + Send + 'static,
    {
        let name = ActorName::new(self.name(), role, replica)?;
        self.check_free(&name)?;
        Ok(supervise(
            name,
            self.inner.config.mailbox_capacity,
            policy,
            NodeHooks(self.clone()),
            make,
        ))
    }

    pub(super) fn check_free(&self, name: &ActorName) -> Result<(), NodeError> {
        if self.lock_hosted().contains_key(name) {
            return Err(NodeError::NameTaken(name.clone()));
        }
        Ok(())
    }

    pub(super) fn lock_hosted(&self) -> std::sync::MutexGuard<'_, HashMap<ActorName, Hosted>> {
        self.inner.hosted.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lock_spawn_tickets(&self) -> std::sync::MutexGuard<'_, SpawnTickets> {
        self.inner
            .spawn_tickets
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn register<Req: Message, Resp: Message>(
        &self,
        r: ActorRef<Req, Resp>,
        claim: Option<DeviceClaim>,
    ) -> Result<(), NodeError> {
        let id = r.id().clone();
        self.lock_hosted().insert(
            id.name.clone(),
            Hosted {
                id: id.clone(),
                typed: Box::new(r.clone()),
                inbox: Some(Arc::new(TypedInbox(r))),
                owner: None,
                claim: claim.clone(),
            },
        );
        self.propose_detached(Change::ActorUp { id, claim });
        Ok(())
    }

    pub(super) fn unregister(&self, id: &ActorId, reason: ExitReason) {
        {
            let mut hosted = self.lock_hosted();
            if hosted.get(&id.name).is_some_and(|h| h.id == *id) {
                hosted.remove(&id.name);
            }
        }
        self.propose_detached(Change::ActorDown {
            id: id.clone(),
            reason,
        });
    }

    /// Sends a directory change to the leader without waiting for it; a change the
    /// leader cannot take now (it died, or is being replaced) goes to the next one.
    pub(super) fn propose_detached(&self, change: Change) {
        let node = self.clone();
        tokio::spawn(async move {
            match node.propose(change.clone()).await {
                Ok(()) => {}
                Err(NodeError::Call(_) | NodeError::NotLeader { .. }) => {
                    tracing::info!(node = %node.name(), "directory change kept for the next leader");
                    node.keep_pending(change);
                }
                Err(e) => {
                    tracing::warn!(node = %node.name(), error = %e, "directory change not recorded")
                }
            }
        });
    }

    /// Records a directory change through the leader; returns once the leader has it.
    pub async fn propose(&self, change: Change) -> Result<(), NodeError> {
        if self.is_leader() {
            if let Some(update) = self.inner.directory.apply(change)? {
                self.broadcast(update).await;
            }
            return Ok(());
        }
        let leader = self.leader();
        match self
            .system_call(&leader, SysRequest::Propose(change))
            .await?
        {
            SysResponse::Ack => Ok(()),
            SysResponse::Redirect { lead, .. } => {
                let err = NodeError::NotLeader {
                    asked: leader,
                    leader: lead.leader.clone(),
                    term: lead.term,
                };
                self.follow(lead);
                Err(err)
            }
            SysResponse::Error(e) => Err(NodeError::Refused {
                node: leader,
                operation: "recording a directory change".into(),
                reason: e,
            }),
            other => Err(NodeError::Refused {
                node: leader,
                operation: "recording a directory change".into(),
                reason: format!("unexpected answer {other:?}"),
            }),
        }
    }
}
