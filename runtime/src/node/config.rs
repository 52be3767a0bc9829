//! A node's settings and errors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::actor::CallError;
use crate::addr::{ActorId, ActorName, AddrError};
use crate::directory::DirectoryError;
use crate::tls::TlsError;
use crate::transport::{TransportConfig, TransportError};

/// Settings of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Address to listen on (port 0 picks a free one).
    pub listen: SocketAddr,
    /// Address peers use to reach this node (default: the bound address).
    pub advertise: Option<SocketAddr>,
    /// A member's address to join through; none makes this node the directory leader.
    pub seed: Option<SocketAddr>,
    /// Other nodes' stable addresses (a launcher's other hosts or pods). With no seed,
    /// each is asked whom it follows before this node leads: a live cluster is rejoined,
    /// so a founder started again does not lead a second one. With a seed, they are
    /// tried after it.
    pub peers: Vec<SocketAddr>,
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
    /// The one directory tree the node's actors write into on a peer's behalf (e.g. a
    /// checkpoint a trainer asks for). Made absolute when the node starts.
    pub data_dir: PathBuf,
}

impl Default for NodeConfig {
    fn default() -> Self {
        NodeConfig {
            listen: "127.0.0.1:0".parse().expect("literal"),
            advertise: None,
            seed: None,
            peers: Vec::new(),
            heartbeat_interval: Duration::from_millis(500),
            failure_timeout: Duration::from_secs(2),
            virtual_devices: 1,
            mailbox_capacity: 1024,
            system_timeout: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(10),
            transport: TransportConfig::default(),
            data_dir: PathBuf::from("."),
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
    /// The data directory cannot be created or resolved.
    #[error("data directory {path}: {reason}; pick a directory this process can create and write (node.data_dir, `--data-dir`)")]
    DataDir {
        /// The configured directory.
        path: PathBuf,
        /// What failed.
        reason: String,
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
    /// A seedless node's peers still follow its name as their leader (an earlier life
    /// not yet found dead, or another process under the name) past the wait.
    #[error("not leading a cluster beside a live one: {members:?} still follow {name} as the leader of term {term} after {waited:?} (an earlier life of {name} not yet found dead, or another process under this name); stop the other {name}, or start this one again once the cluster has elected another leader")]
    StillFollowed {
        /// This node's name.
        name: String,
        /// The term they follow.
        term: u64,
        /// The peers that answered, by address.
        members: Vec<SocketAddr>,
        /// How long this node waited.
        waited: Duration,
    },
    /// The cluster refused the join: a live member already has this node's name.
    #[error("could not join: node name {name:?} belongs to a live member of the cluster (incarnation {incarnation} at {addr}, heard from {silent_for:?} ago); start this node under another name (--name), or stop the other {name} and start this one again once the cluster has declared it dead (after {bound:?} of silence)")]
    NameInUse {
        /// The name asked for.
        name: String,
        /// The live member's incarnation.
        incarnation: u64,
        /// Where the live member is.
        addr: SocketAddr,
        /// How long ago the leader last heard from it.
        silent_for: Duration,
        /// The failure bound.
        bound: Duration,
    },
    /// A change went to a node that no longer leads the directory.
    #[error("node {asked} does not lead the directory ({leader} leads term {term}); the change was not recorded, send it to {leader}")]
    NotLeader {
        /// The node asked.
        asked: String,
        /// The leader it named.
        leader: String,
        /// Its term.
        term: u64,
    },
    /// A peer refused an operation.
    #[error("node {node} refused {operation}: {reason}")]
    Refused {
        /// The node that refused.
        node: String,
        /// What was asked.
        operation: String,
        /// Its reason.
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
