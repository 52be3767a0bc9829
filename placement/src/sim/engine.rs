//! The discrete-event engine: groups decoding in continuous batches, pools running
//! forward and training passes, a controller that issues prompt groups, filters them
//! (dynamic sampling), trains and syncs weights, and migrations carried out group by
//! group. The placement policy, when there is one, is driven exactly as the live actor
//! drives it: a step's metrics in, decisions out, the outcome of each migration back.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap};

use crate::cost::{Stage, StageObs, StepMetrics};
use crate::plan::{Lanes, Plan};
use crate::policy::{Decision, Event, PlacementPolicy};
use crate::profile::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, Efficiency, GpuSpec,
    JobShape, RewardKind, Role, RoleSet, Sharding,
};
use crate::workload::{BeyondBound, PartialRollout, Resume, WorkloadSpec};

/// Seconds the real hardware takes to start a decoding engine on a group.
const TRUE_START_DECODER_S: f64 = 12.0;
/// Seconds to start any other role.
const TRUE_START_OTHER_S: f64 = 4.0;
/// Fixed seconds of an offload/reload switch besides the copies.
const TRUE_SWITCH_FIXED_S: f64 = 0.7;
/// Fixed seconds of a weight update in the decoding engines.
const TRUE_SYNC_FIXED_S: f64 = 0.8;

/// What a simulation run is: the hardware, the job, the workload.
#[derive(Debug, Clone)]
pub struct World {
    /// The accelerator.
    pub gpu: GpuSpec,
    /// Efficiencies the hardware really reaches.
    pub truth: Efficiency,
    /// The job.
    pub job: JobShape,
    /// The workload.
    pub workload: WorkloadSpec,
    /// Devices per group.
    pub group_devices: u32,
    /// Groups in the cluster.
    pub groups: u32,
    /// Measured rates replacing the rooflines (a run calibrated from its metrics).
    pub rates: Option<crate::calibrate::Rates>,
}

