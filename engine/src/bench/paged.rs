//! `yatt bench engine`'s paged-KV row: long-tail rollouts (`max_new_tokens` 8,192, most
//! responses far shorter) under the memory budget today's contiguous cache would take
//! at `max_new_tokens` 2,048, against what that cache can hold at 8,192.

use super::row::{sampled_requests, BenchRow};
use crate::error::Result;
use crate::generate::{Generator, GeneratorConfig, RequestRng};
use crate::model::{KvCache, Llama, KV_BLOCK};

/// The longest response allowed.
const MAX_NEW: usize = 8192;
/// The response cap the budget is sized for (a contiguous cache of `SLOTS` slots).
const SIZED_FOR: usize = 2048;
/// Slots of the contiguous cache whose bytes are the budget.
const SLOTS: usize = 4;
/// Most sequences the paged engine decodes together (its compute cap).
const MAX_BATCH: usize = 16;

/// Long-tail response lengths, capped at [`MAX_NEW`]: Pareto (64 / u), median about
/// 130 (167 for 32 requests, the longest 5,489).
fn lengths(n: usize) -> Vec<usize> {
    let mut rng = RequestRng::new(2);
    (0..n)
        .map(|_| {
            let u = rng.uniform().max(1e-4) as f64;
            ((64.0 / u) as usize).clamp(16, MAX_NEW)
        })
        .collect()
}

/// Runs `n` long-tail requests over `prompts` with the paged cache at the budget of a
/// contiguous cache of [`SLOTS`] × (prompt + [`SIZED_FOR`]) positions; the row compares
/// the sequences it keeps in flight with the slots that budget gives a contiguous cache
/// at [`MAX_NEW`].
pub(super) fn long_tail_row(
    model: Llama,
    prompts: &[Vec<i64>],
    n: usize,
    top_k: usize,
) -> Result<BenchRow> {
    let p = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let per_pos = KvCache::block_bytes(&model) / KV_BLOCK as usize;
    let budget = SLOTS * (p + SIZED_FOR) * per_pos;
    let contiguous_slots = budget / ((p + MAX_NEW) * per_pos);
    let lens = lengths(n);
    let reqs = sampled_requests(prompts, &lens, top_k);
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: MAX_BATCH,
            max_seq_len: p + MAX_NEW,
            max_prefill_batch: MAX_BATCH,
            kv_cache_bytes: Some(budget),
            ..Default::default()
        },
    );
    let (outs, st) = g.generate(&reqs)?;
    let tokens: usize = outs.iter().map(|c| c.tokens.len()).sum();
    let mut sorted = lens.clone();
    sorted.sort_unstable();
    let (median, max) = (sorted[sorted.len() / 2], sorted[sorted.len() - 1]);
    let gb = |b: usize| b as f64 / 1e9;
    eprintln!(
        "paged long tail: {n} requests, {tokens} tokens in {:.1}s, {} in flight at most, {} preemptions",
        st.seconds, st.max_in_flight, st.kv_preemptions
    );
    Ok(BenchRow {
        case: format!(
            "paged KV, long tail: {n} requests, max_new_tokens {MAX_NEW} (median {median}, longest {max}), budget = a contiguous cache of {SLOTS} × (prompt + {SIZED_FOR})"
        ),
        yatt: st.max_in_flight as f64,
        reference: Some(contiguous_slots as f64),
        unit: "sequences in flight".into(),
        note: format!(
            "reference: the slots a contiguous cache gets from the same {:.2} GB at max_new_tokens {MAX_NEW} (it cannot allocate the {SLOTS} slots it had at {SIZED_FOR}: {:.2} GB); paged: {:.1} response tokens/s over the batch, {} preemptions, {:.2} GB of blocks held at the peak",
            gb(budget),
            gb(SLOTS * (p + MAX_NEW) * per_pos),
            tokens as f64 / st.seconds.max(1e-9),
            st.kv_preemptions,
            gb(st.kv_bytes_held_peak)
        ),
    })
}
