//! Python reward functions: a pool of worker processes of the user's Python, each
//! running `python_worker.py` (embedded here, written to a temp file at start) over a
//! line-delimited JSON protocol on stdin/stdout.
//!
//! The function has verl's signature, `compute_score(data_source, solution_str,
//! ground_truth, extra_info) -> float | dict(score=...)`, called with keywords; with
//! `batched` it takes the plural keywords (`data_sources`, `solution_strs`,
//! `ground_truths`, `extra_infos`, lists) and returns a list. A [`RewardInput`] maps to:
//!
//! | argument | from |
//! |---|---|
//! | `data_source` | `metadata["data_source"]`, else `metadata["task"]`, else `"yatt"` |
//! | `solution_str` | the response text |
//! | `ground_truth` | the reference (`None` when the sample has none) |
//! | `extra_info` | the dataset's `extra_info` object (`metadata["extra_info"]`, see `data.extra_info_key`) when it has one, else the metadata object (a non-object is under `"metadata"`); plus `"prompt"` (the prompt text) and `"sample_id"` unless the dataset's extra_info sets them |
//!
//! A step's samples are split over the workers, one call per worker, each with the
//! per-call deadline. A function that raises fails the request with the sample and the
//! traceback, unless a fallback score is set (then that score, counted and logged). A
//! worker that hangs past the deadline or dies is killed and replaced and its batch
//! sent once more; a second failure fails the request naming the function and why.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};

use crate::builtin::reward_model::ModelScorer;
use crate::reward::reward_fn::{excerpt, RewardInput, RewardOutput};
use crate::role::RoleError;

/// The worker script, written to a temp file when a pool starts.
const WORKER: &str = include_str!("python_worker.py");
/// Lines of a worker's stderr kept for error messages.
const STDERR_TAIL: usize = 30;

/// Options of a [`PythonReward`].
#[derive(Debug, Clone, PartialEq)]
pub struct PythonRewardConfig {
    /// `path/to/file.py:function`.
    pub function: String,
    /// The interpreter (see [`default_python`]).
    pub python: PathBuf,
    /// Worker processes (at least 1).
    pub workers: usize,
    /// The function takes lists and returns a list.
    pub batched: bool,
    /// Deadline of one call (one worker's batch).
    pub timeout: Duration,
    /// Deadline for a worker to import the file and say it is ready.
    pub start_timeout: Duration,
    /// Score of a sample whose function call raised; `None` fails the request.
    pub fallback_score: Option<f64>,
}

impl PythonRewardConfig {
    /// Defaults for `function`: [`default_python`], 2 workers, one sample per call,
    /// 60 s per call and to start, no fallback.
    pub fn new(function: impl Into<String>) -> Self {
        PythonRewardConfig {
            function: function.into(),
            python: default_python(),
            workers: 2,
            batched: false,
            timeout: Duration::from_secs(60),
            start_timeout: Duration::from_secs(60),
            fallback_score: None,
        }
    }
}

/// The default interpreter: `$VIRTUAL_ENV/bin/python`, else `.venv/bin/python` under
/// the working directory, else `python3` on the `PATH`.
pub fn default_python() -> PathBuf {
    let venv = std::env::var_os("VIRTUAL_ENV").map(|v| PathBuf::from(v).join("bin/python"));
    venv.into_iter()
        .chain(std::iter::once(PathBuf::from(".venv/bin/python")))
        .find(|p| p.is_file())
        .unwrap_or_else(|| PathBuf::from("python3"))
}

/// Splits `file.py:function`; the error says what is wrong and the fix.
pub fn parse_function(spec: &str) -> Result<(PathBuf, String), String> {
    let fix = "write it as \"path/to/file.py:compute_score\"";
    let (file, name) = spec
        .rsplit_once(':')
        .ok_or_else(|| format!("{spec:?} has no `:function`; {fix}"))?;
    let ident = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_alphanumeric() || c == '_');
    if !ident {
        return Err(format!(
            "{name:?} (after the last `:`) is not a Python function name; {fix}"
        ));
    }
    if !file.ends_with(".py") {
        return Err(format!("{file:?} is not a .py file; {fix}"));
    }
    Ok((PathBuf::from(file), name.to_string()))
}

/// One worker process, the thread that reads its stdout lines and the tail of its stderr.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<Option<String>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// Disconnects when the stderr thread has read the stream to its end.
    stderr_done: std::sync::mpsc::Receiver<()>,
}

