//! The reward role of a job: rule-based functions, reward models and the judge.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use yatt_engine::tch::Device;
use yatt_engine::{Generator, GeneratorConfig, Tokenizer};
use yatt_roles::{
    DeviceGroup, ExactMatchVerifier, HttpRewardConfig, HttpRewardScorer, JudgeConfig, JudgeMode,
    JudgeScorer, JudgeTemplate, ModelScorer, NumericVerifier, OnUnparsed, PythonReward,
    PythonRewardConfig, RewardFn, RewardRole, ScalarRewardModel, TextCodec, TokenizerCodec,
};
use yatt_runtime::Node;

use crate::build::data::growing_task;
use crate::build::devices::job_device;
use crate::config::checks::invalid;
use crate::config::modes::{ModelSource, RewardKind, Task, UnparsedVerdict, VerdictMode};
use crate::config::sections::JobConfig;
use crate::controller::refs::spawn_role;
use crate::error::JobError;
use yatt_roles::LettersReward;
use yatt_roles::TINY_CODEC;

/// Spawns the job's reward role on `node`: the `growing` task's length reward, or the
/// reward functions of `reward.kind`.
pub(crate) async fn spawn_reward(
    job: &JobConfig,
    node: &Node,
    group: DeviceGroup,
) -> Result<crate::controller::refs::SamplesRef, JobError> {
    if job.data.dataset().is_none() && job.data.task == Task::Growing {
        let role = yatt_roles::GrowingLengthReward(growing_task(job));
        return Ok(spawn_role(node, role, 0, group).await?);
    }
    Ok(spawn_role(node, reward_role(job)?, 0, group).await?)
}

/// The job's reward role: its reward functions and reward models with their weights.
/// Models load here (on the role's thread when built through a factory).
pub fn reward_role(job: &JobConfig) -> Result<RewardRole, JobError> {
    let kinds = job.reward_kinds();
    // Built on the node that serves it: the models go to that node's device.
    let dev = || job_device(job, "this node");
    let mut parts: Vec<(f64, Box<dyn RewardFn>)> = Vec::new();
    let mut models: Vec<(f64, Box<dyn ModelScorer>)> = Vec::new();
    for (i, k) in kinds.iter().enumerate() {
        let w = job.reward.weights.get(i).copied().unwrap_or(1.0);
        let f: Box<dyn RewardFn> = match k {
            RewardKind::Numeric => Box::new(NumericVerifier::default()),
            RewardKind::Exact => Box::new(ExactMatchVerifier::default()),
            RewardKind::Model => {
                models.push((w, Box::new(reward_model(job, dev()?)?)));
                continue;
            }
            RewardKind::Judge => {
                models.push((w, Box::new(judge(job, dev()?)?)));
                continue;
            }
            RewardKind::Python => {
                models.push((w, Box::new(python_reward(job)?)));
                continue;
            }
            RewardKind::Http => {
                models.push((w, Box::new(http_reward(job)?)));
                continue;
            }
            RewardKind::Letters => Box::new(LettersReward {
                letters: job.reward.letters.clone(),
            }),
        };
        parts.push((w, f));
    }
    RewardRole::with_models(parts, models).map_err(|e| {
        invalid(
            "reward.kind",
            "a valid reward combination",
            &format!("{kinds:?}"),
            &e.to_string(),
        )
    })
}

/// The codec a reward model or judge in `dir` reads text with: its own tokenizer (with
/// the chat template when `model.chat` is on), else the policy's codec.
pub(crate) fn reward_codec(job: &JobConfig, dir: &Path) -> Result<Arc<dyn TextCodec>, JobError> {
    let from = if dir.join("tokenizer.json").is_file() {
        dir.to_path_buf()
    } else {
        match &job.model.source {
            ModelSource::Tiny => return Ok(Arc::new(TINY_CODEC)),
            ModelSource::Dir(d) => d.clone(),
        }
    };
    let tok = Tokenizer::from_dir(&from).map_err(|e| JobError::Model {
        source_desc: from.display().to_string(),
        reason: e.to_string(),
    })?;
    Ok(Arc::new(TokenizerCodec {
        tokenizer: Arc::new(tok),
        chat: job.model.chat,
    }))
}

