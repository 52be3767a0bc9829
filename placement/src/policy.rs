//! The placement policy: a deterministic state machine with no I/O. Events come in
//! (membership changes, a step's metrics, the outcome of a migration), decisions come
//! out. The live placement actor and the simulator drive this same code.
//!
//! It re-plans every few steps. A better plan is adopted only when
//! - it predicts a step at least `min_gain` shorter than the current plan,
//! - the time it saves over `horizon_steps` pays for the migration `payback` times over,
//! - and the search has proposed it (or a plan close to it) `confirmations` times in a
//!   row;
//!
//! after a migration it waits `cooldown_steps` before looking again. Those four rules
//! are the hysteresis that keeps it from flapping between two near-equal plans as
//! the metrics wobble. Losing a node bypasses them: the plan must change.
//!
//! ```
//! use yatt_placement::{CostSetup, Event, ForecastParams, GpuSpec, Inventory, JobShape};
//! use yatt_placement::{ModelSpec, PlacementPolicy, PolicyConfig, RewardKind};
//!
//! let gpu = GpuSpec::preset("h100").unwrap();
//! let model = ModelSpec::preset("7b").unwrap();
//! let inv = Inventory::uniform(4, 8, 2, gpu.memory_bytes, gpu.host_memory_bytes).unwrap();
//! let setup = CostSetup {
//!     job: JobShape::new(model, RewardKind::Rule, 8192),
//!     gpu, group_devices: 2, staleness: 1,
//!     partial_rollout: None,
//! };
//! // 256 prompts x 8 samples a step, responses around 1,100 tokens.
//! let forecast = ForecastParams::lognormal(256, 8, 1100.0, 1.0, 8192);
//! let mut policy = PlacementPolicy::new(PolicyConfig::default(), inv, setup, forecast).unwrap();
//! println!("start with {}", policy.plan().summary());
//! // The actor (or the simulator) feeds it events and carries out what it decides.
//! let decisions = policy.on_event(Event::NodeLeft { node: "node-3".into() });
//! assert_eq!(decisions.len(), 1);
//! ```

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, CostSetup, Shape, StepMetrics};
use crate::evaluate::simulate_shape;
use crate::events::{Decision, Event, Migration, Placer, Reason};
use crate::inventory::{Inventory, InventoryError};
use crate::plan::{Move, Plan, PlanError};
use crate::profile::RoleSet;
use crate::search::{assign, search_top_in, search_top_lanes, Found, LaneSearch, Space};
use crate::workload::ForecastParams;

/// The policy's knobs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PolicyConfig {
    /// Steps between searches.
    pub replan_every: u64,
    /// Steps of metrics before the first search.
    pub warmup_steps: u64,
    /// Smallest relative gain in predicted step time worth migrating for.
    pub min_gain: f64,
    /// Consecutive searches that must propose the move.
    pub confirmations: u32,
    /// Steps over which a migration must pay for itself.
    pub horizon_steps: f64,
    /// How many times over the saved time must cover the migration cost.
    pub payback: f64,
    /// Steps after a migration before the next search.
    pub cooldown_steps: u64,
    /// How far ahead the forecast looks (steps), so the plan fits the coming steps.
    pub lookahead_steps: f64,
    /// How many of the search's best shapes (plus the current plan) are simulated for
    /// a few steps before choosing; 0 trusts the analytic model alone.
    pub simulate_candidates: u32,
    /// Steps each candidate is simulated for.
    pub simulate_steps: u32,
    /// Straggler lanes the search may propose, e.g. `lanes = { batch = 8 }` (a
    /// threshold, when not given, comes from the forecast); none: never. Ignored under
    /// a live executor's [`Limits`], whose engines have no lanes yet.
    pub lanes: Option<LaneSearch>,
}

impl Default for PolicyConfig {
    fn default() -> Self {
        PolicyConfig {
            replan_every: 2,
            warmup_steps: 2,
            min_gain: 0.08,
            confirmations: 3,
            horizon_steps: 20.0,
            payback: 2.0,
            cooldown_steps: 3,
            lookahead_steps: 5.0,
            simulate_candidates: 4,
            simulate_steps: 10,
            lanes: None,
        }
    }
}

