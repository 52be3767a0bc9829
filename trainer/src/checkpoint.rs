//! A run's checkpoint: the trainers' files and every controller's position.

use std::path::Path;

use serde::{Deserialize, Serialize};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::Trainer;

use crate::config::modes::{Schedule, Task};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::report::ControllerState;
use crate::error::JobError;

/// The run's config, written to the run directory so `--resume` can rebuild the job.
pub const JOB_FILE: &str = "job.toml";

/// What a checkpoint holds besides the models: every controller's position.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunState {
    /// Format tag.
    pub format: String,
    /// Each controller's step, weights version and dataloader position.
    pub controllers: Vec<ControllerState>,
}

impl RunState {
    const FILE: &'static str = "run_state.json";
    const FORMAT: &'static str = "yatt-run-v1";

    /// Reads `DIR/run_state.json`.
    pub fn read(dir: &Path) -> Result<Self, JobError> {
        let path = dir.join(Self::FILE);
        let bad = |reason: String| JobError::Resume {
            dir: dir.into(),
            reason,
        };
        let text = std::fs::read_to_string(&path).map_err(|e| {
            bad(format!(
                "{}: {e}; is this the checkpoint of a `yatt train` run?",
                path.display()
            ))
        })?;
        let state: RunState =
            serde_json::from_str(&text).map_err(|e| bad(format!("{}: {e}", path.display())))?;
        if state.format != Self::FORMAT {
            return Err(bad(format!(
                "{} has format {:?}, expected {:?}",
                path.display(),
                state.format,
                Self::FORMAT
            )));
        }
        Ok(state)
    }
}

/// Puts every controller at its position in the checkpoint `dir` and gives its rollout
/// the restored policy's weights and version (the roles already hold their trainer
/// state).
pub(crate) async fn restore_controllers(
    controllers: &mut [Controller],
    dir: &Path,
) -> Result<(), JobError> {
    let state = RunState::read(dir)?;
    if state.controllers.len() != controllers.len() {
        return Err(JobError::Resume {
            dir: dir.into(),
            reason: format!(
                "the checkpoint has {} controller(s) but the job has {}; resume with the same job.controllers and job.driver",
                state.controllers.len(),
                controllers.len(),
            ),
        });
    }
    for (c, s) in controllers.iter_mut().zip(state.controllers) {
        c.restore(s)?;
        c.sync_weights().await?;
    }
    Ok(())
}

/// Loads a checkpointed trainer onto `device` with weights in `kind` (its AdamW state
/// and master weights stay f32).
pub(crate) fn load_trainer(
    dir: &Path,
    role: &str,
    device: Device,
    kind: Kind,
) -> Result<Trainer, JobError> {
    Trainer::load_checkpoint(dir, device, kind).map_err(|e| JobError::Resume {
        dir: dir.into(),
        reason: format!("loading the {role}: {e}"),
    })
}

/// Saves the policy (shared by every head), the critic (`critic/`) and every
/// controller's position (`run_state.json`) as the checkpoint `dir`, replacing the one
/// there without ever leaving the run without a complete checkpoint.
///
/// Everything is written into `DIR.tmp-<pid>` next to `dir` and fsynced, then swapped in:
/// `dir` is renamed to `DIR.old-<pid>`, the new one to `dir`, the parent directory is
/// fsynced and the old one removed. (POSIX `rename` cannot replace a non-empty
/// directory, so the swap is two renames.) What a crash leaves:
/// - while writing: `dir` untouched, plus an incomplete `DIR.tmp-<pid>`, which the next
///   save removes and [`recover`] ignores (it has no `run_state.json`, written last);
/// - between the two renames: no `dir`, the complete new `DIR.tmp-<pid>` and the complete
///   old `DIR.old-<pid>`: [`recover`] (run by every resume) puts the new one in place;
/// - after the second rename: the new `dir`, plus `DIR.old-<pid>`, which the next save of
///   a process with that pid, or a person, removes; resume never reads it then.
pub(crate) async fn save(controllers: &[Controller], dir: &Path) -> Result<(), JobError> {
    let (tmp, old) = (sibling(dir, "tmp"), sibling(dir, "old"));
    for stale in [&tmp, &old] {
        remove_dir(stale)?;
    }
    std::fs::create_dir_all(&tmp).map_err(wr(&tmp))?;
    if let Some(c) = controllers.first() {
        c.save_policy(tmp.clone()).await?;
        c.save_critic(tmp.join("critic")).await?;
    }
    let state = RunState {
        format: RunState::FORMAT.into(),
        controllers: controllers.iter().map(Controller::state).collect(),
    };
    let text = serde_json::to_string_pretty(&state).expect("run state serializes");
    let state_path = tmp.join(RunState::FILE);
    std::fs::write(&state_path, text).map_err(wr(&state_path))?;
    sync_tree(&tmp)?;
    let had_old = dir.exists();
    if had_old {
        std::fs::rename(dir, &old).map_err(wr(dir))?;
    }
    std::fs::rename(&tmp, dir).map_err(wr(dir))?;
    if let Some(parent) = dir.parent() {
        sync_dir(parent)?;
    }
    // The policy's and the critic's states are saved: one that replaces either starts
    // here.
    for c in controllers {
        if let Some(r) = &c.critic_recovery {
            r.lock_log().checkpointed(dir);
        }
        if let Some(r) = &c.policy_recovery {
            r.lock().checkpointed(dir);
        }
    }
    if had_old {
        // The new checkpoint is in place: a leftover old one is only wasted space.
        if let Err(e) = remove_dir(&old) {
            tracing::warn!(error = %e, "could not remove the replaced checkpoint");
        }
    }
    Ok(())
}

