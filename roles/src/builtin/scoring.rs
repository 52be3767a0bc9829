//! What several built-in roles share: response log-probs and entropies of samples,
//! device checks, and loading weight buckets into a model.

use tch::{Device, Tensor};
use yatt_engine::score::{chunked_backward, head_scores, HeadInput, SeqBatch};
use yatt_engine::{positions_from_mask, Attn, RowLayout};
use yatt_engine::{BucketViews, Llama};

use crate::builtin::device_weights::device_tensors;
use crate::role::{DeviceGroup, DeviceRoute, RoleError, WeightsUpdate};
use crate::sample::Sample;

/// Response-token log-probs and entropies `[B, T]` (`T` = longest response, zero
/// padded) of `samples` under `model` at `temperature`, the LM head in chunks of
/// `model.memory.logprob_chunk_tokens` (the `[tokens, vocab]` logits never exist
/// whole). Differentiable when called with gradients enabled (every chunk's graph is
/// then kept; training uses [`response_backward`] instead).
///
/// Two savings, both exact:
/// - Only the hidden states that predict response tokens go through the LM head and the
///   log-softmax: with short answers to chat-templated prompts most positions are
///   prompt, and the head (vocabulary × hidden) is a fifth of a small model's FLOPs.
/// - A prompt shared by several samples (GRPO's group) runs through the model once; the
///   responses then attend to its keys and values ([`Attn::Continue`]), and the
///   gradients of all the group's samples meet there. With 8 samples of a 46-token
///   prompt and ~14-token answers this is about a third of the tokens.
pub(crate) fn response_scores(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
    temperature: f64,
    with_entropy: bool,
) -> yatt_engine::Result<(Tensor, Tensor)> {
    response_scores_with(model, samples, pad_id, temperature, with_entropy, true)
}

/// [`response_scores`], with prompt sharing on or off (off: every row runs in full).
pub(crate) fn response_scores_with(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
    temperature: f64,
    with_entropy: bool,
    share_prompts: bool,
) -> yatt_engine::Result<(Tensor, Tensor)> {
    let r = response_rows(model, samples, pad_id, share_prompts, false)?;
    let chunk = model.memory.logprob_chunk_tokens;
    let (lp, ent) = head_scores(
        model,
        &r.input.rows,
        &r.input.targets,
        temperature,
        chunk,
        with_entropy,
    );
    Ok((lp.view(r.shape) * &r.mask, ent.view(r.shape) * &r.mask))
}

/// One training micro-batch's forward and backward pass over `samples`: `loss` gets
/// the response log-probs and entropies `[B, T]` (as [`response_scores`] gives them)
/// and its gradient reaches every parameter through the chunked LM head and, with
/// `model.memory.activation_checkpointing`, layer recompute. Returns the loss's value
/// and the detached log-probs and entropies `[B, T]`.
pub(crate) fn response_backward(
    model: &Llama,
    samples: &[Sample],
    pad_id: i64,
    temperature: f64,
    loss: impl FnOnce(&Tensor, &Tensor) -> yatt_engine::Result<Tensor>,
) -> yatt_engine::Result<(f64, Tensor, Tensor)> {
    let r = response_rows(model, samples, pad_id, true, true)?;
    let chunk = model.memory.logprob_chunk_tokens;
    let (shape, mask) = (r.shape, &r.mask);
    let (v, lp, ent) = chunked_backward(model, r.input, temperature, chunk, |lp, ent| {
        loss(&(lp.view(shape) * mask), &(ent.view(shape) * mask))
    })?;
    Ok((v, lp.view(shape) * mask, ent.view(shape) * mask))
}

/// The hidden rows that predict each response token (`[B·T, hidden]`, padding columns
/// pointing at a real row), their targets, the response mask `[B, T]`.
struct ResponseRows<'m> {
    input: HeadInput<'m>,
    mask: Tensor,
    shape: [i64; 2],
}

