//! What the transport needs from its owner (the node): where a message goes and who a
//! peer is.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::actor::{BoxFuture, CallError};
use crate::addr::ActorId;
use crate::codec::{self, Bulk, BulkHeader, BulkLimits, CodecError, FrameLimits};
use crate::message::Wire;
use crate::shm::{MappingCache, SegmentPool};
use crate::tls::{self, NodeIdentity};
use super::config::{TransportConfig, TransportError, TransportStats};
use super::protocol::{
    decode, encode_tagged, read_exact_err, AskFrame, BulkRef, Control, ReplyFrame, ReplyHead,
    RequestHead, ASK, ASKS, BULK_PRIORITY, BULK_REPLY, BULK_TELL, CONTROL_PRIORITY, REPLIES,
    SYSTEM, TELLS, WRITE_BATCH,
};
use super::peer::{write_loop, PendingGuard, PendingReply, Peer, StreamWriter, TellProgress};
use super::endpoint::{bind_socket, Transport};

/// What a request is addressed to.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum Target {
    /// An actor incarnation.
    Actor(ActorId),
    /// The node's system service (membership, directory, spawn).
    System,
    /// The transport itself (shared-memory segment releases).
    Transport,
}

/// What the node does with what arrives. The transport only moves bytes.
pub(crate) trait Dispatch: Send + Sync + 'static {
    /// A request that wants an answer.
    fn ask(
        &self,
        from: &str,
        target: Target,
        wire: Wire,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<Wire, CallError>>;
    /// A fire-and-forget message; resolves once it is queued (the mailbox had room).
    fn tell(&self, from: &str, target: Target, wire: Wire) -> BoxFuture<'static, ()>;
}

/// How the transport finds a peer's address and host.
pub(crate) trait PeerBook: Send + Sync + 'static {
    /// The address and host id of a node, if known and not dead.
    fn lookup(&self, node: &str) -> Result<(SocketAddr, String), CallError>;
}
