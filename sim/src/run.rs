//! Running a scenario: every placement compared on the same workload, dynamic first
//! (the static candidates include the plans it used).

use yatt_placement::{
    assign, search_top_lanes, CostModel, CostSetup, PlacementPolicy, Plan, Shape, Sim, Space, World,
};

use crate::bound::lower_bound;
use crate::config::{Scenario, SimConfig, SimError, Strategy};
use crate::report::{refused, report, ScenarioReport, StrategyReport};

/// Runs one scenario's placements (and, with `without_partial`, each again without
/// partial rollouts).
pub fn run_scenario(sc: &Scenario) -> Result<ScenarioReport, SimError> {
    let w = &sc.world;
    let bound = lower_bound(w);
    let bound_step = bound.iter().sum::<f64>() / bound.len().max(1) as f64;
    let steps = w.workload.steps;
    let mut out = Vec::new();
    let mut policy_log = Vec::new();
    let mut worlds = Vec::new();
    if w.workload.partial_rollout.is_some() && sc.without_partial {
        let mut plain = w.clone();
        plain.workload.partial_rollout = None;
        worlds.push(plain);
    }
    worlds.push(w.clone());
    for world in &worlds {
        // Colocation has no lanes: it runs once, with the placements without lanes.
        if sc.policy.lanes.is_some() && sc.without_lanes {
            let mut plain = sc.clone();
            plain.policy.lanes = None;
            out.extend(run_placements(&plain, world, bound_step)?.0);
            let mut laned = sc.clone();
            laned.strategies.retain(|s| *s != Strategy::Colocate);
            let (rs, log) = run_placements(&laned, world, bound_step)?;
            out.extend(rs);
            policy_log = log;
        } else {
            let (rs, log) = run_placements(sc, world, bound_step)?;
            out.extend(rs);
            policy_log = log;
        }
    }
    let colo = |partial: bool| {
        out.iter()
            .find(|r| r.strategy == Strategy::Colocate && r.partial == partial)
            .filter(|r| r.refused.is_none())
            .map(|r| r.tokens_per_s)
    };
    let (colo_plain, colo_partial) = (colo(false), colo(true));
    for r in &mut out {
        if r.refused.is_none() {
            let like = if r.partial { colo_partial } else { colo_plain };
            r.speedup = like.map(|c| r.tokens_per_s / c);
            r.speedup_vs_on_policy = colo_plain.map(|c| r.tokens_per_s / c);
        }
    }
    out.sort_by_key(|r| (r.partial, r.lanes, r.strategy as u8));
    Ok(ScenarioReport {
        name: sc.name.clone(),
        gpus: w.groups * w.group_devices,
        group_size: w.group_devices,
        model: w.job.policy.name.clone(),
        steps,
        staleness: sc.staleness,
        partial_rollout: w.workload.partial_rollout,
        lanes: sc.policy.lanes,
        bound_step_s: bound_step,
        bound_steps_s: bound,
        strategies: out,
        policy_log,
    })
}

/// Runs the scenario's placements on `w` (the scenario's world, with or without
/// partial rollouts); returns their reports and the dynamic policy's log.
fn run_placements(
    sc: &Scenario,
    w: &World,
    bound_step: f64,
) -> Result<(Vec<StrategyReport>, Vec<String>), SimError> {
    let inv = sc.inventory()?;
    let steps = w.workload.steps;
    let partial = w.workload.partial_rollout;
    let setup = |staleness| CostSetup {
        job: w.job.clone(),
        gpu: w.gpu.clone(),
        group_devices: w.group_devices,
        staleness,
        partial_rollout: partial,
    };
    // Colocation starts each step's generation on the newest weights. With partial
    // rollouts it spends the whole staleness bound on carrying (Kimi k1.5's
    // synchronous partial rollouts), so every placement has the same bound.
    let colocate = |plan: &Plan| match partial {
        Some(_) => Sim::new(w, plan, sc.staleness).synchronous(),
        None => Sim::new(w, plan, 0),
    };
    let prior = w.workload.forecast_at(0).params;
    let mut out = Vec::new();
    let mut policy_log = Vec::new();
    let mut dynamic_shapes: Vec<Shape> = Vec::new();
    let mut fitted = None;
    // Dynamic first: the static candidates include the plans it used.
    let mut order = sc.strategies.clone();
    order.sort_by_key(|s| match s {
        Strategy::Dynamic => 0,
        Strategy::Colocate => 1,
        Strategy::Static => 2,
    });
    for strategy in order {
        match strategy {
            Strategy::Colocate => {
                let plan = Plan::full_colocation(&inv, &w.job);
                match plan.validate(&inv, &w.job) {
                    Ok(()) => {
                        let r = colocate(&plan).run();
                        out.push(report(strategy, &plan, r, bound_step, steps));
                    }
                    Err(e) => out.push(refused(strategy, e.to_string())),
                }
            }
            Strategy::Dynamic => {
                let mut policy =
                    PlacementPolicy::new(sc.policy, inv.clone(), setup(sc.staleness), prior)
                        .map_err(|source| SimError::Policy {
                            scenario: sc.name.clone(),
                            source,
                        })?;
                let plan = policy.plan().clone();
                let r = Sim::new(w, &plan, sc.staleness)
                    .driven_by(&mut policy)
                    .run();
                // The static candidates include the plans it started and ended with,
                // judged with the rates it fitted.
                fitted = Some(policy.cost_model().clone());
                dynamic_shapes.push(Shape::of(&plan));
                dynamic_shapes.push(Shape::of(policy.plan()));
                policy_log = r.log.clone();
                out.push(report(strategy, &plan, r, bound_step, steps));
            }
            Strategy::Static => {
                let cm = match fitted.clone() {
                    Some(cm) => cm,
                    None => CostModel::new(setup(sc.staleness), prior),
                };
                let space = Space::of(&inv);
                let mut shapes = dynamic_shapes.clone();
                for k in [0, steps / 2, steps.saturating_sub(1)] {
                    let f = w.workload.forecast_at(k);
                    let all = search_top_lanes(&cm, &f, &space, usize::MAX, sc.policy.lanes);
                    // The best split without lanes, and the best with lanes when they
                    // are allowed.
                    for lanes in [false, true] {
                        if let Some(x) = all.iter().find(|x| x.shape.lanes.is_some() == lanes) {
                            shapes.push(x.shape.clone());
                        }
                    }
                }
                let mut seen = Vec::new();
                let mut best: Option<StrategyReport> = None;
                for s in shapes {
                    if seen.contains(&s) {
                        continue;
                    }
                    seen.push(s.clone());
                    let plan = assign(&s, &inv, None);
                    if let Err(e) = plan.validate(&inv, &w.job) {
                        if best.is_none() {
                            best = Some(refused(strategy, e.to_string()));
                        }
                        continue;
                    }
                    let r = Sim::new(w, &plan, sc.staleness).run();
                    let rep = report(strategy, &plan, r, bound_step, steps);
                    if best
                        .as_ref()
                        .is_none_or(|b| b.refused.is_some() || rep.makespan_s < b.makespan_s)
                    {
                        best = Some(rep);
                    }
                }
                out.push(best.unwrap_or_else(|| refused(strategy, "no static split fits".into())));
            }
        }
    }
    for r in &mut out {
        r.partial = partial.is_some();
        r.lanes = sc.policy.lanes.is_some() && r.strategy != Strategy::Colocate;
    }
    Ok((out, policy_log))
}

/// Runs every scenario of a configuration.
pub fn run(config: &SimConfig) -> Result<Vec<ScenarioReport>, SimError> {
    config.scenarios()?.iter().map(run_scenario).collect()
}
