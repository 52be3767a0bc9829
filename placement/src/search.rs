//! Plan search: which roles share pools, and how many groups each pool gets.
//!
//! For every way of partitioning the job's GPU roles into pools (52 for five roles),
//! the search gives each pool the fewest groups its memory needs, hands out the rest
//! greedily to whichever pool lowers the predicted step time most, then improves the
//! counts by local search (moving blocks of groups between pools while that helps).
//! Groups are treated as interchangeable; [`assign`] then picks concrete groups,
//! keeping as many where they are as it can so a migration moves few.

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use crate::cost::{CostModel, Prediction, Shape};
use crate::inventory::{GroupId, Inventory};
use crate::plan::{check_lane_memory, check_pool_memory, Lanes, Plan, Pool};
use crate::profile::{Role, RoleSet};
use crate::workload::Forecast;

/// What the search may hand out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Space {
    /// Groups available.
    pub groups: u32,
    /// Devices per group.
    pub group_devices: u32,
    /// Device memory (the smallest of any group), bytes.
    pub device_mem: f64,
    /// Host memory per device (the smallest), bytes.
    pub host_mem: f64,
}

impl Space {
    /// The space of an inventory.
    pub fn of(inv: &Inventory) -> Space {
        Space {
            groups: inv.len() as u32,
            group_devices: inv.group_size(),
            device_mem: inv.min_device_memory(),
            host_mem: inv.min_host_memory(),
        }
    }
}

/// The best shape found.
#[derive(Debug, Clone, PartialEq)]
pub struct Found {
    /// Roles per pool and group counts.
    pub shape: Shape,
    /// Its predicted step.
    pub prediction: Prediction,
    /// How many shapes the search evaluated.
    pub evaluated: u64,
}

/// Straggler lanes the search may propose (see [`Lanes`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct LaneSearch {
    /// Most responses one lane decodes at once; the search tries this batch and a
    /// quarter of it.
    pub batch: u32,
    /// Generated tokens after which a response moves to a lane; none: chosen from the
    /// workload forecast.
    pub threshold: Option<u32>,
}

/// Lane variants of a shape whose rollout streams in a pool of its own: a few lane
/// counts (an eighth and a quarter of the rollout's groups) and batches (`ls.batch`
/// and a quarter of it), each with thresholds from the forecast (the lengths that
/// about 2 and 8 lane batches of each step's responses pass) unless `ls` fixes one.
/// Lane batches that do not fit memory are left out.
pub fn lane_variants(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    shape: &Shape,
    ls: LaneSearch,
) -> Vec<Shape> {
    let alone = RoleSet::of(&[Role::Rollout]);
    let Some(&(_, rollout)) = shape.pools.iter().find(|p| p.0 == alone) else {
        return Vec::new();
    };
    if cm.setup().staleness == 0 {
        return Vec::new();
    }
    let n_gen = f.generated_samples().max(1.0);
    let max = f64::from(f.params.max_response);
    let mut out: Vec<Shape> = Vec::new();
    let mut counts = vec![(rollout / 8).max(1), (rollout / 4).max(1)];
    counts.dedup();
    let mut batches = vec![ls.batch, (ls.batch / 4).max(1)];
    batches.dedup();
    for batch in batches {
        let job = &cm.setup().job;
        if check_lane_memory(job, batch, space.group_devices, space.device_mem).is_err() {
            continue;
        }
        for &groups in counts.iter().filter(|&&n| n < rollout) {
            let thresholds: Vec<u32> = match ls.threshold {
                Some(t) => vec![t],
                None => [2.0, 8.0]
                    .iter()
                    .map(|c| {
                        let share = (c * f64::from(groups * batch) / n_gen).min(0.5);
                        let t = f.len_quantile(1.0 - share).min(max * 0.75);
                        ((t / 64.0).round() * 64.0).max(256.0) as u32
                    })
                    .collect(),
            };
            for threshold in thresholds {
                let mut s = shape.clone();
                s.lanes = Some(Lanes {
                    groups,
                    batch,
                    threshold,
                });
                if !out.contains(&s) {
                    out.push(s);
                }
            }
        }
    }
    out
}