impl Worker {
    fn spawn(
        cfg: &PythonRewardConfig,
        script: &Path,
        file: &Path,
        name: &str,
    ) -> Result<Self, String> {
        let mut child = Command::new(&cfg.python)
            .arg("-u")
            .arg(script)
            .arg(file)
            .arg(name)
            .arg(if cfg.batched { "1" } else { "0" })
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| {
                format!(
                    "cannot start {}: {e}; fix: set reward.python to a Python 3 interpreter",
                    cfg.python.display()
                )
            })?;
        let (Some(stdin), Some(stdout), Some(stderr)) =
            (child.stdin.take(), child.stdout.take(), child.stderr.take())
        else {
            let _ = child.kill();
            let _ = child.wait();
            return Err("the worker's pipes were not opened".into());
        };
        let (tx, lines) = sync_channel(4);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(Some(line)).is_err() {
                    return;
                }
            }
            let _ = tx.send(None);
        });
        let tail = Arc::new(Mutex::new(VecDeque::with_capacity(STDERR_TAIL)));
        let t = tail.clone();
        let (stderr_tx, stderr_done) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            // Dropped at the end of the stream: whoever waits for the tail wakes.
            let _eof = stderr_tx;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                tracing::debug!(target: "yatt::python_reward", "{line}");
                if let Ok(mut t) = t.lock() {
                    if t.len() == STDERR_TAIL {
                        t.pop_front();
                    }
                    t.push_back(line);
                }
            }
        });
        Ok(Worker {
            child,
            stdin,
            lines,
            stderr: tail,
            stderr_done,
        })
    }

    /// Waits for the worker's ready line: it has imported the function.
    fn ready(mut self, cfg: &PythonRewardConfig, deadline: Instant) -> Result<Self, String> {
        let w = &mut self;
        let ready: Value = w.recv(deadline, "starting")?;
        if let Some(tb) = ready.get("error").and_then(Value::as_str) {
            return Err(format!("cannot load {}:\n{tb}", cfg.function));
        }
        if ready.get("ready") != Some(&Value::Bool(true)) {
            return Err(format!("the worker said {ready} instead of ready"));
        }
        Ok(self)
    }

    /// The next line as JSON, before `deadline`.
    fn recv<T: for<'de> Deserialize<'de>>(
        &mut self,
        deadline: Instant,
        doing: &str,
    ) -> Result<T, String> {
        let left = deadline.saturating_duration_since(Instant::now());
        let line = match self.lines.recv_timeout(left) {
            Ok(Some(line)) => line,
            Err(RecvTimeoutError::Timeout) => {
                return Err(format!(
                    "no answer within the deadline ({doing}); the worker was killed"
                ))
            }
            Ok(None) | Err(RecvTimeoutError::Disconnected) => {
                let status = wait_exit(&mut self.child, Duration::from_millis(500));
                // Regression: the error was built before the stderr thread had read the
                // last lines (the traceback) under load. A dead worker's stderr ends, so
                // wait for its end (a moment at most: a grandchild may hold the pipe).
                let _ = self.stderr_done.recv_timeout(Duration::from_millis(500));
                return Err(format!(
                    "the worker died ({doing}, {status}){}",
                    self.stderr_tail()
                ));
            }
        };
        serde_json::from_str(&line).map_err(|e| {
            format!(
                "the worker sent a line that is not the protocol ({e}): {:?}",
                excerpt(&line, 200)
            )
        })
    }

    fn stderr_tail(&self) -> String {
        let tail = self
            .stderr
            .lock()
            .map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n"))
            .unwrap_or_default();
        if tail.is_empty() {
            String::new()
        } else {
            format!("; its stderr ends:\n{tail}")
        }
    }
}

