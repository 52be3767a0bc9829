//! What a scenario's run found: each placement's figures, and the table `yatt sim`
//! prints.

use serde::Serialize;
use yatt_placement::{LaneSearch, PartialRollout, Plan, RunResult};

use crate::config::Strategy;

/// One placement's figures in a scenario.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StrategyReport {
    /// `colocate`, `static` or `dynamic`.
    pub strategy: Strategy,
    /// Whether it ran with partial rollouts.
    pub partial: bool,
    /// Whether its search could use straggler lanes.
    pub lanes: bool,
    /// Responses moved to a straggler lane.
    pub lane_moves: u64,
    /// The plan it started with (group counts per pool).
    pub plan: String,
    /// Whether it ran; if not, why (e.g. it does not fit memory).
    pub refused: Option<String>,
    /// Seconds for the whole run.
    pub makespan_s: f64,
    /// Mean seconds per step.
    pub step_s: f64,
    /// Each step's seconds.
    pub steps_s: Vec<f64>,
    /// Mean step over the lower bound's (1 = the bound).
    pub vs_bound: f64,
    /// Trained tokens per second.
    pub tokens_per_s: f64,
    /// Throughput over full colocation's with the same partial-rollout setting (when
    /// colocation ran).
    pub speedup: Option<f64>,
    /// Throughput over on-policy full colocation without partial rollouts (verl-style),
    /// when that ran.
    pub speedup_vs_on_policy: Option<f64>,
    /// Fraction of device time computing.
    pub compute_frac: f64,
    /// Fraction of device time on offload/reload, weight sync and migration.
    pub overhead_frac: f64,
    /// Fraction of device time idle.
    pub idle_frac: f64,
    /// Fraction of generated tokens thrown away (aborted, surplus, beyond the
    /// staleness bound).
    pub wasted_frac: f64,
    /// Of those, the fraction of generated tokens thrown away because their response
    /// would have trained beyond the staleness bound.
    pub stale_frac: f64,
    /// Prompt groups trained by a later step than the one they were issued for,
    /// fraction of all trained (partial rollouts).
    pub carried_frac: f64,
    /// Tokens prefilled again by responses resuming without their KV cache, fraction
    /// of the generated tokens.
    pub reprefill_frac: f64,
    /// The most versions a trained group's oldest response lagged the weights it
    /// trained.
    pub max_lag: u32,
    /// Migrations (dynamic only).
    pub migrations: u32,
    /// Plans in force, by the step they were decided at.
    pub plans: Vec<(u64, String)>,
}

/// A scenario's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// The scenario.
    pub name: String,
    /// Devices.
    pub gpus: u32,
    /// Devices per group.
    pub group_size: u32,
    /// The policy model.
    pub model: String,
    /// Steps simulated.
    pub steps: u32,
    /// Staleness of static and dynamic.
    pub staleness: u32,
    /// Partial rollouts, when the workload has them.
    pub partial_rollout: Option<PartialRollout>,
    /// Straggler lanes the static and dynamic searches could use.
    pub lanes: Option<LaneSearch>,
    /// Lower bound per step: each step's work at full efficiency over all devices.
    pub bound_steps_s: Vec<f64>,
    /// Mean of the bound per step.
    pub bound_step_s: f64,
    /// The placements compared.
    pub strategies: Vec<StrategyReport>,
    /// What the dynamic policy considered, one line per search.
    pub policy_log: Vec<String>,
}

impl ScenarioReport {
    /// The report of one strategy, as configured: with partial rollouts when the
    /// workload has them and with lanes when the policy may use them (the runs
    /// without are there for comparison).
    pub fn get(&self, s: Strategy) -> Option<&StrategyReport> {
        let configured = self.partial_rollout.is_some();
        let lanes = self.lanes.is_some() && s != Strategy::Colocate;
        self.strategies.iter().find(|r| {
            r.strategy == s && r.refused.is_none() && r.partial == configured && r.lanes == lanes
        })
    }
}

