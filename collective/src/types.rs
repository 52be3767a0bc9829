//! Plain data the caller hands in: element types, device buffers, the NCCL unique id.

use serde::de::{self, Deserializer, SeqAccess, Visitor};
use serde::{Deserialize, Serialize, Serializer};
use std::fmt;

/// Element type of a device buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum DType {
    F32,
    BF16,
    F16,
    /// Raw bytes: a broadcast of a packed buffer of mixed-type tensors.
    U8,
}

impl DType {
    pub fn size_bytes(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::BF16 | DType::F16 => 2,
            DType::U8 => 1,
        }
    }
}

/// How `all_reduce` combines the ranks' values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the number of ranks (NCCL's `ncclAvg`).
    Mean,
}

/// Whether a polled backend operation has finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(feature = "nccl"), allow(dead_code))] // the stub never polls
pub(crate) enum Progress {
    Done,
    Pending,
}

/// A contiguous buffer in GPU memory: a raw CUDA device pointer, an element count and
/// the element type. Constructing one is the unsafe step: the collectives write to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceBuffer {
    ptr: u64,
    count: usize,
    dtype: DType,
}

impl DeviceBuffer {
    /// # Safety
    /// `ptr` must point to at least `count` elements of `dtype` in device memory of the
    /// communicator's GPU (or memory that GPU can access), and stay allocated and not
    /// be used by other work until each operation on it returns.
    pub unsafe fn new(ptr: u64, count: usize, dtype: DType) -> Self {
        DeviceBuffer { ptr, count, dtype }
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn count(&self) -> usize {
        self.count
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
    pub fn size_bytes(&self) -> usize {
        self.count * self.dtype.size_bytes()
    }
}

/// Length of NCCL's `ncclUniqueId` (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// NCCL's unique id: rank 0 makes it with `UniqueId::new` (in comm.rs, beside the backend), the runtime sends it to
/// the other ranks (it is serde-serializable), and every rank passes it to
/// `Communicator::init`.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct UniqueId([u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    pub fn from_bytes(bytes: [u8; UNIQUE_ID_BYTES]) -> UniqueId {
        UniqueId(bytes)
    }
    pub fn as_bytes(&self) -> &[u8; UNIQUE_ID_BYTES] {
        &self.0
    }
}

impl fmt::Debug for UniqueId {
    // The id holds the root's socket address; a short prefix is enough to tell ids apart.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "UniqueId(")?;
        for b in &self.0[..8] {
            write!(f, "{b:02x}")?;
        }
        write!(f, "…)")
    }
}

// serde derives arrays only up to 32 elements: write the id as bytes.
impl Serialize for UniqueId {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_bytes(&self.0)
    }
}

impl<'de> Deserialize<'de> for UniqueId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = UniqueId;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                write!(f, "{UNIQUE_ID_BYTES} bytes of an NCCL unique id")
            }
            fn visit_bytes<E: de::Error>(self, v: &[u8]) -> Result<UniqueId, E> {
                let bytes: [u8; UNIQUE_ID_BYTES] = v
                    .try_into()
                    .map_err(|_| E::invalid_length(v.len(), &self))?;
                Ok(UniqueId(bytes))
            }
            fn visit_byte_buf<E: de::Error>(self, v: Vec<u8>) -> Result<UniqueId, E> {
                self.visit_bytes(&v)
            }
            // Self-describing formats such as JSON write bytes as a sequence.
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<UniqueId, A::Error> {
                let mut bytes = [0u8; UNIQUE_ID_BYTES];
                for (i, b) in bytes.iter_mut().enumerate() {
                    *b = seq
                        .next_element()?
                        .ok_or_else(|| de::Error::invalid_length(i, &self))?;
                }
                if seq.next_element::<u8>()?.is_some() {
                    return Err(de::Error::invalid_length(UNIQUE_ID_BYTES + 1, &self));
                }
                Ok(UniqueId(bytes))
            }
        }
        d.deserialize_bytes(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> UniqueId {
        let mut b = [0u8; UNIQUE_ID_BYTES];
        for (i, x) in b.iter_mut().enumerate() {
            *x = (i * 7 + 3) as u8;
        }
        UniqueId::from_bytes(b)
    }

    #[test]
    fn unique_id_round_trips_through_postcard_and_json() {
        let id = sample();
        let wire = postcard::to_stdvec(&id).unwrap();
        assert_eq!(postcard::from_bytes::<UniqueId>(&wire).unwrap(), id);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<UniqueId>(&json).unwrap(), id);
    }

    #[test]
    fn unique_id_of_wrong_length_is_refused() {
        let short = postcard::to_stdvec(&serde_bytes_like(&[1u8; 5])).unwrap();
        assert!(postcard::from_bytes::<UniqueId>(&short).is_err());
        assert!(serde_json::from_str::<UniqueId>("[1,2,3]").is_err());
    }

    // postcard writes `&[u8]` through serialize_bytes only via a wrapper; a Vec is a
    // length-prefixed sequence of the same bytes, which postcard reads back as bytes.
    fn serde_bytes_like(b: &[u8]) -> Vec<u8> {
        b.to_vec()
    }

    #[test]
    fn buffer_sizes() {
        let b = unsafe { DeviceBuffer::new(0x1000, 10, DType::BF16) };
        assert_eq!(b.size_bytes(), 20);
        assert_eq!(DType::F32.size_bytes(), 4);
    }
}