/// Every partition of `roles` into non-empty pools.
pub fn partitions(roles: RoleSet) -> Vec<Vec<RoleSet>> {
    let list: Vec<_> = roles.iter().collect();
    let mut out = Vec::new();
    let mut current: Vec<RoleSet> = Vec::new();
    fn rec(
        list: &[crate::profile::Role],
        i: usize,
        current: &mut Vec<RoleSet>,
        out: &mut Vec<Vec<RoleSet>>,
    ) {
        if i == list.len() {
            out.push(current.clone());
            return;
        }
        for k in 0..current.len() {
            current[k].insert(list[i]);
            rec(list, i + 1, current, out);
            current[k] = RoleSet::of(
                &current[k]
                    .iter()
                    .filter(|r| *r != list[i])
                    .collect::<Vec<_>>(),
            );
        }
        current.push(RoleSet::of(&[list[i]]));
        rec(list, i + 1, current, out);
        current.pop();
    }
    rec(&list, 0, &mut current, &mut out);
    out
}

/// The fewest groups a pool of `roles` needs to fit memory, if any count fits.
fn min_groups(cm: &CostModel, roles: RoleSet, space: &Space) -> Option<u32> {
    let job = &cm.setup().job;
    let fits = |n: u32| {
        check_pool_memory(
            job,
            roles,
            space.group_devices,
            n * space.group_devices,
            space.device_mem,
            space.host_mem,
        )
        .is_ok()
    };
    if !fits(space.groups) {
        return None;
    }
    // Fitting only gets easier with more groups (sharded state shrinks): bisect.
    let (mut lo, mut hi) = (1, space.groups);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if fits(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    Some(lo)
}

/// Searches every pool structure for the shape with the lowest predicted step time.
/// Returns none when no structure fits in memory.
pub fn search(cm: &CostModel, f: &Forecast, space: &Space) -> Option<Found> {
    let structures = partitions(cm.setup().job.gpu_roles());
    search_structures(cm, f, space, &structures)
}

/// Like [`search_top`], with straggler lanes when `lanes` allows them: each shape
/// whose rollout streams in a pool of its own also comes with its lane variants,
/// ranked by the same cost model.
pub fn search_top_lanes(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    k: usize,
    lanes: Option<LaneSearch>,
) -> Vec<Found> {
    let structures = partitions(cm.setup().job.gpu_roles());
    let mut all = search_ranked(cm, f, space, &structures);
    if let Some(ls) = lanes {
        let mut more = Vec::new();
        for found in &all {
            for s in lane_variants(cm, f, space, &found.shape, ls) {
                let prediction = cm.predict(&s, f);
                more.push(Found {
                    shape: s,
                    prediction,
                    evaluated: found.evaluated,
                });
            }
        }
        all.extend(more);
        all.sort_by(|a, b| a.prediction.step_s.total_cmp(&b.prediction.step_s));
    }
    all.truncate(k.max(1));
    all
}

/// Like [`search`], over the given pool structures only.
pub fn search_structures(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    structures: &[Vec<RoleSet>],
) -> Option<Found> {
    search_ranked(cm, f, space, structures).into_iter().next()
}

/// The best shape of every pool structure (and batch cap), best first: candidates for
/// a closer look by simulation.
pub fn search_top(cm: &CostModel, f: &Forecast, space: &Space, k: usize) -> Vec<Found> {
    search_top_lanes(cm, f, space, k, None)
}

/// Like [`search_top`], over the given pool structures and rollout batch caps only: what
/// a live executor can carry out.
pub fn search_top_in(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    structures: &[Vec<RoleSet>],
    caps: &[Option<u32>],
    k: usize,
) -> Vec<Found> {
    let mut all = search_ranked_caps(cm, f, space, structures, Some(caps));
    all.truncate(k.max(1));
    all
}

fn search_ranked(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    structures: &[Vec<RoleSet>],
) -> Vec<Found> {
    search_ranked_caps(cm, f, space, structures, None)
}

fn search_ranked_caps(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    structures: &[Vec<RoleSet>],
    fixed_caps: Option<&[Option<u32>]>,
) -> Vec<Found> {
    let mut all: Vec<Found> = Vec::new();
    let mut evaluated = 0;
    let alone = RoleSet::of(&[crate::profile::Role::Rollout]);
    let job = &cm.setup().job;
    for roles in structures {
        // In a pipeline a decoding engine that takes turns with other roles must drain
        // its batch at every turn, which undoes the pipeline; such pools are for the
        // on-policy regime only.
        if cm.setup().staleness > 0
            && roles
                .iter()
                .any(|p| p.len() > 1 && p.iter().any(|r| job.decodes(r)))
        {
            continue;
        }
        // A rollout with groups of its own streams across steps; there a smaller batch
        // can shorten the cycle more than it costs in throughput.
        let caps: &[Option<u32>] = if let Some(c) = fixed_caps {
            c
        } else if cm.setup().staleness > 0 && roles.contains(&alone) {
            &[None, Some(256), Some(128), Some(64), Some(32)]
        } else {
            &[None]
        };
        for &cap in caps {
            if let Some(found) = best_counts(cm, f, space, roles, cap, &mut evaluated) {
                all.push(found);
            }
        }
    }
    all.sort_by(|a, b| a.prediction.step_s.total_cmp(&b.prediction.step_s));
    for f in &mut all {
        f.evaluated = evaluated;
    }
    all
}

/// The best group counts for one structure.
fn best_counts(
    cm: &CostModel,
    f: &Forecast,
    space: &Space,
    roles: &[RoleSet],
    cap: Option<u32>,
    evaluated: &mut u64,
) -> Option<Found> {
    let mins: Vec<u32> = roles
        .iter()
        .map(|r| min_groups(cm, *r, space))
        .collect::<Option<_>>()?;
    let need: u32 = mins.iter().sum();
    if need > space.groups {
        return None;
    }
    let mut shape = Shape {
        pools: roles.iter().copied().zip(mins.iter().copied()).collect(),
        rollout_cap: cap,
        lanes: None,
    };
    let mut eval = |s: &Shape| {
        *evaluated += 1;
        cm.predict(s, f)
    };
    // Greedy: hand out the spare groups in blocks, each to the pool that gains most.
    let mut spare = space.groups - need;
    while spare > 0 {
        let block = (spare / 32).max(1);
        let mut choice: Option<(usize, f64)> = None;
        for i in 0..shape.pools.len() {
            shape.pools[i].1 += block;
            let t = eval(&shape).step_s;
            shape.pools[i].1 -= block;
            if choice.is_none_or(|c| t < c.1) {
                choice = Some((i, t));
            }
        }
        let (i, _) = choice.expect("at least one pool");
        shape.pools[i].1 += block;
        spare -= block;
    }
    // Local search: move blocks between pools while the step gets shorter.
    let mut current = eval(&shape);
    let mut block = (space.groups / 16).max(1);
    loop {
        let mut improved = false;
        for (from, &min_from) in mins.iter().enumerate() {
            for to in 0..shape.pools.len() {
                if from == to || shape.pools[from].1 < min_from + block {
                    continue;
                }
                shape.pools[from].1 -= block;
                shape.pools[to].1 += block;
                let p = eval(&shape);
                if p.step_s < current.step_s * (1.0 - 1e-9) {
                    current = p;
                    improved = true;
                } else {
                    shape.pools[from].1 += block;
                    shape.pools[to].1 -= block;
                }
            }
        }
        if !improved {
            if block == 1 {
                break;
            }
            block = (block / 2).max(1);
        }
    }
    Some(Found {
        shape,
        prediction: current,
        evaluated: 0,
    })
}

/// Turns a shape into a plan over concrete groups of `inv`, keeping every group that
/// can stay in a pool with the same roles in `current`, and filling each pool with
/// groups from nodes it already uses first (tensor- and data-parallel traffic stays
/// close).
pub fn assign(shape: &Shape, inv: &Inventory, current: Option<&Plan>) -> Plan {
    let live: BTreeSet<GroupId> = inv.groups().map(|g| g.id).collect();
    let mut taken = BTreeSet::new();
    let mut pools: Vec<Pool> = shape
        .pools
        .iter()
        .map(|(roles, n)| {
            let mut groups = Vec::new();
            if let Some(p) = current.and_then(|c| c.pools.iter().find(|p| p.roles == *roles)) {
                for g in &p.groups {
                    if groups.len() as u32 == *n {
                        break;
                    }
                    if live.contains(g) && taken.insert(*g) {
                        groups.push(*g);
                    }
                }
            }
            Pool {
                roles: *roles,
                groups,
            }
        })
        .collect();
    let mut free: Vec<GroupId> = live
        .iter()
        .filter(|g| !taken.contains(g))
        .copied()
        .collect();
    for (pool, (_, n)) in pools.iter_mut().zip(&shape.pools) {
        let want = (*n as usize).saturating_sub(pool.groups.len());
        if want == 0 {
            continue;
        }
        let nodes: BTreeSet<&str> = pool
            .groups
            .iter()
            .filter_map(|g| inv.group(*g).map(|g| g.node.as_str()))
            .collect();
        // Stable: groups on the pool's nodes first, then in id order.
        free.sort_by_key(|g| {
            let near = inv
                .group(*g)
                .is_some_and(|x| nodes.contains(x.node.as_str()));
            (!near, *g)
        });
        let take: Vec<GroupId> = free.drain(..want.min(free.len())).collect();
        pool.groups.extend(take);
        pool.groups.sort();
    }
    Plan {
        pools,
        rollout_batch_cap: shape.rollout_cap,
        lanes: shape.lanes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cost::CostSetup;
    use crate::profile::{GpuSpec, JobShape, ModelSpec, RewardKind, Role};
    use crate::workload::ForecastParams;

    fn model(staleness: u32, size: &str, group: u32) -> CostModel {
        let m = ModelSpec::preset(size).unwrap();
        CostModel::new(
            CostSetup {
                job: JobShape::new(m.clone(), RewardKind::Generative { model: m }, 16384),
                gpu: GpuSpec::preset("h100").unwrap(),
                group_devices: group,
                staleness,
                partial_rollout: None,
            },
            forecast(),
        )
    }

    fn forecast() -> ForecastParams {
        ForecastParams::lognormal(512, 16, 1500.0, 1.0, 16384)
            .with_drop(0.2)
            .with_judge(300.0, 0.5, 2048)
    }

    fn space(groups: u32, group: u32) -> Space {
        let h = GpuSpec::preset("h100").unwrap();
        Space {
            groups,
            group_devices: group,
            device_mem: h.memory_bytes,
            host_mem: h.host_memory_bytes,
        }
    }

    #[test]
    fn partitions_are_bell_numbers() {
        let r = RoleSet::of(&[Role::Rollout, Role::Reward, Role::Reference, Role::Policy]);
        let p = partitions(r);
        assert_eq!(p.len(), 15);
        assert!(p.iter().all(|parts| {
            parts.iter().fold(RoleSet::EMPTY, |a, b| a.union(*b)) == r
                && parts.iter().map(|x| x.len()).sum::<usize>() == 4
        }));
        assert_eq!(partitions(RoleSet::of(&Role::ALL)).len(), 52);
    }

    #[test]
    fn search_beats_every_single_move_and_respects_memory() {
        let cm = model(1, "70b", 8);
        let f = Forecast::new(forecast());
        let sp = space(64, 8);
        let found = search(&cm, &f, &sp).unwrap();
        assert_eq!(found.shape.groups(), 64);
        // The policy pool holds 70B of training state: at least 2 groups of 8.
        let policy = found
            .shape
            .pools
            .iter()
            .find(|p| p.0.contains(Role::Policy))
            .unwrap();
        assert!(policy.1 >= 2, "{:?}", found.shape);
        // No single-group move improves on it.
        for from in 0..found.shape.pools.len() {
            for to in 0..found.shape.pools.len() {
                if from == to || found.shape.pools[from].1 <= 1 {
                    continue;
                }
                let mut s = found.shape.clone();
                s.pools[from].1 -= 1;
                s.pools[to].1 += 1;
                let fits = min_groups(&cm, s.pools[from].0, &sp).unwrap() <= s.pools[from].1;
                if fits {
                    assert!(cm.predict(&s, &f).step_s >= found.prediction.step_s * (1.0 - 1e-9));
                }
            }
        }
        // It beats full colocation.
        let full = Shape {
            pools: vec![(cm.setup().job.gpu_roles(), 64)],
            rollout_cap: None,
            lanes: None,
        };
        assert!(found.prediction.step_s < cm.predict(&full, &f).step_s);
    }

    #[test]
    fn nothing_fits_means_none() {
        let cm = model(1, "70b", 1);
        assert!(search(&cm, &Forecast::new(forecast()), &space(8, 1)).is_none());
    }

    #[test]
    fn assign_keeps_groups_in_place() {
        let h = GpuSpec::preset("h100").unwrap();
        let inv = Inventory::uniform(2, 8, 2, h.memory_bytes, h.host_memory_bytes).unwrap();
        let split = |rollout: u32, policy: u32| Shape {
            pools: vec![
                (RoleSet::of(&[Role::Rollout]), rollout),
                (RoleSet::of(&[Role::Policy]), policy),
            ],
            rollout_cap: None,
            lanes: None,
        };
        let a = assign(&split(5, 3), &inv, None);
        assert_eq!(a.pools[0].groups.len(), 5);
        let b = assign(&split(6, 2), &inv, Some(&a));
        let moves = a.moves_to(&b);
        assert_eq!(moves.len(), 1, "{moves:?}");
        assert!(a.pools[0]
            .groups
            .iter()
            .all(|g| b.pools[0].groups.contains(g)));
    }

    #[test]
    fn the_search_keeps_no_lanes_without_a_long_tail() {
        let cm = model(1, "7b", 2);
        let sp = space(32, 2);
        let ls = LaneSearch {
            batch: 8,
            threshold: None,
        };
        // Every response about as long as the others: nothing to wait for.
        let flat = Forecast::new(
            ForecastParams::lognormal(512, 16, 1500.0, 0.05, 16384)
                .with_drop(0.2)
                .with_judge(300.0, 0.5, 2048),
        );
        let best = &search_top_lanes(&cm, &flat, &sp, 1, Some(ls))[0];
        assert_eq!(best.shape.lanes, None, "{:?}", best.shape);
        // The variants exist and fit; they just lose.
        let variants = lane_variants(&cm, &flat, &sp, &best.shape, ls);
        assert!(!variants.is_empty());
        for v in &variants {
            let plan = assign(v, &Inventory::uniform(8, 8, 2, 80e9, 1e12).unwrap(), None);
            plan.validate(
                &Inventory::uniform(8, 8, 2, 80e9, 1e12).unwrap(),
                &cm.setup().job,
            )
            .unwrap();
            assert!(cm.predict(v, &flat).step_s > best.prediction.step_s);
        }
        // Without leave to use lanes the search is the plain one.
        let plain = search_top_lanes(&cm, &flat, &sp, 3, None);
        assert!(plain.iter().all(|f| f.shape.lanes.is_none()));
        assert_eq!(plain, search_top(&cm, &flat, &sp, 3));
    }

    #[test]
    fn lane_variants_need_a_rollout_of_its_own_and_memory() {
        let cm = model(1, "7b", 2);
        let sp = space(32, 2);
        let f = Forecast::new(forecast());
        let ls = LaneSearch {
            batch: 8,
            threshold: Some(3000),
        };
        let shared = Shape {
            pools: vec![
                (RoleSet::of(&[Role::Rollout, Role::Reward]), 20),
                (RoleSet::of(&[Role::Reference, Role::Policy]), 12),
            ],
            rollout_cap: None,
            lanes: None,
        };
        assert!(lane_variants(&cm, &f, &sp, &shared, ls).is_empty());
        let split = Shape {
            pools: vec![
                (RoleSet::of(&[Role::Rollout]), 16),
                (RoleSet::of(&[Role::Reward]), 6),
                (RoleSet::of(&[Role::Reference, Role::Policy]), 10),
            ],
            rollout_cap: None,
            lanes: None,
        };
        let v = lane_variants(&cm, &f, &sp, &split, ls);
        let lanes: Vec<_> = v
            .iter()
            .map(|s| s.lanes.unwrap())
            .map(|l| (l.groups, l.batch, l.threshold))
            .collect();
        assert_eq!(
            lanes,
            vec![(2, 8, 3000), (4, 8, 3000), (2, 2, 3000), (4, 2, 3000)]
        );
        // A lane batch of the longest contexts beyond the KV cache: only its quarter.
        let huge = LaneSearch {
            batch: 400,
            threshold: None,
        };
        let v = lane_variants(&cm, &f, &sp, &split, huge);
        assert!(!v.is_empty());
        assert!(v.iter().all(|s| s.lanes.unwrap().batch == 100), "{v:?}");
        // On-policy nothing streams, so lanes have nothing to shorten.
        assert!(lane_variants(&model(0, "7b", 2), &f, &sp, &split, ls).is_empty());
    }
}
