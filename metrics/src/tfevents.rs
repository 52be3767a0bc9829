//! TensorBoard event files: TFRecord framing around `tensorflow.Event` protobufs.
//!
//! A record is `u64 length (LE) | u32 masked crc32c(length) | data | u32 masked
//! crc32c(data)`. The first record of a file is an Event with `file_version =
//! "brain.Event:2"`; every later one carries a `Summary` of scalar values for one step.
//! Only the handful of protobuf fields that scalars need are encoded, by hand:
//!
//! | message | field | number | wire type |
//! |---|---|---|---|
//! | `Event` | `wall_time` (double) | 1 | 64-bit |
//! | `Event` | `step` (int64) | 2 | varint |
//! | `Event` | `file_version` (string) | 3 | length-delimited |
//! | `Event` | `summary` (Summary) | 5 | length-delimited |
//! | `Summary` | `value` (repeated Value) | 1 | length-delimited |
//! | `Summary.Value` | `tag` (string) | 1 | length-delimited |
//! | `Summary.Value` | `simple_value` (float) | 2 | 32-bit |

use std::fs::File;
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};

use crate::crc32c::masked_crc32c;
use crate::WriteError;

/// What the first record of every event file declares.
pub const FILE_VERSION: &str = "brain.Event:2";

/// The prefix of every event file name; TensorBoard finds files by it.
pub const FILE_PREFIX: &str = "events.out.tfevents.";

const VARINT: u32 = 0;
const FIXED64: u32 = 1;
const LEN: u32 = 2;
const FIXED32: u32 = 5;

fn put_varint(buf: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        buf.push((v as u8) | 0x80);
        v >>= 7;
    }
    buf.push(v as u8);
}

fn put_key(buf: &mut Vec<u8>, field: u32, wire: u32) {
    put_varint(buf, u64::from(field << 3 | wire));
}

fn put_bytes(buf: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_key(buf, field, LEN);
    put_varint(buf, bytes.len() as u64);
    buf.extend_from_slice(bytes);
}

/// An `Event` with `wall_time` and `file_version` only: the first record of a file.
pub fn encode_file_version_event(wall_time: f64) -> Vec<u8> {
    let mut buf = Vec::with_capacity(32);
    put_key(&mut buf, 1, FIXED64);
    buf.extend_from_slice(&wall_time.to_le_bytes());
    put_bytes(&mut buf, 3, FILE_VERSION.as_bytes());
    buf
}

/// An `Event` at `step` whose summary holds one `simple_value` per `(tag, value)`.
/// TensorBoard stores scalars as f32, so values are narrowed here.
pub fn encode_scalars_event<'a>(
    wall_time: f64,
    step: i64,
    scalars: impl IntoIterator<Item = (&'a str, f64)>,
) -> Vec<u8> {
    let mut summary = Vec::new();
    let mut value = Vec::new();
    for (tag, v) in scalars {
        value.clear();
        put_bytes(&mut value, 1, tag.as_bytes());
        put_key(&mut value, 2, FIXED32);
        value.extend_from_slice(&(v as f32).to_le_bytes());
        put_bytes(&mut summary, 1, &value);
    }
    let mut buf = Vec::with_capacity(summary.len() + 24);
    put_key(&mut buf, 1, FIXED64);
    buf.extend_from_slice(&wall_time.to_le_bytes());
    put_key(&mut buf, 2, VARINT);
    // int64 is encoded as its two's-complement bit pattern.
    put_varint(&mut buf, step as u64);
    put_bytes(&mut buf, 5, &summary);
    buf
}

/// `data` framed as one TFRecord.
pub fn frame_record(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut rec = Vec::with_capacity(data.len() + 16);
    rec.extend_from_slice(&len);
    rec.extend_from_slice(&masked_crc32c(&len).to_le_bytes());
    rec.extend_from_slice(data);
    rec.extend_from_slice(&masked_crc32c(data).to_le_bytes());
    rec
}

