//! The endpoint and its connections: binding, accepting, dialing peers, closing.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::mpsc;

use super::config::{TransportConfig, TransportError, TransportStats};
use super::handshake;
use super::peer::{Peer, StreamWriter, TellProgress};
use super::protocol::{Control, ASKS, CONTROL_PRIORITY, REPLIES};
use super::routing::{Dispatch, PeerBook, Target};
use super::throttle::LogThrottle;
use super::udp::BatchLimitedSocket;
use crate::actor::CallError;
use crate::buffers::RecvBuffers;
use crate::message::Wire;
use crate::shm::{MappingCache, SegmentPool};
use crate::tls::{self, NodeIdentity, PeerIdentity};

/// One process's QUIC endpoint and its connections.
pub struct Transport {
    pub(super) name: String,
    pub(super) host_id: String,
    pub(super) endpoint: quinn::Endpoint,
    pub(super) config: TransportConfig,
    pub(super) peers: Mutex<HashMap<String, Arc<Peer>>>,
    /// Every connection's peer while it lives, for the idle sweep: `peers` holds one
    /// connection per node, and a second one (both sides dialled at once) also maps
    /// segments.
    pub(super) connections: Mutex<Vec<std::sync::Weak<Peer>>>,
    pub(super) dial_lock: tokio::sync::Mutex<()>,
    pub(super) dispatch: OnceLock<Arc<dyn Dispatch>>,
    pub(super) book: OnceLock<Arc<dyn PeerBook>>,
    pub(super) segments: Arc<SegmentPool>,
    /// Buffers inline bulk payloads are read into, reused once the payload is dropped.
    pub(super) recv_buffers: RecvBuffers,
    /// One line per peer address per [`REFUSAL_LOG_WINDOW`] for refused handshakes.
    refusals: LogThrottle,
    /// Counters.
    pub stats: TransportStats,
}

/// At most one log line per peer address in this window for refused handshakes.
const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// Sweeps the transport's pools for idle buffers until the transport is dropped, a few
/// times per idle period (so a buffer goes at most a quarter of it late).
async fn release_idle_pools(transport: std::sync::Weak<Transport>) {
    let period = match transport.upgrade() {
        Some(t) => (t.config.pool_idle / 4).max(Duration::from_millis(10)),
        None => return,
    };
    let mut tick = tokio::time::interval(period);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match transport.upgrade() {
            Some(t) => t.release_idle(),
            None => return,
        }
    }
}

pub(super) fn bind_socket(
    listen: SocketAddr,
    buffer: usize,
) -> std::io::Result<std::net::UdpSocket> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(
        Domain::for_address(listen),
        Type::DGRAM,
        Some(Protocol::UDP),
    )?;
    // Larger buffers keep bursts of bulk datagrams from being dropped (and retransmitted).
    let _ = socket.set_recv_buffer_size(buffer);
    let _ = socket.set_send_buffer_size(buffer);
    socket.bind(&listen.into())?;
    Ok(socket.into())
}

impl Transport {
    /// Binds the endpoint; it accepts connections once [`Transport::serve`] runs.
    pub(crate) fn bind(
        identity: &NodeIdentity,
        listen: SocketAddr,
        host_id: String,
        config: TransportConfig,
    ) -> Result<Arc<Self>, TransportError> {
        let tuning = config.tuning();
        let server = identity.server_config_with(&tuning)?;
        let client = identity.client_config_with(&tuning)?;
        let bind_err = |reason: String| TransportError::Bind {
            addr: listen,
            reason,
        };
        let socket =
            bind_socket(listen, config.socket_buffer).map_err(|e| bind_err(e.to_string()))?;
        let runtime =
            quinn::default_runtime().ok_or_else(|| bind_err("no async runtime".into()))?;
        let mut endpoint_config = quinn::EndpointConfig::default();
        endpoint_config
            .max_udp_payload_size(
                tuning
                    .max_udp_payload
                    .clamp(tls::MIN_UDP_PAYLOAD, tls::MAX_UDP_PAYLOAD),
            )
            .map_err(|e| bind_err(format!("max_udp_payload: {e}")))?;
        let socket = runtime
            .wrap_udp_socket(socket)
            .map_err(|e| bind_err(e.to_string()))?;
        let socket = Arc::new(BatchLimitedSocket::new(socket));
        let mut endpoint = quinn::Endpoint::new_with_abstract_socket(
            endpoint_config,
            Some(server),
            socket,
            runtime,
        )
        .map_err(|e| bind_err(e.to_string()))?;
        endpoint.set_default_client_config(client);
        crate::shm::remove_stale(&config.shm_dir, &identity.node);
        let segments = SegmentPool::new(
            &config.shm_dir,
            format!("yatt-{}-{}", identity.node, std::process::id()),
            config.shm_pool_bytes,
        );
        let recv_buffers = RecvBuffers::new(config.recv_pool_bytes);
        let transport = Arc::new(Transport {
            name: identity.node.clone(),
            host_id,
            endpoint,
            config,
            peers: Mutex::new(HashMap::new()),
            connections: Mutex::new(Vec::new()),
            dial_lock: tokio::sync::Mutex::new(()),
            dispatch: OnceLock::new(),
            book: OnceLock::new(),
            segments,
            recv_buffers,
            refusals: LogThrottle::new(REFUSAL_LOG_WINDOW),
            stats: TransportStats::default(),
        });
        if !transport.config.pool_idle.is_zero() {
            tokio::spawn(release_idle_pools(Arc::downgrade(&transport)));
        }
        Ok(transport)
    }

