//! Named tensors as buckets of raw bytes with a small header — what the runtime carries
//! for weight sync and gradient all-reduce. The header is a plain struct (and has a
//! compact binary encoding of its own); the payload is the tensors' little-endian bytes
//! back to back.

use crate::error::{EngineError, Result};
use std::marker::PhantomData;

use bytes::Bytes;
use tch::{Device, Kind, Tensor};

/// Element type of a bucket entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum BucketDtype {
    /// 32-bit float.
    F32 = 0,
    /// bfloat16.
    Bf16 = 1,
    /// IEEE half.
    F16 = 2,
    /// 64-bit integer.
    I64 = 3,
}

impl BucketDtype {
    /// From a libtorch kind.
    pub fn from_kind(k: Kind) -> Result<Self> {
        Ok(match k {
            Kind::Float => BucketDtype::F32,
            Kind::BFloat16 => BucketDtype::Bf16,
            Kind::Half => BucketDtype::F16,
            Kind::Int64 => BucketDtype::I64,
            other => {
                return Err(EngineError::Bucket(format!(
                    "dtype {other:?} cannot go in a bucket (f32, bf16, f16, i64 can)"
                )))
            }
        })
    }
    /// The libtorch kind.
    pub fn kind(self) -> Kind {
        match self {
            BucketDtype::F32 => Kind::Float,
            BucketDtype::Bf16 => Kind::BFloat16,
            BucketDtype::F16 => Kind::Half,
            BucketDtype::I64 => Kind::Int64,
        }
    }
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            BucketDtype::F32 => 4,
            BucketDtype::Bf16 | BucketDtype::F16 => 2,
            BucketDtype::I64 => 8,
        }
    }
    fn from_u8(b: u8) -> Result<Self> {
        Ok(match b {
            0 => BucketDtype::F32,
            1 => BucketDtype::Bf16,
            2 => BucketDtype::F16,
            3 => BucketDtype::I64,
            other => return Err(EngineError::Bucket(format!("unknown dtype code {other}"))),
        })
    }
}

/// One tensor's place in a bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketEntry {
    /// Parameter name.
    pub name: String,
    /// Element type.
    pub dtype: BucketDtype,
    /// Shape.
    pub shape: Vec<i64>,
    /// Byte offset in the payload.
    pub offset: u64,
    /// Byte length.
    pub len: u64,
}

/// A bucket: header entries and the payload bytes. The payload is shared, not copied,
/// when a bucket is cloned or taken off the wire.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WeightBucket {
    /// The tensors in the payload.
    pub entries: Vec<BucketEntry>,
    /// Raw little-endian bytes.
    pub data: Bytes,
}

/// A bucket's payload being filled ([`to_buckets`]).
struct BucketBuilder {
    entries: Vec<BucketEntry>,
    data: Vec<u8>,
}

impl BucketBuilder {
    /// Appends a tensor (copied to host bytes, straight into the payload: no temporary
    /// buffer; [`to_buckets`] reserves each bucket's payload up front, so it does not
    /// grow and move either).
    fn push(&mut self, name: &str, t: &Tensor) -> Result<()> {
        let dtype = BucketDtype::from_kind(t.kind())?;
        let shape = t.size();
        let n = t.numel() * t.kind().elt_size_in_bytes();
        let offset = self.data.len();
        self.data.reserve(n);
        if n > 0 {
            // One strided pass from the tensor (a transposed or fused-slice view, on any
            // device) into the payload, instead of a contiguous copy and then bytes; the
            // spare capacity is written once, not zeroed first.
            // SAFETY: `dst` views the first `n` bytes of the spare capacity (reserved
            // above), which stays allocated and untouched until `dst` is dropped at the
            // end of this block.
            let dst = unsafe {
                Tensor::f_from_blob(
                    self.data.spare_capacity_mut().as_mut_ptr().cast::<u8>(),
                    &shape,
                    &row_major_strides(&shape),
                    t.kind(),
                    Device::Cpu,
                )?
            };
            tch::no_grad(|| dst.shallow_clone().f_copy_(t))?;
            // SAFETY: the copy succeeded, so all `n` bytes after `offset` are written.
            unsafe { self.data.set_len(offset + n) };
        }
        self.entries.push(BucketEntry {
            name: name.into(),
            dtype,
            shape,
            offset: offset as u64,
            len: n as u64,
        });
        Ok(())
    }

    fn finish(self) -> WeightBucket {
        WeightBucket {
            entries: self.entries,
            data: Bytes::from(self.data),
        }
    }
}

/// Strides of a contiguous row-major tensor of `shape`.
fn row_major_strides(shape: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * shape[i + 1];
    }
    strides
}

/// A bucket's tensors as views of its payload on the CPU: no copy. They are for
/// reading (copying into a model, a gradient, another device) while the bucket lives;
/// the borrow keeps the bucket alive, and nothing may write through them (the payload
/// may be shared with other buckets and the wire).
pub struct BucketViews<'a> {
    tensors: Vec<(String, Tensor)>,
    _payload: PhantomData<&'a [u8]>,
}

