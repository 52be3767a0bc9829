//! What the transport needs from its owner (the node): where a message goes and who a
//! peer is.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::actor::{BoxFuture, CallError};
use crate::addr::ActorId;
use crate::cert_kind::CertKind;
use crate::message::Wire;

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

/// What the node does with what arrives. The transport only moves bytes; it passes on
/// who sent it (the name and kind from the peer's verified certificate).
pub(crate) trait Dispatch: Send + Sync + 'static {
    /// A request that wants an answer.
    fn ask(
        &self,
        from: &str,
        kind: CertKind,
        target: Target,
        wire: Wire,
        timeout: Duration,
    ) -> BoxFuture<'static, Result<Wire, CallError>>;
    /// A fire-and-forget message; resolves once it is queued (the mailbox had room).
    fn tell(
        &self,
        from: &str,
        kind: CertKind,
        target: Target,
        wire: Wire,
    ) -> BoxFuture<'static, ()>;
}

/// How the transport finds a peer's address and host.
pub(crate) trait PeerBook: Send + Sync + 'static {
    /// The address and host id of a node, if known and not dead.
    fn lookup(&self, node: &str) -> Result<(SocketAddr, String), CallError>;
}
