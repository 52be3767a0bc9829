//! Bulk payloads on a stream: reading them, mapping shared-memory segments, choosing
//! between inline bytes and a segment.

use std::sync::atomic::Ordering;

use bytes::Bytes;

use super::endpoint::Transport;
use super::peer::Peer;
use super::protocol::{decode, BulkRef};
use crate::codec::{self, Bulk, BulkHeader, CodecError};
use crate::message::Wire;

impl Transport {
    pub(super) async fn read_head<T: serde::de::DeserializeOwned>(
        &self,
        recv: &mut quinn::RecvStream,
    ) -> Result<T, CodecError> {
        let frame = codec::read_frame(recv, &self.config.frame_limits)
            .await?
            .ok_or(CodecError::Truncated { needed: 4, have: 0 })?;
        decode(&frame)
    }

    pub(super) async fn read_bulk(
        &self,
        peer: &Peer,
        recv: &mut quinn::RecvStream,
        bulk: BulkRef,
        body: Bytes,
    ) -> Result<Wire, CodecError> {
        let bulk = match bulk {
            BulkRef::None => None,
            BulkRef::Inline => Some(
                codec::read_bulk_pooled(recv, &self.config.bulk_limits, &self.recv_buffers).await?,
            ),
            BulkRef::Shm { path, id, header } => Some(self.map_segment(peer, &path, id, header)?),
        };
        Ok(Wire { body, bulk })
    }

    pub(super) fn map_segment(
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
    pub(super) async fn place_bulk(
        &self,
        peer: &str,
        bulk: Option<Bulk>,
    ) -> (BulkRef, Option<Bulk>) {
        let Some(bulk) = bulk else {
            return (BulkRef::None, None);
        };
        self.stats
            .bulk_bytes_sent
            .fetch_add(bulk.len(), Ordering::Relaxed);
        let same_host = self
            .book
            .get()
            .and_then(|b| b.lookup(peer).ok())
            .is_some_and(|(_, host)| host == self.host_id);
        let len = usize::try_from(bulk.len()).unwrap_or(usize::MAX);
        if self.config.shm_fast_path && same_host && len >= self.config.shm_threshold {
            match self.segments.lease(len) {
                Ok(Some(mut lease)) => {
                    let data = bulk.clone();
                    // Copying megabytes is CPU work: keep it off the async workers.
                    let lease = tokio::task::spawn_blocking(move || {
                        data.copy_to(lease.as_mut());
                        lease
                    })
                    .await;
                    if let Ok(lease) = lease {
                        let r = BulkRef::Shm {
                            path: lease.path.to_string_lossy().into_owned(),
                            id: lease.id,
                            header: bulk.header().clone(),
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
}
