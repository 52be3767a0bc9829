//! Scoring a [`SeqBatch`]: per-token log-probs and entropy under the LM head, values from
//! a value head, scores from a reward head. Works with and without gradients (training
//! losses call the same functions).

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
/// prefix. Differentiable when called with gradients enabled.
pub fn token_logprobs(
    model: &Llama,
    batch: &SeqBatch,
    temperature: f64,
    with_entropy: bool,
) -> TokenScores {
    let ids = &batch.ids;
    let mask = &batch.attention_mask;
    let (b, t) = ids.size2().expect("[B, T]");
    let positions = positions_from_mask(ids, Some(mask));
    let h = model.hidden(ids, &positions, Attn::Full { mask: None });
    // Predict tokens 1..T from hidden 0..T-1.
    let h = h.narrow(1, 0, t - 1);
    let mut logits = model.logits(&h).to_kind(Kind::Float);
    if temperature != 1.0 {
        logits = &logits / temperature;
    }
    let logp = logits.log_softmax(-1, Kind::Float);
    let target = ids.narrow(1, 1, t - 1).unsqueeze(-1);
    let lp = logp.gather(-1, &target, false).squeeze_dim(-1);
    let m = mask.narrow(1, 1, t - 1).to_kind(Kind::Float);
    let zeros = Tensor::zeros([b, 1], (Kind::Float, ids.device()));
    let logprobs = Tensor::cat(&[&zeros, &(lp * &m)], 1);
    let entropy = if with_entropy {
        let ent = -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float);
        Tensor::cat(&[&zeros, &(ent * &m)], 1)
    } else {
        Tensor::zeros([b, t], (Kind::Float, ids.device()))
    };
    TokenScores { logprobs, entropy }
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
