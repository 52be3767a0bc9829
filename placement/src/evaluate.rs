//! Judging candidate plans by simulating a few steps with the fitted cost model, as
//! ReaLHF estimates plans with a runtime simulator: the analytic model ranks
//! thousands of shapes quickly, the simulation settles between the best few, and it
//! sees what the formulas miss (queueing, stragglers holding back a step, pipeline
//! bubbles).

use std::collections::BTreeMap;

use crate::cost::{CostModel, Shape, Stage};
use crate::engine::{Rates, Sim, World};
use crate::inventory::Inventory;
use crate::plan::Lanes;
use crate::profile::{Efficiency, Role, RoleSet};
use crate::search::assign;
use crate::workload::{DynamicSampling, Forecast, LengthDist, WorkloadSpec};

/// Most groups a candidate is simulated with: larger clusters are simulated as a slice
/// with the same load per group, which keeps a search at 4,096 GPUs fast.
const MAX_GROUPS: f64 = 48.0;

/// Mean seconds per step of `shape` over `steps` simulated steps (after the first
/// `staleness + 2`, which fill the pipeline), with the fitted rates of `cm` and the workload of `f`
/// whose lengths grow by `trend` in ln per step.
pub fn simulate_shape(cm: &CostModel, f: &Forecast, trend: f64, shape: &Shape, steps: u32) -> f64 {
    let setup = cm.setup();
    let g = setup.group_devices;
    let total = f64::from(shape.groups().max(1));
    let k = (total / MAX_GROUPS).max(1.0);
    let pools: Vec<_> = shape
        .pools
        .iter()
        .map(|(r, n)| (*r, ((f64::from(*n) / k).round() as u32).max(1)))
        .collect();
    // Lanes scale with the slice, keeping at least one lane and one ordinary group.
    let rollout = pools
        .iter()
        .find(|x| x.0 == RoleSet::of(&[Role::Rollout]))
        .map_or(0, |x| x.1);
    let lanes = shape.lanes.and_then(|l| {
        let n = ((f64::from(l.groups) / k).round() as u32)
            .max(1)
            .min(rollout.saturating_sub(1));
        (n > 0).then_some(Lanes { groups: n, ..l })
    });
    let sliced = Shape {
        pools,
        rollout_cap: shape.rollout_cap,
        lanes,
    };
    let groups = sliced.groups();
    let scale = total / f64::from(groups);
    let p = f.params;
    let prompts = ((f64::from(p.prompts_per_step) / scale).round() as u32).max(1);
    // The first steps fill the pipeline (one more per step of staleness): skip them.
    let skip = (setup.staleness + 2) as usize;
    let steps = steps.max(skip as u32 + 6);
    let workload = WorkloadSpec {
        steps,
        prompts_per_step: prompts,
        samples_per_prompt: p.samples_per_prompt,
        prompt_len: p.prompt_len.round().max(1.0) as u32,
        response: LengthDist::Lognormal {
            median: p.len_log_mean.exp().max(1.0),
            sigma: p.len_log_sigma,
        },
        max_response: p.max_response,
        growth: (trend * f64::from(steps - 1)).exp(),
        group_correlation: 0.5,
        dynamic_sampling: (p.drop_rate > 0.0).then_some(DynamicSampling {
            drop_start: p.drop_rate.min(0.9),
            drop_end: p.drop_rate.min(0.9),
        }),
        judge: (p.judge_log_mean > 0.0).then_some(LengthDist::Lognormal {
            median: p.judge_log_mean.exp(),
            sigma: p.judge_log_sigma,
        }),
        judge_max: p.judge_max.max(1),
        judge_prompt: p.judge_prompt.round() as u32,
        seed: 7,
        scale_by_step: Vec::new(),
        partial_rollout: setup.partial_rollout,
    };
    let rollout_pool = sliced
        .pools
        .iter()
        .position(|x| x.0.contains(Role::Rollout));
    let policy_pool = sliced.pools.iter().position(|x| x.0.contains(Role::Policy));
    let colocated = rollout_pool == policy_pool;
    let mut s_per_token = BTreeMap::new();
    for s in Stage::of_job(&setup.job) {
        if !matches!(s, Stage::Gen | Stage::Judge) {
            s_per_token.insert(s, cm.s_per_token(s));
        }
    }
    let Some(gen) = cm.decode_coeffs(Stage::Gen) else {
        return f64::INFINITY;
    };
    let rates = Rates {
        gen,
        judge: cm.decode_coeffs(Stage::Judge),
        slots: 0,
        s_per_token,
        sync_s: cm.sync_cost(colocated),
        overhead_s: 0.0,
        switch_s: cm.switch_cost(Role::Policy, groups * g),
    };
    let world = World {
        gpu: setup.gpu.clone(),
        truth: Efficiency::default(),
        job: setup.job.clone(),
        workload,
        group_devices: g,
        groups,
        rates: Some(rates),
    };
    let Ok(inv) = Inventory::uniform(
        groups,
        g,
        g,
        setup.gpu.memory_bytes,
        setup.gpu.host_memory_bytes,
    ) else {
        return f64::INFINITY;
    };
    let plan = assign(&sliced, &inv, None);
    let r = Sim::new(&world, &plan, setup.staleness).run();
    let tail = &r.step_s[skip.min(r.step_s.len())..];
    if tail.is_empty() {
        return f64::INFINITY;
    }
    tail.iter().sum::<f64>() / tail.len() as f64
}
