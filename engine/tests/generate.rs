//! Generation on the real SmolLM2 model.

use std::sync::Arc;
use yatt_engine::fixtures::smollm2_hf_dir;
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

pub(crate) fn setup() -> (Llama, Arc<Tokenizer>) {
    tch::set_num_threads(2);
    let dir = smollm2_hf_dir().unwrap();
    (
        Llama::load(&dir, Device::Cpu, Kind::Float).unwrap(),
        Arc::new(Tokenizer::from_dir(&dir).unwrap()),
    )
}

pub(crate) fn chat(tok: &Tokenizer, q: &str) -> Vec<i64> {
    tok.encode_chat(&[ChatMessage::new("user", q)], true)
        .unwrap()
}

#[test]
fn greedy_with_cache_matches_full_recompute_and_batching() {
    let (model, tok) = setup();
    let prompts = [
        chat(&tok, "What is the capital of France?"),
        tok.encode("Once upon a time", true).unwrap(),
        chat(&tok, "List three colors."),
    ];
    // Reference: greedy by recomputing the full forward each step (no cache).
    let reference: Vec<Vec<i64>> = prompts
        .iter()
        .map(|p| {
            let mut seq = p.clone();
            let mut out = vec![];
            for _ in 0..12 {
                let ids = Tensor::from_slice(&seq).unsqueeze(0);
                let lg = tch::no_grad(|| model.forward(&ids, None));
                let t = lg
                    .get(0)
                    .get(seq.len() as i64 - 1)
                    .argmax(0, false)
                    .int64_value(&[]);
                out.push(t);
                seq.push(t);
                if t == 2 {
                    break;
                }
            }
            out
        })
        .collect();
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 2,
            max_seq_len: 128,
            ..Default::default()
        },
    )
    .with_tokenizer(tok.clone());
    let reqs: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: i as u64,
            prompt: p.clone(),
            params: SamplingParams::greedy(12),
        })
        .collect();
    let (outs, stats) = g.generate(&reqs).unwrap();
    for (i, c) in outs.iter().enumerate() {
        assert_eq!(
            c.tokens,
            reference[i],
            "request {i}: {:?}",
            tok.decode(&c.tokens, false)
        );
        assert_eq!(c.logprobs.len(), c.tokens.len());
        assert!(c.logprobs.iter().all(|&x| x <= 0.0 && x.is_finite()));
    }
    assert!(tok.decode(&outs[0].tokens, true).unwrap().contains("Paris"));
    assert!(stats.decode_steps > 0);
}

#[test]
fn seeds_reproduce_and_continuous_batching_streams() {
    let (model, tok) = setup();
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 3,
            max_seq_len: 160,
            ..Default::default()
        },
    )
    .with_tokenizer(tok.clone());
    let qs = [
        "Tell me a joke.",
        "What is 2+2?",
        "Describe the sea.",
        "Name a fruit.",
        "Say hi.",
        "Why is the sky blue?",
        "Count to five.",
    ];
    let reqs: Vec<Request> = qs
        .iter()
        .enumerate()
        .map(|(i, q)| Request {
            id: 100 + i as u64,
            prompt: chat(&tok, q),
            params: SamplingParams {
                temperature: 0.9,
                top_k: 40,
                top_p: 0.95,
                max_new_tokens: 4 + 6 * i,
                seed: i as u64,
                ..Default::default()
            },
        })
        .collect();
    let (tx, rx) = std::sync::mpsc::channel();
    let stats = g.generate_to_channel(&reqs, &tx).unwrap();
    drop(tx);
    let streamed: Vec<Completion> = rx.into_iter().collect();
    assert_eq!(streamed.len(), reqs.len());
    // Short requests finish (and stream) before long ones.
    let order: Vec<u64> = streamed.iter().map(|c| c.id).collect();
    let pos = |id: u64| order.iter().position(|&x| x == id).unwrap();
    assert!(pos(100) < pos(106), "{order:?}");
    for c in &streamed {
        let i = (c.id - 100) as usize;
        assert!(c.tokens.len() <= reqs[i].params.max_new_tokens);
        match &c.finish {
            FinishReason::Length => assert_eq!(c.tokens.len(), reqs[i].params.max_new_tokens),
            FinishReason::StopToken(t) => assert_eq!(c.tokens.last(), Some(t)),
            other => panic!("unexpected {other:?}"),
        }
    }
    // Same seeds, different batch size and order → same tokens.
    let mut g2 = Generator::new(
        Llama::load(smollm2_hf_dir().unwrap(), Device::Cpu, Kind::Float).unwrap(),
        GeneratorConfig {
            max_batch: 2,
            max_seq_len: 160,
            mode: BatchingMode::Static,
            ..Default::default()
        },
    );
    let mut rev = reqs.clone();
    rev.reverse();
    let (again, _) = g2.generate(&rev).unwrap();
    for c in again {
        let s = streamed.iter().find(|x| x.id == c.id).unwrap();
        assert_eq!(
            c.tokens, s.tokens,
            "request {} differs across batch layouts",
            c.id
        );
        for (a, b) in c.logprobs.iter().zip(&s.logprobs) {
            assert!((a - b).abs() < 1e-3);
        }
    }
    // Slot refill kept the batch busy.
    assert!(
        stats.slot_steps as f64 / stats.decode_steps as f64 > 1.5,
        "{stats:?}"
    );
}

