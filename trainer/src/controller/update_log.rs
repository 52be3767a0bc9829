//! A role's updates since its state was last saved, on the trainer's disk: a role that
//! holds trainer state no other node has (the critic; a policy without replicas) is
//! rebuilt after its node is lost by loading that state and taking the same updates
//! again, bit for bit on nodes that compute alike.
//!
//! The log lives in a file, not in the trainer's memory: a run that checkpoints only at
//! its end (`checkpoint.every = 0`, the default) would otherwise hold gigabytes by its
//! thousandth step. Memory keeps one offset per update; a replay reads one batch at a
//! time.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use yatt_roles::Sample;

/// A role's updates since its state was last saved, oldest first, each a postcard
/// batch in `path`.
#[derive(Debug)]
pub(crate) struct UpdateLog {
    /// The role, as errors name it.
    role: &'static str,
    /// What of each sample the role's update reads (the rest is not written); `None`:
    /// whole samples, written as they are.
    keep: Option<fn(&Sample) -> Sample>,
    /// The checkpoint that holds the role's state before the updates; `None`: the job's
    /// fresh role.
    base: Option<PathBuf>,
    /// Where the updates are written: created at the first, removed with the log.
    path: PathBuf,
    file: Option<File>,
    /// Each update: the step (1-based) that made it, and where its batch starts in the
    /// file (it ends where the next starts, the last at `end`).
    updates: Vec<(u64, u64)>,
    end: u64,
    /// Why the updates cannot be given again (a write failed), until the next
    /// checkpoint starts the log afresh.
    broken: Option<String>,
}

impl UpdateLog {
    /// A log of `role`, which started from `base` (a resumed run's checkpoint) or
    /// fresh, writing what `keep` keeps of its updates (all, with `None`) to `path`
    /// (truncated at the first).
    pub(crate) fn new(
        role: &'static str,
        keep: Option<fn(&Sample) -> Sample>,
        base: Option<PathBuf>,
        path: PathBuf,
    ) -> Self {
        UpdateLog {
            role,
            keep,
            base,
            path,
            file: None,
            updates: Vec::new(),
            end: 0,
            broken: None,
        }
    }

    /// Step `step` trained the role on `samples`. A write that fails does not stop
    /// the run: the log says why at the next recovery, which cannot happen then.
    pub(crate) fn record(&mut self, step: u64, samples: &[Sample]) {
        if self.broken.is_some() {
            return;
        }
        let encoded = match self.keep {
            Some(keep) => postcard::to_allocvec(&samples.iter().map(keep).collect::<Vec<_>>()),
            None => postcard::to_allocvec(samples),
        };
        let written = encoded
            .map_err(io::Error::other)
            .and_then(|bytes| self.append(&bytes));
        match written {
            Ok(at) => self.updates.push((step, at)),
            Err(e) => {
                let why = format!(
                    "writing the {}'s update of step {step} to {}: {e}",
                    self.role,
                    self.path.display()
                );
                tracing::warn!(role = self.role, "{why}; until the next checkpoint, losing the {}'s node stops the run (free the disk, or set checkpoint.every)", self.role);
                self.broken = Some(why);
            }
        }
    }

    /// Writes `bytes` at the end of the file; where they start.
    fn append(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let file = match &self.file {
            Some(f) => f,
            None => {
                if let Some(dir) = self.path.parent() {
                    std::fs::create_dir_all(dir)?;
                }
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create(true)
                    .truncate(true)
                    .open(&self.path)?;
                self.file.insert(f)
            }
        };
        file.write_all_at(bytes, self.end)?;
        let at = self.end;
        self.end += bytes.len() as u64;
        Ok(at)
    }

    /// The role's state was saved in checkpoint `dir`: the log starts again there.
    pub(crate) fn checkpointed(&mut self, dir: &Path) {
        self.base = Some(dir.to_path_buf());
        self.updates.clear();
        self.broken = None;
        self.cut(0);
    }

    /// The run goes back to after step `completed`: later updates are undone with it.
    pub(crate) fn rewind(&mut self, completed: u64) {
        if let Some(i) = self.updates.iter().position(|(step, _)| *step > completed) {
            let at = self.updates[i].1;
            self.updates.truncate(i);
            self.cut(at);
        }
    }

    /// Ends the file at `at`; a failure leaves bytes past `end` that nothing reads.
    fn cut(&mut self, at: u64) {
        self.end = at;
        if let Some(f) = &self.file {
            if let Err(e) = f.set_len(at) {
                tracing::debug!(path = %self.path.display(), error = %e, "could not shorten the update log");
            }
        }
    }

    /// Where a new role starts (see [`UpdateLog::base`]).
    pub(crate) fn base(&self) -> Option<&Path> {
        self.base.as_deref()
    }

    /// How many updates a new role is to be given.
    pub(crate) fn len(&self) -> usize {
        self.updates.len()
    }

    /// Whether every update can be given again; `Err`: why not.
    pub(crate) fn replayable(&self) -> Result<(), String> {
        match &self.broken {
            Some(why) => Err(why.clone()),
            None => Ok(()),
        }
    }

