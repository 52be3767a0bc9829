//! The prompts of a job.

use std::sync::Arc;

use yatt_roles::{
    encode_prompt, load_dataset, LengthSchedule, Prompt, SyntheticTask, SyntheticTaskKind,
    TextCodec, TokenizerCodec, TINY_CODEC,
};

use crate::config::checks::invalid;
use crate::config::modes::{ModelSource, Task};
use crate::config::sections::JobConfig;
use crate::error::JobError;

/// The job's training prompts (the synthetic task with the job seed, or the dataset:
/// JSONL, parquet or a `save_to_disk` directory).
pub(crate) fn prompts(job: &JobConfig) -> Result<Vec<Prompt>, JobError> {
    let d = &job.data;
    if let Some(path) = d.dataset() {
        return Ok(load_dataset(path, d.dataset_format(), &d.fields())?);
    }
    let kind = match d.task {
        Task::Letters => {
            return Ok((0..d.num_prompts as u64)
                .map(|i| Prompt {
                    id: 1000 + i,
                    text: format!("q{i}:"),
                    messages: Vec::new(),
                    reference: None,
                    metadata: serde_json::Value::Null,
                })
                .collect())
        }
        Task::Growing => return Ok(growing_task(job).prompts(d.num_prompts)),
        Task::Addition => SyntheticTaskKind::Addition,
        Task::Multiplication => SyntheticTaskKind::Multiplication,
        Task::Sorting => SyntheticTaskKind::Sorting { max_value: 99 },
        Task::Reversal => SyntheticTaskKind::Reversal,
    };
    let task = SyntheticTask::new(kind, LengthSchedule::Constant(d.length), job.job.seed)?;
    Ok(task.prompts(0, d.num_prompts))
}

/// The `growing` task of the job: target length from `data.length` to
/// `data.length_end` over the run's steps.
pub fn growing_task(job: &JobConfig) -> yatt_roles::GrowingLength {
    let d = &job.data;
    let end = if d.length_end == 0 {
        d.length
    } else {
        d.length_end
    };
    yatt_roles::GrowingLength {
        target: LengthSchedule::Linear {
            start: d.length,
            end,
            steps: job.job.steps.saturating_sub(1).max(1),
        },
    }
}

/// The prompts a job trains on: [`prompts`] through [`fit_prompts`]. A build takes
/// them before it starts any role, so a prompt that does not fit leaves nothing running.
pub(crate) fn training_prompts(job: &JobConfig) -> Result<Arc<[Prompt]>, JobError> {
    Ok(fit_prompts(job, prompts(job)?, |row| row_name(job, row))?.into())
}

/// `prompts` that fit `model.max_seq_len` with `rollout.max_new_tokens` after them, in
/// the rollout's encoding. A prompt that does not fit would fail the step that draws it,
/// maybe hours in, so it is an error here, naming the longest (`name` gives a prompt's
/// place from its index), or, with `data.filter_overlong_prompts`, dropped with a
/// warning. Unchecked (said at info) when this process cannot load the tokenizer: a
/// cluster's launcher may not hold the model.
pub(crate) fn fit_prompts(
    job: &JobConfig,
    prompts: Vec<Prompt>,
    name: impl Fn(usize) -> String,
) -> Result<Vec<Prompt>, JobError> {
    let codec: Arc<dyn TextCodec> = match &job.model.source {
        ModelSource::Tiny => Arc::new(TINY_CODEC),
        ModelSource::Dir(dir) => match yatt_engine::Tokenizer::from_dir(dir) {
            Ok(t) => Arc::new(TokenizerCodec {
                tokenizer: Arc::new(t),
                chat: job.model.chat,
            }),
            Err(e) => {
                tracing::info!(model = %dir.display(), error = %e, "prompt lengths not checked here: the tokenizer does not load in this process");
                return Ok(prompts);
            }
        },
    };
    let room = job
        .model
        .max_seq_len
        .saturating_sub(job.rollout.max_new_tokens);
    let mut longest: Option<(usize, usize)> = None;
    let mut over = 0;
    let mut kept = Vec::with_capacity(prompts.len());
    for (row, p) in prompts.into_iter().enumerate() {
        let tokens = encode_prompt(codec.as_ref(), &p)
            .map_err(|e| {
                invalid(
                    "data",
                    "prompts the tokenizer encodes",
                    &format!("{} (id {}): {e}", name(row), p.id),
                    "fix or drop that row",
                )
            })?
            .len();
        if tokens <= room {
            kept.push(p);
            continue;
        }
        over += 1;
        if longest.is_none_or(|(_, n)| tokens > n) {
            longest = Some((row, tokens));
        }
    }
    let Some((row, tokens)) = longest else {
        return Ok(kept);
    };
    let what = format!(
        "{over} prompt(s) longer than the {room} tokens left after rollout.max_new_tokens ({}); the longest, {}, has {tokens}",
        job.rollout.max_new_tokens,
        name(row)
    );
    if !job.data.filter_overlong_prompts {
        return Err(invalid(
            "model.max_seq_len",
            &format!("room for every prompt plus rollout.max_new_tokens, within {}", job.model.max_seq_len),
            &what,
            &format!(
                "raise model.max_seq_len to at least {}, lower rollout.max_new_tokens, or set data.filter_overlong_prompts = true to drop them",
                tokens + job.rollout.max_new_tokens
            ),
        ));
    }
    if kept.is_empty() {
        return Err(invalid(
            "data.filter_overlong_prompts",
            "some prompts left to train on",
            &format!("every prompt dropped: {what}"),
            "raise model.max_seq_len or lower rollout.max_new_tokens",
        ));
    }
    tracing::warn!(
        dropped = over,
        kept = kept.len(),
        "data.filter_overlong_prompts: dropped {what}"
    );
    Ok(kept)
}

/// A prompt's place for a message: its dataset row, or its index in the task.
pub(crate) fn row_name(job: &JobConfig, row: usize) -> String {
    match job.data.dataset() {
        Some(path) => format!("{path}: row {row}"),
        None => format!("prompt {row} of data.task"),
    }
}