/// Runs the decoder over `samples` in the model's [`RowLayout`] and picks the rows that
/// predict response tokens. `train`: with layer recompute on, through a [`Tape`]
/// (prompt sharing is then off: a response's layer would need its prompt's).
fn response_rows<'m>(
    model: &'m Llama,
    samples: &[Sample],
    pad_id: i64,
    share_prompts: bool,
    train: bool,
) -> yatt_engine::Result<ResponseRows<'m>> {
    let device = model.device();
    let recompute = train && model.memory.activation_checkpointing;
    let packed = model.memory.layout == RowLayout::Packed;
    let t = samples.iter().map(Sample::response_len).max().unwrap_or(0);
    // Distinct prompts in order of first appearance, and each row's.
    let mut distinct: Vec<&[i64]> = Vec::new();
    let mut prompt_of = Vec::with_capacity(samples.len());
    for s in samples {
        let p = s.prompt_tokens.as_slice();
        let i = distinct.iter().position(|d| *d == p).unwrap_or_else(|| {
            distinct.push(p);
            distinct.len() - 1
        });
        prompt_of.push(i);
    }
    let shared = share_prompts
        && !recompute
        && !packed
        && t > 0
        && distinct.len() < samples.len()
        && distinct.iter().all(|p| !p.is_empty());
    // `h`: hidden states as rows; `at[i * t + j]`: the row that predicts response token j
    // of sample i (padding columns point at a real row and are masked out).
    let (b, n) = (samples.len(), samples.len() * t);
    let mut at = vec![0i64; n];
    let mut tapes = Vec::new();
    // The decoder over `ids`/`positions`, through a tape with layer recompute.
    let mut run = |ids: &Tensor, pos: &Tensor, attn: Attn<'_>| {
        if recompute {
            let (h, tape) = model.hidden_recompute(ids, pos, attn);
            tapes.push(tape);
            h
        } else {
            model.hidden(ids, pos, attn)
        }
    };
    let h = if packed {
        // One row, every sequence back to back, positions restarting at each.
        let total: usize = samples
            .iter()
            .map(|s| s.prompt_tokens.len() + s.response_len())
            .sum();
        let (mut ids, mut pos, mut lens) = (
            Vec::with_capacity(total),
            Vec::with_capacity(total),
            Vec::new(),
        );
        for (i, s) in samples.iter().enumerate() {
            let start = ids.len() as i64;
            let plen = s.prompt_tokens.len();
            ids.extend(s.prompt_tokens.iter().chain(&s.response_tokens));
            let len = (plen + s.response_len()) as i64;
            pos.extend(0..len);
            lens.push(len);
            for j in 0..t {
                let p = (plen + j) as i64 - 1;
                at[i * t + j] = start + p.clamp(0, (len - 1).max(0));
            }
        }
        // An all-empty micro-batch still needs one row to run.
        if ids.is_empty() {
            ids.push(pad_id);
            pos.push(0);
            lens.push(1);
        }
        let shape = [1, ids.len() as i64];
        let ids = Tensor::from_slice(&ids).view(shape).to_device(device);
        let pos = Tensor::from_slice(&pos).view(shape).to_device(device);
        let lens: Vec<i64> = lens.into_iter().filter(|&l| l > 0).collect();
        let h = run(&ids, &pos, Attn::Packed { lens: &lens });
        let hidden = h.size()[2];
        h.view([-1, hidden])
    } else if shared {
        let prompts: Vec<(&[i64], &[i64])> = distinct.iter().map(|p| (*p, &[][..])).collect();
        let pb = SeqBatch::from_pairs(&prompts, pad_id, device)?;
        let lp = pb.ids.size()[1];
        let mut kv = Vec::new();
        let positions = positions_from_mask(&pb.ids, Some(&pb.attention_mask));
        let hp = model.hidden(&pb.ids, &positions, Attn::Capture { kv: &mut kv });
        // Responses, right-padded, continuing their prompt at its length.
        let mut ids = vec![pad_id; n];
        let mut pos = vec![0i64; n];
        for (i, s) in samples.iter().enumerate() {
            let plen = s.prompt_tokens.len() as i64;
            for j in 0..t {
                ids[i * t + j] = s.response_tokens.get(j).copied().unwrap_or(pad_id);
                pos[i * t + j] = plen + j as i64;
                at[i * t + j] = if j == 0 {
                    prompt_of[i] as i64 * lp + plen - 1
                } else {
                    distinct.len() as i64 * lp + (i * t + j - 1) as i64
                };
            }
        }
        let shape = [b as i64, t as i64];
        let ids = Tensor::from_slice(&ids).view(shape).to_device(device);
        let pos = Tensor::from_slice(&pos).view(shape).to_device(device);
        let rows: Vec<i64> = prompt_of.iter().map(|&u| u as i64).collect();
        let lens: Vec<i64> = samples
            .iter()
            .map(|s| s.prompt_tokens.len() as i64)
            .collect();
        let rows = Tensor::from_slice(&rows).to_device(device);
        let lens = Tensor::from_slice(&lens).to_device(device);
        let attn = Attn::Continue {
            kv: &kv,
            rows: &rows,
            lens: &lens,
        };
        let hr = model.hidden(&ids, &pos, attn);
        let hidden = hp.size()[2];
        Tensor::cat(&[hp.view([-1, hidden]), hr.view([-1, hidden])], 0)
    } else {
        let pairs: Vec<(&[i64], &[i64])> = samples
            .iter()
            .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
            .collect();
        let batch = SeqBatch::from_pairs(&pairs, pad_id, device)?;
        let full = batch.ids.size()[1];
        let positions = positions_from_mask(&batch.ids, Some(&batch.attention_mask));
        // Right padding: causal attention alone keeps real tokens off the padding.
        let h = run(&batch.ids, &positions, Attn::Full { mask: None });
        for (i, s) in samples.iter().enumerate() {
            for j in 0..t {
                let pos = (s.prompt_tokens.len() + j) as i64 - 1;
                at[i * t + j] = i as i64 * full + pos.clamp(0, full - 1);
            }
        }
        let hidden = h.size()[2];
        h.view([-1, hidden])
    };
    let mut target = vec![0i64; n];
    let mut mask = vec![0f32; n];
    for (i, s) in samples.iter().enumerate() {
        for (j, &tok) in s.response_tokens.iter().enumerate() {
            target[i * t + j] = tok;
            mask[i * t + j] = 1.0;
        }
    }
    let shape = [b as i64, t as i64];
    let at = Tensor::from_slice(&at).to_device(device);
    let targets = Tensor::from_slice(&target).to_device(device);
    let mask = Tensor::from_slice(&mask).view(shape).to_device(device);
    let rows = h.index_select(0, &at);
    Ok(ResponseRows {
        input: HeadInput {
            rows,
            targets,
            tapes,
        },
        mask,
        shape,
    })
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
    let want = group.torch_device();
    if model_device != want {
        return Err(RoleError::BadRequest(format!(
            "{role}: the model is on {model_device:?} but the role is started on {want:?} (node {}); build the model on the group's device",
            group.node
        )));
    }
    Ok(())
}

