//! Generation on the real SmolLM2 model.

use std::sync::Arc;
use yatt_engine::fixtures::smollm2_hf_dir;
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

fn setup() -> (Llama, Arc<Tokenizer>) {
    tch::set_num_threads(2);
    let dir = smollm2_hf_dir().unwrap();
    (
        Llama::load(&dir, Device::Cpu, Kind::Float).unwrap(),
        Arc::new(Tokenizer::from_dir(&dir).unwrap()),
    )
}

fn chat(tok: &Tokenizer, q: &str) -> Vec<i64> {
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