impl BucketViews<'_> {
    /// The tensors by name, in the bucket's order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &Tensor)> {
        self.tensors.iter().map(|(n, t)| (n.as_str(), t))
    }
}

impl WeightBucket {
    /// The payload's bytes of entry `e`, checked against the payload and the shape.
    fn entry_bytes(&self, e: &BucketEntry) -> Result<&[u8]> {
        let end = e
            .offset
            .checked_add(e.len)
            .filter(|&x| x <= self.data.len() as u64)
            .ok_or_else(|| {
                EngineError::Bucket(format!(
                    "entry `{}` spans bytes {}..{} of a {}-byte payload",
                    e.name,
                    e.offset,
                    e.offset.saturating_add(e.len),
                    self.data.len()
                ))
            })?;
        let numel = e.shape.iter().try_fold(
            1i64,
            |acc, &d| if d < 0 { None } else { acc.checked_mul(d) },
        );
        if numel.and_then(|n| (n as u64).checked_mul(e.dtype.size() as u64)) != Some(e.len) {
            return Err(EngineError::Bucket(format!(
                "entry `{}`: shape {:?} of {:?} does not fill the {} bytes the header gives it",
                e.name, e.shape, e.dtype, e.len
            )));
        }
        Ok(&self.data[e.offset as usize..end as usize])
    }

    /// The tensors as views of the payload (see [`BucketViews`]).
    pub fn views(&self) -> Result<BucketViews<'_>> {
        let mut tensors = Vec::with_capacity(self.entries.len());
        for e in &self.entries {
            let bytes = self.entry_bytes(e)?;
            let t = if bytes.is_empty() {
                Tensor::f_zeros(&e.shape, (e.dtype.kind(), Device::Cpu))?
            } else if bytes.as_ptr() as usize % e.dtype.size() != 0 {
                // Not aligned to its element (a payload cut at an odd offset): a copy.
                Tensor::f_from_data_size(bytes, &e.shape, e.dtype.kind())?
            } else {
                // SAFETY: the view covers exactly `bytes`, which the returned
                // `BucketViews` borrows, so the payload outlives it; the pointer is cast
                // to `*mut` only because libtorch's signature asks for it, and the view is
                // only read (see `BucketViews`).
                unsafe {
                    Tensor::f_from_blob(
                        bytes.as_ptr() as *mut u8,
                        &e.shape,
                        &row_major_strides(&e.shape),
                        e.dtype.kind(),
                        Device::Cpu,
                    )?
                }
            };
            tensors.push((e.name.clone(), t));
        }
        Ok(BucketViews {
            tensors,
            _payload: PhantomData,
        })
    }

    /// The tensors, on `device` (each is a fresh copy).
    pub fn tensors(&self, device: Device) -> Result<Vec<(String, Tensor)>> {
        let views = self.views()?;
        views
            .iter()
            .map(|(n, t)| {
                let owned = match device {
                    Device::Cpu => t.f_detach_copy()?,
                    d => t.f_to_device(d)?,
                };
                Ok((n.to_string(), owned))
            })
            .collect()
    }

    /// Encodes the header: `u32 count`, then per entry `u16 name_len, name, u8 dtype,
    /// u8 ndim, i64 dims…, u64 offset, u64 len` (little-endian).
    pub fn encode_header(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend((self.entries.len() as u32).to_le_bytes());
        for e in &self.entries {
            out.extend((e.name.len() as u16).to_le_bytes());
            out.extend(e.name.as_bytes());
            out.push(e.dtype as u8);
            out.push(e.shape.len() as u8);
            for d in &e.shape {
                out.extend(d.to_le_bytes());
            }
            out.extend(e.offset.to_le_bytes());
            out.extend(e.len.to_le_bytes());
        }
        out
    }

    /// Decodes a header written by [`WeightBucket::encode_header`].
    pub fn decode_header(b: &[u8]) -> Result<Vec<BucketEntry>> {
        let mut pos = 0usize;
        let mut take = |n: usize| -> Result<&[u8]> {
            let s = b
                .get(pos..pos + n)
                .ok_or_else(|| EngineError::Bucket(format!("header truncated at byte {pos}")))?;
            pos += n;
            Ok(s)
        };
        let count = u32::from_le_bytes(take(4)?.try_into().expect("4")) as usize;
        let mut out = Vec::with_capacity(count.min(1 << 16));
        for _ in 0..count {
            let nl = u16::from_le_bytes(take(2)?.try_into().expect("2")) as usize;
            let name = String::from_utf8(take(nl)?.to_vec())
                .map_err(|_| EngineError::Bucket("entry name is not UTF-8".into()))?;
            let dtype = BucketDtype::from_u8(take(1)?[0])?;
            let nd = take(1)?[0] as usize;
            let mut shape = Vec::with_capacity(nd);
            for _ in 0..nd {
                shape.push(i64::from_le_bytes(take(8)?.try_into().expect("8")));
            }
            let offset = u64::from_le_bytes(take(8)?.try_into().expect("8"));
            let len = u64::from_le_bytes(take(8)?.try_into().expect("8"));
            out.push(BucketEntry {
                name,
                dtype,
                shape,
                offset,
                len,
            });
        }
        Ok(out)
    }
}

