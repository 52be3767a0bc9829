//! Wire framing between nodes: length-delimited control frames and bulk payloads.
//!
//! **Control frames** are `[u32 little-endian length][payload]`; the payload is postcard
//! bytes produced by the caller. Every stream has a maximum frame size
//! ([`FrameLimits::max_frame`]); a larger length is rejected as soon as its 4-byte header
//! is seen, before any of the body is buffered.
//!
//! **Bulk payloads** (tensors) follow the safetensors layout: a small [`BulkHeader`]
//! (postcard, sent as one control frame) listing each tensor's dtype, shape and byte range,
//! then `total_len` raw bytes written with `write_chunks` (no serde, no copy).
//!
//! [`FrameDecoder`] and [`decode_bulk_header`] are sans-I/O so they can be fuzzed
//! (`runtime/fuzz`); [`read_frame`], [`write_frame`], [`read_bulk`] and [`write_bulk`] run
//! them over quinn streams.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};
use serde::{Deserialize, Serialize};

use crate::buffers::RecvBuffers;

/// Length of the frame header (u32 little-endian body length).
pub const FRAME_HEADER_LEN: usize = 4;
/// Default maximum frame body size: 8 MiB.
pub const DEFAULT_MAX_FRAME: usize = 8 << 20;
/// Default maximum total size of a bulk payload: 4 GiB.
pub const DEFAULT_MAX_BULK: u64 = 4 << 30;
/// Default maximum number of tensors in one bulk payload.
pub const DEFAULT_MAX_TENSORS: usize = 65_536;
/// Tensor offsets built by [`Bulk::from_tensors`] are aligned to this many bytes.
pub const BULK_ALIGN: u64 = 8;
/// Size of the slices handed to `write_chunks` when sending bulk data.
const BULK_WRITE_CHUNK: usize = 4 << 20;
/// Largest single read requested from a stream while reading a frame body.
const READ_CHUNK: usize = 1 << 20;

/// Errors of framing and bulk transfer. Any of them closes the stream it came from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CodecError {
    /// A frame header announced a body longer than the stream's limit.
    #[error("frame of {len} bytes exceeds the limit of {max} bytes")]
    FrameTooLarge {
        /// Announced body length.
        len: u64,
        /// The limit in force.
        max: usize,
    },
    /// The stream ended in the middle of a frame or bulk payload.
    #[error("truncated: needed {needed} bytes, have {have}")]
    Truncated {
        /// Bytes the frame (header included) or bulk data needed.
        needed: u64,
        /// Bytes actually received.
        have: u64,
    },
    /// A bulk header frame could not be decoded (postcard error text).
    #[error("bad bulk header: {0}")]
    BadHeader(String),
    /// A bulk header or payload is inconsistent; names the tensor and what is wrong.
    #[error("invalid bulk payload: {reason}")]
    InvalidBulk {
        /// Which tensor and what is wrong with it.
        reason: String,
    },
    /// The peer reset the stream we were reading.
    #[error("stream reset by peer (code {code})")]
    Reset {
        /// Application error code of the reset.
        code: u64,
    },
    /// The peer stopped the stream we were writing.
    #[error("stream stopped by peer (code {code})")]
    Stopped {
        /// Application error code of the stop.
        code: u64,
    },
    /// The connection carrying the stream was lost.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
    /// Any other stream error (closed stream, 0-RTT rejected, ...).
    #[error("stream error: {0}")]
    Io(String),
}

impl From<quinn::ReadError> for CodecError {
    fn from(e: quinn::ReadError) -> Self {
        match e {
            quinn::ReadError::Reset(code) => Self::Reset {
                code: code.into_inner(),
            },
            quinn::ReadError::ConnectionLost(c) => Self::ConnectionLost(c.to_string()),
            other => Self::Io(other.to_string()),
        }
    }
}

impl From<quinn::WriteError> for CodecError {
    fn from(e: quinn::WriteError) -> Self {
        match e {
            quinn::WriteError::Stopped(code) => Self::Stopped {
                code: code.into_inner(),
            },
            quinn::WriteError::ConnectionLost(c) => Self::ConnectionLost(c.to_string()),
            other => Self::Io(other.to_string()),
        }
    }
}

impl From<quinn::ReadExactError> for CodecError {
    /// `FinishedEarly` lacks the expected length; callers that know it map it themselves.
    fn from(e: quinn::ReadExactError) -> Self {
        match e {
            quinn::ReadExactError::FinishedEarly(have) => Self::Truncated {
                needed: have as u64 + 1,
                have: have as u64,
            },
            quinn::ReadExactError::ReadError(r) => r.into(),
        }
    }
}

fn invalid(reason: String) -> CodecError {
    CodecError::InvalidBulk { reason }
}

