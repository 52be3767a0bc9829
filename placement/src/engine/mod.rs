//! The discrete-event engine: groups decoding in continuous batches, pools running
//! forward and training passes, a controller that issues prompt groups, filters them
//! (dynamic sampling), trains and syncs weights, and migrations carried out group by
//! group. A placer, when there is one, is driven exactly as the live actor drives the
//! policy: a step's metrics in, decisions out, the outcome of each migration back.
//!
//! The engine is split by concern, each file an `impl Sim` block: `issue` (prompt
//! groups, their responses, filtering and accepting), `train` (batches, training,
//! weight sync, the step's metrics), `decode` (continuous batching on a group),
//! `lanes` (straggler lanes), `pools` (roles sharing groups, their passes) and
//! `migrate` (moving groups between pools); [`World`] and [`RunResult`] are in `world`.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::cost::{Stage, StageObs, StepMetrics};
use crate::events::{Decision, Event, Placer};
use crate::plan::{Lanes, Plan};
use crate::profile::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, RewardKind, Role, RoleSet,
    Sharding,
};
use crate::sharded::{RankWork, ShardedStep};
use crate::workload::{BeyondBound, PartialRollout, Resume};

mod decode;
mod issue;
mod lanes;
mod migrate;
mod pools;
#[cfg(test)]
mod tests;
mod train;
mod world;

pub use world::{Rates, RunResult, World};

/// Seconds the real hardware takes to start a decoding engine on a group.
const TRUE_START_DECODER_S: f64 = 12.0;
/// Seconds to start any other role.
const TRUE_START_OTHER_S: f64 = 4.0;
/// Fixed seconds of an offload/reload switch besides the copies.
const TRUE_SWITCH_FIXED_S: f64 = 0.7;
/// Fixed seconds of a weight update in the decoding engines.
const TRUE_SYNC_FIXED_S: f64 = 0.8;

/// How a response taken off its group continues elsewhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Carry {
    /// Its KV cache goes to host memory and comes back over PCIe.
    HostKv,
    /// Its KV cache goes to another group over the interconnect.
    NetKv,
    /// Its KV cache is dropped; prompt and tokens so far are prefilled again.
    Reprefill,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Gen,
    Judge,
}

#[derive(Debug, Clone)]
struct Seq {
    step: u32,
    pg: u32,
    kind: Kind,
    /// Context before the tokens still to generate: the prompt, plus the tokens of
    /// earlier segments once a partial rollout paused it.
    ctx0: u32,
    /// Tokens still to generate.
    len: u32,
    judge_len: u32,
    on: Option<usize>,
    start_iter: f64,
    alive: bool,
    order: u64,
    gen: u32,
    /// Tokens generated in earlier segments.
    done: u32,
    /// Tokens to prefill when admitted: the prompt, or the prompt and the tokens so
    /// far when it resumes without its KV cache; 0 when the cache is restored.
    prefill: u32,
    /// Seconds to copy its KV cache back from host memory when admitted.
    restore_s: f64,
    /// The weight version its generation started with.
    born: Option<u32>,
    /// Parked at a cutoff until the next weights are in.
    paused: bool,
    /// Its heap entry marks the lane threshold, not its end.
    checkpoint: bool,
}

impl Seq {
    fn new(step: u32, pg: u32, kind: Kind, ctx0: u32, len: u32, judge_len: u32) -> Seq {
        Seq {
            step,
            pg,
            kind,
            ctx0,
            len,
            judge_len,
            on: None,
            start_iter: 0.0,
            alive: true,
            order: 0,
            gen: 0,
            done: 0,
            prefill: ctx0,
            restore_s: 0.0,
            born: None,
            paused: false,
            checkpoint: false,
        }
    }

    /// The whole response (or verdict) length.
    fn total_len(&self) -> u32 {
        self.done + self.len
    }
}

