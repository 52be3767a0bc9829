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
    assert_eq!(b.header().total_len, 16);
    let (m, y) = b.tensor("y").expect("y");
    assert_eq!(m.offset, 8);
    assert_eq!(&y[..], &[1, 0, 0, 0, 2, 0, 0, 0]);
    assert_eq!(&b.tensor("x").expect("x").1[..], &[1, 2, 3]);
    assert!(b.tensor("z").is_none());
    assert!(Bulk::from_tensors([("x", DType::F32, vec![2], Bytes::from_static(&[0; 7]))]).is_err());
    assert!(Bulk::new(b.header().clone(), Bytes::from_static(&[0; 15])).is_err());
    let contiguous = Bulk::new(b.header().clone(), b.contiguous()).expect("new");
    assert_eq!(
        &b.contiguous()[..],
        &[1, 2, 3, 0, 0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0],
        "tensors at aligned offsets, zeros between"
    );
    assert_eq!(contiguous, b);
}

/// A gathered payload (built from tensors) and the same bytes in one buffer (as received)
/// give the same pieces, checksum, tensors and removals; and building copies nothing.
#[test]
fn gathered_and_contiguous_payloads_agree() {
    let big = Bytes::from((0..10_000u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>());
    let gathered = Bulk::from_tensors([
        ("a", DType::U8, vec![5], Bytes::from_static(&[9; 5])),
        ("empty", DType::F32, vec![0], Bytes::new()),
        ("big", DType::U8, vec![10_000], big.clone()),
        ("c", DType::U8, vec![3], Bytes::from_static(&[7; 3])),
    ])
    .expect("bulk");
    assert_eq!(
        gathered.tensor("big").expect("big").1.as_ptr(),
        big.as_ptr(),
        "from_tensors must not copy"
    );
    let contiguous = Bulk::new(gathered.header().clone(), gathered.contiguous()).expect("new");
    assert_eq!(gathered.len(), 8 + 10_000 + 3);
    for max in [1, 7, 4096, usize::MAX] {
        let joined = |b: &Bulk| b.pieces(max).concat();
        assert_eq!(joined(&gathered), joined(&contiguous), "pieces of {max}");
        assert!(gathered.pieces(max).iter().all(|p| p.len() <= max));
    }
    assert_eq!(gathered.checksum(), contiguous.checksum());
    let mut dst = vec![1; gathered.len() as usize];
    gathered.copy_to(&mut dst);
    assert_eq!(&dst[..], &contiguous.contiguous()[..]);
    for name in ["a", "empty", "big", "c"] {
        assert_eq!(gathered.tensor(name), contiguous.tensor(name), "{name}");
    }
    let (g, c) = (gathered.without("big"), contiguous.without("big"));
    assert!(g.tensor("big").is_none() && c.tensor("big").is_none());
    assert_eq!(g.len(), c.len());
    assert_eq!(g.tensor("c"), c.tensor("c"));
    // The removed tensor's range is sent as zeros from a gathered payload.
    assert!(g.contiguous()[8..10_008].iter().all(|&x| x == 0));
    assert_eq!(g.clone().without("nothing"), g);
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
    let header = postcard::to_stdvec(small.header()).expect("ser");
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
    assert_eq!(got, bulk);
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