/// Loads the weights of `update` into `model` (weight sync): an in-process snapshot is
/// adopted without copying, buckets are copied in place in one `copy_weights_from`
/// (each call repacks every inference matrix of a packed model).
pub(crate) fn load_buckets(model: &mut Llama, update: &WeightsUpdate) -> Result<(), RoleError> {
    if let Some(s) = update.slice {
        return Err(RoleError::BadRequest(format!(
            "weights v{} are rank {} of {}'s slice of a sharded policy, which only rollouts and the reference assemble",
            update.version, s.rank, s.world
        )));
    }
    if let Some(local) = &update.local {
        model
            .adopt_weights(&local.tensors())
            .map_err(|e| weights_error(update, e))?;
        return Ok(());
    }
    let named = bucket_tensors(update, model.device())?;
    model
        .copy_weights_from(named.iter())
        .map_err(|e| weights_error(update, e))?;
    Ok(())
}

/// The tensors of a weight update, for copying into a model.
pub(crate) enum UpdateTensors<'a> {
    /// Views of the buckets' payloads on the CPU (no copy: the model's `copy_` reads
    /// them once, onto its own device).
    Buckets(Vec<BucketViews<'a>>),
    /// Copied out of the policy's device buffer (CUDA IPC).
    Device(Vec<(String, Tensor)>),
}

