//! Cubic congestion control with a ceiling on the window.
//!
//! On a fast path the window outgrows the receiver's UDP socket buffer: whenever the
//! receiving process is descheduled for a millisecond, the kernel drops the datagrams
//! that do not fit. On loopback that was one to four packets in a hundred, each loss
//! halving the window and stalling the stream until the retransmission. A window no
//! larger than the socket buffer keeps those drops away; a real network still shrinks it
//! below the ceiling on loss as usual.

use std::any::Any;
use std::sync::Arc;
use std::time::Instant;

use quinn::congestion::{Controller, ControllerFactory, ControllerMetrics, CubicConfig};
use quinn_proto::RttEstimator;

/// Builds Cubic controllers whose window never passes `max` bytes.
#[derive(Debug)]
pub(crate) struct CappedCubic {
    inner: Arc<CubicConfig>,
    max: u64,
}

impl CappedCubic {
    pub(crate) fn new(max: u64) -> Self {
        CappedCubic {
            inner: Arc::new(CubicConfig::default()),
            max,
        }
    }
}

impl ControllerFactory for CappedCubic {
    fn build(self: Arc<Self>, now: Instant, current_mtu: u16) -> Box<dyn Controller> {
        Box::new(Capped {
            inner: self.inner.clone().build(now, current_mtu),
            max: self.max,
        })
    }
}

struct Capped {
    inner: Box<dyn Controller>,
    max: u64,
}

impl Capped {
    /// Once at the ceiling, acks no longer grow the window: it would only grow out of
    /// reach of the halving that a loss applies.
    fn at_ceiling(&self) -> bool {
        self.inner.window() >= self.max
    }
}

impl Controller for Capped {
    fn on_sent(&mut self, now: Instant, bytes: u64, last_packet_number: u64) {
        self.inner.on_sent(now, bytes, last_packet_number)
    }

    fn on_ack(
        &mut self,
        now: Instant,
        sent: Instant,
        bytes: u64,
        app_limited: bool,
        rtt: &RttEstimator,
    ) {
        let limited = app_limited || self.at_ceiling();
        self.inner.on_ack(now, sent, bytes, limited, rtt)
    }

    fn on_end_acks(
        &mut self,
        now: Instant,
        in_flight: u64,
        app_limited: bool,
        largest_packet_num_acked: Option<u64>,
    ) {
        let limited = app_limited || self.at_ceiling();
        self.inner
            .on_end_acks(now, in_flight, limited, largest_packet_num_acked)
    }

    fn on_congestion_event(
        &mut self,
        now: Instant,
        sent: Instant,
        is_persistent_congestion: bool,
        lost_bytes: u64,
    ) {
        self.inner
            .on_congestion_event(now, sent, is_persistent_congestion, lost_bytes)
    }

    fn on_mtu_update(&mut self, new_mtu: u16) {
        self.inner.on_mtu_update(new_mtu)
    }

    fn window(&self) -> u64 {
        self.inner.window().min(self.max)
    }

    fn metrics(&self) -> ControllerMetrics {
        let mut m = self.inner.metrics();
        m.congestion_window = self.window();
        m
    }

    fn clone_box(&self) -> Box<dyn Controller> {
        Box::new(Capped {
            inner: self.inner.clone_box(),
            max: self.max,
        })
    }

    fn initial_window(&self) -> u64 {
        self.inner.initial_window().min(self.max)
    }

    fn into_any(self: Box<Self>) -> Box<dyn Any> {
        self
    }
}
