//! The prompts of a job.

use yatt_roles::{load_dataset, LengthSchedule, Prompt, SyntheticTask, SyntheticTaskKind};

use crate::config::modes::Task;
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
