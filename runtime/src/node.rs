//! A node: one process's share of the cluster.
//!
//! A node owns the QUIC transport, a replica of the directory, the actors it hosts and
//! the factories it can spawn remotely. The first node of a cluster (no seed) leads the
//! directory: it orders every change and watches every member's heartbeats. Others join
//! through a seed address, heartbeat the leader, and follow its directory updates.
//!
//! ```no_run
//! use std::time::Duration;
//! use yatt_runtime::node::Node;
//! use yatt_runtime::actor::{Actor, ActorError, Context};
//!
//! struct Greeter;
//! impl Actor for Greeter {
//!     type Request = String;
//!     type Response = String;
//!     async fn handle(&mut self, who: String, _: &mut Context) -> Result<String, ActorError> {
//!         Ok(format!("hello, {who}"))
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let seed = Node::builder("alpha").dev_certs("/tmp/yatt-dev-ca").start().await?;
//! let member = Node::builder("beta")
//!     .dev_certs("/tmp/yatt-dev-ca")
//!     .seed(seed.addr())
//!     .factory("greeter", |_: ()| Ok(Greeter))
//!     .start()
//!     .await?;
//! let greeter = seed
//!     .spawn_remote::<String, String, _>("beta", "greeter", &(), Duration::from_secs(5))
//!     .await?;
//! let answer = greeter.ask("world".to_string(), Duration::from_secs(1)).await?;
//! assert_eq!(answer, "hello, world");
//! # Ok(()) }
//! ```

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::actor::{
    spawn_with_id, Actor, ActorError, ActorRef, BoxFuture, CallError, ExitReason, RemoteRoute,
    TellError,
};
use crate::addr::{next_incarnation, validate_segment, ActorId, ActorName, AddrError};
use crate::directory::{Change, Directory, DirectoryError, DirectoryHandle, Liveness, Update};
use crate::membership::{local_inventory, FailureDetector, NodeInfo};
use crate::message::{Message, Wire};
use crate::supervisor::{supervise, Lifecycle, RestartPolicy, Supervised};
use crate::tls::{ClusterCa, NodeIdentity, TlsError};
use crate::transport::{Dispatch, PeerBook, Target, Transport, TransportConfig, TransportError};

/// Settings of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Address to listen on (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Address peers use to reach this node (default: the bound address).
    pub advertise: Option<SocketAddr>,
    /// A member's address to join through; none makes this node the directory leader.
    pub seed: Option<SocketAddr>,
    /// How often heartbeats are sent.
    pub heartbeat_interval: Duration,
    /// Silence after which a peer is declared dead.
    pub failure_timeout: Duration,
    /// Virtual devices to report when there is no GPU.
    pub virtual_devices: u32,
    /// Mailbox capacity of actors spawned by this node.
    pub mailbox_capacity: usize,
    /// Deadline of the node's own calls (join, register, spawn).
    pub system_timeout: Duration,
    /// How long shutdown waits for in-flight requests.
    pub drain_timeout: Duration,
    /// Transport settings.
    pub transport: TransportConfig,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: "127.0.0.1:0".parse().expect("literal"),
            advertise: None,
            seed: None,
            heartbeat_interval: Duration::from_millis(500),
            failure_timeout: Duration::from_secs(2),
            virtual_devices: 1,
            mailbox_capacity: 1024,
            system_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            transport: TransportConfig::default(),
        }
    }
}