/// GRPO-style batches (each prompt sampled several times, all sharing the chat template's
/// system prompt) give the same samples with and without prefix sharing, and sharing
/// prefills fewer positions.
#[test]
fn prefix_sharing_gives_the_same_samples() {
    let (model, tok) = setup();
    let plain_model = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let mut prompts: Vec<Vec<i64>> = ["Name a fruit.", "Why is the sky blue?", "What is 2+2?"]
        .iter()
        .map(|q| chat(&tok, q))
        .collect();
    prompts.push(tok.encode("Once upon a time", true).unwrap());
    let reqs: Vec<Request> = (0..12)
        .map(|i| Request {
            id: i as u64,
            prompt: prompts[i % prompts.len()].clone(),
            params: SamplingParams {
                temperature: 1.0,
                top_k: 50,
                max_new_tokens: 10,
                ignore_eos: true,
                seed: 7 + i as u64,
                ..Default::default()
            },
        })
        .collect();
    let config = |share| GeneratorConfig {
        max_batch: 8,
        max_seq_len: 96,
        share_prefixes: share,
        ..Default::default()
    };
    let (shared, s1) = Generator::new(model, config(true)).generate(&reqs).unwrap();
    let (plain, s2) = Generator::new(plain_model, config(false))
        .generate(&reqs)
        .unwrap();
    for (a, b) in shared.iter().zip(&plain) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.tokens, b.tokens, "request {}", a.id);
        for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
            assert!((x - y).abs() < 1e-3, "request {}: {x} vs {y}", a.id);
        }
    }
    // 12 requests, 4 distinct prompts: the repeats are not prefilled (the plain prompt
    // shares only BOS with the chat prompts, so no common prefix is split off here).
    assert!(
        s1.prefill_positions * 3 <= s2.prefill_positions * 2,
        "{s1:?} vs {s2:?}"
    );
}

#[test]
fn stop_strings_tokens_and_errors() {
    let (model, tok) = setup();
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 2,
            max_seq_len: 128,
            ..Default::default()
        },
    )
    .with_tokenizer(tok.clone());
    let p = chat(&tok, "What is the capital of France?");
    // Greedy says "The capital of France is Paris." — stop at "France".
    let r = Request {
        id: 1,
        prompt: p.clone(),
        params: SamplingParams {
            stop_strings: vec!["France".into()],
            ..SamplingParams::greedy(30)
        },
    };
    let r2 = Request {
        id: 2,
        prompt: p.clone(),
        params: SamplingParams {
            stop_token_ids: vec![tok.token_id("Ġcapital").unwrap()],
            ..SamplingParams::greedy(30)
        },
    };
    let r3 = Request {
        id: 3,
        prompt: p.clone(),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(20)
        },
    };
    let (outs, _) = g.generate(&[r, r2, r3]).unwrap();
    assert_eq!(outs[0].finish, FinishReason::StopString("France".into()));
    assert!(tok
        .decode(&outs[0].tokens, false)
        .unwrap()
        .ends_with("France"));
    assert_eq!(
        outs[1].finish,
        FinishReason::StopToken(tok.token_id("Ġcapital").unwrap())
    );
    assert_eq!(outs[1].tokens.len(), 2);
    assert_eq!(outs[2].finish, FinishReason::Length);
    assert_eq!(outs[2].tokens.len(), 20);
    // Bad input is a clear error.
    let e = g
        .generate(&[Request {
            id: 9,
            prompt: vec![],
            params: Default::default(),
        }])
        .unwrap_err();
    assert!(e.to_string().contains("empty prompt"), "{e}");
    let e = g
        .generate(&[Request {
            id: 9,
            prompt: p.clone(),
            params: SamplingParams::greedy(1000),
        }])
        .unwrap_err();
    assert!(e.to_string().contains("max_seq_len"), "{e}");
}

#[test]
fn weights_replaced_in_place_without_reallocating_cache() {
    let (model, tok) = setup();
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 2,
            max_seq_len: 64,
            ..Default::default()
        },
    );
    let req = vec![Request {
        id: 0,
        prompt: chat(&tok, "Say something."),
        params: SamplingParams::greedy(8),
    }];
    let (a, _) = g.generate(&req).unwrap();
    let cache = g.cache_ptr().unwrap();
    let named = g.model().hf_named_tensors();
    let (name, t) = named
        .iter()
        .find(|(n, _)| n == "model.layers.3.mlp.down_proj.weight")
        .unwrap();
    let w_ptr = t.data_ptr();
    let original = t.copy();
    let perturbed = &original * 0.0;
    g.update_weights([(name.as_str(), &perturbed)]).unwrap();
    assert_eq!(
        g.model()
            .hf_named_tensors()
            .iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1
            .data_ptr(),
        w_ptr
    );
    let (b, _) = g.generate(&req).unwrap();
    assert_ne!(
        a[0].tokens, b[0].tokens,
        "zeroing a layer should change the output"
    );
    g.update_weights([(name.as_str(), &original)]).unwrap();
    let (c, _) = g.generate(&req).unwrap();
    assert_eq!(a[0].tokens, c[0].tokens);
    assert_eq!(
        g.cache_ptr().unwrap(),
        cache,
        "the KV cache must not be reallocated"
    );
    let e = g.update_weights([("nope", &original)]).unwrap_err();
    assert!(e.to_string().contains("nope"));
}

