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

const ASK: u8 = 1;
const TELLS: u8 = 2;
const SYSTEM: u8 = 3;
const BULK_TELL: u8 = 4;
const ASKS: u8 = 5;
const REPLIES: u8 = 6;
const BULK_REPLY: u8 = 7;

const CONTROL_PRIORITY: i32 = 10;
const BULK_PRIORITY: i32 = -10;
/// Frames a stream writer gathers into one write.
const WRITE_BATCH: usize = 64;

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

/// Transport-to-transport messages.
#[derive(Debug, Serialize, Deserialize)]
enum Control {
    /// The receiver is done with these shared-memory segments.
    Release(Vec<u64>),
}

/// Where a message's bulk payload is.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum BulkRef {
    None,
    /// Follows the head on the same stream.
    Inline,
    /// In a shared-memory segment of the sender's.
    Shm {
        path: String,
        id: u64,
        header: BulkHeader,
    },
}

#[derive(Debug, Serialize, Deserialize)]
struct RequestHead {
    target: Target,
    /// Ordered tells this sender had written on the connection before this request;
    /// the receiver queues the request only after as many tells, so a tell followed by
    /// an ask from one node reaches the mailbox in that order.
    after_tells: u64,
    timeout_ms: u64,
    body: Bytes,
    bulk: BulkRef,
}

#[derive(Debug, Serialize, Deserialize)]
struct ReplyHead {
    result: Result<(Bytes, BulkRef), CallError>,
}

/// A request on the long-lived `ASKS` stream.
#[derive(Debug, Serialize, Deserialize)]
struct AskFrame {
    id: u64,
    head: RequestHead,
}

/// A reply on `REPLIES` or `BULK_REPLY`.
#[derive(Debug, Serialize, Deserialize)]
struct ReplyFrame {
    id: u64,
    head: ReplyHead,
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

/// A long-lived outgoing stream fed through a channel by a writer task, which gathers
/// queued frames into one write.
struct StreamWriter {
    tag: u8,
    priority: i32,
    tx: Mutex<Option<mpsc::Sender<Bytes>>>,
}

impl StreamWriter {
    fn new(tag: u8, priority: i32) -> Self {
        StreamWriter {
            tag,
            priority,
            tx: Mutex::new(None),
        }
    }

    /// Queues a frame, starting the writer (and its stream) if needed. Waits while the
    /// queue is full: that is the backpressure of a slow peer.
    async fn send(&self, conn: &quinn::Connection, frame: Bytes) -> Result<(), String> {
        let tx = {
            let mut guard = self.tx.lock().unwrap_or_else(|p| p.into_inner());
            match guard.as_ref() {
                Some(tx) if !tx.is_closed() => tx.clone(),
                _ => {
                    let (tx, rx) = mpsc::channel(1024);
                    tokio::spawn(write_loop(conn.clone(), self.tag, self.priority, rx));
                    *guard = Some(tx.clone());
                    tx
                }
            }
        };
        tx.send(frame)
            .await
            .map_err(|_| "stream writer stopped".to_string())
    }
}

async fn write_loop(
    conn: quinn::Connection,
    tag: u8,
    priority: i32,
    mut rx: mpsc::Receiver<Bytes>,
) {
    let mut stream = match conn.open_uni().await {
        Ok(s) => s,
        Err(e) => {
            tracing::debug!(error = %e, "cannot open a long-lived stream");
            return;
        }
    };
    stream.set_priority(priority).ok();
    let mut batch = vec![Bytes::copy_from_slice(&[tag])];
    while let Some(frame) = rx.recv().await {
        batch.push(frame);
        while batch.len() < WRITE_BATCH {
            match rx.try_recv() {
                Ok(f) => batch.push(f),
                Err(_) => break,
            }
        }
        if let Err(e) = stream.write_all_chunks(&mut batch).await {
            tracing::debug!(error = %e, "long-lived stream failed");
            return;
        }
        batch.clear();
    }
    let _ = stream.finish();
}

type PendingReply = oneshot::Sender<Result<Wire, CallError>>;

/// One connection to a peer, and everything kept per connection.
struct Peer {
    name: String,
    conn: quinn::Connection,
    /// Ordered tells written on this connection.
    tells_sent: AtomicU64,
    tells: tokio::sync::Mutex<Option<quinn::SendStream>>,
    system: tokio::sync::Mutex<Option<quinn::SendStream>>,
    asks: StreamWriter,
    replies: StreamWriter,
    next_ask: AtomicU64,
    pending: Mutex<HashMap<u64, PendingReply>>,
    /// Ordered tells from the peer queued into mailboxes (receiving side).
    progress: TellProgress,
    /// The peer's shared-memory segments, mapped (receiving side).
    segments: MappingCache,
}

impl Peer {
    fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, PendingReply>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn fail_pending(&self, reason: &str) {
        for (_, tx) in self.lock_pending().drain() {
            let _ = tx.send(Err(CallError::Transport {
                node: self.name.clone(),
                reason: reason.to_string(),
            }));
        }
    }
}

/// Removes a pending ask when the asker stops waiting (deadline, cancellation).
struct PendingGuard<'a> {
    peer: &'a Peer,
    id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.peer.lock_pending().remove(&self.id);
    }
}