/// Errors from node operations.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// Certificates could not be loaded, created or used.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The transport could not start.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// A name was invalid.
    #[error(transparent)]
    Addr(#[from] AddrError),
    /// The node's name does not match its certificate.
    #[error("node name {config:?} does not match the certificate's {cert:?}; issue a certificate for {config:?} (`yatt-node cert --name {config}`)")]
    NameMismatch {
        /// The configured name.
        config: String,
        /// The certificate's name.
        cert: String,
    },
    /// No identity was given: neither certificates nor dev mode.
    #[error("no node identity: give certificates (`identity`) or use dev mode (`dev_certs(DIR)`)")]
    NoIdentity,
    /// Joining the cluster failed.
    #[error("could not join through seed {seed}: {reason}")]
    Join {
        /// The seed address.
        seed: SocketAddr,
        /// What went wrong.
        reason: String,
    },
    /// A remote call failed.
    #[error(transparent)]
    Call(#[from] CallError),
    /// The directory refused a change.
    #[error(transparent)]
    Directory(#[from] DirectoryError),
    /// An actor name is already taken by a running actor on this node.
    #[error("{0} is already running on this node; pick another replica index")]
    NameTaken(ActorName),
    /// The reference's types do not match the actor's.
    #[error("{id} does not take {req} / answer {resp}")]
    WrongType {
        /// The actor.
        id: ActorId,
        /// The request type asked for.
        req: &'static str,
        /// The response type asked for.
        resp: &'static str,
    },
    /// No factory is registered under a role name.
    #[error("no factory for role {role:?} on node {node}; registered: {known:?}")]
    NoFactory {
        /// The node asked.
        node: String,
        /// The role asked for.
        role: String,
        /// The roles it can spawn.
        known: Vec<String>,
    },
    /// The node is shutting down.
    #[error("node is shutting down")]
    ShuttingDown,
}

/// System requests between nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum SysRequest {
    Join(NodeInfo),
    Heartbeat {
        node: String,
        incarnation: u64,
    },
    Update(Update),
    Propose(Change),
    Snapshot,
    Spawn {
        role: String,
        replica: Option<u32>,
        args: Vec<u8>,
        /// Release the actor when the asking node leaves or dies.
        linked: bool,
    },
    Leave {
        node: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
enum SysResponse {
    Directory(Directory),
    Ack,
    Spawned(ActorId),
    Error(String),
}

/// Turns spawn arguments into a running, registered actor on this node.
type FactoryFn = Arc<
    dyn Fn(&Node, ActorName, &[u8]) -> BoxFuture<'static, Result<ActorId, String>> + Send + Sync,
>;

/// What the node knows about each hosted actor.
struct Hosted {
    id: ActorId,
    /// The typed local reference, for in-process callers (downcast).
    typed: Box<dyn Any + Send + Sync>,
    /// Delivery of encoded messages from peers; None for local-only actors.
    inbox: Option<Arc<dyn Inbox>>,
    /// The node whose departure releases this actor (see `spawn_remote_linked`).
    owner: Option<String>,
}

trait Inbox: Send + Sync {
    fn ask(&self, wire: Wire, timeout: Duration) -> BoxFuture<'static, Result<Wire, CallError>>;
    fn tell(&self, wire: Wire) -> BoxFuture<'static, ()>;
}

struct TypedInbox<Req, Resp>(ActorRef<Req, Resp>);

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

struct NodeInner {
    info: NodeInfo,
    config: NodeConfig,
    transport: Arc<Transport>,
    directory: DirectoryHandle,
    hosted: Mutex<HashMap<ActorName, Hosted>>,
    factories: HashMap<String, FactoryFn>,
    leader: Mutex<String>,
    detector: Mutex<FailureDetector>,
    next_replica: AtomicU32,
    in_flight: AtomicU64,
    stopping: AtomicBool,
    shutdown: watch::Sender<bool>,
}

/// A running node. Cheap to clone; all clones are the same node.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

/// A reference to a node that does not keep it alive, for what the node itself hosts
/// (an actor holding a [`Node`] would keep its own host alive).
#[derive(Clone)]
pub struct WeakNode(std::sync::Weak<NodeInner>);

impl WeakNode {
    /// The node, while it is alive.
    pub fn upgrade(&self) -> Option<Node> {
        self.0.upgrade().map(|inner| Node { inner })
    }
}

/// Builds and starts a [`Node`].
pub struct NodeBuilder {
    name: String,
    config: NodeConfig,
    identity: Option<NodeIdentity>,
    dev_ca_dir: Option<PathBuf>,
    factories: HashMap<String, FactoryFn>,
}

impl NodeBuilder {
    /// Sets the whole configuration.
    pub fn config(mut self, config: NodeConfig) -> Self {
        self.config = config;
        self
    }
    /// Sets the listen address.
    pub fn listen(mut self, addr: SocketAddr) -> Self {
        self.config.listen = addr;
        self
    }
    /// Joins the cluster through this member.
    pub fn seed(mut self, addr: SocketAddr) -> Self {
        self.config.seed = Some(addr);
        self
    }
    /// Uses this certificate and key (issued by the cluster CA).
    pub fn identity(mut self, identity: NodeIdentity) -> Self {
        self.identity = Some(identity);
        self
    }
    /// Dev mode: a cluster CA kept in `dir` (created on first use) issues this node's
    /// certificate at start. For local clusters only: anyone who can read `dir` can join.
    pub fn dev_certs(mut self, dir: impl Into<PathBuf>) -> Self {
        self.dev_ca_dir = Some(dir.into());
        self
    }
    /// Registers a factory: peers can spawn `role` here with serialized `Args`.
    pub fn factory<Args, A, F>(self, role: &str, make: F) -> Self
    where
        Args: DeserializeOwned + 'static,
        A: Actor,
        A::Request: Message,
        A::Response: Message,
        F: Fn(Args) -> Result<A, String> + Send + Sync + 'static,
    {
        self.factory_async(role, move |args| std::future::ready(make(args)))
    }

    /// Registers a factory whose actor takes a while to build (e.g. it loads a model on
    /// a thread of its own): the spawn request is answered once the future resolves,
    /// and the executor is never blocked meanwhile.
    pub fn factory_async<Args, A, F, Fut>(self, role: &str, make: F) -> Self
    where
        Args: DeserializeOwned + 'static,
        A: Actor,
        A::Request: Message,
        A::Response: Message,
        F: Fn(Args) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<A, String>> + Send + 'static,
    {
        self.factory_with_node(role, move |_: &Node, _: &ActorName, args| make(args))
    }

    /// Like [`NodeBuilder::factory_async`], but `make` also gets the hosting node and the
    /// name the actor will have, for an actor that talks to peers or spawns companions
    /// of its own (e.g. a [`crate::collective::RingMember`]'s inbox).
    pub fn factory_with_node<Args, A, F, Fut>(mut self, role: &str, make: F) -> Self
    where
        Args: DeserializeOwned + 'static,
        A: Actor,
        A::Request: Message,
        A::Response: Message,
        F: Fn(&Node, &ActorName, Args) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<A, String>> + Send + 'static,
    {
        let role_name = role.to_string();
        let f: FactoryFn = Arc::new(move |node: &Node, name: ActorName, args: &[u8]| {
            let made = postcard::from_bytes::<Args>(args)
                .map_err(|e| format!("arguments for role {role_name:?} do not decode: {e}"))
                .map(|a| make(node, &name, a));
            let node = node.clone();
            Box::pin(async move {
                let actor = made?.await?;
                node.spawn_named(name, actor)
                    .map(|r| r.id().clone())
                    .map_err(|e| e.to_string())
            })
        });
        self.factories.insert(role.to_string(), f);
        self
    }

    /// Starts the node: binds, joins (or leads), and begins heartbeats.
    pub async fn start(self) -> Result<Node, NodeError> {
        let identity = match (self.identity, &self.dev_ca_dir) {
            (Some(id), _) => id,
            (None, Some(dir)) => dev_identity(dir, &self.name)?,
            (None, None) => return Err(NodeError::NoIdentity),
        };
        if identity.node != self.name {
            return Err(NodeError::NameMismatch {
                config: self.name,
                cert: identity.node.clone(),
            });
        }
        let (hostname, host_id, cpu_cores, memory_bytes, devices) =
            local_inventory(self.config.virtual_devices);
        let transport = Transport::bind(
            &identity,
            self.config.listen,
            host_id.clone(),
            self.config.transport.clone(),
        )?;
        let mut addr = self
            .config
            .advertise
            .unwrap_or_else(|| transport.local_addr());
        if addr.ip().is_unspecified() {
            addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let info = NodeInfo {
            name: self.name.clone(),
            incarnation: next_incarnation(),
            addr,
            hostname,
            host_id,
            cpu_cores,
            memory_bytes,
            devices,
        };
        let (shutdown, _) = watch::channel(false);
        let node = Node {
            inner: Arc::new(NodeInner {
                info: info.clone(),
                transport: transport.clone(),
                directory: DirectoryHandle::new(),
                hosted: Mutex::new(HashMap::new()),
                factories: self.factories,
                leader: Mutex::new(self.name.clone()),
                detector: Mutex::new(FailureDetector::new(self.config.failure_timeout)),
                next_replica: AtomicU32::new(0),
                in_flight: AtomicU64::new(0),
                stopping: AtomicBool::new(false),
                shutdown,
                config: self.config,
            }),
        };
        let weak = Arc::downgrade(&node.inner);
        transport.set_dispatch(
            Arc::new(NodeDispatch(weak.clone())),
            Arc::new(NodeBook(weak)),
        );
        tokio::spawn(transport.clone().serve());
        match node.inner.config.seed {
            None => {
                node.inner.directory.apply(Change::NodeUp(info))?;
            }
            Some(seed) => node.join(seed).await?,
        }
        tokio::spawn(node.clone().heartbeat_loop());
        tracing::info!(node = %node.name(), addr = %node.addr(), leader = %node.leader(), "node started");
        Ok(node)
    }
}

fn dev_identity(dir: &std::path::Path, name: &str) -> Result<NodeIdentity, NodeError> {
    let ca = match ClusterCa::load(dir) {
        Ok(ca) => ca,
        Err(_) => {
            std::fs::create_dir_all(dir).map_err(|e| TlsError::Io {
                path: dir.to_path_buf(),
                source: e,
            })?;
            let ca = ClusterCa::generate("yatt-dev")?;
            // Another node of the same dev cluster may have raced us; keep whichever
            // was written first.
            if ClusterCa::load(dir).is_err() {
                ca.save(dir)?;
            }
            ClusterCa::load(dir)?
        }
    };
    Ok(ca.issue(name)?)
}

struct NodeDispatch(std::sync::Weak<NodeInner>);
struct NodeBook(std::sync::Weak<NodeInner>);

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
                Target::System => node.system_ask(&from, wire).await,
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

    fn tell(&self, from: &str, target: Target, wire: Wire) -> BoxFuture<'static, ()> {
        let Some(inner) = self.0.upgrade() else {
            return Box::pin(async {});
        };
        let node = Node { inner };
        let from = from.to_string();
        Box::pin(async move {
            match target {
                Target::System => {
                    let _ = node.system_ask(&from, wire).await;
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

struct RemoteActor<Req, Resp> {
    node: Node,
    id: ActorId,
    _types: PhantomData<fn(Req) -> Resp>,
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
struct NodeHooks(Node);

impl<Req: Message, Resp: Message> Lifecycle<Req, Resp> for NodeHooks {
    fn started(&self, actor: &ActorRef<Req, Resp>) {
        if let Err(e) = self.0.register(actor.clone()) {
            tracing::error!(actor = %actor.id(), error = %e, "could not register a restarted actor");
        }
    }
    fn exited(&self, id: &ActorId, reason: &ExitReason) {
        self.0.unregister(id, reason.clone());
    }
}

impl Node {
    /// Starts building a node called `name` (also its certificate's name).
    pub fn builder(name: &str) -> NodeBuilder {
        NodeBuilder {
            name: name.to_string(),
            config: NodeConfig::default(),
            identity: None,
            dev_ca_dir: None,
            factories: HashMap::new(),
        }
    }

    /// A reference that does not keep this node alive.
    pub fn downgrade(&self) -> WeakNode {
        WeakNode(Arc::downgrade(&self.inner))
    }

    /// This node's name.
    pub fn name(&self) -> &str {
        &self.inner.info.name
    }

    /// What this node reported to the cluster.
    pub fn info(&self) -> &NodeInfo {
        &self.inner.info
    }

    /// The address peers reach this node at.
    pub fn addr(&self) -> SocketAddr {
        self.inner.info.addr
    }

    /// The directory replica.
    pub fn directory(&self) -> &DirectoryHandle {
        &self.inner.directory
    }

    /// The node that leads the directory.
    pub fn leader(&self) -> String {
        self.inner
            .leader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether this node leads the directory.
    pub fn is_leader(&self) -> bool {
        self.leader() == self.name()
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

    fn spawn_named<A>(
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
        let running = spawn_with_id(id, actor, self.inner.config.mailbox_capacity);
        self.register(running.actor_ref.clone())?;
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
        let running = crate::actor::spawn(name.clone(), actor, self.inner.config.mailbox_capacity);
        let r = running.actor_ref.clone();
        self.lock_hosted().insert(
            name,
            Hosted {
                id: r.id().clone(),
                typed: Box::new(r.clone()),
                inbox: None,
                owner: None,
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

    fn check_free(&self, name: &ActorName) -> Result<(), NodeError> {
        if self.lock_hosted().contains_key(name) {
            return Err(NodeError::NameTaken(name.clone()));
        }
        Ok(())
    }

    fn lock_hosted(&self) -> std::sync::MutexGuard<'_, HashMap<ActorName, Hosted>> {
        self.inner.hosted.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn register<Req: Message, Resp: Message>(
        &self,
        r: ActorRef<Req, Resp>,
    ) -> Result<(), NodeError> {
        let id = r.id().clone();
        self.lock_hosted().insert(
            id.name.clone(),
            Hosted {
                id: id.clone(),
                typed: Box::new(r.clone()),
                inbox: Some(Arc::new(TypedInbox(r))),
                owner: None,
            },
        );
        self.propose_detached(Change::ActorUp(id));
        Ok(())
    }

    fn unregister(&self, id: &ActorId, reason: ExitReason) {
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

    /// Sends a directory change to the leader without waiting for it.
    fn propose_detached(&self, change: Change) {
        let node = self.clone();
        tokio::spawn(async move {
            if let Err(e) = node.propose(change).await {
                tracing::warn!(error = %e, "directory change not recorded");
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
            other => Err(NodeError::Join {
                seed: self.addr(),
                reason: format!("leader answered {other:?}"),
            }),
        }
    }

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
    /// typed reference once the actor runs and is in the directory.
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

    async fn spawn_remote_as<Req: Message, Resp: Message, Args: Serialize>(
        &self,
        node: &str,
        role: &str,
        args: &Args,
        timeout: Duration,
        linked: bool,
    ) -> Result<ActorRef<Req, Resp>, NodeError> {
        validate_segment("role", role)?;
        let args = postcard::to_stdvec(args).map_err(|e| CallError::Codec(e.to_string()))?;
        let req = SysRequest::Spawn {
            role: role.to_string(),
            replica: None,
            args,
            linked,
        };
        let id = if node == self.name() {
            match self.handle_system(self.name(), req).await {
                SysResponse::Spawned(id) => id,
                SysResponse::Error(e) => return Err(self.spawn_error(node, role, e)),
                other => return Err(self.spawn_error(node, role, format!("{other:?}"))),
            }
        } else {
            let wire = req
                .into_wire()
                .map_err(|e| CallError::Codec(e.to_string()))?;
            let reply = self
                .inner
                .transport
                .ask(node, Target::System, wire, timeout)
                .await?;
            match SysResponse::from_wire(reply).map_err(|e| CallError::Codec(e.to_string()))? {
                SysResponse::Spawned(id) => id,
                SysResponse::Error(e) => return Err(self.spawn_error(node, role, e)),
                other => return Err(self.spawn_error(node, role, format!("{other:?}"))),
            }
        };
        // Return once this node's directory replica shows it, so resolve() works at once.
        let want = id.clone();
        self.inner
            .directory
            .wait_until(timeout, |d| d.resolve(&want.name) == Some(&want))
            .await;
        self.actor_ref(&id)
    }

    fn spawn_error(&self, node: &str, role: &str, e: String) -> NodeError {
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

    fn inbox(&self, id: &ActorId) -> Result<Arc<dyn Inbox>, CallError> {
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

    async fn system_call(&self, node: &str, req: SysRequest) -> Result<SysResponse, NodeError> {
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

    async fn system_tell(&self, node: &str, req: SysRequest) {
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

    async fn system_ask(&self, from: &str, wire: Wire) -> Result<Wire, CallError> {
        let req = SysRequest::from_wire(wire).map_err(|e| CallError::Codec(e.to_string()))?;
        self.handle_system(from, req)
            .await
            .into_wire()
            .map_err(|e| CallError::Codec(e.to_string()))
    }

    async fn handle_system(&self, from: &str, req: SysRequest) -> SysResponse {
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

    fn next_free_replica(&self, role: &str) -> u32 {
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

    fn lock_detector(&self) -> std::sync::MutexGuard<'_, FailureDetector> {
        self.inner
            .detector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Side effects of a directory change on this node: forget dead peers and release
    /// the actors they owned.
    fn follow_update(&self, update: &Update) {
        if let Change::NodeDown { node, .. } = &update.change {
            if node != self.name() {
                self.inner.transport.forget(node);
                self.release_owned_by(node);
            }
        }
    }

    /// Drops this node's references to the actors `owner` spawned linked; each stops
    /// when its last reference is gone, and its exit is recorded in the directory.
    fn release_owned_by(&self, owner: &str) {
        let released: Vec<Hosted> = {
            let mut hosted = self.lock_hosted();
            let names: Vec<ActorName> = hosted
                .iter()
                .filter(|(_, h)| h.owner.as_deref() == Some(owner))
                .map(|(n, _)| n.clone())
                .collect();
            names.iter().filter_map(|n| hosted.remove(n)).collect()
        };
        for h in released {
            tracing::info!(actor = %h.id, %owner, "its owner left the cluster: releasing it");
        }
    }

    /// Leader: sends an update to every alive member, in order.
    async fn broadcast(&self, update: Update) {
        self.follow_update(&update);
        let members: Vec<String> = self.inner.directory.read(|d| {
            d.alive_nodes()
                .filter(|n| n.name != self.name())
                .map(|n| n.name.clone())
                .collect()
        });
        let sends = members.into_iter().map(|m| {
            let node = self.clone();
            let update = update.clone();
            async move { node.system_tell(&m, SysRequest::Update(update)).await }
        });
        futures::future::join_all(sends).await;
    }

    async fn join(&self, seed: SocketAddr) -> Result<(), NodeError> {
        let join_err = |reason: String| NodeError::Join { seed, reason };
        let leader = self
            .inner
            .transport
            .connect_seed(seed)
            .await
            .map_err(|e| join_err(e.to_string()))?;
        *self.inner.leader.lock().unwrap_or_else(|p| p.into_inner()) = leader.clone();
        // The seed is the leader; it is reachable by name once we know its address.
        self.inner.directory.reset(seed_directory(&leader, seed));
        let reply = self
            .system_call(&leader, SysRequest::Join(self.inner.info.clone()))
            .await
            .map_err(|e| join_err(e.to_string()))?;
        match reply {
            SysResponse::Directory(d) => {
                self.inner.directory.reset(d);
                self.lock_detector()
                    .heard(&leader, tokio::time::Instant::now());
                Ok(())
            }
            SysResponse::Error(e) => Err(join_err(e)),
            other => Err(join_err(format!("unexpected answer {other:?}"))),
        }
    }

    async fn resync(&self) {
        let leader = self.leader();
        if let Ok(SysResponse::Directory(d)) = self.system_call(&leader, SysRequest::Snapshot).await
        {
            self.inner.directory.reset(d);
        }
    }

    async fn heartbeat_loop(self) {
        let mut shutdown = self.inner.shutdown.subscribe();
        let mut tick = tokio::time::interval(self.inner.config.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Silence is checked more often than heartbeats are sent, so detection takes
        // at most failure_timeout plus this, not plus a whole heartbeat period.
        let mut check = tokio::time::interval(
            self.inner
                .config
                .heartbeat_interval
                .min(Duration::from_millis(100)),
        );
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.send_heartbeats(),
                _ = check.tick() => self.declare_silent_peers_dead().await,
                _ = shutdown.changed() => return,
            }
        }
    }

    fn send_heartbeats(&self) {
        let me = SysRequest::Heartbeat {
            node: self.name().to_string(),
            incarnation: self.inner.info.incarnation,
        };
        let targets: Vec<String> = if self.is_leader() {
            self.inner.directory.read(|d| {
                d.alive_nodes()
                    .filter(|n| n.name != self.name())
                    .map(|n| n.name.clone())
                    .collect()
            })
        } else {
            vec![self.leader()]
        };
        for t in targets {
            let (node, me) = (self.clone(), me.clone());
            tokio::spawn(async move { node.system_tell(&t, me).await });
        }
    }

    async fn declare_silent_peers_dead(&self) {
        let dead = self.lock_detector().expired(tokio::time::Instant::now());
        for node in dead {
            tracing::warn!(%node, timeout = ?self.inner.config.failure_timeout, "peer silent: declaring it dead");
            let change = Change::NodeDown {
                node: node.clone(),
                reason: ExitReason::NodeDown(format!(
                    "no heartbeat for {:?}",
                    self.inner.config.failure_timeout
                )),
            };
            if self.is_leader() {
                if let Ok(Some(update)) = self.inner.directory.apply(change) {
                    self.broadcast(update).await;
                }
            } else {
                // The leader itself went silent. There is no fail-over yet: mark it
                // dead locally so callers fail fast instead of hanging.
                let _ = self.inner.directory.apply(change);
                self.inner.transport.forget(&node);
            }
        }
    }

    /// Graceful shutdown: refuse new work, drain in-flight requests (bounded), leave
    /// the cluster, close connections.
    pub async fn shutdown(&self) {
        if self.inner.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(node = %self.name(), "shutting down: draining");
        self.inner.transport.stop_accepting();
        let drained = tokio::time::timeout(self.inner.config.drain_timeout, async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                in_flight = self.in_flight(),
                "drain timed out; closing anyway"
            );
        }
        let _ = self.inner.shutdown.send(true);
        if !self.is_leader() {
            let leader = self.leader();
            let _ = tokio::time::timeout(
                self.inner.config.system_timeout,
                self.system_call(
                    &leader,
                    SysRequest::Leave {
                        node: self.name().to_string(),
                    },
                ),
            )
            .await;
        } else if let Ok(Some(update)) = self.inner.directory.apply(Change::NodeDown {
            node: self.name().to_string(),
            reason: ExitReason::Normal,
        }) {
            self.broadcast(update).await;
        }
        self.inner.transport.close().await;
        tracing::info!(node = %self.name(), "left the cluster");
    }
}

/// A directory that knows only the seed, so the first call can reach it by name.
fn seed_directory(leader: &str, addr: SocketAddr) -> Directory {
    let mut d = Directory::default();
    let mut info = NodeInfo::for_tests(leader, 0);
    info.addr = addr;
    info.host_id = String::new();
    let _ = d.apply(Change::NodeUp(info));
    d
}