/// Why a policy could not be made.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PolicyError {
    /// No plan fits: the error of full colocation says why.
    #[error("no placement fits this cluster: {0}")]
    NoPlan(PlanError),
    /// The inventory has no groups.
    #[error(
        "the inventory has no groups; start placement after at least one node with devices joined"
    )]
    Empty,
    /// A membership change was inconsistent.
    #[error(transparent)]
    Inventory(#[from] InventoryError),
}

/// What a live executor can carry out. The policy searches only there, so it never
/// decides a plan its executor would have to refuse. The default limits nothing.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Limits {
    /// The pool structures (partitions of the roles into pools) it can run; none: all.
    pub structures: Option<Vec<Vec<RoleSet>>>,
    /// The rollout batch cap its engines have (most sequences one group decodes at
    /// once); searched plans carry it. Used only with `structures`.
    pub rollout_cap: Option<u32>,
}

/// The best shapes within `limits` (with straggler lanes as `lanes` allows, when
/// nothing limits the search), best first.
fn ranked(
    cm: &CostModel,
    f: &crate::workload::Forecast,
    space: &Space,
    limits: &Limits,
    lanes: Option<LaneSearch>,
    k: usize,
) -> Vec<Found> {
    match &limits.structures {
        Some(s) => search_top_in(cm, f, space, s, &[limits.rollout_cap], k),
        None => search_top_lanes(cm, f, space, k, lanes),
    }
}

#[derive(Debug, Clone, PartialEq)]
enum Phase {
    Warmup,
    Steady,
    Candidate { shape: Shape, seen: u32 },
    Migrating { id: u64, target: Plan },
    Cooldown { until: u64 },
}

/// The placement policy.
#[derive(Debug, Clone)]
pub struct PlacementPolicy {
    config: PolicyConfig,
    inventory: Inventory,
    cost: CostModel,
    plan: Plan,
    phase: Phase,
    last_step: Option<u64>,
    next_id: u64,
    log: Vec<String>,
    limits: Limits,
}

impl PlacementPolicy {
    /// A policy for `inventory`, starting from the best plan the rooflines predict.
    pub fn new(
        config: PolicyConfig,
        inventory: Inventory,
        setup: CostSetup,
        forecast: ForecastParams,
    ) -> Result<Self, PolicyError> {
        if inventory.is_empty() {
            return Err(PolicyError::Empty);
        }
        let cost = CostModel::new(setup.clone(), forecast);
        let f = cost.forecast(0.0);
        let plan = match choose(
            &config,
            &cost,
            &f,
            &Space::of(&inventory),
            None,
            &Limits::default(),
        ) {
            Some((shape, _)) => assign(&shape, &inventory, None),
            None => {
                let full = Plan::full_colocation(&inventory, &cost.setup().job);
                let err = full
                    .validate(&inventory, &cost.setup().job)
                    .expect_err("search found nothing, so full colocation does not fit");
                return Err(PolicyError::NoPlan(err));
            }
        };
        Self::starting_from(config, inventory, setup, forecast, plan, Limits::default())
    }

    /// A policy for a live executor: it starts from `start` (the plan the executor
    /// runs now, checked against the inventory and the job's memory) and searches only
    /// within `limits`.
    pub fn starting_from(
        config: PolicyConfig,
        inventory: Inventory,
        setup: CostSetup,
        forecast: ForecastParams,
        start: Plan,
        limits: Limits,
    ) -> Result<Self, PolicyError> {
        if inventory.is_empty() {
            return Err(PolicyError::Empty);
        }
        start
            .validate(&inventory, &setup.job)
            .map_err(PolicyError::NoPlan)?;
        Ok(PlacementPolicy {
            config,
            inventory,
            cost: CostModel::new(setup, forecast),
            plan: start,
            phase: Phase::Warmup,
            last_step: None,
            next_id: 1,
            log: Vec::new(),
            limits,
        })
    }

    /// The cost model, to tune what the executor measured (e.g.
    /// [`CostModel::set_start_costs`]).
    pub fn cost_model_mut(&mut self) -> &mut CostModel {
        &mut self.cost
    }