/// The job's scalar reward model (`reward.model`).
pub(crate) fn reward_model(job: &JobConfig, device: Device) -> Result<ScalarRewardModel, JobError> {
    let dir = Path::new(&job.reward.model);
    let codec = reward_codec(job, dir)?;
    ScalarRewardModel::load(dir, device, codec, 0, job.optim.micro_batch).map_err(|e| {
        invalid(
            "reward.model",
            "an HF directory of a reward model (a `score` head)",
            &format!("{:?}", job.reward.model),
            &e.to_string(),
        )
    })
}

/// The job's LLM judge (`reward.judge_model`).
pub(crate) fn judge(job: &JobConfig, device: Device) -> Result<JudgeScorer, JobError> {
    let r = &job.reward;
    let dir = Path::new(&r.judge_model);
    let codec = reward_codec(job, dir)?;
    let model = yatt_roles::load_reward_model(dir, device).map_err(|e| {
        invalid(
            "reward.judge_model",
            "an HF model directory",
            &format!("{:?}", r.judge_model),
            &e.to_string(),
        )
    })?;
    let batch = job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    let generator = Generator::new(
        model,
        GeneratorConfig {
            max_batch: batch.clamp(1, 32),
            max_seq_len: r.judge_max_seq_len,
            ..Default::default()
        },
    );
    let template = if r.judge_template.is_empty() {
        JudgeTemplate::default()
    } else {
        JudgeTemplate::new(r.judge_template.clone())?
    };
    let config = JudgeConfig {
        template,
        rubric: r.judge_rubric.clone(),
        max_tokens: r.judge_max_tokens,
        mode: match r.judge_mode {
            VerdictMode::Logits => JudgeMode::DigitLogits,
            VerdictMode::Generate => JudgeMode::Generate,
        },
        on_unparsed: match r.judge_on_unparsed {
            UnparsedVerdict::Fallback => OnUnparsed::Fallback(r.judge_fallback_score),
            UnparsedVerdict::Error => OnUnparsed::Error,
        },
        step_delimiter: job
            .algorithm
            .step_credit
            .as_ref()
            .map(|c| c.delimiter.clone()),
        critiques: r.judge_critiques,
        vote: r.judge_vote,
        step_threshold: job
            .algorithm
            .step_credit
            .as_ref()
            .map_or(0.5, |c| c.threshold as f32),
        temperature: r.judge_temperature as f32,
        ..Default::default()
    };
    JudgeScorer::new(generator, codec, config, 0).map_err(|e| {
        invalid(
            "reward.judge_model",
            "a judge model that can score",
            &format!("{:?}", r.judge_model),
            &e.to_string(),
        )
    })
}

/// The job's Python reward (`reward.function`): starts the worker pool and waits until
/// every worker has imported the function (at most `max(timeout_s, 60)` seconds).
pub(crate) fn python_reward(job: &JobConfig) -> Result<PythonReward, JobError> {
    let r = &job.reward;
    let timeout = Duration::from_secs_f64(r.timeout_s);
    let cfg = PythonRewardConfig {
        python: if r.python.is_empty() {
            yatt_roles::default_python()
        } else {
            PathBuf::from(&r.python)
        },
        workers: r.python_workers,
        batched: r.batched,
        timeout,
        start_timeout: timeout.max(Duration::from_secs(60)),
        fallback_score: r.fallback_score,
        ..PythonRewardConfig::new(r.function.clone())
    };
    PythonReward::new(cfg).map_err(|e| {
        invalid(
            "reward.function",
            "a Python function the workers can import",
            &format!("{:?}", r.function),
            &e.to_string(),
        )
    })
}

/// The job's HTTP reward endpoint (`reward.url`).
pub(crate) fn http_reward(job: &JobConfig) -> Result<HttpRewardScorer, JobError> {
    let r = &job.reward;
    let cfg = HttpRewardConfig {
        timeout: Duration::from_secs_f64(r.timeout_s),
        max_retries: r.max_retries,
        ..HttpRewardConfig::new(r.url.clone())
    };
    HttpRewardScorer::new(cfg).map_err(|e| {
        invalid(
            "reward.url",
            "http://host:port/path",
            &format!("{:?}", r.url),
            &e.to_string(),
        )
    })
}
