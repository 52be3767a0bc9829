//! The cost model against the measured step. Each rank probes the ring before its
//! steps (one all-gather and one reduce-scatter of every unit, as the trainer runs
//! them); the lead takes one rank's compute per token from the first sharded row, and
//! predicts every sharded row with `yatt_placement::ShardedStep`: that compute for the
//! rank's tokens, plus the bytes the schedule moves over the probe's bandwidth, all of
//! it exposed (the trainer has no prefetch).

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

/// Times one all-gather and one reduce-scatter of every unit's padded f32 buffer, after
/// an untimed round of the first layer, so that the ring's streams are open.
pub fn probe(group: &mut dyn ShardGroup, layout: &[UnitLayout]) -> Result<Probe> {
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
    for u in layout {
        bytes += round(group, u)?;
    }
    Ok(Probe {
        bytes,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// Logical cores of this host: ranks beyond them share.
pub fn cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How many times slower a rank computes when `world` ranks of `threads` threads each
/// share the host's cores.
pub fn contention(world: usize, threads: usize) -> f64 {
    ((world * threads) as f64 / cores() as f64).max(1.0)
}

/// Seconds per token of forward, recompute and backward (and the rank's AdamW, which
/// shrinks with N as its tokens do at a fixed global batch) of one rank on a core of
/// its own, collectives excluded.
#[derive(Debug, Clone, Copy)]
pub struct Calibration {
    pub s_per_token: f64,
    /// The row it was taken from.
    pub ranks: usize,
}

/// One sharded row: what a rank measured, and what the cost model predicts.
pub struct Fit {
    /// Ring bandwidth the probes measured, bytes/s per rank (NaN at one rank).
    pub link_bytes_per_s: f64,
    pub predicted: StepCost,
    /// The slowest rank's step, its compute and its collectives, seconds.
    pub step_s: f64,
    pub compute_s: f64,
    pub collectives_s: f64,
}

/// What the lead knows of one rank of a sharded row (timed steps only).
pub struct RankTimes {
    pub step_s: f64,
    pub collectives_s: f64,
    pub tokens: f64,
    pub probe: Option<Probe>,
}

/// Predicts a sharded row of `world` ranks and sets `calib` from it if unset.
pub fn fit(
    layout: &[UnitLayout],
    world: usize,
    threads: usize,
    ranks: &[RankTimes],
    calib: &mut Option<Calibration>,
) -> Fit {
    let slowest = ranks
        .iter()
        .max_by(|a, b| a.step_s.total_cmp(&b.step_s))
        .expect("a row has ranks");
    let per_token = ranks
        .iter()
        .map(|r| (r.step_s - r.collectives_s) / r.tokens.max(1.0))
        .fold(0.0, f64::max);
    let c = calib.get_or_insert(Calibration {
        s_per_token: per_token / contention(world, threads),
        ranks: world,
    });
    let (bytes, secs) = ranks
        .iter()
        .filter_map(|r| r.probe)
        .fold((0.0, 0.0), |(b, s), p| (b + p.bytes as f64, s + p.secs));
    let link_bytes_per_s = if secs > 0.0 { bytes / secs } else { f64::NAN };
    let predicted = sharded(layout, world, link_bytes_per_s).predict(RankWork {
        tokens: ranks.iter().map(|r| r.tokens).fold(0.0, f64::max),
        micro_batches: 1.0,
        s_per_token: c.s_per_token * contention(world, threads),
    });
    Fit {
        link_bytes_per_s,
        predicted,
        step_s: slowest.step_s,
        compute_s: slowest.step_s - slowest.collectives_s,
        collectives_s: slowest.collectives_s,
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