    /// The predicted step of `plan` at the workload forecast `ahead` steps after the
    /// last observed one (e.g. what the plan in force before a migration would take
    /// now: the "no move" figure).
    pub fn predict_plan(&self, plan: &Plan, ahead: f64) -> crate::cost::Prediction {
        self.cost
            .predict(&Shape::of(plan), &self.cost.forecast(ahead))
    }

    /// The plan in force (the target of a migration once it is done).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The cost model, as fitted so far.
    pub fn cost_model(&self) -> &CostModel {
        &self.cost
    }

    /// The inventory as the policy knows it.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// Whether a migration is in flight.
    pub fn migrating(&self) -> bool {
        matches!(self.phase, Phase::Migrating { .. })
    }

    /// What the policy considered and why, one line per search (for reports).
    pub fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.log)
    }

    /// Handles one event.
    pub fn on_event(&mut self, event: Event) -> Vec<Decision> {
        match event {
            Event::Metrics(m) => self.on_metrics(m),
            Event::MigrationDone { id } => {
                if let Phase::Migrating { id: want, target } = &self.phase {
                    if *want == id {
                        self.plan = target.clone();
                        self.phase = Phase::Cooldown {
                            until: self.last_step.unwrap_or(0) + self.config.cooldown_steps,
                        };
                    }
                }
                Vec::new()
            }
            Event::MigrationFailed { id, reason } => {
                if matches!(&self.phase, Phase::Migrating { id: want, .. } if *want == id) {
                    self.log.push(format!("migration {id} failed: {reason}"));
                    self.phase = Phase::Cooldown {
                        until: self.last_step.unwrap_or(0) + self.config.cooldown_steps,
                    };
                }
                Vec::new()
            }
            Event::NodeLeft { node } => {
                let lost = self.inventory.remove_node(&node);
                let used = self.plan.roles_by_group();
                if lost.iter().any(|g| used.contains_key(g)) {
                    self.forced_replan(Reason::NodeLost)
                } else {
                    Vec::new()
                }
            }
            Event::PlanRequested(target) => self.requested(target),
            Event::NodeJoined(info) => {
                match self.inventory.add_node(&info) {
                    Ok(_) => {
                        // New groups are considered at the next search.
                        if matches!(self.phase, Phase::Cooldown { .. } | Phase::Warmup) {
                            self.phase = Phase::Steady;
                        }
                    }
                    Err(e) => self.log.push(format!("node {} not added: {e}", info.name)),
                }
                Vec::new()
            }
        }
    }

    fn on_metrics(&mut self, m: StepMetrics) -> Vec<Decision> {
        self.cost.observe(&m);
        let step = m.step;
        self.last_step = Some(step);
        match &self.phase {
            Phase::Migrating { .. } => return Vec::new(),
            Phase::Warmup if step + 1 < self.config.warmup_steps => return Vec::new(),
            Phase::Cooldown { until } if step < *until => return Vec::new(),
            _ => {}
        }
        if !matches!(self.phase, Phase::Candidate { .. }) {
            self.phase = Phase::Steady;
        }
        if step % self.config.replan_every.max(1) != 0
            && !matches!(self.phase, Phase::Candidate { .. })
        {
            return Vec::new();
        }
        self.consider(step)
    }

    fn consider(&mut self, step: u64) -> Vec<Decision> {
        let f = self.cost.forecast(self.config.lookahead_steps);
        let now = Shape::of(&self.plan);
        let Some((shape, (current, best))) = choose(
            &self.config,
            &self.cost,
            &f,
            &Space::of(&self.inventory),
            Some(&now),
            &self.limits,
        ) else {
            return Vec::new();
        };
        let gain = current - best;
        let target = assign(&shape, &self.inventory, Some(&self.plan));
        let moves = self.plan.moves_to(&target);
        let cost = self.cost.migration_cost(&moves, &shape);
        let changes = !moves.is_empty()
            || target.rollout_batch_cap != self.plan.rollout_batch_cap
            || target.lanes != self.plan.lanes;
        let worth = changes
            && gain >= self.config.min_gain * current
            && gain * self.config.horizon_steps >= self.config.payback * cost;
        self.log.push(format!(
            "step {step}: current {} {current:.3}s, best {} {best:.3}s, {} move(s) costing {cost:.3}s: {} [fit: {}; mean length {:.0}]",
            self.plan.summary(),
            target.summary(),
            moves.len(),
            if worth { "candidate" } else { "stay" },
            self.cost.fit_summary(),
            f.mean_len()
        ));
        if !worth {
            self.phase = Phase::Steady;
            return Vec::new();
        }
        let seen = match &self.phase {
            Phase::Candidate {
                shape: seen_shape,
                seen,
            } if similar(seen_shape, &shape) => seen + 1,
            _ => 1,
        };
        if seen < self.config.confirmations {
            self.phase = Phase::Candidate { shape, seen };
            return Vec::new();
        }
        vec![self.start(Reason::Rebalance, target, moves, (current, best), cost)]
    }

    /// A requested plan: migrated to at once, bypassing the search and its hysteresis
    /// (a cooldown follows as after any move); refused, with the reason logged, while a
    /// migration is in flight or when it does not fit the inventory.
    fn requested(&mut self, target: Plan) -> Vec<Decision> {
        if let Phase::Migrating { id, .. } = &self.phase {
            self.log.push(format!(
                "requested plan {} refused: migration {id} is in flight",
                target.summary()
            ));
            return Vec::new();
        }
        if let Err(e) = target.validate(&self.inventory, &self.cost.setup().job) {
            self.log
                .push(format!("requested plan {} refused: {e}", target.summary()));
            return Vec::new();
        }
        let moves = self.plan.moves_to(&target);
        if moves.is_empty() && target.rollout_batch_cap == self.plan.rollout_batch_cap {
            self.log.push(format!(
                "requested plan {} is the plan in force",
                target.summary()
            ));
            return Vec::new();
        }
        let ahead = self.config.lookahead_steps;
        let predicted = (
            self.predict_plan(&self.plan, ahead).step_s,
            self.predict_plan(&target, ahead).step_s,
        );
        let cost = self.cost.migration_cost(&moves, &Shape::of(&target));
        vec![self.start(Reason::Requested, target, moves, predicted, cost)]
    }

    fn forced_replan(&mut self, reason: Reason) -> Vec<Decision> {
        let f = self.cost.forecast(self.config.lookahead_steps);
        let Some(found) = ranked(
            &self.cost,
            &f,
            &Space::of(&self.inventory),
            &self.limits,
            self.config.lanes,
            1,
        )
        .into_iter()
        .next() else {
            self.log
                .push("no plan fits the remaining groups; waiting for nodes to join".into());
            return Vec::new();
        };
        // The base is the plan in force or the one being migrated to, whichever the
        // groups are closer to; a new migration supersedes one in flight.
        let base = match &self.phase {
            Phase::Migrating { target, .. } => target.clone(),
            _ => self.plan.clone(),
        };
        let target = assign(&found.shape, &self.inventory, Some(&base));
        let moves = base.moves_to(&target);
        let cost = self.cost.migration_cost(&moves, &found.shape);
        let p = found.prediction.step_s;
        vec![self.start(reason, target, moves, (f64::NAN, p), cost)]
    }

    fn start(
        &mut self,
        reason: Reason,
        target: Plan,
        moves: Vec<Move>,
        predicted_s: (f64, f64),
        cost_s: f64,
    ) -> Decision {
        let id = self.next_id;
        self.next_id += 1;
        self.phase = Phase::Migrating {
            id,
            target: target.clone(),
        };
        Decision::Migrate(Migration {
            id,
            reason,
            target,
            moves,
            predicted_s,
            cost_s,
        })
    }
}

