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

/// A bulk payload: a validated header and the bytes it lays out.
///
/// A received payload is one buffer. A payload built from tensors
/// ([`Bulk::from_tensors`]) keeps each tensor's bytes where they are, and sending writes
/// them in turn: a multi-gigabyte weight update sent to several peers is never copied
/// into a buffer per peer.
#[derive(Clone, Debug)]
pub struct Bulk {
    header: BulkHeader,
    data: Layout,
}

#[derive(Clone, Debug)]
enum Layout {
    /// One buffer, `header.total_len` long.
    Contiguous(Bytes),
    /// Byte ranges at their offsets, sorted and not overlapping; what lies between them
    /// (alignment padding) is zeros.
    Gathered(Vec<(u64, Bytes)>),
}

/// Zeros for the gaps of a gathered payload.
static ZEROS: [u8; 4096] = [0; 4096];

impl PartialEq for Bulk {
    fn eq(&self, other: &Self) -> bool {
        self.header == other.header && self.contiguous() == other.contiguous()
    }
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
        Ok(Self {
            header,
            data: Layout::Contiguous(data),
        })
    }

    /// Builds a payload from `(name, dtype, shape, bytes)` tensors, laid out in order at
    /// offsets aligned to [`BULK_ALIGN`]. The bytes are not copied.
    pub fn from_tensors<N, I>(tensors: I) -> Result<Self, CodecError>
    where
        N: Into<String>,
        I: IntoIterator<Item = (N, DType, Vec<u64>, Bytes)>,
    {
        let mut metas = Vec::new();
        let mut parts = Vec::new();
        let mut offset = 0u64;
        for (name, dtype, shape, bytes) in tensors {
            offset = offset
                .checked_next_multiple_of(BULK_ALIGN)
                .ok_or_else(|| invalid("total size overflows".into()))?;
            let len = bytes.len() as u64;
            metas.push(TensorMeta {
                name: name.into(),
                dtype,
                shape,
                offset,
                len,
            });
            if len > 0 {
                parts.push((offset, bytes));
            }
            offset = offset
                .checked_add(len)
                .ok_or_else(|| invalid("total size overflows".into()))?;
        }
        let header = BulkHeader {
            tensors: metas,
            total_len: offset,
        };
        header.validate(&BulkLimits::default())?;
        Ok(Self {
            header,
            data: Layout::Gathered(parts),
        })
    }

    /// The tensor layout.
    pub fn header(&self) -> &BulkHeader {
        &self.header
    }

    /// Bytes of data (`header.total_len`).
    pub fn len(&self) -> u64 {
        self.header.total_len
    }

    /// Whether the payload has no data bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The tensor called `name` and a zero-copy slice of its bytes.
    pub fn tensor(&self, name: &str) -> Option<(&TensorMeta, Bytes)> {
        let meta = self.header.tensors.iter().find(|t| t.name == name)?;
        Some((meta, self.range(meta.offset, meta.len)?))
    }

    /// `len` bytes at `offset`, without copying; `None` if they are not one slice.
    fn range(&self, offset: u64, len: u64) -> Option<Bytes> {
        if len == 0 {
            return Some(Bytes::new());
        }
        let start = usize::try_from(offset).ok()?;
        let end = start.checked_add(usize::try_from(len).ok()?)?;
        match &self.data {
            Layout::Contiguous(data) => (end <= data.len()).then(|| data.slice(start..end)),
            Layout::Gathered(parts) => {
                // The last part starting at or before `offset` is the only one that can
                // hold it.
                let i = parts
                    .partition_point(|(at, _)| *at <= offset)
                    .checked_sub(1)?;
                let (at, bytes) = &parts[i];
                let from = usize::try_from(offset - at).ok()?;
                let to = from.checked_add(usize::try_from(len).ok()?)?;
                (to <= bytes.len()).then(|| bytes.slice(from..to))
            }
        }
    }

    /// The payload without tensor `name` (the others keep their offsets; no copy).
    pub fn without(mut self, name: &str) -> Self {
        let Some(i) = self.header.tensors.iter().position(|t| t.name == name) else {
            return self;
        };
        let meta = self.header.tensors.remove(i);
        if let Layout::Gathered(parts) = &mut self.data {
            // The removed range becomes a gap, which is sent as zeros.
            parts.retain(|(at, _)| *at != meta.offset || meta.len == 0);
        }
        self
    }

    /// The payload's bytes in order, as zero-copy slices of at most `max` bytes (the
    /// gaps of a gathered payload come as zeros).
    pub fn pieces(&self, max: usize) -> Vec<Bytes> {
        let max = max.max(1);
        let mut out = Vec::new();
        let mut push = |bytes: &Bytes| {
            let mut at = 0;
            while at < bytes.len() {
                let end = (at + max).min(bytes.len());
                out.push(bytes.slice(at..end));
                at = end;
            }
        };
        match &self.data {
            Layout::Contiguous(data) => push(data),
            Layout::Gathered(parts) => {
                let mut at = 0u64;
                for (offset, bytes) in parts {
                    zeros(*offset - at, &mut push);
                    push(bytes);
                    at = offset + bytes.len() as u64;
                }
                zeros(self.header.total_len - at, &mut push);
            }
        }
        out
    }

    /// Writes the payload's bytes into `dst`, which must be [`Bulk::len`] bytes long.
    pub fn copy_to(&self, dst: &mut [u8]) {
        assert_eq!(
            dst.len() as u64,
            self.len(),
            "copy_to: wrong destination size"
        );
        let mut at = 0;
        for piece in self.pieces(usize::MAX) {
            dst[at..at + piece.len()].copy_from_slice(&piece);
            at += piece.len();
        }
    }

    /// The payload as one buffer: free for a received payload, a copy for a gathered one.
    pub fn contiguous(&self) -> Bytes {
        match &self.data {
            Layout::Contiguous(data) => data.clone(),
            Layout::Gathered(_) => {
                let mut data = vec![0; self.len() as usize];
                self.copy_to(&mut data);
                Bytes::from(data)
            }
        }
    }

    /// CRC-32 of the data.
    pub fn checksum(&self) -> u32 {
        let mut crc = crc32fast::Hasher::new();
        for piece in self.pieces(usize::MAX) {
            crc.update(&piece);
        }
        crc.finalize()
    }
}

/// Feeds `len` zero bytes to `push` from [`ZEROS`].
fn zeros(mut len: u64, push: &mut impl FnMut(&Bytes)) {
    while len > 0 {
        let n = len.min(ZEROS.len() as u64) as usize;
        push(&Bytes::from_static(&ZEROS[..n]));
        len -= n as u64;
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
    let header =
        postcard::to_stdvec(&bulk.header).map_err(|e| CodecError::BadHeader(e.to_string()))?;
    let len = frame_len(header.len(), &limits.frame)?;
    let mut first = Vec::with_capacity(FRAME_HEADER_LEN + header.len());
    first.extend_from_slice(&len.to_le_bytes());
    first.extend_from_slice(&header);
    let mut chunks = vec![Bytes::from(first)];
    chunks.extend(bulk.pieces(BULK_WRITE_CHUNK));
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
        data: Layout::Contiguous(data.freeze()),
    })
}

#[cfg(test)]
mod tests;
