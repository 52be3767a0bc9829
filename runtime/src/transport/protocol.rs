//! What goes on a stream: the tags that open one, the heads of requests and replies,
//! and how bulk payloads are referenced.

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use super::routing::Target;
use crate::actor::CallError;
use crate::codec::{self, BulkHeader, CodecError, FrameLimits};

// The tags (the table in the transport's docs). `pub` only for the crate's `testing`
// namespace, where tests open a stream of a given kind by hand.
/// Tag of a bidirectional request stream with an inline bulk payload.
pub const ASK: u8 = 1;
/// Tag of the ordered tell stream.
pub const TELLS: u8 = 2;
pub(super) const SYSTEM: u8 = 3;
pub(super) const BULK_TELL: u8 = 4;
/// Tag of the shared request stream.
pub const ASKS: u8 = 5;
pub(super) const REPLIES: u8 = 6;
pub(super) const BULK_REPLY: u8 = 7;

pub(super) const CONTROL_PRIORITY: i32 = 10;
pub(super) const BULK_PRIORITY: i32 = -10;
/// Frames a stream writer gathers into one write.
pub(super) const WRITE_BATCH: usize = 64;

/// Transport-to-transport messages.
#[derive(Debug, Serialize, Deserialize)]
pub(super) enum Control {
    /// The receiver is done with these shared-memory segments.
    Release(Vec<u64>),
}

/// Where a message's bulk payload is.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum BulkRef {
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
pub(super) struct RequestHead {
    pub(super) target: Target,
    /// Ordered tells this sender had written on the connection before this request;
    /// the receiver queues the request only after as many tells, so a tell followed by
    /// an ask from one node reaches the mailbox in that order.
    pub(super) after_tells: u64,
    pub(super) timeout_ms: u64,
    pub(super) body: Bytes,
    pub(super) bulk: BulkRef,
}

#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ReplyHead {
    pub(super) result: Result<(Bytes, BulkRef), CallError>,
}

/// A request on the long-lived `ASKS` stream.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct AskFrame {
    pub(super) id: u64,
    pub(super) head: RequestHead,
}

/// A reply on `REPLIES` or `BULK_REPLY`.
#[derive(Debug, Serialize, Deserialize)]
pub(super) struct ReplyFrame {
    pub(super) id: u64,
    pub(super) head: ReplyHead,
}

pub(super) fn decode<T: serde::de::DeserializeOwned>(frame: &[u8]) -> Result<T, CodecError> {
    postcard::from_bytes(frame).map_err(|e| CodecError::BadHeader(e.to_string()))
}

/// Encodes `[tag][u32 length][postcard]` in one buffer.
pub(super) fn encode_tagged<T: Serialize>(
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

pub(super) fn read_exact_err(e: quinn::ReadExactError) -> CodecError {
    match e {
        quinn::ReadExactError::FinishedEarly(have) => CodecError::Truncated {
            needed: 1,
            have: have as u64,
        },
        quinn::ReadExactError::ReadError(e) => CodecError::ConnectionLost(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::actor::ActorError;
    use crate::addr::ActorId;
    use crate::codec::{DType, TensorMeta};
    use crate::tls::test_support::assert_pinned_to_alpn;

    /// One value of every frame head, each enum's variants by an exhaustive match.
    fn every_frame() -> Vec<Vec<u8>> {
        let id: ActorId = "n/role/0#5".parse().unwrap();
        let header = BulkHeader {
            tensors: vec![TensorMeta {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![2, 3],
                offset: 0,
                len: 24,
            }],
            total_len: 24,
        };
        let bulks = vec![
            BulkRef::None,
            BulkRef::Inline,
            BulkRef::Shm {
                path: "/p".into(),
                id: 1,
                header,
            },
        ];
        let targets = vec![Target::Actor(id.clone()), Target::System, Target::Transport];
        let actor_errors = vec![
            ActorError::BadRequest("x".into()),
            ActorError::Failed("x".into()),
            ActorError::Unavailable("x".into()),
        ];
        let mut errors = vec![
            CallError::Timeout {
                target: id.clone(),
                after: Duration::from_millis(3),
            },
            CallError::Closed { target: id.clone() },
            CallError::Died { target: id.clone() },
            CallError::Stale {
                target: id.clone(),
                current: Some(6),
            },
            CallError::Unavailable {
                node: "n".into(),
                reason: "x".into(),
            },
            CallError::NodeDown { node: "n".into() },
            CallError::Transport {
                node: "n".into(),
                reason: "x".into(),
            },
            CallError::Codec("x".into()),
        ];
        errors.extend(actor_errors.iter().map(|e| CallError::Handler {
            target: id.clone(),
            error: e.clone(),
        }));
        for b in &bulks {
            match b {
                BulkRef::None | BulkRef::Inline | BulkRef::Shm { .. } => {}
            }
        }
        for t in &targets {
            match t {
                Target::Actor(_) | Target::System | Target::Transport => {}
            }
        }
        for e in &actor_errors {
            match e {
                ActorError::BadRequest(_) | ActorError::Failed(_) | ActorError::Unavailable(_) => {}
            }
        }
        for e in &errors {
            match e {
                CallError::Timeout { .. }
                | CallError::Closed { .. }
                | CallError::Died { .. }
                | CallError::Stale { .. }
                | CallError::Handler { .. }
                | CallError::Unavailable { .. }
                | CallError::NodeDown { .. }
                | CallError::Transport { .. }
                | CallError::Codec(_) => {}
            }
        }
        let mut out = vec![postcard::to_stdvec(&Control::Release(vec![1, 2])).unwrap()];
        for (i, target) in targets.into_iter().enumerate() {
            let head = RequestHead {
                target,
                after_tells: 4,
                timeout_ms: 5,
                body: Bytes::from_static(b"body"),
                bulk: bulks[i % bulks.len()].clone(),
            };
            out.push(postcard::to_stdvec(&AskFrame { id: 7, head }).unwrap());
        }
        for b in &bulks {
            let head = ReplyHead {
                result: Ok((Bytes::from_static(b"r"), b.clone())),
            };
            out.push(postcard::to_stdvec(&ReplyFrame { id: 8, head }).unwrap());
        }
        for e in errors {
            let head = ReplyHead { result: Err(e) };
            out.push(postcard::to_stdvec(&ReplyFrame { id: 9, head }).unwrap());
        }
        out
    }

    /// The frame heads' encoding, pinned to the ALPN that names it (as the system
    /// messages' in `node/protocol.rs`): a change to how they encode fails this test
    /// until the ALPN in `tls.rs` is bumped. Bump it, then put the new fingerprint here.
    #[test]
    fn the_frame_heads_encoding_is_pinned_to_the_alpn() {
        assert_pinned_to_alpn("frame heads", every_frame(), 1_259_496_916);
    }
}