impl Placer for PlacementPolicy {
    fn on_event(&mut self, event: Event) -> Vec<Decision> {
        PlacementPolicy::on_event(self, event)
    }

    fn take_log(&mut self) -> Vec<String> {
        PlacementPolicy::take_log(self)
    }
}

/// The shape to run next and the predicted seconds per step of `current` (when
/// given) and of the choice. The analytic search ranks every structure; its best few
/// and the current shape are then simulated for a few steps with the fitted rates when
/// the config asks for it, and the simulation decides.
fn choose(
    config: &PolicyConfig,
    cm: &CostModel,
    f: &crate::workload::Forecast,
    space: &Space,
    current: Option<&Shape>,
    limits: &Limits,
) -> Option<(Shape, (f64, f64))> {
    let k = config.simulate_candidates as usize;
    if k == 0 {
        let all = ranked(cm, f, space, limits, config.lanes, usize::MAX);
        let scored = all.iter().map(|c| (&c.shape, c.prediction.step_s));
        let (shape, t) = prefer_plain(scored, config.min_gain)?;
        let now = current.map_or(f64::NAN, |s| cm.predict(s, f).step_s);
        return Some((shape.clone(), (now, t)));
    }
    // The best `k` shapes without lanes, as if lanes were not allowed, and the best
    // with lanes when the analytic model ranks it above all of them (one more
    // simulation, so the choice stays under a second at 4,096 GPUs).
    let all = ranked(cm, f, space, limits, config.lanes, usize::MAX);
    let plain = all.iter().filter(|c| c.shape.lanes.is_none()).take(k);
    let laned = all.iter().take_while(|c| c.shape.lanes.is_some()).take(1);
    let top: Vec<Shape> = plain
        .chain(laned)
        .map(|c| c.shape.clone())
        .filter(|s| current != Some(s))
        .collect();
    let trend = cm.length_trend();
    let steps = config.simulate_steps;
    let score = |s: &Shape| simulate_shape(cm, f, trend, s, steps);
    let now = current.map_or(f64::NAN, score);
    let scored: Vec<(Shape, f64)> = current
        .map(|s| (s.clone(), now))
        .into_iter()
        .chain(top.into_iter().map(|s| {
            let t = score(&s);
            (s, t)
        }))
        .collect();
    let (shape, t) = prefer_plain(scored.iter().map(|(s, t)| (s, *t)), config.min_gain)?;
    Some((shape.clone(), (now, t)))
}

