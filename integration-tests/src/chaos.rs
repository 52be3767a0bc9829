//! The chaos harness: a GRPO run with a data-parallel policy on a loopback cluster of
//! real `yatt-node` processes, while nodes are killed (`kill -9`) and restarted at
//! random points, the directory leader is killed once and a node is frozen (SIGSTOP
//! past the failure bound, then SIGCONT) once. The schedule comes from a seed: the same
//! seed replays the same faults at the same steps. What each fault cost is measured
//! from outside, as a user sees it: `/health` of the surviving nodes and the run's
//! `metrics.jsonl`.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::{cluster_logs, metric_of_steps, steps_done, Cluster, TrainProc};

/// How large a chaos run is: `YATT_CHAOS_SEED`, `YATT_CHAOS_KILLS`, `YATT_CHAOS_STEPS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChaosConfig {
    /// Seeds the schedule (and only the schedule: the run's own seed is the job's).
    pub seed: u64,
    /// Random `kill -9`s of a node (each restarted a little later); at least 6.
    pub kills: usize,
    /// Steps of the run.
    pub steps: u64,
}

impl ChaosConfig {
    /// The short run CI makes: 6 kills in 400 steps.
    pub const DEFAULT_KILLS: usize = 6;
    /// CI's seed. Not one from the clock, so that CI is deterministic: a failure
    /// replays. `YATT_CHAOS_SEED=random` draws a new schedule (the seeds that once
    /// cascaded, docs/benchmarks.md, pass since a fault waits for its predecessor's node).
    pub const DEFAULT_SEED: u64 = 1_795_695_693_460_619_874;
    /// Steps of the short run. A step of the test's tiny model takes about 0.08 s, and a
    /// fault waits for the node before it to be back (3-5 s, while a node that hosted no
    /// role does not stall the run), so 40 or 120 steps ended before the last fault
    /// struck; 400 leave room (6 seeds, docs/benchmarks.md).
    pub const DEFAULT_STEPS: u64 = 400;

    /// From the environment, with the defaults above (`YATT_CHAOS_SEED=random`: a seed
    /// from the clock). A value that does not parse, or a run too small for its faults, panics
    /// (a misconfigured chaos run fails, it never skips).
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let num = |name: &str, v: String| -> u64 {
            v.trim()
                .parse()
                .unwrap_or_else(|e| panic!("{name}={v:?} is not a whole number: {e}"))
        };
        let seed = match var("YATT_CHAOS_SEED").as_deref() {
            None => Self::DEFAULT_SEED,
            Some("random") => std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64),
            Some(v) => num("YATT_CHAOS_SEED", v.to_string()),
        };
        let kills = var("YATT_CHAOS_KILLS")
            .map_or(Self::DEFAULT_KILLS as u64, |v| num("YATT_CHAOS_KILLS", v));
        let steps =
            var("YATT_CHAOS_STEPS").map_or(Self::DEFAULT_STEPS, |v| num("YATT_CHAOS_STEPS", v));
        let c = ChaosConfig {
            seed,
            kills: kills as usize,
            steps,
        };
        c.check();
        c
    }

    /// Panics unless the run has at least 6 kills and room for every fault (4 steps
    /// each, and 4 at each end).
    pub fn check(&self) {
        assert!(
            self.kills >= Self::DEFAULT_KILLS,
            "YATT_CHAOS_KILLS={} but a chaos run kills at least {} nodes",
            self.kills,
            Self::DEFAULT_KILLS
        );
        let need = 4 * (self.kills as u64 + 2) + 8;
        assert!(
            self.steps >= need,
            "YATT_CHAOS_STEPS={} leaves no room for {} faults: use at least {need}",
            self.steps,
            self.kills + 2
        );
    }
}

/// A small deterministic generator (splitmix64): the schedule depends on the seed only.
#[derive(Debug, Clone)]
pub struct ChaosRng(u64);