/// Per-stream frame limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameLimits {
    /// Largest accepted frame body, in bytes (header excluded). At most `u32::MAX`.
    pub max_frame: usize,
}

impl Default for FrameLimits {
    fn default() -> Self {
        Self {
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

/// Limits on bulk payloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BulkLimits {
    /// Limit on the bulk header frame.
    pub frame: FrameLimits,
    /// Largest accepted `total_len`.
    pub max_bulk: u64,
    /// Largest accepted number of tensors.
    pub max_tensors: usize,
}

impl Default for BulkLimits {
    fn default() -> Self {
        Self {
            frame: FrameLimits::default(),
            max_bulk: DEFAULT_MAX_BULK,
            max_tensors: DEFAULT_MAX_TENSORS,
        }
    }
}

/// Encodes one frame: `[u32 LE len][payload]`.
pub fn encode_frame(payload: &[u8], limits: &FrameLimits) -> Result<Vec<u8>, CodecError> {
    let len = frame_len(payload.len(), limits)?;
    let mut out = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// Checks a payload length against the limits and the u32 header.
fn frame_len(len: usize, limits: &FrameLimits) -> Result<u32, CodecError> {
    let too_large = || CodecError::FrameTooLarge {
        len: len as u64,
        max: limits.max_frame,
    };
    if len > limits.max_frame {
        return Err(too_large());
    }
    u32::try_from(len).map_err(|_| too_large())
}

/// Incremental, sans-I/O frame decoder.
///
/// Push bytes as they arrive with [`push`](Self::push), take complete frames with
/// [`next_frame`](Self::next_frame), and call [`finish`](Self::finish) at end of stream.
/// After an oversized header the decoder is failed: further bytes are discarded and
/// `next_frame` keeps returning the error once the frames before it are drained.
#[derive(Debug)]
pub struct FrameDecoder {
    limits: FrameLimits,
    header: [u8; FRAME_HEADER_LEN],
    header_have: usize,
    /// Body length of the frame in progress, once its header is complete.
    body_len: Option<usize>,
    body: BytesMut,
    ready: VecDeque<Bytes>,
    failed: Option<CodecError>,
}

impl FrameDecoder {
    /// A decoder enforcing `limits`.
    pub fn new(limits: FrameLimits) -> Self {
        Self {
            limits,
            header: [0; FRAME_HEADER_LEN],
            header_have: 0,
            body_len: None,
            body: BytesMut::new(),
            ready: VecDeque::new(),
            failed: None,
        }
    }

    /// Feeds received bytes. Only the bytes of frames within the limit are buffered.
    pub fn push(&mut self, mut bytes: &[u8]) {
        while !bytes.is_empty() && self.failed.is_none() {
            match self.body_len {
                None => {
                    let take = (FRAME_HEADER_LEN - self.header_have).min(bytes.len());
                    self.header[self.header_have..self.header_have + take]
                        .copy_from_slice(&bytes[..take]);
                    self.header_have += take;
                    bytes = &bytes[take..];
                    if self.header_have == FRAME_HEADER_LEN {
                        let len = u32::from_le_bytes(self.header);
                        match usize::try_from(len) {
                            Ok(len) if len <= self.limits.max_frame => {
                                if len == 0 {
                                    self.header_have = 0;
                                    self.ready.push_back(Bytes::new());
                                } else {
                                    self.body_len = Some(len);
                                    // Reserve for what is at hand, not what the header claims.
                                    self.body.reserve(len.min(bytes.len()));
                                }
                            }
                            _ => {
                                self.header_have = 0;
                                self.failed = Some(CodecError::FrameTooLarge {
                                    len: u64::from(len),
                                    max: self.limits.max_frame,
                                });
                            }
                        }
                    }
                }
                Some(len) => {
                    let take = (len - self.body.len()).min(bytes.len());
                    self.body.extend_from_slice(&bytes[..take]);
                    bytes = &bytes[take..];
                    if self.body.len() == len {
                        self.ready.push_back(self.body.split().freeze());
                        self.body_len = None;
                        self.header_have = 0;
                    }
                }
            }
        }
    }

    /// The next complete frame, `Ok(None)` if more bytes are needed, or the error that
    /// failed the stream (after the frames that preceded it).
    pub fn next_frame(&mut self) -> Result<Option<Bytes>, CodecError> {
        if let Some(f) = self.ready.pop_front() {
            return Ok(Some(f));
        }
        match &self.failed {
            Some(e) => Err(e.clone()),
            None => Ok(None),
        }
    }

    /// Bytes buffered for the frame in progress (header included).
    pub fn pending_bytes(&self) -> usize {
        match self.body_len {
            Some(_) => FRAME_HEADER_LEN + self.body.len(),
            None => self.header_have,
        }
    }

    /// Ends the stream: an error if the decoder failed or a frame is incomplete.
    /// Complete frames not taken with `next_frame` are dropped.
    pub fn finish(self) -> Result<(), CodecError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        match self.body_len {
            Some(len) => Err(CodecError::Truncated {
                needed: (FRAME_HEADER_LEN + len) as u64,
                have: (FRAME_HEADER_LEN + self.body.len()) as u64,
            }),
            None if self.header_have > 0 => Err(CodecError::Truncated {
                needed: FRAME_HEADER_LEN as u64,
                have: self.header_have as u64,
            }),
            None => Ok(()),
        }
    }
}

/// Writes one frame (header and payload in a single `write_all_chunks`).
pub async fn write_frame(
    send: &mut quinn::SendStream,
    payload: &[u8],
    limits: &FrameLimits,
) -> Result<(), CodecError> {
    let frame = encode_frame(payload, limits)?;
    send.write_all_chunks(&mut [Bytes::from(frame)]).await?;
    Ok(())
}

/// Writes one frame whose payload is already in a [`Bytes`], without copying it.
pub async fn write_frame_bytes(
    send: &mut quinn::SendStream,
    payload: Bytes,
    limits: &FrameLimits,
) -> Result<(), CodecError> {
    let len = frame_len(payload.len(), limits)?;
    let header = Bytes::copy_from_slice(&len.to_le_bytes());
    send.write_all_chunks(&mut [header, payload]).await?;
    Ok(())
}

/// Reads one frame. `Ok(None)` on a clean end of stream before a header; a stream that
/// ends mid-frame is [`CodecError::Truncated`]; an oversized header is rejected before
/// its body is read.
pub async fn read_frame(
    recv: &mut quinn::RecvStream,
    limits: &FrameLimits,
) -> Result<Option<Bytes>, CodecError> {
    let mut header = [0u8; FRAME_HEADER_LEN];
    let mut have = 0;
    while have < FRAME_HEADER_LEN {
        match recv.read(&mut header[have..]).await? {
            Some(n) => have += n,
            None if have == 0 => return Ok(None),
            None => {
                return Err(CodecError::Truncated {
                    needed: FRAME_HEADER_LEN as u64,
                    have: have as u64,
                })
            }
        }
    }
    let raw_len = u32::from_le_bytes(header);
    let len = usize::try_from(raw_len)
        .ok()
        .filter(|&l| l <= limits.max_frame)
        .ok_or(CodecError::FrameTooLarge {
            len: u64::from(raw_len),
            max: limits.max_frame,
        })?;
    if len == 0 {
        return Ok(Some(Bytes::new()));
    }
    let truncated = |got: usize| CodecError::Truncated {
        needed: (FRAME_HEADER_LEN + len) as u64,
        have: (FRAME_HEADER_LEN + got) as u64,
    };
    // Fast path: the whole body in one chunk, no copy.
    let first = recv
        .read_chunk(len, true)
        .await?
        .ok_or_else(|| truncated(0))?;
    if first.bytes.len() == len {
        return Ok(Some(first.bytes));
    }
    let mut body = BytesMut::with_capacity(len.min(READ_CHUNK.max(first.bytes.len())));
    body.extend_from_slice(&first.bytes);
    while body.len() < len {
        let chunk = recv
            .read_chunk(len - body.len(), true)
            .await?
            .ok_or_else(|| truncated(body.len()))?;
        body.extend_from_slice(&chunk.bytes);
    }
    Ok(Some(body.freeze()))
}

/// Element type of a tensor.
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit float.
    F32,
    /// 16-bit IEEE float.
    F16,
    /// 16-bit bfloat.
    BF16,
    /// 64-bit float.
    F64,
    /// 64-bit signed integer.
    I64,
    /// 32-bit signed integer.
    I32,
    /// 16-bit signed integer.
    I16,
    /// 8-bit signed integer.
    I8,
    /// 8-bit unsigned integer.
    U8,
    /// Boolean, one byte each.
    Bool,
}

impl DType {
    /// Size of one element in bytes.
    pub const fn size_bytes(self) -> u64 {
        match self {
            DType::F64 | DType::I64 => 8,
            DType::F32 | DType::I32 => 4,
            DType::F16 | DType::BF16 | DType::I16 => 2,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }
}

/// One tensor of a bulk payload: `data[offset .. offset + len]`.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Tensor name, unique within the payload.
    pub name: String,
    /// Element type.
    pub dtype: DType,
    /// Dimensions; the empty shape is a scalar.
    pub shape: Vec<u64>,
    /// Byte offset in the data.
    pub offset: u64,
    /// Byte length: product(shape) * dtype size.
    pub len: u64,
}

impl TensorMeta {
    /// Number of elements, or `None` on overflow.
    pub fn numel(&self) -> Option<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
    }
}

