//! Serving with bounds, so that viewers that pile up, hang or drip bytes cannot hold
//! the process's memory or sockets, nor lock real viewers out:
//!
//! - at most [`MAX_CONNECTIONS`] connections are served at once. A connection past
//!   that is accepted at once (not left waiting in the kernel's backlog) and makes room
//!   by shedding the connection that has waited longest without being answered (idle,
//!   or still sending its request); when every connection is being answered, it gets a
//!   `503` with `Retry-After: 1` and is closed. A shed connection keeps its socket
//!   until its task runs, so at most [`SHED_CLOSING`] may be closing at once: past
//!   that, the newcomer waits (up to [`SHED_WAIT`]) for one of them to close. Sockets
//!   stay under `MAX_CONNECTIONS + SHED_CLOSING + 1` however slowly tasks run;
//! - a request must arrive whole within [`REQUEST_TIMEOUT`] of its first byte, however
//!   steadily its bytes drip in;
//! - a connection with no request for [`IDLE_TIMEOUT`] is closed;
//! - an answer whose writing makes no progress for [`WRITE_TIMEOUT`] (a viewer that
//!   stopped reading) is abandoned.
//!
//! The deadlines watch bytes, not HTTP: a request "arrives" when the server starts
//! writing its answer, which for these routes (all `GET`, answered from memory or a
//! short file read) follows the request's last byte within milliseconds.

use std::collections::HashMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::{Instant, Sleep};

/// Connections served at once; one more sheds the longest-waiting of them.
pub const MAX_CONNECTIONS: usize = 256;
/// Shed connections whose sockets may still be open at once.
pub const SHED_CLOSING: usize = 4;
/// How long a newcomer waits for a shed connection to close before its `503`.
pub const SHED_WAIT: Duration = Duration::from_secs(1);
/// From a request's first byte to the start of its answer. A browser sends a request
/// head in one packet; a few seconds leave room for a slow link, and a client that
/// drips a byte now and then is closed this long after it began.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// A connection with no request for this long is closed. The page polls every second
/// (and, after errors, backs off to at most every 10 s), so 10 s keeps a polling
/// page's connection alive between polls while an abandoned one goes soon; closing
/// one costs a browser only a reconnect.
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// An answer that cannot be written for this long (the viewer stopped reading) is
/// abandoned and its connection closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

