//! The cost model against the measured step.
//!
//! Before its steps each rank probes the ring's bandwidth (all-gathers and
//! reduce-scatters of every unit, as the trainer runs them), and around them its share
//! of a core while every rank spins at once (the VM is shared, so the share is not
//! `cores / ranks`); during them it counts its compute thread's CPU time. The first
//! sharded row also times one step of one sequence per rank, so that its compute, in
//! seconds of a whole core, splits into a part per token and a part per micro-batch
//! (every rank materialises the whole model's weights and gradients, whatever its
//! tokens). The lead then predicts every sharded row with
//! `yatt_placement::ShardedStep`: that compute for the row's tokens and the optimizer
//! on a 1/N shard, plus the schedule's bytes over the probed bandwidth, none of it
//! hidden (the trainer has no prefetch). The compute becomes wall time at the share of
//! a core the ranks' compute got (their CPU time over its wall time), and, as a
//! prediction made before the steps, at the share the spinning probe found.

use anyhow::Result;
use serde::{Deserialize, Serialize};
use std::time::Instant;
use yatt_engine::tch::{Device, Kind, Tensor};
use yatt_engine::{ShardGroup, UnitLayout};
use yatt_placement::{Overlap, RankWork, ShardedStep, StepCost};

/// What a rank's ring probe moved and took.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct Probe {
    /// Bytes through this rank's link, counted as the trainer counts them.
    pub bytes: u64,
    /// Seconds.
    pub secs: f64,
}

/// Times `passes` rounds of one all-gather and one reduce-scatter of every unit's padded
/// f32 buffer, after an untimed round of the first layer, so that the ring's streams
/// are open.
pub fn probe(group: &mut dyn ShardGroup, layout: &[UnitLayout], passes: usize) -> Result<Probe> {
    let world = group.world();
    let round = |group: &mut dyn ShardGroup, u: &UnitLayout| -> Result<u64> {
        let s = u.shard_len(world);
        let shard = Tensor::zeros([s], (Kind::Float, Device::Cpu));
        let full = group.all_gather(&shard)?;
        let _mine = group.reduce_scatter(full)?;
        Ok(2 * (s * 4) as u64 * (world as u64 - 1))
    };
    if let Some(first) = layout.get(1).or(layout.first()) {
        round(group, first)?;
    }
    let t0 = Instant::now();
    let mut bytes = 0;
    for u in (0..passes).flat_map(|_| layout) {
        bytes += round(group, u)?;
    }
    Ok(Probe {
        bytes,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// CPU seconds this thread has run.
pub fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes the timespec it is given and nothing else.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
}

/// The share of a core this thread gets while it spins for `secs`: its CPU time over
/// the wall time.
pub fn core_share(secs: f64) -> f64 {
    let (t0, c0) = (Instant::now(), thread_cpu_s());
    let mut x = 1u64;
    while t0.elapsed().as_secs_f64() < secs {
        for _ in 0..10_000 {
            x = std::hint::black_box(x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1));
        }
    }
    ((thread_cpu_s() - c0) / t0.elapsed().as_secs_f64()).clamp(1e-3, 1.0)
}

/// Logical cores of this host.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// One step as a rank timed it (or the mean of its timed steps).
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
pub struct StepTimes {
    pub step_s: f64,
    /// In all-gathers and reduce-scatters.
    pub collectives_s: f64,
    /// In the optimizer step.
    pub update_s: f64,
    /// CPU seconds of the rank's compute thread.
    pub cpu_s: f64,
    pub tokens: f64,
}

impl StepTimes {
    /// The share of a core the rank's compute got: its thread's CPU time over the wall
    /// time outside the collectives (at one rank those are copies on the same thread).
    fn share(&self, world: usize) -> f64 {
        let wall = match world {
            1 => self.step_s,
            _ => self.step_s - self.collectives_s,
        };
        (self.cpu_s / wall.max(1e-9)).clamp(1e-3, 1.0)
    }

    /// Forward, recompute and backward, and the update, in seconds of a whole core.
    fn work(&self, world: usize) -> (f64, f64) {
        let share = self.share(world);
        (
            (self.step_s - self.collectives_s - self.update_s) * share,
            self.update_s * share,
        )
    }
}

/// One rank's compute in seconds of a whole core, from the first sharded row.
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    pub s_per_token: f64,
    pub s_per_micro_batch: f64,
    /// The optimizer step over the whole model.
    pub update_s: f64,
    /// The row it was taken from.
    pub ranks: usize,
}

