//! # yatt-runtime
//!
//! The actor runtime that carries every yatt role. What belongs here: local actors with
//! bounded mailboxes and supervision, actor addressing (`node/role/replica` plus an
//! incarnation), the directory of live actors with its epoch, the QUIC transport with
//! mutual TLS (frames, bulk payloads), cluster membership with heartbeats, remote spawn
//! through a factory registry, and a ring all-reduce of plain `f32` buffers.
//!
//! What does not: machine learning. No models, tensors of a framework, tokenizers,
//! training or RL algorithms (those are `yatt-engine` and `yatt-roles`); bulk payloads
//! are named byte ranges with a dtype and shape, nothing more.
//!
//! Every module is private; the API is re-exported here. The table says which file holds
//! what.
//!
//! | file | concern | start at |
//! |---|---|---|
//! | `addr` | names and incarnations | [`ActorName`], [`ActorId`] |
//! | `actor` | local actors, references, tell/ask | [`Actor`], [`ActorRef`], [`spawn`] |
//! | `supervisor` | restart policies | [`RestartPolicy`], [`supervise`] |
//! | `node` | a process's runtime: spawn, resolve, remote factories | [`Node::builder`] |
//! | `directory` | who is alive, under an epoch | [`Directory`], [`DirectoryHandle`] |
//! | `membership` | node inventory, failure and pause detection | [`NodeInfo`], [`FailureDetector`] |
//! | `founding` | a seedless node: found a cluster or rejoin a live one (pure) | `NodeConfig::peers` |
//! | `leadership` | who leads the directory, join admission, heartbeat verdicts (pure) | [`Lead`], [`successor`] |
//! | `message` | what crosses the wire | [`Message`], [`WithBulk`] |
//! | `codec` | frames and bulk payloads (sans-IO core) | [`FrameDecoder`], [`Bulk`] |
//! | `transport` | QUIC connections, streams, routing | [`TransportConfig`] |
//! | `collective` | ring all-reduce of f32 buffers over actor messages | [`RingMember`] |
//! | `tls` | cluster CA, node certificates, mutual TLS | [`ClusterCa`], [`NodeIdentity`] |
//! | `cert_kind` | what a certificate's holder may do (lead, spawn) | [`CertKind`] |

// The SDK a user writes against: every public item is documented.
#![deny(missing_docs)]

mod actor;
mod addr;
mod buffers;
mod builtin;
mod cert_kind;
mod codec;
mod collective;
mod congestion;
mod directory;
mod founding;
mod leadership;
mod membership;
mod message;
mod node;
mod shm;
mod supervisor;
mod tls;
mod transport;

pub use actor::{
    spawn, spawn_with_id, Actor, ActorError, ActorRef, Addr, BoxFuture, CallError, Context,
    ExitReason, Handled, Running, TellError,
};
pub use addr::{next_incarnation, validate_segment, ActorId, ActorName, AddrError};
pub use builtin::{register as register_builtins, BulkReceipt, BulkSink, Echo};
pub use codec::{
    decode_bulk_header, encode_frame, read_bulk, read_frame, write_bulk, write_frame,
    write_frame_bytes, Bulk, BulkHeader, BulkLimits, CodecError, DType, FrameDecoder, FrameLimits,
    TensorMeta, BULK_ALIGN, DEFAULT_MAX_BULK, DEFAULT_MAX_FRAME, DEFAULT_MAX_TENSORS,
    FRAME_HEADER_LEN,
};
pub use collective::{ring_segments, CollectiveError, RingMember, RingSpec, RING_CHUNK_BYTES};
// The directory's and supervisor's own short names (`Change`, `Update`, `Event`,
// `Decision`) say too little at the crate root, so they are prefixed here.
pub use cert_kind::CertKind;
pub use directory::{
    ActorEntry, Change as DirectoryChange, Directory, DirectoryError, DirectoryHandle,
    Event as DirectoryEvent, Liveness, NodeEntry, Update as DirectoryUpdate,
};
pub use leadership::{
    admit, judge_beat, successor, Admission, Beat, BeatOutcome, BeatReply, Lead,
    Step as SuccessionStep, Succession,
};
pub use membership::{
    local_inventory, DeviceClaim, DeviceInfo, DeviceKind, FailureDetector, Membership, NodeInfo,
    PauseDetector,
};
pub use message::{decode_body, encode_body, Ack, Message, Wire, WireError, WithBulk};
pub use node::{Node, NodeBuilder, NodeConfig, NodeError, WeakNode};
pub use supervisor::{
    supervise, ChildEvent, Decision as RestartDecision, Lifecycle, NoHooks, RestartPolicy,
    RestartTracker, Supervised,
};
pub use tls::wire_fingerprint;
pub use tls::{
    peer_identity, validate_node_name, ClusterCa, NodeIdentity, PeerIdentity, TlsError,
    TransportTuning, ALPN, CA_CERT_FILE, CA_KEY_FILE, DEFAULT_CONN_WINDOW, DEFAULT_IDLE_TIMEOUT,
    DEFAULT_KEEP_ALIVE, DEFAULT_SEND_WINDOW, DEFAULT_STREAM_WINDOW, MAX_UDP_PAYLOAD,
    MIN_UDP_PAYLOAD, SERVER_NAME,
};
pub use transport::{TransportConfig, TransportError, TransportStats};

/// Raw stream tags for tests that play a misbehaving peer. A namespace of its own so that
/// nothing outside a test reaches for them; this module only re-exports.
#[doc(hidden)]
pub mod testing {
    pub use crate::transport::{TAG_ASK, TAG_ASKS, TAG_TELLS};
}
