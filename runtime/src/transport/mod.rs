//! The QUIC transport: one endpoint per process, one connection per peer.
//!
//! Every stream starts with a one-byte tag saying what it carries:
//!
//! | tag | stream | carries |
//! |---|---|---|
//! | `ASKS` | unidirectional, long-lived per peer | requests with ids (no inline bulk), written in batches |
//! | `REPLIES` | unidirectional, long-lived per peer | the replies to `ASKS`, matched by id |
//! | `TELLS` | unidirectional, long-lived per peer | ordered fire-and-forget actor messages |
//! | `SYSTEM` | unidirectional, long-lived per peer | heartbeats, directory updates, segment releases; never blocked by mailboxes |
//! | `ASK` | bidirectional, one per request | a request with an inline bulk payload, and its reply |
//! | `BULK_TELL` | unidirectional, one per message | a fire-and-forget message with an inline bulk payload |
//! | `BULK_REPLY` | unidirectional, one per reply | a reply to `ASKS` with an inline bulk payload |
//!
//! Small requests share long-lived streams (no stream set-up per call, several calls per
//! datagram); control streams run at a higher priority than bulk ones. Bulk bytes never
//! pass through serde: a small header (dtype, shape, byte ranges) is followed by raw
//! bytes. Between processes on the same host, a bulk payload of at least
//! [`TransportConfig::shm_threshold`] bytes goes through a reusable shared-memory
//! segment instead (`crate::shm`): the message names the segment, the receiver maps
//! it once and releases it when done, so the socket carries a few bytes.
//!
//! A malformed or oversized frame closes that stream with a logged error; the
//! connection and every other stream keep working.
//!
//! This file only declares and re-exports; each concern is a leaf file.

mod bulk;
mod config;
mod endpoint;
mod handshake;
mod inbound;
mod outbound;
mod peer;
mod protocol;
mod routing;
mod throttle;
mod udp;

pub use config::{TransportConfig, TransportError, TransportStats};
pub use endpoint::Transport;
// Raw stream tags for the crate's `testing` namespace.
pub use protocol::{ASK as TAG_ASK, ASKS as TAG_ASKS, TELLS as TAG_TELLS};
pub(crate) use routing::{Dispatch, PeerBook, Target};
pub(crate) use throttle::LogThrottle;
