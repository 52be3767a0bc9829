//! At most one log line per peer (address, or member name) per window for repeated
//! events (refused TLS handshakes, refused requests): a scanner or a misconfigured node retrying every few milliseconds must
//! not flood the log, and the line that is logged says how many were suppressed.

use std::collections::HashMap;
use std::hash::Hash;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Entries kept before the ones idle for a whole window are dropped.
const PRUNE_AT: usize = 1024;

/// Per-peer log throttle, keyed by address by default.
pub(crate) struct LogThrottle<K = IpAddr> {
    window: Duration,
    /// Per peer: when its last line was logged, and the events suppressed since.
    seen: Mutex<HashMap<K, (Instant, u64)>>,
}

impl<K: Hash + Eq> LogThrottle<K> {
    pub(crate) fn new(window: Duration) -> Self {
        LogThrottle {
            window,
            seen: Mutex::new(HashMap::new()),
        }
    }

    /// Whether to log an event from `addr` at `now`: `Some(suppressed)` (the events
    /// from it not logged since its last line) when its last line is at least a window
    /// old, `None` when this one is suppressed too.
    pub(crate) fn admit(&self, addr: K, now: Instant) -> Option<u64> {
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() >= PRUNE_AT {
            let window = self.window;
            seen.retain(|_, (at, _)| now.saturating_duration_since(*at) < window);
        }
        match seen.get_mut(&addr) {
            Some((at, suppressed)) if now.saturating_duration_since(*at) < self.window => {
                *suppressed += 1;
                None
            }
            Some((at, suppressed)) => {
                *at = now;
                Some(std::mem::take(suppressed))
            }
            None => {
                seen.insert(addr, (now, 0));
                Some(0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression: one WARN line per refused handshake flooded the log.
    #[test]
    fn one_line_per_address_per_window_with_the_suppressed_count() {
        let t = LogThrottle::new(Duration::from_secs(10));
        let (a, b): (IpAddr, IpAddr) = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        let t0 = Instant::now();
        assert_eq!(t.admit(a, t0), Some(0));
        for i in 1..=99 {
            assert_eq!(t.admit(a, t0 + Duration::from_millis(i * 50)), None);
        }
        // Another address is not held back by the first.
        assert_eq!(t.admit(b, t0 + Duration::from_secs(1)), Some(0));
        // A window after the last line: logged, with the 99 suppressed in between.
        assert_eq!(t.admit(a, t0 + Duration::from_secs(10)), Some(99));
        assert_eq!(t.admit(a, t0 + Duration::from_secs(11)), None);
        assert_eq!(t.admit(a, t0 + Duration::from_secs(20)), Some(1));
    }
}
