//! The QUIC transport: one endpoint per process, one connection per peer.
//!
//! Every stream starts with a one-byte tag saying what it carries:
//!
//! | tag | stream | carries |
//! |---|---|---|
//! | `ASK` | bidirectional, one per request | request head, optional bulk; reply head, optional bulk |
//! | `TELLS` | unidirectional, long-lived per peer | ordered fire-and-forget actor messages |
//! | `SYSTEM` | unidirectional, long-lived per peer | heartbeats and directory updates, never blocked by mailboxes |
//! | `BULK_TELL` | unidirectional, one per message | a fire-and-forget message with a bulk payload |
//!
//! Control streams run at a higher priority than bulk ones. Bulk bytes never pass
//! through serde: a small header (dtype, shape, byte ranges) is followed by raw bytes.
//! Between processes on the same host, a bulk payload of at least
//! [`TransportConfig::shm_threshold`] bytes goes through a shared-memory file instead:
//! the request names the file, the receiver maps it, so the socket carries a few bytes.
//!
//! A malformed or oversized frame closes that stream with a logged error; the
//! connection and every other stream keep working.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use crate::actor::{ActorError, BoxFuture, CallError};
use crate::addr::ActorId;
use crate::codec::{self, Bulk, BulkHeader, BulkLimits, CodecError, FrameLimits};
use crate::message::Wire;
use crate::tls::{self, NodeIdentity};

const ASK: u8 = 1;
const TELLS: u8 = 2;
const SYSTEM: u8 = 3;
const BULK_TELL: u8 = 4;

const CONTROL_PRIORITY: i32 = 10;
const BULK_PRIORITY: i32 = -10;

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
    /// Where shared-memory files are created.
    pub shm_dir: std::path::PathBuf,
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
            shm_dir: "/dev/shm".into(),
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
}

/// Where a message's bulk payload is.
#[derive(Debug, Clone, Serialize, Deserialize)]
enum BulkRef {
    None,
    /// Follows the head on the same stream.
    Inline,
    /// In a shared-memory file on the receiver's host.
    Shm {
        path: String,
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
    #[serde(with = "serde_bytes")]
    body: Vec<u8>,
    bulk: BulkRef,
}

#[derive(Debug, Serialize, Deserialize)]
struct ReplyHead {
    result: Result<(serde_bytes::ByteBuf, BulkRef), RemoteError>,
}

/// Why a remote node refused or failed a request; travels back in the reply.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RemoteError {
    /// No actor of that name runs on the node.
    #[error("no actor {0} on that node")]
    NoSuchActor(ActorId),
    /// The name belongs to another incarnation now.
    #[error("{target} was replaced (current incarnation {current:?})")]
    Stale {
        /// The incarnation asked for.
        target: ActorId,
        /// The one registered now, if any.
        current: Option<u64>,
    },
    /// The actor's handler returned an error.
    #[error("{0}")]
    Handler(ActorError),
    /// The actor stopped before or while handling the request.
    #[error("{0} stopped before replying")]
    Died(ActorId),
    /// The actor did not answer within the request's deadline.
    #[error("deadline passed on the remote node")]
    Timeout,
    /// The request or its bulk payload could not be decoded.
    #[error("codec: {0}")]
    Codec(String),
    /// The node is shutting down or not ready.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

impl RemoteError {
    fn into_call_error(self, target: &Target, node: &str, timeout: Duration) -> CallError {
        let actor = match target {
            Target::Actor(id) => Some(id.clone()),
            Target::System => None,
        };
        match (self, actor) {
            (RemoteError::Stale { target, current }, _) => CallError::Stale { target, current },
            (RemoteError::NoSuchActor(target), _) => CallError::Stale {
                target,
                current: None,
            },
            (RemoteError::Handler(error), Some(target)) => CallError::Handler { target, error },
            (RemoteError::Died(target), _) => CallError::Died { target },
            (RemoteError::Timeout, Some(target)) => CallError::Timeout {
                target,
                after: timeout,
            },
            (RemoteError::Codec(c), _) => CallError::Codec(c),
            (e, _) => CallError::Transport {
                node: node.to_string(),
                reason: e.to_string(),
            },
        }
    }
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
    ) -> BoxFuture<'static, Result<Wire, RemoteError>>;
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

struct Peer {
    conn: quinn::Connection,
    /// Ordered tells written on this connection.
    tells_sent: AtomicU64,
    tells: tokio::sync::Mutex<Option<quinn::SendStream>>,
    system: tokio::sync::Mutex<Option<quinn::SendStream>>,
}

/// How the transport finds a peer's address and host.
pub(crate) trait PeerBook: Send + Sync + 'static {
    /// The address and host id of a node, if known and not dead.
    fn lookup(&self, node: &str) -> Result<(SocketAddr, String), CallError>;
}

