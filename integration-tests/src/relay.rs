//! A UDP relay on loopback that a test can cut: a node advertises the relay's address
//! (`yatt-node run --advertise`), so every connection dialled to it passes through
//! here, and [`UdpRelay::cut`] drops every datagram both ways, as a network partition
//! does. What the node dials itself goes direct, as it would through a firewall that
//! blocks only inbound traffic.

use std::collections::HashMap;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How long a relay thread blocks on a socket before it checks whether to stop.
const POLL: Duration = Duration::from_millis(50);

/// A cuttable UDP relay on 127.0.0.1 (stopped when dropped).
pub struct UdpRelay {
    /// Where peers send to (what the node advertises).
    pub addr: SocketAddr,
    target: Arc<Mutex<Option<SocketAddr>>>,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl UdpRelay {
    /// Binds the relay; it forwards nothing until [`UdpRelay::forward_to`].
    pub fn start() -> UdpRelay {
        let socket = UdpSocket::bind("127.0.0.1:0").expect("bind the relay");
        socket.set_read_timeout(Some(POLL)).expect("read timeout");
        let addr = socket.local_addr().expect("relay address");
        let target = Arc::new(Mutex::new(None));
        let cut = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let front = {
            let (target, cut, stop) = (target.clone(), cut.clone(), stop.clone());
            std::thread::spawn(move || relay_front(socket, target, cut, stop))
        };
        UdpRelay {
            addr,
            target,
            cut,
            stop,
            threads: vec![front],
        }
    }

    /// Where datagrams go: the node's bound address.
    pub fn forward_to(&self, target: SocketAddr) {
        *self.target.lock().unwrap() = Some(target);
    }

    /// Drops every datagram from now on, both ways.
    pub fn cut(&self) {
        self.cut.store(true, Ordering::SeqCst);
    }

    /// Forwards again.
    pub fn heal(&self) {
        self.cut.store(false, Ordering::SeqCst);
    }
}

impl Drop for UdpRelay {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// Reads what peers send to the relay; each peer gets its own upstream socket to the
/// node (so the node sees one address per peer), whose answers a back thread returns.
fn relay_front(
    socket: UdpSocket,
    target: Arc<Mutex<Option<SocketAddr>>>,
    cut: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
) {
    let socket = Arc::new(socket);
    let mut upstream: HashMap<SocketAddr, Arc<UdpSocket>> = HashMap::new();
    let mut backs = Vec::new();
    let mut buf = vec![0u8; 65_536];
    while !stop.load(Ordering::SeqCst) {
        let Ok((n, from)) = socket.recv_from(&mut buf) else {
            continue;
        };
        let Some(to) = *target.lock().unwrap() else {
            continue;
        };
        if cut.load(Ordering::SeqCst) {
            continue;
        }
        let up = upstream.entry(from).or_insert_with(|| {
            let up = UdpSocket::bind("127.0.0.1:0").expect("bind an upstream socket");
            up.set_read_timeout(Some(POLL)).expect("read timeout");
            up.connect(to).expect("connect upstream");
            let up = Arc::new(up);
            let (back, front, cut, stop) = (up.clone(), socket.clone(), cut.clone(), stop.clone());
            backs.push(std::thread::spawn(move || {
                let mut buf = vec![0u8; 65_536];
                while !stop.load(Ordering::SeqCst) {
                    if let Ok(n) = back.recv(&mut buf) {
                        if !cut.load(Ordering::SeqCst) {
                            let _ = front.send_to(&buf[..n], from);
                        }
                    }
                }
            }));
            up
        });
        let _ = up.send(&buf[..n]);
    }
    for b in backs {
        let _ = b.join();
    }
}
