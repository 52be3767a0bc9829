//! Runs the cluster simulator on a config without the `yatt` binary (which links
//! libtorch): `cargo run -p yatt-sim --release --example sim -- CONFIG [SCENARIO]`.
//! With `--plan "rollout:20 reward:4 reference+policy:8" --staleness N` it simulates
//! that fixed plan instead of comparing placements (for exploring the model);
//! `--cap N` caps the rollout batch and `--lanes GROUPS:BATCH:THRESHOLD` adds straggler
//! lanes to it. `CONFIG --bench` times the plan search on the config's
//! scenarios, with and without its straggler lanes.

use std::time::Instant;

use yatt_placement::{
    assign, search_top_lanes, CostModel, CostSetup, Lanes, PlacementPolicy, PolicyConfig, Role,
    RoleSet, Shape, Sim, Space, World,
};
use yatt_sim::{format_report, lower_bound, run_scenario, SimConfig};

fn parse_shape(spec: &str) -> Result<Shape, String> {
    let mut pools = Vec::new();
    for part in spec.split_whitespace() {
        let (roles, n) = part
            .split_once(':')
            .ok_or(format!("{part}: expected ROLES:GROUPS"))?;
        let mut set = RoleSet::EMPTY;
        for r in roles.split('+') {
            let role = Role::ALL
                .into_iter()
                .find(|x| x.name() == r)
                .ok_or(format!("unknown role {r}"))?;
            set.insert(role);
        }
        pools.push((set, n.parse().map_err(|e| format!("{n}: {e}"))?));
    }
    Ok(Shape {
        pools,
        rollout_cap: None,
        lanes: None,
    })
}

/// The cost model's setup for world `w` at `staleness`, with the nominal efficiencies.
fn setup_of(w: &World, staleness: u32) -> CostSetup {
    CostSetup {
        job: w.job.clone(),
        gpu: w.gpu.clone(),
        group_devices: w.group_devices,
        staleness,
        partial_rollout: w.workload.partial_rollout,
    }
}

