use super::*;
use crate::inventory::GroupId;
use crate::plan::Pool;
use crate::profile::{Efficiency, GpuSpec, JobShape, ModelSpec};
use crate::workload::{LengthDist, WorkloadSpec};

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
    let mut sim = Sim::new(&w, &plan(&[0], &[1, 2], &[3]), 1);
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

/// A placer that moves group 2 from the judge to the rollout after the first step
/// and records what it was told.
struct MoveOnce {
    told: Vec<String>,
}

impl Placer for MoveOnce {
    fn on_event(&mut self, event: Event) -> Vec<Decision> {
        let first = self.told.is_empty();
        self.told.push(match &event {
            Event::Metrics(m) => format!("metrics {}", m.step),
            Event::MigrationDone { id } => format!("done {id}"),
            other => format!("{other:?}"),
        });
        if !first {
            return Vec::new();
        }
        let (from, to) = (plan(&[0], &[1, 2], &[3]), plan(&[0, 2], &[1], &[3]));
        vec![Decision::Migrate(crate::events::Migration {
            id: 7,
            reason: crate::events::Reason::Rebalance,
            moves: from.moves_to(&to),
            target: to,
            predicted_s: (1.0, 0.5),
            cost_s: 0.1,
        })]
    }

    fn take_log(&mut self) -> Vec<String> {
        std::mem::take(&mut self.told)
    }
}

#[test]
fn any_placer_drives_the_engine_and_keeps_what_it_learnt() {
    let w = world();
    let mut placer = MoveOnce { told: Vec::new() };
    let r = Sim::new(&w, &plan(&[0], &[1, 2], &[3]), 1)
        .driven_by(&mut placer)
        .run();
    assert_eq!(r.migrations, 1);
    assert_eq!(r.plans.len(), 2, "{:?}", r.plans);
    assert_eq!(r.plans[1], (1, plan(&[0, 2], &[1], &[3]).summary()));
    // Its log is the run's: one line per event, each step's metrics and the
    // migration's outcome.
    assert_eq!(r.log.first().map(String::as_str), Some("metrics 0"));
    assert!(r.log.iter().any(|l| l == "done 7"), "{:?}", r.log);
    assert_eq!(r.log.iter().filter(|l| l.starts_with("metrics")).count(), 6);
}

#[test]
fn every_step_finishes_and_time_adds_up() {
    let w = world();
    let r = Sim::new(&w, &plan(&[0, 1], &[2], &[3]), 1).run();
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
    let mut sim = Sim::new(&w, &colocated(&w), 1);
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
        let r = Sim::new(&w, &colocated(&w), 1).synchronous().run();
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
        for (name, plan, staleness) in [("colocated", colocated(&plain), 0), ("split", split(), 1)]
        {
            let r = Sim::new(&plain, &plan, staleness).run();
            assert_eq!(trained_set(&r), want, "{name} without partial rollouts");
            assert_eq!(r.trained_groups.len(), want.len(), "{name}: trained twice");
            for rule in [BeyondBound::Wait, BeyondBound::Regenerate] {
                let w = long_tail(partial(rule, Resume::Kv), drop);
                let sim = Sim::new(&w, &plan, 1);
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
            let r = Sim::new(&w, &plan, staleness).run();
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
    let r = Sim::new(&w, &colocated(&w), 1).synchronous().run();
    assert!(r.max_lag <= 1);
    assert!(r.stale_frac > 0.0 && r.stale_frac <= r.wasted_frac);
}

#[test]
fn partial_rollouts_cut_the_step_time_on_a_long_tail() {
    let plain = long_tail(None, None);
    let with = long_tail(partial(BeyondBound::Wait, Resume::Kv), None);
    // Synchronous colocation: the cutoff lets the step train without its tail.
    let before = Sim::new(&plain, &colocated(&plain), 0).run();
    let after = Sim::new(&with, &colocated(&with), 1).synchronous().run();
    let colocated_ratio = after.makespan_s / before.makespan_s;
    // A one-step pipeline on a split: groups complete early are scored at once
    // instead of waiting for the stragglers issued before them.
    let before = Sim::new(&plain, &split(), 1).run();
    let after = Sim::new(&with, &split(), 1).run();
    let split_ratio = after.makespan_s / before.makespan_s;
    eprintln!(
        "step time with partial rollouts: colocated {colocated_ratio:.3}, split {split_ratio:.3}"
    );
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
    let mut sim = Sim::new(w, plan, 1);
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
            let r = Sim::new(&w, &split_with_lane(4, 600), 1).run();
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
    let mut sim = Sim::new(&w, &split_with_lane(2, 300), 1);
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
