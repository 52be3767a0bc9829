//! The deterministic part of batching, with no tensors: which request sits in which
//! cache slot ([`Scheduler`]), and how an admitted chunk is prefilled ([`plan_prefill`]).

use std::collections::VecDeque;

/// Continuous or static batching.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchingMode {
    /// Refill a slot as soon as its sequence finishes.
    Continuous,
    /// Admit a new batch only when every sequence of the previous one has finished.
    Static,
}

/// The deterministic slot bookkeeping of continuous batching.
#[derive(Debug, Clone)]
pub struct Scheduler {
    mode: BatchingMode,
    max_batch: usize,
    waiting: VecDeque<usize>,
    active: Vec<usize>,
}

impl Scheduler {
    /// A scheduler for requests `0..n`.
    pub fn new(n: usize, max_batch: usize, mode: BatchingMode) -> Self {
        Scheduler {
            mode,
            max_batch: max_batch.max(1),
            waiting: (0..n).collect(),
            active: Vec::new(),
        }
    }
    /// Moves waiting requests into free slots; returns them. They occupy slots
    /// `active_len() - k .. active_len()`, in order.
    #[cfg(test)]
    pub fn admit(&mut self) -> Vec<usize> {
        self.admit_while(|_| true)
    }

    /// Like [`Scheduler::admit`], in queue order while `fits` says the next request
    /// fits (the KV cache's free blocks): the first that does not stops admission.
    pub fn admit_while(&mut self, mut fits: impl FnMut(usize) -> bool) -> Vec<usize> {
        let mut out = Vec::new();
        for _ in 0..self.room() {
            match self.waiting.front() {
                Some(&r) if fits(r) => {
                    self.waiting.pop_front();
                    self.active.push(r);
                    out.push(r);
                }
                _ => break,
            }
        }
        out
    }

    /// Slots a new or resumed sequence may take now (none in static mode while a batch
    /// runs).
    pub fn room(&self) -> usize {
        if self.mode == BatchingMode::Static && !self.active.is_empty() {
            return 0;
        }
        self.max_batch - self.active.len().min(self.max_batch)
    }

    /// Puts a preempted request back into the next slot (after its sequence left it
    /// through [`Scheduler::finish`]); the caller checked [`Scheduler::room`].
    pub fn resume(&mut self, r: usize) {
        self.active.push(r);
    }
    /// Puts the requests in slots `start..start + order.len()` in the given order, which
    /// must be a permutation of them (prefill places copies of a prompt after it).
    pub fn reorder_slots(&mut self, start: usize, order: &[usize]) {
        let range = start..start + order.len();
        let mut a = self.active[range.clone()].to_vec();
        let mut b = order.to_vec();
        a.sort_unstable();
        b.sort_unstable();
        assert_eq!(
            a, b,
            "reorder_slots needs a permutation of the slots' requests"
        );
        self.active[range].copy_from_slice(order);
    }
    /// Finishes the sequence in `slot`. If another sequence was moved into that slot to
    /// keep the active slots dense, returns the slot it came from.
    /// Finish several slots of one step in descending slot order.
    pub fn finish(&mut self, slot: usize) -> Option<usize> {
        let last = self.active.len() - 1;
        self.active.swap_remove(slot);
        (slot != last).then_some(last)
    }
    /// Request in each active slot (the tests' view of the bookkeeping).
    #[cfg(test)]
    pub fn active(&self) -> &[usize] {
        &self.active
    }
    /// Number of active slots.
    pub fn active_len(&self) -> usize {
        self.active.len()
    }
    /// Whether no request is active or waiting (preempted sequences are the caller's).
    pub fn is_done(&self) -> bool {
        self.active.is_empty() && self.waiting.is_empty()
    }
}

/// How an admitted chunk is prefilled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefillPlan {
    /// The chunk's requests in slot order: the first `leaders` have distinct prompts,
    /// the rest repeat one of them.
    pub order: Vec<usize>,
    /// Number of distinct prompts.
    pub leaders: usize,
    /// For each entry of `order`, the position (in `order`) of the request whose prompt
    /// it runs: itself for a leader.
    pub source: Vec<usize>,
    /// Leading tokens common to all distinct prompts, prefilled once (0 = none).
    pub shared: usize,
}

/// Fewest common leading tokens worth a separate prefill call.
const MIN_SHARED_PREFIX: usize = 4;