/// Packs named tensors into buckets of at most `max_bytes` payload each (a tensor larger
/// than that gets a bucket of its own).
pub fn to_buckets(named: &[(String, Tensor)], max_bytes: usize) -> Result<Vec<WeightBucket>> {
    let size = |t: &Tensor| t.numel() * t.kind().elt_size_in_bytes();
    // Bucket boundaries first, so each payload is allocated once at its final size.
    if named.is_empty() {
        return Ok(Vec::new());
    }
    let (mut cuts, mut first, mut bytes) = (Vec::new(), 0, 0);
    for (i, (_, t)) in named.iter().enumerate() {
        if i > first && bytes + size(t) > max_bytes {
            cuts.push(i);
            (first, bytes) = (i, 0);
        }
        bytes += size(t);
    }
    cuts.push(named.len());
    let mut out = Vec::with_capacity(cuts.len());
    let mut start = 0;
    for end in cuts {
        let part = &named[start..end];
        let mut cur = BucketBuilder {
            entries: Vec::with_capacity(part.len()),
            data: Vec::with_capacity(part.iter().map(|(_, t)| size(t)).sum()),
        };
        for (name, t) in part {
            cur.push(name, t)?;
        }
        out.push(cur.finish());
        start = end;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Views (a transpose, a column slice, a zero-size tensor) land in the payload as
    /// their contiguous values, and buckets split at the byte limit.
    #[test]
    fn views_round_trip_and_buckets_split() {
        let base = Tensor::arange(24, (Kind::Float, Device::Cpu)).view([4, 6]);
        let named = vec![
            ("t".to_string(), base.tr()),
            ("slice".to_string(), base.narrow(1, 2, 3)),
            (
                "empty".to_string(),
                Tensor::zeros([0, 3], (Kind::Float, Device::Cpu)),
            ),
            ("whole".to_string(), base.shallow_clone()),
        ];
        // 24 floats = 96 bytes: "t" alone, then "slice" + "empty" (48 bytes), then "whole".
        let bs = to_buckets(&named, 96).unwrap();
        assert_eq!(
            bs.len(),
            3,
            "{:?}",
            bs.iter().map(|b| b.entries.len()).collect::<Vec<_>>()
        );
        let back: Vec<(String, Tensor)> = bs
            .iter()
            .flat_map(|b| b.tensors(Device::Cpu).unwrap())
            .collect();
        assert_eq!(back.len(), named.len());
        for ((n, want), (m, got)) in named.iter().zip(&back) {
            assert_eq!(n, m);
            assert_eq!(want.size(), got.size(), "{n}");
            assert!(want.equal(got), "{n}");
        }
        assert!(to_buckets(&[], 96).unwrap().is_empty());
    }

    #[test]
    fn round_trip_and_header() {
        let a = Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]);
        let b = Tensor::from_slice(&[5.0f32, 6.0]).to_kind(Kind::BFloat16);
        let named = vec![
            ("a".to_string(), a.shallow_clone()),
            ("b".to_string(), b.shallow_clone()),
        ];
        let bs = to_buckets(&named, 1 << 20).unwrap();
        assert_eq!(bs.len(), 1);
        let hdr = bs[0].encode_header();
        assert_eq!(WeightBucket::decode_header(&hdr).unwrap(), bs[0].entries);
        // Views read the payload in place; `tensors` copies.
        let views = bs[0].views().unwrap();
        let (name, view) = views.iter().next().unwrap();
        assert_eq!(name, "a");
        assert_eq!(view.data_ptr() as usize, bs[0].data.as_ptr() as usize);
        assert_eq!(view, &a);
        let ts = bs[0].tensors(Device::Cpu).unwrap();
        assert_ne!(ts[0].1.data_ptr() as usize, bs[0].data.as_ptr() as usize);
        assert_eq!(ts[0].1, a);
        assert_eq!(ts[1].1.kind(), Kind::BFloat16);
        assert_eq!(
            ts[1].1.to_kind(Kind::Float),
            Tensor::from_slice(&[5.0f32, 6.0])
        );
        // Small limit: one tensor per bucket.
        assert_eq!(to_buckets(&named, 4).unwrap().len(), 2);
        // Corrupt headers are errors, not panics.
        assert!(WeightBucket::decode_header(&hdr[..hdr.len() - 3]).is_err());
        let mut bad = bs[0].clone();
        bad.entries[0].len = 999;
        assert!(bad.tensors(Device::Cpu).is_err());
        assert!(bad.views().is_err());
        bad.entries[0].len = 16;
        bad.entries[0].shape = vec![-1, -4];
        assert!(
            bad.views().is_err(),
            "negative dims fill 16 bytes only by overflow"
        );
    }
}
