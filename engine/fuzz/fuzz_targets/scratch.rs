//! A scratch directory for the targets whose API reads files: one per process, on
//! tmpfs (`/dev/shm`) when there is one, removed by nothing (it holds a few small
//! files, overwritten every run).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// `yatt-fuzz-<target>-<pid>` under `/dev/shm` (or the temp dir), created once.
pub fn dir(target: &str) -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let shm = Path::new("/dev/shm");
        let base = if shm.is_dir() {
            shm.to_path_buf()
        } else {
            std::env::temp_dir()
        };
        let d = base.join(format!("yatt-fuzz-{target}-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("creating the scratch directory");
        d
    })
}
