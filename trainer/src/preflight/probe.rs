//! The checks a job's preflight makes on the node where they matter: whether the node's
//! roles may and can write the run's directory (its data-directory rule, a probe file
//! created, fsynced and removed, the free space), the content hash of the model it will
//! load, and whether the job's Python or HTTP reward answers one call there. A node
//! runs them in a short-lived `preflight` actor (registered by [`crate::register`]),
//! which answers one request and stops; the trainer runs the same functions in process
//! for what it writes itself and for an embedded job.

use std::collections::HashMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use yatt_roles::{ModelScorer, RewardInput};
use yatt_runtime::{Actor, ActorError, ActorName, Context, Node};

use crate::build::reward::{http_reward, python_reward};
use crate::config::modes::RewardKind;
use crate::config::sections::JobConfig;

/// The test hook that fakes the free space a path's file system reports, in bytes: a
/// node (or the trainer) whose environment sets it reports that figure instead of the
/// file system's, so a test can stand for a disk too small for the checkpoints. Not a
/// setting: nothing but tests should set it.
pub const FREE_BYTES_TEST_HOOK: &str = "YATT_TEST_FREE_BYTES";

/// One check a node is asked to make.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum ProbeCheck {
    /// The node's roles will write under `dir` (`key` names the setting, `what` the
    /// writer): the data-directory rule accepts it, a file can be created, fsynced and
    /// removed there, and `need_bytes` fit its free space (a warning otherwise).
    Writable {
        key: String,
        what: String,
        dir: PathBuf,
        need_bytes: u64,
    },
    /// The node will load the model at `source`: it exists, and its content hash.
    Model { source: PathBuf },
    /// The node will serve the job's reward (the job as TOML): its Python or HTTP
    /// reward answers one call with this input.
    Reward {
        job: String,
        prompt: String,
        response: String,
        reference: Option<String>,
    },
}

/// What one check found.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Outcome {
    /// Passed: what was seen.
    Pass(String),
    /// Passed with a warning: what may fail later, and the fix.
    Warn(String),
    /// Failed: what is wrong and the fix.
    Fail(String),
}

/// A check's result on one node.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeResult {
    /// The check, e.g. `checkpoint path`.
    pub check: String,
    /// The config key it is about.
    pub key: String,
    /// What it found.
    pub outcome: Outcome,
    /// The model's content hash (for [`ProbeCheck::Model`]).
    pub digest: Option<String>,
}

/// What a node asked for checks answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeRequest {
    pub checks: Vec<ProbeCheck>,
}

/// A node's answer: its data directory and factories, and each check's result.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProbeAnswer {
    /// The node's data directory (where it writes for peers).
    pub data_dir: PathBuf,
    /// The roles the node can spawn.
    pub factories: Vec<String>,
    /// One per check, in order.
    pub results: Vec<ProbeResult>,
}

/// The `preflight` actor: answers one [`ProbeRequest`] and stops.
pub(crate) struct ProbeActor {
    root: PathBuf,
    factories: Vec<String>,
}

impl ProbeActor {
    pub(crate) fn new(
        node: &Node,
        _: &ActorName,
        _: (),
    ) -> impl std::future::Future<Output = Result<Self, String>> {
        let made = ProbeActor {
            root: node.config().data_dir.clone(),
            factories: node.factory_roles(),
        };
        std::future::ready(Ok(made))
    }
}

impl Actor for ProbeActor {
    type Request = ProbeRequest;
    type Response = ProbeAnswer;

    async fn handle(
        &mut self,
        request: ProbeRequest,
        ctx: &mut Context,
    ) -> Result<ProbeAnswer, ActorError> {
        // One request: nothing of the check stays on the node.
        ctx.stop();
        let root = self.root.clone();
        let results = tokio::task::spawn_blocking(move || run_checks(Some(&root), &request.checks))
            .await
            .map_err(|e| ActorError::Failed(format!("the checks panicked: {e}")))?;
        Ok(ProbeAnswer {
            data_dir: self.root.clone(),
            factories: self.factories.clone(),
            results,
        })
    }
}