impl UpdateTensors<'_> {
    /// The tensors by name.
    pub(crate) fn iter(&self) -> Box<dyn Iterator<Item = (&str, &Tensor)> + '_> {
        match self {
            UpdateTensors::Buckets(views) => Box::new(views.iter().flat_map(|v| v.iter())),
            UpdateTensors::Device(named) => Box::new(named.iter().map(|(n, t)| (n.as_str(), t))),
        }
    }
}

/// Every tensor of `update`'s buckets (or device buffer), for a model on `device`.
pub(crate) fn bucket_tensors(
    update: &WeightsUpdate,
    device: Device,
) -> Result<UpdateTensors<'_>, RoleError> {
    if update.local.is_some() {
        return Err(RoleError::BadRequest(format!(
            "weights v{} are an in-process snapshot (canonical names), not buckets: adopt them with Llama::adopt_weights",
            update.version
        )));
    }
    match update.device.as_ref().map(|w| (w, &w.route)) {
        Some((w, DeviceRoute::Ipc(handle))) => {
            return device_tensors(&w.entries, handle, device)
                .map(UpdateTensors::Device)
                .map_err(|e| {
                    RoleError::Failed(format!(
                        "weights v{} through CUDA IPC: {e} (send them as buckets: ExportWeights)",
                        update.version
                    ))
                })
        }
        // Only the rollout joins a broadcast group (it receives before this is called).
        Some((_, DeviceRoute::Broadcast(_))) => {
            return Err(RoleError::BadRequest(format!(
                "weights v{} come by NCCL broadcast, which only rollouts receive; send them as buckets (ExportWeights)",
                update.version
            )))
        }
        None => {}
    }
    let views = update
        .buckets
        .iter()
        .map(|b| b.views().map_err(|e| weights_error(update, e)))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(UpdateTensors::Buckets(views))
}

pub(crate) fn weights_error(update: &WeightsUpdate, e: yatt_engine::EngineError) -> RoleError {
    RoleError::BadRequest(format!("weights v{}: {e}", update.version))
}

