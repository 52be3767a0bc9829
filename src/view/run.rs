//! The run half of the live view: a run directory's `metrics.jsonl`, `eval.jsonl` and
//! `placement.jsonl`, read incrementally as the trainer appends to them (or once, for a
//! finished run), and served as what is new since the step and event a viewer has.
//!
//! The trainer writes those files anyway; reading them here costs the run nothing but
//! the reads a viewer asks for, and `yatt view RUN_DIR` serves a finished run with the
//! same code.

use std::collections::{BTreeMap, VecDeque};
use std::io::{Read as _, Seek as _, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde::Serialize;
use yatt_metrics::names;
use yatt_placement::{Record, RECORD_FILE};

/// Steps kept in memory; a longer run keeps its last ones (the page thins its own copy
/// long before this).
pub const MAX_STEPS: usize = 20_000;
/// Run events kept (placement decisions, migrations, plans, recoveries).
pub const MAX_EVENTS: usize = 512;
/// Steps one answer carries at most; the page asks again for the rest at once.
pub const MAX_STEPS_PER_ANSWER: usize = 2_000;
/// Bytes one refresh reads from a file at most, and the longest line kept whole.
const READ_CHUNK: usize = 4 << 20;
/// The last steps whose heads' own values (`head/I/...`) are kept: the timeline draws
/// at most 30 steps, and a run of many heads would multiply every step's row.
pub const HEAD_ROWS: usize = 60;

/// The metrics a step row keeps (names, or prefixes ending in '/').
const KEPT: &[&str] = &[
    names::TIMING_PREFIX,
    "async/",
    "placement/",
    "recovery/",
    "off_policy/",
    names::REWARDS_MEAN,
    names::SCORE_MEAN,
    names::KL,
    names::LOGPROB_DIFF_MEAN,
    names::LOGPROB_DIFF_MAX,
    names::GEN_TOKENS_PER_S,
    names::THROUGHPUT,
    names::TOTAL_NUM_TOKENS,
    names::RESPONSE_LENGTH_MEAN,
    names::WEIGHTS_VERSION,
    names::DROPPED_SAMPLES,
];

fn kept(name: &str) -> bool {
    // A head's own values: those its timeline is drawn from.
    let metric = names::without_head(name);
    if metric != name {
        return names::kept_per_head(metric);
    }
    KEPT.iter().any(|k| match k.ends_with('/') {
        true => name.starts_with(k),
        false => name == *k,
    })
}

/// What kind of run event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum RunEventKind {
    /// A plan came into force.
    Plan,
    /// The placement decided to move groups between roles.
    Move,
    /// A migration's outcome.
    Migrated,
    /// A step lost roles with their node and ran again with them respawned.
    Recovery,
    /// Samples were requeued onto another group.
    Requeue,
}

/// One run event.
#[derive(Debug, Clone, Serialize)]
pub struct RunEvent {
    /// Its number (1, 2, ...).
    pub seq: u64,
    /// The step it belongs to (1-based, as in metrics.jsonl).
    pub step: u64,
    /// When this server read it, milliseconds since the Unix epoch (for a live run, a
    /// second or less after it happened).
    pub unix_ms: u64,
    /// What.
    pub kind: RunEventKind,
    /// In words.
    pub text: String,
    /// Extra figures (predicted and measured step, stall seconds, ...).
    pub data: serde_json::Value,
}

/// A file read from where the last read stopped.
struct Tail {
    path: PathBuf,
    offset: u64,
    partial: Vec<u8>,
}

impl Tail {
    fn new(path: PathBuf) -> Self {
        Tail {
            path,
            offset: 0,
            partial: Vec::new(),
        }
    }