impl ChaosRng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Self {
        ChaosRng(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A number in `0..n` (`n` > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// One fault.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// `kill -9` of node `node` (an index into the cluster), started again after
    /// `restart_after_ms` under the same name.
    Kill {
        /// The node's index.
        node: usize,
        /// When it comes back, after the kill.
        restart_after_ms: u64,
    },
    /// `kill -9` of whichever node leads the directory then, started again later.
    KillLeader {
        /// When it comes back, after the kill.
        restart_after_ms: u64,
    },
    /// SIGSTOP of node `node` until the others declare it dead, then SIGCONT.
    Freeze {
        /// The node's index.
        node: usize,
    },
}

/// A fault and when it strikes: once the run has recorded `after_step` steps, plus
/// `delay_ms` (a random point inside the next step).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Planned {
    /// Steps recorded before it.
    pub after_step: usize,
    /// Milliseconds after that.
    pub delay_ms: u64,
    /// What happens.
    pub fault: Fault,
}

/// The faults of a run of `config` over `nodes` nodes: `config.kills` kills of random
/// nodes, one leader kill and one freeze, each in its own stretch of the run, in order.
pub fn schedule(config: &ChaosConfig, nodes: usize) -> Vec<Planned> {
    let mut rng = ChaosRng::new(config.seed);
    let events = config.kills + 2;
    let (lo, hi) = (4u64, config.steps - 4);
    let slot = (hi - lo) / events as u64;
    // Which two stretches hold the leader kill and the freeze.
    let leader = rng.below(events as u64) as usize;
    let freeze = (leader + 1 + rng.below(events as u64 - 1) as usize) % events;
    (0..events)
        .map(|i| {
            let after_step =
                (lo + i as u64 * slot + rng.below(slot.saturating_sub(2).max(1))) as usize;
            let delay_ms = rng.below(120);
            let restart_after_ms = 200 + rng.below(1500);
            let fault = if i == leader {
                Fault::KillLeader { restart_after_ms }
            } else if i == freeze {
                Fault::Freeze {
                    node: rng.below(nodes as u64) as usize,
                }
            } else {
                Fault::Kill {
                    node: rng.below(nodes as u64) as usize,
                    restart_after_ms,
                }
            };
            Planned {
                after_step,
                delay_ms,
                fault,
            }
        })
        .collect()
}

/// What one fault cost, measured from outside.
#[derive(Debug, Clone)]
pub struct FaultRecord {
    /// `kill -9`, `kill -9 (leader)`, `SIGSTOP/SIGCONT`, `kill -9 (trainer)`.
    pub what: String,
    /// The node it struck.
    pub node: String,
    /// The job's roles that node hosted then (`policy`, `rollout`, ...).
    pub roles: Vec<String>,
    /// Seconds into the run.
    pub at_s: f64,
    /// Steps recorded when it struck.
    pub at_step: usize,
    /// Seconds until a surviving node no longer listed it alive.
    pub detected_s: Option<f64>,
    /// Seconds until the run recorded the step that recovered (with
    /// `recovery/respawned_roles`), or `None` when nothing had to be recovered.
    pub recovered_s: Option<f64>,
    /// That step's number and its recorded wall time.
    pub recovered_step: Option<(usize, f64)>,
    /// Steps whose work was done twice (the failed attempt of the recovered step, or
    /// the steps after the checkpoint for a resumed trainer).
    pub steps_lost: usize,
}

impl FaultRecord {
    /// The record as a row of a Markdown table (see [`table_header`]).
    pub fn row(&self) -> String {
        let s = |x: Option<f64>| x.map_or("–".to_string(), |v| format!("{v:.2}"));
        let roles = if self.roles.is_empty() {
            "none".to_string()
        } else {
            self.roles.join(", ")
        };
        let step = self
            .recovered_step
            .map_or("–".to_string(), |(n, t)| format!("{n} ({t:.2} s)"));
        format!(
            "| {} | {} | {} | {:.1} (step {}) | {} | {} | {} | {} |",
            self.what,
            self.node,
            roles,
            self.at_s,
            self.at_step + 1,
            s(self.detected_s),
            s(self.recovered_s),
            step,
            self.steps_lost
        )
    }
}

/// The header of the table [`FaultRecord::row`] fills.
pub fn table_header() -> String {
    "| fault | node | roles on it | time of fault, s | detected after, s | recovered after, s | recovered step (its wall time) | steps lost |\n|---|---|---|---|---|---|---|---|".into()
}

/// How long a fault waits to be seen declared dead before its node is brought back.
const DETECT_BOUND: Duration = Duration::from_secs(20);

/// A fault that struck, until its node is back and its loss recovered.
struct Watch {
    record: usize,
    victim: usize,
    struck: Instant,
    /// When the node comes back (`None`: a freeze, woken once declared dead).
    restart_after: Option<Duration>,
    /// Restarted or woken.
    revived: bool,
    /// Seen alive again after that.
    back: bool,
    /// Processes started to bring it back.
    starts: u32,
    /// When the last of them was found exited (its join failed).
    exited_at: Option<Instant>,
}

/// Runs `plan` against the run `train` writes to `out` on `cluster`; returns one
/// record per fault. One loop polls everything (every 20 ms): a fault strikes once the
/// run has recorded its step, its delay later, and once the loss before it was
/// recovered and its node is back (so at most one node is down at a time); a killed node is started again
/// when due, a frozen one woken once declared dead; detection and recovery are read
/// as they happen. Panics (with the logs) when the run stops, ends before every fault
/// struck, or a fault is not detected, recovered or undone within its bound.
pub fn inflict(
    cluster: &mut Cluster,
    train: &mut TrainProc,
    out: &Path,
    t0: Instant,
    plan: &[Planned],
) -> Vec<FaultRecord> {
    let mut records: Vec<FaultRecord> = Vec::new();
    let mut watches: Vec<Watch> = Vec::new();
    let mut next = 0;
    let mut armed: Option<Instant> = None;
    let deadline = Instant::now() + Duration::from_secs(60 + 30 * plan.len() as u64);
    fn fail(cluster: &Cluster, train: &TrainProc, why: String) -> ! {
        panic!("{why}\n{}\n{}", train.printed(), cluster_logs(cluster))
    }
    loop {
        if Instant::now() >= deadline {
            fail(cluster, train, "the chaos run took too long".into());
        }
        let done = steps_done(out);
        if next < plan.len() {
            if let Ok(Some(status)) = train.child.try_wait() {
                fail(cluster, train, format!("the run ended ({status}) before fault {next} struck: {:?} (more steps: YATT_CHAOS_STEPS)", plan[next]));
            }
        }
        // The earlier loss is recovered (nothing else may fail inside its step) and its
        // node is back: the cluster is built to survive one node down at a time, the
        // redundancy it has (two policy replicas, one spare). Striking again while a node
        // is still down or rejoining tests two concurrent losses, which can take both
        // replicas or the rejoin's own leader, and stops the run by design.
        let settled = records
            .iter()
            .all(|r| r.roles.is_empty() || r.recovered_s.is_some())
            && watches.iter().all(|w| w.back);
        // The leader is killed once one that is up leads (not one already down, or in
        // the middle of its fail-over).
        let down: Vec<usize> = watches
            .iter()
            .filter(|w| !w.back)
            .map(|w| w.victim)
            .collect();
        let settled = settled
            && (next >= plan.len()
                || !matches!(plan[next].fault, Fault::KillLeader { .. })
                || leader(cluster, &down).is_some());
        if next < plan.len() && done >= plan[next].after_step && settled {
            let p = plan[next];
            let since = *armed.get_or_insert_with(Instant::now);
            if since.elapsed() >= Duration::from_millis(p.delay_ms) {
                armed = None;
                next += 1;
                let (victim, what, restart_after) = match p.fault {
                    Fault::Kill {
                        node,
                        restart_after_ms,
                    } => (
                        pick_victim(cluster, node, &down),
                        "kill -9",
                        Some(restart_after_ms),
                    ),
                    Fault::KillLeader { restart_after_ms } => (
                        leader(cluster, &down).expect("checked above"),
                        "kill -9 (leader)",
                        Some(restart_after_ms),
                    ),
                    Fault::Freeze { node } => {
                        (pick_victim(cluster, node, &down), "SIGSTOP/SIGCONT", None)
                    }
                };
                let roles = hosted_roles(cluster, victim);
                let at_step = steps_done(out);
                match p.fault {
                    Fault::Freeze { .. } => cluster.nodes[victim].pause(),
                    _ => cluster.nodes[victim].kill9(),
                }
                watches.push(Watch {
                    record: records.len(),
                    victim,
                    struck: Instant::now(),
                    restart_after: restart_after.map(Duration::from_millis),
                    revived: false,
                    back: false,
                    starts: 0,
                    exited_at: None,
                });
                records.push(FaultRecord {
                    what: what.into(),
                    node: cluster.nodes[victim].name.clone(),
                    roles,
                    at_s: t0.elapsed().as_secs_f64(),
                    at_step,
                    detected_s: None,
                    recovered_s: None,
                    recovered_step: None,
                    steps_lost: 0,
                });
            }
        }
        let down: Vec<usize> = watches
            .iter()
            .filter(|w| !w.back)
            .map(|w| w.victim)
            .collect();
        for w in watches.iter_mut() {
            let r = &mut records[w.record];
            if w.back && (r.roles.is_empty() || r.recovered_s.is_some()) {
                continue;
            }
            let name = r.node.clone();
            // Never ask a frozen or dead node: its HTTP read would wait out its timeout.
            let up: Vec<usize> = (0..cluster.nodes.len())
                .filter(|i| !down.contains(i) && *i != w.victim)
                .collect();
            let Some(&watcher) = up.first() else {
                fail(cluster, train, "no live node left to watch from".into());
            };
            // Declared dead: the leader's view reaches every member within a heartbeat
            // or two; any member that lists the node dead has it from the leader.
            if r.detected_s.is_none()
                && up
                    .iter()
                    .any(|&i| cluster.nodes[i].sees_alive(&name) == Some(false))
            {
                r.detected_s = Some(w.struck.elapsed().as_secs_f64());
            }
            // A node not seen declared dead within the bound (a view in the middle of a
            // fail-over) is brought back anyway; the table shows "–".
            let detected = r.detected_s.is_some() || w.struck.elapsed() > DETECT_BOUND;
            if detected && !w.revived {
                match w.restart_after {
                    None => {
                        // It learns it was declared dead and joins again as a new incarnation.
                        cluster.nodes[w.victim].resume();
                        w.revived = true;
                    }
                    Some(due) if w.struck.elapsed() >= due => {
                        cluster.begin_restart(w.victim, watcher);
                        w.starts = 1;
                        w.revived = true;
                    }
                    Some(_) => {}
                }
            }
            let starting = w.revived
                && !w.back
                && w.restart_after.is_some()
                && !cluster.nodes[w.victim].ready();
            if starting {
                // A join can fail under load (its leader stood still): start it again.
                if cluster.nodes[w.victim].exited() {
                    // Its failed life may have been admitted: start again once the
                    // cluster can have declared that one dead (after a bound of silence).
                    let since = *w.exited_at.get_or_insert_with(Instant::now);
                    if since.elapsed() >= Duration::from_secs(3) {
                        if w.starts == 5 {
                            fail(
                                cluster,
                                train,
                                format!(
                                    "{name} could not join again in 5 tries:\n{}",
                                    cluster.nodes[w.victim].log()
                                ),
                            );
                        }
                        eprintln!("chaos: {name} did not join; starting it again");
                        cluster.begin_restart(w.victim, watcher);
                        w.starts += 1;
                        w.exited_at = None;
                    }
                }
            } else if w.revived && !w.back {
                if cluster.nodes[watcher].sees_alive(&name) == Some(true) {
                    w.back = true;
                } else if w.struck.elapsed() > DETECT_BOUND + Duration::from_secs(40) {
                    fail(cluster, train, format!("{name} did not come back"));
                }
            }
            if r.recovered_s.is_none() && !r.roles.is_empty() {
                // The step that met the loss recorded `recovery/respawned_roles`.
                let found = metric_of_steps(out, "recovery/respawned_roles")
                    .into_iter()
                    .find(|(step, _)| *step > r.at_step);
                if let Some((step, _)) = found {
                    let wall = metric_of_steps(out, "timing_s/step")
                        .into_iter()
                        .find(|(s, _)| *s == step)
                        .map_or(f64::NAN, |(_, t)| t);
                    r.recovered_s = Some(w.struck.elapsed().as_secs_f64());
                    r.recovered_step = Some((step, wall));
                    r.steps_lost = 1;
                    eprintln!("chaos: {} of {name} ({}) at step {}: detected after {:.2?} s, recovered at step {step} after {:.2} s", r.what, r.roles.join(", "), r.at_step + 1, r.detected_s, w.struck.elapsed().as_secs_f64());
                } else if let Ok(Some(status)) = train.child.try_wait() {
                    fail(
                        cluster,
                        train,
                        format!(
                            "the run ended ({status}) without recovering from {} of {name}",
                            r.what
                        ),
                    );
                }
            }
        }
        let quiet = watches.iter().all(|w| w.back)
            && records
                .iter()
                .all(|r| r.roles.is_empty() || r.recovered_s.is_some());
        if next == plan.len() && quiet {
            return records;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The node that leads the directory, as a node that is up names it, when that
/// leader is not down itself.
fn leader(cluster: &Cluster, down: &[usize]) -> Option<usize> {
    let (name, _) = (0..cluster.nodes.len())
        .filter(|i| !down.contains(i))
        .find_map(|i| cluster.nodes[i].lead())?;
    cluster
        .nodes
        .iter()
        .position(|n| n.name == name)
        .filter(|i| !down.contains(i))
}

/// `node`, unless it is down or hosts every policy replica (the run cannot survive
/// that, by design): then the next node that is neither.
fn pick_victim(cluster: &Cluster, node: usize, down: &[usize]) -> usize {
    let n = cluster.nodes.len();
    let replicas = |i: usize| match down.contains(&i) {
        true => 0,
        false => hosted_roles(cluster, i)
            .iter()
            .filter(|r| *r == "policy")
            .count(),
    };
    let total: usize = (0..n).map(replicas).sum();
    (0..n)
        .map(|k| (node + k) % n)
        .find(|&i| !down.contains(&i) && (total < 2 || replicas(i) < total))
        .unwrap_or(node)
}

/// The roles node `i` hosts, by its `/health` (`node/role/replica#incarnation`), without
/// the replicas' ring inboxes.
pub fn hosted_roles(cluster: &Cluster, i: usize) -> Vec<String> {
    let Some(h) = cluster.nodes[i].health() else {
        return Vec::new();
    };
    let mut roles: Vec<String> = h["hosted"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_str()?.split('/').nth(1).map(str::to_string))
                .filter(|r| r != "policy-ring")
                .collect()
        })
        .unwrap_or_default();
    roles.sort();
    roles
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_seed_gives_the_same_schedule_and_another_seed_another() {
        let c = ChaosConfig {
            seed: 7,
            kills: 6,
            steps: 40,
        };
        c.check();
        let a = schedule(&c, 5);
        assert_eq!(a, schedule(&c, 5));
        assert_ne!(a, schedule(&ChaosConfig { seed: 8, ..c }, 5));
        assert_eq!(a.len(), 8);
        let kills = a
            .iter()
            .filter(|p| matches!(p.fault, Fault::Kill { .. }))
            .count();
        assert_eq!(kills, 6);
        assert_eq!(
            a.iter()
                .filter(|p| matches!(p.fault, Fault::KillLeader { .. }))
                .count(),
            1
        );
        assert_eq!(
            a.iter()
                .filter(|p| matches!(p.fault, Fault::Freeze { .. }))
                .count(),
            1
        );
        // In order, inside the run, apart.
        assert!(
            a.windows(2).all(|w| w[0].after_step < w[1].after_step),
            "{a:?}"
        );
        assert!(
            a.iter().all(|p| p.after_step >= 4 && p.after_step <= 36),
            "{a:?}"
        );
    }

    #[test]
    #[should_panic(expected = "at least 6")]
    fn fewer_than_six_kills_is_refused() {
        ChaosConfig {
            seed: 1,
            kills: 5,
            steps: 100,
        }
        .check();
    }
}