/// Bytes held by a model's weights.
pub(crate) fn model_bytes(model: &Llama) -> u64 {
    model
        .hf_named_tensors()
        .iter()
        .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sample::tests::sample;
    use tch::Kind;
    use yatt_engine::score::token_logprobs;
    use yatt_engine::tiny_config;

    /// Scoring only the response positions gives what scoring every position of the
    /// full sequences gives there, for rows of different prompt and response lengths.
    #[test]
    fn response_scores_match_full_sequence_scoring() {
        let model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 3).unwrap();
        let lens = [(5usize, 3usize), (2, 6), (7, 1), (1, 4)];
        let samples: Vec<Sample> = lens
            .iter()
            .enumerate()
            .map(|(i, &(p, r))| {
                let mut s = sample(i as u64, 0, r);
                let tok = |t: usize, m: usize| 2 + ((t * m + 3 * i) % 90) as i64;
                s.prompt_tokens = (0..p).map(|t| tok(t, 7)).collect();
                s.response_tokens = (0..r).map(|t| tok(t, 13)).collect();
                s
            })
            .collect();
        let temperature = 0.8;
        let (lp, ent) =
            tch::no_grad(|| response_scores(&model, &samples, 0, temperature, true)).unwrap();
        let pairs: Vec<(&[i64], &[i64])> = samples
            .iter()
            .map(|s| (s.prompt_tokens.as_slice(), s.response_tokens.as_slice()))
            .collect();
        let batch = SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap();
        let full = tch::no_grad(|| token_logprobs(&model, &batch, temperature, true));
        assert_eq!(lp.size(), [4, 6]);
        for (i, s) in samples.iter().enumerate() {
            for j in 0..6 {
                let (i, at) = (i as i64, (s.prompt_tokens.len() + j) as i64);
                let (want_lp, want_ent) = if j < s.response_len() {
                    (
                        full.logprobs.double_value(&[i, at]),
                        full.entropy.double_value(&[i, at]),
                    )
                } else {
                    (0.0, 0.0)
                };
                let (got_lp, got_ent) = (
                    lp.double_value(&[i, j as i64]),
                    ent.double_value(&[i, j as i64]),
                );
                assert!(
                    (got_lp - want_lp).abs() < 1e-5 && (got_ent - want_ent).abs() < 1e-5,
                    "row {i} token {j}: log-prob {got_lp} vs {want_lp}, entropy {got_ent} vs {want_ent}"
                );
            }
        }
    }

    /// Groups of samples sharing a prompt (GRPO), prompts of different lengths, one
    /// empty response: running each prompt once gives the same log-probs, entropies and
    /// gradients as running every row in full.
    #[test]
    fn shared_prompts_score_and_differentiate_like_full_rows() {
        let mut model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap();
        model.set_requires_grad(true);
        let prompts: [Vec<i64>; 3] = [
            (0..9).map(|t| 2 + (t * 7) % 90).collect(),
            (0..4).map(|t| 5 + (t * 11) % 80).collect(),
            (0..6).map(|t| 3 + (t * 5) % 70).collect(),
        ];
        let rlens = [3usize, 6, 1, 4, 0, 5, 2, 6];
        let samples: Vec<Sample> = rlens
            .iter()
            .enumerate()
            .map(|(i, &r)| {
                let mut s = sample((i % 3) as u64, i as u32, r);
                s.prompt_tokens = prompts[i % 3].clone();
                s.response_tokens = (0..r).map(|t| 2 + ((t * 13 + 5 * i) % 90) as i64).collect();
                s
            })
            .collect();
        let mut run = |share: bool| {
            for (_, p) in model.parameters_mut() {
                p.zero_grad();
            }
            let (lp, ent) = response_scores_with(&model, &samples, 0, 0.9, true, share).unwrap();
            // A loss that weighs tokens differently, so every row's gradient matters.
            let w = Tensor::arange(lp.numel() as i64, (Kind::Float, Device::Cpu))
                .view(lp.size().as_slice())
                / 7.0;
            (&lp * &w + &ent).sum(Kind::Float).backward();
            let grads: Vec<Tensor> = model
                .parameters()
                .iter()
                .filter(|(_, p)| p.grad().defined())
                .map(|(_, p)| p.grad().copy())
                .collect();
            assert!(!grads.is_empty());
            (lp.detach(), ent.detach(), grads)
        };
        let (lp_s, ent_s, g_s) = run(true);
        let (lp_f, ent_f, g_f) = run(false);
        let max = |a: &Tensor, b: &Tensor| (a - b).abs().max().double_value(&[]);
        assert!(
            max(&lp_s, &lp_f) < 1e-5,
            "log-probs differ by {}",
            max(&lp_s, &lp_f)
        );
        assert!(
            max(&ent_s, &ent_f) < 1e-5,
            "entropies differ by {}",
            max(&ent_s, &ent_f)
        );
        assert!(lp_f.abs().sum(Kind::Float).double_value(&[]) > 1.0);
        for (a, b) in g_s.iter().zip(&g_f) {
            let scale = b.abs().max().double_value(&[]).max(1e-3);
            assert!(
                max(a, b) / scale < 1e-4,
                "gradients differ by {}",
                max(a, b)
            );
        }
    }
}