impl Calibration {
    /// From a rank's timed steps (`full`) and its step of one sequence (`small`).
    fn new(world: usize, full: &StepTimes, small: Option<&StepTimes>) -> Self {
        let (cf, uf) = full.work(world);
        let (s_per_token, s_per_micro_batch) = match small {
            Some(s) if full.tokens > s.tokens => {
                let per_token = (cf - s.work(world).0) / (full.tokens - s.tokens);
                let per_token = per_token.max(0.0);
                (per_token, (cf - per_token * full.tokens).max(0.0))
            }
            _ => (cf / full.tokens.max(1.0), 0.0),
        };
        Calibration {
            s_per_token,
            s_per_micro_batch,
            update_s: uf * world as f64,
            ranks: world,
        }
    }
}

/// What the lead knows of one rank of a sharded row.
pub struct RankTimes {
    /// The mean of its timed steps.
    pub steps: StepTimes,
    /// Its step of one sequence, in the calibration row.
    pub small: Option<StepTimes>,
    pub probe: Option<Probe>,
    pub core_share: f64,
}

/// One sharded row: what the probes found, what the cost model predicts, and what the
/// slowest rank measured.
pub struct Fit {
    /// Ring bandwidth, bytes/s per rank (NaN at one rank).
    pub link_bytes_per_s: f64,
    /// The least share of a core a rank's probe found, and the least its steps got.
    pub share_probe: f64,
    pub share_steps: f64,
    /// At the share the steps got, and at the probed one.
    pub predicted: StepCost,
    pub predicted_probe: StepCost,
    /// The slowest rank's step, its compute (the update included) and its collectives.
    pub step_s: f64,
    pub compute_s: f64,
    pub collectives_s: f64,
}

/// Predicts a sharded row of `world` ranks; sets `calib` from it if unset.
pub fn fit(
    layout: &[UnitLayout],
    world: usize,
    ranks: &[RankTimes],
    calib: &mut Option<Calibration>,
) -> Fit {
    let slowest = ranks
        .iter()
        .max_by(|a, b| a.steps.step_s.total_cmp(&b.steps.step_s))
        .expect("a row has ranks");
    let c = *calib
        .get_or_insert_with(|| Calibration::new(world, &slowest.steps, slowest.small.as_ref()));
    let (bytes, secs) = ranks
        .iter()
        .filter_map(|r| r.probe)
        .fold((0.0, 0.0), |(b, s), p| (b + p.bytes as f64, s + p.secs));
    let link_bytes_per_s = if secs > 0.0 { bytes / secs } else { f64::NAN };
    let least = |f: &dyn Fn(&RankTimes) -> f64| ranks.iter().map(f).fold(1.0, f64::min);
    let model = sharded(layout, world, link_bytes_per_s);
    let tokens = ranks.iter().map(|r| r.steps.tokens).fold(0.0, f64::max);
    let at = |share: f64| {
        model.predict(RankWork {
            tokens,
            micro_batches: 1.0,
            s_per_token: c.s_per_token / share,
            s_per_micro_batch: c.s_per_micro_batch / share,
            update_s: c.update_s / world as f64 / share,
        })
    };
    let (share_probe, share_steps) = (least(&|r| r.core_share), least(&|r| r.steps.share(world)));
    Fit {
        link_bytes_per_s,
        share_probe,
        share_steps,
        predicted: at(share_steps),
        predicted_probe: at(share_probe),
        step_s: slowest.steps.step_s,
        compute_s: slowest.steps.step_s - slowest.steps.collectives_s,
        collectives_s: slowest.steps.collectives_s,
    }
}

/// Bytes a rank moves per step of one micro-batch by the cost model's schedule.
pub fn schedule_bytes(layout: &[UnitLayout], world: usize) -> f64 {
    sharded(layout, world, f64::NAN).moved_bytes_per_micro_batch()
}

/// The cost model of this f32 CPU trainer, no prefetch.
fn sharded(layout: &[UnitLayout], world: usize, link_bytes_per_s: f64) -> ShardedStep {
    ShardedStep {
        units: layout.iter().map(|u| u.numel as f64).collect(),
        ranks: world as u32,
        elt_bytes: 4.0,
        link_bytes_per_s,
        overlap: Overlap::Exposed,
    }
}
