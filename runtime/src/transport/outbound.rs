//! Calling a peer: asks on the shared or an own stream, ordered tells.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::endpoint::Transport;
use super::peer::{Peer, PendingGuard};
use super::protocol::{
    encode_tagged, AskFrame, BulkRef, ReplyHead, RequestHead, ASK, BULK_PRIORITY, BULK_TELL,
    CONTROL_PRIORITY, SYSTEM, TELLS,
};
use super::routing::Target;
use crate::actor::CallError;
use crate::codec::Bulk;
use crate::message::Wire;

impl Transport {
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
            // An actor's ask waits for the tells sent to it before; a system ask (a
            // heartbeat, a join) must not wait behind a full mailbox.
            let after_tells = match target {
                Target::System => 0,
                _ => peer.tells_sent.load(Ordering::Acquire),
            };
            let head = RequestHead {
                target: target.clone(),
                after_tells,
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
    pub(super) async fn ask_shared(
        &self,
        peer: &Peer,
        head: RequestHead,
    ) -> Result<Wire, CallError> {
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
    pub(super) async fn ask_own_stream(
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

    pub(super) async fn tell_on(
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
