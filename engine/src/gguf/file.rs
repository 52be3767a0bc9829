//! The GGUF container: metadata key/values, tensor infos and the memory-mapped tensor
//! data. Layout (version 2 and 3, little-endian): magic `GGUF`, version, tensor count,
//! metadata count, the metadata key/values, the tensor infos, padding to
//! `general.alignment` (32 by default), then the tensor data. Tensor dims are listed
//! fastest-varying first, so the PyTorch shape is the reverse.

use super::dequant::{dequantize, GgmlType};
use crate::error::{EngineError, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer of any width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v as u64),
            GgufValue::U16(v) => Some(v as u64),
            GgufValue::U32(v) => Some(v as u64),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) if v >= 0 => Some(v as u64),
            GgufValue::I16(v) if v >= 0 => Some(v as u64),
            GgufValue::I32(v) if v >= 0 => Some(v as u64),
            GgufValue::I64(v) if v >= 0 => Some(v as u64),
            _ => None,
        }
    }
    /// The value as an `i64`, if it is an integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v as i64),
            GgufValue::I16(v) => Some(v as i64),
            GgufValue::I32(v) => Some(v as i64),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().map(|v| v as i64),
        }
    }
    /// The value as an `f64`, if it is numeric.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v as f64),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }
    /// The value as a string slice.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }
    /// The value as a bool.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }
    /// The value as an array.
    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the GGUF directory.