/// Header of a bulk payload, sent as one postcard frame ahead of the raw data.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct BulkHeader {
    /// The tensors, in any order.
    pub tensors: Vec<TensorMeta>,
    /// Length of the raw data that follows the header.
    pub total_len: u64,
}

impl BulkHeader {
    /// Checks the header: count and size within limits, every range inside `total_len`,
    /// `len == product(shape) * dtype size` (overflow-checked), unique names and
    /// non-overlapping ranges.
    pub fn validate(&self, limits: &BulkLimits) -> Result<(), CodecError> {
        if self.tensors.len() > limits.max_tensors {
            return Err(invalid(format!(
                "{} tensors exceed the limit of {}",
                self.tensors.len(),
                limits.max_tensors
            )));
        }
        if self.total_len > limits.max_bulk {
            return Err(invalid(format!(
                "total_len {} exceeds the limit of {}",
                self.total_len, limits.max_bulk
            )));
        }
        let mut ranges: Vec<(u64, u64, usize)> = Vec::with_capacity(self.tensors.len());
        for (i, t) in self.tensors.iter().enumerate() {
            let numel = t.numel().ok_or_else(|| {
                invalid(format!(
                    "tensor {:?}: shape {:?} overflows",
                    t.name, t.shape
                ))
            })?;
            let expected = numel.checked_mul(t.dtype.size_bytes()).ok_or_else(|| {
                invalid(format!(
                    "tensor {:?}: shape {:?} of {:?} overflows",
                    t.name, t.shape, t.dtype
                ))
            })?;
            if t.len != expected {
                return Err(invalid(format!(
                    "tensor {:?}: len {} but shape {:?} of {:?} needs {}",
                    t.name, t.len, t.shape, t.dtype, expected
                )));
            }
            let end = t
                .offset
                .checked_add(t.len)
                .filter(|&e| e <= self.total_len)
                .ok_or_else(|| {
                    invalid(format!(
                        "tensor {:?}: range {}+{} outside total_len {}",
                        t.name, t.offset, t.len, self.total_len
                    ))
                })?;
            ranges.push((t.offset, end, i));
        }
        let mut names: Vec<&str> = self.tensors.iter().map(|t| t.name.as_str()).collect();
        names.sort_unstable();
        if let Some(w) = names.windows(2).find(|w| w[0] == w[1]) {
            return Err(invalid(format!("tensor {:?}: duplicate name", w[0])));
        }
        // Empty tensors occupy no bytes and cannot overlap anything.
        ranges.retain(|&(s, e, _)| e > s);
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            let (_, prev_end, a) = w[0];
            let (start, _, b) = w[1];
            if start < prev_end {
                return Err(invalid(format!(
                    "tensors {:?} and {:?} overlap",
                    self.tensors[a].name, self.tensors[b].name
                )));
            }
        }
        Ok(())
    }
}

