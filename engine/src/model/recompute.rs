//! Layer recompute (activation checkpointing): a forward pass that keeps only each
//! unit's input, and a backward pass that runs each unit again, with gradients, from its
//! saved input and backpropagates the incoming gradient through it, last unit first.
//!
//! tch has no custom autograd function, so the backward is driven by hand:
//! [`recompute_backward`] is the generic loop (a unit is any closure, so a sharded
//! trainer can gather a unit's weights inside it); [`Tape`] runs the decoder's layers
//! the same way, each in parts of whole sequences and its MLP in chunks of tokens, so
//! that what a layer holds at once is bounded however long the micro-batch.

use super::attention::Attn;
use super::forward::{Ctx, Part};
use super::llama::Llama;
use tch::{Kind, Tensor};

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
    // As a dot product of the flattened tensors where the kernel takes the type: no
    // temporary of y's size (a hidden state per token, on a long micro-batch).
    let g = grad.detach();
    let dot = matches!(y.kind(), Kind::Float | Kind::Double) && y.size() == g.size();
    match dot {
        true => y.reshape([-1]).dot(&g.reshape([-1])).backward(),
        false => (y * g).sum(y.kind()).backward(),
    }
}

/// A decoder forward pass that kept only each layer's input: its output
/// (`Tape::output`) is a leaf, and [`Tape::backward`] finishes the backward pass from
/// that leaf's gradient by layer recompute.
pub struct Tape<'m> {
    model: &'m Llama,
    ctx: Ctx<'m>,
    /// The token ids: the first layer's input is their embeddings, looked up again in
    /// backward rather than kept.
    ids: Tensor,
    /// The input of each layer but the first, without a graph.
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
        let mut inputs = Vec::with_capacity(self.layers.len());
        let parts = ctx.parts(self.memory.recompute_chunk_tokens);
        let x = tch::no_grad(|| {
            let mut x = self.embed_rows(ids, &ctx);
            // The kept inputs in one allocation, apart from the heap where the step's
            // short-lived tensors come and go: interleaved with them, they would pin
            // freed holes resident (glibc returns a large block only when it stands alone).
            let layers = self.layers.len() as i64;
            let mut shape = vec![(layers - 1).max(0)];
            shape.extend(x.size());
            let kept = Tensor::empty(shape.as_slice(), (x.kind(), x.device()));
            for li in 0..layers {
                let y = match li + 1 < layers {
                    true => kept.get(li),
                    false => x.empty_like(),
                };
                self.layer_in_parts(li as usize, &x, &ctx, &parts, &lens, &y);
                let input = std::mem::replace(&mut x, y);
                if li > 0 {
                    inputs.push(input);
                }
            }
            x
        });
        let last = x.set_requires_grad(true);
        let h = self.final_norm(&last, &ctx);
        let tape = Tape {
            model: self,
            ctx,
            ids: ids.shallow_clone(),
            inputs,
            last,
            lens,
        };
        (h, tape)
    }
}

/// The attention mode of a part of a recompute pass: its own packed sequences, or
/// right-padded rows.
fn part_attn<'a>(lens: &'a Option<Vec<i64>>, part: &Part) -> Attn<'a> {
    match lens {
        Some(l) => Attn::Packed {
            lens: &l[part.segments()],
        },
        None => Attn::Full { mask: None },
    }
}

/// The chunks `(start, len)` of `n` rows, `chunk` at a time.
fn chunks(n: i64, chunk: usize) -> impl Iterator<Item = (i64, i64)> {
    let c = chunk.max(1) as i64;
    (0..n).step_by(c as usize).map(move |s| (s, c.min(n - s)))
}

