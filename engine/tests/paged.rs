//! The paged KV cache in generation, on the real SmolLM2 model: a budget in bytes
//! instead of `slots × max_len`, preemption when blocks run out, and a GRPO group
//! holding its prompt once.

use super::generate::{chat, setup};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::*;

/// Greedy requests that finish at very different lengths (1 to 72 new tokens).
fn uneven(tok: &Tokenizer) -> Vec<Request> {
    let qs = [
        "Tell me a story about a dragon.",
        "What is 2+2?",
        "Describe the sea in detail.",
        "Name a fruit.",
        "Why is the sky blue?",
        "Count to twenty.",
    ];
    let lens = [72usize, 3, 40, 1, 60, 12];
    qs.iter()
        .zip(lens)
        .enumerate()
        .map(|(i, (q, n))| Request {
            id: i as u64,
            prompt: chat(tok, q),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(n)
            },
        })
        .collect()
}

fn config(budget: Option<usize>) -> GeneratorConfig {
    GeneratorConfig {
        max_batch: 6,
        max_seq_len: 128,
        kv_cache_bytes: budget,
        ..Default::default()
    }
}

/// A budget too small for the batch preempts the newest sequences and recomputes their
/// prefix later: every sequence finishes with the greedy tokens of a cache that holds
/// them all, whatever its length, and the preemptions are counted. A budget too small
/// for one request alone is refused, naming the key to raise.
#[test]
fn a_small_budget_preempts_and_finishes_with_the_tokens_of_a_large_one() {
    let (model, tok) = setup();
    let small_model = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let block = KvCache::block_bytes(&model);
    let reqs = uneven(&tok);
    let (want, big) = Generator::new(model, config(None)).generate(&reqs).unwrap();
    assert_eq!(big.kv_preemptions, 0, "{big:?}");
    // The longest request needs 7 blocks alone; 12 cannot hold all six at once.
    let longest = reqs
        .iter()
        .map(|r| blocks_for((r.prompt.len() + r.params.max_new_tokens) as i64))
        .max()
        .unwrap() as usize;
    let budget = (longest + 5) * block;
    let mut small = Generator::new(small_model, config(Some(budget)));
    let (got, st) = small.generate(&reqs).unwrap();
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.tokens.len(), reqs[a.id as usize].params.max_new_tokens);
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-3, "request {}: {x} vs {y}", a.id);
        }
    }
    assert!(st.kv_preemptions > 0, "{st:?}");
    assert!(st.recomputed_positions > 0, "{st:?}");
    assert!(st.kv_bytes_held_peak <= budget, "{st:?}");
    assert_eq!(small.kv_bytes_held(), 0, "every block goes back");
    // One request alone larger than the budget: refused before anything runs.
    small.config_mut().kv_cache_bytes = Some(3 * block);
    let e = small.generate(&reqs[..1]).unwrap_err().to_string();
    assert!(e.contains("rollout.kv_cache_bytes"), "{e}");
}

/// The 16 samples of one prompt hold its full blocks once: the KV bytes held peak at
/// the live tokens rounded up to blocks (at most one block per sequence more than its
/// own tokens), where copies would hold the prompt 16 times.
#[test]
fn a_group_of_sixteen_holds_its_prompt_once() {
    let (model, tok) = setup();
    let block = KvCache::block_bytes(&model);
    let q = "Explain, step by step and with an example for each step, how a bicycle \
             turns the force of the rider's legs into forward motion, including the \
             chain, the gears, the wheels and the friction with the road.";
    let prompt = chat(&tok, q);
    let p = prompt.len() as i64;
    assert!(p > 64, "a prompt of several blocks ({p})");
    let new = 8usize;
    let reqs: Vec<Request> = (0..16)
        .map(|i| Request {
            id: i,
            prompt: prompt.clone(),
            params: SamplingParams {
                temperature: 1.0,
                max_new_tokens: new,
                ignore_eos: true,
                seed: i,
                ..Default::default()
            },
        })
        .collect();
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 16,
            max_seq_len: 256,
            ..Default::default()
        },
    );
    let (done, st) = g.generate(&reqs).unwrap();
    assert!(done.iter().all(|c| c.tokens.len() == new));
    // Live tokens rounded up to blocks: the prompt's full blocks once, and per sample
    // its own positions with its copy of the prompt's last, partial block (so at most
    // one block more per sample than its own tokens take).
    let own = p % KV_BLOCK + new as i64 - 1;
    let want = (p / KV_BLOCK + 16 * blocks_for(own)) as usize * block;
    assert_eq!(st.kv_bytes_held_peak, want, "{st:?}");
    assert!(blocks_for(own) <= blocks_for(new as i64 - 1) + 1);
    // A private cache per sample holds the prompt 16 times: more than twice as much.
    let copies = 16 * blocks_for(p + new as i64 - 1) as usize * block;
    assert!(st.kv_bytes_held_peak * 2 < copies, "{st:?}");
    assert_eq!(st.max_in_flight, 16);
}

/// At the bytes of a contiguous cache of 2 slots × 128 positions, admission by blocks
/// keeps more short sequences in flight than 2, with the same tokens.
#[test]
fn admission_by_blocks_runs_more_sequences_than_slots_of_max_len() {
    let (model, tok) = setup();
    let other = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let block = KvCache::block_bytes(&model);
    let budget = 2 * blocks_for(128) as usize * block;
    let reqs: Vec<Request> = uneven(&tok)
        .into_iter()
        .map(|mut r| {
            r.params.max_new_tokens = r.params.max_new_tokens.min(8);
            r
        })
        .collect();
    let (want, _) = Generator::new(model, config(None)).generate(&reqs).unwrap();
    let (got, st) = Generator::new(other, config(Some(budget)))
        .generate(&reqs)
        .unwrap();
    assert!(st.max_in_flight >= 4, "{st:?}");
    for (a, b) in got.iter().zip(&want) {
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
    }
}
