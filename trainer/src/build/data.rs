//! The prompts of a job.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use yatt_engine::{Generator, GeneratorConfig, Llama, LrSchedule, SamplingParams, Tokenizer, TrainConfig, Trainer, tch};
use yatt_engine::fixtures::tiny_config;
use yatt_engine::tch::{Device, Kind};
use yatt_metrics::{RunWriter, WriteError};
use yatt_roles::{AsciiCodec, CriticConfig, CriticRole, DataError, Dataloader, DeviceGroup, ExactMatchVerifier, GaeConfig, GrpoConfig, JudgeConfig, JudgeMode, JudgeScorer, JudgeTemplate, KlEstimator, KlLossConfig, LengthSchedule, LossAgg, ModelScorer, NumericVerifier, OnUnparsed, PolicyConfig, PolicyLossConfig, PolicyRole, Prompt, ReferenceRole, ReinforcePpConfig, RewardError, RewardFn, RewardInput, RewardOutput, RewardRole, RolloutRole, ScalarRewardModel, SyntheticTask, SyntheticTaskKind, TextCodec, TokenizerCodec, ValueLossConfig, load_jsonl};
use yatt_runtime::collective::{RING_CHUNK_BYTES, RingMember};
use yatt_runtime::node::Node;

use crate::config::checks::invalid;
use crate::config::sections::JobConfig;
use crate::error::JobError;
use crate::config::modes::Task;

/// The job's training prompts (the synthetic task with the job seed, or the JSONL file).
pub(crate) fn prompts(job: &JobConfig) -> Result<Vec<Prompt>, JobError> {
    let d = &job.data;
    if !d.jsonl.is_empty() {
        return Ok(load_jsonl(&d.jsonl)?);
    }
    let kind = match d.task {
        Task::Letters => {
            return Ok((0..d.num_prompts as u64)
                .map(|i| Prompt {
                    id: 1000 + i,
                    text: format!("q{i}:"),
                    reference: None,
                    metadata: serde_json::Value::Null,
                })
                .collect())
        }
        Task::Growing => return Ok(growing_task(job).prompts(d.num_prompts)),
        Task::Addition => SyntheticTaskKind::Addition,
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