    /// The `i`th update's samples (0: the oldest).
    pub(crate) fn batch(&self, i: usize) -> Result<Vec<Sample>, String> {
        self.replayable()?;
        let (step, at) = *self.updates.get(i).ok_or_else(|| {
            format!(
                "the {}'s log has {} updates, not {}",
                self.role,
                self.len(),
                i + 1
            )
        })?;
        let end = self.updates.get(i + 1).map_or(self.end, |u| u.1);
        let read = || -> io::Result<Vec<Sample>> {
            let file = self
                .file
                .as_ref()
                .ok_or_else(|| io::Error::other("the file was never written"))?;
            let mut bytes = vec![0; (end - at) as usize];
            file.read_exact_at(&mut bytes, at)?;
            postcard::from_bytes(&bytes).map_err(io::Error::other)
        };
        read().map_err(|e| {
            format!(
                "reading the {}'s update of step {step} back from {}: {e}",
                self.role,
                self.path.display()
            )
        })
    }
}

impl Drop for UpdateLog {
    fn drop(&mut self) {
        if self.file.take().is_some() {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// A role's [`UpdateLog`] as a controller shares it, with the count of updates given
/// again since the step's metrics last took it.
#[derive(Debug)]
pub(crate) struct LoggedUpdates {
    log: Mutex<UpdateLog>,
    replayed: AtomicU64,
}

impl LoggedUpdates {
    pub(crate) fn new(log: UpdateLog) -> Self {
        LoggedUpdates {
            log: Mutex::new(log),
            replayed: AtomicU64::new(0),
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, UpdateLog> {
        // Its methods do not panic midway: a poisoned lock still guards a whole log.
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Updates given again since the last call.
    pub(crate) fn take_replayed(&self) -> u64 {
        self.replayed.swap(0, Ordering::Relaxed)
    }

    /// A new role took `updates` logged updates.
    pub(crate) fn count_replayed(&self, updates: u64) {
        self.replayed.fetch_add(updates, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use yatt_roles::SampleId;

    fn sample(id: u64) -> Sample {
        let id = SampleId {
            step: 0,
            prompt: id,
            k: 0,
        };
        let mut s = Sample::new(id, id.prompt);
        s.prompt_tokens = vec![1, 2];
        s.response_tokens = vec![3, 4, 5];
        s.prompt_text = "a long prompt".into();
        s.values = Some(vec![0.5; 3]);
        s.returns = Some(vec![1.0; 3]);
        s
    }

    fn ids(log: &UpdateLog) -> Vec<Vec<SampleId>> {
        (0..log.len())
            .map(|i| log.batch(i).unwrap().iter().map(|s| s.id).collect())
            .collect()
    }

    fn size(path: &Path) -> u64 {
        std::fs::metadata(path).unwrap().len()
    }

    #[test]
    fn the_log_keeps_on_disk_what_the_role_trained_on_since_the_last_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("out").join("critic-updates.bin");
        let mut log = UpdateLog::new("critic", None, None, path.clone());
        log.record(1, &[sample(1), sample(2)]);
        log.record(2, &[sample(3)]);
        assert_eq!(
            ids(&log),
            [vec![sample(1).id, sample(2).id], vec![sample(3).id]]
        );
        assert_eq!(log.batch(0).unwrap()[0], sample(1));
        assert!(size(&path) > 0);

        log.checkpointed(Path::new("/run/checkpoint"));
        assert_eq!(log.base(), Some(Path::new("/run/checkpoint")));
        assert_eq!(log.len(), 0);
        assert_eq!(size(&path), 0, "a checkpoint empties the file");
        log.record(3, &[sample(4)]);
        let one = size(&path);
        log.record(4, &[sample(5)]);
        // Step 4 runs again from after step 3: its update is undone, in the file too.
        log.rewind(3);
        assert_eq!(ids(&log), [vec![sample(4).id]]);
        assert_eq!(size(&path), one);
        log.record(4, &[sample(6)]);
        assert_eq!(ids(&log), [vec![sample(4).id], vec![sample(6).id]]);
        assert!(log.batch(2).is_err());

        drop(log);
        assert!(!path.exists(), "the log's file goes with it");
    }

    #[test]
    fn a_log_that_cannot_be_written_says_so_until_the_next_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        // Its directory would be a file.
        let blocker = dir.path().join("output");
        std::fs::write(&blocker, "not a directory").unwrap();
        let path = blocker.join("critic-updates.bin");
        let mut log = UpdateLog::new("critic", None, None, path.clone());
        log.record(7, &[sample(1)]);
        let why = log.replayable().unwrap_err();
        assert!(why.contains("step 7"), "{why}");
        assert!(why.contains(&path.display().to_string()), "{why}");
        assert_eq!(log.len(), 0);
        assert_eq!(log.batch(0).unwrap_err(), why);
        log.checkpointed(Path::new("/run/checkpoint"));
        assert_eq!(log.replayable(), Ok(()));
    }
}
