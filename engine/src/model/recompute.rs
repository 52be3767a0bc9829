//! Layer recompute (activation checkpointing): a forward pass that keeps only each
//! unit's input, and a backward pass that runs each unit again, with gradients, from its
//! saved input and backpropagates the incoming gradient through it, last unit first.
//!
//! tch has no custom autograd function, so the backward is driven by hand:
//! [`recompute_backward`] is the generic loop (a unit is any closure, so a sharded
//! trainer can gather a unit's weights inside it), [`Tape`] applies it to the decoder.

use super::attention::Attn;
use super::forward::Ctx;
use super::llama::Llama;
use tch::Tensor;

/// Backward through a chain of units `y_i = unit(i, x_i)`, `x_{i+1} = y_i`, of which only
/// the inputs `inputs[i]` were kept: for `i` from last to first, recompute `unit(i, x_i)`
/// with gradients from a detached copy of `x_i`, backpropagate `grad` (the gradient of
/// the loss w.r.t. its output) into the unit's parameters and its input, and pass the
/// input's gradient on. Returns the gradient w.r.t. the first unit's input.
///
/// Peak memory is one unit's activations, plus the inputs. `unit` may do anything
/// before its forward (say, gather a sharded unit's weights) and must compute the same
/// function as the forward that saved the inputs.
pub fn recompute_backward(
    inputs: &[Tensor],
    mut grad: Tensor,
    mut unit: impl FnMut(usize, &Tensor) -> Tensor,
) -> Tensor {
    for (i, saved) in inputs.iter().enumerate().rev() {
        let x = saved.detach().set_requires_grad(true);
        let y = unit(i, &x);
        backward_with(&y, &grad);
        grad = x.grad();
        if !grad.defined() {
            // The unit ignored its input: nothing flows further back.
            grad = x.zeros_like();
        }
    }
    grad
}

/// Backpropagates `grad` (the loss's gradient w.r.t. `y`, same shape) through `y`'s
/// graph, accumulating into the leaves' `.grad`: `torch.autograd.backward(y, grad)`.
pub fn backward_with(y: &Tensor, grad: &Tensor) {
    if !y.requires_grad() {
        return;
    }
    // `sum(y · g)` has gradient `g` w.r.t. `y`; g is detached so nothing flows into it.
    (y * grad.detach()).sum(y.kind()).backward();
}

/// A decoder forward pass that kept only each layer's input: its output
/// (`Tape::output`) is a leaf, and [`Tape::backward`] finishes the backward pass from
/// that leaf's gradient by layer recompute.
pub struct Tape<'m> {
    model: &'m Llama,
    ctx: Ctx<'m>,
    /// The embeddings, in the graph of the embedding matrix.
    x0: Tensor,
    /// Each layer's input, without a graph.
    inputs: Vec<Tensor>,
    /// The last layer's output, a leaf that collects the gradient from above.
    last: Tensor,
    lens: Option<Vec<i64>>,
}

impl Llama {
    /// [`Llama::hidden`] with layer recompute, for training: runs the decoder without
    /// keeping activations (each layer's input alone is kept) and returns the
    /// final-normed hidden states `[B, T, hidden]` (in the graph of the final norm and
    /// of [`Tape`]'s leaf) with the tape that finishes their backward pass. Only the
    /// cache-free modes `Full` (without a mask: right padding) and `Packed` apply.
    pub fn hidden_recompute(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        attn: Attn<'_>,
    ) -> (Tensor, Tape<'_>) {
        let lens = match &attn {
            Attn::Full { mask: None } => None,
            Attn::Packed { lens } => Some(lens.to_vec()),
            _ => panic!("layer recompute takes Attn::Full without a mask or Attn::Packed"),
        };
        let ctx = self.prepare(ids, positions, &attn);
        let x0 = self.embed_rows(ids, &ctx);
        let mut inputs = Vec::with_capacity(self.layers.len());
        let mut x = x0.detach();
        tch::no_grad(|| {
            let mut attn = tape_attn(&lens);
            for li in 0..self.layers.len() {
                let y = self.layer(li, &x, &ctx, &mut attn, &mut None);
                inputs.push(std::mem::replace(&mut x, y));
            }
        });
        let last = x.set_requires_grad(true);
        let h = self.final_norm(&last, &ctx);
        let tape = Tape {
            model: self,
            ctx,
            x0,
            inputs,
            last,
            lens,
        };
        (h, tape)
    }
}

fn tape_attn(lens: &Option<Vec<i64>>) -> Attn<'_> {
    match lens {
        Some(l) => Attn::Packed { lens: l },
        None => Attn::Full { mask: None },
    }
}

impl Tape<'_> {
    /// Finishes the backward pass once the gradient of the loss has reached the output
    /// (the hidden states `hidden_recompute` returned have been backpropagated): layer
    /// by layer in reverse, then into the embeddings.
    pub fn backward(self) {
        let g = self.last.grad();
        if !g.defined() {
            return;
        }
        let Tape {
            model,
            ctx,
            x0,
            inputs,
            lens,
            ..
        } = self;
        let mut attn = tape_attn(&lens);
        let g0 = recompute_backward(&inputs, g, |li, x| {
            model.layer(li, x, &ctx, &mut attn, &mut None)
        });
        backward_with(&x0, &g0);
    }
}
