//! Small checks of config values that give `JobError::Invalid` with the key, what is
//! accepted, what was found and the fix.

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

use crate::error::JobError;

pub(crate) fn invalid(key: &str, expected: &str, found: &str, fix: &str) -> JobError {
    JobError::Invalid {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.into(),
    }
}

pub(crate) fn positive(key: &str, v: f64, fix: &str) -> Result<(), JobError> {
    if v > 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(key, "a positive number", &v.to_string(), fix))
    }
}

fn non_negative(key: &str, v: f64) -> Result<(), JobError> {
    if v >= 0.0 && v.is_finite() {
        Ok(())
    } else {
        Err(invalid(
            key,
            "a number ≥ 0",
            &v.to_string(),
            "use 0 to turn it off",
        ))
    }
}

pub(crate) fn one_of(key: &str, v: &str, allowed: &[&str]) -> Result<(), JobError> {
    if allowed.contains(&v) {
        Ok(())
    } else {
        let list = allowed
            .iter()
            .map(|a| format!("\"{a}\""))
            .collect::<Vec<_>>()
            .join(", ");
        Err(invalid(
            key,
            &format!("one of {list}"),
            &format!("\"{v}\""),
            &format!("set {key} = \"{}\"", allowed[0]),
        ))
    }
}
