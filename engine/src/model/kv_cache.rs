//! The preallocated key/value cache of generation: on the CPU in the blocked key layout
//! the CPU decode kernel streams, elsewhere dense like the values.

use super::llama::Llama;
use tch::{Device, Kind, Tensor};

/// Positions per key block of a cache on the CPU (see [`KvCache`]).
pub const KV_BLOCK: i64 = 16;

/// A preallocated key/value cache. Per layer, values are `[slots, kv_heads, max_len,
/// head_dim]` and keys are stored in blocks of [`KV_BLOCK`] positions, transposed within
/// each block: `[slots, kv_heads, max_len / KV_BLOCK, head_dim, KV_BLOCK]`. The CPU decode
/// kernel then streams both contiguously: 16 scores at a time from one block of keys
/// (one vector per head dimension, no horizontal sums), and the weighted sum row by row
/// over the values.
///
/// On other devices the block is one position: keys are `[.., max_len, head_dim, 1]`,
/// dense like the values, so attention reads them in place. (With blocks of 16, every
/// layer of every decode step copied all keys into the dense layout first. On an H100
/// removing that copy did not shorten a step measurably: a graph-replayed step is bound
/// by its kernels' count, see docs/benchmarks.md.)
#[derive(Debug)]
pub struct KvCache {
    pub(super) kb: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    /// Positions per key block: [`KV_BLOCK`] on the CPU, 1 elsewhere.
    pub(super) block: i64,
    /// Number of sequence slots.
    pub slots: i64,
    /// Positions per slot.
    pub max_len: i64,
}

impl KvCache {
    /// Allocates a cache for `model`, in the layout its device reads best.
    pub fn new(model: &Llama, slots: i64, max_len: i64) -> Self {
        let block = if model.device() == Device::Cpu {
            KV_BLOCK
        } else {
            1
        };
        Self::with_block(model, slots, max_len, block)
    }

