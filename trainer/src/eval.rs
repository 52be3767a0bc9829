//! Accuracy of a policy: greedy decoding of a job's task on held-out prompts (or on its
//! training prompts), scored by the job's own reward.
//!
//! [`evaluate`] builds the job's model (the base model, or a checkpoint written by
//! [`train`](crate::run::train)) with the same prompt encoding (chat template or not),
//! generation limits and reward functions as training, and runs the rollout and reward
//! roles directly on this thread: an evaluation needs no node and no controller.
//!
//! Held-out prompts are the same synthetic task drawn with another seed, minus every
//! prompt whose text is among the training prompts; they are a pure function of the
//! config, so base and trained models see the same ones.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use yatt_engine::{Llama, SamplingParams};
use yatt_roles::{
    DeviceGroup, GenerateRequest, Prompt, Role, RoleError, RolloutRequest, RolloutResponse,
    RolloutRole,
};

use crate::build::data::{fit_prompts, prompts, row_name};
use crate::build::devices::{on_device, role_group};
use crate::build::parts::{base_model, rollout_role};
use crate::build::reward::reward_role;
use crate::config::modes::CallPrefix;
use crate::config::sections::JobConfig;
use crate::error::JobError;

/// Mixed into the job seed to draw held-out prompts (any constant ≠ 0 would do; it is
/// fixed so held-out sets stay the same across versions).
const HELD_OUT_SEED: u64 = 0x5eed_e7a1_0000_0001;

/// Which prompts to evaluate on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Split {
    /// The job's task drawn with another seed, without any training prompt.
    HeldOut,
    /// The first prompts of the training set.
    Train,
}

impl std::fmt::Display for Split {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Split::HeldOut => "held-out",
            Split::Train => "train",
        })
    }
}

/// What to evaluate and how.
#[derive(Debug, Clone, PartialEq)]
pub struct EvalOptions {
    /// Number of prompts (one greedy answer each).
    pub prompts: usize,
    /// Weights to evaluate: a checkpoint directory; `None` = the job's base model.
    pub checkpoint: Option<PathBuf>,
    /// Which prompts.
    pub split: Split,
    /// A sample counts as correct when its reward reaches this (the numeric and exact
    /// verifiers give 1 for a right answer).
    pub pass_score: f64,
}

impl Default for EvalOptions {
    fn default() -> Self {
        EvalOptions {
            prompts: 200,
            checkpoint: None,
            split: Split::HeldOut,
            pass_score: 1.0,
        }
    }
}

/// One evaluated prompt.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalSample {
    /// The prompt text.
    pub prompt: String,
    /// The greedy answer.
    pub response: String,
    /// The reference answer, when the task has one.
    pub reference: Option<String>,
    /// The job's reward for the answer.
    pub reward: f64,
    /// Whether the reward reached the pass score.
    pub correct: bool,
    /// Tool calls of the answer's episode (0 without `rollout.env`).
    pub tool_calls: u32,
}

/// The result of an evaluation.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EvalReport {
    /// The weights evaluated: the checkpoint, or the job's `model.source`.
    pub model: String,
    /// Which prompts.
    pub split: Split,
    /// Prompts evaluated.
    pub prompts: usize,
    /// Answers that reached the pass score.
    pub correct: usize,
    /// `correct / prompts`.
    pub accuracy: f64,
    /// Mean reward.
    pub mean_reward: f64,
    /// With `rollout.env`: the share of answers that called a tool at least once.
    pub tool_call_rate: Option<f64>,
    /// Longest answer, tokens.
    pub max_new_tokens: usize,
    /// Seconds of generation and scoring (not counting loading).
    pub seconds: f64,
    /// Every prompt with its answer, in prompt order.
    pub samples: Vec<EvalSample>,
}

/// Why an evaluation could not run.
#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    /// The job config, its model, prompts or reward could not be set up.
    #[error("{0}")]
    Job(#[from] JobError),
    /// The options cannot work (no prompts asked for, no held-out split, ...).
    #[error("eval: {0}")]
    Options(String),
    /// Generating or scoring the answers failed.
    #[error("eval: {stage}: {source}")]
    Role {
        /// `generation` or `reward`.
        stage: &'static str,
        /// The role's error.
        #[source]
        source: RoleError,
    },
}

