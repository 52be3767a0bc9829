//! The bookkeeping of the paged KV cache, with no tensors in it: which physical blocks
//! each slot's positions live in (its block table), how many slots share each block
//! (reference counts), and which blocks are free.
//!
//! Block 0 is never handed out: it is the scratch block that padding rows and padding
//! positions write into (a table is padded with 0 past a slot's own blocks), so that a
//! write nobody reads never lands in a live block.

/// Positions per block of the paged KV cache: the CPU decode kernel's key block (16
/// scores at a time from one block of transposed keys, one vector per head dimension).
pub const KV_BLOCK: i64 = 16;

/// Blocks that hold `len` positions.
pub fn blocks_for(len: i64) -> i64 {
    (len.max(0) + KV_BLOCK - 1) / KV_BLOCK
}

/// The block tables, reference counts and free list of one paged cache.
#[derive(Debug, Clone)]
pub(crate) struct Blocks {
    refs: Vec<u32>,
    /// Free blocks, popped from the end (the lowest ids first on a fresh cache).
    free: Vec<i64>,
    tables: Vec<Vec<i64>>,
}

/// A block copied before a write because another slot still reads it (copy-on-write):
/// the caller copies the data of `from` into `to`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Cow {
    pub(crate) from: i64,
    pub(crate) to: i64,
}

impl Blocks {
    /// `total` physical blocks (block 0 the scratch) and `slots` empty tables.
    pub(crate) fn new(total: usize, slots: usize) -> Self {
        let total = total.max(1);
        let mut refs = vec![0; total];
        refs[0] = 1;
        Blocks {
            refs,
            free: (1..total as i64).rev().collect(),
            tables: vec![Vec::new(); slots],
        }
    }

    /// Blocks that can hold positions (all but the scratch block).
    pub(crate) fn usable(&self) -> usize {
        self.refs.len() - 1
    }

    /// Free blocks.
    pub(crate) fn free(&self) -> usize {
        self.free.len()
    }

    /// Blocks held by at least one slot.
    pub(crate) fn held(&self) -> usize {
        self.usable() - self.free.len()
    }

    /// Slot `slot`'s block table.
    pub(crate) fn table(&self, slot: usize) -> &[i64] {
        &self.tables[slot]
    }

    /// Blocks that making positions `from..to` of `slot` writable would take: new blocks
    /// past its table, and copies of the shared blocks the range touches.
    pub(crate) fn needed(&self, slot: usize, from: i64, to: i64) -> usize {
        let t = &self.tables[slot];
        let end = blocks_for(to) as usize;
        let first = (from.max(0) / KV_BLOCK) as usize;
        let grow = end.saturating_sub(t.len());
        let shared = (first..end.min(t.len()))
            .filter(|&b| self.refs[t[b] as usize] > 1)
            .count();
        grow + shared
    }

    /// Makes positions `from..to` of `slot` writable: blocks are added past its table and
    /// shared blocks in the range are replaced by private copies (returned, for the
    /// caller to copy their data). `None`, with nothing changed, when too few blocks are
    /// free.
    pub(crate) fn reserve(&mut self, slot: usize, from: i64, to: i64) -> Option<Vec<Cow>> {
        if self.needed(slot, from, to) > self.free.len() {
            return None;
        }
        let end = blocks_for(to) as usize;
        let first = (from.max(0) / KV_BLOCK) as usize;
        let mut cows = Vec::new();
        for b in first..end.min(self.tables[slot].len()) {
            let old = self.tables[slot][b];
            if self.refs[old as usize] > 1 {
                let new = self.pop();
                self.refs[old as usize] -= 1;
                self.tables[slot][b] = new;
                cows.push(Cow { from: old, to: new });
            }
        }
        while self.tables[slot].len() < end {
            let new = self.pop();
            self.tables[slot].push(new);
        }
        Some(cows)
    }

    fn pop(&mut self) -> i64 {
        let b = self.free.pop().expect("counted before taking");
        self.refs[b as usize] = 1;
        b
    }

    /// Returns `slot`'s blocks (each freed when no other slot holds it).
    pub(crate) fn release(&mut self, slot: usize) {
        for b in std::mem::take(&mut self.tables[slot]) {
            self.unref(b);
        }
    }

    /// `dst`'s first blocks become those of `src`'s first `len` positions (shared, the
    /// blocks they replace released): full blocks and the last partial one, copied at
    /// the first write into it ([`Blocks::reserve`]). `dst` keeps its blocks past them.
    pub(crate) fn share(&mut self, src: usize, dst: usize, len: i64) {
        if src == dst {
            return;
        }
        let n = (blocks_for(len) as usize).min(self.tables[src].len());
        for b in 0..n {
            let new = self.tables[src][b];
            self.refs[new as usize] += 1;
            match self.tables[dst].get(b).copied() {
                Some(old) => {
                    self.tables[dst][b] = new;
                    self.unref(old);
                }
                None => self.tables[dst].push(new),
            }
        }
    }

