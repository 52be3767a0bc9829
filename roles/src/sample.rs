//! Samples: what flows between roles, keyed by sample id.
//!
//! What belongs here: [`SampleId`], [`Sample`] (one response to one prompt plus the
//! per-stage fields each role fills in), and the helpers that turn a batch of samples
//! into the `[B, T]` response-token tensors the algorithms take (and back). No actors,
//! no models.
//!
//! A sample is created by the rollout role with its tokens and rollout log-probs; the
//! reward role sets `reward`, the reference role `ref_logprobs`, the policy
//! `old_logprobs`, the controller `advantages`. Every per-token field has one entry per
//! response token.

use std::fmt;

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Which sample: the `k`-th of the `n` responses to prompt `prompt` at step `step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct SampleId {
    /// Training step the sample belongs to.
    pub step: u64,
    /// The prompt's stable id (also the sample's group).
    pub prompt: u64,
    /// Which of the prompt's `n` samples (0-based).
    pub k: u32,
}

impl fmt::Display for SampleId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "step {} prompt {:#x} sample {}",
            self.step, self.prompt, self.k
        )
    }
}

/// Why generation of a sample stopped (the engine's reason, serializable).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Finish {
    /// It produced a stop token (included in the response).
    StopToken(i64),
    /// Its text contains this stop string.
    StopString(String),
    /// It reached the length limit.
    Length,
}

impl From<yatt_engine::FinishReason> for Finish {
    fn from(f: yatt_engine::FinishReason) -> Self {
        match f {
            yatt_engine::FinishReason::StopToken(t) => Finish::StopToken(t),
            yatt_engine::FinishReason::StopString(s) => Finish::StopString(s),
            yatt_engine::FinishReason::Length => Finish::Length,
        }
    }
}

/// One response to one prompt, and what each stage learnt about it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// The sample's id.
    pub id: SampleId,
    /// The prompt group (the prompt id): advantages compare samples of one group.
    pub group: u64,
    /// Prompt token ids.
    pub prompt_tokens: Vec<i64>,
    /// Response token ids.
    pub response_tokens: Vec<i64>,
    /// Log-prob of each response token under the rollout engine's weights.
    pub rollout_logprobs: Vec<f32>,
    /// Why generation stopped.
    pub finish: Finish,
    /// The prompt text.
    pub prompt_text: String,
    /// The decoded response text.
    pub response_text: String,
    /// The reference answer, when the task has one.
    pub reference: Option<String>,
    /// Task metadata carried from the prompt.
    #[serde(default, with = "crate::json_value")]
    pub metadata: serde_json::Value,
    /// Policy weights version its generation started with (its first token's).
    pub weights_version: u64,
    /// Policy weights version of its last token, when a partial rollout continued it on
    /// newer weights; `None`: every token came from `weights_version`.
    #[serde(default)]
    pub weights_version_last: Option<u64>,
    /// Scalar reward (reward stage).
    pub reward: Option<f64>,
    /// Per-token log-probs under the reference policy (reference stage).
    pub ref_logprobs: Option<Vec<f32>>,
    /// Per-token log-probs under the policy before the update (old-log-prob stage).
    pub old_logprobs: Option<Vec<f32>>,
    /// Per-token critic values (critic stage).
    pub values: Option<Vec<f32>>,
    /// Per-token advantages (advantage stage).
    pub advantages: Option<Vec<f32>>,
    /// Per-token returns, the critic's targets (advantage stage, with GAE).
    #[serde(default)]
    pub returns: Option<Vec<f32>>,
    /// Per-step (process) rewards in `[0, 1]`, one per reasoning step the reward judged
    /// (reward stage, when the reward gives them: an LLM judge's `Step k: s` lines).
    /// With `[algorithm.step_credit]` they lower the advantages of failed steps'
    /// tokens (CAPO-style); the controller reports their mean as
    /// `reward/step_scores/mean`.
    #[serde(default)]
    pub step_rewards: Option<Vec<f32>>,
    /// Where each reasoning step of the response ends, in response tokens (exclusive),
    /// set by the rollout when step credit is on ([`crate::step_token_ends`]): the
    /// tokens a step verdict in `step_rewards` applies to.
    #[serde(default)]
    pub step_ends: Option<Vec<u32>>,
    /// Per response token: 1 for the model's own tokens, 0 for tokens an environment
    /// inserted (observations, tool results, the chat template around them). `None`:
    /// every token is the model's. Losses, advantages and statistics count only the 1s.
    #[serde(default)]
    pub loss_mask: Option<Vec<u8>>,
    /// What a multi-turn episode did (turns, tool calls, environment time); `None` for a
    /// single-turn rollout.
    #[serde(default)]
    pub episode: Option<EpisodeInfo>,
}

/// Counters of one multi-turn episode, carried on its sample for the step's metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeInfo {
    /// Model turns taken.
    pub turns: u32,
    /// Tool calls the environment ran (well-formed or not).
    pub tool_calls: u32,
    /// Tool calls that failed: malformed JSON, an unknown tool, a tool error or timeout.
    pub tool_errors: u32,
    /// Seconds spent inside the environment.
    pub env_seconds: f64,
    /// Sum of the rewards the environment gave.
    pub env_reward: f64,
    /// The environment failed (an error, a missed deadline): the episode stopped there.
    pub env_failed: Option<String>,
    /// The environment opened the episode's first turn (`Env::turn_prefix`, e.g. a
    /// tool call's opening): a call it made is not the model's own choice.
    #[serde(default)]
    pub prefixed: bool,
}

/// A per-token field of a [`Sample`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenField {
    /// `rollout_logprobs`.
    RolloutLogprobs,
    /// `ref_logprobs`.
    RefLogprobs,
    /// `old_logprobs`.
    OldLogprobs,
    /// `values`.
    Values,
    /// `advantages`.
    Advantages,
    /// `returns`.
    Returns,
}

impl TokenField {
    /// The field's name.
    pub fn name(self) -> &'static str {
        match self {
            TokenField::RolloutLogprobs => "rollout_logprobs",
            TokenField::RefLogprobs => "ref_logprobs",
            TokenField::OldLogprobs => "old_logprobs",
            TokenField::Values => "values",
            TokenField::Advantages => "advantages",
            TokenField::Returns => "returns",
        }
    }
}

/// A sample lacks what a stage needs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SampleError {
    /// A per-token field has not been filled in by its stage yet.
    #[error("{id}: `{field}` is not set; run the stage that fills it first")]
    MissingField {
        /// The sample.
        id: SampleId,
        /// The field.
        field: &'static str,
    },
    /// A per-token field does not have one entry per response token.
    #[error("{id}: `{field}` has {got} entries for {want} response tokens")]
    Length {
        /// The sample.
        id: SampleId,
        /// The field.
        field: &'static str,
        /// Entries present.
        got: usize,
        /// Response tokens.
        want: usize,
    },
    /// The sample has no reward yet.
    #[error("{id}: no reward; run the reward stage first")]
    MissingReward {
        /// The sample.
        id: SampleId,
    },
    /// An empty batch was given where samples are needed.
    #[error("empty batch of samples")]
    Empty,
}

impl Sample {
    /// A sample of prompt group `group` with nothing generated or learnt yet: callers
    /// fill in what they know with struct update syntax (`Sample { .., ..Sample::new(id,
    /// group) }`), so a new stage field does not touch every constructor.
    pub fn new(id: SampleId, group: u64) -> Sample {
        Sample {
            id,
            group,
            prompt_tokens: Vec::new(),
            response_tokens: Vec::new(),
            rollout_logprobs: Vec::new(),
            finish: Finish::Length,
            prompt_text: String::new(),
            response_text: String::new(),
            reference: None,
            metadata: serde_json::Value::Null,
            weights_version: 0,
            weights_version_last: None,
            reward: None,
            ref_logprobs: None,
            old_logprobs: None,
            values: None,
            advantages: None,
            returns: None,
            step_rewards: None,
            step_ends: None,
            loss_mask: None,
            episode: None,
        }
    }

    /// Whether response token `t` is the model's own (see [`Sample::loss_mask`]).
    pub fn is_model_token(&self, t: usize) -> bool {
        self.loss_mask
            .as_ref()
            .is_none_or(|m| m.get(t).is_some_and(|&b| b != 0))
    }

    /// The policy versions of its first and last tokens.
    pub fn version_span(&self) -> (u64, u64) {
        (
            self.weights_version,
            self.weights_version_last.unwrap_or(self.weights_version),
        )
    }

    /// Number of response tokens.
    pub fn response_len(&self) -> usize {
        self.response_tokens.len()
    }

    /// A per-token field, checked to be present and of the response's length.
    pub fn token_field(&self, field: TokenField) -> Result<&[f32], SampleError> {
        let v = match field {
            TokenField::RolloutLogprobs => Some(&self.rollout_logprobs),
            TokenField::RefLogprobs => self.ref_logprobs.as_ref(),
            TokenField::OldLogprobs => self.old_logprobs.as_ref(),
            TokenField::Values => self.values.as_ref(),
            TokenField::Advantages => self.advantages.as_ref(),
            TokenField::Returns => self.returns.as_ref(),
        }
        .ok_or(SampleError::MissingField {
            id: self.id,
            field: field.name(),
        })?;
        if v.len() != self.response_len() {
            return Err(SampleError::Length {
                id: self.id,
                field: field.name(),
                got: v.len(),
                want: self.response_len(),
            });
        }
        Ok(v)
    }

    /// The reward, checked to be present.
    pub fn require_reward(&self) -> Result<f64, SampleError> {
        self.reward
            .ok_or(SampleError::MissingReward { id: self.id })
    }
}

/// The response mask `[B, T]` (f32, `T` = longest response) of a batch: 1 on the
/// model's own response tokens, 0 on padding and on tokens an environment inserted
/// ([`Sample::loss_mask`]). Every loss, advantage and statistic takes this mask, so
/// observation tokens get no gradient.
pub fn response_mask(samples: &[Sample], device: Device) -> Result<Tensor, SampleError> {
    let t = samples
        .iter()
        .map(Sample::response_len)
        .max()
        .ok_or(SampleError::Empty)?;
    let mut m = vec![0f32; samples.len() * t];
    for (i, s) in samples.iter().enumerate() {
        let row = &mut m[i * t..i * t + s.response_len()];
        match &s.loss_mask {
            None => row.fill(1.0),
            Some(mask) if mask.len() == row.len() => {
                for (x, &b) in row.iter_mut().zip(mask) {
                    *x = f32::from(b != 0);
                }
            }
            Some(mask) => {
                return Err(SampleError::Length {
                    id: s.id,
                    field: "loss_mask",
                    got: mask.len(),
                    want: row.len(),
                })
            }
        }
    }
    Ok(Tensor::from_slice(&m)
        .view([samples.len() as i64, t as i64])
        .to_device(device))
}

/// A per-token field of a batch as a right-padded `[B, T]` f32 tensor (zero padding,
/// same `T` as [`response_mask`]).
pub fn token_matrix(
    samples: &[Sample],
    field: TokenField,
    device: Device,
) -> Result<Tensor, SampleError> {
    let t = samples
        .iter()
        .map(Sample::response_len)
        .max()
        .ok_or(SampleError::Empty)?;
    let mut m = vec![0f32; samples.len() * t];
    for (i, s) in samples.iter().enumerate() {
        let v = s.token_field(field)?;
        m[i * t..i * t + v.len()].copy_from_slice(v);
    }
    Ok(Tensor::from_slice(&m)
        .view([samples.len() as i64, t as i64])
        .to_device(device))
}

/// Rows of a `[B, T]` tensor cut back to each sample's response length.
pub fn split_rows(matrix: &Tensor, samples: &[Sample]) -> Vec<Vec<f32>> {
    let m = matrix
        .to_device(Device::Cpu)
        .to_kind(Kind::Float)
        .contiguous();
    let t = m.size().get(1).copied().unwrap_or(0) as usize;
    let flat: Vec<f32> = Vec::<f32>::try_from(m.view([-1])).unwrap_or_default();
    samples
        .iter()
        .enumerate()
        .map(|(i, s)| {
            flat.get(i * t..i * t + s.response_len())
                .map(<[f32]>::to_vec)
                .unwrap_or_default()
        })
        .collect()
}

/// Dense group indices (`0..G`, in order of first appearance) for the algorithms.
pub fn group_indices(samples: &[Sample]) -> Vec<usize> {
    let mut seen: Vec<u64> = Vec::new();
    samples
        .iter()
        .map(|s| match seen.iter().position(|g| *g == s.group) {
            Some(i) => i,
            None => {
                seen.push(s.group);
                seen.len() - 1
            }
        })
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn sample(prompt: u64, k: u32, len: usize) -> Sample {
        Sample {
            prompt_tokens: vec![0, 5],
            response_tokens: (0..len as i64).collect(),
            rollout_logprobs: vec![-1.0; len],
            ..Sample::new(SampleId { step: 0, prompt, k }, prompt)
        }
    }

    #[test]
    fn matrices_pad_and_split_back() {
        let s = vec![sample(1, 0, 3), sample(1, 1, 1), sample(2, 0, 2)];
        let m = response_mask(&s, Device::Cpu).unwrap();
        assert_eq!(m.size(), [3, 3]);
        assert_eq!(m.sum(Kind::Float).double_value(&[]), 6.0);
        let lp = token_matrix(&s, TokenField::RolloutLogprobs, Device::Cpu).unwrap();
        assert_eq!(lp.sum(Kind::Float).double_value(&[]), -6.0);
        let rows = split_rows(&lp, &s);
        assert_eq!(rows[1], vec![-1.0]);
        assert_eq!(rows[2].len(), 2);
        assert_eq!(group_indices(&s), vec![0, 0, 1]);
        let e = token_matrix(&s, TokenField::RefLogprobs, Device::Cpu).unwrap_err();
        assert!(e.to_string().contains("ref_logprobs"), "{e}");
    }
}
