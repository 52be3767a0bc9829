//! The built-in roles: rollout, reference, policy, critic, reward.
//!
//! What belongs here: [`Role`](crate::role::Role) implementations that wrap the engine
//! (generation, scoring, training) and the reward functions, with the request and
//! response types the controller sends them. Each role is synchronous and runs on its
//! own thread inside a [`RoleActor`](crate::role::RoleActor); tch is only touched there.
//! Samples come in and go out keyed by [`SampleId`](crate::sample::SampleId); a role
//! fills in its own field of each [`Sample`](crate::sample::Sample) and nothing else.
//!
//! | file | role |
//! |---|---|
//! | [`rollout`] | generation engine replica; text codecs (tokenizer, ASCII for tests) |
//! | [`reference`] | frozen reference policy: reference log-probs |
//! | [`policy`] | the trainer: old log-probs, PPO/GRPO update, weight export, checkpoints |
//! | [`reward`] | weighted rule-based reward functions |
//! | [`critic`] | value model (backbone + `v_head`) for PPO: values and value-loss updates |

pub mod critic;
pub mod policy;
pub mod reference;
pub mod reward;
pub mod rollout;

pub use critic::{CriticConfig, CriticReport, CriticRequest, CriticResponse, CriticRole};
pub use policy::{
    GradShard, KlLossConfig, PolicyConfig, PolicyRequest, PolicyResponse, PolicyRole, TrainReport,
};
pub use reference::ReferenceRole;
pub use reward::RewardRole;
pub use rollout::{
    AsciiCodec, GenerateRequest, RolloutRequest, RolloutResponse, RolloutRole, RolloutStats,
    TextCodec, TokenizerCodec,
};

use tch::{Device, Tensor};
use yatt_engine::score::{token_logprobs, SeqBatch};
use yatt_engine::Llama;

use crate::role::{DeviceGroup, RoleError, WeightsUpdate};
use crate::sample::Sample;

/// Response-token log-probs and entropies `[B, T]` (`T` = longest response, zero
/// padded) of `samples` under `model` at `temperature`. Differentiable when called with
/// gradients enabled (the policy's loss uses it; the other callers wrap it in
/// `no_grad`).
pub(crate) fn response_scores(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
    temperature: f64,
    with_entropy: bool,
) -> yatt_engine::Result<(Tensor, Tensor)> {
    let device = model.device();
    let pairs: Vec<(&[i64], &[i64])> = samples
        .iter()
        .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
        .collect();
    let batch = SeqBatch::from_pairs(&pairs, pad_id, device)?;
    let scores = token_logprobs(model, &batch, temperature, with_entropy);
    let full = scores.logprobs.size().get(1).copied().unwrap_or(0);
    let t = samples.iter().map(Sample::response_len).max().unwrap_or(0);
    // Column j of row i is the response's j-th token, at position prompt_len + j of the
    // full sequence; padding columns point at the last position and are masked out.
    let mut idx = vec![0i64; samples.len() * t];
    let mut mask = vec![0f32; samples.len() * t];
    for (i, s) in samples.iter().enumerate() {
        for j in 0..t {
            idx[i * t + j] = ((s.prompt_tokens.len() + j) as i64).min(full - 1).max(0);
            if j < s.response_len() {
                mask[i * t + j] = 1.0;
            }
        }
    }
    let shape = [samples.len() as i64, t as i64];
    let idx = Tensor::from_slice(&idx).view(shape).to_device(device);
    let mask = Tensor::from_slice(&mask).view(shape).to_device(device);
    let lp = scores.logprobs.gather(1, &idx, false) * &mask;
    let ent = scores.entropy.gather(1, &idx, false) * &mask;
    Ok((lp, ent))
}

/// Response log-probs of `samples` (no gradients), in micro-batches of `micro`, as one
/// `Vec<f32>` per sample.
pub(crate) fn score_samples(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
    temperature: f64,
    micro: usize,
) -> Result<Vec<Vec<f32>>, RoleError> {
    let mut out = Vec::with_capacity(samples.len());
    for chunk in samples.chunks(micro.max(1)) {
        let (lp, _) = tch::no_grad(|| response_scores(model, chunk, pad_id, temperature, false))
            .map_err(|e| RoleError::Failed(format!("scoring {} samples: {e}", chunk.len())))?;
        out.extend(crate::sample::split_rows(&lp, chunk));
    }
    Ok(out)
}

/// Checks a model lives where the role is started: roles are built on their group's
/// device by whoever builds them.
pub(crate) fn check_device(
    role: &str,
    model_device: Device,
    group: &DeviceGroup,
) -> Result<(), RoleError> {
    let want = if group.cuda {
        Device::Cuda(group.devices.first().copied().unwrap_or(0) as usize)
    } else {
        Device::Cpu
    };
    if model_device != want {
        return Err(RoleError::BadRequest(format!(
            "{role}: the model is on {model_device:?} but the role is started on {want:?} (node {}); build the model on the group's device",
            group.node
        )));
    }
    Ok(())
}

/// Copies the weights of `update` into `model` in place (weight sync).
pub(crate) fn load_buckets(model: &mut Llama, update: &WeightsUpdate) -> Result<(), RoleError> {
    let bad = |e: yatt_engine::EngineError| {
        RoleError::BadRequest(format!("weights v{}: {e}", update.version))
    };
    for b in &update.buckets {
        let named = b.tensors(model.device()).map_err(bad)?;
        model
            .copy_weights_from(named.iter().map(|(n, t)| (n.as_str(), t)))
            .map_err(bad)?;
    }
    Ok(())
}

/// Bytes held by a model's weights.
pub(crate) fn model_bytes(model: &Llama) -> u64 {
    model
        .hf_named_tensors()
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}