    /// Frees the receive buffers and shared-memory segments (sent and mapped) unused
    /// for [`TransportConfig::pool_idle`].
    fn release_idle(&self) {
        let (idle, now) = (self.config.pool_idle, std::time::Instant::now());
        let buffers = self.recv_buffers.release_idle(idle, now);
        let segments = self.segments.release_idle(idle, now);
        let peers: Vec<Arc<Peer>> = {
            let mut connections = self.connections.lock().unwrap_or_else(|p| p.into_inner());
            connections.retain(|p| p.strong_count() > 0);
            connections.iter().filter_map(|p| p.upgrade()).collect()
        };
        for p in peers {
            p.segments.release_idle(idle, now);
        }
        if buffers + segments > 0 {
            tracing::debug!(buffers, segments, "freed idle transport buffers");
        }
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.endpoint
            .local_addr()
            .unwrap_or_else(|_| "0.0.0.0:0".parse().expect("literal"))
    }

    pub(crate) fn set_dispatch(&self, d: Arc<dyn Dispatch>, book: Arc<dyn PeerBook>) {
        let _ = self.dispatch.set(d);
        let _ = self.book.set(book);
    }

    /// Accepts connections until the endpoint closes.
    pub(crate) async fn serve(self: Arc<Self>) {
        while let Some(incoming) = self.endpoint.accept().await {
            let this = self.clone();
            tokio::spawn(async move {
                let remote = incoming.remote_address();
                match tokio::time::timeout(this.config.connect_timeout, incoming).await {
                    Ok(Ok(conn)) => match tls::peer_identity(&conn) {
                        Ok(who) => {
                            this.adopt(who, conn);
                        }
                        Err(e) => {
                            if let Some(suppressed) = this.admit_refusal(remote) {
                                tracing::warn!(%remote, error = %e, suppressed, "refusing peer without a usable certificate (suppressed: same-address refusals not logged in the last 10 s)");
                            }
                            conn.close(1u32.into(), b"bad certificate");
                        }
                    },
                    Ok(Err(e)) => {
                        if let Some(suppressed) = this.admit_refusal(remote) {
                            let error = handshake::explain(&e);
                            tracing::warn!(%remote, %error, suppressed, "handshake refused (suppressed: same-address refusals not logged in the last 10 s)");
                        }
                    }
                    Err(_) => {
                        if let Some(suppressed) = this.admit_refusal(remote) {
                            tracing::warn!(%remote, suppressed, "handshake timed out (suppressed: same-address refusals not logged in the last 10 s)");
                        }
                    }
                }
            });
        }
    }

    /// Whether to log a refused handshake from `remote` (see [`LogThrottle::admit`]).
    fn admit_refusal(&self, remote: SocketAddr) -> Option<u64> {
        self.refusals.admit(remote.ip(), std::time::Instant::now())
    }

    /// Stops accepting new connections (existing ones keep working).
    pub(crate) fn stop_accepting(&self) {
        self.endpoint.set_server_config(None);
    }

    /// Closes every connection and waits (bounded) for the peers to be told.
    pub(crate) async fn close(&self) {
        self.segments.remove_all();
        self.endpoint.close(0u32.into(), b"node shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
    }

    /// Drops the cached connection to `node` (it died).
    pub(crate) fn forget(&self, node: &str) {
        if let Some(p) = self.lock_peers().remove(node) {
            p.conn.close(2u32.into(), b"peer declared dead");
            p.fail_pending("peer declared dead");
        }
    }

    /// [`Transport::forget`] for a peer that left on its own: it may still be reading the
    /// answer to its leave (closing at once discarded that answer, and the peer took its
    /// leave for unannounced), so its connection is left for it to close, and closed
    /// here after `grace` at the latest.
    pub(crate) fn forget_departed(&self, node: &str, grace: std::time::Duration) {
        let Some(p) = self.lock_peers().remove(node) else {
            return;
        };
        p.fail_pending("peer left the cluster");
        let conn = p.conn.clone();
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return conn.close(2u32.into(), b"peer left");
        };
        rt.spawn(async move {
            let _ = tokio::time::timeout(grace, conn.closed()).await;
            conn.close(2u32.into(), b"peer left");
        });
    }