/// Runs `checks` here; `root` is the data directory writes must stay under (none: the
/// trainer's own process, which writes where its user can).
pub(crate) fn run_checks(root: Option<&Path>, checks: &[ProbeCheck]) -> Vec<ProbeResult> {
    checks.iter().flat_map(|c| run_check(root, c)).collect()
}

fn result(check: &str, key: &str, outcome: Outcome) -> ProbeResult {
    ProbeResult {
        check: check.into(),
        key: key.into(),
        outcome,
        digest: None,
    }
}

fn run_check(root: Option<&Path>, check: &ProbeCheck) -> Vec<ProbeResult> {
    match check {
        ProbeCheck::Writable {
            key,
            what,
            dir,
            need_bytes,
        } => writable(root, key, what, dir, *need_bytes),
        ProbeCheck::Model { source } => vec![match model_digest(source) {
            Ok(d) => ProbeResult {
                digest: Some(d.hash.clone()),
                ..result(
                    "model",
                    "model.source",
                    Outcome::Pass(format!(
                        "{} present: {} weight file(s), {} bytes, content hash {}",
                        source.display(),
                        d.files,
                        d.bytes,
                        d.hash
                    )),
                )
            },
            Err(e) => result("model", "model.source", Outcome::Fail(e)),
        }],
        ProbeCheck::Reward {
            job,
            prompt,
            response,
            reference,
        } => reward(job, prompt, response, reference.clone()),
    }
}

/// The writable check of `dir`: the rule, a probe file, the free space.
fn writable(root: Option<&Path>, key: &str, what: &str, dir: &Path, need: u64) -> Vec<ProbeResult> {
    let check = "checkpoint path";
    if let Some(root) = root {
        if let Err(e) = yatt_roles::check_write_root(root, dir, what) {
            let text = e.to_string();
            let text = text
                .strip_prefix("bad request: ")
                .unwrap_or(&text)
                .to_string();
            return vec![result(check, key, Outcome::Fail(text))];
        }
    }
    if let Err(e) = probe_file(dir) {
        return vec![result(
            check,
            key,
            Outcome::Fail(format!(
                "cannot create, fsync and remove a file in {}: {e}; fix: make it writable by this node's user, or set {key} to a directory it can write",
                dir.display()
            )),
        )];
    }
    let mut out = vec![result(
        check,
        key,
        Outcome::Pass(format!(
            "{what} may be written to {} (a probe file was created, fsynced and removed)",
            dir.display()
        )),
    )];
    out.push(result(
        "free space",
        key,
        match free_bytes(dir) {
            Ok(free) if free < need => Outcome::Warn(format!(
                "{} has {} free, the checkpoints this job keeps need about {}; fix: free space there or set {key} on a larger disk",
                dir.display(),
                gib(free),
                gib(need)
            )),
            Ok(free) => Outcome::Pass(format!(
                "{} free at {}, the checkpoints need about {}",
                gib(free),
                dir.display(),
                gib(need)
            )),
            Err(e) => Outcome::Warn(format!(
                "cannot read the free space at {}: {e}",
                dir.display()
            )),
        },
    ));
    out
}

/// Bytes as GiB (or MiB below 1 GiB) for messages.
pub(crate) fn gib(bytes: u64) -> String {
    let b = bytes as f64;
    if b >= f64::from(1u32 << 30) {
        format!("{:.1} GiB", b / f64::from(1u32 << 30))
    } else {
        format!("{:.1} MiB", b / f64::from(1u32 << 20))
    }
}

