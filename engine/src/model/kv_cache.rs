//! The paged key/value cache of generation: fixed blocks of [`KV_BLOCK`] positions, a
//! block table per sequence slot, blocks taken as positions are written and returned
//! when a slot is released (the bookkeeping is [`Blocks`]). Memory follows the tokens
//! that exist, not `slots × max_len`.

use super::blocks::{blocks_for, Blocks, Cow, KV_BLOCK};
use super::llama::Llama;
use tch::{Device, Tensor};

/// A paged key/value cache. Per layer, keys are `[blocks, kv_heads, head_dim,
/// KV_BLOCK]` (transposed within a block) and values `[blocks, kv_heads, KV_BLOCK,
/// head_dim]`. The CPU decode kernel streams both through a slot's block table: 16
/// scores at a time from one block of keys (one vector per head dimension, no
/// horizontal sums), and the weighted sum row by row over a block of values. Other paths
/// gather a slot's blocks into the dense `[n, kv_heads, len, head_dim]` layout.
///
/// Slots are the rows of a batch; each has a block table. Positions are written only
/// after [`KvCache::reserve`] (the forward reserves what a call writes when the caller
/// did not); several slots may share blocks (a GRPO group's prompt), a shared block
/// being copied at the first write into it.
#[derive(Debug)]
pub struct KvCache {
    pub(super) kb: Vec<Tensor>,
    pub(super) v: Vec<Tensor>,
    blocks: Blocks,
    /// Number of sequence slots (block tables).
    pub slots: i64,
    /// Most positions a slot may hold.
    pub max_len: i64,
}

/// Where one forward call's new keys and values go, computed once for all layers.
#[derive(Debug)]
pub(super) struct CacheIndex {
    /// The rows' block tables `[B, nb]` on the cache's device (0: the scratch block).
    pub(super) table: Tensor,
    /// Block and lane of each new position, ordered `[B, t]` row-major.
    blk: Tensor,
    lane: Tensor,
}

impl KvCache {
    /// A cache for `model` with blocks enough for `slots` slots of `max_len` positions
    /// each (what a contiguous cache would hold).
    pub fn new(model: &Llama, slots: i64, max_len: i64) -> Self {
        let total = slots.max(1) * blocks_for(max_len) + 1;
        Self::with_blocks(model, slots, max_len, total as usize)
    }