/// Decodes and validates a bulk header frame (sans-I/O).
pub fn decode_bulk_header(frame: &[u8], limits: &BulkLimits) -> Result<BulkHeader, CodecError> {
    if frame.len() > limits.frame.max_frame {
        return Err(CodecError::FrameTooLarge {
            len: frame.len() as u64,
            max: limits.frame.max_frame,
        });
    }
    let (header, rest): (BulkHeader, _) =
        postcard::take_from_bytes(frame).map_err(|e| CodecError::BadHeader(e.to_string()))?;
    if !rest.is_empty() {
        return Err(CodecError::BadHeader(format!(
            "{} trailing bytes after the header",
            rest.len()
        )));
    }
    header.validate(limits)?;
    Ok(header)
}

/// A bulk payload: validated header plus one contiguous data buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct Bulk {
    /// Tensor layout.
    pub header: BulkHeader,
    /// Raw bytes, `header.total_len` long.
    pub data: Bytes,
}

impl Bulk {
    /// Wraps `header` and `data`, validating with the default [`BulkLimits`].
    pub fn new(header: BulkHeader, data: Bytes) -> Result<Self, CodecError> {
        Self::with_limits(header, data, &BulkLimits::default())
    }

    /// Wraps `header` and `data`, validating with `limits`.
    pub fn with_limits(
        header: BulkHeader,
        data: Bytes,
        limits: &BulkLimits,
    ) -> Result<Self, CodecError> {
        header.validate(limits)?;
        if data.len() as u64 != header.total_len {
            return Err(invalid(format!(
                "data is {} bytes but total_len is {}",
                data.len(),
                header.total_len
            )));
        }
        Ok(Self { header, data })
    }

