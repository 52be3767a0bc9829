//! What a node is: its shared state, the actors it hosts and how peers' messages reach
//! them.

use std::any::Any;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio::sync::watch;

use super::config::NodeConfig;
use super::protocol::SpawnArgs;
use super::spawn_tickets::SpawnTickets;
use crate::actor::{ActorRef, BoxFuture, CallError};
use crate::addr::{ActorId, ActorName};
use crate::directory::{Change, DirectoryHandle};
use crate::leadership::{Lead, Succession};
use crate::membership::{DeviceClaim, FailureDetector, Membership, NodeInfo, PauseDetector};
use crate::message::{Message, Wire};
use crate::transport::{LogThrottle, Transport};

/// Turns spawn arguments into a running, registered actor on this node.
pub(super) type FactoryFn = Arc<
    dyn Fn(&Node, ActorName, &SpawnArgs) -> BoxFuture<'static, Result<ActorId, String>>
        + Send
        + Sync,
>;

/// What the node knows about each hosted actor.
pub(super) struct Hosted {
    pub(super) id: ActorId,
    /// The typed local reference, for in-process callers (downcast).
    pub(super) typed: Box<dyn Any + Send + Sync>,
    /// Delivery of encoded messages from peers; None for local-only actors.
    pub(super) inbox: Option<Arc<dyn Inbox>>,
    /// The node whose departure releases this actor (see `spawn_remote_linked`).
    pub(super) owner: Option<String>,
    /// The devices of this node it holds ([`crate::Actor::device_claim`]).
    pub(super) claim: Option<DeviceClaim>,
}

pub(super) trait Inbox: Send + Sync {
    fn ask(&self, wire: Wire, timeout: Duration) -> BoxFuture<'static, Result<Wire, CallError>>;
    fn tell(&self, wire: Wire) -> BoxFuture<'static, ()>;
}

pub(super) struct TypedInbox<Req, Resp>(pub(super) ActorRef<Req, Resp>);

impl<Req: Message, Resp: Message> Inbox for TypedInbox<Req, Resp> {
    fn ask(&self, wire: Wire, timeout: Duration) -> BoxFuture<'static, Result<Wire, CallError>> {
        let r = self.0.clone();
        Box::pin(async move {
            let req = Req::from_wire(wire).map_err(|e| CallError::Codec(e.to_string()))?;
            let resp = r.ask(req, timeout).await?;
            resp.into_wire()
                .map_err(|e| CallError::Codec(e.to_string()))
        })
    }
    fn tell(&self, wire: Wire) -> BoxFuture<'static, ()> {
        let r = self.0.clone();
        Box::pin(async move {
            match Req::from_wire(wire) {
                Ok(req) => {
                    if let Err(e) = r.tell(req).await {
                        tracing::debug!(actor = %r.id(), error = %e, "dropped a tell for a stopped actor");
                    }
                }
                Err(e) => {
                    tracing::warn!(actor = %r.id(), error = %e, "dropped an undecodable tell")
                }
            }
        })
    }
}

pub(super) struct NodeInner {
    /// The node's name (fixed; also its certificate's).
    pub(super) name: String,
    /// Where peers reach it (fixed).
    pub(super) addr: SocketAddr,
    /// What it reports; the incarnation changes when it rejoins after being declared dead.
    pub(super) info: RwLock<NodeInfo>,
    pub(super) config: NodeConfig,
    pub(super) transport: Arc<Transport>,
    pub(super) directory: DirectoryHandle,
    pub(super) hosted: Mutex<HashMap<ActorName, Hosted>>,
    pub(super) factories: HashMap<String, FactoryFn>,
    /// The leader this node follows, and its term.
    pub(super) lead: Mutex<Lead>,
    /// Member, or rejoining after being declared dead.
    pub(super) membership: watch::Sender<Membership>,
    /// A fail-over in progress, from this member's side.
    pub(super) succession: Mutex<Succession>,
    /// Set while this node checks whether it may take over (one check at a time).
    pub(super) electing: AtomicBool,
    /// Directory changes the leader did not take (it died or was being replaced); sent
    /// again to the next leader.
    pub(super) pending: Mutex<VecDeque<Change>>,
    /// Notices this process's own stalls.
    pub(super) pause: Mutex<PauseDetector>,
    pub(super) detector: Mutex<FailureDetector>,
    /// Throttles the log lines of requests refused by the sender's certificate kind.
    pub(super) refusals: LogThrottle<String>,
    pub(super) next_replica: AtomicU32,
    /// Remote spawns by ticket, so one its caller gave up on is undone.
    pub(super) spawn_tickets: Mutex<SpawnTickets>,
    pub(super) in_flight: AtomicU64,
    pub(super) stopping: AtomicBool,
    pub(super) shutdown: watch::Sender<bool>,
}

/// A running node. Cheap to clone; all clones are the same node.
#[derive(Clone)]
pub struct Node {
    pub(super) inner: Arc<NodeInner>,
}

/// A reference to a node that does not keep it alive, for what the node itself hosts
/// (an actor holding a [`Node`] would keep its own host alive).
#[derive(Clone)]
pub struct WeakNode(pub(super) std::sync::Weak<NodeInner>);

impl WeakNode {
    /// The node, while it is alive.
    pub fn upgrade(&self) -> Option<Node> {
        self.0.upgrade().map(|inner| Node { inner })
    }
}
