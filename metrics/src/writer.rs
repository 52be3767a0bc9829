//! [`RunWriter`]: a run's per-step metrics to `metrics.jsonl` and a TensorBoard event
//! file, flushed after every step.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write as _};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::error::WriteError;
use crate::jsonl;
use crate::tfevents::{self, EventWriter};

/// Seconds since the Unix epoch, as event files record time.
fn now_s() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Writes a run's per-step metrics to `RUN_DIR/metrics.jsonl` and to a TensorBoard
/// event file in `RUN_DIR`, flushing both after every step so a crashed run keeps
/// every finished step.
#[derive(Debug)]
pub struct RunWriter {
    metrics_path: PathBuf,
    jsonl: BufWriter<File>,
    events: EventWriter,
}

impl RunWriter {
    /// Starts a run in `run_dir` (created if missing). A previous run's
    /// `metrics.jsonl` is truncated and its event files are removed: TensorBoard would
    /// otherwise draw both runs as one zig-zag curve under one name.
    pub fn create(run_dir: impl AsRef<Path>) -> Result<Self, WriteError> {
        let dir = run_dir.as_ref();
        let werr = |path: &Path| {
            let path = path.to_path_buf();
            move |source| WriteError { path, source }
        };
        std::fs::create_dir_all(dir).map_err(werr(dir))?;
        for entry in std::fs::read_dir(dir).map_err(werr(dir))? {
            let path = entry.map_err(werr(dir))?.path();
            let stale = path
                .file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(tfevents::FILE_PREFIX));
            if stale && path.is_file() {
                std::fs::remove_file(&path).map_err(werr(&path))?;
            }
        }
        let metrics_path = dir.join(jsonl::FILE_NAME);
        let file = File::create(&metrics_path).map_err(werr(&metrics_path))?;
        Ok(RunWriter {
            jsonl: BufWriter::new(file),
            events: EventWriter::create(dir, now_s())?,
            metrics_path,
        })
    }

    /// Continues a run in `run_dir` after its checkpoint at step `steps`: the first
    /// `steps` lines of `metrics.jsonl` are kept (later ones, written after the
    /// checkpoint, are dropped: the resumed run writes those steps again) and new steps
    /// are appended; earlier event files are kept and a new one continues them.
    pub fn resume(run_dir: impl AsRef<Path>, steps: u64) -> Result<Self, WriteError> {
        let dir = run_dir.as_ref();
        let metrics_path = dir.join(jsonl::FILE_NAME);
        let werr = |source| WriteError {
            path: metrics_path.clone(),
            source,
        };
        let text = match std::fs::read_to_string(&metrics_path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(werr(e)),
        };
        let kept: String = text
            .lines()
            .take(steps as usize)
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(&metrics_path, kept).map_err(werr)?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(&metrics_path)
            .map_err(werr)?;
        Ok(RunWriter {
            jsonl: BufWriter::new(file),
            events: EventWriter::create(dir, now_s())?,
            metrics_path,
        })
    }

    /// `RUN_DIR/metrics.jsonl`.
    pub fn metrics_path(&self) -> &Path {
        &self.metrics_path
    }

    /// The event file.
    pub fn events_path(&self) -> &Path {
        self.events.path()
    }

    /// Appends one step: a line to `metrics.jsonl` and a scalar summary (one tag per
    /// metric name) to the event file.
    pub fn write_step(
        &mut self,
        step: u64,
        metrics: &BTreeMap<String, f64>,
    ) -> Result<(), WriteError> {
        writeln!(self.jsonl, "{}", jsonl::format_line(step, metrics))
            .and_then(|()| self.jsonl.flush())
            .map_err(|source| WriteError {
                path: self.metrics_path.clone(),
                source,
            })?;
        let step = i64::try_from(step).unwrap_or(i64::MAX);
        self.events
            .write_scalars(now_s(), step, metrics.iter().map(|(k, v)| (k.as_str(), *v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::jsonl::read_jsonl;

    #[test]
    fn a_new_run_replaces_the_previous_runs_files() {
        let dir = tempfile::tempdir().unwrap();
        let stale = dir.path().join("events.out.tfevents.1.oldhost");
        std::fs::write(&stale, b"old").unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), "{\"step\":9}\n").unwrap();
        std::fs::write(dir.path().join("notes.txt"), "keep").unwrap();
        let mut w = RunWriter::create(dir.path()).unwrap();
        w.write_step(1, &BTreeMap::from([("x".to_string(), 2.0)]))
            .unwrap();
        assert!(!stale.exists());
        assert!(dir.path().join("notes.txt").exists());
        let steps = read_jsonl(w.metrics_path()).unwrap();
        assert_eq!(steps.len(), 1);
        assert_eq!((steps[0].step, steps[0].get("x")), (1, Some(2.0)));
        let records = tfevents::read_records(&std::fs::read(w.events_path()).unwrap()).unwrap();
        assert_eq!(records.len(), 2, "file_version and one step");
    }

    #[test]
    fn a_run_dir_that_cannot_be_created_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a-file");
        std::fs::write(&file, "").unwrap();
        let e = RunWriter::create(file.join("run")).unwrap_err().to_string();
        assert!(e.contains("a-file/run"), "{e}");
    }
}