    /// A cache for `model` with `slots` slots and `total` blocks (one of them the scratch
    /// block padding writes into).
    pub fn with_blocks(model: &Llama, slots: i64, max_len: i64, total: usize) -> Self {
        let c = &model.config;
        let opts = (model.kind(), model.device());
        let (nkv, hd, n) = (c.num_key_value_heads, c.head_dim, total.max(2) as i64);
        // Zeroed: a padded table reads blocks that were never written, under a mask; a
        // NaN there would survive the mask.
        let kb = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([n, nkv, hd, KV_BLOCK], opts))
            .collect();
        let v = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([n, nkv, KV_BLOCK, hd], opts))
            .collect();
        KvCache {
            kb,
            v,
            blocks: Blocks::new(n as usize, slots.max(1) as usize),
            slots: slots.max(1),
            max_len,
        }
    }

    /// Bytes of one block (keys and values of every layer) for `model`.
    pub fn block_bytes(model: &Llama) -> usize {
        let c = &model.config;
        let per = c.num_key_value_heads * c.head_dim * KV_BLOCK;
        2 * c.num_hidden_layers as usize * per as usize * model.kind().elt_size_in_bytes()
    }

    /// Bytes of one of this cache's blocks.
    pub fn bytes_per_block(&self) -> usize {
        self.kb
            .iter()
            .chain(self.v.iter())
            .map(|t| t.numel() / t.size()[0] as usize * t.kind().elt_size_in_bytes())
            .sum()
    }

    /// Blocks that can hold positions (all but the scratch block).
    pub fn usable_blocks(&self) -> usize {
        self.blocks.usable()
    }

    /// Free blocks.
    pub fn free_blocks(&self) -> usize {
        self.blocks.free()
    }

    /// Blocks held by live slots (a block shared by several counts once).
    pub fn held_blocks(&self) -> usize {
        self.blocks.held()
    }

    /// Bytes of the blocks held by live slots.
    pub fn held_bytes(&self) -> usize {
        self.held_blocks() * self.bytes_per_block()
    }

    /// Slot `slot`'s block table.
    pub fn table(&self, slot: i64) -> &[i64] {
        self.blocks.table(slot as usize)
    }

    /// Blocks [`KvCache::reserve`] would take to make positions `from..to` of `slot`
    /// writable.
    pub fn needed(&self, slot: i64, from: i64, to: i64) -> usize {
        self.blocks.needed(slot as usize, from, to)
    }

    /// Makes positions `from..to` of `slot` writable (blocks added, shared ones copied);
    /// `false`, with nothing changed, when too few blocks are free.
    pub fn reserve(&mut self, slot: i64, from: i64, to: i64) -> bool {
        match self.blocks.reserve(slot as usize, from, to) {
            Some(cows) => {
                self.copy_blocks(&cows);
                true
            }
            None => false,
        }
    }

    /// Copies the data of copied-on-write blocks.
    fn copy_blocks(&mut self, cows: &[Cow]) {
        if cows.is_empty() {
            return;
        }
        let dev = self.device();
        let from: Vec<i64> = cows.iter().map(|c| c.from).collect();
        let to: Vec<i64> = cows.iter().map(|c| c.to).collect();
        let (from, to) = (
            Tensor::from_slice(&from).to_device(dev),
            Tensor::from_slice(&to).to_device(dev),
        );
        tch::no_grad(|| {
            for t in self.kb.iter_mut().chain(self.v.iter_mut()) {
                let rows = t.index_select(0, &from);
                let _ = t.index_copy_(0, &to, &rows);
            }
        });
    }

    /// Returns `slot`'s blocks (a shared block stays while another slot holds it).
    pub fn release(&mut self, slot: i64) {
        self.blocks.release(slot as usize);
    }

    /// The block tables of slots `start..start + n`, padded with the scratch block to
    /// `nb` entries: `[n, nb]` int64 on the CPU.
    pub fn tables(&self, start: i64, n: i64, nb: i64) -> Tensor {
        let t = self
            .blocks
            .padded(start as usize, n as usize, nb.max(1) as usize);
        Tensor::from_slice(&t).view([n, nb.max(1)])
    }

    /// Reserves the positions one prefill call writes into slots `start..start + b`
    /// from `offset` (row `i`'s first `lens[i]` tokens, all `t` without lengths) and
    /// says where its keys and values go. A fresh prompt (`offset` 0) releases the
    /// slots' old blocks first.
    ///
    /// # Panics
    /// When too few blocks are free: a caller with a bounded cache (the generator)
    /// reserves first; [`KvCache::new`] holds every slot's `max_len` positions.
    pub(super) fn prefill_index(
        &mut self,
        start: i64,
        offset: i64,
        positions: &Tensor,
        lens: Option<&[i64]>,
    ) -> CacheIndex {
        let (b, t) = positions.size2().expect("positions must be [B, T]");
        for i in 0..b {
            let slot = start + i;
            if offset == 0 {
                self.release(slot);
            }
            let len = lens.map_or(t, |l| l[i as usize].min(t));
            assert!(
                self.reserve(slot, offset, offset + len),
                "KV cache out of blocks in a prefill: reserve before the forward"
            );
        }
        let table = self
            .tables(start, b, blocks_for(offset + t))
            .to_device(self.device());
        self.index(table, positions)
    }

    /// The block tables `[B, nb]` of slots `0..B` for one decode step writing position
    /// `positions[i]` of slot `i` (reserved here).
    ///
    /// # Panics
    /// When too few blocks are free (see [`KvCache::prefill_index`]).
    pub(super) fn decode_tables(&mut self, positions: &Tensor) -> Tensor {
        let pos = Vec::<i64>::try_from(positions.reshape([-1]).to_device(Device::Cpu))
            .expect("int64 positions");
        for (i, &p) in pos.iter().enumerate() {
            assert!(
                self.reserve(i as i64, p, p + 1),
                "KV cache out of blocks in a decode step: reserve before the forward"
            );
        }
        let span = pos.iter().copied().max().unwrap_or(0) + 1;
        self.tables(0, pos.len() as i64, blocks_for(span))
            .to_device(self.device())
    }

    /// Where the keys and values of `positions` `[B, t]` go, through `table` `[B, nb]`.
    pub(super) fn index(&self, table: Tensor, positions: &Tensor) -> CacheIndex {
        let blk = table
            .gather(1, &positions.floor_divide_scalar(KV_BLOCK), false)
            .reshape([-1]);
        let lane = positions.remainder(KV_BLOCK).reshape([-1]);
        CacheIndex { table, blk, lane }
    }

    /// Writes keys and values `[B, kv_heads, t, head_dim]` of one layer where `index`
    /// says.
    pub(super) fn write(&mut self, layer: usize, index: &CacheIndex, k: &Tensor, v: &Tensor) {
        let (nkv, hd) = (k.size()[1], k.size()[3]);
        let rows = |x: &Tensor| x.transpose(1, 2).reshape([-1, nkv, hd]);
        let at = [Some(&index.blk), None, None, Some(&index.lane)];
        let _ = self.kb[layer].index_put_(&at, &rows(k), false);
        let at = [Some(&index.blk), None, Some(&index.lane)];
        let _ = self.v[layer].index_put_(&at, &rows(v), false);
    }

    /// Keys of the slots whose tables are `table` `[n, nb]`, positions `0..len`, as a
    /// dense `[n, kv_heads, len, head_dim]` copy.
    pub(super) fn gather_keys(&self, layer: usize, table: &Tensor, len: i64) -> Tensor {
        // A block's keys are `[kv, hd, 16]`: positions go before the head dimension.
        gather(&self.kb[layer], table, len, [0, 2, 1, 4, 3])
    }

    /// Values like [`KvCache::gather_keys`].
    pub(super) fn gather_values(&self, layer: usize, table: &Tensor, len: i64) -> Tensor {
        gather(&self.v[layer], table, len, [0, 2, 1, 3, 4])
    }

    /// Keys of slots `start..start+n`, positions `0..len`: `[n, kv_heads, len, head_dim]`.
    #[cfg(test)]
    pub(super) fn keys(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        let t = self
            .tables(start, n, blocks_for(len))
            .to_device(self.device());
        self.gather_keys(layer, &t, len)
    }

    /// Values of slots `start..start+n`, positions `0..len`.
    #[cfg(test)]
    pub(super) fn values(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        let t = self
            .tables(start, n, blocks_for(len))
            .to_device(self.device());
        self.gather_values(layer, &t, len)
    }

    /// A cache like this one (same layers, heads, device and type) with `slots` slots and
    /// blocks for `max_len` positions in each.
    pub fn like(&self, slots: i64, max_len: i64) -> Self {
        let total = (slots.max(1) * blocks_for(max_len) + 1) as usize;
        let shaped = |t: &Tensor| {
            let mut z = t.size();
            z[0] = total as i64;
            Tensor::zeros(z, (t.kind(), t.device()))
        };
        KvCache {
            kb: self.kb.iter().map(shaped).collect(),
            v: self.v.iter().map(shaped).collect(),
            blocks: Blocks::new(total, slots.max(1) as usize),
            slots: slots.max(1),
            max_len,
        }
    }

    /// Copies the first `len` positions of slot `from` into slot `to` of `other` (a cache
    /// of the same layout, see [`KvCache::like`]), which gets fresh blocks for them
    /// (whole blocks are copied). `false`, with `to` left empty, when `other` has too
    /// few free blocks.
    pub fn copy_slot_to(&self, from: i64, other: &mut KvCache, to: i64, len: i64) -> bool {
        let len = len.min(self.max_len).min(other.max_len);
        let src = self.blocks.table(from as usize);
        let n = (blocks_for(len) as usize).min(src.len());
        let dev = other.device();
        let Some(dst) = other.blocks.fresh(to as usize, n) else {
            return false;
        };
        if n == 0 {
            return true;
        }
        let si = Tensor::from_slice(&src[..n]).to_device(self.device());
        let di = Tensor::from_slice(dst).to_device(dev);
        tch::no_grad(|| {
            let pairs = self.kb.iter().zip(other.kb.iter_mut());
            for (s, d) in pairs.chain(self.v.iter().zip(other.v.iter_mut())) {
                let rows = s.index_select(0, &si).to_device(dev);
                let _ = d.index_copy_(0, &di, &rows);
            }
        });
        true
    }

    /// Moves slot `from`'s blocks to slot `to` (no data is copied: its table moves).
    pub fn move_slot(&mut self, from: i64, to: i64) {
        self.blocks.move_slot(from as usize, to as usize);
    }

    /// Slots `dst[i]` share the blocks of the first `len` positions of `src[i]`, for
    /// every `i` (prefix sharing: a prompt prefilled once serves every sample of it). A
    /// shared block is copied only when a slot writes into it.
    pub fn copy_slots(&mut self, src: &[i64], dst: &[i64], len: i64) {
        assert_eq!(
            src.len(),
            dst.len(),
            "copy_slots: one source per destination"
        );
        for (&s, &d) in src.iter().zip(dst) {
            self.blocks.share(s as usize, d as usize, len);
        }
    }

    /// Data pointer of the first layer's key tensor (identity check for reuse).
    pub fn k_ptr(&self) -> usize {
        self.kb.first().map(|t| t.data_ptr() as usize).unwrap_or(0)
    }

    /// The device the cache lives on.
    pub fn device(&self) -> Device {
        self.kb.first().map(|t| t.device()).unwrap_or(Device::Cpu)
    }

    /// Bytes allocated for the cache (every block, held or free).
    pub fn bytes(&self) -> usize {
        self.kb
            .iter()
            .chain(self.v.iter())
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }
}

/// The blocks `table` `[n, nb]` names of one layer's keys or values, as `[n, kv_heads,
/// len, head_dim]`: `perm` orders the gathered `[n, nb, kv, a, b]` as `[n, kv, nb,
/// position, head_dim]`.
fn gather(blocks: &Tensor, table: &Tensor, len: i64, perm: [i64; 5]) -> Tensor {
    let (n, nb) = table.size2().expect("tables are [n, nb]");
    let z = blocks.size();
    let (nkv, hd) = (z[1], z[1..].iter().product::<i64>() / z[1] / KV_BLOCK);
    blocks
        .index_select(0, &table.reshape([-1]))
        .view([n, nb, z[1], z[2], z[3]])
        .permute(perm)
        .reshape([n, nkv, nb * KV_BLOCK, hd])
        .narrow(2, 0, len)
}
