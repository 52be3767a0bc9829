//! Pushes arbitrary bytes in arbitrary splits into `FrameDecoder`, checks that the split
//! does not change the outcome, and feeds every frame (and the raw input) to
//! `decode_bulk_header`. Nothing here may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use yatt_runtime::{
    decode_bulk_header, encode_frame, Bulk, BulkLimits, CodecError, FrameDecoder, FrameLimits,
};

/// Decodes `stream` pushed in the given pieces; returns frames and the final outcome.
fn decode(limits: FrameLimits, stream: &[u8], splits: &[u8]) -> (Vec<Vec<u8>>, Result<(), CodecError>) {
    let mut d = FrameDecoder::new(limits);
    let mut frames = Vec::new();
    let mut rest = stream;
    let mut i = 0;
    let mut err = None;
    loop {
        let n = if splits.is_empty() {
            rest.len()
        } else {
            (usize::from(splits[i % splits.len()]) % 64).max(1).min(rest.len())
        };
        i += 1;
        d.push(&rest[..n]);
        rest = &rest[n..];
        loop {
            match d.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.len() <= limits.max_frame);
                    frames.push(f.to_vec());
                }
                Ok(None) => break,
                Err(e) => {
                    err = Some(e);
                    break;
                }
            }
        }
        if err.is_some() || rest.is_empty() {
            break;
        }
    }
    let end = match err {
        Some(e) => Err(e),
        None => d.finish(),
    };
    (frames, end)
}

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    // Byte 0: frame limit; byte 1: number of split-size bytes that follow.
    let max_frame = [0usize, 1, 16, 300, 4096, 8 << 20][usize::from(data[0]) % 6];
    let limits = FrameLimits { max_frame };
    let nsplit = usize::from(data[1]).min(data.len() - 2);
    let splits = &data[2..2 + nsplit];
    let stream = &data[2 + nsplit..];

    let (frames, end) = decode(limits, stream, splits);
    let (whole, whole_end) = decode(limits, stream, &[]);
    assert_eq!(frames, whole, "splitting changed the frames");
    assert_eq!(end, whole_end, "splitting changed the outcome");

    let bulk_limits = BulkLimits {
        frame: limits,
        max_bulk: 1 << 20,
        ..BulkLimits::default()
    };
    for f in frames.iter().map(Vec::as_slice).chain([stream]) {
        if let Ok(enc) = encode_frame(f, &limits) {
            assert_eq!(&enc[4..], f);
        }
        if let Ok(h) = decode_bulk_header(f, &bulk_limits) {
            // A valid header must describe slices that exist.
            let data = bytes::Bytes::from(vec![0u8; h.total_len as usize]);
            let bulk = Bulk::with_limits(h.clone(), data, &bulk_limits).expect("valid header");
            for t in &h.tensors {
                let (m, s) = bulk.tensor(&t.name).expect("tensor present");
                assert_eq!(s.len() as u64, m.len);
            }
        }
    }
});
