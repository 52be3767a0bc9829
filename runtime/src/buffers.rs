//! Reused receive buffers for inline bulk payloads.
//!
//! A fresh 64 MiB vector costs 16,384 page faults as the stream fills it (each one zeroes
//! a page and charges it to the cgroup) and as many pages unmapped when it is dropped:
//! in a profile of the plain-QUIC handoff that was about a third of all CPU time. A
//! payload's buffer therefore goes back to a bounded pool when the last [`Bytes`] of it
//! is dropped, and the next payload of about the same size is read into it.

use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

/// Payloads smaller than this are read into a fresh vector (few pages to fault in).
pub const MIN_POOLED: usize = 1 << 20;

/// A pool of receive buffers holding at most `max_bytes` while they are unused.
#[derive(Debug, Clone)]
pub struct RecvBuffers {
    pool: Arc<Mutex<Pool>>,
}

#[derive(Debug)]
struct Pool {
    /// Unused buffers, each with when it came back.
    free: Vec<(Vec<u8>, Instant)>,
    free_bytes: usize,
    max_bytes: usize,
}

impl RecvBuffers {
    /// A pool that keeps at most `max_bytes` of unused buffers (0 keeps none).
    pub fn new(max_bytes: usize) -> Self {
        RecvBuffers {
            pool: Arc::new(Mutex::new(Pool {
                free: Vec::new(),
                free_bytes: 0,
                max_bytes,
            })),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pool> {
        self.pool.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes held by unused buffers.
    #[cfg(test)]
    pub fn free_bytes(&self) -> usize {
        self.lock().free_bytes
    }

    /// A buffer of exactly `len` bytes whose contents are unspecified: the caller
    /// overwrites all of them. A pooled buffer is reused when one of `len` to `2 × len`
    /// bytes is free.
    pub fn take(&self, len: usize) -> RecvBuf {
        let reused = (len >= MIN_POOLED)
            .then(|| {
                let mut p = self.lock();
                let best = p
                    .free
                    .iter()
                    .enumerate()
                    .filter(|(_, (b, _))| b.len() >= len && b.len() / 2 <= len)
                    .min_by_key(|(_, (b, _))| b.len())
                    .map(|(i, _)| i)?;
                let (buf, _) = p.free.swap_remove(best);
                p.free_bytes -= buf.len();
                Some(buf)
            })
            .flatten();
        RecvBuf {
            buf: reused.unwrap_or_else(|| vec![0u8; len]),
            len,
            pool: (len >= MIN_POOLED).then(|| Arc::downgrade(&self.pool)),
        }
    }

    /// Frees the buffers unused for `idle` or longer at `now`, so a process that has
    /// stopped receiving does not keep them; answers the bytes freed.
    pub fn release_idle(&self, idle: Duration, now: Instant) -> usize {
        let mut p = self.lock();
        let before = p.free_bytes;
        p.free
            .retain(|(_, back)| now.saturating_duration_since(*back) < idle);
        p.free_bytes = p.free.iter().map(|(b, _)| b.len()).sum();
        before - p.free_bytes
    }
}

/// A receive buffer; dropped, it goes back to its pool if the pool has room.
#[derive(Debug)]
pub struct RecvBuf {
    buf: Vec<u8>,
    len: usize,
    pool: Option<Weak<Mutex<Pool>>>,
}

impl RecvBuf {
    /// The `len` bytes to fill.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.buf[..self.len]
    }

    /// The filled buffer as [`Bytes`]; it returns to the pool when the last clone or
    /// slice of them is dropped.
    pub fn freeze(self) -> Bytes {
        if self.pool.is_none() {
            let mut me = self;
            let mut buf = std::mem::take(&mut me.buf);
            buf.truncate(me.len);
            return Bytes::from(buf);
        }
        Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for RecvBuf {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for RecvBuf {
    fn drop(&mut self) {
        let Some(pool) = self.pool.as_ref().and_then(Weak::upgrade) else {
            return;
        };
        let mut p = pool.lock().unwrap_or_else(|p| p.into_inner());
        let size = self.buf.len();
        if size > 0 && p.free_bytes + size <= p.max_bytes {
            p.free_bytes += size;
            p.free.push((std::mem::take(&mut self.buf), Instant::now()));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_come_back_and_are_reused() {
        let pool = RecvBuffers::new(8 << 20);
        let mut a = pool.take(4 << 20);
        a.as_mut_slice().fill(7);
        let ptr = a.as_ref().as_ptr();
        let bytes = a.freeze();
        let half = bytes.slice(0..10);
        drop(bytes);
        // A slice still holds the buffer.
        assert_eq!(pool.free_bytes(), 0);
        assert_eq!(&half[..], &[7; 10]);
        drop(half);
        assert_eq!(pool.free_bytes(), 4 << 20);
        // A payload of about the same size reuses it; its length is the one asked for.
        let mut b = pool.take(3 << 20);
        assert_eq!(b.as_mut_slice().as_ptr(), ptr);
        assert_eq!(b.as_mut_slice().len(), 3 << 20);
        assert_eq!(b.freeze().len(), 3 << 20);
        // Far smaller payloads do not take a big buffer.
        let c = pool.take(1 << 20);
        assert_ne!(c.as_ref().as_ptr(), ptr);
    }

    #[test]
    fn the_pool_is_bounded() {
        let pool = RecvBuffers::new(6 << 20);
        let a = pool.take(4 << 20).freeze();
        let b = pool.take(4 << 20).freeze();
        drop(a);
        drop(b);
        // The second one did not fit.
        assert_eq!(pool.free_bytes(), 4 << 20);
        // Small payloads are never pooled.
        drop(pool.take(1000).freeze());
        assert_eq!(pool.free_bytes(), 4 << 20);
        // No pool at all: nothing kept.
        let none = RecvBuffers::new(0);
        drop(none.take(4 << 20).freeze());
        assert_eq!(none.free_bytes(), 0);
    }

    #[test]
    fn buffers_unused_for_the_idle_time_are_freed() {
        let pool = RecvBuffers::new(16 << 20);
        drop(pool.take(4 << 20).freeze());
        let back = Instant::now();
        let idle = Duration::from_secs(30);
        // Used a moment ago: kept.
        assert_eq!(pool.release_idle(idle, back + Duration::from_secs(29)), 0);
        assert_eq!(pool.free_bytes(), 4 << 20);
        // A buffer in use is not the pool's to free.
        let held = pool.take(4 << 20);
        assert_eq!(pool.release_idle(idle, back + Duration::from_secs(60)), 0);
        drop(held);
        assert_eq!(pool.free_bytes(), 4 << 20);
        // Unused for the idle time: freed.
        let later = Instant::now() + idle;
        assert_eq!(pool.release_idle(idle, later), 4 << 20);
        assert_eq!(pool.free_bytes(), 0);
    }
}