/// The prompts `options` asks for: held-out ones (deterministic, none of the training
/// prompts) or the first training prompts.
pub fn eval_prompts(job: &JobConfig, options: &EvalOptions) -> Result<Vec<Prompt>, EvalError> {
    let n = options.prompts;
    if n == 0 {
        return Err(EvalError::Options("--prompts must be at least 1".into()));
    }
    // The answers get rollout.max_new_tokens, as in training: a prompt without room for
    // them fails here, naming it, rather than in the middle of a run's evaluation.
    let train = prompts(job)?;
    if options.split == Split::Train {
        let train = fit_prompts(job, train, |row| row_name(job, row))?;
        if train.len() < n {
            return Err(EvalError::Options(format!(
                "{n} training prompts asked for, the job has {}; lower --prompts",
                train.len()
            )));
        }
        return Ok(train.into_iter().take(n).collect());
    }
    if let Some(path) = job.data.dataset() {
        return Err(EvalError::Options(format!(
            "the dataset {path:?} has no held-out split; evaluate with --split train, or on a config whose data.path is a held-out file (e.g. --set data.path=\"test.parquet\")"
        )));
    }
    let mut seen: HashSet<String> = train.into_iter().map(|p| p.text).collect();
    let mut other = job.clone();
    other.job.seed = job.job.seed ^ HELD_OUT_SEED;
    // Collisions with the training set are rare for a large task space; a few times n
    // candidates is plenty, and a small task space is reported below, not looped on.
    other.data.num_prompts = n.saturating_mul(4).saturating_add(64);
    let held_out = |i: usize| format!("held-out prompt {i} of data.task");
    // With the filter, overlong candidates are dropped before the n are picked; without
    // it, the n picked are checked at the end.
    let filter = job.data.filter_overlong_prompts;
    let candidates = match filter {
        true => fit_prompts(job, prompts(&other)?, held_out)?,
        false => prompts(&other)?,
    };
    let mut out = Vec::with_capacity(n);
    for p in candidates {
        if out.len() == n {
            break;
        }
        if seen.insert(p.text.clone()) {
            out.push(p);
        }
    }
    if out.len() < n {
        return Err(EvalError::Options(format!(
            "only {} distinct held-out prompts of task \"{}\" (length {}) are not training prompts, {n} asked for; lower --prompts or use --split train",
            out.len(),
            job.data.task,
            job.data.length
        )));
    }
    match filter {
        true => Ok(out),
        false => Ok(fit_prompts(job, out, held_out)?),
    }
}

/// The rollout role that answers: the job's base model exactly as training builds it,
/// or a checkpoint's weights (with the base model's prompt codec).
pub(crate) fn answering_role(
    job: &JobConfig,
    checkpoint: Option<&Path>,
    group: &DeviceGroup,
) -> Result<RolloutRole, EvalError> {
    let (base, codec, _) = base_model(job)?;
    let dev = group.torch_device();
    let model = match checkpoint {
        None => on_device(job, base, dev)?,
        Some(dir) => {
            drop(base);
            let kind = job.model.dtype.kind();
            // A sharded policy's checkpoint is read whole, as `yatt checkpoint merge` would.
            let loaded = match yatt_engine::is_sharded_checkpoint(dir) {
                true => yatt_engine::load_sharded_weights(dir, dev, kind),
                false => Llama::load(dir, dev, kind),
            };
            loaded.map_err(|e| JobError::Model {
                source_desc: dir.display().to_string(),
                reason: e.to_string(),
            })?
        }
    };
    Ok(rollout_role(job, model, codec))
}

/// Evaluates `job`'s model (or `options.checkpoint`): one greedy answer per prompt,
/// with the rollout's limits (`max_new_tokens`, `ignore_eos`), scored by the job's
/// reward.
pub fn evaluate(job: &JobConfig, options: &EvalOptions) -> Result<EvalReport, EvalError> {
    job.validate()?;
    // Guidance is a training aid: the evaluation measures the model's own calls.
    let unguided;
    let job = match job.rollout.env.as_ref().map(|e| e.call_prefix) {
        Some(CallPrefix::Guide) => {
            let mut j = job.clone();
            if let Some(e) = j.rollout.env.as_mut() {
                e.call_prefix = CallPrefix::Off;
            }
            unguided = j;
            &unguided
        }
        _ => job,
    };
    let prompts = eval_prompts(job, options)?;
    let role = |stage: &'static str| move |source| EvalError::Role { stage, source };
    let group = role_group(job, "eval")?;
    let mut rollout = answering_role(job, options.checkpoint.as_deref(), &group)?;
    rollout.start(&group).map_err(role("generation"))?;
    let mut reward = reward_role(job)?;
    let r = &job.rollout;
    let t0 = Instant::now();
    let request = RolloutRequest::Generate(GenerateRequest {
        step: 0,
        prompts,
        n: 1,
        params: SamplingParams {
            ignore_eos: r.ignore_eos,
            stop_strings: r.stop.clone(),
            ..SamplingParams::greedy(r.max_new_tokens)
        },
        seed: job.job.seed,
    });
    let samples = match rollout.serve(request).map_err(role("generation"))? {
        RolloutResponse::Generated { samples, .. } => samples,
        _ => {
            return Err(EvalError::Role {
                stage: "generation",
                source: RoleError::Failed("the rollout answered no samples to Generate".into()),
            })
        }
    };
    let samples = reward.serve(samples).map_err(role("reward"))?;
    let seconds = t0.elapsed().as_secs_f64();
    let samples: Vec<EvalSample> = samples
        .into_iter()
        .map(|s| {
            let reward = s.reward.unwrap_or(f64::NAN);
            EvalSample {
                prompt: s.prompt_text,
                response: s.response_text,
                reference: s.reference,
                reward,
                correct: reward >= options.pass_score,
                tool_calls: s.episode.as_ref().map_or(0, |e| e.tool_calls),
            }
        })
        .collect();
    let n = samples.len();
    let correct = samples.iter().filter(|s| s.correct).count();
    Ok(EvalReport {
        model: options
            .checkpoint
            .as_ref()
            .map_or_else(|| job.model.source.to_string(), |p| p.display().to_string()),
        split: options.split,
        prompts: n,
        correct,
        accuracy: correct as f64 / n.max(1) as f64,
        mean_reward: samples.iter().map(|s| s.reward).sum::<f64>() / n.max(1) as f64,
        tool_call_rate: job
            .rollout
            .env
            .as_ref()
            .map(|_| samples.iter().filter(|s| s.tool_calls > 0).count() as f64 / n.max(1) as f64),
        max_new_tokens: r.max_new_tokens,
        seconds,
        samples,
    })
}