/// A time or iteration count ordered by `total_cmp`, for the event and batch heaps.
#[derive(Debug, Clone, Copy, PartialEq)]
struct OrdF64(f64);
impl Eq for OrdF64 {}
impl PartialOrd for OrdF64 {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for OrdF64 {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.0.total_cmp(&other.0)
    }
}

#[derive(Debug, Default)]
struct Window {
    group_s: f64,
    iterations: f64,
    tokens: f64,
    context: f64,
    prefill: f64,
}

struct DecodeGroup {
    kind: Option<Kind>,
    coeffs: DecodeCoeffs,
    heap: BinaryHeap<Reverse<(OrdF64, usize, u32)>>,
    hungry: [bool; 2],
    b: u32,
    p_sum: f64,
    s_sum: f64,
    iter: f64,
    last: f64,
    debt: f64,
    paused_until: f64,
    stamp: u64,
    pool: Option<usize>,
    compute_s: f64,
    overhead_s: f64,
    /// A straggler lane of the rollout pool.
    lane: bool,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum PoolPhase {
    Idle,
    Decode(Kind),
    Busy { until: f64, what: Busy },
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Busy {
    Task(Stage),
    Switch,
    Sync,
}

struct PoolState {
    roles: RoleSet,
    members: Vec<usize>,
    phase: PoolPhase,
    loaded: Option<Role>,
    stamp: u64,
    reshard: bool,
    running: Vec<Task>,
}

#[derive(Debug, Clone, Copy)]
struct Task {
    stage: Stage,
    step: u32,
    tokens: f64,
    /// The prompt group, for scalar scoring (which rewards a whole group).
    pg: u32,
}

#[derive(Debug, Default, Clone)]
struct PgState {
    gen_left: u32,
    remaining: u32,
    keep: bool,
    tokens: f64,
    lengths: Vec<u32>,
    /// The oldest weight version any of its responses started with.
    born_min: Option<u32>,
    /// Tokens of its responses generated so far (what regenerating it throws away).
    gen_tokens: f64,
}

/// With partial rollouts, a prompt group accepted into the batch and not trained yet.
#[derive(Debug, Clone, Copy)]
struct Accepted {
    tokens: f64,
    scoring_left: u32,
    born_min: Option<u32>,
    /// The step whose batch it joined at that step's cutoff, if one did.
    in_batch: Option<u32>,
}

/// What partial rollouts did over a run.
#[derive(Debug, Default, Clone, Copy)]
struct PartialStats {
    carried_groups: u64,
    stale_tokens: f64,
    reprefill_tokens: f64,
    max_lag: u32,
}

#[derive(Debug, Default)]
struct StepState {
    opened: bool,
    issued: u32,
    filtered: u32,
    kept: u32,
    full: bool,
    scoring_left: u32,
    kept_tokens: f64,
    train_left: u32,
    pgs: HashMap<u32, PgState>,
    /// Count, sum and sum of squares of ln(length) of the step's generated responses
    /// and of its judge outputs (what the step reports, like the live metrics do).
    lens: [(f64, f64, f64); 2],
    /// Groups rewarded out of issue order, waiting for the ones before them.
    done: BTreeMap<u32, PgState>,
    /// The first group not yet accepted or dropped, in issue order.
    next: u32,
    /// Tokens the step trains on (prompt + response of its batch).
    train_tokens: f64,
    /// Without partial rollouts: the groups it accepted (what it trains).
    kept_pgs: Vec<u32>,
    /// With partial rollouts: groups of this step accepted but not yet in a batch.
    accepted_open: u32,
    /// With partial rollouts: its batch is cut off (later groups go to later steps).
    closed: bool,
    /// With partial rollouts: groups of its batch whose scoring passes still run.
    batch_left: u32,
    /// With partial rollouts: the groups of its batch.
    batch: Vec<(u32, u32)>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    GroupWake { g: usize, stamp: u64 },
    PoolWake { p: usize, stamp: u64 },
    SyncDone { step: u32 },
    GroupJoin { g: usize, p: usize, migration: u64 },
}

/// A simulation in progress.
pub struct Sim<'w> {
    w: &'w World,
    /// Versions a trained sample's generation may have started before the weights it
    /// trains.
    staleness: u32,
    /// Versions ahead of the weights a step's generation may start: the staleness,
    /// less what partial rollouts keep for carrying.
    lookahead: u32,
    partial: Option<PartialRollout>,
    /// With partial rollouts: each step's number of leading prompt groups that make
    /// its batch (the first `prompts_per_step` kept, as the lower bound counts them),
    /// so that every placement trains the same groups whichever finish first.
    batch_end: Vec<u32>,
    /// With partial rollouts: accepted groups not trained yet, by (step, group).
    accepted: BTreeMap<(u32, u32), Accepted>,
    /// Responses paused at a cutoff (slot and its generation), requeued when the next
    /// weights are in.
    paused: Vec<(usize, u32)>,
    trained_groups: Vec<(u32, u32, u32)>,
    partial_stats: PartialStats,
    now: f64,
    events: BinaryHeap<Reverse<(OrdF64, u64, Ev)>>,
    counter: u64,
    seqs: Vec<Seq>,
    free: Vec<usize>,
    queues: [BTreeMap<(u32, u64), usize>; 2],
    hungry: [Vec<usize>; 2],
    tasks: Vec<std::collections::VecDeque<Task>>,
    groups: Vec<DecodeGroup>,
    pools: Vec<PoolState>,
    role_pool: HashMap<Role, usize>,
    steps: Vec<StepState>,
    version: u32,
    trained: u32,
    drop_est: f64,
    coeffs: [DecodeCoeffs; 2],
    slots: [Vec<u32>; 2],
    s_per_token: HashMap<Stage, f64>,
    windows: HashMap<Stage, Window>,
    filtered_window: (u64, u64),
    switches_window: (u32, f64),
    sync_window: Option<(f64, bool)>,
    last_step_end: f64,
    step_s: Vec<f64>,
    generated_tokens: f64,
    wasted_tokens: f64,
    trained_tokens: f64,
    /// What places the roles, when the plan may change during the run.
    placer: Option<&'w mut dyn Placer>,
    migration: Option<(u64, usize)>,
    migrations: u32,
    plans: Vec<(u64, String)>,
    step_done: u32,
    rollout_cap: Option<u32>,
    /// Straggler lanes of the plan in force.
    lanes: Option<Lanes>,
    /// Responses on ordinary rollout groups past the lane threshold, waiting for room
    /// in a lane, oldest step first: (step, order) → (slot, generation).
    lane_wait: BTreeMap<(u32, u64), (usize, u32)>,
    lane_moves: u64,
    lane_transfer_s: f64,
    totals: BTreeMap<Stage, (f64, f64, f64)>,
}

impl<'w> Sim<'w> {
    /// A simulation of `world` on `plan`, with samples allowed to lag the weights by
    /// `staleness` versions; the plan stays as it is unless [`Sim::driven_by`] a
    /// placer. With partial
    /// rollouts (`world.workload.partial_rollout`) `reserve` of those versions are
    /// kept for carrying unfinished responses, so generation starts fewer versions
    /// ahead.
    pub fn new(w: &'w World, plan: &Plan, staleness: u32) -> Sim<'w> {
        let gen_model = &w.job.policy;
        let coeffs_gen = DecodeCoeffs::roofline(gen_model, &w.gpu, w.group_devices, &w.truth);
        let judge_model = match &w.job.reward {
            RewardKind::Generative { model } => model.clone(),
            _ => gen_model.clone(),
        };
        let coeffs_judge = DecodeCoeffs::roofline(&judge_model, &w.gpu, w.group_devices, &w.truth);
        let steps = w.workload.steps;
        let wl = &w.workload;
        let slots_gen = (0..steps)
            .map(|k| {
                let f = wl.forecast_at(k);
                decode_slots(
                    gen_model,
                    &w.gpu,
                    w.group_devices,
                    f.params.prompt_len + f.mean_len(),
                )
                .max(1)
            })
            .collect();
        let slots_judge = (0..steps)
            .map(|k| {
                let f = wl.forecast_at(k);
                let ctx =
                    f.params.prompt_len + f.mean_len() + f.params.judge_prompt + f.mean_judge_len();
                decode_slots(&judge_model, &w.gpu, w.group_devices, ctx).max(1)
            })
            .collect();
        let mut s_per_token = HashMap::new();
        for s in Stage::of_job(&w.job) {
            if let Some(m) = w.job.model(s.role()) {
                let v = match s {
                    Stage::TrainActor | Stage::TrainCritic => {
                        train_s_per_token(m, &w.gpu, &w.truth)
                    }
                    _ => forward_s_per_token(m, &w.gpu, &w.truth),
                };
                s_per_token.insert(s, v);
            }
        }
        let (coeffs_gen, slots_gen, coeffs_judge) = match &w.rates {
            Some(r) => {
                for (stage, v) in &r.s_per_token {
                    s_per_token.insert(*stage, *v);
                }
                let slots = if r.slots > 0 {
                    vec![r.slots; steps as usize]
                } else {
                    slots_gen
                };
                (r.gen, slots, r.judge.unwrap_or(coeffs_judge))
            }
            None => (coeffs_gen, slots_gen, coeffs_judge),
        };
        let groups = (0..w.groups)
            .map(|_| DecodeGroup {
                kind: None,
                coeffs: coeffs_gen,
                heap: BinaryHeap::new(),
                hungry: [false; 2],
                b: 0,
                p_sum: 0.0,
                s_sum: 0.0,
                iter: 0.0,
                last: 0.0,
                debt: 0.0,
                paused_until: 0.0,
                stamp: 0,
                pool: None,
                compute_s: 0.0,
                overhead_s: 0.0,
                lane: false,
            })
            .collect();
        let partial = w.workload.partial_rollout;
        let lookahead = match partial {
            Some(pr) => staleness.saturating_sub(pr.reserve),
            None => staleness,
        };
        let batch_end = match partial {
            Some(_) => (0..steps).map(|k| wl.batch_groups(k)).collect(),
            None => Vec::new(),
        };
        let mut sim = Sim {
            w,
            staleness,
            lookahead,
            partial,
            batch_end,
            accepted: BTreeMap::new(),
            paused: Vec::new(),
            trained_groups: Vec::new(),
            partial_stats: PartialStats::default(),
            now: 0.0,
            events: BinaryHeap::new(),
            counter: 0,
            seqs: Vec::new(),
            free: Vec::new(),
            queues: [BTreeMap::new(), BTreeMap::new()],
            hungry: [Vec::new(), Vec::new()],
            tasks: vec![std::collections::VecDeque::new(); Stage::ALL.len()],
            groups,
            pools: Vec::new(),
            role_pool: HashMap::new(),
            steps: (0..steps).map(|_| StepState::default()).collect(),
            version: 0,
            trained: 0,
            drop_est: 0.0,
            coeffs: [coeffs_gen, coeffs_judge],
            slots: [slots_gen, slots_judge],
            s_per_token,
            windows: HashMap::new(),
            filtered_window: (0, 0),
            switches_window: (0, 0.0),
            sync_window: None,
            last_step_end: 0.0,
            step_s: Vec::new(),
            generated_tokens: 0.0,
            wasted_tokens: 0.0,
            trained_tokens: 0.0,
            placer: None,
            migration: None,
            migrations: 0,
            plans: vec![(0, plan.summary())],
            step_done: 0,
            rollout_cap: plan.rollout_batch_cap,
            lanes: None,
            lane_wait: BTreeMap::new(),
            lane_moves: 0,
            lane_transfer_s: 0.0,
            totals: BTreeMap::new(),
        };
        sim.set_lanes(plan);
        for pool in &plan.pools {
            let p = sim.pools.len();
            for r in pool.roles.iter() {
                sim.role_pool.insert(r, p);
            }
            let members: Vec<usize> = pool.groups.iter().map(|g| g.0 as usize).collect();
            for &g in &members {
                sim.groups[g].pool = Some(p);
            }
            sim.pools.push(PoolState {
                roles: pool.roles,
                members,
                phase: PoolPhase::Idle,
                loaded: pool.roles.iter().next(),
                stamp: 0,
                reshard: false,
                running: Vec::new(),
            });
        }
        sim
    }

    /// Starts each step's generation on the newest weights only (as synchronous
    /// colocation does), keeping the whole staleness bound for partial rollouts to
    /// carry responses.
    pub fn synchronous(mut self) -> Self {
        self.lookahead = 0;
        self
    }

    fn at(&mut self, t: f64, ev: Ev) {
        self.counter += 1;
        self.events.push(Reverse((OrdF64(t), self.counter, ev)));
    }

    /// Lets `placer` change the plan: it gets each step's metrics and the outcome of
    /// each migration, exactly as the live actor feeds the policy, and the run carries
    /// out what it decides. The caller keeps it, with whatever it learnt, afterwards.
    pub fn driven_by(mut self, placer: &'w mut dyn Placer) -> Self {
        self.placer = Some(placer);
        self
    }

    /// Runs to the end of the workload.
    pub fn run(mut self) -> RunResult {
        self.open_steps();
        self.kick_all();
        while self.step_done < self.w.workload.steps && self.next_event() {}
        let log = self
            .placer
            .as_mut()
            .map(|p| p.take_log())
            .unwrap_or_default();
        self.finish(log)
    }

    /// Handles the next event; false when there is none.
    fn next_event(&mut self) -> bool {
        let Some(Reverse((OrdF64(t), _, ev))) = self.events.pop() else {
            return false;
        };
        self.now = t;
        match ev {
            Ev::GroupWake { g, stamp } => {
                if self.groups[g].stamp == stamp {
                    self.group_wake(g);
                }
            }
            Ev::PoolWake { p, stamp } => {
                if self.pools[p].stamp == stamp {
                    self.pool_done(p);
                }
            }
            Ev::SyncDone { step } => self.sync_done(step),
            Ev::GroupJoin { g, p, migration } => self.group_join(g, p, migration),
        }
        true
    }

    fn finish(self, log: Vec<String>) -> RunResult {
        let makespan = self.last_step_end;
        let device_s = makespan * f64::from(self.w.groups * self.w.group_devices);
        let d = f64::from(self.w.group_devices);
        let compute: f64 = self
            .groups
            .iter()
            .map(|g| g.compute_s.min(makespan))
            .sum::<f64>()
            * d;
        let overhead: f64 = self.groups.iter().map(|g| g.overhead_s).sum::<f64>() * d;
        let compute_frac = (compute / device_s).min(1.0);
        let overhead_frac = (overhead / device_s).min(1.0 - compute_frac);
        RunResult {
            makespan_s: makespan,
            step_s: self.step_s,
            compute_frac,
            overhead_frac,
            idle_frac: (1.0 - compute_frac - overhead_frac).max(0.0),
            wasted_frac: self.wasted_tokens / self.generated_tokens.max(1.0),
            generated_tokens: self.generated_tokens,
            trained_tokens: self.trained_tokens,
            migrations: self.migrations,
            plans: self.plans,
            log,
            stages: self
                .totals
                .iter()
                .map(|(s, t)| (*s, t.0, (t.2 > 0.0).then(|| t.1 / t.2)))
                .collect(),
            carried_frac: self.partial_stats.carried_groups as f64
                / self.trained_groups.len().max(1) as f64,
            stale_frac: self.partial_stats.stale_tokens / self.generated_tokens.max(1.0),
            reprefill_frac: self.partial_stats.reprefill_tokens / self.generated_tokens.max(1.0),
            max_lag: self.partial_stats.max_lag,
            trained_groups: self.trained_groups,
            lane_moves: self.lane_moves,
            lane_transfer_s: self.lane_transfer_s,
        }
    }
}
