//! Serving a peer's streams: requests, tells, control messages, and our replies.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;

use super::endpoint::Transport;
use super::peer::Peer;
use super::protocol::{
    decode, encode_tagged, read_exact_err, AskFrame, BulkRef, Control, ReplyFrame, ReplyHead,
    RequestHead, ASK, ASKS, BULK_PRIORITY, BULK_REPLY, BULK_TELL, REPLIES, SYSTEM, TELLS,
};
use super::routing::{Dispatch, Target};
use crate::actor::CallError;
use crate::codec::{self, Bulk, CodecError};
use crate::message::Wire;

impl Transport {
    pub(super) async fn serve_connection(self: Arc<Self>, peer: Arc<Peer>) {
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

    pub(super) fn note_bad_stream(&self, peer: &str, e: &CodecError) {
        let benign = matches!(e, CodecError::ConnectionLost(_));
        if !benign {
            self.stats.bad_frames.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(%peer, error = %e, "closed a stream with a bad frame; the connection stays up");
        }
    }

    pub(super) fn dispatch(&self) -> Result<&Arc<dyn Dispatch>, CallError> {
        self.dispatch.get().ok_or_else(|| CallError::Unavailable {
            node: self.name.clone(),
            reason: "node is starting".into(),
        })
    }

    /// Runs a request for a peer: waits for earlier tells, dispatches, and returns the
    /// reply head plus a bulk payload still to be sent inline, if any.
    pub(super) async fn run_request(
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
                        Ok(d) => {
                            d.ask(&peer.name, peer.kind, head.target, wire, timeout)
                                .await
                        }
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

    pub(super) async fn serve_ask(
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

    pub(super) async fn serve_uni(
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
                                d.tell(&peer.name, peer.kind, target, wire).await;
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
                    d.tell(&peer.name, peer.kind, head.target, wire).await;
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

    pub(super) fn handle_control(&self, body: &[u8]) -> Result<(), CodecError> {
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
    pub(super) async fn send_reply(
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
    pub(super) async fn write_message(
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
    pub(super) async fn reply_wire(
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
                    let bulk =
                        codec::read_bulk_pooled(recv, &self.config.bulk_limits, &self.recv_buffers)
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
}