/// Serves `app` on `listener` under the bounds above until `shutdown` completes.
pub async fn serve(
    listener: TcpListener,
    app: axum::Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> io::Result<()> {
    let bounded = Bounded {
        inner: listener,
        table: Arc::new(Table::default()),
        epoch: Instant::now(),
    };
    axum::serve(bounded, app)
        .with_graceful_shutdown(shutdown)
        .await
}

/// What the server knows of one connection, shared between it and the accept loop.
struct Slot {
    /// Milliseconds (since the listener's epoch) when it began waiting: for its next
    /// request (idle), or for its request's answer.
    waiting_since: AtomicU64,
    /// Its answer's writing is under way (not sheddable).
    writing: AtomicBool,
    /// Told to close: the server needed its place.
    shed: AtomicBool,
    /// Wakes its reader when it is shed.
    waker: Mutex<Option<Waker>>,
}

/// The connections being served.
#[derive(Default)]
struct Table {
    slots: Mutex<Slots>,
    /// Told each time a shed connection's socket closes.
    shed_closed: tokio::sync::Notify,
}

#[derive(Default)]
struct Slots {
    last_id: u64,
    open: HashMap<u64, Arc<Slot>>,
    /// Shed, out of `open`, and not yet dropped: each still holds its socket.
    shed_closing: usize,
}

/// What [`Table::admit`] makes of a new connection.
enum Admission {
    Admitted(u64, Arc<Slot>),
    /// Every connection is being answered: nothing can be shed.
    Full,
    /// [`SHED_CLOSING`] shed connections have yet to close their sockets.
    WaitForShed,
}

impl Table {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A place for a new connection, shedding the longest-waiting connection when the
    /// table is full.
    fn admit(&self, now_ms: u64) -> Admission {
        let mut t = self.lock();
        if t.open.len() >= MAX_CONNECTIONS {
            if t.shed_closing >= SHED_CLOSING {
                return Admission::WaitForShed;
            }
            let Some(oldest) = t
                .open
                .iter()
                .filter(|(_, s)| !s.writing.load(Ordering::Relaxed))
                .min_by_key(|(_, s)| s.waiting_since.load(Ordering::Relaxed))
                .map(|(id, _)| *id)
            else {
                return Admission::Full;
            };
            if let Some(s) = t.open.remove(&oldest) {
                t.shed_closing += 1;
                s.shed.store(true, Ordering::Relaxed);
                let waker = s.waker.lock().unwrap_or_else(|p| p.into_inner()).take();
                waker.map(Waker::wake);
            }
        }
        t.last_id += 1;
        let id = t.last_id;
        let slot = Arc::new(Slot {
            waiting_since: AtomicU64::new(now_ms),
            writing: AtomicBool::new(false),
            shed: AtomicBool::new(false),
            waker: Mutex::new(None),
        });
        t.open.insert(id, slot.clone());
        Admission::Admitted(id, slot)
    }

    /// A connection's socket closed.
    fn remove(&self, id: u64) {
        let mut t = self.lock();
        if t.open.remove(&id).is_none() {
            // Only shedding takes a connection out before its drop.
            t.shed_closing -= 1;
            drop(t);
            self.shed_closed.notify_one();
        }
    }

    /// Admits a new connection, waiting up to [`SHED_WAIT`] for shed sockets to close;
    /// `None` when there is no room.
    async fn admit_waiting(&self, epoch: Instant) -> Option<(u64, Arc<Slot>)> {
        let give_up = Instant::now() + SHED_WAIT;
        loop {
            match self.admit(epoch.elapsed().as_millis() as u64) {
                Admission::Admitted(id, slot) => return Some((id, slot)),
                Admission::Full => return None,
                // `notify_one` keeps a permit when no one waits, so a close between
                // `admit` and here is not missed.
                Admission::WaitForShed => {
                    tokio::time::timeout_at(give_up, self.shed_closed.notified())
                        .await
                        .ok()?;
                }
            }
        }
    }
}

struct Bounded {
    inner: TcpListener,
    table: Arc<Table>,
    epoch: Instant,
}

/// The answer to a connection past [`MAX_CONNECTIONS`] when none can be shed.
const FULL: &[u8] = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: text/plain\r\nContent-Length: 72\r\nConnection: close\r\n\r\nevery connection of this view is being answered; try again in a second\n";

impl axum::serve::Listener for Bounded {
    type Io = Conn;
    type Addr = std::net::SocketAddr;

    async fn accept(&mut self) -> (Conn, std::net::SocketAddr) {
        loop {
            let (stream, addr) = match self.inner.accept().await {
                Ok(s) => s,
                Err(e) => {
                    // Out of file descriptors and the like: back off, as axum does.
                    tracing::debug!(error = %e, "HTTP accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some((id, slot)) = self.table.admit_waiting(self.epoch).await else {
                // A fresh socket's send buffer takes these few bytes at once; whatever
                // does not fit is not worth waiting for.
                let _ = stream.try_write(FULL);
                continue;
            };
            let _ = stream.set_nodelay(true);
            let now = Instant::now();
            let conn = Conn {
                stream,
                id,
                slot,
                table: self.table.clone(),
                epoch: self.epoch,
                receiving: false,
                read_deadline: Box::pin(tokio::time::sleep_until(now + IDLE_TIMEOUT)),
                write_deadline: Box::pin(tokio::time::sleep_until(now + WRITE_TIMEOUT)),
            };
            return (conn, addr);
        }
    }

    fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.inner.local_addr()
    }
}

/// A served connection under the deadlines above; it leaves the table when dropped.
struct Conn {
    stream: TcpStream,
    id: u64,
    slot: Arc<Slot>,
    table: Arc<Table>,
    epoch: Instant,
    /// Bytes of a request came in and no answer has been written since.
    receiving: bool,
    /// [`REQUEST_TIMEOUT`] while receiving, [`IDLE_TIMEOUT`] otherwise.
    read_deadline: Pin<Box<Sleep>>,
    /// [`WRITE_TIMEOUT`] from the last write that made progress.
    write_deadline: Pin<Box<Sleep>>,
}

impl Conn {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.table.remove(self.id);
    }
}

fn closed(kind: io::ErrorKind, why: &'static str) -> Poll<io::Result<()>> {
    Poll::Ready(Err(io::Error::new(kind, why)))
}

impl AsyncRead for Conn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.slot.shed.load(Ordering::Relaxed) {
            return closed(
                io::ErrorKind::ConnectionAborted,
                "HTTP connection shed: the view was full",
            );
        }
        let before = buf.filled().len();
        match Pin::new(&mut self.stream).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before && !self.receiving {
                    // A request begins: it has REQUEST_TIMEOUT to arrive whole, however
                    // its bytes come.
                    self.receiving = true;
                    let now = self.now_ms();
                    self.slot.waiting_since.store(now, Ordering::Relaxed);
                    let at = Instant::now() + REQUEST_TIMEOUT;
                    self.read_deadline.as_mut().reset(at);
                }
                Poll::Ready(r)
            }
            Poll::Pending => {
                {
                    let mut w = self.slot.waker.lock().unwrap_or_else(|p| p.into_inner());
                    if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                        *w = Some(cx.waker().clone());
                    }
                }
                // Shed between the check above and the waker's registration.
                if self.slot.shed.load(Ordering::Relaxed) {
                    return closed(
                        io::ErrorKind::ConnectionAborted,
                        "HTTP connection shed: the view was full",
                    );
                }
                match self.read_deadline.as_mut().poll(cx) {
                    Poll::Ready(()) if self.receiving => closed(
                        io::ErrorKind::TimedOut,
                        "HTTP request not received whole in time",
                    ),
                    Poll::Ready(()) => closed(io::ErrorKind::TimedOut, "HTTP connection idle"),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

impl Conn {
    /// Bookkeeping after a write: progress ends the request (the connection waits for
    /// the next one, idle); no progress starts or runs the write deadline.
    fn wrote<T>(&mut self, cx: &mut Context<'_>, r: Poll<io::Result<T>>) -> Poll<io::Result<T>>
    where
        T: Progress,
    {
        match r {
            Poll::Ready(Ok(n)) => {
                self.slot.writing.store(false, Ordering::Relaxed);
                if n.progressed() {
                    self.receiving = false;
                    let now = self.now_ms();
                    self.slot.waiting_since.store(now, Ordering::Relaxed);
                    let at = Instant::now() + IDLE_TIMEOUT;
                    self.read_deadline.as_mut().reset(at);
                }
                Poll::Ready(Ok(n))
            }
            Poll::Ready(Err(e)) => Poll::Ready(Err(e)),
            Poll::Pending => {
                if !self.slot.writing.swap(true, Ordering::Relaxed) {
                    let at = Instant::now() + WRITE_TIMEOUT;
                    self.write_deadline.as_mut().reset(at);
                }
                match self.write_deadline.as_mut().poll(cx) {
                    Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        "HTTP answer not read by the viewer in time",
                    ))),
                    Poll::Pending => Poll::Pending,
                }
            }
        }
    }
}