/// Creates `dir` as needed, writes, fsyncs and removes a file there, and removes the
/// directories it created: nothing is left behind.
fn probe_file(dir: &Path) -> std::io::Result<()> {
    let mut created = Vec::new();
    let mut d = dir.to_path_buf();
    while !d.exists() {
        created.push(d.clone());
        if !d.pop() {
            break;
        }
    }
    std::fs::create_dir_all(dir)?;
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |t| t.subsec_nanos());
    let path = dir.join(format!(".yatt-preflight-{}-{nanos}", std::process::id()));
    let written = (|| {
        let mut f = std::fs::File::create(&path)?;
        f.write_all(b"yatt preflight\n")?;
        f.sync_all()?;
        std::fs::remove_file(&path)?;
        std::fs::File::open(dir)?.sync_all()
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&path);
    }
    for c in &created {
        let _ = std::fs::remove_dir(c);
    }
    written
}

/// The free bytes of the file system holding `dir` (its nearest existing ancestor), or
/// the figure of [`FREE_BYTES_TEST_HOOK`].
fn free_bytes(dir: &Path) -> Result<u64, String> {
    if let Ok(v) = std::env::var(FREE_BYTES_TEST_HOOK) {
        return v
            .trim()
            .parse()
            .map_err(|e| format!("{FREE_BYTES_TEST_HOOK}={v:?}: {e}"));
    }
    let mut d = dir.to_path_buf();
    while !d.exists() && d.pop() {}
    let c = std::ffi::CString::new(d.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: a valid NUL-terminated path and a zeroed out-parameter.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::statvfs(c.as_ptr(), &mut s) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error().to_string());
    }
    Ok((s.f_bavail as u64).saturating_mul(s.f_frsize as u64))
}

/// A model's weights as the preflight compares them between nodes.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ModelDigest {
    pub files: usize,
    pub bytes: u64,
    pub hash: String,
}

/// Whether a file of a model directory is part of what must match between nodes: the
/// weights and the architecture.
fn is_weight_file(p: &Path) -> bool {
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    name == "config.json"
        || [".safetensors", ".bin", ".pt", ".pth", ".gguf"]
            .iter()
            .any(|e| name.ends_with(e))
}

/// Per-file crc32 by (path, size, mtime): a daemon checks the same model run after run
/// without reading it again.
type DigestCache = Mutex<HashMap<(PathBuf, u64, SystemTime), u32>>;
fn cache() -> &'static DigestCache {
    static CACHE: OnceLock<DigestCache> = OnceLock::new();
    CACHE.get_or_init(Default::default)
}

/// The content hash of the model at `source` (a directory's weight files and
/// `config.json`, or one file): a crc32 of each, folded with its name and size.
pub(crate) fn model_digest(source: &Path) -> Result<ModelDigest, String> {
    let missing = |e: std::io::Error| {
        format!(
            "{} cannot be read here: {e}; fix: copy the model to this path on this node, or set model.source to where it is",
            source.display()
        )
    };
    let meta = std::fs::metadata(source).map_err(missing)?;
    let mut files: Vec<PathBuf> = if meta.is_dir() {
        std::fs::read_dir(source)
            .map_err(missing)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && is_weight_file(p))
            .collect()
    } else {
        vec![source.to_path_buf()]
    };
    files.sort();
    if files.is_empty() {
        return Err(format!(
            "{} holds no weight files (*.safetensors, *.bin, *.gguf, config.json); fix: point model.source at an HF model directory present on this node",
            source.display()
        ));
    }
    let mut all = crc32fast::Hasher::new();
    let mut bytes = 0;
    for f in &files {
        let m = std::fs::metadata(f).map_err(missing)?;
        let key = (f.clone(), m.len(), m.modified().unwrap_or(UNIX_EPOCH));
        let cached = cache()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&key)
            .copied();
        let crc = match cached {
            Some(c) => c,
            None => {
                let c = file_crc(f).map_err(missing)?;
                cache()
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert(key, c);
                c
            }
        };
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned());
        all.update(name.unwrap_or_default().as_bytes());
        all.update(&m.len().to_le_bytes());
        all.update(&crc.to_le_bytes());
        bytes += m.len();
    }
    Ok(ModelDigest {
        files: files.len(),
        bytes,
        hash: format!("{:08x}", all.finalize()),
    })
}

