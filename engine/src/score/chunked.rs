//! Log-probs and entropies through the LM head in chunks of tokens, so that the
//! `[tokens, vocab]` logits never exist whole: forward under `no_grad` chunk by chunk,
//! and a backward pass driven by hand that recomputes each chunk's logits.
//!
//! tch has no custom autograd function, so [`chunked_backward`] runs the steps itself:
//! 1. the caller's hidden rows `h` (in the decoder's graph, or a [`Tape`]'s);
//! 2. log-probs and entropies per chunk without gradients, from `h'`, `h` detached;
//! 3. the caller's loss on leaf copies of them, backpropagated to `dL/dlp`, `dL/dent`;
//! 4. per chunk, its logits again with gradients from a leaf `h'[chunk]`,
//!    backpropagating `sum(lp·dL/dlp + ent·dL/dent)` into the head's weights and that
//!    chunk of `dL/dh`;
//! 5. `dL/dh` through `h`'s graph, then each tape's layer recompute.

use crate::error::{EngineError, Result};
use crate::model::{backward_with, Llama, Tape};
use tch::{Kind, Tensor};

pub use crate::model::DEFAULT_CHUNK_TOKENS;

/// What the LM head scores: hidden rows and the token each predicts.
pub struct HeadInput<'m> {
    /// Hidden states `[N, hidden]`, each predicting one target; may carry a graph
    /// (training) or not (scoring).
    pub rows: Tensor,
    /// The predicted tokens `[N]` (int64).
    pub targets: Tensor,
    /// Layer-recompute tapes whose outputs `rows` derive from: their backward runs
    /// after `rows`'s.
    pub tapes: Vec<Tape<'m>>,
}

/// Log-probs and entropy of one chunk of rows `[n, hidden]`, f32, at `temperature`.
fn chunk_scores(
    model: &Llama,
    h: &Tensor,
    targets: &Tensor,
    temperature: f64,
    with_entropy: bool,
) -> (Tensor, Option<Tensor>) {
    let mut logits = model.logits(h).to_kind(Kind::Float);
    if temperature != 1.0 {
        logits = logits / temperature;
    }
    let logp = logits.log_softmax(-1, Kind::Float);
    let lp = logp
        .gather(-1, &targets.unsqueeze(-1), false)
        .squeeze_dim(-1);
    let ent = with_entropy.then(|| -(logp.exp() * &logp).sum_dim_intlist(-1, false, Kind::Float));
    (lp, ent)
}

/// The chunks `(start, len)` of `n` rows.
fn chunks(n: i64, chunk: usize) -> impl Iterator<Item = (i64, i64)> {
    let c = chunk.max(1) as i64;
    (0..n).step_by(c as usize).map(move |s| (s, c.min(n - s)))
}

/// Log-probs of `targets` `[N]` and entropies `[N]` (zeros without `with_entropy`) of
/// hidden rows `[N, hidden]`, in f32, `chunk` rows at a time. Differentiable when called
/// with gradients on (each chunk's graph is then kept: use [`chunked_backward`] to
/// train in bounded memory).
pub fn head_scores(
    model: &Llama,
    rows: &Tensor,
    targets: &Tensor,
    temperature: f64,
    chunk: usize,
    with_entropy: bool,
) -> (Tensor, Tensor) {
    let n = rows.size()[0];
    let (mut lps, mut ents) = (Vec::new(), Vec::new());
    for (s, len) in chunks(n, chunk) {
        let (lp, ent) = chunk_scores(
            model,
            &rows.narrow(0, s, len),
            &targets.narrow(0, s, len),
            temperature,
            with_entropy,
        );
        lps.push(lp);
        ents.extend(ent);
    }
    let dev = rows.device();
    let cat = |v: Vec<Tensor>| {
        if v.is_empty() {
            Tensor::zeros([n], (Kind::Float, dev))
        } else {
            Tensor::cat(&v, 0)
        }
    };
    (cat(lps), cat(ents))
}

/// One training micro-batch's backward pass with the LM head in chunks of `chunk` rows:
/// `loss(lp, ent)` (log-probs and entropies `[N]` of `input`'s rows, leaves with
/// gradients) is backpropagated into every parameter, its value returned with the
/// (detached) log-probs and entropies. The gradients equal those of the unchunked
/// computation; the full `[N, vocab]` logits never exist.
pub fn chunked_backward(
    model: &Llama,
    input: HeadInput<'_>,
    temperature: f64,
    chunk: usize,
    loss: impl FnOnce(&Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(f64, Tensor, Tensor)> {
    let HeadInput {
        rows,
        targets,
        tapes,
    } = input;
    let leaf = rows.detach();
    let (lp, ent) = tch::no_grad(|| head_scores(model, &leaf, &targets, temperature, chunk, true));
    let lp_leaf = lp.detach().set_requires_grad(true);
    let ent_leaf = ent.detach().set_requires_grad(true);
    let l = loss(&lp_leaf, &ent_leaf)?;
    if l.numel() != 1 {
        return Err(EngineError::InvalidArgument(format!(
            "the loss must be a scalar, got shape {:?}",
            l.size()
        )));
    }
    let v = l.double_value(&[]);
    if !v.is_finite() {
        return Err(EngineError::InvalidArgument(format!(
            "the loss is {v}; refusing to backpropagate"
        )));
    }
    if !l.requires_grad() {
        return Ok((v, lp, ent));
    }
    l.f_backward()?;
    let (g_lp, g_ent) = (lp_leaf.grad(), ent_leaf.grad());
    let n = rows.size()[0];
    // dL/drows, filled chunk by chunk: each chunk's rows are a leaf of their own, so a
    // chunk's backward makes no gradient of all the rows' size.
    let g = leaf.zeros_like();
    let mut reached = false;
    for (s, len) in chunks(n, chunk) {
        let hc = leaf.narrow(0, s, len).detach().set_requires_grad(true);
        let (lpc, entc) = chunk_scores(
            model,
            &hc,
            &targets.narrow(0, s, len),
            temperature,
            g_ent.defined(),
        );
        let mut surrogate = match g_lp.defined() {
            true => (lpc * g_lp.narrow(0, s, len)).sum(Kind::Float),
            false => Tensor::zeros([], (Kind::Float, rows.device())),
        };
        if let Some(e) = entc {
            surrogate = surrogate + (e * g_ent.narrow(0, s, len)).sum(Kind::Float);
        }
        if surrogate.requires_grad() {
            surrogate.f_backward()?;
        }
        let gc = hc.grad();
        if gc.defined() {
            g.narrow(0, s, len).copy_(&gc);
            reached = true;
        }
    }
    if reached {
        backward_with(&rows, &g);
    }
    // The rows and their gradient are a hidden state's size each: gone before the
    // layers' backward, which holds a hidden state per layer already.
    drop((g, leaf, rows));
    for tape in tapes {
        tape.backward();
    }
    Ok((v, lp, ent))
}
