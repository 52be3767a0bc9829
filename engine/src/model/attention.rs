//! How attention sees the past in one forward call, and the attention kernel itself.

use super::kv_cache::KvCache;
use tch::Tensor;

/// How attention sees the past in one forward call.
pub enum Attn<'a> {
    /// No cache: causal attention over the given tokens, with an optional key mask
    /// `[B, T]` (1 = real token).
    Full {
        /// The padding mask, if any.
        mask: Option<&'a Tensor>,
    },
    /// Prefill slots `start..start+B` of a cache from position `offset` (right-padded
    /// input). Positions `0..offset` must already hold the slots' shared prefix; the new
    /// tokens attend to it and, causally, to each other.
    Prefill {
        /// The cache.
        cache: &'a mut KvCache,
        /// The first slot.
        start: i64,
        /// Cache positions already filled (0: a fresh prompt).
        offset: i64,
        /// Each row's real length (the rest is padding): the per-token work (projections,
        /// MLP) then skips the padding; only attention sees the padded layout.
        lens: Option<&'a [i64]>,
    },
    /// Like `Full` without a mask (right-padded rows), and keeps each layer's keys and
    /// values (after RoPE, still in the autograd graph) in `kv` for a later
    /// [`Attn::Continue`] call: a prompt shared by several rows runs once.
    Capture {
        /// Filled with one `(keys, values)` pair per layer, `[P, kv_heads, Lp, head_dim]`.
        kv: &'a mut Vec<(Tensor, Tensor)>,
    },
    /// Tokens that continue prefixes computed by an earlier [`Attn::Capture`] call (e.g.
    /// GRPO's samples of one prompt continue that prompt). Row `i` attends to the first
    /// `lens[i]` positions of prefix `rows[i]` and, causally, to its own tokens; the
    /// forward's positions must start at `lens[i]`. Gradients flow into the prefix's
    /// keys and values, summed over the rows that share it.
    Continue {
        /// The prefixes' keys and values, per layer (from `Capture`).
        kv: &'a [(Tensor, Tensor)],
        /// Which prefix each row continues `[B]` (int64).
        rows: &'a Tensor,
        /// The real length of each row's prefix `[B]` (int64); the rest is padding.
        lens: &'a Tensor,
    },
    /// Padding-free packing: one row `[1, N]` holding several sequences back to back,
    /// of lengths `lens` (summing to `N`). Each attends, causally, to itself alone; the
    /// forward's positions restart at 0 for each, so RoPE, q/k norms and sliding
    /// windows see it as a lone sequence.
    Packed {
        /// The sequences' lengths, in order.
        lens: &'a [i64],
    },
    /// One new token per slot `0..B`, at the per-slot positions given to the forward.
    Decode {
        /// The cache.
        cache: &'a mut KvCache,
        /// Number of cache positions to attend over (max position + 1).
        span: i64,
        /// The slots' block tables `[B, nb]` (int64, on the cache's device, `nb` blocks
        /// covering `span`; 0 past a slot's blocks), with the written positions already
        /// reserved ([`KvCache::reserve`]): a CUDA graph replays a step on its own table
        /// tensor. `None`: the forward reserves the positions and builds the tables.
        table: Option<&'a Tensor>,
    },
}

/// Scaled dot-product attention (libtorch's fused kernel; GQA heads shared), causal
/// when no mask is given: every call site either masks explicitly or is plain causal.
pub(super) fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
    Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, mask.is_none(), None, true)
}

/// Attention of one new token per row `q` `[B, heads, 1, hd]` over `k`, `v` `[B, kv_heads,
/// S, hd]` with a key mask `[B, 1, 1, S]`. A KV head's query heads go in as the query
/// positions of one head (`[B, kv_heads, group, hd]`): the same scores, without GQA, so
/// that a fused kernel that takes a mask but not GQA heads (libtorch's memory-efficient
/// one) can run it, and no path repeats every key and value `group` times.
pub(super) fn attend_decode(q: &Tensor, k: &Tensor, v: &Tensor, mask: &Tensor) -> Tensor {
    let (b, heads, t, hd) = q.size4().expect("queries are [B, heads, 1, hd]");
    let kv_heads = k.size()[1];
    if t != 1 || heads == kv_heads {
        return attend(q, k, v, Some(mask));
    }
    let grouped = q.reshape([b, kv_heads, heads / kv_heads, hd]);
    attend(&grouped, k, v, Some(mask)).reshape([b, heads, 1, hd])
}