/// What one run measured.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// Seconds from start to the last step's weights published.
    pub makespan_s: f64,
    /// Each step's duration (time between consecutive steps finishing), seconds.
    pub step_s: Vec<f64>,
    /// Fraction of device-time spent computing (decoding, prefill, passes).
    pub compute_frac: f64,
    /// Tokens generated, responses and verdicts, including those thrown away.
    pub generated_tokens: f64,
    /// Fraction spent on overhead: offload/reload, weight sync, migrations.
    pub overhead_frac: f64,
    /// Fraction with nothing to do.
    pub idle_frac: f64,
    /// Generated tokens thrown away (aborted sequences, surplus groups), fraction of all.
    pub wasted_frac: f64,
    /// Tokens trained on (prompt + response of kept samples), all steps.
    pub trained_tokens: f64,
    /// Migrations carried out.
    pub migrations: u32,
    /// The plans in force: (step at which it was decided, summary).
    pub plans: Vec<(u64, String)>,
    /// The policy's search log, when there was a policy.
    pub log: Vec<String>,
    /// Per stage over the run: group-seconds, and for decoding stages the mean batch
    /// (tokens per iteration).
    pub stages: Vec<(Stage, f64, Option<f64>)>,
    /// Prompt groups trained by a later step than the one they were issued for
    /// (carried by partial rollouts), fraction of the groups trained.
    pub carried_frac: f64,
    /// Generated tokens thrown away because their response would have trained beyond
    /// the staleness bound (generated again), fraction of all generated.
    pub stale_frac: f64,
    /// Tokens prefilled again by responses that resumed without their KV cache,
    /// fraction of all generated.
    pub reprefill_frac: f64,
    /// The most versions a trained group's oldest response lagged the weights it
    /// trained.
    pub max_lag: u32,
    /// Every group trained: (the step it was issued for, its index, the step that
    /// trained it).
    pub trained_groups: Vec<(u32, u32, u32)>,
    /// Responses moved to a straggler lane.
    pub lane_moves: u64,
    /// Group-seconds the lanes spent bringing moved responses' KV caches over the
    /// interconnect (or prefilling them again).
    pub lane_transfer_s: f64,
}

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
    policy: Option<PlacementPolicy>,
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
    /// `staleness` versions, optionally driven by a placement policy. With partial
    /// rollouts (`world.workload.partial_rollout`) `reserve` of those versions are
    /// kept for carrying unfinished responses, so generation starts fewer versions
    /// ahead.
    pub fn new(
        w: &'w World,
        plan: &Plan,
        staleness: u32,
        policy: Option<PlacementPolicy>,
    ) -> Sim<'w> {
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
            policy,
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

    /// Runs to the end of the workload.
    pub fn run(self) -> RunResult {
        self.run_keep().0
    }

    /// Runs to the end of the workload and hands back the policy as it ended (with its
    /// fitted cost model).
    pub fn run_keep(mut self) -> (RunResult, Option<PlacementPolicy>) {
        self.open_steps();
        self.kick_all();
        while self.step_done < self.w.workload.steps && self.next_event() {}
        let mut policy = self.policy.take();
        let log = policy.as_mut().map(|p| p.take_log()).unwrap_or_default();
        (self.finish(log), policy)
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

    // ---- the controller -------------------------------------------------------

    fn target(&self) -> u32 {
        self.w.workload.prompts_per_step
    }

    fn open_steps(&mut self) {
        let last = (self.version + self.lookahead).min(self.w.workload.steps - 1);
        for k in 0..=last {
            if !self.steps[k as usize].opened {
                self.steps[k as usize].opened = true;
                let want = (f64::from(self.target()) / (1.0 - self.drop_est)).ceil() as u32;
                self.issue(k, want);
            }
        }
    }

    fn issue(&mut self, step: u32, count: u32) {
        let n = self.w.workload.samples_per_prompt;
        for _ in 0..count {
            let st = &mut self.steps[step as usize];
            let i = st.issued;
            st.issued += 1;
            let pg = self.w.workload.group(step, i);
            let tokens = pg
                .lengths
                .iter()
                .map(|l| f64::from(pg.prompt_len + l))
                .sum();
            self.steps[step as usize].pgs.insert(
                i,
                PgState {
                    gen_left: n,
                    remaining: n,
                    keep: pg.keep,
                    tokens,
                    lengths: pg.lengths.clone(),
                    born_min: None,
                    gen_tokens: 0.0,
                },
            );
            self.push_responses(step, i, &pg);
        }
    }

    /// Queues a prompt group's responses; returns their slots.
    fn push_responses(
        &mut self,
        step: u32,
        index: u32,
        pg: &crate::workload::PromptGroup,
    ) -> Vec<usize> {
        pg.lengths
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let judge_len = pg.judge.get(s).copied().unwrap_or(0);
                self.push_seq(Seq::new(
                    step,
                    index,
                    Kind::Gen,
                    pg.prompt_len,
                    len,
                    judge_len,
                ))
            })
            .collect()
    }

    /// Queues a sequence; returns its slot.
    fn push_seq(&mut self, mut s: Seq) -> usize {
        self.counter += 1;
        s.order = self.counter;
        let q = s.kind as usize;
        let key = (s.step, s.order);
        let idx = match self.free.pop() {
            Some(i) => {
                s.gen = self.seqs[i].gen.wrapping_add(1);
                self.seqs[i] = s;
                i
            }
            None => {
                self.seqs.push(s);
                self.seqs.len() - 1
            }
        };
        self.queues[q].insert(key, idx);
        idx
    }

    /// Returns a finished sequence's slot to the slab; its generation changes, so heap
    /// entries that still name it are recognised as stale.
    fn release(&mut self, idx: usize) {
        let s = &mut self.seqs[idx];
        s.alive = false;
        s.on = None;
        s.paused = false;
        s.gen = s.gen.wrapping_add(1);
        self.free.push(idx);
    }

    fn requeue(&mut self, idx: usize) {
        let s = &mut self.seqs[idx];
        s.on = None;
        s.paused = false;
        let key = (s.step, s.order);
        self.queues[s.kind as usize].insert(key, idx);
    }

    /// Takes an in-flight sequence off group `g` (advanced to now) keeping what it
    /// generated, as a partial rollout pauses it. It resumes from its KV cache copied
    /// to host memory and back (`keep_kv`), or by prefilling its prompt and tokens
    /// again. The caller queues it again or parks it in `paused`.
    fn suspend(&mut self, g: usize, idx: usize, keep_kv: bool) {
        let carry = if keep_kv {
            Carry::HostKv
        } else {
            Carry::Reprefill
        };
        self.take_off(g, idx, carry, 0.0);
    }

    /// Takes an in-flight sequence off group `g` (advanced to now) keeping what it
    /// generated; `carry` says what its next admission costs. `slack` (iterations)
    /// keeps a response stopped exactly at a token boundary (a lane threshold) from
    /// losing that token to rounding.
    fn take_off(&mut self, g: usize, idx: usize, carry: Carry, slack: f64) {
        let progress = (self.groups[g].iter - self.seqs[idx].start_iter + slack).max(0.0);
        self.remove_from_group(g, idx);
        let model = match self.seqs[idx].kind {
            Kind::Gen => &self.w.job.policy,
            Kind::Judge => self.w.job.model(Role::Reward).unwrap_or(&self.w.job.policy),
        };
        let kv_bytes = model.kv_bytes_per_token();
        let devices = f64::from(self.w.group_devices);
        let s = &mut self.seqs[idx];
        // A response that is paused has at least one token left, or it would have
        // finished.
        let tokens = (progress.floor() as u32).min(s.len.saturating_sub(1));
        s.done += tokens;
        s.ctx0 += tokens;
        s.len -= tokens;
        // Its heap entry names the old generation and is skipped when it surfaces.
        s.gen = s.gen.wrapping_add(1);
        s.checkpoint = false;
        match carry {
            Carry::HostKv => {
                s.prefill = 0;
                // Out to host memory and back in.
                s.restore_s =
                    2.0 * kv_bytes * f64::from(s.ctx0) / (devices * self.w.gpu.pcie_bytes_per_s);
            }
            Carry::NetKv => {
                // Each device sends its shard of the cache to its peer in the lane.
                s.prefill = 0;
                s.restore_s = kv_bytes * f64::from(s.ctx0) / (devices * self.w.gpu.net_bytes_per_s);
            }
            Carry::Reprefill => {
                s.prefill = s.ctx0;
                s.restore_s = 0.0;
            }
        }
    }

    /// Parks a suspended sequence until the next weights are in.
    fn park(&mut self, idx: usize) {
        self.seqs[idx].paused = true;
        self.paused.push((idx, self.seqs[idx].gen));
    }

    fn admissible(&self, kind: Kind) -> Option<usize> {
        let (&(step, _), &idx) = self.queues[kind as usize].iter().next()?;
        // Gen: the weights must be recent enough for the step; judging has no bound.
        (kind == Kind::Judge || step <= self.version + self.lookahead).then_some(idx)
    }

    fn seq_done(&mut self, idx: usize) {
        let s = self.seqs[idx].clone();
        self.release(idx);
        let len = s.total_len();
        if self.steps[s.step as usize].full {
            self.wasted_tokens += f64::from(len);
            return;
        }
        let l = f64::from(len.max(1)).ln();
        let st = &mut self.steps[s.step as usize].lens[s.kind as usize];
        st.0 += 1.0;
        st.1 += l;
        st.2 += l * l;
        match s.kind {
            Kind::Gen => {
                let st = &mut self.steps[s.step as usize];
                let Some(p) = st.pgs.get_mut(&s.pg) else {
                    return;
                };
                p.gen_left -= 1;
                p.gen_tokens += f64::from(len);
                let all_generated = p.gen_left == 0;
                match &self.w.job.reward {
                    RewardKind::Generative { .. } => {
                        // The judge reads the prompt and the whole response.
                        let ctx0 = s.ctx0 + s.len + self.w.workload.judge_prompt;
                        let judge = s.judge_len.max(1);
                        self.push_seq(Seq::new(
                            s.step,
                            s.pg,
                            Kind::Judge,
                            ctx0,
                            judge,
                            s.judge_len,
                        ));
                        self.kick_role(Role::Reward);
                    }
                    RewardKind::Rule => self.sample_rewarded(s.step, s.pg, 1),
                    RewardKind::Scalar { .. } => {
                        // The scalar model scores a prompt group once all of it is
                        // generated.
                        if all_generated {
                            let tokens = self.steps[s.step as usize].pgs[&s.pg].tokens;
                            self.enqueue(Task {
                                stage: Stage::Score,
                                step: s.step,
                                tokens,
                                pg: s.pg,
                            });
                        }
                    }
                }
            }
            Kind::Judge => self.sample_rewarded(s.step, s.pg, 1),
        }
    }

    fn sample_rewarded(&mut self, step: u32, pg: u32, n: u32) {
        let st = &mut self.steps[step as usize];
        let Some(p) = st.pgs.get_mut(&pg) else { return };
        p.remaining -= n;
        if p.remaining == 0 {
            let p = st.pgs.remove(&pg).expect("present");
            if self.partial.is_some() {
                self.filter_partial(step, pg, p);
            } else {
                self.filter(step, pg, p);
            }
        }
    }

    /// A prompt group has all its rewards. Groups are accepted in issue order, as a
    /// dataloader hands them out: a group that finishes early waits for the ones
    /// before it. So every placement trains on the same groups, whatever order they
    /// finish in, and no placement favours short responses by keeping whatever
    /// finishes first.
    fn filter(&mut self, step: u32, pg: u32, p: PgState) {
        let st = &mut self.steps[step as usize];
        if st.full {
            self.wasted_tokens += p.lengths.iter().map(|l| f64::from(*l)).sum::<f64>();
            return;
        }
        st.done.insert(pg, p);
        loop {
            let st = &mut self.steps[step as usize];
            if st.full {
                break;
            }
            let next = st.next;
            let Some(p) = st.done.remove(&next) else {
                break;
            };
            st.next += 1;
            self.accept(step, next, p);
        }
    }

    /// Counts a group the dynamic-sampling filter has seen.
    fn count_filtered(&mut self, step: u32, keep: bool) {
        let st = &mut self.steps[step as usize];
        st.filtered += 1;
        self.filtered_window.0 += 1;
        if keep {
            st.kept += 1;
        } else {
            self.filtered_window.1 += 1;
        }
    }

    fn accept(&mut self, step: u32, pg: u32, p: PgState) {
        let target = self.target();
        self.count_filtered(step, p.keep);
        if p.keep {
            let st = &mut self.steps[step as usize];
            st.kept_tokens += p.tokens;
            st.kept_pgs.push(pg);
            let lag = p.born_min.map_or(0, |b| step.saturating_sub(b));
            self.partial_stats.max_lag = self.partial_stats.max_lag.max(lag);
            let stages = self.scoring_stages();
            let st = &mut self.steps[step as usize];
            st.scoring_left += stages.len() as u32;
            for stage in stages {
                self.enqueue(Task {
                    stage,
                    step,
                    tokens: p.tokens,
                    pg: 0,
                });
            }
        }
        let st = &mut self.steps[step as usize];
        if st.kept >= target {
            st.full = true;
            self.abort_step(step);
            self.maybe_train(step);
            return;
        }
        self.top_up(step);
    }

    /// With partial rollouts a group is accepted as soon as it has its rewards, while
    /// groups before it may still be generating: the step can train without them. Its
    /// batch is still made of its first `prompts_per_step` kept groups in issue order
    /// (`batch_end`), so every placement trains the same groups, only not always in
    /// the same step; the controller learns that a group is kept only from its
    /// rewards.
    fn filter_partial(&mut self, step: u32, pg: u32, p: PgState) {
        if self.steps[step as usize].full {
            self.wasted_tokens += p.gen_tokens;
            return;
        }
        self.count_filtered(step, p.keep);
        if p.keep {
            if pg < self.batch_end[step as usize] {
                self.accept_partial(step, pg, p);
            } else {
                // Kept, but the step's batch is made of groups issued before it.
                self.wasted_tokens += p.gen_tokens;
            }
        }
        if !self.steps[step as usize].full {
            self.top_up(step);
        }
    }

    fn accept_partial(&mut self, step: u32, pg: u32, p: PgState) {
        let stages = self.scoring_stages();
        let st = &mut self.steps[step as usize];
        st.kept_pgs.push(pg);
        st.accepted_open += 1;
        let full = st.kept_pgs.len() as u32 >= self.w.workload.prompts_per_step;
        self.accepted.insert(
            (step, pg),
            Accepted {
                tokens: p.tokens,
                scoring_left: stages.len() as u32,
                born_min: p.born_min,
                in_batch: None,
            },
        );
        let scored = stages.is_empty();
        for stage in stages {
            self.enqueue(Task {
                stage,
                step,
                tokens: p.tokens,
                pg,
            });
        }
        if full {
            self.steps[step as usize].full = true;
            self.abort_step(step);
        }
        if scored {
            self.group_scored(step, pg);
        } else {
            self.maybe_train(self.trained);
        }
    }

    fn scoring_stages(&self) -> Vec<Stage> {
        Stage::of_job(&self.w.job)
            .into_iter()
            .filter(|s| matches!(s, Stage::Ref | Stage::Values | Stage::OldLogProb))
            .collect()
    }

    /// Issues prompts while the expected keepers fall short of the batch.
    fn top_up(&mut self, step: u32) {
        let target = self.target();
        let st = &self.steps[step as usize];
        let pending = f64::from(st.issued - st.filtered);
        let observed = f64::from(st.filtered - st.kept) / f64::from(st.filtered.max(1));
        let d = if st.filtered >= 8 {
            observed
        } else {
            self.drop_est
        }
        .clamp(0.0, 0.9);
        let expect = f64::from(st.kept) + pending * (1.0 - d);
        if expect < f64::from(target) {
            let more = ((f64::from(target) - expect) / (1.0 - d)).ceil() as u32;
            self.issue(step, more.max(1));
            self.kick_role(Role::Rollout);
        }
    }

    fn abort_step(&mut self, step: u32) {
        let lost = self.discard(step, None);
        self.wasted_tokens += lost;
    }

    /// Throws away the queued, paused and in-flight sequences of `step` (of its prompt
    /// group `pg` only, when given); returns the tokens they had generated.
    fn discard(&mut self, step: u32, pg: Option<u32>) -> f64 {
        let mut lost = 0.0;
        for q in 0..2 {
            let keys: Vec<(u32, u64)> = self.queues[q]
                .range((step, 0)..(step + 1, 0))
                .filter(|&(_, &i)| pg.is_none_or(|x| self.seqs[i].pg == x))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                let idx = self.queues[q].remove(&k).expect("present");
                lost += f64::from(self.seqs[idx].done);
                self.release(idx);
            }
        }
        // In-flight sequences stop where they are; their tokens are lost.
        let live: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| {
                let s = &self.seqs[i];
                s.alive
                    && s.step == step
                    && pg.is_none_or(|x| s.pg == x)
                    && (s.on.is_some() || s.paused)
            })
            .collect();
        for idx in live {
            lost += f64::from(self.seqs[idx].done);
            let Some(g) = self.seqs[idx].on else {
                self.release(idx);
                continue;
            };
            self.advance(g);
            lost += self.groups[g].iter - self.seqs[idx].start_iter;
            self.remove_from_group(g, idx);
            self.release(idx);
            self.refill(g);
            self.reschedule(g);
        }
        lost
    }

    fn maybe_train(&mut self, step: u32) {
        if self.partial.is_some() {
            self.maybe_close(step);
            return;
        }
        let Some(st) = self.steps.get(step as usize) else {
            return;
        };
        if !st.full || st.scoring_left > 0 || st.train_left > 0 || self.trained != step {
            return;
        }
        let st = &mut self.steps[step as usize];
        st.train_tokens = st.kept_tokens;
        let batch: Vec<(u32, u32, u32)> = st.kept_pgs.iter().map(|&g| (step, g, step)).collect();
        self.trained_groups.extend(batch);
        self.start_training(step);
    }

    fn start_training(&mut self, step: u32) {
        let epochs = f64::from(self.w.job.train_epochs.max(1));
        let tokens = self.steps[step as usize].train_tokens * epochs;
        let stages: Vec<Stage> = Stage::of_job(&self.w.job)
            .into_iter()
            .filter(|s| matches!(s, Stage::TrainActor | Stage::TrainCritic))
            .collect();
        self.steps[step as usize].train_left = stages.len() as u32;
        for stage in stages {
            self.enqueue(Task {
                stage,
                step,
                tokens,
                pg: 0,
            });
        }
    }

    /// With partial rollouts: cuts step `step`'s batch off when the trainer is ready for
    /// it and the cutoff's share of a batch is complete, unless a group that would then
    /// go beyond the staleness bound is still generating and the config says to wait
    /// for it. The last step takes every group left.
    fn maybe_close(&mut self, step: u32) {
        let Some(pr) = self.partial else { return };
        let Some(st) = self.steps.get(step as usize) else {
            return;
        };
        if self.trained != step || st.closed {
            return;
        }
        let upto = step as usize + 1;
        let all_in = self.steps[..upto].iter().all(|s| s.full);
        if !all_in {
            if upto == self.steps.len() {
                return;
            }
            let open: u32 = self.steps[..upto].iter().map(|s| s.accepted_open).sum();
            let need = (pr.cutoff * f64::from(self.target())).ceil() as u32;
            if open < need {
                return;
            }
            let (wait, regenerate) = self.beyond_bound(step, pr.beyond_bound);
            if wait {
                return;
            }
            for (k, pg) in regenerate {
                self.regenerate(k, pg);
            }
        }
        self.close(step);
    }

    /// The unfinished groups of steps up to `step` that would train beyond the
    /// staleness bound if carried past it: whether the step must wait for one, and
    /// those to generate again.
    fn beyond_bound(&self, step: u32, rule: BeyondBound) -> (bool, Vec<(u32, u32)>) {
        let mut regenerate = Vec::new();
        for (k, st) in self.steps[..=step as usize].iter().enumerate() {
            for (&pg, p) in &st.pgs {
                let Some(born) = p.born_min else { continue };
                // Trained at step + 1 or later, it would lag more than allowed.
                if born + self.staleness > step {
                    continue;
                }
                // A group whose responses are all generated waits for its verdicts only.
                if rule == BeyondBound::Wait || p.gen_left == 0 {
                    return (true, Vec::new());
                }
                regenerate.push((k as u32, pg));
            }
        }
        regenerate.sort_unstable();
        (false, regenerate)
    }

    /// Throws a group's responses away and generates them again, from the start, with
    /// the next weights.
    fn regenerate(&mut self, step: u32, pg: u32) {
        let mut lost = self.discard(step, Some(pg));
        let n = self.w.workload.samples_per_prompt;
        let Some(p) = self.steps[step as usize].pgs.get_mut(&pg) else {
            return;
        };
        lost += p.gen_tokens;
        p.gen_left = n;
        p.remaining = n;
        p.born_min = None;
        p.gen_tokens = 0.0;
        self.partial_stats.stale_tokens += lost;
        self.wasted_tokens += lost;
        let group = self.w.workload.group(step, pg);
        // They wait for the next weights, as paused responses do.
        for idx in self.push_responses(step, pg, &group) {
            let key = (step, self.seqs[idx].order);
            self.queues[Kind::Gen as usize].remove(&key);
            self.park(idx);
        }
    }

    /// Cuts step `step`'s batch off: every accepted group not yet trained joins it.
    /// Groups still generating are carried into later steps. Groups that share their
    /// devices with passes pause their in-flight responses so the passes can start.
    fn close(&mut self, step: u32) {
        let keys: Vec<(u32, u32)> = self
            .accepted
            .range(..(step + 1, 0))
            .filter(|(_, a)| a.in_batch.is_none())
            .map(|(k, _)| *k)
            .collect();
        let mut tokens = 0.0;
        let mut left = 0;
        for &(k, pg) in &keys {
            let a = self.accepted.get_mut(&(k, pg)).expect("accepted");
            a.in_batch = Some(step);
            tokens += a.tokens;
            if a.scoring_left > 0 {
                left += 1;
            }
            let lag = a.born_min.map_or(0, |b| step.saturating_sub(b));
            self.partial_stats.max_lag = self.partial_stats.max_lag.max(lag);
            if k < step {
                self.partial_stats.carried_groups += 1;
            }
            self.steps[k as usize].accepted_open -= 1;
        }
        let st = &mut self.steps[step as usize];
        st.closed = true;
        st.batch_left = left;
        st.train_tokens = tokens;
        st.batch = keys;
        self.pause_at_cutoff(step);
        if left == 0 {
            self.train_batch(step);
        }
        self.kick_all();
    }

    /// A group's scoring passes are done.
    fn group_scored(&mut self, step: u32, pg: u32) {
        let Some(in_batch) = self.accepted.get(&(step, pg)).map(|a| a.in_batch) else {
            return;
        };
        match in_batch {
            Some(t) => {
                let st = &mut self.steps[t as usize];
                st.batch_left -= 1;
                if st.batch_left == 0 {
                    self.train_batch(t);
                }
            }
            None => self.maybe_train(self.trained),
        }
    }

    /// With partial rollouts: trains a closed batch whose groups are all scored.
    fn train_batch(&mut self, step: u32) {
        let batch = std::mem::take(&mut self.steps[step as usize].batch);
        for (k, pg) in batch {
            self.accepted.remove(&(k, pg));
            self.trained_groups.push((k, pg, step));
        }
        self.start_training(step);
    }

    /// At a cutoff, pools that share their devices with passes stop decoding: their
    /// in-flight responses pause (KV cache to host memory, or dropped and prefilled
    /// again on resuming). With `resume = "reprefill"` the carried responses pause in
    /// every pool, to continue with the new weights.
    fn pause_at_cutoff(&mut self, step: u32) {
        let Some(pr) = self.partial else { return };
        let keep_kv = pr.resume == Resume::Kv;
        for p in 0..self.pools.len() {
            if !self.hosts_passes(p) || !matches!(self.pools[p].phase, PoolPhase::Decode(_)) {
                continue;
            }
            for g in self.pools[p].members.clone() {
                self.advance(g);
                for idx in self.in_flight(g) {
                    self.suspend(g, idx, keep_kv);
                    self.park(idx);
                }
                self.reschedule(g);
            }
        }
        if !keep_kv {
            for g in 0..self.groups.len() {
                let carried: Vec<usize> = self
                    .in_flight(g)
                    .into_iter()
                    .filter(|&i| self.seqs[i].kind == Kind::Gen && self.seqs[i].step <= step)
                    .collect();
                if carried.is_empty() {
                    continue;
                }
                self.advance(g);
                for idx in carried {
                    self.suspend(g, idx, false);
                    self.park(idx);
                }
                self.refill(g);
                self.reschedule(g);
            }
        }
    }

    /// Whether pool `p` also runs forward or training passes (and so must stop
    /// decoding for them).
    fn hosts_passes(&self, p: usize) -> bool {
        let roles = self.pools[p].roles;
        Stage::of_job(&self.w.job)
            .iter()
            .any(|s| !matches!(s, Stage::Gen | Stage::Judge) && roles.contains(s.role()))
    }

    /// The sequences decoding on group `g` now.
    fn in_flight(&self, g: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.groups[g]
            .heap
            .iter()
            .map(|Reverse((_, i, gen))| (*i, *gen))
            .filter(|&(i, gen)| {
                let s = &self.seqs[i];
                s.alive && s.gen == gen && s.on == Some(g)
            })
            .map(|(i, _)| i)
            .collect();
        // The heap's order is arbitrary; keep the simulation deterministic.
        v.sort_unstable();
        v
    }

    fn task_done(&mut self, t: Task) {
        match t.stage {
            Stage::Score => {
                let n = self.w.workload.samples_per_prompt;
                self.sample_rewarded(t.step, t.pg, n);
            }
            Stage::Ref | Stage::Values | Stage::OldLogProb if self.partial.is_some() => {
                let Some(a) = self.accepted.get_mut(&(t.step, t.pg)) else {
                    return;
                };
                a.scoring_left -= 1;
                if a.scoring_left == 0 {
                    self.group_scored(t.step, t.pg);
                }
            }
            Stage::Ref | Stage::Values | Stage::OldLogProb => {
                let st = &mut self.steps[t.step as usize];
                st.scoring_left -= 1;
                self.maybe_train(t.step);
            }
            Stage::TrainActor | Stage::TrainCritic => {
                let st = &mut self.steps[t.step as usize];
                st.train_left -= 1;
                if st.train_left == 0 {
                    self.trained_tokens += st.train_tokens;
                    self.start_sync(t.step);
                }
            }
            Stage::Gen | Stage::Judge => {}
        }
    }

    fn start_sync(&mut self, step: u32) {
        let rp = self.role_pool.get(&Role::Rollout).copied();
        let pp = self.role_pool.get(&Role::Policy).copied();
        let w = self.w.job.policy.weight_bytes() / f64::from(self.w.group_devices);
        let local = rp == pp;
        let t = match &self.w.rates {
            Some(r) => r.sync_s + r.overhead_s,
            None if local => w / self.w.gpu.pcie_bytes_per_s + TRUE_SYNC_FIXED_S,
            None => w / self.w.gpu.net_bytes_per_s + TRUE_SYNC_FIXED_S,
        };
        self.sync_window = Some((t, local));
        if let Some(pp) = pp {
            self.pool_busy(pp, t, Busy::Sync);
        }
        if !local {
            if let Some(rp) = rp {
                for g in self.pools[rp].members.clone() {
                    self.advance(g);
                    let grp = &mut self.groups[g];
                    grp.paused_until = grp.paused_until.max(self.now) + t;
                    grp.overhead_s += t;
                    self.reschedule(g);
                }
            }
        }
        self.at(self.now + t, Ev::SyncDone { step });
    }

    fn sync_done(&mut self, step: u32) {
        self.trained = step + 1;
        self.version = step + 1;
        self.step_done = step + 1;
        let st = &self.steps[step as usize];
        let d = f64::from(st.filtered - st.kept) / f64::from(st.filtered.max(1));
        self.drop_est = (0.5 * self.drop_est + 0.5 * d).clamp(0.0, 0.9);
        let dur = self.now - self.last_step_end;
        self.last_step_end = self.now;
        self.step_s.push(dur);
        if self.partial.is_none() {
            // Groups that finished after the batch filled, waiting for groups before
            // them, are surplus: their tokens were generated for nothing.
            let surplus: f64 = std::mem::take(&mut self.steps[step as usize].done)
                .values()
                .map(|p| p.gen_tokens)
                .sum();
            self.wasted_tokens += surplus;
            self.steps[step as usize].pgs.clear();
        }
        // Paused responses continue with the new weights.
        for (idx, gen) in std::mem::take(&mut self.paused) {
            if self.seqs[idx].alive && self.seqs[idx].paused && self.seqs[idx].gen == gen {
                self.requeue(idx);
            }
        }
        let metrics = self.take_metrics(step, dur);
        if let Some(mut policy) = self.policy.take() {
            let decisions = policy.on_event(Event::Metrics(metrics));
            for d in decisions {
                let Decision::Migrate(m) = d;
                self.plans.push((u64::from(step) + 1, m.target.summary()));
                self.migrate(&m.target, m.id);
            }
            self.policy = Some(policy);
        }
        if self.step_done < self.w.workload.steps {
            self.open_steps();
            // The next step can train as soon as its batch is ready.
            self.maybe_train(self.trained);
            self.kick_all();
        }
    }

    fn take_metrics(&mut self, step: u32, dur: f64) -> StepMetrics {
        let g = self.w.group_devices;
        let mut stages = Vec::new();
        let windows = std::mem::take(&mut self.windows);
        let mut keys: Vec<_> = windows.keys().copied().collect();
        keys.sort();
        for s in keys {
            let w = &windows[&s];
            let decode = matches!(s, Stage::Gen | Stage::Judge);
            let t = self.totals.entry(s).or_default();
            t.0 += w.group_s;
            t.1 += w.tokens;
            t.2 += w.iterations;
            stages.push(StageObs {
                stage: s,
                group_s: w.group_s,
                group_devices: g,
                tokens: w.tokens,
                iterations: decode.then_some(w.iterations),
                context_tokens: decode.then_some(w.context),
                prefill_tokens: decode.then_some(w.prefill),
            });
        }
        let stat = |s: (f64, f64, f64)| {
            if s.0 < 1.0 {
                return (0.0, 0.0);
            }
            let m = s.1 / s.0;
            (m, (s.2 / s.0 - m * m).max(0.0).sqrt())
        };
        let lens = self.steps[step as usize].lens;
        let (lm, ls) = stat(lens[0]);
        let (jm, js) = stat(lens[1]);
        let (filtered, dropped) = std::mem::take(&mut self.filtered_window);
        let (switches, switch_s) = std::mem::take(&mut self.switches_window);
        let sync = self.sync_window.take();
        StepMetrics {
            step: u64::from(step),
            step_s: dur,
            stages,
            response_len_mean: if lm > 0.0 {
                (lm + ls * ls / 2.0).exp()
            } else {
                0.0
            },
            response_log_mean: lm,
            response_log_std: ls,
            prompt_len_mean: f64::from(self.w.workload.prompt_len),
            judge_log_mean: jm,
            judge_log_std: js,
            groups_filtered: filtered,
            groups_dropped: dropped,
            weight_sync_s: sync.map(|s| s.0),
            weight_sync_local: sync.is_some_and(|s| s.1),
            switches,
            switch_s,
        }
    }

    // ---- decoding groups -------------------------------------------------------

    fn enqueue(&mut self, t: Task) {
        self.tasks[t.stage as usize].push_back(t);
        self.kick_role(t.stage.role());
    }

    fn advance(&mut self, g: usize) {
        let now = self.now;
        let grp = &mut self.groups[g];
        let start = grp.last.max(grp.paused_until);
        if now > start && (grp.b > 0 || grp.debt > 0.0) {
            let mut dt = now - start;
            grp.compute_s += dt;
            let stage = match grp.kind {
                Some(Kind::Judge) => Stage::Judge,
                _ => Stage::Gen,
            };
            let win = self.windows.entry(stage).or_default();
            win.group_s += dt;
            let pay = grp.debt.min(dt);
            grp.debt -= pay;
            dt -= pay;
            if grp.b > 0 && dt > 0.0 {
                let b = f64::from(grp.b);
                let ctx = grp.p_sum + b * grp.iter - grp.s_sum;
                let t_it = grp.coeffs.iteration(b, ctx);
                let iters = dt / t_it;
                win.iterations += iters;
                win.tokens += iters * b;
                win.context += iters * ctx;
                self.generated_tokens += iters * b;
                grp.iter += iters;
            }
        }
        if now > grp.last {
            grp.last = now;
        }
    }

    fn reschedule(&mut self, g: usize) {
        let grp = &mut self.groups[g];
        grp.stamp += 1;
        let Some(Reverse((OrdF64(fin), _, _))) = grp.heap.peek().copied() else {
            return;
        };
        let b = f64::from(grp.b);
        let ctx = grp.p_sum + b * grp.iter - grp.s_sum;
        let t_it = grp.coeffs.iteration(b, ctx);
        let start = self.now.max(grp.paused_until).max(grp.last);
        let t = start + grp.debt + (fin - grp.iter).max(0.0) * t_it;
        let stamp = grp.stamp;
        self.at(t, Ev::GroupWake { g, stamp });
    }

    fn remove_from_group(&mut self, g: usize, idx: usize) {
        let s = &mut self.seqs[idx];
        s.on = None;
        let grp = &mut self.groups[g];
        grp.b -= 1;
        grp.p_sum -= f64::from(s.ctx0);
        grp.s_sum -= s.start_iter;
        // The heap entry stays; it is skipped when it surfaces (lazy deletion).
    }

    fn group_wake(&mut self, g: usize) {
        self.advance(g);
        while let Some(Reverse((OrdF64(fin), idx, gen))) = self.groups[g].heap.peek().copied() {
            let s = &self.seqs[idx];
            if !s.alive || s.gen != gen || s.on != Some(g) {
                self.groups[g].heap.pop();
                continue;
            }
            if fin > self.groups[g].iter + 1e-6 {
                break;
            }
            self.groups[g].heap.pop();
            if self.seqs[idx].checkpoint {
                self.crossed(g, idx);
                continue;
            }
            self.remove_from_group(g, idx);
            self.seq_done(idx);
        }
        self.refill(g);
        self.reschedule(g);
        if self.groups[g].b == 0 {
            if let Some(p) = self.groups[g].pool {
                self.pool_kick(p);
            }
        }
    }

    fn refill(&mut self, g: usize) {
        let Some(kind) = self.groups[g].kind else {
            return;
        };
        if self.groups[g].lane {
            self.refill_lane(g);
            return;
        }
        if self.groups[g]
            .pool
            .is_some_and(|p| self.pools[p].roles.len() > 1 && self.should_yield(p))
        {
            return;
        }
        loop {
            let Some(idx) = self.admissible(kind) else {
                // Out of work with free slots: wake this group when work arrives.
                if !self.groups[g].hungry[kind as usize] {
                    self.groups[g].hungry[kind as usize] = true;
                    self.hungry[kind as usize].push(g);
                }
                break;
            };
            let step = self.seqs[idx].step as usize;
            let mut slots =
                self.slots[kind as usize][step.min(self.slots[kind as usize].len() - 1)];
            if let (Kind::Gen, Some(cap)) = (kind, self.rollout_cap) {
                slots = slots.min(cap.max(1));
            }
            if self.groups[g].b >= slots {
                break;
            }
            let key = (self.seqs[idx].step, self.seqs[idx].order);
            self.queues[kind as usize].remove(&key);
            // A response resuming past the lane threshold goes straight to a lane.
            if let (Some(l), Some(lane)) = (self.lanes, self.lane_with_room()) {
                if kind == Kind::Gen && self.seqs[idx].done >= l.threshold {
                    self.advance(lane);
                    self.admit(lane, idx, kind);
                    self.reschedule(lane);
                    continue;
                }
            }
            self.admit(g, idx, kind);
        }
    }

    /// Starts sequence `idx` (off the queues) on group `g`, paying its prefill or
    /// cache restore. On an ordinary rollout group a response that will pass the lane
    /// threshold gets a checkpoint there instead of its end.
    fn admit(&mut self, g: usize, idx: usize, kind: Kind) {
        {
            let threshold = match self.lanes {
                Some(l) if kind == Kind::Gen && !self.groups[g].lane => Some(l.threshold),
                _ => None,
            };
            let version = self.version;
            let grp = &mut self.groups[g];
            let s = &mut self.seqs[idx];
            s.on = Some(g);
            s.start_iter = grp.iter;
            grp.b += 1;
            grp.p_sum += f64::from(s.ctx0);
            grp.s_sum += s.start_iter;
            grp.debt += f64::from(s.prefill) * grp.coeffs.prefill + s.restore_s;
            let mut run = s.len;
            s.checkpoint = false;
            if let Some(t) = threshold {
                let to_lane = t.saturating_sub(s.done).max(1);
                if to_lane < s.len {
                    run = to_lane;
                    s.checkpoint = true;
                }
            }
            grp.heap
                .push(Reverse((OrdF64(grp.iter + f64::from(run)), idx, s.gen)));
            let prefill = f64::from(s.prefill);
            if s.done > 0 {
                self.partial_stats.reprefill_tokens += prefill;
            }
            let first_start = kind == Kind::Gen && s.born.is_none();
            if first_start {
                s.born = Some(version);
            }
            let (step, pg) = (s.step, s.pg);
            if first_start {
                if let Some(p) = self.steps[step as usize].pgs.get_mut(&pg) {
                    p.born_min = Some(p.born_min.map_or(version, |b| b.min(version)));
                }
            }
            let stage = if kind == Kind::Gen {
                Stage::Gen
            } else {
                Stage::Judge
            };
            self.windows.entry(stage).or_default().prefill += prefill;
        }
    }

    // ---- straggler lanes ---------------------------------------------------------

    /// Takes the lanes of `plan`: its lane groups decode only moved responses.
    fn set_lanes(&mut self, plan: &Plan) {
        self.lanes = plan.lanes;
        for grp in &mut self.groups {
            grp.lane = false;
        }
        for g in plan.lane_groups() {
            self.groups[g.0 as usize].lane = true;
        }
    }

    /// The decoding lane with the most room (the first such in id order), if any.
    fn lane_with_room(&self) -> Option<usize> {
        let l = self.lanes?;
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, grp)| {
                grp.lane && grp.kind == Some(Kind::Gen) && grp.pool.is_some() && grp.b < l.batch
            })
            .min_by_key(|(i, grp)| (grp.b, *i))
            .map(|(i, _)| i)
    }

    /// Response `idx` on ordinary group `g` (advanced to now) reached the lane
    /// threshold: it moves to a lane with room, or goes on where it is and waits for
    /// one.
    fn crossed(&mut self, g: usize, idx: usize) {
        self.seqs[idx].checkpoint = false;
        if !self.groups[g].lane && self.lanes.is_some() {
            if let Some(lane) = self.lane_with_room() {
                self.move_to_lane(g, idx, lane);
                return;
            }
            let s = &self.seqs[idx];
            self.lane_wait.insert((s.step, s.order), (idx, s.gen));
        }
        let s = &self.seqs[idx];
        let end = s.start_iter + f64::from(s.len);
        self.groups[g].heap.push(Reverse((OrdF64(end), idx, s.gen)));
    }

    /// Moves response `idx` from group `g` (advanced to now) to `lane`: it brings its
    /// KV cache over the interconnect, or prefills it again with `resume =
    /// "reprefill"`. The caller refills and reschedules `g`.
    fn move_to_lane(&mut self, g: usize, idx: usize, lane: usize) {
        let carry = match self.partial.map(|p| p.resume) {
            Some(Resume::Reprefill) => Carry::Reprefill,
            _ => Carry::NetKv,
        };
        self.take_off(g, idx, carry, 1e-6);
        self.advance(lane);
        let s = &self.seqs[idx];
        self.lane_transfer_s +=
            f64::from(s.prefill) * self.groups[lane].coeffs.prefill + s.restore_s;
        self.lane_moves += 1;
        self.admit(lane, idx, Kind::Gen);
        self.reschedule(lane);
    }

    /// Fills a lane's free room with the responses waiting for one, oldest step first.
    fn refill_lane(&mut self, lane: usize) {
        let Some(l) = self.lanes else { return };
        while self.groups[lane].b < l.batch && self.groups[lane].kind == Some(Kind::Gen) {
            let Some((_, (idx, gen))) = self.lane_wait.pop_first() else {
                break;
            };
            let s = &self.seqs[idx];
            let Some(g) =
                s.on.filter(|&g| s.alive && s.gen == gen && !self.groups[g].lane)
            else {
                continue;
            };
            self.advance(g);
            self.move_to_lane(g, idx, lane);
            self.refill(g);
            self.reschedule(g);
        }
    }

    // ---- pools -----------------------------------------------------------------

    fn kick_all(&mut self) {
        for p in 0..self.pools.len() {
            self.pool_kick(p);
        }
    }

    fn kick_role(&mut self, role: Role) {
        if let Some(&p) = self.role_pool.get(&role) {
            self.pool_kick(p);
        }
    }

    fn decode_kind(&self, role: Role) -> Option<Kind> {
        match role {
            Role::Rollout => Some(Kind::Gen),
            Role::Reward if matches!(self.w.job.reward, RewardKind::Generative { .. }) => {
                Some(Kind::Judge)
            }
            _ => None,
        }
    }

    fn pool_busy(&mut self, p: usize, secs: f64, what: Busy) {
        let start = match self.pools[p].phase {
            PoolPhase::Busy { until, .. } if until > self.now => until,
            _ => self.now,
        };
        let until = start + secs;
        let pool = &mut self.pools[p];
        pool.phase = PoolPhase::Busy { until, what };
        pool.stamp += 1;
        let stamp = pool.stamp;
        for &g in &pool.members {
            let grp = &mut self.groups[g];
            match what {
                Busy::Task(_) => grp.compute_s += secs,
                Busy::Switch | Busy::Sync => grp.overhead_s += secs,
            }
        }
        self.at(until, Ev::PoolWake { p, stamp });
    }

    fn pool_done(&mut self, p: usize) {
        let running = std::mem::take(&mut self.pools[p].running);
        self.pools[p].phase = PoolPhase::Idle;
        for t in running {
            self.task_done(t);
        }
        self.pool_kick(p);
    }

    /// Whether a pool that decodes should stop admitting and drain, so that passes it
    /// also hosts can run: when the oldest untrained step has its whole batch and
    /// waits on those passes.
    fn should_yield(&self, p: usize) -> bool {
        let roles = self.pools[p].roles;
        let Some(oldest) = self.steps.get(self.trained as usize) else {
            return false;
        };
        let batch_cut = if self.partial.is_some() {
            oldest.closed
        } else {
            oldest.full
        };
        batch_cut
            && Stage::ALL.iter().any(|s| {
                !matches!(s, Stage::Gen | Stage::Judge)
                    && roles.contains(s.role())
                    && !self.tasks[*s as usize].is_empty()
            })
    }

    fn has_decode_work(&self, p: usize, kind: Kind) -> bool {
        (self.admissible(kind).is_some() && !self.should_yield(p))
            || self.pools[p]
                .members
                .iter()
                .any(|&g| self.groups[g].b > 0 && self.groups[g].kind == Some(kind))
    }

    fn pool_kick(&mut self, p: usize) {
        match self.pools[p].phase {
            PoolPhase::Busy { until, .. } if until > self.now => return,
            PoolPhase::Busy { .. } => self.pools[p].phase = PoolPhase::Idle,
            PoolPhase::Decode(kind) => {
                if self.has_decode_work(p, kind) {
                    self.feed_hungry(kind);
                    return;
                }
                for g in self.pools[p].members.clone() {
                    self.groups[g].kind = None;
                }
                self.pools[p].phase = PoolPhase::Idle;
            }
            PoolPhase::Idle => {}
        }
        if self.pools[p].members.is_empty() {
            return;
        }
        // Pick the next role with work, latest pipeline stage first (it unblocks the
        // step soonest); decoding comes last.
        let roles = self.pools[p].roles;
        let mut choice: Option<(Role, Option<Stage>)> = None;
        // Stay with the loaded role while it has passes queued: switching costs copies.
        if let Some(loaded) = self.pools[p].loaded {
            for stage in Stage::ALL {
                if stage.role() == loaded
                    && !matches!(stage, Stage::Gen | Stage::Judge)
                    && roles.contains(loaded)
                    && !self.tasks[stage as usize].is_empty()
                {
                    choice = Some((loaded, Some(stage)));
                    break;
                }
            }
        }
        for stage in [
            Stage::TrainActor,
            Stage::TrainCritic,
            Stage::OldLogProb,
            Stage::Values,
            Stage::Ref,
            Stage::Score,
        ] {
            if choice.is_some() {
                break;
            }
            if roles.contains(stage.role()) && !self.tasks[stage as usize].is_empty() {
                choice = Some((stage.role(), Some(stage)));
                break;
            }
        }
        if choice.is_none() {
            for role in [Role::Reward, Role::Rollout] {
                if let Some(kind) = self.decode_kind(role) {
                    if roles.contains(role) && self.admissible(kind).is_some() {
                        choice = Some((role, None));
                        break;
                    }
                }
            }
        }
        let Some((role, stage)) = choice else { return };
        let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
        let offload = crate::plan::needs_offload(
            &self.w.job,
            roles,
            self.w.group_devices,
            devices,
            self.w.gpu.memory_bytes,
        );
        if !offload {
            self.pools[p].loaded = Some(role);
        }
        if self.pools[p].loaded != Some(role) {
            let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
            let out = self.pools[p]
                .loaded
                .and_then(|r| self.w.job.memory(r))
                .map(|m| m.resident_per_device(self.w.group_devices, devices))
                .unwrap_or(0.0);
            let inn = self
                .w
                .job
                .memory(role)
                .map(|m| m.resident_per_device(self.w.group_devices, devices))
                .unwrap_or(0.0);
            let t = match &self.w.rates {
                Some(r) => r.switch_s,
                None => (out + inn) / self.w.gpu.pcie_bytes_per_s + TRUE_SWITCH_FIXED_S,
            };
            self.pools[p].loaded = Some(role);
            self.switches_window.0 += 1;
            self.switches_window.1 += t;
            self.pool_busy(p, t, Busy::Switch);
            return;
        }
        match stage {
            Some(stage) => self.run_tasks(p, stage),
            None => {
                let kind = self.decode_kind(role).expect("decoding role");
                self.pools[p].phase = PoolPhase::Decode(kind);
                for g in self.pools[p].members.clone() {
                    self.start_decoding(g, kind);
                    self.refill(g);
                    self.reschedule(g);
                }
            }
        }
    }

    fn start_decoding(&mut self, g: usize, kind: Kind) {
        self.advance(g);
        let grp = &mut self.groups[g];
        grp.kind = Some(kind);
        grp.coeffs = self.coeffs[kind as usize];
    }

    /// Gives queued work to the groups that ran out of it (nobody else has free slots:
    /// refilling drains the queue into every free slot it meets).
    fn feed_hungry(&mut self, kind: Kind) {
        if self.admissible(kind).is_none() {
            return;
        }
        let hungry = std::mem::take(&mut self.hungry[kind as usize]);
        for g in hungry {
            self.groups[g].hungry[kind as usize] = false;
            if self.groups[g].kind != Some(kind) {
                continue;
            }
            self.advance(g);
            self.refill(g);
            self.reschedule(g);
        }
    }

    fn run_tasks(&mut self, p: usize, stage: Stage) {
        // Train one step at a time; scoring passes take everything queued as one batch.
        let q = &mut self.tasks[stage as usize];
        let tasks: Vec<Task> = if matches!(stage, Stage::TrainActor | Stage::TrainCritic) {
            q.pop_front().into_iter().collect()
        } else {
            q.drain(..).collect()
        };
        let tokens: f64 = tasks.iter().map(|t| t.tokens).sum();
        let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
        let mut secs = tokens * self.s_per_token[&stage] / f64::from(devices);
        if matches!(stage, Stage::TrainActor | Stage::TrainCritic) {
            // Gradient reduce-scatter and parameter all-gather of ZeRO-3, partly hidden.
            let model = self
                .w
                .job
                .model(stage.role())
                .expect("trained role has a model");
            secs += 1.5 * model.weight_bytes() / f64::from(devices) / self.w.gpu.net_bytes_per_s;
            if std::mem::take(&mut self.pools[p].reshard) {
                let state = self.w.job.memory(stage.role()).expect("memory profile");
                secs += state.resident_per_device(self.w.group_devices, devices)
                    / self.w.gpu.net_bytes_per_s;
            }
        }
        let w = self.windows.entry(stage).or_default();
        w.group_s += secs * self.pools[p].members.len() as f64;
        w.tokens += tokens;
        self.pools[p].running = tasks;
        self.pool_busy(p, secs, Busy::Task(stage));
    }

    // ---- migrations ----------------------------------------------------------------

    fn migrate(&mut self, target: &Plan, id: u64) {
        self.migrations += 1;
        self.rollout_cap = target.rollout_batch_cap;
        self.set_lanes(target);
        let mut pending = 0;
        // Pools of the target, reusing pools with the same roles.
        let mut pool_of_roles: HashMap<RoleSet, usize> = HashMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            if !p.roles.is_empty() {
                pool_of_roles.insert(p.roles, i);
            }
        }
        let mut keep: Vec<bool> = vec![false; self.pools.len()];
        for pool in &target.pools {
            let idx = match pool_of_roles.get(&pool.roles) {
                Some(&i) => i,
                None => {
                    self.pools.push(PoolState {
                        roles: pool.roles,
                        members: Vec::new(),
                        phase: PoolPhase::Idle,
                        loaded: pool.roles.iter().next(),
                        stamp: 0,
                        reshard: false,
                        running: Vec::new(),
                    });
                    keep.push(false);
                    self.pools.len() - 1
                }
            };
            keep[idx] = true;
            for r in pool.roles.iter() {
                self.role_pool.insert(r, idx);
            }
        }
        for (i, k) in keep.iter().enumerate() {
            if !k {
                self.pools[i].roles = RoleSet::EMPTY;
            }
        }
        for pool in &target.pools {
            let dest = self.role_pool[&pool.roles.iter().next().expect("roles")];
            for gid in &pool.groups {
                let g = gid.0 as usize;
                if self.groups[g].pool == Some(dest) {
                    continue;
                }
                let leave_at = self.evict(g);
                let devices = pool.groups.len() as u32 * self.w.group_devices;
                let load: f64 = pool
                    .roles
                    .iter()
                    .filter_map(|r| {
                        let m = self.w.job.memory(r)?;
                        let start = if self.decode_kind(r).is_some() {
                            TRUE_START_DECODER_S
                        } else {
                            TRUE_START_OTHER_S
                        };
                        let per = m.resident_per_device(self.w.group_devices, devices);
                        Some(per / self.w.gpu.net_bytes_per_s + start)
                    })
                    .sum();
                self.groups[g].overhead_s += load;
                if pool.roles.iter().any(|r| {
                    self.w
                        .job
                        .memory(r)
                        .is_some_and(|m| m.sharding == Sharding::Pool)
                }) {
                    self.pools[dest].reshard = true;
                }
                pending += 1;
                self.at(
                    leave_at + load,
                    Ev::GroupJoin {
                        g,
                        p: dest,
                        migration: id,
                    },
                );
            }
        }
        if pending == 0 {
            self.finish_migration(id);
        } else {
            self.migration = Some((id, pending));
        }
        self.kick_all();
    }

    /// Takes a group out of its pool; returns when it is free. In-flight sequences are
    /// aborted and requeued; a pool pass in progress finishes first.
    fn evict(&mut self, g: usize) -> f64 {
        let Some(p) = self.groups[g].pool.take() else {
            return self.now;
        };
        self.advance(g);
        let live: Vec<(usize, u32)> = std::iter::from_fn({
            let heap = &mut self.groups[g].heap;
            move || heap.pop().map(|Reverse((_, i, gen))| (i, gen))
        })
        .collect();
        for (idx, gen) in live {
            if self.seqs[idx].alive && self.seqs[idx].gen == gen && self.seqs[idx].on == Some(g) {
                if self.partial.is_some() {
                    // Partial rollouts keep what it generated; the cache is lost with
                    // the group, so it is prefilled again wherever it resumes.
                    self.suspend(g, idx, false);
                } else {
                    let done = self.groups[g].iter - self.seqs[idx].start_iter;
                    self.wasted_tokens += done;
                    self.remove_from_group(g, idx);
                    // A response a lane took in keeps its earlier tokens, but its
                    // cache is lost with the group.
                    let s = &mut self.seqs[idx];
                    s.gen = s.gen.wrapping_add(1);
                    if s.done > 0 {
                        s.prefill = s.ctx0;
                        s.restore_s = 0.0;
                    }
                }
                self.requeue(idx);
            }
        }
        let grp = &mut self.groups[g];
        grp.kind = None;
        grp.debt = 0.0;
        grp.stamp += 1;
        let pool = &mut self.pools[p];
        pool.members.retain(|&x| x != g);
        if pool.roles.iter().any(|r| {
            self.w
                .job
                .memory(r)
                .is_some_and(|m| m.sharding == Sharding::Pool)
        }) {
            pool.reshard = true;
        }
        match pool.phase {
            PoolPhase::Busy { until, .. } if until > self.now => until,
            _ => self.now,
        }
    }

    fn group_join(&mut self, g: usize, p: usize, migration: u64) {
        self.groups[g].pool = Some(p);
        self.groups[g].last = self.now;
        self.pools[p].members.push(g);
        // A pool that is decoding takes the newcomer into its batch at once (a pool in
        // a pass uses it from its next pass).
        if let PoolPhase::Decode(kind) = self.pools[p].phase {
            self.start_decoding(g, kind);
            self.refill(g);
            self.reschedule(g);
        }
        if let Some((id, left)) = self.migration {
            if id == migration {
                if left <= 1 {
                    self.migration = None;
                    self.finish_migration(id);
                } else {
                    self.migration = Some((id, left - 1));
                }
            }
        }
        self.pool_kick(p);
        self.kick_all();
    }

    fn finish_migration(&mut self, id: u64) {
        if let Some(mut policy) = self.policy.take() {
            let _ = policy.on_event(Event::MigrationDone { id });
            self.policy = Some(policy);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::inventory::GroupId;
    use crate::plan::Pool;
    use crate::profile::ModelSpec;
    use crate::workload::LengthDist;

    fn world() -> World {
        let m = ModelSpec::preset("1b").unwrap();
        World {
            gpu: GpuSpec::preset("h100").unwrap(),
            truth: Efficiency::default(),
            job: JobShape::new(m.clone(), RewardKind::Generative { model: m }, 4096),
            workload: WorkloadSpec {
                steps: 6,
                prompts_per_step: 32,
                samples_per_prompt: 8,
                prompt_len: 256,
                response: LengthDist::Lognormal {
                    median: 600.0,
                    sigma: 0.8,
                },
                max_response: 4096,
                growth: 1.0,
                group_correlation: 0.0,
                dynamic_sampling: None,
                judge: Some(LengthDist::Lognormal {
                    median: 100.0,
                    sigma: 0.3,
                }),
                judge_max: 512,
                judge_prompt: 64,
                seed: 3,
                scale_by_step: Vec::new(),
                partial_rollout: None,
            },
            group_devices: 1,
            groups: 4,
            rates: None,
        }
    }

    fn plan(rollout: &[u32], reward: &[u32], rest: &[u32]) -> Plan {
        let pool = |roles: &[Role], ids: &[u32]| Pool {
            roles: RoleSet::of(roles),
            groups: ids.iter().map(|i| GroupId(*i)).collect(),
        };
        Plan {
            pools: vec![
                pool(&[Role::Rollout], rollout),
                pool(&[Role::Reward], reward),
                pool(&[Role::Reference, Role::Policy], rest),
            ],
            // Small batches keep a queue waiting, so a newcomer has work to take.
            rollout_batch_cap: Some(32),
            lanes: None,
        }
    }

    #[test]
    fn a_group_moved_into_a_decoding_pool_decodes() {
        let w = world();
        let mut sim = Sim::new(&w, &plan(&[0], &[1, 2], &[3]), 1, None);
        sim.open_steps();
        sim.kick_all();
        while sim.now < 5.0 && sim.next_event() {}
        // Group 2 leaves the judge for the rollout, which is mid-batch.
        sim.migrate(&plan(&[0, 2], &[1], &[3]), 1);
        let at = sim.now;
        let before = sim.groups[2].compute_s;
        while sim.now < at + 200.0 && sim.next_event() {}
        assert_eq!(sim.groups[2].pool, Some(0));
        assert!(
            sim.groups[2].compute_s > before + 10.0,
            "the moved group decoded {:.1} s in 200 s",
            sim.groups[2].compute_s - before
        );
        assert!(sim.migration.is_none(), "the migration finished");
    }

    #[test]
    fn every_step_finishes_and_time_adds_up() {
        let w = world();
        let r = Sim::new(&w, &plan(&[0, 1], &[2], &[3]), 1, None).run();
        assert_eq!(r.step_s.len(), 6);
        assert!((r.step_s.iter().sum::<f64>() - r.makespan_s).abs() < 1e-6);
        assert!(r.trained_tokens > 0.0);
        assert!(r.idle_frac >= 0.0 && r.compute_frac > 0.0);
    }

    // ---- partial rollouts ----------------------------------------------------------

    /// A long-tail world: most responses short, a few long, every group kept unless
    /// `drop` says otherwise, a rule reward (no judge) so token counts are exact.
    fn long_tail(partial: Option<PartialRollout>, drop: Option<f64>) -> World {
        let mut w = world();
        w.job = JobShape::new(w.job.policy.clone(), RewardKind::Rule, 8192);
        w.workload.steps = 8;
        w.workload.prompts_per_step = 16;
        w.workload.samples_per_prompt = 4;
        w.workload.max_response = 8192;
        w.workload.response = LengthDist::Lognormal {
            median: 300.0,
            sigma: 1.2,
        };
        w.workload.judge = None;
        w.workload.dynamic_sampling = drop.map(|d| crate::workload::DynamicSampling {
            drop_start: d,
            drop_end: d,
        });
        w.workload.partial_rollout = partial;
        w
    }

    fn colocated(w: &World) -> Plan {
        let pool = Pool {
            roles: RoleSet::of(&[Role::Rollout, Role::Reference, Role::Policy]),
            groups: (0..w.groups).map(GroupId).collect(),
        };
        Plan {
            pools: vec![pool],
            rollout_batch_cap: Some(32),
            lanes: None,
        }
    }

    fn split() -> Plan {
        let pool = |roles: &[Role], ids: &[u32]| Pool {
            roles: RoleSet::of(roles),
            groups: ids.iter().map(|i| GroupId(*i)).collect(),
        };
        Plan {
            pools: vec![
                pool(&[Role::Rollout], &[0, 1, 2]),
                pool(&[Role::Reference, Role::Policy], &[3]),
            ],
            rollout_batch_cap: Some(32),
            lanes: None,
        }
    }

    fn partial(beyond_bound: BeyondBound, resume: Resume) -> Option<PartialRollout> {
        Some(PartialRollout {
            cutoff: 0.75,
            reserve: 0,
            resume,
            beyond_bound,
        })
    }

    /// The groups every step should train: the lower bound's.
    fn expected_groups(w: &World) -> Vec<(u32, u32)> {
        (0..w.workload.steps)
            .flat_map(|k| {
                (0..w.workload.batch_groups(k))
                    .filter(move |&i| w.workload.group(k, i).keep)
                    .map(move |i| (k, i))
            })
            .collect()
    }

    fn trained_set(r: &RunResult) -> Vec<(u32, u32)> {
        let mut v: Vec<(u32, u32)> = r.trained_groups.iter().map(|g| (g.0, g.1)).collect();
        v.sort_unstable();
        v
    }

    #[test]
    fn a_paused_response_keeps_its_tokens_and_context() {
        let w = long_tail(partial(BeyondBound::Wait, Resume::Kv), None);
        let mut sim = Sim::new(&w, &colocated(&w), 1, None);
        sim.open_steps();
        sim.kick_all();
        while sim.now < 2.0 && sim.next_event() {}
        let g = (0..w.groups as usize)
            .find(|&g| !sim.in_flight(g).is_empty())
            .expect("a group decodes");
        sim.advance(g);
        let idx = sim.in_flight(g)[0];
        let before = sim.seqs[idx].clone();
        let progress = (sim.groups[g].iter - before.start_iter).floor() as u32;
        assert!(progress > 0, "it generated something in 2 s");
        sim.suspend(g, idx, true);
        let s = &sim.seqs[idx];
        assert_eq!(s.done, progress);
        assert_eq!(s.total_len(), before.total_len());
        assert_eq!(s.ctx0, before.ctx0 + progress);
        assert_eq!(s.prefill, 0, "its cache is restored, not prefilled");
        assert!(s.restore_s > 0.0);
        assert!(!sim.in_flight(g).contains(&idx));
        // Without its cache it prefills the prompt and the tokens so far.
        let other = sim.in_flight(g)[0];
        sim.suspend(g, other, false);
        let s = &sim.seqs[other];
        assert_eq!(s.prefill, s.ctx0);
        assert_eq!(s.restore_s, 0.0);
    }

    #[test]
    fn a_carried_response_finishes_in_a_later_step_with_its_whole_length() {
        for resume in [Resume::Kv, Resume::Reprefill] {
            let w = long_tail(partial(BeyondBound::Wait, resume), None);
            let r = Sim::new(&w, &colocated(&w), 1, None).synchronous().run();
            let carried: Vec<_> = r.trained_groups.iter().filter(|g| g.2 > g.0).collect();
            assert!(
                !carried.is_empty(),
                "{resume:?}: the cutoff carried nothing"
            );
            assert!(carried.iter().all(|g| g.2 == g.0 + 1), "{carried:?}");
            // No group is thrown away here (no dynamic sampling, nothing surplus), so
            // every generated token belongs to a trained response: a carried response
            // generated exactly its length over its segments (a pause may repeat the
            // fraction of a token it was in).
            let lengths: f64 = expected_groups(&w)
                .iter()
                .flat_map(|&(k, i)| w.workload.group(k, i).lengths)
                .map(f64::from)
                .sum();
            assert_eq!(r.wasted_frac, 0.0, "{resume:?}");
            let extra = r.generated_tokens / lengths - 1.0;
            assert!((0.0..1e-3).contains(&extra), "{resume:?}: {extra}");
            if resume == Resume::Reprefill {
                assert!(r.reprefill_frac > 0.0, "re-prefill is paid for");
            } else {
                assert_eq!(r.reprefill_frac, 0.0);
            }
        }
    }

    #[test]
    fn every_group_trains_exactly_once_with_or_without_partial_rollouts() {
        for drop in [None, Some(0.3)] {
            let plain = long_tail(None, drop);
            let want = expected_groups(&plain);
            for (name, plan, staleness) in
                [("colocated", colocated(&plain), 0), ("split", split(), 1)]
            {
                let r = Sim::new(&plain, &plan, staleness, None).run();
                assert_eq!(trained_set(&r), want, "{name} without partial rollouts");
                assert_eq!(r.trained_groups.len(), want.len(), "{name}: trained twice");
                for rule in [BeyondBound::Wait, BeyondBound::Regenerate] {
                    let w = long_tail(partial(rule, Resume::Kv), drop);
                    let sim = Sim::new(&w, &plan, 1, None);
                    let sim = if staleness == 0 {
                        sim.synchronous()
                    } else {
                        sim
                    };
                    let r = sim.run();
                    assert_eq!(trained_set(&r), want, "{name}, {rule:?}");
                    assert_eq!(r.trained_groups.len(), want.len(), "{name}: trained twice");
                    assert_eq!(r.step_s.len(), 8);
                }
            }
        }
    }

    #[test]
    fn no_group_trains_beyond_the_staleness_bound() {
        for rule in [BeyondBound::Wait, BeyondBound::Regenerate] {
            for (plan, staleness) in [(split(), 1), (split(), 2)] {
                let w = long_tail(partial(rule, Resume::Kv), Some(0.2));
                let r = Sim::new(&w, &plan, staleness, None).run();
                assert!(
                    r.max_lag <= staleness,
                    "{rule:?}: lag {} beyond {staleness}",
                    r.max_lag
                );
                if rule == BeyondBound::Wait {
                    assert_eq!(r.stale_frac, 0.0, "waiting throws nothing away");
                }
            }
        }
        // Regenerating throws tokens away, and says so.
        let w = long_tail(partial(BeyondBound::Regenerate, Resume::Kv), None);
        let r = Sim::new(&w, &colocated(&w), 1, None).synchronous().run();
        assert!(r.max_lag <= 1);
        assert!(r.stale_frac > 0.0 && r.stale_frac <= r.wasted_frac);
    }

    #[test]
    fn partial_rollouts_cut_the_step_time_on_a_long_tail() {
        let plain = long_tail(None, None);
        let with = long_tail(partial(BeyondBound::Wait, Resume::Kv), None);
        // Synchronous colocation: the cutoff lets the step train without its tail.
        let before = Sim::new(&plain, &colocated(&plain), 0, None).run();
        let after = Sim::new(&with, &colocated(&with), 1, None)
            .synchronous()
            .run();
        let colocated_ratio = after.makespan_s / before.makespan_s;
        // A one-step pipeline on a split: groups complete early are scored at once
        // instead of waiting for the stragglers issued before them.
        let before = Sim::new(&plain, &split(), 1, None).run();
        let after = Sim::new(&with, &split(), 1, None).run();
        let split_ratio = after.makespan_s / before.makespan_s;
        eprintln!("step time with partial rollouts: colocated {colocated_ratio:.3}, split {split_ratio:.3}");
        assert!(colocated_ratio < 0.9, "colocated: {colocated_ratio:.3}");
        assert!(split_ratio < 0.9, "split: {split_ratio:.3}");
    }

    // ---- straggler lanes -------------------------------------------------------------

    /// `split()` with its last rollout group as a lane.
    fn split_with_lane(batch: u32, threshold: u32) -> Plan {
        let mut p = split();
        p.lanes = Some(Lanes {
            groups: 1,
            batch,
            threshold,
        });
        p
    }

    /// Context of the straggler test's sequences before they decode: long, as a
    /// straggler's is (decoding is then bound by reading the batch's KV cache).
    const STRAGGLER_CTX: u32 = 6000;

    /// Runs a batch of 31 long fillers and one straggler of `len` tokens (queued first)
    /// on `plan`, with no controller; returns the straggler's finish time and the
    /// simulation.
    fn run_straggler<'w>(w: &'w World, plan: &Plan, len: u32) -> (f64, Sim<'w>) {
        let mut sim = Sim::new(w, plan, 1, None);
        let prompt = STRAGGLER_CTX;
        let idx = sim.push_seq(Seq::new(0, 0, Kind::Gen, prompt, len, 0));
        for i in 0..31 {
            sim.push_seq(Seq::new(0, 1 + i, Kind::Gen, prompt, 4 * len, 0));
        }
        sim.kick_all();
        while sim.seqs[idx].alive && sim.next_event() {}
        assert!(!sim.seqs[idx].alive, "the straggler finished");
        (sim.now, sim)
    }

    #[test]
    fn a_lane_cuts_a_single_stragglers_time_by_the_roofline_ratio() {
        let w = long_tail(None, None);
        let only = |plan: &Plan| {
            let mut p = plan.clone();
            // One ordinary group, so the straggler shares its batch with every filler.
            p.pools[0].groups = vec![GroupId(0), GroupId(1)];
            p.pools[1].groups = vec![GroupId(2), GroupId(3)];
            p
        };
        let (len, threshold) = (4000, 500);
        let mut plain = only(&split());
        plain.pools[0].groups = vec![GroupId(0)];
        plain.pools[1].groups = vec![GroupId(1), GroupId(2), GroupId(3)];
        let (t0, _) = run_straggler(&w, &plain, len);
        let (t1, sim) = run_straggler(&w, &only(&split_with_lane(1, threshold)), len);
        // The straggler, then (as it finishes) the first filler waiting for the lane.
        assert_eq!(
            sim.lane_moves, 2,
            "a lane of one takes one response at a time"
        );
        // The same roofline for both: 32 sequences with their prompts, then the
        // straggler alone with its prompt and `threshold` tokens of context.
        let c = DecodeCoeffs::roofline(&w.job.policy, &w.gpu, w.group_devices, &w.truth);
        let p = f64::from(STRAGGLER_CTX);
        let prefill = 32.0 * p * c.prefill;
        let batch = c.iteration(32.0, 32.0 * p);
        let kv = w.job.policy.kv_bytes_per_token() * (p + f64::from(threshold))
            / (f64::from(w.group_devices) * w.gpu.net_bytes_per_s);
        let want0 = prefill + f64::from(len) * batch;
        let want1 = prefill
            + f64::from(threshold) * batch
            + kv
            + f64::from(len - threshold) * c.iteration(1.0, p + f64::from(threshold));
        assert!((t0 - want0).abs() < 1e-6 * want0, "{t0} vs {want0}");
        assert!((t1 - want1).abs() < 1e-6 * want1, "{t1} vs {want1}");
        assert!(t0 / t1 > 2.0, "the lane cut it only {:.2}x", t0 / t1);
        assert!(
            kv > 0.0 && sim.lane_transfer_s > kv,
            "both moves brought a cache"
        );
    }

    #[test]
    fn a_straggler_waits_on_its_group_while_the_lanes_are_full_then_moves() {
        let w = long_tail(None, None);
        let mut plan = split_with_lane(1, 500);
        plan.pools[0].groups = vec![GroupId(0), GroupId(1)];
        plan.pools[1].groups = vec![GroupId(2), GroupId(3)];
        let (_, mut sim) = run_straggler(&w, &plan, 4000);
        // The fillers crossed the threshold with the straggler and waited for the
        // lane, decoding where they were; the first of them moves once it is free.
        assert_eq!(sim.lane_moves, 2);
        assert_eq!(sim.groups[1].b, 1, "the lane holds its batch of one");
        assert_eq!(sim.groups[0].b, 30, "the rest decode where they were");
        while sim.next_event() {}
        assert!(sim.seqs.iter().all(|s| !s.alive), "every response finished");
        // One at a time, the lane takes some; the others finish where they waited.
        assert!(
            sim.lane_moves > 2 && sim.lane_moves < 32,
            "{} moves",
            sim.lane_moves
        );
    }

    #[test]
    fn every_group_trains_exactly_once_with_lanes() {
        for partial_rollout in [
            None,
            partial(BeyondBound::Wait, Resume::Kv),
            partial(BeyondBound::Wait, Resume::Reprefill),
            partial(BeyondBound::Regenerate, Resume::Kv),
        ] {
            for drop in [None, Some(0.3)] {
                let w = long_tail(partial_rollout, drop);
                let want = expected_groups(&w);
                let r = Sim::new(&w, &split_with_lane(4, 600), 1, None).run();
                assert_eq!(trained_set(&r), want, "{partial_rollout:?}, drop {drop:?}");
                assert_eq!(r.trained_groups.len(), want.len(), "trained twice");
                assert!(r.lane_moves > 0, "some response passed 600 tokens");
                if partial_rollout.is_some_and(|p| p.resume == Resume::Reprefill) {
                    assert!(r.reprefill_frac > 0.0, "moved responses prefill again");
                }
            }
        }
    }

    #[test]
    fn lanes_change_hands_in_a_migration_without_losing_a_response() {
        let w = long_tail(None, None);
        let mut sim = Sim::new(&w, &split_with_lane(2, 300), 1, None);
        sim.open_steps();
        sim.kick_all();
        while sim.now < 30.0 && sim.next_event() {}
        // The lane becomes an ordinary group, then the rollout loses it.
        sim.migrate(&split(), 1);
        while sim.now < 60.0 && sim.next_event() {}
        let mut fewer = split();
        fewer.pools[0].groups = vec![GroupId(0), GroupId(1)];
        fewer.pools[1].groups = vec![GroupId(2), GroupId(3)];
        sim.migrate(&fewer, 2);
        while sim.step_done < w.workload.steps && sim.next_event() {}
        assert_eq!(sim.step_done, w.workload.steps, "every step finished");
        let r = sim.finish(Vec::new());
        assert_eq!(trained_set(&r), expected_groups(&w));
    }
}