    /// The complete lines appended since the last call (at most [`READ_CHUNK`] bytes),
    /// and whether the file shrank (it was rewritten: start over).
    fn lines(&mut self) -> (Vec<String>, bool) {
        let Ok(mut f) = std::fs::File::open(&self.path) else {
            return (Vec::new(), false);
        };
        let len = f.metadata().map_or(0, |m| m.len());
        let mut restarted = false;
        if len < self.offset {
            (self.offset, restarted) = (0, true);
            self.partial.clear();
        }
        if len == self.offset || f.seek(SeekFrom::Start(self.offset)).is_err() {
            return (Vec::new(), restarted);
        }
        let mut buf = Vec::new();
        let n = (&mut f)
            .take(READ_CHUNK as u64)
            .read_to_end(&mut buf)
            .unwrap_or(0);
        self.offset += n as u64;
        self.partial.extend_from_slice(&buf[..n]);
        let Some(end) = self.partial.iter().rposition(|&b| b == b'\n') else {
            if self.partial.len() > READ_CHUNK {
                // A line this long is not one the trainer wrote: drop it.
                self.partial.clear();
            }
            return (Vec::new(), restarted);
        };
        let rest = self.partial.split_off(end + 1);
        let done = std::mem::replace(&mut self.partial, rest);
        let lines = String::from_utf8_lossy(&done)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(str::to_string)
            .collect();
        (lines, restarted)
    }
}

struct State {
    metrics: Tail,
    eval: Tail,
    placement: Tail,
    steps: VecDeque<BTreeMap<String, f64>>,
    events: VecDeque<RunEvent>,
    next_event: u64,
    plan: Option<serde_json::Value>,
    /// The last placement step record: each group's busy seconds.
    groups: serde_json::Value,
    /// The last placement step record's measured seconds.
    last_step_s: Option<f64>,
    /// Placement predictions by 1-based step, until the step's metrics row takes them.
    predicted: BTreeMap<u64, (Option<f64>, Option<f64>)>,
    bad_lines: u64,
}

/// A run directory as the page sees it.
pub struct RunSource {
    dir: PathBuf,
    total: Option<u64>,
    state: Mutex<State>,
}

impl RunSource {
    /// The run in `dir`; `total` is the job's step count when known.
    pub fn new(dir: &Path, total: Option<u64>) -> Self {
        RunSource {
            dir: dir.to_path_buf(),
            total,
            state: Mutex::new(State {
                metrics: Tail::new(dir.join(yatt_metrics::METRICS_FILE)),
                eval: Tail::new(dir.join(yatt_metrics::EVAL_FILE)),
                placement: Tail::new(dir.join(RECORD_FILE)),
                steps: VecDeque::new(),
                events: VecDeque::new(),
                next_event: 0,
                plan: None,
                groups: serde_json::Value::Null,
                predicted: BTreeMap::new(),
                last_step_s: None,
                bad_lines: 0,
            }),
        }
    }

    /// Reads what was appended and answers with the steps after `since` and the
    /// events after `events_since`. Blocking (file reads): call it off the async
    /// threads.
    pub fn answer(&self, since: u64, events_since: u64) -> serde_json::Value {
        let mut s = self.state.lock().unwrap_or_else(|p| p.into_inner());
        s.refresh();
        let done = s
            .steps
            .back()
            .and_then(|r| r.get("step"))
            .map_or(0, |x| *x as u64);
        let recent: Vec<f64> = s
            .steps
            .iter()
            .rev()
            .take(20)
            .filter_map(|r| r.get(names::STEP_S).copied())
            .filter(|x| x.is_finite())
            .collect();
        let mean_step =
            (!recent.is_empty()).then(|| recent.iter().sum::<f64>() / recent.len() as f64);
        let eta = match (self.total, mean_step) {
            (Some(t), Some(m)) => Some(t.saturating_sub(done) as f64 * m),
            _ => None,
        };
        let new: Vec<&BTreeMap<String, f64>> = s
            .steps
            .iter()
            .filter(|r| r.get("step").is_some_and(|x| *x as u64 > since))
            .take(MAX_STEPS_PER_ANSWER)
            .collect();
        let more = new.len() == MAX_STEPS_PER_ANSWER
            && new
                .last()
                .and_then(|r| r.get("step"))
                .is_some_and(|x| (*x as u64) < done);
        let steps: Vec<serde_json::Value> = new.iter().map(|r| row_json(r)).collect();
        let events: Vec<&RunEvent> = s.events.iter().filter(|e| e.seq > events_since).collect();
        serde_json::json!({
            "dir": self.dir.display().to_string(),
            "total": self.total,
            "done": done,
            "eta_s": eta,
            "mean_step_s": mean_step,
            "steps": steps,
            "more": more,
            "events": events,
            "plan": s.plan,
            "groups": s.groups,
            "bad_lines": s.bad_lines,
        })
    }
}

