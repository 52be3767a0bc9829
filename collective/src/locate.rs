//! Where to look for libnccl. The torch wheel ships it inside the Python venv
//! (`site-packages/nvidia/nccl/lib/libnccl.so.2`), not on the system search path, and
//! the process that embeds yatt must use that same copy as its libtorch. This file only
//! plans the search (pure, testable without NCCL); `backend` opens the candidates.

use std::ffi::OsString;
use std::path::{Path, PathBuf};

/// Env var with an explicit path to libnccl; when set, nothing else is tried.
pub const NCCL_LIB_ENV: &str = "YATT_NCCL_LIB";
/// The library's file name in the nvidia-nccl wheel, and its soname.
const NCCL_FILE: &str = "libnccl.so.2";

/// One place that was looked at, and what to try to open there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Step {
    /// Human words for the error message: where, and what was (not) found.
    pub place: String,
    pub target: Option<Target>,
}

impl Step {
    /// A place that was looked at and held nothing to open.
    fn nothing(place: impl Into<String>) -> Step {
        Step {
            place: place.into(),
            target: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Target {
    /// An existing file.
    File(PathBuf),
    /// A name for the dynamic loader's own search (LD_LIBRARY_PATH, ld.so.cache).
    Soname(&'static str),
}

/// The process facts the search depends on, gathered apart so tests can fake them.
#[derive(Debug, Clone, Default)]
pub(crate) struct SearchEnv {
    pub explicit: Option<OsString>,
    /// Contents of /proc/self/maps.
    pub maps: Option<String>,
    pub virtual_env: Option<OsString>,
    pub path: Option<OsString>,
}

impl SearchEnv {
    pub fn from_process() -> SearchEnv {
        SearchEnv {
            explicit: std::env::var_os(NCCL_LIB_ENV).filter(|v| !v.is_empty()),
            maps: std::fs::read_to_string("/proc/self/maps").ok(),
            virtual_env: std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()),
            path: std::env::var_os("PATH"),
        }
    }
}

/// The ordered search: `YATT_NCCL_LIB`; the venv of the libtorch this process loaded;
/// `VIRTUAL_ENV`; venvs on `PATH`; the system search path.
pub(crate) fn plan(env: &SearchEnv) -> Vec<Step> {
    if let Some(p) = &env.explicit {
        let p = PathBuf::from(p);
        let target = p.is_file().then(|| Target::File(p.clone()));
        let found = if target.is_some() {
            ""
        } else {
            " (no such file)"
        };
        return vec![Step {
            place: format!("{NCCL_LIB_ENV}={}{found}", p.display()),
            target,
        }];
    }
    let mut steps = Vec::new();
    let mut seen: Vec<PathBuf> = Vec::new();
    let mut file_step = |steps: &mut Vec<Step>, origin: &str, file: PathBuf| {
        if seen.contains(&file) {
            return;
        }
        seen.push(file.clone());
        if file.is_file() {
            steps.push(Step {
                place: format!("{origin}: {}", file.display()),
                target: Some(Target::File(file)),
            });
        } else {
            steps.push(Step::nothing(format!(
                "{origin}: {} (no such file)",
                file.display()
            )));
        }
    };

    let torch_dirs = env.maps.as_deref().map(libtorch_dirs).unwrap_or_default();
    if torch_dirs.is_empty() {
        steps.push(Step::nothing("libtorch in /proc/self/maps (not loaded)"));
    }
    for dir in torch_dirs {
        // <site-packages>/torch/lib -> <site-packages>/nvidia/nccl/lib
        let file = dir.join("../../nvidia/nccl/lib").join(NCCL_FILE);
        file_step(&mut steps, "next to the loaded libtorch", normalize(&file));
    }

    match &env.virtual_env {
        None => steps.push(Step::nothing("VIRTUAL_ENV (unset)")),
        Some(v) => {
            let files = venv_candidates(Path::new(v));
            if files.is_empty() {
                let place = format!(
                    "VIRTUAL_ENV={}: no lib/python*/site-packages",
                    Path::new(v).display()
                );
                steps.push(Step::nothing(place));
            }
            for f in files {
                file_step(&mut steps, "VIRTUAL_ENV", f);
            }
        }
    }

    let path_venvs = env.path.as_ref().map(venvs_on_path).unwrap_or_default();
    if path_venvs.is_empty() {
        steps.push(Step::nothing("Python venvs on PATH (none)"));
    }
    for venv in path_venvs {
        for f in venv_candidates(&venv) {
            file_step(&mut steps, "venv on PATH", f);
        }
    }

    for soname in [NCCL_FILE, "libnccl.so"] {
        steps.push(Step {
            place: format!("system search path: {soname}"),
            target: Some(Target::Soname(soname)),
        });
    }
    steps
}

/// Directories of every libtorch shared object mapped into the process.
fn libtorch_dirs(maps: &str) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    for line in maps.lines() {
        // The path is the sixth field and may contain spaces: take everything from '/'.
        let Some(start) = line.find('/') else {
            continue;
        };
        let path = Path::new(&line[start..]);
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if name == "libtorch_cpu.so" || name == "libtorch_cuda.so" || name == "libtorch.so" {
            if let Some(dir) = path.parent() {
                if !dirs.iter().any(|d| d == dir) {
                    dirs.push(dir.to_path_buf());
                }
            }
        }
    }
    dirs
}

/// `<venv>/lib/python*/site-packages/nvidia/nccl/lib/libnccl.so.2`, one per Python.
fn venv_candidates(venv: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(venv.join("lib")) else {
        return Vec::new();
    };
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| {
            e.path()
                .join("site-packages/nvidia/nccl/lib")
                .join(NCCL_FILE)
        })
        .collect();
    out.sort();
    out
}

/// Directories on PATH that are a venv's `bin` (their parent holds `pyvenv.cfg`), as
/// scripts/bootstrap.sh leaves the project's venv.
fn venvs_on_path(path: &OsString) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for dir in std::env::split_paths(path) {
        if let Some(venv) = dir.parent() {
            if venv.join("pyvenv.cfg").is_file() && !out.iter().any(|v| v == venv) {
                out.push(venv.to_path_buf());
            }
        }
    }
    out
}

