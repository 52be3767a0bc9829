//! Scoring a [`SeqBatch`]: per-token log-probs and entropy under the LM head, values from
//! a value head, scores from a reward head. Works with and without gradients (training
//! losses call the same functions).

use super::chunked::{chunked_backward, head_scores, HeadInput};
use super::seq_batch::SeqBatch;
use crate::error::{EngineError, Result};
use crate::model::{positions_from_mask, Attn, Llama, ScalarHead};
use tch::{Kind, Tensor};

/// Per-token log-probs and entropies.
#[derive(Debug)]
pub struct TokenScores {
    /// `[B, T]`: entry `t` is `log p(ids[t] | ids[<t])` under `logits / temperature`; 0 at
    /// `t = 0` and at padding.
    pub logprobs: Tensor,
    /// `[B, T]`: entropy of the distribution that predicted `ids[t]` (same masking).
    pub entropy: Tensor,
}

/// Log-probs (and entropy, when `with_entropy`) of every token of `batch` given its
/// prefix, the LM head in chunks of `model.memory.logprob_chunk_tokens` tokens.
/// Differentiable when called with gradients enabled (every chunk's graph is then kept:
/// [`token_logprobs_backward`] trains in bounded memory).
pub fn token_logprobs(
    model: &Llama,
    batch: &SeqBatch,
    temperature: f64,
    with_entropy: bool,
) -> TokenScores {
    let (b, t) = batch.ids.size2().expect("[B, T]");
    let positions = positions_from_mask(&batch.ids, Some(&batch.attention_mask));
    let h = model.hidden(&batch.ids, &positions, Attn::Full { mask: None });
    let (rows, targets) = predicting_rows(&h, batch);
    let chunk = model.memory.logprob_chunk_tokens;
    let (lp, ent) = head_scores(model, &rows, &targets, temperature, chunk, with_entropy);
    TokenScores {
        logprobs: token_layout(&lp, batch, b, t),
        entropy: if with_entropy {
            token_layout(&ent, batch, b, t)
        } else {
            Tensor::zeros([b, t], (Kind::Float, batch.ids.device()))
        },
    }
}

/// The hidden rows that predict tokens `1..T` of each row (from positions `0..T-1`),
/// flat `[B·(T−1), hidden]`, with their targets.
pub(crate) fn predicting_rows(h: &Tensor, batch: &SeqBatch) -> (Tensor, Tensor) {
    let t = batch.ids.size()[1];
    let hidden = h.size()[2];
    let rows = h.narrow(1, 0, t - 1).reshape([-1, hidden]);
    let targets = batch.ids.narrow(1, 1, t - 1).reshape([-1]);
    (rows, targets)
}

/// Flat per-row scores `[B·(T−1)]` as `[B, T]`: 0 at `t = 0` and at padding.
pub(crate) fn token_layout(x: &Tensor, batch: &SeqBatch, b: i64, t: i64) -> Tensor {
    let m = batch
        .attention_mask
        .narrow(1, 1, t - 1)
        .to_kind(Kind::Float);
    let zeros = Tensor::zeros([b, 1], (Kind::Float, batch.ids.device()));
    Tensor::cat(&[&zeros, &(x.view([b, t - 1]) * m)], 1)
}

/// A training micro-batch's forward and backward pass over `batch` in bounded memory:
/// `loss` gets the [`TokenScores`] (log-probs and entropies `[B, T]`, as
/// [`token_logprobs`] gives them) and its gradient reaches every parameter through the
/// chunked LM head ([`chunked_backward`]) and, with
/// `model.memory.activation_checkpointing`, layer recompute. Returns the loss's value.
pub fn token_logprobs_backward(
    model: &Llama,
    batch: &SeqBatch,
    temperature: f64,
    loss: impl FnOnce(&TokenScores) -> Result<Tensor>,
) -> Result<f64> {
    let (b, t) = batch.ids.size2().expect("[B, T]");
    let positions = positions_from_mask(&batch.ids, Some(&batch.attention_mask));
    let attn = Attn::Full { mask: None };
    let (h, tapes) = if model.memory.activation_checkpointing {
        let (h, tape) = model.hidden_recompute(&batch.ids, &positions, attn);
        (h, vec![tape])
    } else {
        (model.hidden(&batch.ids, &positions, attn), vec![])
    };
    let (rows, targets) = predicting_rows(&h, batch);
    let input = HeadInput {
        rows,
        targets,
        tapes,
    };
    let chunk = model.memory.logprob_chunk_tokens;
    let (v, _, _) = chunked_backward(model, input, temperature, chunk, |lp, ent| {
        loss(&TokenScores {
            logprobs: token_layout(lp, batch, b, t),
            entropy: token_layout(ent, batch, b, t),
        })
    })?;
    Ok(v)
}

fn head<'a>(model: &'a Llama, what: &str) -> Result<&'a ScalarHead> {
    model.head.as_ref().ok_or_else(|| {
        EngineError::InvalidArgument(format!(
            "{what} needs a scalar head: call Llama::attach_head or load a model that has one"
        ))
    })
}

/// Values `[B, T]` from the value head at every position (padding zeroed).
pub fn values(model: &Llama, batch: &SeqBatch) -> Result<Tensor> {
    let hd = head(model, "values")?;
    let positions = positions_from_mask(&batch.ids, Some(&batch.attention_mask));
    let h = model.hidden(&batch.ids, &positions, Attn::Full { mask: None });
    Ok(hd.forward(&h).to_kind(Kind::Float) * batch.attention_mask.to_kind(Kind::Float))
}

/// Rewards `[B]`: the reward head at each row's last real token.
pub fn rewards(model: &Llama, batch: &SeqBatch) -> Result<Tensor> {
    let hd = head(model, "rewards")?;
    Ok(hd.forward(&last_hidden(model, batch)).to_kind(Kind::Float))
}

/// The final hidden state `[B, hidden]` at each row's last real token (right padding):
/// what a reward head scores, or what predicts the token after each row.
pub fn last_hidden(model: &Llama, batch: &SeqBatch) -> Tensor {
    let positions = positions_from_mask(&batch.ids, Some(&batch.attention_mask));
    let h = model.hidden(&batch.ids, &positions, Attn::Full { mask: None });
    let dev = batch.ids.device();
    let last: Vec<i64> = batch.lens.iter().map(|&l| l as i64 - 1).collect();
    let rows = Tensor::arange(batch.len() as i64, (Kind::Int64, dev));
    h.index(&[Some(rows), Some(Tensor::from_slice(&last).to_device(dev))])
}