/// Plans the prefill of `chunk` (request indices). With `share`, identical prompts are
/// prefilled once and the prefix common to all distinct prompts once (each prompt keeps at
/// least its last token, whose logits start sampling); without, every request is its own
/// leader.
pub fn plan_prefill<'a>(
    chunk: &[usize],
    prompt: impl Fn(usize) -> &'a [i64],
    share: bool,
) -> PrefillPlan {
    if !share {
        return PrefillPlan {
            order: chunk.to_vec(),
            leaders: chunk.len(),
            source: (0..chunk.len()).collect(),
            shared: 0,
        };
    }
    let mut leaders: Vec<usize> = Vec::new();
    let mut copies: Vec<(usize, usize)> = Vec::new(); // (request, leader position)
    let mut seen: std::collections::HashMap<&[i64], usize> = Default::default();
    for &r in chunk {
        let p = prompt(r);
        match seen.get(p) {
            Some(&l) => copies.push((r, l)),
            None => {
                seen.insert(p, leaders.len());
                leaders.push(r);
            }
        }
    }
    let mut shared = 0;
    if leaders.len() >= 2 {
        let first = prompt(leaders[0]);
        shared = leaders[1..].iter().fold(first.len() - 1, |acc, &r| {
            let p = prompt(r);
            let common = first.iter().zip(p).take_while(|(a, b)| a == b).count();
            acc.min(common).min(p.len() - 1)
        });
        if shared < MIN_SHARED_PREFIX {
            shared = 0;
        }
    }
    let mut order = leaders.clone();
    let mut source: Vec<usize> = (0..leaders.len()).collect();
    for (r, l) in copies {
        order.push(r);
        source.push(l);
    }
    PrefillPlan {
        leaders: leaders.len(),
        order,
        source,
        shared,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scheduler_refills_at_once_in_continuous_mode() {
        let mut s = Scheduler::new(5, 2, BatchingMode::Continuous);
        assert_eq!(s.admit(), vec![0, 1]);
        assert_eq!(s.admit(), Vec::<usize>::new());
        assert_eq!(s.finish(0), Some(1)); // request 1 moves into slot 0
        assert_eq!(s.active(), &[1]);
        assert_eq!(s.admit(), vec![2]);
        assert_eq!(s.active(), &[1, 2]);
        // finishing both in descending order keeps indices valid
        assert_eq!(s.finish(1), None);
        assert_eq!(s.finish(0), None);
        assert_eq!(s.admit(), vec![3, 4]);
        s.finish(1);
        s.finish(0);
        assert!(s.is_done());
    }

    #[test]
    fn admission_stops_at_the_first_request_that_does_not_fit() {
        let mut s = Scheduler::new(5, 4, BatchingMode::Continuous);
        let mut free = 5;
        let cost = [2, 2, 3, 1, 1];
        let got = s.admit_while(|r| {
            let ok = cost[r] <= free;
            free -= if ok { cost[r] } else { 0 };
            ok
        });
        assert_eq!(got, vec![0, 1]);
        assert_eq!(s.room(), 2);
        // A preempted sequence leaves, and comes back at the end.
        assert_eq!(s.finish(0), Some(1));
        s.resume(0);
        assert_eq!(s.active(), &[1, 0]);
        assert_eq!(s.admit(), vec![2, 3]);
        assert_eq!(s.room(), 0);
        let mut st = Scheduler::new(2, 2, BatchingMode::Static);
        st.admit_while(|r| r == 0);
        assert_eq!(st.room(), 0);
    }

    #[test]
    fn scheduler_static_waits_for_whole_batch() {
        let mut s = Scheduler::new(4, 2, BatchingMode::Static);
        assert_eq!(s.admit(), vec![0, 1]);
        s.finish(1);
        assert_eq!(s.admit(), Vec::<usize>::new());
        s.finish(0);
        assert_eq!(s.admit(), vec![2, 3]);
    }

    fn req(_id: u64, prompt: &[i64]) -> Vec<i64> {
        prompt.to_vec()
    }

    #[test]
    fn prefill_plan_shares_repeats_and_the_common_prefix() {
        let sys = [1i64, 2, 3, 4, 5, 6];
        let a = [&sys[..], &[10, 11]].concat();
        let b = [&sys[..], &[20]].concat();
        let reqs = vec![req(0, &a), req(1, &b), req(2, &a), req(3, &b), req(4, &a)];
        let plan = plan_prefill(&[0, 1, 2, 3, 4], |r| reqs[r].as_slice(), true);
        assert_eq!(plan.order, vec![0, 1, 2, 3, 4]);
        assert_eq!(plan.leaders, 2);
        assert_eq!(plan.source, vec![0, 1, 0, 1, 0]);
        assert_eq!(plan.shared, 6);
        // Requests 2 and 4 repeat request 0's prompt: they follow the leaders.
        let plan = plan_prefill(&[2, 4, 1, 0], |r| reqs[r].as_slice(), true);
        assert_eq!(plan.order, vec![2, 1, 4, 0]);
        assert_eq!(plan.source, vec![0, 1, 0, 0]);
        // One prompt being a prefix of another: each keeps its last token.
        let reqs = vec![req(0, &sys), req(1, &a)];
        assert_eq!(
            plan_prefill(&[0, 1], |r| reqs[r].as_slice(), true).shared,
            5
        );
        // Short common prefixes and a single distinct prompt are not split off.
        let reqs = vec![
            req(0, &[1, 2, 3, 9]),
            req(1, &[1, 2, 3, 8]),
            req(2, &[1, 2, 3, 8]),
        ];
        assert_eq!(
            plan_prefill(&[0, 1], |r| reqs[r].as_slice(), true).shared,
            0
        );
        let plan = plan_prefill(&[1, 2], |r| reqs[r].as_slice(), true);
        assert_eq!((plan.leaders, plan.shared), (1, 0));
        // Without sharing every request is its own leader.
        let plan = plan_prefill(&[1, 2], |r| reqs[r].as_slice(), false);
        assert_eq!((plan.order, plan.leaders, plan.shared), (vec![1, 2], 2, 0));
    }

    #[test]
    fn scheduler_reorders_slots_within_a_permutation() {
        let mut s = Scheduler::new(4, 4, BatchingMode::Continuous);
        s.admit();
        s.reorder_slots(1, &[3, 1, 2]);
        assert_eq!(s.active(), &[0, 3, 1, 2]);
        let r = std::panic::catch_unwind(move || s.reorder_slots(0, &[0, 0]));
        assert!(r.is_err());
    }
}