/// Resolves `..` lexically so messages and de-duplication see one spelling per file.
fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            std::path::Component::ParentDir => {
                out.pop();
            }
            std::path::Component::CurDir => {}
            other => out.push(other),
        }
    }
    out
}

/// The search written out for an `Unavailable` reason.
pub(crate) fn describe(tried: &[String]) -> String {
    format!("libnccl not found; searched {}", tried.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_venv(root: &Path, with_nccl: bool) -> PathBuf {
        let venv = root.join("venv");
        let lib = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::create_dir_all(venv.join("lib/python3.12/site-packages/torch/lib")).unwrap();
        std::fs::create_dir_all(venv.join("bin")).unwrap();
        std::fs::write(venv.join("pyvenv.cfg"), "home = /usr/bin\n").unwrap();
        if with_nccl {
            std::fs::write(lib.join(NCCL_FILE), b"not really a library").unwrap();
        }
        venv
    }

    fn tmpdir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("yatt-collective-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn explicit_path_is_the_only_step() {
        let env = SearchEnv {
            explicit: Some("/nonexistent/libnccl.so.2".into()),
            ..Default::default()
        };
        let steps = plan(&env);
        assert_eq!(steps.len(), 1);
        assert_eq!(steps[0].target, None);
        assert!(steps[0]
            .place
            .contains("YATT_NCCL_LIB=/nonexistent/libnccl.so.2 (no such file)"));
    }

    #[test]
    fn empty_process_falls_through_to_the_system() {
        let steps = plan(&SearchEnv::default());
        let places: Vec<&str> = steps.iter().map(|s| s.place.as_str()).collect();
        assert_eq!(
            places,
            [
                "libtorch in /proc/self/maps (not loaded)",
                "VIRTUAL_ENV (unset)",
                "Python venvs on PATH (none)",
                "system search path: libnccl.so.2",
                "system search path: libnccl.so",
            ]
        );
    }

    #[test]
    fn finds_the_wheel_next_to_the_mapped_libtorch_once() {
        let root = tmpdir("maps");
        let venv = fake_venv(&root, true);
        let torch = venv.join("lib/python3.12/site-packages/torch/lib/libtorch_cpu.so");
        let maps = format!(
            "7f00-7f01 r-xp 00000000 08:01 12 {t}\n7f01-7f02 r--p 00001000 08:01 12 {t}\n",
            t = torch.display()
        );
        let env = SearchEnv {
            maps: Some(maps),
            virtual_env: Some(venv.clone().into()),
            path: Some(venv.join("bin").into()),
            ..Default::default()
        };
        let steps = plan(&env);
        let want = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2");
        assert_eq!(steps[0].target, Some(Target::File(want)));
        assert!(steps[0].place.starts_with("next to the loaded libtorch"));
        // VIRTUAL_ENV and PATH name the same file: it is tried once.
        let files = steps
            .iter()
            .filter(|s| matches!(s.target, Some(Target::File(_))))
            .count();
        assert_eq!(files, 1, "{steps:?}");
        let _ = std::fs::remove_dir_all(root);
    }

    #[test]
    fn venv_without_nccl_says_so() {
        let root = tmpdir("nonccl");
        let venv = fake_venv(&root, false);
        let env = SearchEnv {
            virtual_env: Some(venv.clone().into()),
            ..Default::default()
        };
        let steps = plan(&env);
        assert!(steps[1].place.starts_with("VIRTUAL_ENV: "), "{steps:?}");
        assert!(
            steps[1]
                .place
                .ends_with("nvidia/nccl/lib/libnccl.so.2 (no such file)"),
            "{steps:?}"
        );
        assert_eq!(steps[1].target, None);
        let _ = std::fs::remove_dir_all(root);
    }
}