    fn unref(&mut self, b: i64) {
        let r = &mut self.refs[b as usize];
        *r -= 1;
        if *r == 0 {
            self.free.push(b);
        }
    }

    /// Moves `from`'s table to `to` (released first); `from` is left empty.
    pub(crate) fn move_slot(&mut self, from: usize, to: usize) {
        if from == to {
            return;
        }
        self.release(to);
        self.tables[to] = std::mem::take(&mut self.tables[from]);
    }

    /// Releases `slot` and gives it `n` fresh blocks; `None` (the slot left empty) when
    /// too few are free.
    pub(crate) fn fresh(&mut self, slot: usize, n: usize) -> Option<&[i64]> {
        self.release(slot);
        if n > self.free.len() {
            return None;
        }
        let t: Vec<i64> = (0..n).map(|_| self.pop()).collect();
        self.tables[slot] = t;
        Some(&self.tables[slot])
    }

    /// The tables of slots `start..start + n`, each padded with the scratch block to `nb`
    /// entries (cut to `nb` when longer), row-major `[n, nb]`.
    pub(crate) fn padded(&self, start: usize, n: usize, nb: usize) -> Vec<i64> {
        let mut out = vec![0; n * nb];
        for (i, t) in self.tables[start..start + n].iter().enumerate() {
            let k = t.len().min(nb);
            out[i * nb..i * nb + k].copy_from_slice(&t[..k]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_taken_as_positions_grow_and_returned_on_release() {
        let mut b = Blocks::new(5, 2);
        assert_eq!((b.usable(), b.free(), b.held()), (4, 4, 0));
        assert_eq!(b.needed(0, 0, 17), 2);
        assert_eq!(b.reserve(0, 0, 17), Some(vec![]));
        assert_eq!(b.table(0), &[1, 2]);
        // Writing inside the blocks it has takes nothing.
        assert_eq!(b.needed(0, 17, 32), 0);
        assert_eq!(b.needed(0, 32, 33), 1);
        // Too few free: nothing changes.
        assert_eq!(b.reserve(1, 0, 49), None);
        assert_eq!((b.table(1).len(), b.free()), (0, 2));
        b.release(0);
        assert_eq!(b.free(), 4);
        assert!(b.table(0).is_empty());
    }

    #[test]
    fn shared_blocks_are_counted_once_and_copied_on_write() {
        let mut b = Blocks::new(8, 3);
        b.reserve(0, 0, 20).unwrap(); // blocks 1, 2: 16 + 4 positions
        b.share(0, 1, 20);
        b.share(0, 2, 20);
        assert_eq!(b.held(), 2);
        assert_eq!(b.table(2), &[1, 2]);
        // Row 1 writes position 20 (the shared partial block): one copy.
        assert_eq!(b.needed(1, 20, 21), 1);
        assert_eq!(b.reserve(1, 20, 21), Some(vec![Cow { from: 2, to: 3 }]));
        assert_eq!(b.table(1), &[1, 3]);
        // Row 0 still shares block 2 with row 2.
        assert_eq!(b.reserve(0, 20, 21), Some(vec![Cow { from: 2, to: 4 }]));
        // Row 2 holds block 2 alone now: written in place.
        assert_eq!(b.reserve(2, 20, 21), Some(vec![]));
        assert_eq!(b.table(2), &[1, 2]);
        assert_eq!(b.held(), 4);
        // Sharing a prefix replaces the leading blocks alone.
        b.reserve(0, 20, 40).unwrap();
        assert_eq!(b.table(0), &[1, 4, 5]);
        b.share(2, 0, 16);
        assert_eq!(b.table(0), &[1, 4, 5]);
        b.share(1, 0, 16);
        assert_eq!(b.table(0), &[1, 4, 5]);
        // The full block goes back only when its last holder releases it.
        b.release(0);
        b.release(1);
        assert_eq!(b.held(), 2);
        b.release(2);
        assert_eq!(b.held(), 0);
    }

    #[test]
    fn moves_fresh_tables_and_padding() {
        let mut b = Blocks::new(6, 3);
        b.reserve(2, 0, 40).unwrap();
        b.move_slot(2, 0);
        assert_eq!(b.table(0), &[1, 2, 3]);
        assert!(b.table(2).is_empty());
        assert_eq!(b.fresh(1, 2).unwrap(), &[4, 5]);
        assert!(b.fresh(2, 1).is_none());
        assert_eq!(b.padded(0, 2, 4), vec![1, 2, 3, 0, 4, 5, 0, 0]);
        assert_eq!(b.padded(0, 1, 2), vec![1, 2]);
    }
}
