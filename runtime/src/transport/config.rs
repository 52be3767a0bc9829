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
    /// Most memory kept in unused receive buffers for inline bulk payloads, in bytes:
    /// a payload's buffer is reused for the next one of about its size once dropped.
    pub recv_pool_bytes: usize,
    /// How long an unused receive buffer or shared-memory segment is kept for the next
    /// payload before it is freed (zero: kept until the pools need the room), so a
    /// daemon whose job has ended gives the memory back.
    pub pool_idle: Duration,
    /// UDP socket send and receive buffer size, in bytes (the kernel may cap it).
    pub socket_buffer: usize,
    /// UDP payload size of the first packets, before path MTU discovery confirms a
    /// larger one (1200, QUIC's minimum, is safe on any path).
    pub initial_udp_payload: u16,
    /// Largest UDP payload this node sends (path MTU discovery probes up to it) and
    /// accepts, in bytes: 1200 to 65527. The default lets loopback reach 64 KiB packets;
    /// on a real network discovery stops at the path's MTU.
    pub max_udp_payload: u16,
    /// Ceiling on each connection's congestion window, in bytes (0: none). Keep it below
    /// the peers' UDP receive buffer (Linux grants twice `socket_buffer`, up to
    /// `net.core.rmem_max`): a larger window overflows it whenever the receiver is
    /// descheduled for a moment, and every drop halves the window.
    pub max_congestion_window: u64,
}

impl TransportConfig {
    /// The QUIC tuning of this node's connections.
    pub(super) fn tuning(&self) -> tls::TransportTuning {
        tls::TransportTuning {
            initial_udp_payload: self.initial_udp_payload,
            max_udp_payload: self.max_udp_payload,
            max_congestion_window: self.max_congestion_window,
            ..tls::TransportTuning::default()
        }
    }
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
            recv_pool_bytes: 256 << 20,
            pool_idle: Duration::from_secs(30),
            socket_buffer: 4 << 20,
            initial_udp_payload: tls::MIN_UDP_PAYLOAD,
            max_udp_payload: tls::MAX_UDP_PAYLOAD,
            max_congestion_window: tls::DEFAULT_MAX_CWND,
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