    pub(super) fn lock_peers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Peer>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection (dialled or accepted) and serves the streams the peer opens.
    pub(super) fn adopt(self: &Arc<Self>, who: PeerIdentity, conn: quinn::Connection) -> Arc<Peer> {
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let (release_tx, release_rx) = mpsc::unbounded_channel();
        let name = who.name;
        let peer = Arc::new(Peer {
            name: name.clone(),
            kind: who.kind,
            conn: conn.clone(),
            tells_sent: AtomicU64::new(0),
            tells: tokio::sync::Mutex::new(None),
            system: tokio::sync::Mutex::new(None),
            asks: StreamWriter::new(ASKS, CONTROL_PRIORITY),
            replies: StreamWriter::new(REPLIES, CONTROL_PRIORITY),
            next_ask: AtomicU64::new(0),
            pending: Mutex::new(HashMap::new()),
            progress: TellProgress::default(),
            segments: MappingCache::new(release_tx),
        });
        {
            // Pruned here too: with the sweep off (`pool_idle` zero) nothing else would.
            let mut connections = self.connections.lock().unwrap_or_else(|p| p.into_inner());
            connections.retain(|p| p.strong_count() > 0);
            connections.push(Arc::downgrade(&peer));
        }
        let chosen = {
            let mut peers = self.lock_peers();
            match peers.get(&name) {
                // Keep one connection per peer for sending; a second one (both sides
                // dialled at once) is still served until the peer stops using it.
                Some(existing) if existing.conn.close_reason().is_none() => existing.clone(),
                _ => {
                    peers.insert(name, peer.clone());
                    peer.clone()
                }
            }
        };
        let this = self.clone();
        tokio::spawn(this.clone().send_releases(peer.clone(), release_rx));
        tokio::spawn(async move { this.serve_connection(peer).await });
        chosen
    }

    /// Tells the peer which of its segments this side is done with, in batches.
    pub(super) async fn send_releases(
        self: Arc<Self>,
        peer: Arc<Peer>,
        mut rx: mpsc::UnboundedReceiver<u64>,
    ) {
        // Ends with the connection: this task holds the peer, and the peer's mappings
        // hold the sender, so waiting for `rx` to close alone never ends and keeps the
        // peer and its mappings for good.
        loop {
            let id = tokio::select! {
                id = rx.recv() => id,
                _ = peer.conn.closed() => None,
            };
            let Some(id) = id else { return };
            let mut ids = vec![id];
            while let Ok(id) = rx.try_recv() {
                ids.push(id);
            }
            let Ok(body) = postcard::to_stdvec(&Control::Release(ids)) else {
                continue;
            };
            let wire = Wire {
                body: Bytes::from(body),
                bulk: None,
            };
            if self
                .tell_on(&peer, Target::Transport, wire, true)
                .await
                .is_err()
            {
                return;
            }
        }
    }

    pub(super) async fn peer(self: &Arc<Self>, node: &str) -> Result<Arc<Peer>, CallError> {
        if let Some(p) = self.lock_peers().get(node) {
            if p.conn.close_reason().is_none() {
                return Ok(p.clone());
            }
        }
        let (addr, _) = self
            .book
            .get()
            .ok_or_else(|| CallError::NodeDown {
                node: node.to_string(),
            })?
            .lookup(node)?;
        let _dialing = self.dial_lock.lock().await;
        if let Some(p) = self.lock_peers().get(node) {
            if p.conn.close_reason().is_none() {
                return Ok(p.clone());
            }
        }
        let (who, conn) = self.dial(addr).await?;
        if who.name != node {
            conn.close(1u32.into(), b"unexpected node");
            return Err(CallError::Transport {
                node: node.to_string(),
                reason: format!("{addr} answered as node {:?}", who.name),
            });
        }
        Ok(self.adopt(who, conn))
    }

    /// Connects to an address and returns who the peer is, from its certificate.
    pub(crate) async fn dial(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<(PeerIdentity, quinn::Connection), CallError> {
        let fail = |reason: String| CallError::Transport {
            node: addr.to_string(),
            reason,
        };
        let connecting = self
            .endpoint
            .connect(addr, tls::SERVER_NAME)
            .map_err(|e| fail(e.to_string()))?;
        let conn = tokio::time::timeout(self.config.connect_timeout, connecting)
            .await
            .map_err(|_| {
                fail(format!(
                    "handshake timed out after {:?}",
                    self.config.connect_timeout
                ))
            })?
            .map_err(|e| fail(handshake::explain(&e)))?;
        let who = tls::peer_identity(&conn).map_err(|e| fail(e.to_string()))?;
        Ok((who, conn))
    }

    /// Dials a seed by address and keeps the connection as that peer's.
    pub(crate) async fn connect_seed(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<String, CallError> {
        let (who, conn) = self.dial(addr).await?;
        let name = who.name.clone();
        self.adopt(who, conn);
        Ok(name)
    }

    /// Checks that `node` can be reached (connecting if needed) before a message is
    /// committed to the wire, so a failed tell can give the message back.
    pub(crate) async fn reachable(self: &Arc<Self>, node: &str) -> Result<(), CallError> {
        tokio::time::timeout(self.config.connect_timeout, self.peer(node))
            .await
            .map_err(|_| CallError::Transport {
                node: node.to_string(),
                reason: "connect timed out".into(),
            })?
            .map(|_| ())
    }
}