/// Waits up to `limit` for `child` to exit (polling), and says how it ended.
fn wait_exit(child: &mut Child, limit: Duration) -> String {
    let end = Instant::now() + limit;
    loop {
        match child.try_wait() {
            Ok(Some(s)) => return s.to_string(),
            Ok(None) if Instant::now() < end => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => return "still running".into(),
            Err(e) => return format!("status unknown: {e}"),
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[derive(Deserialize)]
struct Reply {
    id: u64,
    #[serde(default)]
    results: Option<Vec<ItemReply>>,
    #[serde(default)]
    error: Option<String>,
}

#[derive(Deserialize)]
struct ItemReply {
    #[serde(default)]
    score: Option<f64>,
    #[serde(default)]
    step_scores: Option<Vec<f32>>,
    #[serde(default)]
    error: Option<String>,
}

/// What one call of a worker gave: per-sample scores or tracebacks.
type CallResult = Result<Vec<Result<RewardOutput, String>>, String>;

/// A pool of Python reward workers; a [`ModelScorer`] for the reward role.
pub struct PythonReward {
    cfg: PythonRewardConfig,
    file: PathBuf,
    func: String,
    script: tempfile::TempPath,
    workers: Vec<Option<Worker>>,
    next_id: u64,
    fallbacks: u64,
    name: String,
}

impl PythonReward {
    /// Starts `cfg.workers` workers and waits until each has imported the function.
    pub fn new(cfg: PythonRewardConfig) -> Result<Self, RoleError> {
        let (file, func) = parse_function(&cfg.function)
            .map_err(|e| RoleError::BadRequest(format!("python reward function: {e}")))?;
        if !file.is_file() {
            return Err(RoleError::BadRequest(format!(
                "python reward function: {} is not a file (relative paths are from {}); fix: point reward.function at an existing .py file",
                file.display(),
                std::env::current_dir().map(|d| d.display().to_string()).unwrap_or_default()
            )));
        }
        if cfg.workers == 0 || cfg.timeout.is_zero() {
            return Err(RoleError::BadRequest(
                "python reward: workers and timeout must be > 0".into(),
            ));
        }
        let mut script = tempfile::Builder::new()
            .prefix("yatt-reward-worker-")
            .suffix(".py")
            .tempfile()
            .map_err(|e| {
                RoleError::Failed(format!("python reward: temp file for the worker: {e}"))
            })?;
        script
            .write_all(WORKER.as_bytes())
            .map_err(|e| RoleError::Failed(format!("python reward: writing the worker: {e}")))?;
        let script = script.into_temp_path();
        let name = format!("python {}", cfg.function);
        let mut pool = PythonReward {
            workers: (0..cfg.workers).map(|_| None).collect(),
            cfg,
            file,
            func,
            script,
            next_id: 0,
            fallbacks: 0,
            name,
        };
        // Start them all, then wait for each: the imports run in parallel.
        let failed = |e: String| RoleError::Failed(format!("{}: {e}", pool.name));
        let started = (0..pool.workers.len())
            .map(|_| pool.start())
            .collect::<Result<Vec<_>, _>>()
            .map_err(failed)?;
        let deadline = Instant::now() + pool.cfg.start_timeout;
        let ready = started
            .into_iter()
            .map(|w| w.ready(&pool.cfg, deadline))
            .collect::<Result<Vec<_>, _>>()
            .map_err(failed)?;
        pool.workers = ready.into_iter().map(Some).collect();
        Ok(pool)
    }

    fn start(&self) -> Result<Worker, String> {
        Worker::spawn(&self.cfg, &self.script, &self.file, &self.func)
    }

    fn spawn(&self) -> Result<Worker, String> {
        self.start()?
            .ready(&self.cfg, Instant::now() + self.cfg.start_timeout)
    }

    /// How many samples got the fallback score so far.
    pub fn fallbacks(&self) -> u64 {
        self.fallbacks
    }

    /// Sends each chunk to its worker, then collects the answers before one deadline.
    fn round(&mut self, calls: &[(usize, &[Value])]) -> Vec<CallResult> {
        let mut ids = Vec::with_capacity(calls.len());
        let mut sent: Vec<Option<String>> = Vec::with_capacity(calls.len());
        for (w, items) in calls {
            self.next_id += 1;
            ids.push(self.next_id);
            let line = json!({"id": self.next_id, "items": items}).to_string();
            let err = match self.workers[*w].as_mut() {
                None => Some("no worker (it could not be restarted)".to_string()),
                Some(worker) => writeln!(worker.stdin, "{line}")
                    .and_then(|_| worker.stdin.flush())
                    .err()
                    .map(|e| format!("writing to the worker: {e}{}", worker.stderr_tail())),
            };
            sent.push(err);
        }
        let deadline = Instant::now() + self.cfg.timeout;
        let doing = format!(
            "a call of {} samples, timeout {:?}",
            calls.first().map_or(0, |c| c.1.len()),
            self.cfg.timeout
        );
        calls
            .iter()
            .zip(ids)
            .zip(sent)
            .map(|(((w, items), id), err)| {
                if let Some(e) = err {
                    return Err(e);
                }
                let worker = self.workers[*w].as_mut().ok_or("no worker")?;
                let reply: Reply = worker.recv(deadline, &doing)?;
                if reply.id != id {
                    return Err(format!(
                        "the worker answered call {} instead of {id}",
                        reply.id
                    ));
                }
                if let Some(tb) = reply.error {
                    return Ok(vec![Err(tb); items.len()]);
                }
                let results = reply.results.unwrap_or_default();
                if results.len() != items.len() {
                    return Err(format!(
                        "the worker gave {} results for {} samples",
                        results.len(),
                        items.len()
                    ));
                }
                Ok(results
                    .into_iter()
                    .map(|r| match (r.error, r.score) {
                        (Some(tb), _) => Err(tb),
                        (None, Some(score)) => Ok(RewardOutput {
                            score,
                            step_scores: r.step_scores,
                            explanation: String::new(),
                        }),
                        (None, None) => Err("the worker gave neither a score nor an error".into()),
                    })
                    .collect())
            })
            .collect()
    }

    fn score_labelled(
        &mut self,
        labels: &[String],
        inputs: &[RewardInput],
    ) -> Result<Vec<RewardOutput>, RoleError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let items: Vec<Value> = inputs
            .iter()
            .zip(labels)
            .map(|(i, l)| to_item(i, l))
            .collect();
        let n = self.workers.len().min(items.len());
        let per = items.len().div_ceil(n);
        let chunks: Vec<(usize, &[Value])> = items.chunks(per).enumerate().collect();
        let mut results = self.round(&chunks);
        let failed: Vec<usize> = (0..chunks.len()).filter(|&c| results[c].is_err()).collect();
        if !failed.is_empty() {
            for &c in &failed {
                let w = chunks[c].0;
                tracing::warn!(reward = %self.name, error = %results[c].as_ref().err().map_or("", |e| e.as_str()), "python reward worker failed; restarting it and retrying its batch once");
                self.workers[w] = None; // kills it
                match self.spawn() {
                    Ok(worker) => self.workers[w] = Some(worker),
                    Err(e) => {
                        return Err(RoleError::Failed(format!(
                            "{}: restarting a failed worker: {e}",
                            self.name
                        )))
                    }
                }
            }
            let retry: Vec<(usize, &[Value])> = failed.iter().map(|&c| chunks[c]).collect();
            for (c, r) in failed.iter().zip(self.round(&retry)) {
                if let Err(e) = &r {
                    let first = c * per;
                    return Err(RoleError::Failed(format!(
                        "{} failed twice on the batch from {} ({} samples): {}; fix: make the function return within reward.timeout_s ({:?}) and not crash, or raise reward.timeout_s",
                        self.name, labels[first], chunks[*c].1.len(), e, self.cfg.timeout
                    )));
                }
                results[*c] = r;
            }
        }
        let mut out = Vec::with_capacity(inputs.len());
        let mut fell_back = Vec::new();
        for (i, r) in results
            .into_iter()
            .flat_map(|r| r.unwrap_or_default())
            .enumerate()
        {
            match (r, self.cfg.fallback_score) {
                (Ok(o), _) => out.push(o),
                (Err(tb), Some(f)) => {
                    fell_back.push((i, tb));
                    out.push(RewardOutput {
                        score: f,
                        step_scores: None,
                        explanation: format!("fallback {f}: the function raised"),
                    });
                }
                (Err(tb), None) => {
                    return Err(RoleError::Failed(format!(
                        "{}: {} raised (fix the function, or set reward.fallback_score):\n{}",
                        labels[i],
                        self.cfg.function,
                        tb.trim_end()
                    )))
                }
            }
        }
        if let Some((i, tb)) = fell_back.first() {
            self.fallbacks += fell_back.len() as u64;
            tracing::warn!(
                reward = %self.name,
                fallbacks = fell_back.len(),
                total_fallbacks = self.fallbacks,
                "{} of {} samples got reward.fallback_score {:?} because the function raised; first: {}: {}",
                fell_back.len(), inputs.len(), self.cfg.fallback_score, labels[*i], tb.trim_end().lines().last().unwrap_or("")
            );
        }
        Ok(out)
    }
}

/// The verl arguments of one sample (see the module's table).
fn to_item(i: &RewardInput, label: &str) -> Value {
    let meta = &i.metadata;
    let data_source = ["data_source", "task"]
        .iter()
        .find_map(|k| meta.get(k).and_then(Value::as_str))
        .unwrap_or("yatt");
    let mut extra = match meta {
        // A dataset's own extra_info column (verl) is the function's extra_info.
        Value::Object(m) if m.get("extra_info").is_some_and(Value::is_object) => {
            m["extra_info"].as_object().cloned().unwrap_or_default()
        }
        Value::Object(m) => m.clone(),
        Value::Null => Default::default(),
        other => [("metadata".to_string(), other.clone())]
            .into_iter()
            .collect(),
    };
    extra
        .entry("prompt")
        .or_insert_with(|| Value::String(i.prompt.clone()));
    extra
        .entry("sample_id")
        .or_insert_with(|| Value::String(label.to_string()));
    json!({
        "data_source": data_source,
        "solution_str": i.response,
        "ground_truth": i.reference,
        "extra_info": extra,
    })
}

impl ModelScorer for PythonReward {
    fn name(&self) -> &str {
        &self.name
    }

    fn score_batch(&mut self, inputs: &[RewardInput]) -> Result<Vec<RewardOutput>, RoleError> {
        let labels: Vec<String> = (0..inputs.len())
            .map(|i| format!("sample #{i} of the batch"))
            .collect();
        self.score_labelled(&labels, inputs)
    }

    fn score_samples(
        &mut self,
        labels: &[String],
        inputs: &[RewardInput],
    ) -> Result<Vec<RewardOutput>, RoleError> {
        if labels.len() != inputs.len() {
            return self.score_batch(inputs);
        }
        self.score_labelled(labels, inputs)
    }
}