/// Keys of a job that do not change a run's trajectory: a resumed run may change them.
/// `job.output_dir` is where the run is, not what it does (`--resume DIR` sets it).
/// `rollout.cuda_graphs` changes how, not what, the rollout decodes (within rounding);
/// `rollout.weight_sync` how, not what, the weights travel; `job.gradient_sync` how the
/// replicas average gradients (within rounding); `job.policy_shards` how many ranks the
/// policy's state is split over (a sharded checkpoint reshards to any count), and
/// `job.critic_shards` the critic's.
const RESUMABLE_KEYS: [&str; 22] = [
    "job.policy_shards",
    "job.critic_shards",
    "timeouts.generate_s",
    "timeouts.score_s",
    "timeouts.train_s",
    "timeouts.sync_s",
    "timeouts.collective_s",
    "job.steps",
    "job.output_dir",
    "checkpoint.every",
    "eval.every",
    "eval.prompts",
    "eval.before_train",
    "placement.rollout",
    "placement.policy",
    "placement.reference",
    "placement.reward",
    "placement.critic",
    "placement.nodes",
    "rollout.cuda_graphs",
    "rollout.weight_sync",
    "job.gradient_sync",
];

/// Refuses to resume `job` in `dir` when the run there (its `job.toml`) differs from
/// it in a key that changes the trajectory: the two would mix in one checkpoint and
/// one metrics file. A directory without `job.toml` has nothing to compare.
pub(crate) fn check_same_run(job: &JobConfig, dir: &Path) -> Result<(), JobError> {
    let path = dir.join(JOB_FILE);
    if !path.is_file() {
        return Ok(());
    }
    let bad = |reason: String| JobError::Resume {
        dir: dir.into(),
        reason,
    };
    let theirs = JobConfig::load(&path, &[]).map_err(|e| {
        bad(format!(
            "its {} does not load ({e}); fix it, or use a new job.output_dir",
            path.display()
        ))
    })?;
    let flat = |j: &JobConfig| {
        let mut out = std::collections::BTreeMap::new();
        match toml::Value::try_from(j) {
            Ok(v) => flatten("", &v, &mut out),
            Err(e) => {
                out.insert("<job>".to_string(), format!("does not serialize: {e}"));
            }
        }
        // Where a user's role runs is placement too (`roles.reward.node`, a stage's).
        out.retain(|k, _| {
            !RESUMABLE_KEYS.contains(&k.as_str())
                && !(k.starts_with("roles.") && k.ends_with(".node"))
        });
        out
    };
    let (run, this) = (flat(&theirs), flat(job));
    let keys: std::collections::BTreeSet<&String> = run.keys().chain(this.keys()).collect();
    let missing = || "(unset)".to_string();
    let mut differ: Vec<String> = keys
        .into_iter()
        .filter(|k| run.get(*k) != this.get(*k))
        .map(|k| {
            format!(
                "{k} (run: {}, this job: {})",
                run.get(k).cloned().unwrap_or_else(missing),
                this.get(k).cloned().unwrap_or_else(missing)
            )
        })
        .collect();
    // `job.steps` may change, unless something is scheduled over it.
    let over_steps = if job.optim.schedule == Schedule::Cosine {
        Some("optim.schedule = \"cosine\" decays over job.steps")
    } else if job.data.task == Task::Growing && job.data.length_end != 0 {
        Some("data.length_end grows the target length over job.steps")
    } else {
        None
    };
    if let (Some(why), true) = (over_steps, theirs.job.steps != job.job.steps) {
        differ.push(format!(
            "job.steps (run: {}, this job: {}; {why})",
            theirs.job.steps, job.job.steps
        ));
    }
    if differ.is_empty() {
        return Ok(());
    }
    Err(bad(format!(
        "the run there ({}) differs from this job in {} key(s) that change the training: {}; \
         fix: use a new job.output_dir for a different run, or resume with the run's own config \
         (`yatt train --resume DIR` reads DIR/{JOB_FILE}; only {} may change)",
        path.display(),
        differ.len(),
        differ.join(", "),
        RESUMABLE_KEYS.join(", ")
    )))
}

