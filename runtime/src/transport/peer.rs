//! One connected peer: its long-lived streams and their writers, the replies it owes us,
//! progress of ordered tells.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::sync::{mpsc, oneshot};

use super::protocol::WRITE_BATCH;
use crate::actor::CallError;
use crate::cert_kind::CertKind;
use crate::message::Wire;
use crate::shm::MappingCache;

/// A long-lived outgoing stream fed through a channel by a writer task, which gathers
/// queued frames into one write.
pub(super) struct StreamWriter {
    pub(super) tag: u8,
    pub(super) priority: i32,
    pub(super) tx: Mutex<Option<mpsc::Sender<Bytes>>>,
}

impl StreamWriter {
    pub(super) fn new(tag: u8, priority: i32) -> Self {
        StreamWriter {
            tag,
            priority,
            tx: Mutex::new(None),
        }
    }

    /// Queues a frame, starting the writer (and its stream) if needed. Waits while the
    /// queue is full: that is the backpressure of a slow peer.
    pub(super) async fn send(&self, conn: &quinn::Connection, frame: Bytes) -> Result<(), String> {
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

pub(super) async fn write_loop(
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

pub(super) type PendingReply = oneshot::Sender<Result<Wire, CallError>>;

/// One connection to a peer, and everything kept per connection.
pub(super) struct Peer {
    pub(super) name: String,
    /// What its certificate lets it do.
    pub(super) kind: CertKind,
    pub(super) conn: quinn::Connection,
    /// Ordered tells written on this connection.
    pub(super) tells_sent: AtomicU64,
    pub(super) tells: tokio::sync::Mutex<Option<quinn::SendStream>>,
    pub(super) system: tokio::sync::Mutex<Option<quinn::SendStream>>,
    pub(super) asks: StreamWriter,
    pub(super) replies: StreamWriter,
    pub(super) next_ask: AtomicU64,
    pub(super) pending: Mutex<HashMap<u64, PendingReply>>,
    /// Ordered tells from the peer queued into mailboxes (receiving side).
    pub(super) progress: TellProgress,
    /// The peer's shared-memory segments, mapped (receiving side).
    pub(super) segments: MappingCache,
}

impl Peer {
    pub(super) fn lock_pending(&self) -> std::sync::MutexGuard<'_, HashMap<u64, PendingReply>> {
        self.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn fail_pending(&self, reason: &str) {
        for (_, tx) in self.lock_pending().drain() {
            let _ = tx.send(Err(CallError::Transport {
                node: self.name.clone(),
                reason: reason.to_string(),
            }));
        }
    }
}

/// Removes a pending ask when the asker stops waiting (deadline, cancellation).
pub(super) struct PendingGuard<'a> {
    pub(super) peer: &'a Peer,
    pub(super) id: u64,
}

impl Drop for PendingGuard<'_> {
    fn drop(&mut self) {
        self.peer.lock_pending().remove(&self.id);
    }
}

/// How many ordered tells of one connection have been queued into mailboxes.
#[derive(Default)]
pub(super) struct TellProgress {
    pub(super) delivered: AtomicU64,
    pub(super) changed: tokio::sync::Notify,
}

impl TellProgress {
    pub(super) fn delivered(&self) {
        self.delivered.fetch_add(1, Ordering::AcqRel);
        self.changed.notify_waiters();
    }

    /// Waits until `count` tells were queued; false if the deadline passed first.
    pub(super) async fn wait_for(&self, count: u64, timeout: Duration) -> bool {
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
