//! The forward pass: the decoder stack under each [`Attn`] mode, the fused CPU decode
//! step, and the LM head.

use super::attention::{attend, attend_decode, Attn};
use super::blocks::blocks_for;
use super::kv_cache::{CacheIndex, KvCache};
use super::llama::{Llama, Packed};
use super::lora_types::Matrix;
use super::rope::positions_from_mask;
use tch::{Kind, Tensor};

impl Llama {
    /// `x @ w (+ bias)`, through the packed copy when there is one.
    fn mm(&self, x: &Tensor, w: &Tensor, packed: Option<&Tensor>, bias: Option<&Tensor>) -> Tensor {
        if let Some(p) = packed {
            if let Ok(y) = crate::onednn::linear(x, p, bias, w.size()[1]) {
                return y;
            }
        }
        match bias {
            Some(b) => x.matmul(w) + b,
            None => x.matmul(w),
        }
    }

    /// `base + x @ w`: one matmul that adds `base` in its epilogue (BLAS's `beta = 1`)
    /// instead of a matmul and an addition, or through the packed copy.
    fn mm_residual(
        &self,
        base: &Tensor,
        x: &Tensor,
        w: &Tensor,
        packed: Option<&Tensor>,
    ) -> Tensor {
        if packed.is_some() {
            return base + self.mm(x, w, packed, None);
        }
        let (k, n) = (w.size()[0], w.size()[1]);
        let rows = x.numel() as i64 / k;
        base.reshape([rows, n])
            .addmm(&x.reshape([rows, k]), w)
            .reshape(base.size())
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Tensor {
        self.rms_last(x, w, self.config.hidden_size)
    }

    /// RMSNorm over the last dimension, of width `n` (the hidden size, or the head width
    /// for Qwen3's q/k norms).
    fn rms_last(&self, x: &Tensor, w: &Tensor, n: i64) -> Tensor {
        let eps = self.config.rms_norm_eps;
        // libtorch's fused kernel: 1 launch instead of 8 in bf16/f16 on a GPU, where a
        // decode step is bound by its launches. It rounds once where HF's form below
        // rounds twice (within bf16's precision); rollout and trainer both take it.
        if self.kind == Kind::Float || self.device.is_cuda() {
            x.rms_norm([n], Some(w), eps)
        } else {
            let xf = x.to_kind(Kind::Float);
            let var = xf.square().mean_dim(-1, true, Kind::Float);
            (xf * (var + eps).rsqrt()).to_kind(self.kind) * w
        }
    }

    /// Rotary embedding of `x` (head dimension last) as `x·cos2 + roll(x, hd/2)·sin2`,
    /// with `cos2 = [cos, cos]` and `sin2 = [-sin, sin]` (see [`Llama::rope_tables`]):
    /// HF's `x·cos + rotate_half(x)·sin` in 3 kernels instead of 7 (a decode step on a
    /// GPU is bound by its kernels' count).
    fn rope(&self, x: &Tensor, cos2: &Tensor, sin2: &Tensor) -> Tensor {
        let half = self.config.head_dim / 2;
        (x * cos2).addcmul(&x.roll([half], [-1]), sin2)
    }

    /// The rotary tables of `positions` `[B, T]` over the full head dimension, `[B, 1, T,
    /// hd]` in the model's type: `[cos, cos]` and `[-sin, sin]`.
    fn rope_tables(&self, positions: &Tensor, b: i64, t: i64) -> (Tensor, Tensor) {
        let half = self.config.head_dim / 2;
        let at = |table: &Tensor| {
            table
                .index_select(0, &positions.reshape([-1]))
                .reshape([b, 1, t, half])
        };
        let (cos, sin) = (at(&self.cos), at(&self.sin));
        (
            Tensor::cat(&[&cos, &cos], -1).to_kind(self.kind),
            Tensor::cat(&[-&sin, sin], -1).to_kind(self.kind),
        )
    }

    /// The fused CPU decode step (`csrc/decode_step.cpp`): one call for the whole decoder
    /// stack instead of ~70 tch operations per layer. `None` when it does not apply
    /// (weights not packed, autograd on, more than one token per row) or fails, in which
    /// case the caller takes the tch path. It reads and writes the cache through the
    /// slots' block tables (`table`, or reserved and built here).
    fn decode_fused(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        cache: &mut KvCache,
        table: Option<&Tensor>,
    ) -> Option<Tensor> {
        let packed = self
            .packed
            .as_ref()
            .filter(|_| !self.embed.requires_grad())?;
        let (b, t) = ids.size2().ok()?;
        if t != 1 || b > cache.slots || cache.device() != tch::Device::Cpu {
            return None;
        }
        let c = &self.config;
        let x = Tensor::embedding(&self.embed.tr(), &ids.reshape([b]), -1, false, false);
        let pos = positions.reshape([b]).to_kind(Kind::Int64).contiguous();
        let table = match table {
            Some(t) => t.to_kind(Kind::Int64).contiguous(),
            None => cache.decode_tables(positions),
        };
        let layers: Vec<crate::onednn::DecodeLayer<'_>> = self
            .layers
            .iter()
            .zip(&packed.layers)
            .enumerate()
            .map(|(i, (l, p))| crate::onednn::DecodeLayer {
                ln1: &l.ln1,
                wqkv: &p[0],
                bqkv: l.bqkv.as_ref(),
                wo: &p[1],
                ln2: &l.ln2,
                wgu: &p[2],
                wdown: &p[3],
                kb: &cache.kb[i],
                v: &cache.v[i],
                qk_norm: l.qk_norm.as_ref().map(|(q, k)| (q, k)),
                window: c.window(i),
            })
            .collect();
        match crate::onednn::decode_layers(
            &x,
            &pos,
            &table,
            &self.cos,
            &self.sin,
            &layers,
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            c.rms_norm_eps,
        ) {
            Ok(x) => Some(self.rms(&x, &self.norm).unsqueeze(1)),
            Err(e) => {
                // A failure here is a bug, not bad input; the tch path gives the same
                // result, so say so once and carry on.
                static WARN: std::sync::Once = std::sync::Once::new();
                WARN.call_once(|| {
                    eprintln!("yatt-engine: fused decode step failed, using tch ops: {e}")
                });
                None
            }
        }
    }

    /// Embeds tokens and runs the decoder stack; returns the final-normed hidden states
    /// `[B, T, hidden]`. `positions` `[B, T]` are the rotary positions.
    pub fn hidden(&self, ids: &Tensor, positions: &Tensor, mut attn: Attn<'_>) -> Tensor {
        if let Attn::Decode { cache, table, .. } = &mut attn {
            if let Some(h) = self.decode_fused(ids, positions, cache, *table) {
                return h;
            }
        }
        let ctx = self.prepare(ids, positions, &attn);
        let mut x = self.embed_rows(ids, &ctx);
        crate::profile::mark_layer(self.device, "layers: embed, rope tables, masks");
        let mut key_index: Option<CacheIndex> = None;
        for li in 0..self.layers.len() {
            x = self.layer(li, &x, &ctx, &mut attn, &mut key_index);
        }
        ctx.pad(self.rms(&x, &self.norm))
    }

    /// The token embeddings of `ids`, as the residual stream's rows (real tokens only
    /// where `ctx` drops padding).
    pub(super) fn embed_rows(&self, ids: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let x = Tensor::embedding(&self.embed.tr(), ids, -1, false, false);
        match &ctx.real {
            Some(idx) => x.reshape([ctx.b * ctx.t, -1]).index_select(0, idx),
            None => x,
        }
    }

    /// What every layer of one forward call shares: rotary tables, masks, which rows are
    /// real. Built once per call.
    pub(super) fn prepare(&self, ids: &Tensor, positions: &Tensor, attn: &Attn<'_>) -> Ctx<'_> {
        let (b, t) = ids.size2().expect("ids must be [B, T]");
        // Ragged prefill: real tokens only, as rows of [n, hidden]; `pad` restores the
        // [b, t, ..] layout (zeros in the padding) where attention needs it.
        let real = match attn {
            Attn::Prefill {
                lens: Some(lens), ..
            } if lens.iter().any(|&l| l < t) => {
                let mut idx = Vec::with_capacity(lens.iter().sum::<i64>() as usize);
                for (i, &l) in lens.iter().enumerate() {
                    idx.extend((0..l.min(t)).map(|j| i as i64 * t + j));
                }
                Some(Tensor::from_slice(&idx).to_device(self.device))
            }
            _ => None,
        };
        let (cos, sin) = self.rope_tables(positions, b, t);
        // The same tables for `[B, T, heads, hd]` (queries and keys rotated together).
        let (cos_bthd, sin_bthd) = (cos.transpose(1, 2), sin.transpose(1, 2));
        // Attention masks, built once for all layers.
        let full_mask = match attn {
            Attn::Full { mask: Some(m) } => {
                let causal = Tensor::ones([t, t], (Kind::Bool, self.device)).tril(0);
                let keys = m.to_kind(Kind::Bool).reshape([b, 1, 1, t]);
                let eye = Tensor::eye(t, (Kind::Bool, self.device));
                Some(causal.logical_and(&keys).logical_or(&eye))
            }
            // New token i sees the whole shared prefix and new tokens 0..=i.
            Attn::Prefill { offset, .. } if *offset > 0 => {
                let keys = Tensor::arange(offset + t, (Kind::Int64, self.device));
                let rows = Tensor::arange(t, (Kind::Int64, self.device)).unsqueeze(1) + *offset;
                Some(
                    keys.unsqueeze(0)
                        .le_tensor(&rows)
                        .reshape([1, 1, t, offset + t]),
                )
            }
            Attn::Decode { span, .. } => {
                let ar =
                    Tensor::arange(*span, (Kind::Int64, self.device)).reshape([1, 1, 1, *span]);
                Some(ar.le_tensor(&positions.reshape([b, 1, 1, 1])))
            }
            // Prefix keys below the row's prefix length, then causal over its own tokens.
            Attn::Continue { kv, lens, .. } => {
                let lp = kv.first().map_or(0, |(k, _)| k.size()[2]);
                let keys = Tensor::arange(lp, (Kind::Int64, self.device)).reshape([1, 1, 1, lp]);
                let prefix = keys
                    .lt_tensor(&lens.reshape([b, 1, 1, 1]))
                    .expand([b, 1, t, lp], false);
                let causal = Tensor::ones([t, t], (Kind::Bool, self.device))
                    .tril(0)
                    .reshape([1, 1, t, t])
                    .expand([b, 1, t, t], false);
                Some(Tensor::cat(&[prefix, causal], 3))
            }
            _ => None,
        };
        let win_mask = self.window_mask(attn, full_mask.as_ref(), positions, b, t);
        // Additive masks in the model's type, made once: given a boolean mask, libtorch's
        // attention converts it on every call, two kernels per layer.
        let additive = |m: Tensor| {
            Tensor::zeros(m.size(), (self.kind, self.device))
                .masked_fill(&m.logical_not(), f64::NEG_INFINITY)
        };
        let (full_mask, win_mask) = (full_mask.map(additive), win_mask.map(additive));
        // Packed rows: each sequence's span of the one row, and for windowed layers its
        // own causal window mask (only `len × len` per sequence, never the row's square).
        let segments = match attn {
            Attn::Packed { lens } => {
                let mut at = 0;
                let w = self.config.sliding_window.as_ref().map(|s| s.size);
                Some(
                    lens.iter()
                        .map(|&l| {
                            let span = (at, l);
                            at += l;
                            let win = w.map(|w| {
                                let ar = Tensor::arange(l, (Kind::Int64, self.device));
                                let (q, k) = (ar.reshape([l, 1]), ar.reshape([1, l]));
                                additive(k.le_tensor(&q).logical_and(&k.gt_tensor(&(q - w))))
                            });
                            (span, win)
                        })
                        .collect(),
                )
            }
            _ => None,
        };
        // Packed weights only serve inference: with autograd on, use the parameters.
        let packed = if self.packed.is_some() && !self.embed.requires_grad() {
            self.packed.as_ref()
        } else {
            None
        };
        Ctx {
            b,
            t,
            real,
            cos,
            sin,
            cos_bthd,
            sin_bthd,
            full_mask,
            win_mask,
            segments,
            positions: positions.shallow_clone(),
            packed,
            // LoRA dropout only while the adapters train.
            lora_train: self.lora_training(),
        }
    }

    /// `y + x·A·B·s` where layer `li`'s adapters touch matrix `m`.
    fn adapt(&self, y: Tensor, li: usize, m: Matrix, x: &Tensor, train: bool) -> Tensor {
        match self.lora_forward(li, m, x, train) {
            Some(d) => y + d,
            None => y,
        }
    }

    /// Decoder layer `li` on the residual stream `x`: one unit of the stack, which layer
    /// recompute runs again from its saved input. `key_index`: where the new keys and
    /// values go in the cache, the same for every layer (computed by the first).
    pub(super) fn layer(
        &self,
        li: usize,
        x: &Tensor,
        ctx: &Ctx<'_>,
        attn: &mut Attn<'_>,
        key_index: &mut Option<CacheIndex>,
    ) -> Tensor {
        // Two calls, so that the attention's intermediates are freed before the MLP's
        // (without autograd nothing else holds them).
        let x = self.attention_block(li, x, ctx, attn, key_index);
        self.mlp_block(li, &x, ctx)
    }

    /// The first half of decoder layer `li`: `x + o_proj(attention(norm(x)))`.
    pub(super) fn attention_block(
        &self,
        li: usize,
        x: &Tensor,
        ctx: &Ctx<'_>,
        attn: &mut Attn<'_>,
        key_index: &mut Option<CacheIndex>,
    ) -> Tensor {
        let o = self.attention(li, x, ctx, attn, key_index);
        let l = &self.layers[li];
        let pl = ctx.packed.map(|p| &p.layers[li]);
        // The residual stream is rebuilt by each sum, never updated in place: an
        // in-place `+=` would modify a tensor autograd saved.
        let x = self.adapt(
            self.mm_residual(x, &o, &l.wo, pl.map(|p| &p[1])),
            li,
            Matrix::O,
            &o,
            ctx.lora_train,
        );
        crate::profile::mark_layer(self.device, "layer: o proj");
        x
    }

    /// The second half of decoder layer `li`: `x + mlp(norm(x))`, position-wise (each
    /// token's row alone), so it can run on any split of the rows.
    pub(super) fn mlp_block(&self, li: usize, x: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        let l = &self.layers[li];
        let pl = ctx.packed.map(|p| &p.layers[li]);
        let lt = ctx.lora_train;
        let act = {
            let hn = self.rms(x, &l.ln2);
            let gu = self.adapt(
                self.mm(&hn, &l.w_gate_up, pl.map(|p| &p[2]), None),
                li,
                Matrix::GateUp,
                &hn,
                lt,
            );
            let f = self.config.intermediate_size;
            gu.narrow(-1, 0, f).silu() * gu.narrow(-1, f, f)
        };
        let x = self.adapt(
            self.mm_residual(x, &act, &l.w_down, pl.map(|p| &p[3])),
            li,
            Matrix::Down,
            &act,
            lt,
        );
        crate::profile::mark_layer(self.device, "layer: mlp");
        x
    }

    /// Layer `li`'s attention output `[rows, heads · head_dim]` (before the output
    /// projection) for the residual stream `x`.
    fn attention(
        &self,
        li: usize,
        x: &Tensor,
        ctx: &Ctx<'_>,
        attn: &mut Attn<'_>,
        key_index: &mut Option<CacheIndex>,
    ) -> Tensor {
        let c = &self.config;
        let (b, t) = (ctx.b, ctx.t);
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        let (cos, sin) = (&ctx.cos, &ctx.sin);
        let l = &self.layers[li];
        let pl = ctx.packed.map(|p| &p.layers[li]);
        let qkv = {
            let hn = self.rms(x, &l.ln1);
            ctx.pad(self.adapt(
                self.mm(&hn, &l.wqkv, pl.map(|p| &p[0]), l.bqkv.as_ref()),
                li,
                Matrix::Qkv,
                &hn,
                ctx.lora_train,
            ))
        };
        let v = qkv
            .narrow(-1, (nh + nkv) * hd, nkv * hd)
            .view([b, t, nkv, hd])
            .transpose(1, 2);
        crate::profile::mark_layer(self.device, "layer: norm, qkv");
        let (q, k) = match &l.qk_norm {
            Some((qn, kn)) => {
                let q = qkv
                    .narrow(-1, 0, nh * hd)
                    .view([b, t, nh, hd])
                    .transpose(1, 2);
                let k = qkv
                    .narrow(-1, nh * hd, nkv * hd)
                    .view([b, t, nkv, hd])
                    .transpose(1, 2);
                let (q, k) = (self.rms_last(&q, qn, hd), self.rms_last(&k, kn, hd));
                (self.rope(&q, cos, sin), self.rope(&k, cos, sin))
            }
            // Queries and keys rotated together: the same arithmetic in half the
            // operations (each one a kernel launch on a GPU).
            None => {
                let qk = qkv
                    .narrow(-1, 0, (nh + nkv) * hd)
                    .view([b, t, nh + nkv, hd]);
                let qk = self.rope(&qk, &ctx.cos_bthd, &ctx.sin_bthd);
                (
                    qk.narrow(2, 0, nh).transpose(1, 2),
                    qk.narrow(2, nh, nkv).transpose(1, 2),
                )
            }
        };
        crate::profile::mark_layer(self.device, "layer: rope");
        // A windowed layer's mask; `None` is plain causal attention.
        let windowed = c.window(li).is_some();
        let mask = if windowed {
            ctx.win_mask.as_ref()
        } else {
            ctx.full_mask.as_ref()
        };
        let o = match attn {
            Attn::Capture { kv } => {
                kv.push((k.shallow_clone(), v.shallow_clone()));
                attend(&q, &k, &v, mask)
            }
            Attn::Continue { kv, rows, .. } => {
                let (pk, pv) = &kv[li];
                let keys = Tensor::cat(&[pk.index_select(0, rows), k], 2);
                let values = Tensor::cat(&[pv.index_select(0, rows), v], 2);
                attend(&q, &keys, &values, mask)
            }
            Attn::Full { .. } => attend(&q, &k, &v, mask),
            // Each sequence attends to itself alone: per-segment causal attention, no
            // mask over the whole row.
            Attn::Packed { .. } => {
                let segs = ctx.segments.as_ref().expect("packed segments");
                let outs: Vec<Tensor> = segs
                    .iter()
                    .map(|&((at, len), ref win)| {
                        let cut = |z: &Tensor| z.narrow(2, at, len);
                        let m = if windowed { win.as_ref() } else { None };
                        attend(&cut(&q), &cut(&k), &cut(&v), m)
                    })
                    .collect();
                Tensor::cat(&outs, 2)
            }
            Attn::Prefill {
                cache,
                start,
                offset,
                lens,
            } => {
                let index = key_index.get_or_insert_with(|| {
                    cache.prefill_index(*start, *offset, &ctx.positions, *lens)
                });
                cache.write(li, index, &k, &v);
                if *offset == 0 {
                    attend(&q, &k, &v, mask)
                } else {
                    let len = *offset + t;
                    attend(
                        &q,
                        &cache.gather_keys(li, &index.table, len),
                        &cache.gather_values(li, &index.table, len),
                        mask,
                    )
                }
            }
            Attn::Decode { cache, span, table } => {
                let index = key_index.get_or_insert_with(|| {
                    let table = match table {
                        Some(t) => t.shallow_clone(),
                        None => cache.decode_tables(&ctx.positions),
                    };
                    cache.index(table, &ctx.positions)
                });
                cache.write(li, index, &k, &v);
                // A graph's table may cover a longer bucketed span than this one.
                let nb = blocks_for(*span).min(index.table.size()[1]);
                let table = index.table.narrow(1, 0, nb);
                attend_decode(
                    &q,
                    &cache.gather_keys(li, &table, *span),
                    &cache.gather_values(li, &table, *span),
                    mask.expect("decode attention is masked"),
                )
            }
        };
        crate::profile::mark_layer(self.device, "layer: kv write, attention");
        let o = o.transpose(1, 2).reshape([b, t, nh * hd]);
        match &ctx.real {
            Some(idx) => o.reshape([b * t, nh * hd]).index_select(0, idx),
            None => o,
        }
    }

    /// The final RMSNorm, restoring the padded layout where `ctx` dropped padding.
    pub(super) fn final_norm(&self, x: &Tensor, ctx: &Ctx<'_>) -> Tensor {
        ctx.pad(self.rms(x, &self.norm))
    }

    /// The mask of the layers with a sliding window (`None` when no layer has one): the
    /// mode's own mask (or causal) and, in position space, keys later than
    /// `query - window`. Keys are cache indices, which equal positions in every mode but
    /// `Full` with left padding, where real tokens are contiguous, so distances agree.
    fn window_mask(
        &self,
        attn: &Attn<'_>,
        base: Option<&Tensor>,
        positions: &Tensor,
        b: i64,
        t: i64,
    ) -> Option<Tensor> {
        let w = self.config.sliding_window.as_ref()?.size;
        let dev = (Kind::Int64, self.device);
        let ar = |n: i64| Tensor::arange(n, dev);
        let causal = || Tensor::ones([t, t], (Kind::Bool, self.device)).tril(0);
        let (q, k, base) = match attn {
            // Packed rows mask each sequence on its own (`Ctx::segments`).
            Attn::Packed { .. } => return None,
            Attn::Full { .. } | Attn::Capture { .. } | Attn::Prefill { offset: 0, .. } => (
                ar(t).reshape([1, 1, t, 1]),
                ar(t).reshape([1, 1, 1, t]),
                base.map_or_else(causal, Tensor::shallow_clone),
            ),
            Attn::Prefill { offset, .. } => (
                (ar(t) + *offset).reshape([1, 1, t, 1]),
                ar(offset + t).reshape([1, 1, 1, offset + t]),
                base?.shallow_clone(),
            ),
            Attn::Decode { span, .. } => (
                positions.reshape([b, 1, 1, 1]),
                ar(*span).reshape([1, 1, 1, *span]),
                base?.shallow_clone(),
            ),
            // Row i's own tokens sit at positions lens[i].. after its prefix's keys.
            Attn::Continue { kv, lens, .. } => {
                let lp = kv.first().map_or(0, |(k, _)| k.size()[2]);
                let lens = lens.reshape([b, 1, 1, 1]);
                let own = &lens + ar(t).reshape([1, 1, 1, t]);
                let keys = Tensor::cat(
                    &[
                        ar(lp).reshape([1, 1, 1, lp]).expand([b, 1, 1, lp], false),
                        own,
                    ],
                    3,
                );
                (
                    &lens + ar(t).reshape([1, 1, t, 1]),
                    keys,
                    base?.shallow_clone(),
                )
            }
        };
        Some(base.logical_and(&k.gt_tensor(&(q - w))))
    }

    /// LM logits for hidden states `[.., hidden] → [.., vocab]`.
    pub fn logits(&self, h: &Tensor) -> Tensor {
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let packed = self
            .packed
            .as_ref()
            .filter(|_| !self.embed.requires_grad())
            .map(|p| &p.lm_head);
        self.mm(h, w, packed, None)
    }

    /// Full forward: logits `[B, T, vocab]` for token ids `[B, T]` with an optional
    /// padding mask `[B, T]` (1 = token). Positions count real tokens (left padding works).
    pub fn forward(&self, ids: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let positions = positions_from_mask(ids, mask);
        let h = self.hidden(ids, &positions, Attn::Full { mask });
        self.logits(&h)
    }
}

/// What every layer of one forward call shares (see [`Llama::prepare`]).
pub(super) struct Ctx<'m> {
    b: i64,
    t: i64,
    /// Ragged prefill: the flat indices of the real tokens (the stream holds them alone).
    real: Option<Tensor>,
    cos: Tensor,
    sin: Tensor,
    cos_bthd: Tensor,
    sin_bthd: Tensor,
    full_mask: Option<Tensor>,
    win_mask: Option<Tensor>,
    /// Packed rows: each sequence's `(start, len)` and, with a sliding window, its mask.
    segments: Option<Vec<((i64, i64), Option<Tensor>)>>,
    positions: Tensor,
    packed: Option<&'m Packed>,
    lora_train: bool,
}

impl<'m> Ctx<'m> {
    /// The same tables without the packed inference weights, so that the context no
    /// longer borrows the model (a unit-by-unit caller changes the weights under it).
    pub(super) fn without_packed(self) -> Ctx<'static> {
        Ctx {
            b: self.b,
            t: self.t,
            real: self.real,
            cos: self.cos,
            sin: self.sin,
            cos_bthd: self.cos_bthd,
            sin_bthd: self.sin_bthd,
            full_mask: self.full_mask,
            win_mask: self.win_mask,
            segments: self.segments,
            positions: self.positions,
            packed: None,
            lora_train: self.lora_train,
        }
    }

