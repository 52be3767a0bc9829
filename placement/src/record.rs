//! The live placement actor's log: `RUN_DIR/placement.jsonl`, one [`Record`] per line
//! (plan snapshots, per-step group use, searches, decisions, migration outcomes), and
//! [`render_records`], which `yatt placement show RUN_DIR` prints.
//!
//! Appending one line per event keeps the actor simple and a crashed run readable; the
//! renderer takes text, not a path (reading the file is the caller's business).

use serde::{Deserialize, Serialize};

use crate::events::Reason;
use crate::inventory::GroupId;
use crate::plan::{Move, Plan};
use crate::profile::RoleSet;

/// File name of the log in a run directory.
pub const RECORD_FILE: &str = "placement.jsonl";

/// What one group did in one step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupUse {
    /// The group.
    pub group: GroupId,
    /// The roles it serves.
    pub roles: RoleSet,
    /// Seconds it computed this step.
    pub busy_s: f64,
}

/// Where a group's devices are.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupPlace {
    /// The group.
    pub group: GroupId,
    /// The node hosting its devices.
    pub node: String,
    /// Device indices on that node.
    pub devices: Vec<u32>,
}

/// One line of `placement.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Record {
    /// The plan in force from `step` on, as routing publishes it.
    Plan {
        /// First step run on it.
        step: u64,
        /// Routing version controllers follow (bumped by every migration).
        routing_version: u64,
        /// The runtime directory's epoch when it was published.
        directory_epoch: u64,
        /// The plan.
        plan: Plan,
        /// Where each group of the inventory is (node and device indices), for the live
        /// view's "which group holds this device"; empty in logs written before it.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        places: Vec<GroupPlace>,
    },
    /// A finished step: its time, the model's prediction for the plan in force, and
    /// each group's busy time.
    Step {
        /// The step (0-based).
        step: u64,
        /// Measured wall seconds.
        step_s: f64,
        /// The cost model's prediction for the plan in force, with this step's
        /// metrics folded in.
        predicted_s: Option<f64>,
        /// After a migration: the prediction for the plan in force before it, at the
        /// same workload (the "no move" figure).
        no_move_s: Option<f64>,
        /// Each group's work.
        groups: Vec<GroupUse>,
    },
    /// What a search considered (the policy's log line).
    Search {
        /// The step after which it ran.
        step: u64,
        /// The policy's line.
        line: String,
    },
    /// A decided migration.
    Decision {
        /// The step after which it was decided.
        step: u64,
        /// Its id.
        id: u64,
        /// Why.
        reason: Reason,
        /// The plan before, summarised.
        from: String,
        /// The plan after, summarised.
        to: String,
        /// The groups that change roles.
        moves: Vec<Move>,
        /// Predicted seconds per step before (none for a forced re-plan) and after.
        predicted_before_s: Option<f64>,
        /// Predicted seconds per step after.
        predicted_after_s: Option<f64>,
        /// Predicted job-seconds the migration costs.
        cost_s: f64,
    },
    /// A migration's outcome.
    Migrated {
        /// Its id.
        id: u64,
        /// Whether it completed (false: rolled back).
        ok: bool,
        /// Wall seconds it took.
        seconds: f64,
        /// What was done or what failed.
        detail: String,
    },
}

/// A finite value, or none (JSON has no NaN).
pub fn finite(x: f64) -> Option<f64> {
    x.is_finite().then_some(x)
}

/// The measured step times after step `after` (a migration's step) and, beside each,
/// the "no move" prediction for the plan before it: the pairs that tell whether a move
/// paid.
pub fn after_move(records: &[Record], after: u64) -> (Vec<f64>, Vec<f64>) {
    records
        .iter()
        .filter_map(|r| match r {
            Record::Step {
                step,
                step_s,
                no_move_s: Some(n),
                ..
            } if *step > after => Some((*step_s, *n)),
            _ => None,
        })
        .unzip()
}

/// Why `placement.jsonl` could not be read.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RecordError {
    /// A line is not a record.
    #[error("placement log line {line}: {reason}; expected one JSON record per line as the live placement actor writes")]
    Line {
        /// 1-based line number.
        line: usize,
        /// The parser's message.
        reason: String,
    },
    /// The log has no plan: the run did not use live placement.
    #[error("the placement log has no plan; was the run started with placement.live = true?")]
    NoPlan,
}