/// The fastest of `scored` (shapes and their seconds per step, first wins a tie),
/// except that a shape with straggler lanes must beat the fastest without them by
/// `margin`: lanes gain a few percent at best on the workloads simulated so far, and
/// a short simulation's noise is of that order.
fn prefer_plain<'a>(
    scored: impl Iterator<Item = (&'a Shape, f64)>,
    margin: f64,
) -> Option<(&'a Shape, f64)> {
    let mut best: Option<(&Shape, f64)> = None;
    let mut plain: Option<(&Shape, f64)> = None;
    for (s, t) in scored {
        if best.is_none_or(|b| t < b.1) {
            best = Some((s, t));
        }
        if s.lanes.is_none() && plain.is_none_or(|b| t < b.1) {
            plain = Some((s, t));
        }
    }
    match (best, plain) {
        (Some(b), Some(p)) if b.0.lanes.is_some() && p.1 <= b.1 * (1.0 + margin) => Some(p),
        _ => best,
    }
}

/// Whether two shapes have the same pools with group counts within 10% of each other
/// (the search's answer wobbles by a group or two as the metrics do).
fn similar(a: &Shape, b: &Shape) -> bool {
    a.pools.len() == b.pools.len()
        && a.rollout_cap == b.rollout_cap
        && a.lanes.map(|l| l.batch) == b.lanes.map(|l| l.batch)
        && a.pools.iter().zip(&b.pools).all(|(x, y)| {
            x.0 == y.0
                && (f64::from(x.1) - f64::from(y.1)).abs()
                    <= 0.1 * f64::from(x.1.max(y.1)).max(10.0)
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::{Stage, StageObs};
    use crate::profile::{GpuSpec, JobShape, ModelSpec, RewardKind, Role};

    fn setup() -> (Inventory, CostSetup, ForecastParams) {
        let gpu = GpuSpec::preset("h100").unwrap();
        let m = ModelSpec::preset("7b").unwrap();
        let inv = Inventory::uniform(4, 8, 2, gpu.memory_bytes, gpu.host_memory_bytes).unwrap();
        let setup = CostSetup {
            job: JobShape::new(m.clone(), RewardKind::Generative { model: m }, 16384),
            gpu,
            group_devices: 2,
            staleness: 1,
            partial_rollout: None,
        };
        let f = ForecastParams::lognormal(256, 16, 800.0, 1.0, 16384)
            .with_drop(0.1)
            .with_judge(300.0, 0.5, 2048);
        (inv, setup, f)
    }

    /// Metrics of a step whose responses have log-mean `mu`.
    fn metrics(step: u64, mu: f64) -> StepMetrics {
        StepMetrics {
            step,
            step_s: 100.0,
            stages: Vec::<StageObs>::new(),
            response_len_mean: mu.exp(),
            response_log_mean: mu,
            response_log_std: 1.0,
            prompt_len_mean: 512.0,
            judge_log_mean: 300f64.ln(),
            judge_log_std: 0.5,
            groups_filtered: 100,
            groups_dropped: 10,
            ..StepMetrics::default()
        }
    }

    fn rollout_groups(p: &Plan) -> usize {
        p.pool_of(Role::Rollout).unwrap().groups.len()
    }

    #[test]
    fn starts_valid_and_holds_when_nothing_changes() {
        let (inv, setup, f) = setup();
        let mut p =
            PlacementPolicy::new(PolicyConfig::default(), inv.clone(), setup.clone(), f).unwrap();
        p.plan().validate(&inv, &setup.job).unwrap();
        for step in 0..30 {
            assert!(p
                .on_event(Event::Metrics(metrics(step, 800f64.ln())))
                .is_empty());
        }
    }

    #[test]
    fn longer_responses_move_groups_to_the_rollout_after_confirmation() {
        let (inv, setup, f) = setup();
        let mut p =
            PlacementPolicy::new(PolicyConfig::default(), inv.clone(), setup.clone(), f).unwrap();
        let before = rollout_groups(p.plan());
        let mut decided = None;
        let mut searches_before = 0;
        for step in 0..20 {
            // Responses jump to 5x longer: the rollout (and judge) need more groups.
            let d = p.on_event(Event::Metrics(metrics(step, (4000f64).ln())));
            if let Some(Decision::Migrate(m)) = d.into_iter().next() {
                decided = Some((step, m));
                break;
            }
            searches_before += 1;
        }
        let (step, m) = decided.expect("a migration");
        // Not on the first look: the move must be confirmed.
        assert!(step >= 3 && searches_before >= 3, "decided at step {step}");
        assert_eq!(m.reason, Reason::Rebalance);
        assert!(m.predicted_s.1 < m.predicted_s.0);
        m.target.validate(&inv, &setup.job).unwrap();
        assert!(rollout_groups(&m.target) > before);
        assert!(p.migrating());
        // Metrics during the migration decide nothing.
        assert!(p
            .on_event(Event::Metrics(metrics(step + 1, 4000f64.ln())))
            .is_empty());
        p.on_event(Event::MigrationDone { id: m.id });
        assert_eq!(p.plan(), &m.target);
        // Cooldown, then steady again at the new load: no flapping back.
        for s in step + 2..step + 30 {
            assert!(
                p.on_event(Event::Metrics(metrics(s, 4000f64.ln())))
                    .is_empty(),
                "step {s}"
            );
        }
    }

    #[test]
    fn a_wobbling_load_does_not_flap() {
        let (inv, setup, f) = setup();
        let mut p = PlacementPolicy::new(PolicyConfig::default(), inv, setup, f).unwrap();
        let mut migrations = Vec::new();
        for step in 0..60u64 {
            // ±4% around the initial length, alternating every step.
            let mu = 800f64.ln() + if step % 2 == 0 { 0.04 } else { -0.04 };
            for d in p.on_event(Event::Metrics(metrics(step, mu))) {
                let Decision::Migrate(m) = d;
                migrations.push((step, m.target.summary(), m.predicted_s));
                p.on_event(Event::MigrationDone { id: m.id });
            }
        }
        assert!(
            migrations.len() <= 1,
            "migrations on a steady load: {migrations:?}"
        );
    }

    #[test]
    fn a_requested_plan_migrates_at_once_unless_one_is_in_flight() {
        let (inv, setup, f) = setup();
        let mut p = PlacementPolicy::new(PolicyConfig::default(), inv, setup.clone(), f).unwrap();
        let d = p.on_event(Event::NodeLeft {
            node: "node-1".into(),
        });
        let Some(Decision::Migrate(lost)) = d.into_iter().next() else {
            panic!("no decision")
        };
        // In flight: a request is refused, and says why.
        let back = p.plan().clone();
        assert!(p.on_event(Event::PlanRequested(back.clone())).is_empty());
        assert!(
            p.take_log().iter().any(|l| l.contains("in flight")),
            "{:?}",
            p.take_log()
        );
        p.on_event(Event::MigrationDone { id: lost.id });
        // The plan in force asks for nothing.
        assert!(p
            .on_event(Event::PlanRequested(lost.target.clone()))
            .is_empty());
        // A plan on a lost node's groups does not fit the inventory.
        assert!(p.on_event(Event::PlanRequested(back)).is_empty());
        assert!(p.take_log().iter().any(|l| l.contains("refused")));
        // Another plan of the groups left: migrated to at once, whatever the cooldown.
        let mut other = lost.target.clone();
        let (a, b) = (other.pools[0].groups.remove(0), other.pools.len() - 1);
        other.pools[b].groups.push(a);
        other.validate(p.inventory(), &setup.job).unwrap();
        let Some(Decision::Migrate(m)) = p
            .on_event(Event::PlanRequested(other.clone()))
            .into_iter()
            .next()
        else {
            panic!(
                "a requested plan that fits was not migrated to: {:?}",
                p.take_log()
            )
        };
        assert_eq!((m.reason, &m.target), (Reason::Requested, &other));
        assert!(!m.moves.is_empty() && p.migrating());
        p.on_event(Event::MigrationDone { id: m.id });
        assert_eq!(p.plan(), &other);
    }

    #[test]
    fn losing_a_node_replans_at_once() {
        let (inv, setup, f) = setup();
        let mut p = PlacementPolicy::new(PolicyConfig::default(), inv, setup.clone(), f).unwrap();
        let d = p.on_event(Event::NodeLeft {
            node: "node-1".into(),
        });
        let Some(Decision::Migrate(m)) = d.into_iter().next() else {
            panic!("no decision")
        };
        assert_eq!(m.reason, Reason::NodeLost);
        assert_eq!(m.target.roles_by_group().len(), 12);
        m.target.validate(p.inventory(), &setup.job).unwrap();
        // A failed migration leaves the plan as it was.
        let old = p.plan().clone();
        p.on_event(Event::MigrationFailed {
            id: m.id,
            reason: "rollout did not start".into(),
        });
        assert_eq!(p.plan(), &old);
        assert!(!p.migrating());
        // Unknown ids are ignored.
        p.on_event(Event::MigrationDone { id: 999 });
        assert_eq!(p.plan(), &old);
        let _ = Stage::Gen;
    }

    #[test]
    fn a_live_executors_limits_bound_the_search() {
        use crate::inventory::GroupId;
        use crate::plan::Pool;
        let gpu = GpuSpec::preset("h100").unwrap();
        let m = ModelSpec::preset("7b").unwrap();
        let inv = Inventory::uniform(1, 8, 2, gpu.memory_bytes, gpu.host_memory_bytes).unwrap();
        let mut job = JobShape::new(m, RewardKind::Rule, 16384);
        job.reference = false;
        let setup = CostSetup {
            job,
            gpu,
            group_devices: 2,
            staleness: 0,
            partial_rollout: None,
        };
        let (rollout, policy) = (RoleSet::of(&[Role::Rollout]), RoleSet::of(&[Role::Policy]));
        let ids: Vec<GroupId> = inv.groups().map(|g| g.id).collect();
        let start = Plan {
            pools: vec![
                Pool {
                    roles: rollout,
                    groups: ids[..1].to_vec(),
                },
                Pool {
                    roles: policy,
                    groups: ids[1..].to_vec(),
                },
            ],
            rollout_batch_cap: Some(64),
            lanes: None,
        };
        let limits = Limits {
            structures: Some(vec![vec![rollout, policy]]),
            rollout_cap: Some(64),
        };
        let config = PolicyConfig {
            simulate_candidates: 0,
            ..PolicyConfig::default()
        };
        let f = ForecastParams::lognormal(256, 16, 200.0, 0.5, 16384);
        let mut p = PlacementPolicy::starting_from(
            config,
            inv.clone(),
            setup.clone(),
            f,
            start.clone(),
            limits.clone(),
        )
        .unwrap();
        assert_eq!(p.plan(), &start);
        let mut decided = None;
        for step in 0..20 {
            // No judge in this job.
            let m = StepMetrics {
                judge_log_mean: 0.0,
                judge_log_std: 0.0,
                ..metrics(step, 4000f64.ln())
            };
            if let Some(Decision::Migrate(m)) = p.on_event(Event::Metrics(m)).into_iter().next() {
                decided = Some(m);
                break;
            }
        }
        let m = decided.expect("long responses move groups to the rollout");
        let pools: Vec<RoleSet> = m.target.pools.iter().map(|p| p.roles).collect();
        assert_eq!(pools, vec![rollout, policy], "{}", m.target.summary());
        assert_eq!(m.target.rollout_batch_cap, Some(64));
        assert!(m.target.pool_of(Role::Rollout).unwrap().groups.len() > 1);
        // A start plan that does not cover the job is refused.
        let bad = Plan {
            pools: vec![start.pools[0].clone()],
            rollout_batch_cap: None,
            lanes: None,
        };
        assert!(matches!(
            PlacementPolicy::starting_from(config, inv, setup, f, bad, limits),
            Err(PolicyError::NoPlan(PlanError::Unplaced(Role::Policy)))
        ));
    }

    #[test]
    fn lanes_are_searched_only_without_a_live_executors_limits() {
        let (inv, setup, f) = setup();
        let cm = CostModel::new(setup.clone(), f);
        let fc = cm.forecast(0.0);
        let space = Space::of(&inv);
        let ls = Some(LaneSearch {
            batch: 4,
            threshold: Some(2000),
        });
        let free = ranked(&cm, &fc, &space, &Limits::default(), ls, usize::MAX);
        assert!(free.iter().any(|c| c.shape.lanes.is_some()));
        let none = ranked(&cm, &fc, &space, &Limits::default(), None, usize::MAX);
        assert!(none.iter().all(|c| c.shape.lanes.is_none()));
        let limits = Limits {
            structures: Some(vec![free[0].shape.pools.iter().map(|p| p.0).collect()]),
            rollout_cap: None,
        };
        let live = ranked(&cm, &fc, &space, &limits, ls, usize::MAX);
        assert!(!live.is_empty());
        assert!(live.iter().all(|c| c.shape.lanes.is_none()));
        // Whatever it starts from, with or without lanes, the plan is valid.
        let config = PolicyConfig {
            lanes: ls,
            ..PolicyConfig::default()
        };
        let p = PlacementPolicy::new(config, inv.clone(), setup.clone(), f).unwrap();
        p.plan().validate(&inv, &setup.job).unwrap();
    }

    #[test]
    fn lanes_must_beat_the_best_plan_without_them_by_the_margin() {
        let plain = Shape {
            pools: vec![(RoleSet::of(&[Role::Rollout]), 8)],
            rollout_cap: None,
            lanes: None,
        };
        let laned = Shape {
            lanes: Some(crate::plan::Lanes {
                groups: 1,
                batch: 4,
                threshold: 4096,
            }),
            ..plain.clone()
        };
        let pick = |t_plain: f64, t_laned: f64| {
            let v = [(laned.clone(), t_laned), (plain.clone(), t_plain)];
            prefer_plain(v.iter().map(|(s, t)| (s, *t)), 0.08).map(|(s, t)| (s.lanes.is_some(), t))
        };
        assert_eq!(
            pick(100.0, 95.0),
            Some((false, 100.0)),
            "5% is within the margin"
        );
        assert_eq!(pick(100.0, 90.0), Some((true, 90.0)), "10% is not");
        assert_eq!(pick(90.0, 95.0), Some((false, 90.0)));
        let only = [(laned.clone(), 50.0)];
        assert_eq!(
            prefer_plain(only.iter().map(|(s, t)| (s, *t)), 0.08).map(|x| x.1),
            Some(50.0),
            "with nothing else to take, lanes it is"
        );
    }
}
