//! The policy's whole training state as bytes (weights, optimizer, step): what a new
//! replica in another process continues from (the live placement's hand-off). The
//! policy makes and takes it in `export.rs`.

use crate::role::RoleError;

/// A policy replica's whole training state: the files of an exact-resume checkpoint
/// (weights, AdamW moments and master weights, step and settings). Bytes rather than a
/// path, because the replica that takes it may run on a node without the same disk.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainerState {
    /// `(file name, contents)`, names without directories, sorted by name.
    pub files: Vec<(String, bytes::Bytes)>,
}

impl TrainerState {
    /// Bytes in all.
    pub fn len_bytes(&self) -> u64 {
        self.files.iter().map(|(_, b)| b.len() as u64).sum()
    }

    /// Checks the file names are plain names, each once (they become paths on import).
    pub fn check(&self) -> Result<(), RoleError> {
        let mut seen = std::collections::BTreeSet::new();
        for (name, _) in &self.files {
            let plain = !name.is_empty()
                && name != "."
                && name != ".."
                && !name.contains(['/', '\\', '\0']);
            if !plain || !seen.insert(name.as_str()) {
                return Err(RoleError::BadRequest(format!(
                    "a trainer state holds plain file names, each once; got {name:?} (send what ExportState answered)"
                )));
            }
        }
        if self.files.is_empty() {
            return Err(RoleError::BadRequest(
                "an empty trainer state (send what ExportState answered)".into(),
            ));
        }
        Ok(())
    }
}