    /// Allocates a cache for `model` with `block` positions per key block.
    pub(super) fn with_block(model: &Llama, slots: i64, max_len: i64, block: i64) -> Self {
        let c = &model.config;
        let opts = (model.kind(), model.device());
        let (nkv, hd) = (c.num_key_value_heads, c.head_dim);
        let blocks = (max_len + block - 1) / block;
        let kb = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([slots, nkv, blocks, hd, block], opts))
            .collect();
        let v = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([slots, nkv, max_len, hd], opts))
            .collect();
        KvCache {
            kb,
            v,
            block,
            slots,
            max_len,
        }
    }

    /// Keys of slots `start..start+n`, positions `0..len`, as a dense
    /// `[n, kv_heads, len, head_dim]` tensor: a copy with blocks of several positions, a
    /// view with blocks of one.
    pub(super) fn keys(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        let k = self.kb[layer]
            .narrow(0, start, n)
            .narrow(2, 0, (len + self.block - 1) / self.block)
            .permute([0, 1, 2, 4, 3]);
        let (kv, hd) = (k.size()[1], k.size()[4]);
        k.reshape([n, kv, -1, hd]).narrow(2, 0, len)
    }

    /// Values of slots `start..start+n`, positions `0..len`: a view
    /// `[n, kv_heads, len, head_dim]`.
    pub(super) fn values(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        self.v[layer].narrow(0, start, n).narrow(2, 0, len)
    }

    /// Where the keys of `positions` `[n, t]` in `slots` `[n]` go: (row, lane) indices into
    /// a layer's keys viewed as `[slots · kv_heads · blocks, head_dim, block]`, ordered
    /// like `k.reshape([-1, head_dim])` for `k` `[n, kv_heads, t, head_dim]`.
    pub(super) fn key_index(&self, slots: &Tensor, positions: &Tensor) -> (Tensor, Tensor) {
        let size = self.kb[0].size();
        let (nkv, blocks) = (size[1], size[2]);
        let dev = self.device();
        let (n, t) = positions.size2().expect("positions must be [n, t]");
        let heads = Tensor::arange(nkv, (Kind::Int64, dev)).reshape([1, nkv, 1]);
        let slot_rows = slots.reshape([n, 1, 1]) * nkv + heads; // [n, kv, 1]
        let pos = positions.reshape([n, 1, t]);
        let row = (slot_rows * blocks + pos.floor_divide_scalar(self.block)).reshape([-1]);
        let lane = pos
            .remainder(self.block)
            .expand([n, nkv, t], false)
            .reshape([-1]);
        (row, lane)
    }

    /// Writes keys and values `[n, kv_heads, t, head_dim]` of one layer: the keys where
    /// `index` (from [`KvCache::key_index`]) says, the values where `at` says.
    pub(super) fn write(
        &mut self,
        layer: usize,
        index: &(Tensor, Tensor),
        k: &Tensor,
        v: &Tensor,
        at: ValueSlots<'_>,
    ) {
        let size = self.kb[layer].size();
        let hd = size[3];
        let mut flat = self.kb[layer].view([-1, hd, self.block]);
        let _ = flat.index_put_(
            &[Some(&index.0), None, Some(&index.1)],
            &k.reshape([-1, hd]),
            false,
        );
        match at {
            ValueSlots::Range { start, offset } => {
                let (n, t) = (v.size()[0], v.size()[2]);
                self.v[layer]
                    .narrow(0, start, n)
                    .narrow(2, offset, t)
                    .copy_(v);
            }
            ValueSlots::Rows { rows, pos } => {
                let _ = self.v[layer].index_put_(
                    &[Some(rows), None, Some(pos)],
                    &v.squeeze_dim(2),
                    false,
                );
            }
        }
    }

    /// Writes one token per row (keys and values `[n, kv_heads, 1, head_dim]`) at slot
    /// `rows[i]`, position `pos[i]`, when keys are dense (blocks of one position): both
    /// like the values, with no flat index and no copy of the keys first. `false`: the
    /// keys are blocked, use [`KvCache::write`].
    pub(super) fn write_rows_dense(
        &mut self,
        layer: usize,
        rows: &Tensor,
        pos: &Tensor,
        k: &Tensor,
        v: &Tensor,
    ) -> bool {
        if self.block != 1 {
            return false;
        }
        let index = [Some(rows), None, Some(pos)];
        let mut keys = self.kb[layer].squeeze_dim(-1);
        let _ = keys.index_put_(&index, &k.squeeze_dim(2), false);
        let _ = self.v[layer].index_put_(&index, &v.squeeze_dim(2), false);
        true
    }

    /// A cache like this one (same layers, heads, device and type) with `slots` slots of
    /// `max_len` positions, not zeroed: what it holds is only read after being written.
    pub fn like(&self, slots: i64, max_len: i64) -> Self {
        let block = self.block;
        let blocks = (max_len + block - 1) / block;
        let shaped = |t: &Tensor, dims: &[i64]| Tensor::empty(dims, (t.kind(), t.device()));
        KvCache {
            kb: self
                .kb
                .iter()
                .map(|t| {
                    let z = t.size();
                    shaped(t, &[slots, z[1], blocks, z[3], block])
                })
                .collect(),
            v: self
                .v
                .iter()
                .map(|t| {
                    let z = t.size();
                    shaped(t, &[slots, z[1], max_len, z[3]])
                })
                .collect(),
            block,
            slots,
            max_len,
        }
    }

    /// Copies the first `len` positions of slot `from` into slot `to` of `other` (a cache
    /// of the same layout, see [`KvCache::like`]). Whole key blocks are copied: positions
    /// of the last block past `len` are copied too, and no one attends to a position
    /// past a slot's length before writing it.
    pub fn copy_slot_to(&self, from: i64, other: &mut KvCache, to: i64, len: i64) {
        let len = len.min(self.max_len).min(other.max_len);
        let blocks = (len + self.block - 1) / self.block;
        tch::no_grad(|| {
            for (src, dst) in self.kb.iter().zip(other.kb.iter_mut()) {
                dst.narrow(0, to, 1)
                    .narrow(2, 0, blocks)
                    .copy_(&src.narrow(0, from, 1).narrow(2, 0, blocks));
            }
            for (src, dst) in self.v.iter().zip(other.v.iter_mut()) {
                dst.narrow(0, to, 1)
                    .narrow(2, 0, len)
                    .copy_(&src.narrow(0, from, 1).narrow(2, 0, len));
            }
        });
    }

    /// Copies the first `len` positions of slot `from` into slot `to`.
    pub fn move_slot(&mut self, from: i64, to: i64, len: i64) {
        if from == to || len == 0 {
            return;
        }
        self.copy_slots(&[from], &[to], len);
    }

    /// Copies the first `len` positions of slot `src[i]` into slot `dst[i]`, for every
    /// `i` (prefix sharing: prompts prefilled once are copied into the other slots). No
    /// slot may be both a source and a destination.
    pub fn copy_slots(&mut self, src: &[i64], dst: &[i64], len: i64) {
        assert_eq!(
            src.len(),
            dst.len(),
            "copy_slots: one source per destination"
        );
        if src.is_empty() || len == 0 {
            return;
        }
        let dev = self.device();
        let si = Tensor::from_slice(src).to_device(dev);
        let di = Tensor::from_slice(dst).to_device(dev);
        tch::no_grad(|| {
            for t in self.kb.iter_mut() {
                let mut view = t.narrow(2, 0, (len + self.block - 1) / self.block);
                let rows = view.index_select(0, &si);
                let _ = view.index_copy_(0, &di, &rows);
            }
            for t in self.v.iter_mut() {
                let mut view = t.narrow(2, 0, len);
                let rows = view.index_select(0, &si);
                let _ = view.index_copy_(0, &di, &rows);
            }
        });
    }

    /// Data pointer of the first layer's key tensor (identity check for reuse).
    pub fn k_ptr(&self) -> usize {
        self.kb.first().map(|t| t.data_ptr() as usize).unwrap_or(0)
    }

    /// The device the cache lives on.
    pub fn device(&self) -> Device {
        self.kb.first().map(|t| t.device()).unwrap_or(Device::Cpu)
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        self.kb
            .iter()
            .chain(self.v.iter())
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }
}

/// Where [`KvCache::write`] puts values.
pub(super) enum ValueSlots<'a> {
    /// Slots `start..start+n`, positions `offset..offset+t`.
    Range { start: i64, offset: i64 },
    /// One token per row: slot `rows[i]`, position `pos[i]`.
    Rows { rows: &'a Tensor, pos: &'a Tensor },
}
