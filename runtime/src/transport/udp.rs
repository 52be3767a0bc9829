//! The endpoint's UDP socket: quinn's tokio socket, with segmentation-offload batches
//! kept within what one `sendmsg` may carry.
//!
//! quinn hands the socket up to 10 equal datagrams at once for segmentation offload
//! (GSO). Linux refuses a GSO send whose payload passes 64 KiB with `EMSGSIZE`, which
//! quinn-udp takes for a failed MTU probe and drops silently. With datagrams larger than
//! 6,550 bytes (jumbo frames, loopback) every full batch would be lost, and the losses
//! would end in black-hole detection pulling the path MTU back to 1,200 bytes. So a batch
//! that does not fit is sent as several smaller ones here.

use std::fmt;
use std::io;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use quinn::udp::{RecvMeta, Transmit};
use quinn::{AsyncUdpSocket, UdpPoller};

/// Most UDP payload one `sendmsg` may carry, segments together (IPv4's limit; IPv6's is 20
/// bytes more).
pub(super) const MAX_SEND_PAYLOAD: usize = 65_507;

/// Wraps the runtime's socket; see the module docs.
pub(super) struct BatchLimitedSocket {
    inner: Arc<dyn AsyncUdpSocket>,
}

impl BatchLimitedSocket {
    pub(super) fn new(inner: Arc<dyn AsyncUdpSocket>) -> Self {
        BatchLimitedSocket { inner }
    }
}

impl fmt::Debug for BatchLimitedSocket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BatchLimitedSocket")
            .field("inner", &self.inner)
            .finish()
    }
}

/// The pieces of `contents` (datagrams of `segment` bytes, the last one possibly
/// shorter) that each fit in one send: whole datagrams, at most [`MAX_SEND_PAYLOAD`]
/// bytes together (a datagram larger than that is a piece on its own).
pub(super) fn batches(contents: &[u8], segment: usize) -> impl Iterator<Item = &[u8]> {
    let per_send = (MAX_SEND_PAYLOAD / segment.max(1)).max(1) * segment.max(1);
    contents.chunks(per_send)
}

impl AsyncUdpSocket for BatchLimitedSocket {
    fn create_io_poller(self: Arc<Self>) -> Pin<Box<dyn UdpPoller>> {
        self.inner.clone().create_io_poller()
    }

    fn try_send(&self, transmit: &Transmit) -> io::Result<()> {
        let segment = match transmit.segment_size {
            Some(s)
                if transmit.contents.len() > MAX_SEND_PAYLOAD && s < transmit.contents.len() =>
            {
                s
            }
            _ => return self.inner.try_send(transmit),
        };
        for (i, piece) in batches(transmit.contents, segment).enumerate() {
            let part = Transmit {
                destination: transmit.destination,
                ecn: transmit.ecn,
                contents: piece,
                segment_size: (piece.len() > segment).then_some(segment),
                src_ip: transmit.src_ip,
            };
            match self.inner.try_send(&part) {
                Ok(()) => {}
                // Nothing sent yet: quinn waits for the socket and retries the batch.
                Err(e) if i == 0 => return Err(e),
                // Part of the batch is out; the rest counts as lost (quinn resends it)
                // rather than sending the first pieces twice.
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    fn poll_recv(
        &self,
        cx: &mut Context,
        bufs: &mut [io::IoSliceMut<'_>],
        meta: &mut [RecvMeta],
    ) -> Poll<io::Result<usize>> {
        self.inner.poll_recv(cx, bufs, meta)
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }

    fn max_transmit_segments(&self) -> usize {
        self.inner.max_transmit_segments()
    }

    fn max_receive_segments(&self) -> usize {
        self.inner.max_receive_segments()
    }

    fn may_fragment(&self) -> bool {
        self.inner.may_fragment()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quinn::Runtime;

    #[test]
    fn batches_stay_within_one_send() {
        // Ten loopback-sized datagrams: one per send.
        let big = vec![0u8; 10 * 65_000];
        let b: Vec<usize> = batches(&big, 65_000).map(<[u8]>::len).collect();
        assert_eq!(b, vec![65_000; 10]);
        // Ten jumbo datagrams, the last one short: 7 and then 3 of them.
        let jumbo = vec![0u8; 9 * 8_952 + 100];
        let b: Vec<usize> = batches(&jumbo, 8_952).map(<[u8]>::len).collect();
        assert_eq!(b, vec![7 * 8_952, 2 * 8_952 + 100]);
        // Ethernet-sized datagrams fit ten to a send, as quinn batches them.
        let small = vec![0u8; 10 * 1_452];
        assert_eq!(batches(&small, 1_452).count(), 1);
        for p in batches(&jumbo, 8_952) {
            assert!(p.len() <= MAX_SEND_PAYLOAD);
        }
    }

    /// Regression: quinn hands over ten jumbo datagrams at once; sent as one GSO
    /// `sendmsg` the kernel refused them (`EMSGSIZE`) and quinn-udp dropped all ten
    /// without a word. Split, every one arrives, in order.
    #[tokio::test]
    async fn an_oversized_gso_batch_arrives_whole() {
        use socket2::{Domain, Protocol, Socket, Type};
        let rx = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP)).expect("socket");
        let _ = rx.set_recv_buffer_size(4 << 20);
        rx.bind(
            &"127.0.0.1:0"
                .parse::<std::net::SocketAddr>()
                .expect("addr")
                .into(),
        )
        .expect("bind");
        let rx: std::net::UdpSocket = rx.into();
        rx.set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .expect("timeout");
        let tx = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let inner = quinn::TokioRuntime.wrap_udp_socket(tx).expect("wrap");
        if inner.max_transmit_segments() < 10 {
            // No segmentation offload on this kernel: quinn never batches, nothing to split.
            return;
        }
        let socket = Arc::new(BatchLimitedSocket::new(inner));
        let mut poller = socket.clone().create_io_poller();
        let segment = 8_952;
        let contents: Vec<u8> = (0..10 * segment).map(|i| (i / segment) as u8).collect();
        let transmit = Transmit {
            destination: rx.local_addr().expect("addr"),
            ecn: None,
            contents: &contents,
            segment_size: Some(segment),
            src_ip: None,
        };
        // As quinn does: wait until the socket is writable, then send.
        for _ in 0..100 {
            std::future::poll_fn(|cx| poller.as_mut().poll_writable(cx))
                .await
                .expect("writable");
            match socket.try_send(&transmit) {
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                r => {
                    r.expect("send");
                    break;
                }
            }
        }
        let mut buf = vec![0u8; 65_536];
        for i in 0..10u8 {
            let n = rx.recv(&mut buf).expect("datagram lost");
            assert_eq!((n, buf[0], buf[n - 1]), (segment, i, i));
        }
    }
}
