//! # yatt-runtime
//!
//! The actor runtime that carries every yatt role. It knows nothing of machine learning:
//! what belongs here is local actors with bounded mailboxes and supervision, actor
//! addressing (`node/role/replica` plus an incarnation), the directory of live actors
//! with its epoch, the QUIC transport with mutual TLS (frames, bulk payloads), cluster
//! membership with heartbeats, and remote spawn through a factory registry.
//!
//! | module | concern |
//! |---|---|
//! | [`addr`] | names and incarnations |
//! | [`actor`] | local actors, references, tell/ask |
//! | [`supervisor`] | restart policies |
//! | [`directory`] | who is alive, under an epoch |
//! | [`membership`] | node inventory, failure detection |
//! | [`message`] | what crosses the wire |
//! | [`codec`] | frames and bulk payloads |
//! | [`collective`] | ring all-reduce of f32 buffers over actor messages |
//! | [`tls`] | cluster CA, node certificates, mutual TLS |

pub mod actor;
pub mod addr;
pub mod builtin;
pub mod codec;
pub mod collective;
pub mod directory;
pub mod membership;
pub mod message;
pub mod node;
pub(crate) mod shm;
pub mod supervisor;
pub mod tls;
pub mod transport;

pub use actor::{Actor, ActorError, ActorRef, CallError, Context, TellError};
pub use addr::{ActorId, ActorName};
pub use node::{Node, NodeBuilder, NodeConfig, NodeError};
