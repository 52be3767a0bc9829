//! Sequences kept after they finish, for a later request that continues them: a
//! multi-turn episode's next turn starts with the whole conversation so far, and only
//! what was appended since (the environment's observation) has to be prefilled.
//!
//! Kept KV lives in a paged pool laid out like the generator's cache (each entry a slot
//! whose blocks are copied in and out through its block table), allocated once and grown
//! by doubling (a copy per kept sequence allocated anew cost more than the prefill it
//! saved: page faults on every fresh buffer). An entry is a pool slot and the tokens it
//! holds; a request that names its key takes it back (an entry is used once) and keeps
//! the longest common prefix of those tokens and its prompt. The pool is bounded in
//! bytes, the oldest entry giving up its slot first; new weights clear it (a KV is only
//! valid for the weights that computed it).

use std::collections::VecDeque;

use crate::model::{blocks_for, KvCache};

/// An entry given back to a request continuing it.
pub(crate) struct Continued {
    /// Its pool slot (free again once the request's KV is copied out of it).
    pub(crate) slot: i64,
    /// Leading positions of the request's prompt it already holds (at least one, and
    /// at most the prompt's length less one: the last prompt token is always run, its
    /// logits start sampling).
    pub(crate) positions: usize,
}

struct Entry {
    key: u64,
    tokens: Vec<i64>,
    slot: i64,
}

/// The kept sequences of a generator.
pub(crate) struct KeptSequences {
    pool: Option<KvCache>,
    entries: VecDeque<Entry>,
    free: Vec<i64>,
    budget: usize,
}

/// Default bound on the bytes of the pool.
pub const DEFAULT_KEPT_KV_BYTES: usize = 1 << 30;

/// Slots of a new pool.
const FIRST_SLOTS: i64 = 16;

impl KeptSequences {
    pub(crate) fn new(budget: usize) -> Self {
        KeptSequences {
            pool: None,
            entries: VecDeque::new(),
            free: Vec::new(),
            budget,
        }
    }

    /// Keeps the first `len` positions of `cache`'s slot `from`, which hold `tokens`,
    /// under `key` (replacing an entry of that key). Without room, the oldest entry
    /// gives up its slot; under a budget too small for one slot, nothing is kept.
    pub(crate) fn keep(
        &mut self,
        key: u64,
        tokens: Vec<i64>,
        cache: &KvCache,
        from: i64,
        len: i64,
    ) {
        if let Some(e) = self.remove(key) {
            self.free.push(e.slot);
        }
        let Some(slot) = self.free_slot(cache) else {
            return;
        };
        let pool = self.pool.as_mut().expect("a free slot means a pool");
        // The pool holds `max_len` positions for every slot: the copy always fits.
        if cache.copy_slot_to(from, pool, slot, len) {
            self.entries.push_back(Entry { key, tokens, slot });
        } else {
            self.free.push(slot);
        }
    }

    /// A free pool slot: one never used, a new one (the pool doubled within the
    /// budget), or the oldest entry's.
    fn free_slot(&mut self, cache: &KvCache) -> Option<i64> {
        if let Some(s) = self.free.pop() {
            return Some(s);
        }
        let per_slot = (blocks_for(cache.max_len) as usize * cache.bytes_per_block()).max(1);
        let most = (self.budget / per_slot) as i64;
        let have = self.pool.as_ref().map_or(0, |p| p.slots);
        if have < most {
            let slots = (have * 2).max(FIRST_SLOTS).min(most);
            let mut grown = cache.like(slots, cache.max_len);
            if let Some(old) = &self.pool {
                for s in 0..old.slots {
                    old.copy_slot_to(s, &mut grown, s, old.max_len);
                }
            }
            self.pool = Some(grown);
            self.free.extend((have..slots).rev());
            return self.free.pop();
        }
        self.entries.pop_front().map(|e| e.slot)
    }

    /// Takes the entry of `key` for a request of `prompt`, if it shares at least one
    /// leading token with it.
    pub(crate) fn take(&mut self, key: u64, prompt: &[i64]) -> Option<Continued> {
        let e = self.remove(key)?;
        // Its slot is free once the caller copied it out (see `restore`).
        self.free.push(e.slot);
        let common = e
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let positions = common.min(prompt.len().saturating_sub(1));
        (positions > 0).then_some(Continued {
            slot: e.slot,
            positions,
        })
    }

    /// Copies the first `len` positions of a taken entry's pool slot into fresh blocks
    /// of `cache`'s slot `to`; `false` when `cache` has too few free blocks. Call before
    /// keeping anything else: the slot is free again.
    pub(crate) fn restore(&self, c: &Continued, cache: &mut KvCache, to: i64, len: i64) -> bool {
        match &self.pool {
            Some(pool) => pool.copy_slot_to(c.slot, cache, to, len),
            None => false,
        }
    }

    fn remove(&mut self, key: u64) -> Option<Entry> {
        let i = self.entries.iter().position(|e| e.key == key)?;
        self.entries.remove(i)
    }

    /// Drops every entry and the pool.
    pub(crate) fn clear(&mut self) {
        self.entries.clear();
        self.free.clear();
        self.pool = None;
    }

    /// Sets the bound on the pool's bytes (taking effect when the pool is made next).
    pub(crate) fn set_budget(&mut self, budget: usize) {
        self.budget = budget;
        self.clear();
    }

    /// Entries kept.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}