/// One process's QUIC endpoint and its connections.
pub struct Transport {
    me: String,
    host_id: String,
    endpoint: quinn::Endpoint,
    config: TransportConfig,
    peers: Mutex<HashMap<String, Arc<Peer>>>,
    dial_lock: tokio::sync::Mutex<()>,
    dispatch: OnceLock<Arc<dyn Dispatch>>,
    book: OnceLock<Arc<dyn PeerBook>>,
    shm_seq: AtomicU64,
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
        let socket = std::net::UdpSocket::bind(listen).map_err(|e| TransportError::Bind {
            addr: listen,
            reason: e.to_string(),
        })?;
        let runtime = quinn::default_runtime().ok_or_else(|| TransportError::Bind {
            addr: listen,
            reason: "no async runtime".into(),
        })?;
        let mut endpoint = quinn::Endpoint::new(
            quinn::EndpointConfig::default(),
            Some(server),
            socket,
            runtime,
        )
        .map_err(|e| TransportError::Bind {
            addr: listen,
            reason: e.to_string(),
        })?;
        endpoint.set_default_client_config(client);
        Ok(Arc::new(Transport {
            me: identity.node.clone(),
            host_id,
            endpoint,
            config,
            peers: Mutex::new(HashMap::new()),
            dial_lock: tokio::sync::Mutex::new(()),
            dispatch: OnceLock::new(),
            book: OnceLock::new(),
            shm_seq: AtomicU64::new(0),
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
        self.endpoint.close(0u32.into(), b"node shutting down");
        let _ = tokio::time::timeout(Duration::from_secs(2), self.endpoint.wait_idle()).await;
    }

    /// Drops the cached connection to `node` (it died).
    pub(crate) fn forget(&self, node: &str) {
        if let Some(p) = self.lock_peers().remove(node) {
            p.conn.close(2u32.into(), b"peer declared dead");
        }
    }

    fn lock_peers(&self) -> std::sync::MutexGuard<'_, HashMap<String, Arc<Peer>>> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Registers a connection (dialled or accepted) and serves the streams the peer opens.
    fn adopt(self: &Arc<Self>, name: String, conn: quinn::Connection) -> Arc<Peer> {
        self.stats.connections.fetch_add(1, Ordering::Relaxed);
        let peer = {
            let mut peers = self.lock_peers();
            match peers.get(&name) {
                // Keep one connection per peer; a second one (both sides dialled at
                // once) is still served until the peer stops using it.
                Some(existing) if existing.conn.close_reason().is_none() => existing.clone(),
                _ => {
                    let p = Arc::new(Peer {
                        conn: conn.clone(),
                        tells_sent: AtomicU64::new(0),
                        tells: tokio::sync::Mutex::new(None),
                        system: tokio::sync::Mutex::new(None),
                    });
                    peers.insert(name.clone(), p.clone());
                    p
                }
            }
        };
        let this = self.clone();
        tokio::spawn(async move { this.serve_connection(name, conn).await });
        peer
    }

    async fn serve_connection(self: Arc<Self>, peer: String, conn: quinn::Connection) {
        let progress = Arc::new(TellProgress::default());
        let bi = {
            let (this, conn, peer, progress) =
                (self.clone(), conn.clone(), peer.clone(), progress.clone());
            async move {
                while let Ok((send, recv)) = conn.accept_bi().await {
                    let (this, peer, progress) = (this.clone(), peer.clone(), progress.clone());
                    tokio::spawn(async move {
                        if let Err(e) = this.serve_ask(&peer, send, recv, &progress).await {
                            this.note_bad_stream(&peer, &e);
                        }
                    });
                }
            }
        };
        let uni = {
            let (this, conn, peer) = (self.clone(), conn.clone(), peer.clone());
            let progress = progress.clone();
            async move {
                while let Ok(recv) = conn.accept_uni().await {
                    let (this, peer, progress) = (this.clone(), peer.clone(), progress.clone());
                    tokio::spawn(async move {
                        if let Err(e) = this.serve_uni(&peer, recv, &progress).await {
                            this.note_bad_stream(&peer, &e);
                        }
                    });
                }
            }
        };
        tokio::join!(bi, uni);
        let mut peers = self.lock_peers();
        if peers
            .get(&peer)
            .is_some_and(|p| p.conn.stable_id() == conn.stable_id())
        {
            peers.remove(&peer);
        }
    }

    fn note_bad_stream(&self, peer: &str, e: &CodecError) {
        let benign = matches!(e, CodecError::ConnectionLost(_));
        if !benign {
            self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "closed a stream with a bad frame; the connection stays up");
        }
    }

    fn dispatch(&self) -> Result<&Arc<dyn Dispatch>, RemoteError> {
        self.dispatch
            .get()
            .ok_or_else(|| RemoteError::Unavailable("node is starting".into()))
    }

    async fn serve_ask(
        &self,
        peer: &str,
        mut send: quinn::SendStream,
        mut recv: quinn::RecvStream,
        progress: &TellProgress,
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
        let head = self.read_request(&mut recv).await?;
        let wire = self
            .read_request_bulk(&mut recv, head.bulk, head.body)
            .await;
        self.stats.received.fetch_add(1, Ordering::Relaxed);
        let timeout = Duration::from_millis(head.timeout_ms);
        let ordered = progress.wait_for(head.after_tells, timeout).await;
        let result = match wire {
            Err(e) => Err(RemoteError::Codec(e.to_string())),
            Ok(_) if !ordered => Err(RemoteError::Timeout),
            Ok(wire) => match self.dispatch() {
                Ok(d) => d.ask(peer, head.target, wire, timeout).await,
                Err(e) => Err(e),
            },
        };
        let (reply, bulk) = match result {
            Ok(wire) => {
                let (bulk_ref, bulk) = self.place_bulk(peer, wire.bulk).await;
                (
                    ReplyHead {
                        result: Ok((serde_bytes::ByteBuf::from(wire.body.to_vec()), bulk_ref)),
                    },
                    bulk,
                )
            }
            Err(e) => (ReplyHead { result: Err(e) }, None),
        };
        let head = postcard::to_stdvec(&reply).map_err(|e| CodecError::BadHeader(e.to_string()))?;
        codec::write_frame(&mut send, &head, &self.config.frame_limits).await?;
        if let Some(bulk) = bulk {
            send.set_priority(BULK_PRIORITY).ok();
            codec::write_bulk(&mut send, &bulk, &self.config.bulk_limits).await?;
        }
        let _ = send.finish();
        Ok(())
    }

    async fn serve_uni(
        &self,
        peer: &str,
        mut recv: quinn::RecvStream,
        progress: &TellProgress,
    ) -> Result<(), CodecError> {
        let mut tag = [0u8; 1];
        recv.read_exact(&mut tag).await.map_err(read_exact_err)?;
        let ordered = tag[0] == TELLS;
        match tag[0] {
            TELLS | SYSTEM => loop {
                let Some(frame) = codec::read_frame(&mut recv, &self.config.frame_limits).await?
                else {
                    return Ok(());
                };
                let head: RequestHead = postcard::from_bytes(&frame)
                    .map_err(|e| CodecError::BadHeader(e.to_string()))?;
                if !matches!(head.bulk, BulkRef::None) {
                    return Err(CodecError::BadHeader(
                        "bulk reference on an ordered stream".into(),
                    ));
                }
                self.stats.received.fetch_add(1, Ordering::Relaxed);
                let wire = Wire {
                    body: Bytes::from(head.body),
                    bulk: None,
                };
                if let Ok(d) = self.dispatch() {
                    // Awaiting here is the backpressure: the peer's writes stall on flow
                    // control while the mailbox is full.
                    d.tell(peer, head.target, wire).await;
                }
                if ordered {
                    progress.delivered();
                }
            },
            BULK_TELL => {
                let head = self.read_request(&mut recv).await?;
                let wire = self
                    .read_request_bulk(&mut recv, head.bulk, head.body)
                    .await?;
                self.stats.received.fetch_add(1, Ordering::Relaxed);
                if let Ok(d) = self.dispatch() {
                    d.tell(peer, head.target, wire).await;
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

    async fn read_request(&self, recv: &mut quinn::RecvStream) -> Result<RequestHead, CodecError> {
        let frame = codec::read_frame(recv, &self.config.frame_limits)
            .await?
            .ok_or(CodecError::Truncated { needed: 4, have: 0 })?;
        postcard::from_bytes(&frame).map_err(|e| CodecError::BadHeader(e.to_string()))
    }

    async fn read_request_bulk(
        &self,
        recv: &mut quinn::RecvStream,
        bulk: BulkRef,
        body: Vec<u8>,
    ) -> Result<Wire, CodecError> {
        let bulk = match bulk {
            BulkRef::None => None,
            BulkRef::Inline => Some(codec::read_bulk(recv, &self.config.bulk_limits).await?),
            BulkRef::Shm { path, header } => Some(self.map_shm(&path, header).await?),
        };
        Ok(Wire {
            body: Bytes::from(body),
            bulk,
        })
    }

    /// Decides how a bulk payload travels to `peer`: through a shared-memory file when
    /// the peer is on this host, otherwise inline after the head.
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
            match self.write_shm(&bulk).await {
                Ok(path) => {
                    return (
                        BulkRef::Shm {
                            path,
                            header: bulk.header,
                        },
                        None,
                    )
                }
                Err(e) => {
                    tracing::warn!(error = %e, "shared-memory fast path failed; sending inline")
                }
            }
        }
        (BulkRef::Inline, Some(bulk))
    }

    async fn write_shm(&self, bulk: &Bulk) -> std::io::Result<String> {
        let seq = self.shm_seq.fetch_add(1, Ordering::Relaxed);
        let path =
            self.config
                .shm_dir
                .join(format!("yatt-{}-{}-{seq}", self.me, std::process::id()));
        let data = bulk.data.clone();
        let p = path.clone();
        tokio::task::spawn_blocking(move || {
            use std::io::Write;
            use std::os::unix::fs::OpenOptionsExt;
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&p)?;
            f.write_all(&data)
        })
        .await
        .map_err(std::io::Error::other)??;
        Ok(path.to_string_lossy().into_owned())
    }

    async fn map_shm(&self, path: &str, header: BulkHeader) -> Result<Bulk, CodecError> {
        let allowed = std::path::Path::new(path)
            .parent()
            .is_some_and(|d| d == self.config.shm_dir)
            && std::path::Path::new(path)
                .file_name()
                .is_some_and(|f| f.to_string_lossy().starts_with("yatt-"));
        if !allowed {
            return Err(CodecError::InvalidBulk {
                reason: format!(
                    "shared-memory path {path:?} is outside {}",
                    self.config.shm_dir.display()
                ),
            });
        }
        header.validate(&self.config.bulk_limits)?;
        let path = path.to_string();
        let data = tokio::task::spawn_blocking(move || -> std::io::Result<Bytes> {
            let file = std::fs::File::open(&path)?;
            // The name is ours to remove once mapped; the mapping keeps the pages.
            let _ = std::fs::remove_file(&path);
            if file.metadata()?.len() == 0 {
                return Ok(Bytes::new());
            }
            // SAFETY: the sender wrote the file completely before sending its name and
            // never touches it again; we removed the name, so no one else can open it.
            let map = unsafe { memmap2::Mmap::map(&file)? };
            Ok(Bytes::from_owner(map))
        })
        .await
        .map_err(|e| CodecError::Io(e.to_string()))?
        .map_err(|e| CodecError::Io(format!("shared-memory bulk: {e}")))?;
        Bulk::with_limits(header, data, &self.config.bulk_limits)
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
        let work = async {
            let peer = self.peer(node).await?;
            let lost = |e: String| CallError::Transport {
                node: node.to_string(),
                reason: e,
            };
            let (mut send, mut recv) =
                peer.conn.open_bi().await.map_err(|e| lost(e.to_string()))?;
            send.set_priority(CONTROL_PRIORITY).ok();
            let (bulk_ref, bulk) = self.place_bulk(node, wire.bulk).await;
            let head = RequestHead {
                target: target.clone(),
                after_tells: peer.tells_sent.load(Ordering::Acquire),
                timeout_ms: timeout.as_millis() as u64,
                body: wire.body.to_vec(),
                bulk: bulk_ref,
            };
            let frame = self.tagged_frame(ASK, &head)?;
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
            send.write_all_chunks(&mut [frame])
                .await
                .map_err(|e| lost(e.to_string()))?;
            if let Some(bulk) = &bulk {
                send.set_priority(BULK_PRIORITY).ok();
                codec::write_bulk(&mut send, bulk, &self.config.bulk_limits)
                    .await
                    .map_err(|e| lost(e.to_string()))?;
            }
            let _ = send.finish();
            let frame = codec::read_frame(&mut recv, &self.config.frame_limits)
                .await
                .map_err(|e| lost(e.to_string()))?
                .ok_or_else(|| lost("stream closed before the reply".into()))?;
            let reply: ReplyHead =
                postcard::from_bytes(&frame).map_err(|e| CallError::Codec(e.to_string()))?;
            match reply.result {
                Ok((body, bulk_ref)) => self
                    .read_request_bulk(&mut recv, bulk_ref, body.into_vec())
                    .await
                    .map_err(|e| lost(e.to_string())),
                Err(e) => Err(e.into_call_error(&target, node, timeout)),
            }
        };
        match tokio::time::timeout(timeout, work).await {
            Ok(r) => r,
            Err(_) => Err(match target {
                Target::Actor(target) => CallError::Timeout {
                    target,
                    after: timeout,
                },
                Target::System => CallError::Transport {
                    node: node.to_string(),
                    reason: format!("no reply within {timeout:?}"),
                },
            }),
        }
    }

    fn tagged_frame(&self, tag: u8, head: &RequestHead) -> Result<Bytes, CallError> {
        let body = postcard::to_stdvec(head).map_err(|e| CallError::Codec(e.to_string()))?;
        let frame = codec::encode_frame(&body, &self.config.frame_limits)
            .map_err(|e| CallError::Codec(e.to_string()))?;
        let mut out = Vec::with_capacity(1 + frame.len());
        out.push(tag);
        out.extend_from_slice(&frame);
        Ok(Bytes::from(out))
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
            self.stats.sent.fetch_add(1, Ordering::Relaxed);
            if wire.bulk.is_some() {
                let mut send = peer
                    .conn
                    .open_uni()
                    .await
                    .map_err(|e| lost(e.to_string()))?;
                send.set_priority(BULK_PRIORITY).ok();
                let (bulk_ref, bulk) = self.place_bulk(node, wire.bulk).await;
                let head = RequestHead {
                    target,
                    after_tells: 0,
                    timeout_ms: 0,
                    body: wire.body.to_vec(),
                    bulk: bulk_ref,
                };
                let frame = self.tagged_frame(BULK_TELL, &head)?;
                send.write_all_chunks(&mut [frame])
                    .await
                    .map_err(|e| lost(e.to_string()))?;
                if let Some(bulk) = &bulk {
                    codec::write_bulk(&mut send, bulk, &self.config.bulk_limits)
                        .await
                        .map_err(|e| lost(e.to_string()))?;
                }
                let _ = send.finish();
                return Ok(());
            }
            let head = RequestHead {
                target,
                after_tells: 0,
                timeout_ms: 0,
                body: wire.body.to_vec(),
                bulk: BulkRef::None,
            };
            let (slot, tag, priority) = if system {
                (&peer.system, SYSTEM, CONTROL_PRIORITY + 10)
            } else {
                (&peer.tells, TELLS, CONTROL_PRIORITY)
            };
            let mut stream = slot.lock().await;
            let mut frame = self.tagged_frame(tag, &head)?;
            if stream.is_none() {
                let s = peer
                    .conn
                    .open_uni()
                    .await
                    .map_err(|e| lost(e.to_string()))?;
                s.set_priority(priority).ok();
                *stream = Some(s);
            } else {
                frame = frame.slice(1..);
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
        };
        tokio::time::timeout(self.config.tell_timeout, work)
            .await
            .map_err(|_| lost(format!("send stalled for {:?}", self.config.tell_timeout)))?
    }
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
}