    /// Splits this call's tokens into parts a layer can run on one at a time, each of
    /// whole sequences (attention never crosses a part): runs of consecutive packed
    /// sequences, or of rows, of at most `tokens` tokens unless one sequence alone is
    /// longer. For the cache-free modes of layer recompute: `Packed`, and `Full` without
    /// a mask (rows right-padded, each causal on its own); anything else is one part.
    pub(super) fn parts(&self, tokens: usize) -> Vec<Part> {
        let tokens = tokens.max(1) as i64;
        let whole = || Part {
            dim: 1,
            start: 0,
            len: self.t,
            segments: 0..self.segments.as_ref().map_or(0, Vec::len),
        };
        // Runs of consecutive items (`spans`: each one's start and length along `dim`)
        // of at most `tokens` tokens (items of `per` tokens each unit of length).
        let group = |spans: &mut dyn Iterator<Item = (i64, i64)>, dim: i64, per: i64| {
            let mut parts: Vec<Part> = Vec::new();
            for (i, (start, len)) in spans.enumerate() {
                match parts.last_mut() {
                    Some(p) if (p.len + len) * per <= tokens => {
                        p.len += len;
                        p.segments.end = i + 1;
                    }
                    _ => parts.push(Part {
                        dim,
                        start,
                        len,
                        segments: i..i + 1,
                    }),
                }
            }
            parts
        };
        match &self.segments {
            Some(segs) => group(&mut segs.iter().map(|s| s.0), 1, 1),
            None if self.full_mask.is_none() && self.real.is_none() && self.b > 1 => {
                let mut rows = (0..self.b).map(|r| (r, 1));
                let mut parts = group(&mut rows, 0, self.t);
                for p in &mut parts {
                    p.segments = 0..0;
                }
                parts
            }
            None => vec![whole()],
        }
    }

