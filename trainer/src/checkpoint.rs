//! A run's checkpoint: the trainers' files and every controller's position.

use std::path::Path;

use serde::{Deserialize, Serialize};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::Trainer;

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

pub(crate) fn load_trainer(dir: &Path, role: &str) -> Result<Trainer, JobError> {
    Trainer::load_checkpoint(dir, Device::Cpu, Kind::Float).map_err(|e| JobError::Resume {
        dir: dir.into(),
        reason: format!("loading the {role}: {e}"),
    })
}

/// Saves the policy (shared by every head) to `dir`, the critic to `dir/critic`, and
/// every controller's position to `dir/run_state.json`, the last so that a checkpoint
/// without it is recognisably incomplete.
pub(crate) async fn save(controllers: &[Controller], dir: &Path) -> Result<(), JobError> {
    let wr = |path: &Path| {
        let path = path.to_path_buf();
        move |source| JobError::Write { path, source }
    };
    std::fs::create_dir_all(dir).map_err(wr(dir))?;
    let state_path = dir.join(RunState::FILE);
    // An interrupted save must not look complete.
    match std::fs::remove_file(&state_path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(wr(&state_path)(e)),
        _ => {}
    }
    if let Some(c) = controllers.first() {
        c.save_policy(dir.into()).await?;
        c.save_critic(dir.join("critic")).await?;
    }
    let state = RunState {
        format: RunState::FORMAT.into(),
        controllers: controllers.iter().map(Controller::state).collect(),
    };
    let text = serde_json::to_string_pretty(&state).expect("run state serializes");
    std::fs::write(&state_path, text).map_err(wr(&state_path))?;
    Ok(())
}