/// `--bench`: the plan search's time on each scenario of the config at its first
/// step's forecast, with the config's straggler lanes and without: the analytic
/// search alone (median of 5), and the policy's whole first choice (its best shapes
/// simulated on a slice of the cluster).
fn bench(config: &SimConfig) -> Result<(), Box<dyn std::error::Error>> {
    println!("| scenario | lanes | analytic search (median of 5) | with simulated candidates | chosen plan |");
    println!("|---|---|---:|---:|---|");
    for sc in config.scenarios()? {
        let w = &sc.world;
        let inv = sc.inventory()?;
        let prior = w.workload.forecast_at(0).params;
        let cm = CostModel::new(setup_of(w, sc.staleness), prior);
        let f = cm.forecast(0.0);
        let space = Space::of(&inv);
        let mut variants = vec![None];
        if sc.policy.lanes.is_some() {
            variants.push(sc.policy.lanes);
        }
        for lanes in variants {
            let mut times: Vec<f64> = (0..5)
                .map(|_| {
                    let t = Instant::now();
                    let found = search_top_lanes(&cm, &f, &space, 4, lanes);
                    assert!(!found.is_empty(), "no plan fits");
                    t.elapsed().as_secs_f64()
                })
                .collect();
            times.sort_by(f64::total_cmp);
            let policy = PolicyConfig { lanes, ..sc.policy };
            let t = Instant::now();
            let chosen =
                PlacementPolicy::new(policy, inv.clone(), setup_of(w, sc.staleness), prior)?;
            println!(
                "| {} | {} | {:.0} ms | {:.0} ms | {} |",
                sc.name,
                if lanes.is_some() { "yes" } else { "no" },
                times[2] * 1e3,
                t.elapsed().as_secs_f64() * 1e3,
                chosen.plan().summary()
            );
        }
    }
    Ok(())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();

    let path = args
        .first()
        .ok_or("usage: sim CONFIG [SCENARIO-INDEX] [--plan SPEC --staleness N]")?;
    let only: Option<usize> = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .map(|s| s.parse())
        .transpose()?;
    let flag = |name: &str| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
    };
    let config = SimConfig::parse(&std::fs::read_to_string(path)?)?;
    if args.iter().any(|a| a == "--bench") {
        return bench(&config);
    }
    for (i, sc) in config.scenarios()?.iter().enumerate() {
        if only.is_some_and(|o| o != i) {
            continue;
        }
        let t = std::time::Instant::now();
        if let Some(spec) = flag("--plan") {
            let mut shape = parse_shape(spec)?;
            if let Some(l) = flag("--lanes") {
                let n: Vec<u32> = l.split(':').map(|x| x.parse()).collect::<Result<_, _>>()?;
                let [groups, batch, threshold] = n[..] else {
                    return Err("--lanes: expected GROUPS:BATCH:THRESHOLD, e.g. 2:8:4096".into());
                };
                shape.lanes = Some(Lanes {
                    groups,
                    batch,
                    threshold,
                });
            }
            if let Some(c) = flag("--cap") {
                shape.rollout_cap = Some(c.parse()?);
            }
            let w = &sc.world;
            let inv = sc.inventory()?;
            let plan = assign(&shape, &inv, None);
            plan.validate(&inv, &w.job)?;
            let staleness: u32 = flag("--staleness")
                .map(|s| s.parse())
                .transpose()?
                .unwrap_or(sc.staleness);
            let r = Sim::new(w, &plan, staleness).run();
            let cm = CostModel::with_efficiency(
                setup_of(w, staleness),
                w.workload.forecast_at(0).params,
                w.truth,
            );
            let steps = w.workload.steps;
            let preds: Vec<String> = [0, steps / 2, steps - 1]
                .iter()
                .map(|k| {
                    let p = cm.predict(&shape, &w.workload.forecast_at(*k));
                    format!(
                        "step {k}: {:.0}s busy {:?} cycle {:.0}",
                        p.step_s,
                        p.pool_busy_s.iter().map(|x| x.round()).collect::<Vec<_>>(),
                        p.cycle_s
                    )
                })
                .collect();
            println!("  cost model: {}", preds.join("; "));
            let bound: f64 = lower_bound(w).iter().sum();
            println!(
                "{}: plan {} staleness {staleness}: {:.1} s/step, {:.2}x bound, idle {:.1}%, overhead {:.1}%, wasted {:.1}%",
                sc.name,
                plan.summary(),
                r.makespan_s / f64::from(w.workload.steps),
                r.makespan_s / bound,
                r.idle_frac * 100.0,
                r.overhead_frac * 100.0,
                r.wasted_frac * 100.0
            );
            if w.workload.partial_rollout.is_some() {
                println!(
                    "  partial rollouts: carried {:.1}% of groups, thrown away beyond the bound {:.2}%, re-prefilled {:.2}% of generated, max lag {}",
                    r.carried_frac * 100.0,
                    r.stale_frac * 100.0,
                    r.reprefill_frac * 100.0,
                    r.max_lag
                );
            }
            for (stage, gs, batch) in &r.stages {
                println!(
                    "  {stage:?}: {:.0} group-s/step, batch {:?}",
                    gs / f64::from(w.workload.steps),
                    batch.map(|b| b.round())
                );
            }
            let st: Vec<String> = r.step_s.iter().map(|x| format!("{x:.0}")).collect();
            println!("  steps: {}", st.join(" "));
            if r.lane_moves > 0 {
                println!(
                    "  lanes: {} responses moved, {:.0} group-s bringing their caches",
                    r.lane_moves, r.lane_transfer_s
                );
            }
        } else {
            let r = run_scenario(sc)?;
            print!("{}", format_report(&r));
            for l in &r.policy_log {
                println!("    {l}");
            }
        }
        println!("(simulated in {:.1} s)\n", t.elapsed().as_secs_f64());
    }
    Ok(())
}