    /// Builds a payload from `(name, dtype, shape, bytes)` tensors, copied into one
    /// buffer with offsets aligned to [`BULK_ALIGN`].
    pub fn from_tensors<N, I>(tensors: I) -> Result<Self, CodecError>
    where
        N: Into<String>,
        I: IntoIterator<Item = (N, DType, Vec<u64>, Bytes)>,
    {
        let items: Vec<(String, DType, Vec<u64>, Bytes)> = tensors
            .into_iter()
            .map(|(n, d, s, b)| (n.into(), d, s, b))
            .collect();
        let mut metas = Vec::with_capacity(items.len());
        let mut offset = 0u64;
        for (name, dtype, shape, bytes) in &items {
            offset = offset
                .checked_next_multiple_of(BULK_ALIGN)
                .ok_or_else(|| invalid("total size overflows".into()))?;
            let len = bytes.len() as u64;
            metas.push(TensorMeta {
                name: name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
                offset,
                len,
            });
            offset = offset
                .checked_add(len)
                .ok_or_else(|| invalid("total size overflows".into()))?;
        }
        let header = BulkHeader {
            tensors: metas,
            total_len: offset,
        };
        header.validate(&BulkLimits::default())?;
        let total = usize::try_from(offset)
            .map_err(|_| invalid(format!("total_len {offset} does not fit in memory")))?;
        let mut data = BytesMut::zeroed(total);
        for (meta, (_, _, _, bytes)) in header.tensors.iter().zip(&items) {
            // Offsets are validated to lie within `total`.
            let start = meta.offset as usize;
            data[start..start + bytes.len()].copy_from_slice(bytes);
        }
        Ok(Self {
            header,
            data: data.freeze(),
        })
    }

    /// The tensor called `name` and a zero-copy slice of its bytes.
    pub fn tensor(&self, name: &str) -> Option<(&TensorMeta, Bytes)> {
        let meta = self.header.tensors.iter().find(|t| t.name == name)?;
        let start = usize::try_from(meta.offset).ok()?;
        let end = start.checked_add(usize::try_from(meta.len).ok()?)?;
        if end > self.data.len() {
            return None;
        }
        Some((meta, self.data.slice(start..end)))
    }

    /// CRC-32 of the data.
    pub fn checksum(&self) -> u32 {
        crc32fast::hash(&self.data)
    }
}

/// Writes a bulk payload: the postcard header as one frame, then the raw data in
/// large zero-copy slices through `write_all_chunks`.
pub async fn write_bulk(
    send: &mut quinn::SendStream,
    bulk: &Bulk,
    limits: &BulkLimits,
) -> Result<(), CodecError> {
    bulk.header.validate(limits)?;
    if bulk.data.len() as u64 != bulk.header.total_len {
        return Err(invalid(format!(
            "data is {} bytes but total_len is {}",
            bulk.data.len(),
            bulk.header.total_len
        )));
    }
    let header =
        postcard::to_stdvec(&bulk.header).map_err(|e| CodecError::BadHeader(e.to_string()))?;
    let len = frame_len(header.len(), &limits.frame)?;
    let mut chunks: Vec<Bytes> = Vec::with_capacity(2 + bulk.data.len() / BULK_WRITE_CHUNK);
    let mut first = Vec::with_capacity(FRAME_HEADER_LEN + header.len());
    first.extend_from_slice(&len.to_le_bytes());
    first.extend_from_slice(&header);
    chunks.push(Bytes::from(first));
    let mut at = 0;
    while at < bulk.data.len() {
        let end = (at + BULK_WRITE_CHUNK).min(bulk.data.len());
        chunks.push(bulk.data.slice(at..end));
        at = end;
    }
    send.write_all_chunks(&mut chunks).await?;
    Ok(())
}

/// Reads a bulk payload written by [`write_bulk`]: the header frame (validated), then
/// exactly `total_len` bytes into one freshly allocated buffer.
pub async fn read_bulk(
    recv: &mut quinn::RecvStream,
    limits: &BulkLimits,
) -> Result<Bulk, CodecError> {
    read_bulk_pooled(recv, limits, &RecvBuffers::new(0)).await
}

