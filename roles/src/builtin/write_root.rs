//! Where a role may write on a peer's behalf: a node hands its roles its data
//! directory, and a path outside it (after resolving symlinks and `..`) is refused, so a
//! certificate holder cannot make a node overwrite arbitrary files.

use std::path::{Component, Path, PathBuf};

use crate::role::RoleError;

/// Whether a node whose data directory is `root` accepts writing `what` to `dir`: the
/// rule the policy and the critic apply to every checkpoint a peer asks for, for a
/// check made before the run (a job's preflight). The error names the path, the data
/// directory and both fixes.
pub fn check_write_root(root: &Path, dir: &Path, what: &str) -> Result<(), RoleError> {
    check_under(Some(root), dir, what)
}

/// Refuses `dir` unless it lies under `root` (no root: anything goes, as for a role
/// built in the trainer's own process).
pub(crate) fn check_under(root: Option<&Path>, dir: &Path, what: &str) -> Result<(), RoleError> {
    let Some(root) = root else {
        return Ok(());
    };
    let refuse = |why: &str| {
        RoleError::BadRequest(format!(
            "refusing to write {what} to {}: {why}; this node writes only under its data directory {} (yatt-node --data-dir, node.data_dir): set job.output_dir under it, or start the node with a data directory that holds the run",
            dir.display(),
            root.display()
        ))
    };
    if !dir.is_absolute() {
        return Err(refuse("a peer must send an absolute path"));
    }
    // The longest existing prefix is resolved (symlinks included); the rest must be
    // plain names, so nothing after it can climb out.
    let mut existing = dir.to_path_buf();
    let mut rest: Vec<PathBuf> = Vec::new();
    while !existing.exists() {
        let Some(name) = existing.file_name().map(PathBuf::from) else {
            return Err(refuse("no part of it exists"));
        };
        rest.push(name);
        existing.pop();
    }
    let mut resolved = existing
        .canonicalize()
        .map_err(|e| refuse(&format!("cannot resolve {}: {e}", existing.display())))?;
    for part in rest.iter().rev() {
        if !matches!(part.components().next(), Some(Component::Normal(_))) {
            return Err(refuse("it climbs out with `..`"));
        }
        resolved.push(part);
    }
    if resolved.starts_with(root) {
        Ok(())
    } else {
        Err(refuse("it is outside"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_under_the_root_pass_and_others_are_refused() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap().join("data");
        std::fs::create_dir_all(root.join("runs")).unwrap();
        let ok = |p: &Path| check_under(Some(&root), p, "a checkpoint");
        ok(&root.join("runs/a/checkpoint.tmp-1")).unwrap();
        ok(&root).unwrap();
        assert!(check_under(None, Path::new("/etc/x"), "a checkpoint").is_ok());
        for bad in [
            PathBuf::from("/etc/cron.d/x"),
            root.join("runs/../../escape"),
            root.join("missing/../../escape"),
            PathBuf::from("runs/relative"),
        ] {
            let e = ok(&bad).unwrap_err().to_string();
            assert!(e.contains("data directory"), "{bad:?}: {e}");
        }
        // A symlink inside the root that points out of it is resolved and refused.
        let outside = tmp.path().join("outside");
        std::fs::create_dir_all(&outside).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("link")).unwrap();
        assert!(ok(&root.join("link/ckpt")).is_err());
    }
}