impl Llama {
    /// Decoder layer `li` on `x` `[b, t, hidden]` without autograd, into `y` (the same
    /// shape, contiguous), one part at a time and the MLP in chunks of tokens: what is
    /// live besides `x` and `y` is one part's attention and one chunk's MLP, however
    /// many tokens `x` holds. `lens`: the packed sequences' lengths (`None`:
    /// right-padded rows).
    fn layer_in_parts(
        &self,
        li: usize,
        x: &Tensor,
        ctx: &Ctx<'_>,
        parts: &[Part],
        lens: &Option<Vec<i64>>,
        y: &Tensor,
    ) {
        let h = self.config.hidden_size;
        for part in parts {
            let pc = ctx.part(part);
            let mut attn = part_attn(lens, part);
            let x1 = self.attention_block(li, &part.cut(x), &pc, &mut attn, &mut None);
            let x1 = x1.reshape([-1, h]);
            let out = part.rows(y, h);
            for (s, n) in chunks(x1.size()[0], self.memory.recompute_chunk_tokens) {
                out.narrow(0, s, n)
                    .copy_(&self.mlp_block(li, &x1.narrow(0, s, n), &pc));
            }
        }
    }

    /// The backward pass of decoder layer `li` recomputed from its input `x`: `grad`
    /// (the loss's gradient w.r.t. the layer's output) is backpropagated into the
    /// layer's parameters, and the gradient w.r.t. `x` returned. One part at a time
    /// ([`Ctx::parts`]): the part's attention half with autograd, then its MLP half
    /// recomputed and backpropagated in chunks of tokens (it is position-wise), then
    /// the attention half's backward from the MLP half's input gradient. Live at once:
    /// one part's attention graph and one chunk's MLP graph.
    fn layer_backward_in_parts(
        &self,
        li: usize,
        x: &Tensor,
        grad: &Tensor,
        ctx: &Ctx<'_>,
        parts: &[Part],
        lens: &Option<Vec<i64>>,
    ) -> Tensor {
        let h = self.config.hidden_size;
        let grad_x = x.zeros_like();
        for part in parts {
            let pc = ctx.part(part);
            let xl = part.cut(x).detach().set_requires_grad(true);
            let mut attn = part_attn(lens, part);
            let x1 = self.attention_block(li, &xl, &pc, &mut attn, &mut None);
            // The gradient w.r.t. the MLP half's input, chunk by chunk.
            let g1 = x1.zeros_like();
            {
                let x1 = x1.detach().reshape([-1, h]);
                let g2 = part.cut(grad).reshape([-1, h]);
                let g1 = g1.view([-1, h]);
                for (s, n) in chunks(x1.size()[0], self.memory.recompute_chunk_tokens) {
                    let xc = x1.narrow(0, s, n).detach().set_requires_grad(true);
                    backward_with(&self.mlp_block(li, &xc, &pc), &g2.narrow(0, s, n));
                    let gc = xc.grad();
                    if gc.defined() {
                        g1.narrow(0, s, n).copy_(&gc);
                    }
                }
            }
            backward_with(&x1, &g1);
            let gx = xl.grad();
            if gx.defined() {
                part.cut(&grad_x).copy_(&gx);
            }
        }
        grad_x
    }
}

impl Tape<'_> {
    /// Finishes the backward pass once the gradient of the loss has reached the output
    /// (the hidden states `hidden_recompute` returned have been backpropagated): layer
    /// by layer in reverse (`Llama::layer_backward_in_parts`), then into the
    /// embeddings (looked up again: cheaper than keeping them).
    pub fn backward(self) {
        let mut g = self.last.grad();
        if !g.defined() {
            return;
        }
        let Tape {
            model,
            ctx,
            ids,
            mut inputs,
            lens,
            ..
        } = self;
        let parts = ctx.parts(model.memory.recompute_chunk_tokens);
        while let Some(x) = inputs.pop() {
            let li = inputs.len() + 1;
            g = model.layer_backward_in_parts(li, &x, &g, &ctx, &parts, &lens);
        }
        if !model.layers.is_empty() {
            let x = tch::no_grad(|| model.embed_rows(&ids, &ctx));
            g = model.layer_backward_in_parts(0, &x, &g, &ctx, &parts, &lens);
        }
        backward_with(&model.embed_rows(&ids, &ctx), &g);
    }
}