/// Prepares `out/eval.jsonl` for a run, as `metrics.jsonl` is prepared: a fresh run
/// (`resumed_at = None`) removes a previous run's file, so two runs never share one
/// curve; a run resumed from its checkpoint at step N keeps the lines of steps up to N
/// and drops later ones, which the resumed run evaluates again. Lines that are not an
/// evaluation (no numeric `step`) are kept.
pub(crate) fn start_eval_log(out: &Path, resumed_at: Option<u64>) -> Result<(), JobError> {
    let path = out.join(yatt_metrics::EVAL_FILE);
    let write = |source| JobError::Write {
        path: path.clone(),
        source,
    };
    let text = match std::fs::read_to_string(&path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(write(e)),
    };
    let Some(step) = resumed_at else {
        return std::fs::remove_file(&path).map_err(write);
    };
    let kept: String = text
        .lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v.get("step").and_then(serde_json::Value::as_u64))
                .is_none_or(|s| s <= step)
        })
        .map(|line| format!("{line}\n"))
        .collect();
    std::fs::write(&path, kept).map_err(write)
}

/// The options of an evaluation during training: `job.eval.prompts` held-out prompts,
/// answered by the weights in `checkpoint`.
pub(crate) fn training_eval_options(job: &JobConfig, checkpoint: Option<&Path>) -> EvalOptions {
    EvalOptions {
        prompts: job.eval.prompts,
        checkpoint: checkpoint.map(Path::to_path_buf),
        ..Default::default()
    }
}

/// Evaluates the policy checkpoint saved after `step` (or, with `None`, the job's
/// starting weights) as `[eval]` asks and appends one
/// line to `out/eval.jsonl`: `step`, `eval/accuracy`, `eval/mean_reward`,
/// `eval/prompts`, `eval/seconds` (and `eval/tool_call_rate` with an environment), the
/// format `yatt plot --compare ... --file eval.jsonl` reads. The evaluation
/// loads its own copy of the weights on a blocking thread, so the roles' actors keep
/// answering their heartbeats meanwhile.
pub(crate) async fn evaluate_after_step(
    job: &JobConfig,
    checkpoint: Option<&Path>,
    step: u64,
    out: &Path,
) -> Result<(), JobError> {
    let fail = |reason: String| JobError::Eval { step, reason };
    let options = training_eval_options(job, checkpoint);
    let owned = job.clone();
    let report = tokio::task::spawn_blocking(move || evaluate(&owned, &options))
        .await
        .map_err(|e| fail(format!("the evaluation thread failed: {e}")))?
        .map_err(|e| fail(e.to_string()))?;
    let mut line = serde_json::json!({
        "step": step,
        (yatt_metrics::names::EVAL_ACCURACY): report.accuracy,
        (yatt_metrics::names::EVAL_MEAN_REWARD): report.mean_reward,
        "eval/prompts": report.prompts,
        "eval/seconds": report.seconds,
    });
    if let Some(rate) = report.tool_call_rate {
        line["eval/tool_call_rate"] = rate.into();
    }
    tracing::info!(
        step,
        accuracy = report.accuracy,
        prompts = report.prompts,
        seconds = report.seconds,
        "eval: greedy accuracy on held-out prompts"
    );
    let path = out.join(yatt_metrics::EVAL_FILE);
    let write = |source| JobError::Write {
        path: path.clone(),
        source,
    };
    use std::io::Write as _;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .map_err(write)?;
    writeln!(file, "{line}").map_err(write)?;
    Ok(())
}