    /// The tables of `part` alone, for running a layer on [`Part::cut`] of its input.
    pub(super) fn part(&self, part: &Part) -> Ctx<'m> {
        let (d, s, n) = (part.dim, part.start, part.len);
        // The rotary tables are `[b, 1, t, hd]`, and `[b, t, 1, hd]` transposed.
        let rot = |z: &Tensor, dim_t: i64| match d {
            0 => z.narrow(0, s, n),
            _ => z.narrow(dim_t, s, n),
        };
        let (b, t) = match d {
            0 => (n, self.t),
            _ => (self.b, n),
        };
        Ctx {
            b,
            t,
            real: None,
            cos: rot(&self.cos, 2),
            sin: rot(&self.sin, 2),
            cos_bthd: rot(&self.cos_bthd, 1),
            sin_bthd: rot(&self.sin_bthd, 1),
            full_mask: self.full_mask.as_ref().map(Tensor::shallow_clone),
            win_mask: self.win_mask.as_ref().map(Tensor::shallow_clone),
            segments: self.segments.as_ref().map(|segs| {
                segs[part.segments.clone()]
                    .iter()
                    .map(|((at, len), win)| {
                        ((at - s, *len), win.as_ref().map(Tensor::shallow_clone))
                    })
                    .collect()
            }),
            positions: rot(&self.positions, 1),
            packed: self.packed,
            lora_train: self.lora_train,
        }
    }

    /// Restores the `[b, t, ..]` layout (zeros in the padding) of rows of real tokens.
    fn pad(&self, z: Tensor) -> Tensor {
        match &self.real {
            Some(idx) => {
                let w = *z.size().last().expect("rows have a width");
                z.new_zeros([self.b * self.t, w], (z.kind(), z.device()))
                    .index_copy(0, idx, &z)
                    .view([self.b, self.t, w])
            }
            None => z,
        }
    }
}

/// Tokens of one forward call that a layer can run on alone ([`Ctx::parts`]): `len`
/// rows from `start` (`dim` 0) or, in a packed row, `len` positions from `start` (`dim`
/// 1) holding packed sequences `segments`.
pub(super) struct Part {
    dim: i64,
    start: i64,
    len: i64,
    segments: std::ops::Range<usize>,
}

impl Part {
    /// The part's tokens of `z` `[b, t, ..]`.
    pub(super) fn cut(&self, z: &Tensor) -> Tensor {
        z.narrow(self.dim, self.start, self.len)
    }

    /// [`Part::cut`]'s tokens of `z` `[b, t, width]` as rows `[tokens, width]`, a view
    /// (writes reach `z`): a part is contiguous in memory when `z` is.
    pub(super) fn rows(&self, z: &Tensor, width: i64) -> Tensor {
        self.cut(z).view([-1, width])
    }

    /// The packed sequences the part holds (indices into the call's sequences).
    pub(super) fn segments(&self) -> std::ops::Range<usize> {
        self.segments.clone()
    }
}