/// A write's result that says whether bytes went out.
trait Progress {
    fn progressed(&self) -> bool;
}

impl Progress for usize {
    fn progressed(&self) -> bool {
        *self > 0
    }
}

impl Progress for () {
    fn progressed(&self) -> bool {
        false
    }
}

impl AsyncWrite for Conn {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write(cx, buf);
        self.wrote(cx, r)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let r = Pin::new(&mut self.stream).poll_flush(cx);
        self.wrote(cx, r)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let r = Pin::new(&mut self.stream).poll_write_vectored(cx, bufs);
        self.wrote(cx, r)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admitted(a: Admission) -> (u64, Arc<Slot>) {
        match a {
            Admission::Admitted(id, slot) => (id, slot),
            Admission::Full => panic!("refused: full"),
            Admission::WaitForShed => panic!("refused: waiting for shed connections"),
        }
    }

    fn full_table() -> (Table, Vec<(u64, Arc<Slot>)>) {
        let t = Table::default();
        let slots = (0..MAX_CONNECTIONS as u64)
            .map(|i| admitted(t.admit(1000 + i)))
            .collect();
        (t, slots)
    }

    #[test]
    fn a_full_table_sheds_the_longest_waiting_connection_that_is_not_being_answered() {
        let (t, slots) = full_table();
        // The oldest is mid-answer: the next oldest goes.
        slots[0].1.writing.store(true, Ordering::Relaxed);
        let (_, new) = admitted(t.admit(5000));
        assert!(!slots[0].1.shed.load(Ordering::Relaxed));
        assert!(slots[1].1.shed.load(Ordering::Relaxed));
        assert!(!new.shed.load(Ordering::Relaxed));
        assert_eq!(t.lock().open.len(), MAX_CONNECTIONS);
        // Every connection being answered: no room, the newcomer is refused.
        for s in t.lock().open.values() {
            s.writing.store(true, Ordering::Relaxed);
        }
        assert!(matches!(t.admit(6000), Admission::Full));
        assert_eq!(t.lock().open.len(), MAX_CONNECTIONS);
    }

    // Regression: CI saw 274 sockets open with a limit of 256, when shed connections'
    // tasks ran late on a loaded machine and newcomers kept shedding more.
    #[test]
    fn newcomers_wait_while_too_many_shed_connections_still_hold_their_sockets() {
        let (t, slots) = full_table();
        for i in 0..SHED_CLOSING as u64 {
            admitted(t.admit(5000 + i));
        }
        assert!(matches!(t.admit(6000), Admission::WaitForShed));
        // One shed connection's task runs and drops it: one newcomer gets in.
        t.remove(slots[0].0);
        admitted(t.admit(6001));
        assert!(matches!(t.admit(6002), Admission::WaitForShed));
        assert_eq!(t.lock().open.len(), MAX_CONNECTIONS);
        assert_eq!(t.lock().shed_closing, SHED_CLOSING);
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_past_the_shed_connections_gets_in_when_one_closes_or_gives_up() {
        let (t, slots) = full_table();
        for i in 0..SHED_CLOSING as u64 {
            admitted(t.admit(5000 + i));
        }
        let t = Arc::new(t);
        let epoch = Instant::now();
        // Nothing closes: refused after SHED_WAIT.
        let started = Instant::now();
        assert!(t.admit_waiting(epoch).await.is_none());
        assert_eq!(started.elapsed(), SHED_WAIT);
        // A shed socket closes while the newcomer waits: it gets in.
        let waiting = tokio::spawn({
            let t = t.clone();
            async move { t.admit_waiting(epoch).await.map(|(id, _)| id) }
        });
        tokio::time::sleep(Duration::from_millis(100)).await;
        t.remove(slots[1].0);
        assert!(waiting.await.unwrap().is_some());
    }
}