/// `table.key = value` for every leaf of `v`, keys dotted.
fn flatten(prefix: &str, v: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
    match v {
        toml::Value::Table(t) => {
            for (k, v) in t {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        // Arrays of tables (`[[roles.stages]]`) by entry, so their keys compare one by one.
        toml::Value::Array(a) if !a.is_empty() && a.iter().all(toml::Value::is_table) => {
            for (i, v) in a.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), v, out);
            }
        }
        leaf => {
            out.insert(prefix.to_string(), leaf.to_string());
        }
    }
}

/// Completes a checkpoint swap that a crash interrupted (see [`save`]): when `dir` is
/// missing, the newest complete `DIR.tmp-*` (one with `run_state.json`), else the
/// newest `DIR.old-*`, becomes `dir`. Does nothing when `dir` exists.
pub(crate) fn recover(dir: &Path) -> Result<(), JobError> {
    if dir.exists() {
        return Ok(());
    }
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Ok(());
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Ok(());
    };
    let name = name.to_string_lossy();
    let mut found: Vec<(bool, std::time::SystemTime, std::path::PathBuf)> = entries
        .flatten()
        .filter_map(|e| {
            let file = e.file_name().to_string_lossy().into_owned();
            let kind = file.strip_prefix(&*name)?;
            let new = kind.starts_with(".tmp-");
            if !new && !kind.starts_with(".old-") {
                return None;
            }
            let path = e.path();
            if !path.join(RunState::FILE).is_file() {
                return None;
            }
            let mtime = e.metadata().and_then(|m| m.modified()).ok()?;
            Some((new, mtime, path))
        })
        .collect();
    found.sort();
    if let Some((_, _, best)) = found.pop() {
        tracing::warn!(from = %best.display(), to = %dir.display(),
            "a checkpoint save was interrupted between its renames; completing it");
        std::fs::rename(&best, dir).map_err(wr(dir))?;
    }
    Ok(())
}

fn wr(path: &Path) -> impl FnOnce(std::io::Error) -> JobError {
    let path = path.to_path_buf();
    move |source| JobError::Write { path, source }
}

/// `DIR.<what>-<pid>` next to `dir`.
fn sibling(dir: &Path, what: &str) -> std::path::PathBuf {
    let name = dir
        .file_name()
        .map_or("checkpoint".into(), |n| n.to_string_lossy());
    dir.with_file_name(format!("{name}.{what}-{}", std::process::id()))
}

fn remove_dir(dir: &Path) -> Result<(), JobError> {
    match std::fs::remove_dir_all(dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(wr(dir)(e)),
        _ => Ok(()),
    }
}

fn sync_dir(dir: &Path) -> Result<(), JobError> {
    std::fs::File::open(dir)
        .and_then(|f| f.sync_all())
        .map_err(wr(dir))
}

/// fsyncs every file under `dir`, then the directories, deepest first.
fn sync_tree(dir: &Path) -> Result<(), JobError> {
    for e in std::fs::read_dir(dir).map_err(wr(dir))? {
        let path = e.map_err(wr(dir))?.path();
        if path.is_dir() {
            sync_tree(&path)?;
        } else {
            std::fs::File::open(&path)
                .and_then(|f| f.sync_all())
                .map_err(wr(&path))?;
        }
    }
    sync_dir(dir)
}