/// [`read_bulk`] into a buffer from `buffers` (reused, and given back when the payload
/// is dropped).
pub async fn read_bulk_pooled(
    recv: &mut quinn::RecvStream,
    limits: &BulkLimits,
    buffers: &RecvBuffers,
) -> Result<Bulk, CodecError> {
    let frame = read_frame(recv, &limits.frame)
        .await?
        .ok_or(CodecError::Truncated {
            needed: FRAME_HEADER_LEN as u64,
            have: 0,
        })?;
    let header = decode_bulk_header(&frame, limits)?;
    let total = usize::try_from(header.total_len).map_err(|_| {
        invalid(format!(
            "total_len {} does not fit in memory",
            header.total_len
        ))
    })?;
    let mut data = buffers.take(total);
    match recv.read_exact(data.as_mut_slice()).await {
        Ok(()) => {}
        Err(quinn::ReadExactError::FinishedEarly(have)) => {
            return Err(CodecError::Truncated {
                needed: header.total_len,
                have: have as u64,
            })
        }
        Err(quinn::ReadExactError::ReadError(e)) => return Err(e.into()),
    }
    Ok(Bulk {
        header,
        data: data.freeze(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::test_support::connected_pair;
    use std::time::Duration;

    const T: Duration = Duration::from_secs(60);

    fn lim(max: usize) -> FrameLimits {
        FrameLimits { max_frame: max }
    }

    #[test]
    fn frame_roundtrip_sizes() {
        let limits = lim(1000);
        for size in [0usize, 1, 999, 1000] {
            let payload: Vec<u8> = (0..size).map(|i| i as u8).collect();
            let enc = encode_frame(&payload, &limits).expect("encode");
            assert_eq!(enc.len(), size + 4);
            let mut d = FrameDecoder::new(limits);
            d.push(&enc);
            assert_eq!(d.next_frame().expect("ok").as_deref(), Some(&payload[..]));
            assert_eq!(d.next_frame().expect("ok"), None);
            d.finish().expect("clean");
        }
        assert_eq!(
            encode_frame(&[0; 1001], &limits),
            Err(CodecError::FrameTooLarge {
                len: 1001,
                max: 1000
            })
        );
    }

    #[test]
    fn frames_byte_by_byte() {
        let limits = FrameLimits::default();
        let payloads: Vec<Vec<u8>> = vec![vec![], b"a".to_vec(), vec![7; 300], b"xyz".to_vec()];
        let mut stream = Vec::new();
        for p in &payloads {
            stream.extend(encode_frame(p, &limits).expect("enc"));
        }
        let mut d = FrameDecoder::new(limits);
        let mut got = Vec::new();
        for b in &stream {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().expect("frame") {
                got.push(f.to_vec());
            }
        }
        assert_eq!(got, payloads);
        d.finish().expect("clean");
    }

    #[test]
    fn truncated_header_and_body() {
        let mut d = FrameDecoder::new(FrameLimits::default());
        d.push(&[5, 0]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(
            d.finish(),
            Err(CodecError::Truncated { needed: 4, have: 2 })
        );

        let mut d = FrameDecoder::new(FrameLimits::default());
        d.push(&[5, 0, 0, 0, 1, 2]);
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.pending_bytes(), 6);
        assert_eq!(
            d.finish(),
            Err(CodecError::Truncated { needed: 9, have: 6 })
        );
    }

    #[test]
    fn oversized_rejected_without_buffering() {
        let limits = lim(16);
        let mut d = FrameDecoder::new(limits);
        let mut input = encode_frame(b"ok", &limits).expect("enc");
        input.extend_from_slice(&17u32.to_le_bytes());
        input.extend_from_slice(&[0xAA; 4096]);
        d.push(&input);
        d.push(&[0xBB; 4096]);
        assert_eq!(
            d.pending_bytes(),
            0,
            "body of the oversized frame was buffered"
        );
        assert_eq!(d.next_frame().expect("first").as_deref(), Some(&b"ok"[..]));
        let err = CodecError::FrameTooLarge { len: 17, max: 16 };
        assert_eq!(d.next_frame(), Err(err.clone()));
        assert_eq!(d.next_frame(), Err(err.clone()), "error is sticky");
        assert_eq!(d.finish(), Err(err));

        // u32::MAX header with the default limits.
        let mut d = FrameDecoder::new(FrameLimits::default());
        d.push(&[0xFF; 4]);
        assert!(matches!(
            d.next_frame(),
            Err(CodecError::FrameTooLarge {
                len: 0xFFFF_FFFF,
                ..
            })
        ));
    }

    fn meta(name: &str, dtype: DType, shape: &[u64], offset: u64, len: u64) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            dtype,
            shape: shape.to_vec(),
            offset,
            len,
        }
    }

    fn reason(r: Result<(), CodecError>) -> String {
        match r {
            Err(CodecError::InvalidBulk { reason }) => reason,
            other => panic!("expected InvalidBulk, got {other:?}"),
        }
    }

    #[test]
    fn bulk_header_validation() {
        let l = BulkLimits::default();
        let ok = BulkHeader {
            tensors: vec![
                meta("a", DType::F32, &[2, 3], 0, 24),
                meta("b", DType::U8, &[8], 24, 8),
                meta("s", DType::I64, &[], 32, 8),
                meta("e", DType::F16, &[0, 5], 40, 0),
            ],
            total_len: 40,
        };
        ok.validate(&l).expect("valid");

        let mut h = ok.clone();
        h.tensors[1].offset = 20;
        let r = reason(h.validate(&l));
        assert!(r.contains("overlap") && r.contains("\"a\""), "{r}");

        let mut h = ok.clone();
        h.tensors[2].offset = 33;
        let r = reason(h.validate(&l));
        assert!(r.contains("\"s\"") && r.contains("outside"), "{r}");

        let mut h = ok.clone();
        h.tensors[2].offset = u64::MAX - 3;
        let r = reason(h.validate(&l));
        assert!(r.contains("outside"), "{r}");

        let mut h = ok.clone();
        h.tensors[0].shape = vec![3, 3];
        let r = reason(h.validate(&l));
        assert!(r.contains("\"a\"") && r.contains("needs 36"), "{r}");

        let mut h = ok.clone();
        h.tensors[0].shape = vec![u64::MAX, 2];
        let r = reason(h.validate(&l));
        assert!(r.contains("overflows"), "{r}");
        let mut h = ok.clone();
        h.tensors[0].shape = vec![u64::MAX / 2];
        let r = reason(h.validate(&l));
        assert!(r.contains("overflows"), "{r}");

        let mut h = ok.clone();
        h.tensors[1].name = "a".into();
        assert!(reason(h.validate(&l)).contains("duplicate"));

        let h = BulkHeader {
            tensors: vec![],
            total_len: l.max_bulk + 1,
        };
        assert!(reason(h.validate(&l)).contains("total_len"));
        let small = BulkLimits {
            max_tensors: 3,
            ..l
        };
        assert!(reason(ok.validate(&small)).contains("tensors"));
    }

    #[test]
    fn bulk_header_decode() {
        let l = BulkLimits::default();
        let h = BulkHeader {
            tensors: vec![meta("w", DType::BF16, &[4], 0, 8)],
            total_len: 8,
        };
        let bytes = postcard::to_stdvec(&h).expect("ser");
        assert_eq!(decode_bulk_header(&bytes, &l), Ok(h));
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert!(matches!(
            decode_bulk_header(&trailing, &l),
            Err(CodecError::BadHeader(_))
        ));
        assert!(matches!(
            decode_bulk_header(&bytes[..bytes.len() - 1], &l),
            Err(CodecError::BadHeader(_))
        ));
        assert!(matches!(
            decode_bulk_header(&[0xFF; 32], &l),
            Err(CodecError::BadHeader(_))
        ));
    }

    #[test]
    fn bulk_from_tensors_and_slices() {
        let b = Bulk::from_tensors([
            ("x", DType::U8, vec![3], Bytes::from_static(&[1, 2, 3])),
            (
                "y",
                DType::I32,
                vec![2],
                Bytes::from_static(&[1, 0, 0, 0, 2, 0, 0, 0]),
            ),
        ])
        .expect("bulk");
        assert_eq!(b.header.total_len, 16);
        let (m, y) = b.tensor("y").expect("y");
        assert_eq!(m.offset, 8);
        assert_eq!(&y[..], &[1, 0, 0, 0, 2, 0, 0, 0]);
        assert_eq!(&b.tensor("x").expect("x").1[..], &[1, 2, 3]);
        assert!(b.tensor("z").is_none());
        assert!(
            Bulk::from_tensors([("x", DType::F32, vec![2], Bytes::from_static(&[0; 7]))]).is_err()
        );
        assert!(Bulk::new(b.header.clone(), Bytes::from_static(&[0; 15])).is_err());
        Bulk::new(b.header.clone(), b.data.clone()).expect("new");
    }

    #[tokio::test]
    async fn frames_over_quic() {
        let (c, s, _eps) = connected_pair().await;
        let limits = lim(1 << 20);
        let server = tokio::spawn(async move {
            let (mut send, mut recv) = s.accept_bi().await.map_err(|e| e.to_string())?;
            let mut n = 0;
            while let Some(f) = read_frame(&mut recv, &limits)
                .await
                .map_err(|e| e.to_string())?
            {
                write_frame(&mut send, &f, &limits)
                    .await
                    .map_err(|e| e.to_string())?;
                n += 1;
            }
            send.finish().map_err(|e| e.to_string())?;
            // The client's second stream is oversized.
            let (_send2, mut recv2) = s.accept_bi().await.map_err(|e| e.to_string())?;
            let err = read_frame(&mut recv2, &limits).await;
            // Third stream: truncated mid-body.
            let (_send3, mut recv3) = s.accept_bi().await.map_err(|e| e.to_string())?;
            let err3 = read_frame(&mut recv3, &limits).await;
            Ok::<_, String>((n, err, err3, s))
        });
        let (mut send, mut recv) = c.open_bi().await.expect("open");
        let big = vec![9u8; 1 << 20];
        let payloads: Vec<&[u8]> = vec![b"", b"a", &big, b"tail"];
        for p in &payloads {
            write_frame(&mut send, p, &limits).await.expect("write");
        }
        write_frame_bytes(&mut send, Bytes::from_static(b"zc"), &limits)
            .await
            .expect("write bytes");
        send.finish().expect("finish");
        for p in payloads.iter().chain([&&b"zc"[..]]) {
            let f = tokio::time::timeout(T, read_frame(&mut recv, &limits))
                .await
                .expect("timeout")
                .expect("read")
                .expect("frame");
            assert_eq!(&f[..], *p);
        }
        assert_eq!(read_frame(&mut recv, &limits).await.expect("eof"), None);
        assert!(matches!(
            write_frame(&mut send, &big, &lim(10)).await,
            Err(CodecError::FrameTooLarge { .. })
        ));

        let (mut send2, _recv2) = c.open_bi().await.expect("open2");
        send2
            .write_all(&((1u32 << 20) + 1).to_le_bytes())
            .await
            .expect("w");
        send2.write_all(&[0; 64]).await.expect("w");
        let (mut send3, _recv3) = c.open_bi().await.expect("open3");
        send3.write_all(&10u32.to_le_bytes()).await.expect("w");
        send3.write_all(&[1, 2, 3]).await.expect("w");
        send3.finish().expect("finish");
        let (n, err, err3, _s) = tokio::time::timeout(T, server)
            .await
            .expect("timeout")
            .expect("join")
            .expect("server");
        assert_eq!(n, 5);
        assert_eq!(
            err,
            Err(CodecError::FrameTooLarge {
                len: (1 << 20) + 1,
                max: 1 << 20
            })
        );
        assert_eq!(
            err3,
            Err(CodecError::Truncated {
                needed: 14,
                have: 7
            })
        );
    }

    #[tokio::test]
    async fn bulk_roundtrip_64mib_over_quic() {
        let (c, s, _eps) = connected_pair().await;
        let limits = BulkLimits::default();
        let n: usize = 64 << 20;
        let mut big = vec![0u8; n];
        let mut x: u32 = 0x1234_5678;
        for chunk in big.chunks_mut(4) {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
        }
        let bulk = Bulk::from_tensors([
            (
                "weights",
                DType::F32,
                vec![(n / 4) as u64],
                Bytes::from(big),
            ),
            ("ids", DType::I64, vec![3], Bytes::from_static(&[7; 24])),
            ("empty", DType::BF16, vec![0], Bytes::new()),
        ])
        .expect("bulk");
        let sent_crc = bulk.checksum();
        let receiver = tokio::spawn(async move {
            let mut recv = s.accept_uni().await.map_err(|e| e.to_string())?;
            let b = read_bulk(&mut recv, &limits)
                .await
                .map_err(|e| e.to_string())?;
            // Second stream: truncated data.
            let mut recv2 = s.accept_uni().await.map_err(|e| e.to_string())?;
            let err = read_bulk(&mut recv2, &limits).await;
            Ok::<_, String>((b, err, s))
        });
        let mut send = c.open_uni().await.expect("uni");
        tokio::time::timeout(T, write_bulk(&mut send, &bulk, &limits))
            .await
            .expect("timeout")
            .expect("write");
        send.finish().expect("finish");

        let small = Bulk::from_tensors([("t", DType::U8, vec![100], Bytes::from(vec![1u8; 100]))])
            .expect("small");
        let header = postcard::to_stdvec(&small.header).expect("ser");
        let mut send2 = c.open_uni().await.expect("uni2");
        write_frame(&mut send2, &header, &limits.frame)
            .await
            .expect("hdr");
        send2.write_all(&[1; 40]).await.expect("data");
        send2.finish().expect("finish");

        let (got, err, _s) = tokio::time::timeout(T, receiver)
            .await
            .expect("timeout")
            .expect("join")
            .expect("receiver");
        assert_eq!(got.header, bulk.header);
        assert_eq!(got.data.len(), bulk.data.len());
        assert_eq!(got.checksum(), sent_crc);
        let (m, ids) = got.tensor("ids").expect("ids");
        assert_eq!(m.dtype, DType::I64);
        assert_eq!(&ids[..], &[7; 24]);
        assert_eq!(
            err,
            Err(CodecError::Truncated {
                needed: 100,
                have: 40
            })
        );
    }
}