/// Parses `placement.jsonl` text; blank lines are skipped.
pub fn parse_records(text: &str) -> Result<Vec<Record>, RecordError> {
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| RecordError::Line {
                line: i + 1,
                reason: e.to_string(),
            })
        })
        .collect()
}

fn secs(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.3}s"))
}

/// Renders the log for people: the plan in force, each group's utilisation over the
/// last `window` steps, and the last `last` decisions with their reasons and outcomes.
pub fn render_records(
    records: &[Record],
    window: usize,
    last: usize,
) -> Result<String, RecordError> {
    use std::fmt::Write;
    let mut out = String::new();
    let plans: Vec<(u64, u64, u64, &Plan)> = records
        .iter()
        .filter_map(|r| match r {
            Record::Plan {
                step,
                routing_version,
                directory_epoch,
                plan,
                ..
            } => Some((*step, *routing_version, *directory_epoch, plan)),
            _ => None,
        })
        .collect();
    let &(since, version, epoch, plan) = plans.last().ok_or(RecordError::NoPlan)?;
    let steps: Vec<&Record> = records
        .iter()
        .filter(|r| matches!(r, Record::Step { .. }))
        .collect();
    let _ = writeln!(
        out,
        "plan: {} ({}), routing v{version}, directory epoch {epoch}, since step {since}",
        plan.summary(),
        plan.mode()
    );
    for p in &plan.pools {
        let groups: Vec<String> = p.groups.iter().map(|g| g.to_string()).collect();
        let _ = writeln!(out, "  {:<24} {}", p.roles.to_string(), groups.join(" "));
    }
    // Utilisation: busy seconds over wall seconds, on the plan's recent steps.
    let recent: Vec<&Record> = steps
        .iter()
        .rev()
        .filter(|r| matches!(r, Record::Step { step, .. } if *step >= since))
        .take(window.max(1))
        .copied()
        .collect();
    let wall: f64 = recent
        .iter()
        .map(|r| match r {
            Record::Step { step_s, .. } => *step_s,
            _ => 0.0,
        })
        .sum();
    let _ = writeln!(
        out,
        "utilisation over the last {} step(s) ({:.3}s of wall time):",
        recent.len(),
        wall
    );
    let mut per_group: std::collections::BTreeMap<GroupId, (RoleSet, f64)> = Default::default();
    for r in &recent {
        if let Record::Step { groups, .. } = r {
            for g in groups {
                let e = per_group.entry(g.group).or_insert((g.roles, 0.0));
                e.1 += g.busy_s;
            }
        }
    }
    for (g, (roles, busy)) in &per_group {
        let _ = writeln!(
            out,
            "  {:<4} {:<24} busy {:>8.3}s  {:>5.1}%",
            g.to_string(),
            roles.to_string(),
            busy,
            100.0 * busy / wall.max(1e-12)
        );
    }
    if let Some(Record::Step {
        step,
        step_s,
        predicted_s,
        no_move_s,
        ..
    }) = steps.last()
    {
        let _ = writeln!(
            out,
            "last step {step}: {step_s:.3}s measured, {} predicted{}",
            secs(*predicted_s),
            no_move_s.map_or(String::new(), |v| format!(
                ", {v:.3}s predicted without the last migration"
            ))
        );
    }
    let decisions: Vec<&Record> = records
        .iter()
        .filter(|r| matches!(r, Record::Decision { .. }))
        .collect();
    let _ = writeln!(
        out,
        "decisions: {} in all, the last {}:",
        decisions.len(),
        last.min(decisions.len())
    );
    for d in decisions.iter().rev().take(last).rev() {
        let Record::Decision {
            step,
            id,
            reason,
            from,
            to,
            moves,
            predicted_before_s,
            predicted_after_s,
            cost_s,
        } = d
        else {
            continue;
        };
        let why = match reason {
            Reason::Rebalance => "rebalance: another plan is predicted faster",
            Reason::NodeLost => "node lost: groups of the plan are gone",
            Reason::Requested => "requested",
        };
        let _ = writeln!(
            out,
            "  #{id} after step {step} ({why}): {from} -> {to}; predicted {} -> {} per step, migration costs {cost_s:.3}s",
            secs(*predicted_before_s),
            secs(*predicted_after_s)
        );
        for m in moves {
            let _ = writeln!(out, "      {} {} -> {}", m.group, m.from, m.to);
        }
        let outcome = records.iter().find_map(|r| match r {
            Record::Migrated {
                id: i,
                ok,
                seconds,
                detail,
            } if i == id => Some((*ok, *seconds, detail)),
            _ => None,
        });
        match outcome {
            Some((true, s, detail)) => {
                let _ = writeln!(out, "      done in {s:.3}s: {detail}");
            }
            Some((false, s, detail)) => {
                let _ = writeln!(out, "      FAILED after {s:.3}s, rolled back: {detail}");
            }
            None => {
                let _ = writeln!(out, "      in flight");
            }
        }
    }
    let searches: Vec<&String> = records
        .iter()
        .filter_map(|r| match r {
            Record::Search { line, .. } => Some(line),
            _ => None,
        })
        .collect();
    if let Some(l) = searches.last() {
        let _ = writeln!(out, "last search: {l}");
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Pool;
    use crate::profile::Role;

    fn plan(r: &[u32], p: &[u32]) -> Plan {
        Plan {
            pools: vec![
                Pool {
                    roles: RoleSet::of(&[Role::Rollout]),
                    groups: r.iter().map(|g| GroupId(*g)).collect(),
                },
                Pool {
                    roles: RoleSet::of(&[Role::Policy]),
                    groups: p.iter().map(|g| GroupId(*g)).collect(),
                },
            ],
            rollout_batch_cap: None,
            lanes: None,
        }
    }

    #[test]
    fn renders_plan_use_and_decisions_and_round_trips() {
        let rollout = RoleSet::of(&[Role::Rollout]);
        let policy = RoleSet::of(&[Role::Policy]);
        let records = vec![
            Record::Plan {
                step: 0,
                routing_version: 1,
                directory_epoch: 3,
                plan: plan(&[0], &[1, 2]),
                places: Vec::new(),
            },
            Record::Step {
                step: 0,
                step_s: 1.0,
                predicted_s: None,
                no_move_s: None,
                groups: vec![GroupUse {
                    group: GroupId(0),
                    roles: rollout,
                    busy_s: 0.8,
                }],
            },
            Record::Decision {
                step: 0,
                id: 1,
                reason: Reason::Rebalance,
                from: "rollout:1 policy:2".into(),
                to: "rollout:2 policy:1".into(),
                moves: vec![Move {
                    group: GroupId(1),
                    from: policy,
                    to: rollout,
                }],
                predicted_before_s: Some(1.0),
                predicted_after_s: finite(0.7),
                cost_s: 0.2,
            },
            Record::Migrated {
                id: 1,
                ok: true,
                seconds: 0.3,
                detail: "g1: policy replica stopped, rollout started".into(),
            },
            Record::Plan {
                step: 1,
                routing_version: 2,
                directory_epoch: 4,
                plan: plan(&[0, 1], &[2]),
                places: Vec::new(),
            },
            Record::Step {
                step: 1,
                step_s: 0.5,
                predicted_s: Some(0.6),
                no_move_s: Some(0.9),
                groups: vec![
                    GroupUse {
                        group: GroupId(0),
                        roles: rollout,
                        busy_s: 0.4,
                    },
                    GroupUse {
                        group: GroupId(2),
                        roles: policy,
                        busy_s: 0.1,
                    },
                ],
            },
        ];
        let text: String = records
            .iter()
            .map(|r| serde_json::to_string(r).unwrap() + "\n")
            .collect();
        let back = parse_records(&text).unwrap();
        assert_eq!(back, records);
        let out = render_records(&back, 5, 3).unwrap();
        assert!(out.contains("plan: rollout:2 policy:1"), "{out}");
        assert!(out.contains("routing v2"), "{out}");
        assert!(out.contains("g0   rollout"), "{out}");
        assert!(out.contains("80.0%"), "{out}");
        assert!(out.contains("#1 after step 0 (rebalance"), "{out}");
        assert!(out.contains("g1 policy -> rollout"), "{out}");
        assert!(out.contains("done in 0.300s"), "{out}");
        assert!(out.contains("0.900s predicted without"), "{out}");
        assert_eq!(render_records(&[], 5, 3).unwrap_err(), RecordError::NoPlan);
        assert!(matches!(
            parse_records("{\"kind\":\"nope\"}").unwrap_err(),
            RecordError::Line { line: 1, .. }
        ));
    }
}
