//! Building and starting a node: identity, listen address, seed, remote factories.

use std::collections::HashMap;
use std::collections::VecDeque;
use std::future::Future;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use serde::de::DeserializeOwned;
use tokio::sync::watch;

use super::config::{NodeConfig, NodeError};
use super::dispatch::{NodeBook, NodeDispatch};
use super::protocol::SpawnArgs;
use super::spawn_tickets::SpawnTickets;
use super::state::{FactoryFn, Node, NodeInner};
use crate::actor::Actor;
use crate::addr::{next_incarnation, ActorName};
use crate::cert_kind::CertKind;
use crate::directory::DirectoryHandle;
use crate::leadership::{Lead, Succession};
use crate::membership::{local_inventory, FailureDetector, Membership, NodeInfo, PauseDetector};
use crate::message::Message;
use crate::tls::{ClusterCa, NodeIdentity, TlsError};
use crate::transport::{LogThrottle, Transport};

/// At most one log line per member per this window for requests its certificate does
/// not allow.
const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// Builds and starts a [`Node`].
pub struct NodeBuilder {
    pub(super) name: String,
    pub(super) config: NodeConfig,
    pub(super) identity: Option<NodeIdentity>,
    pub(super) dev_ca_dir: Option<PathBuf>,
    /// The kind a dev certificate is issued with.
    pub(super) dev_kind: CertKind,
    pub(super) factories: HashMap<String, FactoryFn>,
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
    /// The directory the node's actors may write into for peers (default: the
    /// working directory).
    pub fn data_dir(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.config.data_dir = dir.into();
        self
    }
    /// Joins the cluster through this member.
    pub fn seed(mut self, addr: SocketAddr) -> Self {
        self.config.seed = Some(addr);
        self
    }
    /// Other nodes' stable addresses: asked for a live cluster before a seedless node
    /// leads, tried after the seed otherwise (see [`NodeConfig::peers`]).
    pub fn peers(mut self, addrs: impl IntoIterator<Item = SocketAddr>) -> Self {
        self.config.peers = addrs.into_iter().collect();
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
    /// The kind of the certificate [`NodeBuilder::dev_certs`] issues (default: `node`,
    /// which may lead and spawn; `yatt train` takes `trainer`).
    pub fn dev_kind(mut self, kind: CertKind) -> Self {
        self.dev_kind = kind;
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
        let f: FactoryFn = Arc::new(move |node: &Node, name: ActorName, args: &SpawnArgs| {
            let decoded = match args {
                SpawnArgs::Postcard(bytes) => postcard::from_bytes::<Args>(bytes)
                    .map_err(|e| format!("arguments for role {role_name:?} do not decode: {e}")),
                SpawnArgs::Json(text) => serde_json::from_str::<Args>(text).map_err(|e| {
                    format!("arguments for role {role_name:?} do not fit its type: {e} (in {text})")
                }),
            };
            let made = decoded.map(|a| make(node, &name, a));
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
            (None, Some(dir)) => dev_identity(dir, &self.name, self.dev_kind)?,
            (None, None) => return Err(NodeError::NoIdentity),
        };
        if identity.node != self.name {
            return Err(NodeError::NameMismatch {
                config: self.name,
                cert: identity.node.clone(),
            });
        }
        let mut config = self.config;
        let data_dir = &config.data_dir;
        config.data_dir = std::fs::create_dir_all(data_dir)
            .and_then(|()| data_dir.canonicalize())
            .map_err(|e| NodeError::DataDir {
                path: data_dir.clone(),
                reason: e.to_string(),
            })?;
        let (hostname, host_id, cpu_cores, memory_bytes, devices) =
            local_inventory(config.virtual_devices);
        let transport = Transport::bind(
            &identity,
            config.listen,
            host_id.clone(),
            config.transport.clone(),
        )?;
        let mut addr = config.advertise.unwrap_or_else(|| transport.local_addr());
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
            kind: identity.kind,
        };
        let (shutdown, _) = watch::channel(false);
        // The founding seed leads term 1; a joining node learns the lead from the join,
        // and a seedless node with peers leads only once none of them belongs to a
        // cluster (term 0 until then: it accepts no joins meanwhile).
        let lead = Lead {
            term: u64::from(config.seed.is_none() && config.peers.is_empty()),
            leader: self.name.clone(),
        };
        let node = Node {
            inner: Arc::new(NodeInner {
                name: self.name.clone(),
                addr,
                info: RwLock::new(info),
                transport: transport.clone(),
                directory: DirectoryHandle::new(),
                hosted: Mutex::new(HashMap::new()),
                factories: self.factories,
                lead: Mutex::new(lead),
                membership: watch::channel(Membership::Member).0,
                succession: Mutex::new(Succession::default()),
                electing: AtomicBool::new(false),
                pending: Mutex::new(VecDeque::new()),
                // A tick late by half a failure bound: this node stood still.
                pause: Mutex::new(PauseDetector::new(config.failure_timeout / 2)),
                detector: Mutex::new(FailureDetector::new(config.failure_timeout)),
                refusals: LogThrottle::new(REFUSAL_LOG_WINDOW),
                next_replica: AtomicU32::new(0),
                spawn_tickets: Mutex::new(SpawnTickets::default()),
                in_flight: AtomicU64::new(0),
                stopping: AtomicBool::new(false),
                shutdown,
                config,
            }),
        };
        let weak = Arc::downgrade(&node.inner);
        transport.set_dispatch(
            Arc::new(NodeDispatch(weak.clone())),
            Arc::new(NodeBook(weak)),
        );
        tokio::spawn(transport.clone().serve());
        let config = &node.inner.config;
        let joined = match config.seed {
            None if config.peers.is_empty() => node.found(),
            None => node.found_or_rejoin(&config.peers).await,
            Some(seed) => {
                let deadline = tokio::time::Instant::now() + config.system_timeout;
                let seeds: Vec<SocketAddr> = std::iter::once(seed)
                    .chain(config.peers.iter().copied().filter(|p| *p != seed))
                    .collect();
                node.join_through(&seeds, deadline).await
            }
        };
        if let Err(e) = joined {
            node.inner.transport.close().await;
            return Err(e);
        }
        tokio::spawn(node.clone().heartbeat_loop());
        tracing::info!(node = %node.name(), addr = %node.addr(), leader = %node.leader(), "node started");
        Ok(node)
    }
}

pub(super) fn dev_identity(
    dir: &std::path::Path,
    name: &str,
    kind: CertKind,
) -> Result<NodeIdentity, NodeError> {
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
    Ok(ca.issue(name, kind)?)
}
