//! The transport's settings, counters and errors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use crate::codec::{BulkLimits, FrameLimits};
use crate::tls::{self};

/// Transport settings.
#[derive(Debug, Clone)]
pub struct TransportConfig {
    /// Largest control frame accepted on any stream.
    pub frame_limits: FrameLimits,
    /// Largest bulk payload and tensor count accepted.
    pub bulk_limits: BulkLimits,
    /// How long to wait for a QUIC handshake.
    pub connect_timeout: Duration,
    /// How long a fire-and-forget write may wait for flow control.
    pub tell_timeout: Duration,
    /// Use shared memory for bulk payloads to peers on the same host.
    pub shm_fast_path: bool,
    /// Smallest bulk payload sent through shared memory.
    pub shm_threshold: usize,
    /// Most shared memory this process keeps in segments, in bytes.
    pub shm_pool_bytes: usize,
    /// Where shared-memory segments are created.
    pub shm_dir: PathBuf,
    /// UDP socket send and receive buffer size, in bytes (the kernel may cap it).
    pub socket_buffer: usize,
}

impl Default for TransportConfig {
    fn default() -> Self {
        TransportConfig {
            frame_limits: FrameLimits::default(),
            bulk_limits: BulkLimits::default(),
            connect_timeout: Duration::from_secs(5),
            tell_timeout: Duration::from_secs(10),
            shm_fast_path: true,
            shm_threshold: 256 << 10,
            shm_pool_bytes: 1 << 30,
            shm_dir: "/dev/shm".into(),
            socket_buffer: 4 << 20,
        }
    }
}

/// Counters exported as metrics.
#[derive(Debug, Default)]
pub struct TransportStats {
    /// Requests sent (asks and tells).
    pub sent: AtomicU64,
    /// Requests received.
    pub received: AtomicU64,
    /// Bulk bytes sent, inline or through shared memory.
    pub bulk_bytes_sent: AtomicU64,
    /// Streams closed because of a malformed, oversized or truncated frame.
    pub bad_frames: AtomicU64,
    /// Connections accepted or dialled.
    pub connections: AtomicU64,
}

/// Errors starting the transport.
#[derive(Debug, thiserror::Error)]
pub enum TransportError {
    /// The listen address could not be bound.
    #[error("cannot listen on {addr}: {reason} (is another process using the port? pick another with --listen)")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The OS error.
        reason: String,
    },
    /// The TLS configuration could not be built.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
}
