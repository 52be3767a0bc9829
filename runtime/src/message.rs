//! What crosses the wire: the [`Message`] trait and its encoded form, [`Wire`].
//!
//! In-process sends never encode: the value moves through the mailbox as it is. Only a
//! message bound for another process is turned into a [`Wire`]: a postcard body plus,
//! optionally, a [`Bulk`] payload whose bytes travel raw on their own stream.

use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::codec::Bulk;

/// A message in its encoded form.
#[derive(Debug, Clone, Default)]
pub struct Wire {
    /// The postcard-encoded control part.
    pub body: Bytes,
    /// Raw tensor bytes with their header, never passed through serde.
    pub bulk: Option<Bulk>,
}

/// Errors turning a message into a [`Wire`] or back.
#[derive(Debug, Clone, thiserror::Error)]
pub enum WireError {
    /// postcard could not encode the message.
    #[error("cannot encode {type_name}: {reason}")]
    Encode {
        /// The Rust type being encoded.
        type_name: &'static str,
        /// postcard's explanation.
        reason: String,
    },
    /// The bytes did not decode as the expected type (peer running a different version?).
    #[error("cannot decode {type_name}: {reason} (is the peer running the same yatt version?)")]
    Decode {
        /// The Rust type expected.
        type_name: &'static str,
        /// postcard's explanation.
        reason: String,
    },
    /// A message that needs a bulk payload arrived without one, or the other way round.
    #[error("{type_name}: {reason}")]
    BulkMismatch {
        /// The Rust type expected.
        type_name: &'static str,
        /// What was wrong.
        reason: &'static str,
    },
}

/// A value that can be sent to an actor in another process.
///
/// Every `serde` type is a `Message` (its bytes go through postcard). Tensor data should
/// not: wrap it as [`WithBulk`] (metadata through serde, bytes raw) or send a [`Bulk`].
pub trait Message: Send + Sized + 'static {
    /// Encodes the message.
    fn into_wire(self) -> Result<Wire, WireError>;
    /// Decodes a message received from a peer.
    fn from_wire(wire: Wire) -> Result<Self, WireError>;
}

/// postcard-encodes a message body (for [`Message`] impls that compose a body of their
/// own around a bulk payload).
pub fn encode_body<T: Serialize>(value: &T) -> Result<Bytes, WireError> {
    postcard::to_stdvec(value)
        .map(Bytes::from)
        .map_err(|e| WireError::Encode {
            type_name: std::any::type_name::<T>(),
            reason: e.to_string(),
        })
}

/// Decodes a body written by [`encode_body`].
pub fn decode_body<T: DeserializeOwned>(body: &[u8]) -> Result<T, WireError> {
    postcard::from_bytes(body).map_err(|e| WireError::Decode {
        type_name: std::any::type_name::<T>(),
        reason: e.to_string(),
    })
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Message for T {
    fn into_wire(self) -> Result<Wire, WireError> {
        Ok(Wire {
            body: encode_body(&self)?,
            bulk: None,
        })
    }
    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        if wire.bulk.is_some() {
            return Err(WireError::BulkMismatch {
                type_name: std::any::type_name::<T>(),
                reason: "a bulk payload arrived for a message that takes none",
            });
        }
        decode_body(&wire.body)
    }
}

/// Serializable metadata plus a raw bulk payload, e.g. a sample batch: ids and lengths
/// in `meta`, token and log-prob tensors in `bulk`.
#[derive(Debug, Clone)]
pub struct WithBulk<T> {
    /// The part that goes through serde.
    pub meta: T,
    /// The raw tensors.
    pub bulk: Bulk,
}

impl<T: Serialize + DeserializeOwned + Send + 'static> Message for WithBulk<T> {
    fn into_wire(self) -> Result<Wire, WireError> {
        Ok(Wire {
            body: encode_body(&self.meta)?,
            bulk: Some(self.bulk),
        })
    }
    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        let bulk = wire.bulk.ok_or(WireError::BulkMismatch {
            type_name: std::any::type_name::<Self>(),
            reason: "the message needs a bulk payload and none arrived",
        })?;
        Ok(WithBulk {
            meta: decode_body(&wire.body)?,
            bulk,
        })
    }
}

impl Message for Bulk {
    fn into_wire(self) -> Result<Wire, WireError> {
        Ok(Wire {
            body: Bytes::new(),
            bulk: Some(self),
        })
    }
    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        wire.bulk.ok_or(WireError::BulkMismatch {
            type_name: "Bulk",
            reason: "the message needs a bulk payload and none arrived",
        })
    }
}

/// A serde value that is `()` on the wire; handy as a response type.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ack;