/// How the transport finds a peer's address and host.
pub(crate) trait PeerBook: Send + Sync + 'static {
    /// The address and host id of a node, if known and not dead.
    fn lookup(&self, node: &str) -> Result<(SocketAddr, String), CallError>;
}

/// One process's QUIC endpoint and its connections.
pub struct Transport {
    name: String,
    host_id: String,
    endpoint: quinn::Endpoint,
    config: TransportConfig,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    dial_lock: tokio::sync::Mutex<()>,
    dispatch: OnceLock<Arc<dyn Dispatch>>,
    book: OnceLock<Arc<dyn PeerBook>>,
    segments: Arc<SegmentPool>,
    /// Counters.
    pub stats: TransportStats,
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

fn bind_socket(listen: SocketAddr, buffer: usize) -> std::io::Result<std::net::UdpSocket> {
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
        let server = identity.server_config()?;
        let client = identity.client_config()?;
        let bind_err = |reason: String| TransportError::Bind {
            addr: listen,
            reason,
        };
        let socket =
            bind_socket(listen, config.socket_buffer).map_err(|e| bind_err(e.to_string()))?;
        let runtime =
            quinn::default_runtime().ok_or_else(|| bind_err("no async runtime".into()))?;
        let mut endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
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
        Ok(Arc::new(Transport {
            name: identity.node.clone(),
            host_id,
            endpoint,
            config,
            peers: Mutex::new(HashMap::new()),
            dial_lock: tokio::sync::Mutex::new(()),
            dispatch: OnceLock::new(),
            book: OnceLock::new(),
            segments,
            stats: TransportStats::default(),
        }))
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
                    Ok(Ok(conn)) => match tls::peer_node_name(&conn) {
                        Ok(name) => {
                            this.adopt(name, conn);
                        }
                        Err(e) => {
                            tracing::warn!(%remote, error = %e, "refusing peer without a usable certificate");
                            conn.close(1u32.into(), b"bad certificate");
                        }
                    },
                    Ok(Err(e)) => tracing::warn!(%remote, error = %e, "handshake refused"),
                    Err(_) => tracing::warn!(%remote, "handshake timed out"),
                }
            });
        }
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

    fn lock_peers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Peer>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection (dialled or accepted) and serves the streams the peer opens.
    fn adopt(self: &Arc<Self>, name: String, conn: quinn::Connection) -> Arc<Peer> {
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let (release_tx, release_rx) = mpsc::unbounded_channel();
        let peer = Arc::new(Peer {
            name: name.clone(),
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
    async fn send_releases(self: Arc<Self>, peer: Arc<Peer>, mut rx: mpsc::UnboundedReceiver<u64>) {
        while let Some(id) = rx.recv().await {
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

    async fn serve_connection(self: Arc<Self>, peer: Arc<Peer>) {
        let conn = peer.conn.clone();
        let bi = {
            let (this, conn, peer) = (self.clone(), conn.clone(), peer.clone());
            async move {
                while let Ok((send, recv)) = conn.accept_bi().await {
                    let (this, peer) = (this.clone(), peer.clone());
                    tokio::spawn(async move {
                        if let Err(e) = this.serve_ask(&peer, send, recv).await {
                            this.note_bad_stream(&peer.name, &e);
                        }
                    });
                }
            }
        };
        let uni = {
            let (this, conn, peer) = (self.clone(), conn.clone(), peer.clone());
            async move {
                while let Ok(recv) = conn.accept_uni().await {
                    let (this, peer) = (this.clone(), peer.clone());
                    tokio::spawn(async move {
                        if let Err(e) = this.serve_uni(&peer, recv).await {
                            this.note_bad_stream(&peer.name, &e);
                        }
                    });
                }
            }
        };
        tokio::join!(bi, uni);
        peer.fail_pending("connection lost");
        let mut peers = self.lock_peers();
        if peers
            .get(&peer.name)
            .is_some_and(|p| p.conn.stable_id() == conn.stable_id())
        {
            peers.remove(&peer.name);
        }
    }

    fn note_bad_stream(&self, peer: &str, e: &CodecError) {
        let benign = matches!(e, CodecError::ConnectionLost(_));
        if !benign {
            self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "closed a stream with a bad frame; the connection stays up");
        }
    }

    fn dispatch(&self) -> Result<&Arc<dyn Dispatch>, CallError> {
        self.dispatch.get().ok_or_else(|| CallError::Unavailable {
            node: self.name.clone(),
            reason: "node is starting".into(),
        })
    }

    /// Runs a request for a peer: waits for earlier tells, dispatches, and returns the
    /// reply head plus a bulk payload still to be sent inline, if any.
    async fn run_request(
        &self,
        peer: &Peer,
        head: RequestHead,
        wire: Result<Wire, CodecError>,
    ) -> (ReplyHead, Option<Bulk>) {
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        let timeout = Duration::from_millis(head.timeout_ms);
        let result = match wire {
            Err(e) => Err(CallError::Codec(e.to_string())),
            Ok(wire) => {
                if !peer.progress.wait_for(head.after_tells, timeout).await {
                    Err(match &head.target {
                        Target::Actor(id) => CallError::Timeout {
                            target: id.clone(),
                            after: timeout,
                        },
                        _ => CallError::Unavailable {
                            node: self.name.clone(),
                            reason: format!("earlier messages did not arrive within {timeout:?}"),
                        },
                    })
                } else {
                    match self.dispatch() {
                        Ok(d) => d.ask(&peer.name, head.target, wire, timeout).await,
                        Err(e) => Err(e),
                    }
                }
            }
        };
        match result {
            Ok(wire) => {
                let (bulk_ref, bulk) = self.place_bulk(&peer.name, wire.bulk).await;
                (
                    ReplyHead {
                        result: Ok((wire.body, bulk_ref)),
                    },
                    bulk,
                )
            }
            Err(e) => (ReplyHead { result: Err(e) }, None),
        }
    }

    async fn serve_ask(
        &self,
        peer: &Arc<Peer>,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
    ) -> Result<(), CodecError> {
        let mut tag = [0u8; 1];
        recv.read_exact(&mut tag).await.map_err(read_exact_err)?;
        if tag[0] != ASK {
            let _ = recv.stop(3u32.into());
            return Err(CodecError::BadHeader(format!(
                "bidirectional stream with tag {}",
                tag[0]
            )));
        }
        let head: RequestHead = self.read_head(&mut recv).await?;
        let wire = self
            .read_bulk(peer, &mut recv, head.bulk.clone(), head.body.clone())
            .await;
        let (reply, bulk) = self.run_request(peer, head, wire).await;
        let frame = encode_tagged(None, &reply, &self.config.frame_limits)
            .map_err(|e| CodecError::BadHeader(e.to_string()))?;
        send.write_all_chunks(&mut [frame]).await?;
        if let Some(bulk) = bulk {
            send.set_priority(BULK_PRIORITY).ok();
            codec::write_bulk(&mut send, &bulk, &self.config.bulk_limits).await?;
        }
        let _ = send.finish();
        Ok(())
    }

    async fn serve_uni(
        self: &Arc<Self>,
        peer: &Arc<Peer>,
        mut recv: quinn::RecvStream,
    ) -> Result<(), CodecError> {
        let mut tag = [0u8; 1];
        recv.read_exact(&mut tag).await.map_err(read_exact_err)?;
        match tag[0] {
            TELLS | SYSTEM => {
                let ordered = tag[0] == TELLS;
                while let Some(frame) =
                    codec::read_frame(&mut recv, &self.config.frame_limits).await?
                {
                    let head: RequestHead = decode(&frame)?;
                    if !matches!(head.bulk, BulkRef::None) {
                        return Err(CodecError::BadHeader(
                            "bulk reference on an ordered stream".into(),
                        ));
                    }
                    self.stats.received.fetch_add(1, Ordering::Relaxed);
                    let wire = Wire {
                        body: head.body,
                        bulk: None,
                    };
                    match head.target {
                        Target::Transport => self.handle_control(&wire.body)?,
                        target => {
                            if let Ok(d) = self.dispatch() {
                                // Awaiting here is the backpressure: the peer's writes
                                // stall on flow control while the mailbox is full.
                                d.tell(&peer.name, target, wire).await;
                            }
                        }
                    }
                    if ordered {
                        peer.progress.delivered();
                    }
                }
                Ok(())
            }
            ASKS => {
                while let Some(frame) =
                    codec::read_frame(&mut recv, &self.config.frame_limits).await?
                {
                    let AskFrame { id, head } = decode(&frame)?;
                    let wire = match &head.bulk {
                        BulkRef::Inline => {
                            return Err(CodecError::BadHeader(
                                "inline bulk on the shared request stream".into(),
                            ))
                        }
                        BulkRef::None => Ok(Wire {
                            body: head.body.clone(),
                            bulk: None,
                        }),
                        BulkRef::Shm { path, id, header } => self
                            .map_segment(peer, path, *id, header.clone())
                            .map(|bulk| Wire {
                                body: head.body.clone(),
                                bulk: Some(bulk),
                            }),
                    };
                    let (this, peer) = (self.clone(), peer.clone());
                    tokio::spawn(async move {
                        let (reply, bulk) = this.run_request(&peer, head, wire).await;
                        if let Err(e) = this.send_reply(&peer, id, reply, bulk).await {
                            tracing::debug!(peer = %peer.name, error = %e, "reply not sent");
                        }
                    });
                }
                Ok(())
            }
            REPLIES => {
                while let Some(frame) =
                    codec::read_frame(&mut recv, &self.config.frame_limits).await?
                {
                    let ReplyFrame { id, head } = decode(&frame)?;
                    let result = self.reply_wire(peer, head, None).await;
                    if let Some(tx) = peer.lock_pending().remove(&id) {
                        let _ = tx.send(result);
                    }
                }
                Ok(())
            }
            BULK_REPLY => {
                let ReplyFrame { id, head } = self.read_head(&mut recv).await?;
                let result = self.reply_wire(peer, head, Some(&mut recv)).await;
                if let Some(tx) = peer.lock_pending().remove(&id) {
                    let _ = tx.send(result);
                }
                Ok(())
            }
            BULK_TELL => {
                let head: RequestHead = self.read_head(&mut recv).await?;
                let wire = self
                    .read_bulk(peer, &mut recv, head.bulk.clone(), head.body.clone())
                    .await?;
                self.stats.received.fetch_add(1, Ordering::Relaxed);
                if let Ok(d) = self.dispatch() {
                    d.tell(&peer.name, head.target, wire).await;
                }
                Ok(())
            }
            other => {
                let _ = recv.stop(3u32.into());
                Err(CodecError::BadHeader(format!(
                    "unidirectional stream with tag {other}"
                )))
            }
        }
    }

    fn handle_control(&self, body: &[u8]) -> Result<(), CodecError> {
        match decode::<Control>(body)? {
            Control::Release(ids) => {
                for id in ids {
                    self.segments.release(id);
                }
            }
        }
        Ok(())
    }

    /// Sends a reply to an `ASKS` request: on the shared reply stream, or on a stream
    /// of its own when it carries an inline bulk payload.
    async fn send_reply(
        &self,
        peer: &Peer,
        id: u64,
        head: ReplyHead,
        bulk: Option<Bulk>,
    ) -> Result<(), String> {
        let frame = ReplyFrame { id, head };
        match bulk {
            None => {
                let bytes = encode_tagged(None, &frame, &self.config.frame_limits)
                    .map_err(|e| e.to_string())?;
                peer.replies.send(&peer.conn, bytes).await
            }
            Some(bulk) => {
                let bytes = encode_tagged(Some(BULK_REPLY), &frame, &self.config.frame_limits)
                    .map_err(|e| e.to_string())?;
                let mut s = peer.conn.open_uni().await.map_err(|e| e.to_string())?;
                s.set_priority(BULK_PRIORITY).ok();
                self.write_message(&mut s, bytes, Some(&bulk)).await
            }
        }
    }

    /// Writes an encoded head frame, then the bulk payload if any, and finishes the
    /// stream.
    async fn write_message(
        &self,
        send: &mut quinn::SendStream,
        frame: Bytes,
        bulk: Option<&Bulk>,
    ) -> Result<(), String> {
        send.write_all_chunks(&mut [frame])
            .await
            .map_err(|e| e.to_string())?;
        if let Some(bulk) = bulk {
            codec::write_bulk(send, bulk, &self.config.bulk_limits)
                .await
                .map_err(|e| e.to_string())?;
        }
        let _ = send.finish();
        Ok(())
    }

    /// Turns a reply head (and its bulk, inline on `recv` or in a segment) into a wire.
    async fn reply_wire(
        &self,
        peer: &Peer,
        head: ReplyHead,
        recv: Option<&mut quinn::RecvStream>,
    ) -> Result<Wire, CallError> {
        let lost = |reason: String| CallError::Transport {
            node: peer.name.clone(),
            reason,
        };
        match head.result {
            Err(e) => Err(e),
            Ok((body, BulkRef::None)) => Ok(Wire { body, bulk: None }),
            Ok((body, BulkRef::Shm { path, id, header })) => {
                let bulk = self
                    .map_segment(peer, &path, id, header)
                    .map_err(|e| lost(e.to_string()))?;
                Ok(Wire {
                    body,
                    bulk: Some(bulk),
                })
            }
            Ok((body, BulkRef::Inline)) => match recv {
                Some(recv) => {
                    let bulk = codec::read_bulk(recv, &self.config.bulk_limits)
                        .await
                        .map_err(|e| lost(e.to_string()))?;
                    Ok(Wire {
                        body,
                        bulk: Some(bulk),
                    })
                }
                None => Err(lost("inline bulk on the shared reply stream".into())),
            },
        }
    }

    async fn read_head<T: serde::de::DeserializeOwned>(
        &self,
        recv: &mut quinn::RecvStream,
    ) -> Result<T, CodecError> {
        let frame = codec::read_frame(recv, &self.config.frame_limits)
            .await?
            .ok_or(CodecError::Truncated { needed: 4, have: 0 })?;
        decode(&frame)
    }

    async fn read_bulk(
        &self,
        peer: &Peer,
        recv: &mut quinn::RecvStream,
        bulk: BulkRef,
        body: Bytes,
    ) -> Result<Wire, CodecError> {
        let bulk = match bulk {
            BulkRef::None => None,
            BulkRef::Inline => Some(codec::read_bulk(recv, &self.config.bulk_limits).await?),
            BulkRef::Shm { path, id, header } => Some(self.map_segment(peer, &path, id, header)?),
        };
        Ok(Wire { body, bulk })
    }

    fn map_segment(
        &self,
        peer: &Peer,
        path: &str,
        id: u64,
        header: BulkHeader,
    ) -> Result<Bulk, CodecError> {
        let p = std::path::Path::new(path);
        let allowed = p.parent().is_some_and(|d| d == self.config.shm_dir)
            && p.file_name().is_some_and(|f| {
                f.to_string_lossy()
                    .starts_with(&format!("yatt-{}-", peer.name))
            });
        if !allowed {
            return Err(CodecError::InvalidBulk {
                reason: format!(
                    "shared-memory segment {path:?} is not one of {}'s in {}",
                    peer.name,
                    self.config.shm_dir.display()
                ),
            });
        }
        header.validate(&self.config.bulk_limits)?;
        let len = usize::try_from(header.total_len).map_err(|_| CodecError::InvalidBulk {
            reason: format!("total_len {} does not fit in memory", header.total_len),
        })?;
        let data = peer
            .segments
            .bytes(p, id, len)
            .map_err(|e| CodecError::Io(format!("shared-memory segment {path}: {e}")))?;
        Bulk::with_limits(header, data, &self.config.bulk_limits)
    }

    /// Decides how a bulk payload travels to `peer`: through a shared-memory segment
    /// when the peer is on this host, otherwise inline after the head.
    async fn place_bulk(&self, peer: &str, bulk: Option<Bulk>) -> (BulkRef, Option<Bulk>) {
        let Some(bulk) = bulk else {
            return (BulkRef::None, None);
        };
        self.stats
            .bulk_bytes_sent
            .fetch_add(bulk.data.len() as u64, Ordering::Relaxed);
        let same_host = self
            .book
            .get()
            .and_then(|b| b.lookup(peer).ok())
            .is_some_and(|(_, host)| host == self.host_id);
        if self.config.shm_fast_path && same_host && bulk.data.len() >= self.config.shm_threshold {
            match self.segments.lease(bulk.data.len()) {
                Ok(Some(mut lease)) => {
                    let data = bulk.data.clone();
                    // Copying megabytes is CPU work: keep it off the async workers.
                    let lease = tokio::task::spawn_blocking(move || {
                        lease.as_mut().copy_from_slice(&data);
                        lease
                    })
                    .await;
                    if let Ok(lease) = lease {
                        let r = BulkRef::Shm {
                            path: lease.path.to_string_lossy().into_owned(),
                            id: lease.id,
                            header: bulk.header,
                        };
                        lease.sent();
                        return (r, None);
                    }
                }
                Ok(None) => tracing::debug!("shared-memory pool full; sending inline"),
                Err(e) => {
                    tracing::warn!(error = %e, "shared-memory fast path failed; sending inline")
                }
            }
        }
        (BulkRef::Inline, Some(bulk))
    }

    async fn peer(self: &Arc<Self>, node: &str) -> Result<Arc<Peer>, CallError> {
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
        let (name, conn) = self.dial(addr).await?;
        if name != node {
            conn.close(1u32.into(), b"unexpected node");
            return Err(CallError::Transport {
                node: node.to_string(),
                reason: format!("{addr} answered as node {name:?}"),
            });
        }
        Ok(self.adopt(name, conn))
    }

    /// Connects to an address and returns the peer's node name from its certificate.
    pub(crate) async fn dial(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<(String, quinn::Connection), CallError> {
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
            .map_err(|e| fail(e.to_string()))?;
        let name = tls::peer_node_name(&conn).map_err(|e| fail(e.to_string()))?;
        Ok((name, conn))
    }

    /// Dials a seed by address and keeps the connection as that peer's.
    pub(crate) async fn connect_seed(
        self: &Arc<Self>,
        addr: SocketAddr,
    ) -> Result<String, CallError> {
        let (name, conn) = self.dial(addr).await?;
        self.adopt(name.clone(), conn);
        Ok(name)
    }

    /// Sends a request and waits for the reply, all within `timeout`.
    pub(crate) async fn ask(
        self: &Arc<Self>,
        node: &str,
        target: Target,
        wire: Wire,
        timeout: Duration,
    ) -> Result<Wire, CallError> {
        let timed_out = {
            let target = target.clone();
            move || match target {
                Target::Actor(target) => CallError::Timeout {
                    target,
                    after: timeout,
                },
                _ => CallError::Transport {
                    node: node.to_string(),
                    reason: format!("no reply within {timeout:?}"),
                },
            }
        };
        let work = async {
            let peer = self.peer(node).await?;
            let (bulk_ref, bulk) = self.place_bulk(node, wire.bulk).await;
            let head = RequestHead {
                target: target.clone(),
                after_tells: peer.tells_sent.load(Ordering::Acquire),
                timeout_ms: timeout.as_millis() as u64,
                body: wire.body,
                bulk: bulk_ref,
            };
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
            match bulk {
                None => self.ask_shared(&peer, head).await,
                Some(bulk) => self.ask_own_stream(&peer, head, bulk).await,
            }
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(timed_out()),
        }
    }

    /// An ask on the long-lived request stream; the reply comes back by id.
    async fn ask_shared(&self, peer: &Peer, head: RequestHead) -> Result<Wire, CallError> {
        let id = peer.next_ask.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        peer.lock_pending().insert(id, tx);
        let _guard = PendingGuard { peer, id };
        let frame = encode_tagged(None, &AskFrame { id, head }, &self.config.frame_limits)?;
        peer.asks
            .send(&peer.conn, frame)
            .await
            .map_err(|reason| CallError::Transport {
                node: peer.name.clone(),
                reason,
            })?;
        rx.await.unwrap_or_else(|_| {
            Err(CallError::Transport {
                node: peer.name.clone(),
                reason: "connection lost before the reply".into(),
            })
        })
    }

    /// An ask with an inline bulk payload, on a bidirectional stream of its own.
    async fn ask_own_stream(
        &self,
        peer: &Peer,
        head: RequestHead,
        bulk: Bulk,
    ) -> Result<Wire, CallError> {
        let lost = |e: String| CallError::Transport {
            node: peer.name.clone(),
            reason: e,
        };
        let frame = encode_tagged(Some(ASK), &head, &self.config.frame_limits)?;
        let (mut send, mut recv) = peer.conn.open_bi().await.map_err(|e| lost(e.to_string()))?;
        send.set_priority(BULK_PRIORITY).ok();
        self.write_message(&mut send, frame, Some(&bulk))
            .await
            .map_err(lost)?;
        let reply: ReplyHead = self
            .read_head(&mut recv)
            .await
            .map_err(|e| lost(e.to_string()))?;
        self.reply_wire(peer, reply, Some(&mut recv)).await
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

    /// Sends a fire-and-forget message. Messages without bulk keep their order per peer
    /// (one long-lived stream); `system` ones use a stream of their own that actor
    /// mailboxes never block.
    pub(crate) async fn tell(
        self: &Arc<Self>,
        node: &str,
        target: Target,
        wire: Wire,
        system: bool,
    ) -> Result<(), CallError> {
        let lost = |reason: String| CallError::Transport {
            node: node.to_string(),
            reason,
        };
        let work = async {
            let peer = self.peer(node).await?;
            self.tell_on(&peer, target, wire, system).await
        };
        tokio::time::timeout(self.config.tell_timeout, work)
            .await
            .map_err(|_| lost(format!("send stalled for {:?}", self.config.tell_timeout)))?
    }

    async fn tell_on(
        &self,
        peer: &Peer,
        target: Target,
        wire: Wire,
        system: bool,
    ) -> Result<(), CallError> {
        let lost = |reason: String| CallError::Transport {
            node: peer.name.clone(),
            reason,
        };
        self.stats.sent.fetch_add(1, Ordering::Relaxed);
        let (bulk_ref, bulk) = self.place_bulk(&peer.name, wire.bulk).await;
        let head = RequestHead {
            target,
            after_tells: 0,
            timeout_ms: 0,
            body: wire.body,
            bulk: bulk_ref,
        };
        if bulk.is_some() || matches!(head.bulk, BulkRef::Shm { .. }) {
            // Ordered streams carry no bulk, not even a segment reference: such a message
            // gets a stream of its own.
            let frame = encode_tagged(Some(BULK_TELL), &head, &self.config.frame_limits)?;
            let mut send = peer
                .conn
                .open_uni()
                .await
                .map_err(|e| lost(e.to_string()))?;
            send.set_priority(BULK_PRIORITY).ok();
            return self
                .write_message(&mut send, frame, bulk.as_ref())
                .await
                .map_err(lost);
        }
        let (slot, tag, priority) = if system {
            (&peer.system, SYSTEM, CONTROL_PRIORITY + 10)
        } else {
            (&peer.tells, TELLS, CONTROL_PRIORITY)
        };
        let mut stream = slot.lock().await;
        let tagged = stream.is_none();
        let frame = encode_tagged(tagged.then_some(tag), &head, &self.config.frame_limits)?;
        if stream.is_none() {
            let s = peer
                .conn
                .open_uni()
                .await
                .map_err(|e| lost(e.to_string()))?;
            s.set_priority(priority).ok();
            *stream = Some(s);
        }
        let s = stream.as_mut().expect("opened above");
        if let Err(e) = s.write_all_chunks(&mut [frame]).await {
            *stream = None;
            return Err(lost(e.to_string()));
        }
        if !system {
            peer.tells_sent.fetch_add(1, Ordering::AcqRel);
        }
        Ok(())
    }
}

fn decode<T: serde::de::DeserializeOwned>(frame: &[u8]) -> Result<T, CodecError> {
    postcard::from_bytes(frame).map_err(|e| CodecError::BadHeader(e.to_string()))
}

/// Encodes `[tag][u32 length][postcard]` in one buffer.
fn encode_tagged<T: Serialize>(
    tag: Option<u8>,
    value: &T,
    limits: &FrameLimits,
) -> Result<Bytes, CallError> {
    let mut buf = Vec::with_capacity(128);
    if let Some(t) = tag {
        buf.push(t);
    }
    let at = buf.len();
    buf.extend_from_slice(&[0; codec::FRAME_HEADER_LEN]);
    let mut buf = postcard::to_extend(value, buf).map_err(|e| CallError::Codec(e.to_string()))?;
    let len = buf.len() - at - codec::FRAME_HEADER_LEN;
    if len > limits.max_frame {
        return Err(CallError::Codec(format!(
            "message of {len} bytes exceeds the frame limit of {} bytes; send large data as a bulk payload",
            limits.max_frame
        )));
    }
    buf[at..at + codec::FRAME_HEADER_LEN].copy_from_slice(&(len as u32).to_le_bytes());
    Ok(Bytes::from(buf))
}

/// How many ordered tells of one connection have been queued into mailboxes.
#[derive(Default)]
struct TellProgress {
    delivered: AtomicU64,
    changed: tokio::sync::Notify,
}

impl TellProgress {
    fn delivered(&self) {
        self.delivered.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Waits until `count` tells were queued; false if the deadline passed first.
    async fn wait_for(&self, count: u64, timeout: Duration) -> bool {
        if self.delivered.load(Ordering::Acquire) >= count {
            return true;
        }
        let wait = async {
            loop {
                let notified = self.changed.notified();
                if self.delivered.load(Ordering::Acquire) >= count {
                    return;
                }
                notified.await;
            }
        };
        tokio::time::timeout(timeout, wait).await.is_ok()
    }
}

fn read_exact_err(e: quinn::ReadExactError) -> CodecError {
    match e {
        quinn::ReadExactError::FinishedEarly(have) => CodecError::Truncated {
            needed: 1,
            have: have as u64,
        },
        quinn::ReadExactError::ReadError(e) => CodecError::ConnectionLost(e.to_string()),
    }
}

/// Raw access for tests that play a misbehaving peer.
#[doc(hidden)]
pub mod testing {
    /// The stream tags, so a test can open a stream of a given kind by hand.
    pub const TAG_ASK: u8 = super::ASK;
    /// Tag of the ordered tell stream.
    pub const TAG_TELLS: u8 = super::TELLS;
    /// Tag of the shared request stream.
    pub const TAG_ASKS: u8 = super::ASKS;
}