/// Splits a TFRecord stream into its records' data, checking both checksums of each;
/// the error names the byte offset of the first bad record.
pub fn read_records(mut bytes: &[u8]) -> Result<Vec<Vec<u8>>, String> {
    let mut records = Vec::new();
    let mut offset = 0usize;
    while !bytes.is_empty() {
        let bad = |what: &str| format!("record at byte {offset}: {what}");
        if bytes.len() < 12 {
            return Err(bad("truncated header"));
        }
        let (len_bytes, rest) = bytes.split_at(8);
        let crc = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        if crc != masked_crc32c(len_bytes) {
            return Err(bad("length checksum mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes.try_into().expect("8 bytes")) as usize;
        let rest = &rest[4..];
        if rest.len() < len.saturating_add(4) {
            return Err(bad("truncated data"));
        }
        let (data, rest) = rest.split_at(len);
        let crc = u32::from_le_bytes(rest[..4].try_into().expect("4 bytes"));
        if crc != masked_crc32c(data) {
            return Err(bad("data checksum mismatch"));
        }
        records.push(data.to_vec());
        bytes = &rest[4..];
        offset += 16 + len;
    }
    Ok(records)
}

/// The host name for event file names (TensorBoard's convention), or `localhost`.
fn host_name() -> String {
    let raw = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c == '/' || c.is_whitespace() {
                '_'
            } else {
                c
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}

/// Appends scalar events to one `events.out.tfevents.<secs>.<host>` file.
#[derive(Debug)]
pub struct EventWriter {
    path: PathBuf,
    file: BufWriter<File>,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<secs>.<host>` (`secs` from `wall_time`) and
    /// writes its `file_version` record.
    pub fn create(dir: &Path, wall_time: f64) -> Result<Self, WriteError> {
        let path = dir.join(format!(
            "{FILE_PREFIX}{}.{}",
            wall_time.max(0.0) as u64,
            host_name()
        ));
        let file = File::create(&path).map_err(|source| WriteError {
            path: path.clone(),
            source,
        })?;
        let mut w = EventWriter {
            path,
            file: BufWriter::new(file),
        };
        w.write_record(&encode_file_version_event(wall_time))?;
        Ok(w)
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one step's scalars and flushes, so TensorBoard sees the step at once.
    pub fn write_scalars<'a>(
        &mut self,
        wall_time: f64,
        step: i64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Result<(), WriteError> {
        self.write_record(&encode_scalars_event(wall_time, step, scalars))
    }

    fn write_record(&mut self, data: &[u8]) -> Result<(), WriteError> {
        self.file
            .write_all(&frame_record(data))
            .and_then(|()| self.file.flush())
            .map_err(|source| WriteError {
                path: self.path.clone(),
                source,
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_file_version_event_encodes_byte_for_byte() {
        let got = encode_file_version_event(1.5);
        let mut want = vec![0x09];
        want.extend_from_slice(&1.5f64.to_le_bytes());
        want.extend_from_slice(&[0x1A, 13]);
        want.extend_from_slice(b"brain.Event:2");
        assert_eq!(got, want);
    }

    #[test]
    fn a_scalar_event_encodes_byte_for_byte() {
        let got = encode_scalars_event(2.0, 300, [("a/b", 0.5)]);
        let mut want = vec![0x09];
        want.extend_from_slice(&2.0f64.to_le_bytes());
        // step 300 = 0b10_0101100 as a varint: 0xAC 0x02.
        want.extend_from_slice(&[0x10, 0xAC, 0x02]);
        // summary (field 5) > value (field 1) > tag (field 1) and simple_value (field 2).
        let mut value = vec![0x0A, 3];
        value.extend_from_slice(b"a/b");
        value.push(0x15);
        value.extend_from_slice(&0.5f32.to_le_bytes());
        let mut summary = vec![0x0A, value.len() as u8];
        summary.extend_from_slice(&value);
        want.extend_from_slice(&[0x2A, summary.len() as u8]);
        want.extend_from_slice(&summary);
        assert_eq!(got, want);
    }

    #[test]
    fn a_negative_step_is_a_ten_byte_varint() {
        let got = encode_scalars_event(0.0, -1, []);
        assert_eq!(
            &got[9..21],
            &[0x10, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01, 0x2A]
        );
    }

    #[test]
    fn records_frame_and_unframe() {
        let mut stream = frame_record(b"hello");
        stream.extend(frame_record(b""));
        assert_eq!(stream.len(), 16 + 5 + 16);
        assert_eq!(&stream[..8], &5u64.to_le_bytes());
        assert_eq!(
            read_records(&stream).unwrap(),
            vec![b"hello".to_vec(), vec![]]
        );
        let mut corrupt = stream.clone();
        corrupt[13] ^= 1;
        let e = read_records(&corrupt).unwrap_err();
        assert!(e.contains("byte 0") && e.contains("data checksum"), "{e}");
        let e = read_records(&stream[..stream.len() - 1]).unwrap_err();
        assert!(e.contains("byte 21") && e.contains("truncated"), "{e}");
    }

    #[test]
    fn the_writer_starts_with_the_file_version_and_appends_steps() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = EventWriter::create(dir.path(), 1_700_000_000.25).unwrap();
        let name = w.path().file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            name.starts_with("events.out.tfevents.1700000000."),
            "{name}"
        );
        w.write_scalars(1_700_000_001.0, 1, [("x", 1.0)]).unwrap();
        let records = read_records(&std::fs::read(w.path()).unwrap()).unwrap();
        assert_eq!(records.len(), 2);
        assert_eq!(records[0], encode_file_version_event(1_700_000_000.25));
        assert_eq!(
            records[1],
            encode_scalars_event(1_700_000_001.0, 1, [("x", 1.0)])
        );
    }
}
