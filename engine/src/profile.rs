//! Opt-in phase timing for machines where no profiler runs: each [`mark`] waits for the
//! device and charges the time since the previous mark to a label. The waits slow the
//! run, so the figures are for finding where time goes, not for reporting speed.
//!
//! `YATT_PROFILE=1` marks every phase, down to each layer's (decode graphs are off then:
//! a capture cannot wait); `YATT_PROFILE=steps` marks only whole phases of a step
//! (inputs, the decode graph's replay, sampling; a training step's forward, backward,
//! clipping and optimizer), with decode graphs on.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::OnceLock;
use std::time::Instant;

use tch::Device;

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Off,
    Steps,
    Layers,
}

fn level() -> Level {
    static LEVEL: OnceLock<Level> = OnceLock::new();
    *LEVEL.get_or_init(|| match std::env::var("YATT_PROFILE").as_deref() {
        Ok("1") => Level::Layers,
        Ok("steps") => Level::Steps,
        _ => Level::Off,
    })
}

/// Whether any profiling is on (`YATT_PROFILE=1` or `steps`, read once).
pub fn enabled() -> bool {
    level() > Level::Off
}

/// Whether each layer's phases are marked (`YATT_PROFILE=1`).
pub fn per_layer() -> bool {
    level() == Level::Layers
}

/// [`mark`] for the phases inside a layer: only with `YATT_PROFILE=1`.
pub fn mark_layer(device: Device, label: &'static str) {
    if per_layer() {
        mark(device, label);
    }
}

thread_local! {
    static PHASES: RefCell<(Option<Instant>, BTreeMap<&'static str, (f64, u64)>)> =
        RefCell::new((None, BTreeMap::new()));
}

fn wait(device: Device) {
    if let Device::Cuda(n) = device {
        tch::Cuda::synchronize(n as i64);
    }
}

/// Charges the time since the previous mark (or [`start`]) to `label`.
pub fn mark(device: Device, label: &'static str) {
    if !enabled() {
        return;
    }
    wait(device);
    let now = Instant::now();
    PHASES.with(|p| {
        let mut p = p.borrow_mut();
        if let Some(t0) = p.0 {
            let e = p.1.entry(label).or_insert((0.0, 0));
            e.0 += (now - t0).as_secs_f64();
            e.1 += 1;
        }
        p.0 = Some(now);
    });
}

/// Starts the clock without charging anything.
pub fn start(device: Device) {
    if !enabled() {
        return;
    }
    wait(device);
    PHASES.with(|p| p.borrow_mut().0 = Some(Instant::now()));
}

/// The phases of this thread so far, `(label, seconds, count)`, and clears them.
#[cfg_attr(not(feature = "bench"), allow(dead_code))]
pub fn take() -> Vec<(&'static str, f64, u64)> {
    PHASES.with(|p| {
        let mut p = p.borrow_mut();
        p.0 = None;
        std::mem::take(&mut p.1)
            .into_iter()
            .map(|(k, (s, n))| (k, s, n))
            .collect()
    })
}