/// Three conversations over three turns, two cache slots (so sequences move between
/// slots as others finish): continuing each turn from the kept KV samples the tokens
/// of a full prefill, and prefills little more than what the turn appended (the last
/// sampled token and the observation).
#[test]
fn continuing_kept_sequences_prefills_little_more_than_each_turn_appends() {
    let (model, tok) = setup();
    let plain_model = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let config = GeneratorConfig {
        max_batch: 2,
        max_seq_len: 192,
        ..Default::default()
    };
    let mut kept = Generator::new(model, config.clone());
    let mut plain = Generator::new(plain_model, config);
    let mut convs: Vec<Vec<i64>> = ["Name a fruit.", "Why is the sky blue?", "What is 2+2?"]
        .iter()
        .map(|q| chat(&tok, q))
        .collect();
    let observation = tok
        .encode(
            "<|im_end|>\n<|im_start|>user\nAnd then?<|im_end|>\n<|im_start|>assistant\n",
            false,
        )
        .unwrap();
    let keys: Vec<Option<u64>> = (0..3).map(|i| Some(100 + i)).collect();
    for turn in 0..3u64 {
        let reqs: Vec<Request> = convs
            .iter()
            .enumerate()
            .map(|(i, c)| Request {
                id: i as u64,
                prompt: c.clone(),
                params: SamplingParams {
                    temperature: 1.0,
                    top_k: 50,
                    max_new_tokens: 8,
                    ignore_eos: true,
                    seed: 11 + i as u64 + 100 * turn,
                    ..Default::default()
                },
            })
            .collect();
        let mut got = Vec::new();
        let s = kept
            .generate_continuing(&reqs, &keys, true, |c| got.push(c))
            .unwrap();
        got.sort_by_key(|c| c.id);
        let (want, _) = plain.generate(&reqs).unwrap();
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.tokens, b.tokens, "turn {turn}, conversation {}", a.id);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-3, "turn {turn}: {x} vs {y}");
            }
        }
        let appended = 1 + observation.len();
        if turn == 0 {
            assert_eq!(s.reused_positions, 0);
        } else {
            // Kept: each conversation but what the turn appended. Conversations 0 and 1
            // are admitted together and prefilled in one call from the shorter's kept
            // length; 2 comes alone once a slot frees.
            let kept_len: Vec<usize> = convs.iter().map(|c| c.len() - appended).collect();
            let reused = 2 * kept_len[0].min(kept_len[1]) + kept_len[2];
            let total: usize = convs.iter().map(Vec::len).sum();
            assert_eq!(s.reused_positions, reused, "turn {turn}: {s:?}");
            assert_eq!(s.prefill_positions, total - reused, "turn {turn}: {s:?}");
        }
        assert_eq!(kept.kept_len(), 3);
        for (c, done) in convs.iter_mut().zip(&got) {
            c.extend_from_slice(&done.tokens);
            c.extend_from_slice(&observation);
        }
    }
    // A prompt that shares only a prefix with what was kept reuses that prefix.
    let mut other = convs[0].clone();
    let cut = other.len() - 20;
    other.truncate(cut);
    other.extend(tok.encode(" Something else entirely.", false).unwrap());
    let req = Request {
        id: 0,
        prompt: other,
        params: SamplingParams::greedy(4),
    };
    let s = kept
        .generate_continuing(std::slice::from_ref(&req), &[Some(100)], true, |_| {})
        .unwrap();
    // What was kept: the conversation but its last sampled token and the observation.
    let kept_tokens = &convs[0][..convs[0].len() - 1 - observation.len()];
    let common = kept_tokens
        .iter()
        .zip(&req.prompt)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(common >= cut);
    assert_eq!(s.reused_positions, common, "{s:?}");
    assert_eq!(s.prefill_positions, req.prompt.len() - common, "{s:?}");
    // New weights (any mutable access to the model) drop what was kept, and so does a
    // budget of 0 bytes.
    let _ = kept.model_mut();
    assert_eq!(kept.kept_len(), 0);
    kept.set_kept_kv_bytes(0);
    kept.generate_continuing(std::slice::from_ref(&req), &[Some(7)], true, |_| {})
        .unwrap();
    assert_eq!(kept.kept_len(), 0);
    // One key per request, or none.
    let err = kept
        .generate_continuing(std::slice::from_ref(&req), &[None, None], true, |_| {})
        .unwrap_err();
    assert!(err.to_string().contains("2 keys for 1 requests"), "{err}");
}