/// A row as JSON; non-finite values become null.
fn row_json(r: &BTreeMap<String, f64>) -> serde_json::Value {
    serde_json::Value::Object(
        r.iter()
            .map(|(k, v)| {
                let v =
                    serde_json::Number::from_f64(*v).map_or(serde_json::Value::Null, Into::into);
                (k.clone(), v)
            })
            .collect(),
    )
}

fn secs(x: Option<f64>) -> String {
    x.map_or("-".into(), |v| format!("{v:.3} s"))
}

impl State {
    fn event(&mut self, step: u64, kind: RunEventKind, text: String, data: serde_json::Value) {
        self.next_event += 1;
        if self.events.len() == MAX_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(RunEvent {
            seq: self.next_event,
            step,
            unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_millis() as u64),
            kind,
            text,
            data,
        });
    }

    fn refresh(&mut self) {
        // The placement log first: a step's prediction is written before its metrics.
        let (lines, restarted) = self.placement.lines();
        if restarted {
            self.plan = None;
        }
        for l in lines {
            match serde_json::from_str::<Record>(&l) {
                Ok(r) => self.placement_record(r),
                Err(_) => self.bad_lines += 1,
            }
        }
        let (lines, restarted) = self.metrics.lines();
        if restarted {
            self.steps.clear();
        }
        for l in lines {
            match yatt_metrics::parse_line(&l) {
                Ok(rec) => self.step_row(rec),
                Err(_) => self.bad_lines += 1,
            }
        }
        let (lines, _) = self.eval.lines();
        for l in lines {
            let Ok(rec) = yatt_metrics::parse_line(&l) else {
                self.bad_lines += 1;
                continue;
            };
            // An evaluation belongs to a step already read, usually the last.
            if let Some(row) = self
                .steps
                .iter_mut()
                .rev()
                .find(|r| r.get("step").is_some_and(|s| *s as u64 == rec.step))
            {
                for (k, v) in rec.values.iter().filter(|(k, _)| k.starts_with("eval/")) {
                    row.insert(k.clone(), *v);
                }
            }
        }
    }

    fn step_row(&mut self, rec: yatt_metrics::StepRecord) {
        let mut row: BTreeMap<String, f64> =
            rec.values.into_iter().filter(|(k, _)| kept(k)).collect();
        row.insert("step".into(), rec.step as f64);
        if let Some((p, n)) = self.predicted.remove(&rec.step) {
            p.map(|p| row.insert(names::PLACEMENT_PREDICTED_S.into(), p));
            n.map(|n| row.insert(names::PLACEMENT_NO_MOVE_S.into(), n));
        }
        self.predicted.retain(|s, _| *s > rec.step);
        if let Some(r) = row.get(names::RECOVERY_RESPAWNED).copied() {
            let step_s = row.get(names::STEP_S).copied();
            let mut others: Vec<f64> = self
                .steps
                .iter()
                .rev()
                .take(50)
                .filter(|r| !r.contains_key(names::RECOVERY_RESPAWNED))
                .filter_map(|r| r.get(names::STEP_S).copied())
                .collect();
            others.sort_by(f64::total_cmp);
            let median = others.get(others.len() / 2).copied();
            let stall = step_s.zip(median).map(|(s, m)| (s - m).max(0.0));
            let replayed: Vec<String> = [
                (names::RECOVERY_POLICY_REPLAYED, "policy update(s) replayed"),
                (names::RECOVERY_CRITIC_REPLAYED, "critic update(s) replayed"),
            ]
            .iter()
            .filter_map(|(k, what)| row.get(*k).map(|v| format!(", {v} {what}")))
            .collect();
            self.event(
                rec.step,
                RunEventKind::Recovery,
                format!(
                    "recovery in step {}: {r} role(s) lost with their node and respawned on surviving nodes{}; the step took {} (median step {}), a stall of {}",
                    rec.step,
                    replayed.concat(),
                    secs(step_s),
                    secs(median),
                    secs(stall)
                ),
                serde_json::json!({"respawned": r, "step_s": step_s, "median_s": median, "stall_s": stall}),
            );
        }
        if let Some(n) = row
            .get(names::PLACEMENT_REQUEUED)
            .copied()
            .filter(|n| *n > 0.0)
        {
            self.event(
                rec.step,
                RunEventKind::Requeue,
                format!(
                    "step {}: {n} sample(s) requeued onto another group",
                    rec.step
                ),
                serde_json::json!({"requeued": n}),
            );
        }
        if self.steps.len() == MAX_STEPS {
            self.steps.pop_front();
        }
        self.steps.push_back(row);
        if let Some(old) = self.steps.len().checked_sub(HEAD_ROWS + 1) {
            self.steps[old].retain(|k, _| !k.starts_with(names::HEAD_PREFIX));
        }
    }

    fn placement_record(&mut self, r: Record) {
        match r {
            Record::Plan {
                step,
                routing_version,
                directory_epoch,
                plan,
                places,
            } => {
                let pools: Vec<serde_json::Value> = plan
                    .pools
                    .iter()
                    .map(|p| {
                        serde_json::json!({
                            "roles": p.roles.to_string(),
                            "groups": p.groups.iter().map(|g| g.to_string()).collect::<Vec<_>>(),
                        })
                    })
                    .collect();
                let summary = pools
                    .iter()
                    .map(|p| {
                        format!(
                            "{}: {}",
                            p["roles"].as_str().unwrap_or("?"),
                            p["groups"].as_array().map_or(String::new(), |g| g
                                .iter()
                                .filter_map(|x| x.as_str())
                                .collect::<Vec<_>>()
                                .join(" "))
                        )
                    })
                    .collect::<Vec<_>>()
                    .join("; ");
                self.event(
                    step + 1,
                    RunEventKind::Plan,
                    format!("plan from step {}: {summary} (routing v{routing_version}, directory epoch {directory_epoch})", step + 1),
                    serde_json::Value::Null,
                );
                self.plan = Some(serde_json::json!({
                    "step": step + 1,
                    "routing_version": routing_version,
                    "directory_epoch": directory_epoch,
                    "pools": pools,
                    "places": places.iter().map(|p| serde_json::json!({
                        "group": p.group.to_string(), "node": p.node, "devices": p.devices,
                    })).collect::<Vec<_>>(),
                }));
            }
            Record::Step {
                step,
                step_s,
                predicted_s,
                no_move_s,
                groups,
                ..
            } => {
                self.groups = serde_json::json!(groups
                    .iter()
                    .map(|g| serde_json::json!({"group": g.group.to_string(), "roles": g.roles.to_string(), "busy_s": g.busy_s}))
                    .collect::<Vec<_>>());
                self.last_step_s = Some(step_s);
                if self.predicted.len() < 1024 {
                    self.predicted.insert(step + 1, (predicted_s, no_move_s));
                }
            }
            Record::Search { .. } => {}
            Record::Decision {
                step,
                id,
                reason,
                from,
                to,
                moves,
                predicted_before_s,
                predicted_after_s,
                cost_s,
            } => {
                let moved: Vec<String> = moves
                    .iter()
                    .map(|m| format!("{} {} -> {}", m.group, m.from, m.to))
                    .collect();
                let measured = self.last_step_s;
                self.event(
                    step + 1,
                    RunEventKind::Move,
                    format!(
                        "move #{id} after step {} ({reason:?}): {from} -> {to}; {}; measured step {}, predicted {} -> {} per step, migration costs {cost_s:.3} s",
                        step + 1,
                        moved.join(", "),
                        secs(measured),
                        secs(predicted_before_s),
                        secs(predicted_after_s),
                    ),
                    serde_json::json!({
                        "id": id, "moves": moved, "measured_s": measured,
                        "predicted_before_s": predicted_before_s,
                        "predicted_after_s": predicted_after_s, "cost_s": cost_s,
                    }),
                );
            }
            Record::Migrated {
                id,
                ok,
                seconds,
                detail,
            } => {
                let step = self
                    .steps
                    .back()
                    .and_then(|r| r.get("step"))
                    .map_or(0, |s| *s as u64);
                let outcome = if ok { "done" } else { "FAILED, rolled back" };
                self.event(
                    step,
                    RunEventKind::Migrated,
                    format!("move #{id} {outcome} in {seconds:.3} s: {detail}"),
                    serde_json::json!({"id": id, "ok": ok, "seconds": seconds}),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    #[test]
    fn reads_what_is_appended_a_line_at_a_time_and_answers_only_what_is_new() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("metrics.jsonl");
        let mut f = std::fs::File::create(&path).unwrap();
        let src = RunSource::new(dir.path(), Some(4));
        assert_eq!(src.answer(0, 0)["done"], 0);
        writeln!(
            f,
            r#"{{"step":1,"critic/rewards/mean":0.5,"timing_s/step":1.0,"actor/pg_loss":3}}"#
        )
        .unwrap();
        write!(f, r#"{{"step":2,"critic/rewards/mean":0.6,"#).unwrap();
        let a = src.answer(0, 0);
        assert_eq!(a["done"], 1);
        assert_eq!(a["steps"].as_array().unwrap().len(), 1);
        assert!(
            a["steps"][0].get("actor/pg_loss").is_none(),
            "only the kept metrics"
        );
        assert_eq!(a["eta_s"], 3.0);
        writeln!(f, r#""timing_s/step":3.0,"recovery/respawned_roles":1}}"#).unwrap();
        let a = src.answer(1, 0);
        assert_eq!(a["steps"].as_array().unwrap().len(), 1);
        assert_eq!(a["steps"][0]["step"], 2.0);
        assert_eq!(a["events"][0]["kind"], "recovery");
        assert_eq!(a["events"][0]["data"]["stall_s"], 2.0);
        assert!(src.answer(2, 1)["events"].as_array().unwrap().is_empty());
    }

    #[test]
    fn each_heads_stage_times_are_served_for_the_last_steps_only() {
        let dir = tempfile::tempdir().unwrap();
        let mut f = std::fs::File::create(dir.path().join("metrics.jsonl")).unwrap();
        let steps = HEAD_ROWS as u64 + 10;
        for step in 1..=steps {
            writeln!(
                f,
                r#"{{"step":{step},"timing_s/gen":2.0,"head/0/timing_s/gen":1.0,"head/1/timing_s/gen":3.0,"head/1/async/gen_ahead_s":0.5,"head/1/actor/pg_loss":1}}"#
            )
            .unwrap();
        }
        let a = RunSource::new(dir.path(), None).answer(0, 0);
        let rows = a["steps"].as_array().unwrap();
        assert_eq!(rows.len() as u64, steps);
        let last = &rows[rows.len() - 1];
        assert_eq!(last["head/1/timing_s/gen"], 3.0);
        assert_eq!(last["head/1/async/gen_ahead_s"], 0.5);
        assert!(
            last.get("head/1/actor/pg_loss").is_none(),
            "a head's stage figures only"
        );
        let heads = |r: &serde_json::Value| {
            r.as_object()
                .unwrap()
                .keys()
                .filter(|k| k.starts_with("head/"))
                .count()
        };
        assert_eq!(heads(&rows[rows.len() - HEAD_ROWS]), 3);
        assert_eq!(
            heads(&rows[rows.len() - HEAD_ROWS - 1]),
            0,
            "older rows keep the means"
        );
        assert_eq!(rows[0]["timing_s/gen"], 2.0);
    }
}