#[derive(Debug, Clone)]
pub struct GgufTensorInfo {
    /// Its GGUF name (e.g. `blk.0.attn_q.weight`).
    pub name: String,
    /// Dims as GGUF lists them (fastest-varying first).
    pub dims: Vec<u64>,
    /// The raw ggml type id.
    pub ty: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Number of elements (`u64::MAX` if the dims' product overflows, which
    /// [`GgufFile::open`] and [`GgufFile::from_bytes`] reject).
    pub fn numel(&self) -> u64 {
        self.dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .unwrap_or(u64::MAX)
    }
    /// The PyTorch (row-major) shape: the dims reversed.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// The bytes of a GGUF file: memory-mapped ([`GgufFile::open`]) or held in memory
/// ([`GgufFile::from_bytes`]).
enum Bytes {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Bytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Bytes::Mapped(m) => m,
            Bytes::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file (the tensor data stays memory-mapped when read from disk).
pub struct GgufFile {
    path: PathBuf,
    map: Bytes,
    /// Format version (2 or 3).
    pub version: u32,
    /// All metadata, by key.
    pub metadata: BTreeMap<String, GgufValue>,
    /// All tensors, in file order.
    pub tensors: Vec<GgufTensorInfo>,
    data_offset: usize,
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

/// The fewest bytes a metadata value of type `ty` takes in the file.
fn min_value_bytes(ty: u32) -> u64 {
    match ty {
        2 | 3 => 2,
        4..=6 => 4,
        8 | 10..=12 => 8,
        9 => 12,
        _ => 1,
    }
}

impl<'a> Reader<'a> {
    fn err(&self, msg: impl Into<String>) -> EngineError {
        EngineError::GgufFormat {
            path: self.path.to_path_buf(),
            msg: format!("{} (at byte {})", msg.into(), self.pos),
        }
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.pos.checked_add(n).is_none_or(|e| e > self.buf.len()) {
            return Err(self.err(format!(
                "truncated: wanted {n} more bytes, file has {}",
                self.buf.len()
            )));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self.take(N)?.try_into().expect("length checked"))
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    /// Reads a count of items that each take at least `min_bytes` in the file and
    /// rejects one the rest of the file cannot hold, before anything is allocated for it.
    fn count(&mut self, field: &str, min_bytes: u64) -> Result<u64> {
        let n = self.u64()?;
        let left = (self.buf.len() - self.pos) as u64;
        if n > left / min_bytes.max(1) {
            return Err(self.err(format!(
                "{field} = {n}, but each entry takes at least {min_bytes} bytes and only {left} bytes \
                 remain: the file is corrupt or truncated; re-download or re-convert it"
            )));
        }
        Ok(n)
    }
    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > (1 << 30) {
            return Err(self.err(format!("string length {n} is implausible")));
        }
        let b = self.take(n as usize)?;
        // Some GGUF tokens are not valid UTF-8 (byte tokens); keep them lossily.
        Ok(String::from_utf8_lossy(b).into_owned())
    }
    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.arr::<1>()?[0]),
            1 => GgufValue::I8(self.arr::<1>()?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.arr()?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.arr()?)),
            4 => GgufValue::U32(self.u32()?),
            5 => GgufValue::I32(i32::from_le_bytes(self.arr()?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.arr()?)),
            7 => GgufValue::Bool(self.arr::<1>()?[0] != 0),
            8 => GgufValue::String(self.string()?),
            9 => {
                if depth > 4 {
                    return Err(self.err("arrays nested too deeply"));
                }
                let ety = self.u32()?;
                let n = self.count("array length", min_value_bytes(ety))?;
                let mut v = Vec::with_capacity(n as usize);
                for _ in 0..n {
                    v.push(self.value(ety, depth + 1)?);
                }
                GgufValue::Array(v)
            }
            10 => GgufValue::U64(self.u64()?),
            11 => GgufValue::I64(i64::from_le_bytes(self.arr()?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.arr()?)),
            t => return Err(self.err(format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file (the tensor data stays memory-mapped).
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        if !path.exists() {
            return Err(EngineError::Missing {
                what: "GGUF file",
                path: path.into(),
                hint: "check the path",
            });
        }
        let f = std::fs::File::open(path).map_err(|e| EngineError::io("opening", path, e))?;
        // SAFETY: the file is opened read-only; yatt does not modify it while mapped.
        let map =
            unsafe { memmap2::Mmap::map(&f) }.map_err(|e| EngineError::io("mapping", path, e))?;
        Self::parse(path.into(), Bytes::Mapped(map))
    }

    /// Parses a GGUF file held in memory; `path` names it in error messages (nothing is
    /// read from it).
    pub fn from_bytes(path: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self> {
        Self::parse(path.into(), Bytes::Owned(bytes))
    }

    fn parse(path: PathBuf, map: Bytes) -> Result<Self> {
        let mut r = Reader {
            buf: &map,
            pos: 0,
            path: &path,
        };
        let magic = r.arr::<4>()?;
        if &magic != b"GGUF" {
            return Err(r.err(format!(
                "bad magic {magic:?}, expected \"GGUF\" (is this a GGUF file?)"
            )));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.err(format!(
                "GGUF version {version} is not supported (2 and 3 are)"
            )));
        }
        // A tensor info is at least a name length, a dim count, a type and an offset (24
        // bytes); a key/value at least a key length, a type and one byte (13 bytes).
        let n_tensors = r.count("header tensor_count", 24)?;
        let n_kv = r.count("header metadata_kv_count", 13)?;
        let mut metadata = BTreeMap::new();
        // A key or tensor name given twice is refused (as llama.cpp does): one of the two
        // would be dropped without a word, and two tensors of one name broke the import.
        let twice = |r: &Reader, what: &str, name: &str| {
            r.err(format!(
                "{what} `{name}` appears twice: the file is corrupt; re-download or re-convert it"
            ))
        };
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let v = r.value(ty, 0)?;
            if metadata.contains_key(&key) {
                return Err(twice(&r, "metadata key", &key));
            }
            metadata.insert(key, v);
        }
        let mut tensors = Vec::with_capacity(n_tensors as usize);
        let mut names = std::collections::HashSet::new();
        for _ in 0..n_tensors {
            let name = r.string()?;
            if !names.insert(name.clone()) {
                return Err(twice(&r, "tensor", &name));
            }
            let nd = r.u32()?;
            if nd > 8 {
                return Err(r.err(format!("tensor {name} has {nd} dims")));
            }
            let mut dims = Vec::with_capacity(nd as usize);
            for _ in 0..nd {
                dims.push(r.u64()?);
            }
            // Libtorch and the safetensors writer multiply the dims in their own order (the
            // latter in shape order, the dims reversed), so the product must fit whatever the
            // order: without its zeros, in an i64. [4, 0, 2^61, 2^62] has no elements, but
            // the import's safetensors writer overflowed on it (a panic with overflow
            // checks, a wrapped size without).
            let product = dims
                .iter()
                .filter(|&&d| d != 0)
                .try_fold(1u64, |a, &d| a.checked_mul(d));
            if product.is_none_or(|n| n > i64::MAX as u64) {
                return Err(r.err(format!(
                    "tensor `{name}` has dims {dims:?}, whose product (zeros left out) does not \
                     fit in 63 bits: the file is corrupt; re-download or re-convert it"
                )));
            }
            let ty = GgmlType(r.u32()?);
            let offset = r.u64()?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let align = metadata
            .get("general.alignment")
            .and_then(|v| v.as_u64())
            .unwrap_or(32) as usize;
        if align == 0 || !align.is_power_of_two() {
            return Err(r.err(format!("general.alignment {align} is not a power of two")));
        }
        let data_offset = r.pos.div_ceil(align) * align;
        let out = GgufFile {
            path,
            map,
            version,
            metadata,
            tensors,
            data_offset,
        };
        for t in &out.tensors {
            out.tensor_bytes(t)?; // bounds-check every tensor up front
        }
        Ok(out)
    }

    /// The file path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A metadata value.
    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    /// A tensor by name.
    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor. Errors for types whose block size is unknown.
    pub fn tensor_bytes(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        let past_end = |what: String| {
            EngineError::GgufFormat {
            path: self.path.clone(),
            msg: format!(
                "tensor {} {what}, which runs past the end of the file ({} bytes): the file is corrupt or truncated; re-download or re-convert it",
                t.name,
                self.map.len()
            ),
        }
        };
        let n = t.numel();
        // No ggml type packs more than 8 elements per byte: bounds the element count (and
        // so the byte length below) before any arithmetic can overflow.
        if n > (self.map.len() as u64).saturating_mul(8) {
            return Err(past_end(format!("has dims {:?} ({n} elements)", t.dims)));
        }
        let len =
            t.ty.byte_len(n)
                .ok_or_else(|| EngineError::UnsupportedGgufType {
                    tensor: t.name.clone(),
                    ty: t.ty.name(),
                })?;
        let end = (self.data_offset as u64)
            .checked_add(t.offset)
            .and_then(|start| start.checked_add(len));
        let Some(end) = end.filter(|&e| e <= self.map.len() as u64) else {
            return Err(past_end(format!(
                "at offset {} needs {len} bytes",
                t.offset
            )));
        };
        let start = end - len;
        Ok(&self.map[start as usize..end as usize])
    }

    /// Dequantizes a tensor to f32 (row-major, PyTorch shape [`GgufTensorInfo::shape`]).
    pub fn dequantize(&self, t: &GgufTensorInfo) -> Result<Vec<f32>> {
        if !t.ty.is_supported() {
            return Err(EngineError::UnsupportedGgufType {
                tensor: t.name.clone(),
                ty: t.ty.name(),
            });
        }
        let bytes = self.tensor_bytes(t)?;
        dequantize(t.ty, bytes, t.numel() as usize).map_err(|msg| EngineError::GgufFormat {
            path: self.path.clone(),
            msg: format!("tensor {}: {msg}", t.name),
        })
    }
}