fn file_crc(path: &Path) -> std::io::Result<u32> {
    use std::io::Read as _;
    let mut f = std::fs::File::open(path)?;
    let mut h = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(h.finalize());
        }
        h.update(&buf[..n]);
    }
}

/// The job's Python and HTTP rewards, each built here and asked to score one input.
fn reward(job: &str, prompt: &str, response: &str, reference: Option<String>) -> Vec<ProbeResult> {
    let job = match JobConfig::parse(job, "the job config sent by the trainer", &[]) {
        Ok(j) => j,
        Err(e) => return vec![result("reward", "reward", Outcome::Fail(e.to_string()))],
    };
    let input = RewardInput {
        prompt: prompt.into(),
        response: response.into(),
        reference,
        metadata: serde_json::Value::Null,
    };
    let mut out = Vec::new();
    for kind in job.reward_kinds() {
        let (key, built): (&str, Result<Box<dyn ModelScorer>, String>) = match kind {
            RewardKind::Python => (
                "reward.function",
                python_reward(&job)
                    .map(|r| Box::new(r) as Box<dyn ModelScorer>)
                    .map_err(|e| e.to_string()),
            ),
            RewardKind::Http => (
                "reward.url",
                http_reward(&job)
                    .map(|r| Box::new(r) as Box<dyn ModelScorer>)
                    .map_err(|e| e.to_string()),
            ),
            _ => continue,
        };
        let outcome = match built {
            Err(e) => Outcome::Fail(e),
            Ok(mut scorer) => match scorer.score_batch(std::slice::from_ref(&input)) {
                Ok(scores) => Outcome::Pass(format!(
                    "{} answered one call (score {})",
                    scorer.name(),
                    scores.first().map_or(f64::NAN, |s| s.score)
                )),
                Err(e) => Outcome::Fail(format!(
                    "{} did not answer one call: {e}; fix: run the reward by hand with a sample of the job and correct it",
                    scorer.name()
                )),
            },
        };
        out.push(result("reward", key, outcome));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_differing_by_one_byte_hashes_differently_and_the_cache_sees_the_change() {
        let tmp = tempfile::tempdir().unwrap();
        let f = tmp.path().join("model.safetensors");
        std::fs::write(&f, vec![7u8; 4096]).unwrap();
        std::fs::write(tmp.path().join("README.md"), "ignored").unwrap();
        let a = model_digest(tmp.path()).unwrap();
        assert_eq!((a.files, a.bytes), (1, 4096));
        assert_eq!(model_digest(tmp.path()).unwrap(), a);
        let mut bytes = vec![7u8; 4096];
        bytes[100] = 8;
        std::fs::write(&f, bytes).unwrap();
        // A rewrite within the same mtime tick keeps size and mtime: force a new mtime.
        let later = SystemTime::now() + std::time::Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(&f)
            .unwrap()
            .set_modified(later)
            .unwrap();
        assert_ne!(model_digest(tmp.path()).unwrap().hash, a.hash);
        let e = model_digest(&tmp.path().join("absent")).unwrap_err();
        assert!(e.contains("model.source"), "{e}");
    }

    #[test]
    fn a_probe_leaves_nothing_and_the_rule_names_the_data_directory() {
        let tmp = tempfile::tempdir().unwrap();
        let root = tmp.path().canonicalize().unwrap();
        let dir = root.join("a/b");
        let r = writable(
            Some(&root),
            "job.output_dir",
            "the policy's checkpoint",
            &dir,
            0,
        );
        assert!(matches!(r[0].outcome, Outcome::Pass(_)), "{r:?}");
        assert!(!root.join("a").exists());
        let other = tempfile::tempdir().unwrap();
        let r = writable(
            Some(&root),
            "job.output_dir",
            "the policy's checkpoint",
            other.path(),
            0,
        );
        let Outcome::Fail(text) = &r[0].outcome else {
            panic!("{r:?}")
        };
        assert!(
            text.contains("outside") && text.contains(&root.display().to_string()),
            "{text}"
        );
    }
}