pub(crate) fn report(
    strategy: Strategy,
    plan: &Plan,
    r: RunResult,
    bound_step: f64,
    steps: u32,
) -> StrategyReport {
    let step_s = r.makespan_s / f64::from(steps.max(1));
    StrategyReport {
        strategy,
        partial: false,
        lanes: false,
        lane_moves: r.lane_moves,
        plan: plan.summary(),
        refused: None,
        makespan_s: r.makespan_s,
        step_s,
        steps_s: r.step_s,
        vs_bound: step_s / bound_step,
        tokens_per_s: r.trained_tokens / r.makespan_s.max(1e-9),
        speedup: None,
        speedup_vs_on_policy: None,
        compute_frac: r.compute_frac,
        overhead_frac: r.overhead_frac,
        idle_frac: r.idle_frac,
        wasted_frac: r.wasted_frac,
        stale_frac: r.stale_frac,
        carried_frac: r.carried_frac,
        reprefill_frac: r.reprefill_frac,
        max_lag: r.max_lag,
        migrations: r.migrations,
        plans: r.plans,
    }
}

pub(crate) fn refused(strategy: Strategy, why: String) -> StrategyReport {
    StrategyReport {
        strategy,
        partial: false,
        lanes: false,
        lane_moves: 0,
        plan: String::new(),
        refused: Some(why),
        makespan_s: f64::NAN,
        step_s: f64::NAN,
        steps_s: Vec::new(),
        vs_bound: f64::NAN,
        tokens_per_s: f64::NAN,
        speedup: None,
        speedup_vs_on_policy: None,
        compute_frac: f64::NAN,
        overhead_frac: f64::NAN,
        idle_frac: f64::NAN,
        wasted_frac: f64::NAN,
        stale_frac: f64::NAN,
        carried_frac: f64::NAN,
        reprefill_frac: f64::NAN,
        max_lag: 0,
        migrations: 0,
        plans: Vec::new(),
    }
}

/// A scenario's figures as a plain-text table.
pub fn format_report(r: &ScenarioReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{}: {} GPUs in groups of {}, {} model, {} steps, staleness {} (static, dynamic); lower bound {:.1} s/step",
        r.name, r.gpus, r.group_size, r.model, r.steps, r.staleness, r.bound_step_s
    );
    if let Some(pr) = &r.partial_rollout {
        let _ = writeln!(
            s,
            "  partial rollouts: cutoff {:.0}% of a batch, {} version(s) reserved for carrying, resume {:?}, beyond the bound: {:?}",
            pr.cutoff * 100.0,
            pr.reserve,
            pr.resume,
            pr.beyond_bound
        );
    }
    let _ = writeln!(
        s,
        "  {:<23} {:>7} {:>7} {:>8} {:>8} {:>6} {:>7} {:>7} {:>7} {:>4} {:>7} {:>5} {:>6}  plan",
        "placement",
        "s/step",
        "x bound",
        "speedup",
        "vs sync",
        "idle",
        "overhd",
        "wasted",
        "carried",
        "lag",
        "tok/s",
        "migr",
        "lane"
    );
    let pct = |v: f64| format!("{:.1}%", v * 100.0);
    let times = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.2}x"));
    for x in &r.strategies {
        let name = format!(
            "{}{}{}",
            x.strategy.name(),
            if x.partial { "+partial" } else { "" },
            if x.lanes { "+lanes" } else { "" }
        );
        if let Some(why) = &x.refused {
            let _ = writeln!(s, "  {name:<23} refused: {why}");
            continue;
        }
        let _ = writeln!(
            s,
            "  {:<23} {:>7.1} {:>7.2} {:>8} {:>8} {:>6} {:>7} {:>7} {:>7} {:>4} {:>7.0} {:>5} {:>6}  {}",
            name,
            x.step_s,
            x.vs_bound,
            times(x.speedup),
            times(x.speedup_vs_on_policy),
            pct(x.idle_frac),
            pct(x.overhead_frac),
            pct(x.wasted_frac),
            pct(x.carried_frac),
            x.max_lag,
            x.tokens_per_s,
            x.migrations,
            x.lane_moves,
            match x.plans.last() {
                Some(last) if x.plans.len() > 1 => format!("{} → {}", x.plan, last.1),
                _ => x.plan.clone(),
            }
        );
    }
    s
}
