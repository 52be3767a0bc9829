//! The same bodies on every available device (CPU always, CUDA when present) and dtype.

use yatt_engine::score::token_logprobs;
use yatt_engine::tch::{self, Kind, Tensor};
use yatt_engine::*;

#[test]
fn generate_and_train_on_each_device_and_dtype() {
    tch::set_num_threads(2);
    yatt_engine::test_device!(|dev| {
        let reference = Llama::random(tiny_config(), dev, Kind::Float, 11).unwrap();
        let ids = Tensor::from_slice(&[0i64, 5, 6, 7, 8])
            .unsqueeze(0)
            .to_device(dev);
        let want = tch::no_grad(|| reference.forward(&ids, None));
        for kind in [Kind::Float, Kind::BFloat16, Kind::Half] {
            let model = reference.deep_copy(dev, kind).unwrap();
            assert_eq!(model.kind(), kind);
            let got = tch::no_grad(|| model.forward(&ids, None)).to_kind(Kind::Float);
            let tol = if kind == Kind::Float { 1e-5 } else { 5e-2 };
            let d = (&got - &want).abs().max().double_value(&[]);
            assert!(d < tol, "{kind:?} on {dev:?}: logits differ by {d}");
            let mut g = Generator::new(
                model,
                GeneratorConfig {
                    max_batch: 2,
                    max_seq_len: 32,
                    ..Default::default()
                },
            );
            let reqs: Vec<Request> = (0..3)
                .map(|i| Request {
                    id: i,
                    prompt: vec![0, 5, 6],
                    params: SamplingParams {
                        max_new_tokens: 6,
                        seed: i,
                        ignore_eos: true,
                        top_p: 0.9,
                        ..Default::default()
                    },
                })
                .collect();
            let (outs, _) = g.generate(&reqs).unwrap();
            assert!(outs.iter().all(|c| c.tokens.len() == 6));
            // A training step with f32 master weights for low-precision models.
            let model = reference.deep_copy(dev, kind).unwrap();
            let mut t = Trainer::new(
                model,
                TrainConfig {
                    lr: 1e-3,
                    ..Default::default()
                },
            );
            let b = SeqBatch::from_pairs(&[(&[0, 5, 6][..], &[7, 8, 9][..])], 1, dev).unwrap();
            let before = t.model.embed.to_kind(Kind::Float).copy();
            let s = t
                .step(&[b], |m, b| {
                    Ok(-token_logprobs(m, b, 1.0, false).logprobs.sum(Kind::Float))
                })
                .unwrap();
            assert!(s.loss.is_finite() && s.grad_norm > 0.0);
            assert!(
                t.model
                    .embed
                    .to_kind(Kind::Float)
                    .not_equal_tensor(&before)
                    .any()
                    .int64_value(&[])
                    == 1,
                "{kind:?}: weights moved"
            );
        }
    });
}

/// Decoding through CUDA graphs gives what eager decoding gives: the same tokens and
/// log-probs, with requests of different lengths (the active rows shrink), and after an
/// in-place weight update (the graphs read the new weights). On the CPU no graph is
/// recorded; on CUDA every decode step is replayed from one.
#[test]
fn decode_through_cuda_graphs_matches_eager_decoding() {
    tch::set_num_threads(2);
    // The project's bootstrap brings the CUDA wheel and the headers the shim needs, so
    // the shim is built and its embedded shared object loads, GPU or not.
    if std::env::var("YATT_ALLOW_NO_CUDA_GRAPHS").as_deref() != Ok("1") {
        assert!(
            cuda_graphs_built(),
            "built without CUDA graphs (see the build warnings of yatt-engine; YATT_ALLOW_NO_CUDA_GRAPHS=1 accepts that)"
        );
        load_cuda_graph_shim().expect("the CUDA-graph shim loads");
    }
    yatt_engine::test_device!(|dev| {
        let reference = Llama::random(tiny_config(), dev, Kind::Float, 12).unwrap();
        let bumped = Llama::random(tiny_config(), dev, Kind::Float, 13).unwrap();
        let reqs: Vec<Request> = (0..5u64)
            .map(|i| Request {
                id: i,
                prompt: (0..3 + i as i64).map(|t| 4 + t).collect(),
                params: SamplingParams {
                    // Greedy for some rows, seeded sampling for the others.
                    temperature: if i % 2 == 0 { 0.0 } else { 1.0 },
                    max_new_tokens: 4 + 9 * i as usize,
                    seed: i,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .collect();
        let run = |graphs: bool| {
            let mut g = Generator::new(
                reference.deep_copy(dev, Kind::Float).unwrap(),
                GeneratorConfig {
                    max_batch: 4,
                    max_seq_len: 96,
                    ..Default::default()
                },
            );
            g.set_cuda_graphs(graphs);
            let (first, _) = g.generate(&reqs).unwrap();
            let named = bumped.hf_named_tensors();
            g.update_weights(named.iter().map(|(n, t)| (n.as_str(), t)))
                .unwrap();
            let (second, _) = g.generate(&reqs).unwrap();
            let (recorded, replays, failure) = g.cuda_graph_stats();
            (
                first,
                second,
                recorded,
                replays,
                failure.map(str::to_string),
            )
        };
        let (eager1, eager2, r, _, _) = run(false);
        assert_eq!(r, 0, "graphs recorded while turned off");
        let (graph1, graph2, recorded, replays, failure) = run(true);
        if dev.is_cuda() && cuda_graphs_built() {
            assert_eq!(failure, None, "recording failed on {dev:?}");
            assert!(
                recorded > 0 && replays > 0,
                "{recorded} graphs, {replays} replays"
            );
        } else {
            assert_eq!((recorded, replays), (0, 0), "no graphs on {dev:?}");
        }
        for (eager, graph) in [(&eager1, &graph1), (&eager2, &graph2)] {
            for (e, g) in eager.iter().zip(graph.iter()) {
                assert_eq!(e.id, g.id);
                assert_eq!(e.tokens, g.tokens, "request {} on {dev:?}", e.id);
                let d = e
                    .logprobs
                    .iter()
                    .zip(&g.logprobs)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d < 1e-3, "request {}: log-probs differ by {d}", e.id);
            }
        }
        assert_ne!(
            eager1[1].tokens, eager2[1].tokens,
            "the weight update changed nothing"
        );
    });
}

/// The paged KV cache on every device, CUDA graphs on: a budget too small for the batch
/// preempts sequences and recomputes their prefix, and every sequence ends with the
/// tokens of a cache that holds them all, eager and without preemption (the block
/// tables change between steps while the graphs replay). A group's samples share their
/// prompt's blocks in both.
#[test]
fn a_paged_cache_under_a_small_budget_decodes_like_a_large_one() {
    tch::set_num_threads(2);
    yatt_engine::test_device!(|dev| {
        let reference = Llama::random(tiny_config(), dev, Kind::Float, 14).unwrap();
        let prompt: Vec<i64> = (0..20).map(|t| 2 + t * 3 % 90).collect();
        let reqs: Vec<Request> = (0..6u64)
            .map(|i| Request {
                id: i,
                prompt: if i < 4 {
                    prompt.clone()
                } else {
                    prompt[..7].to_vec()
                },
                params: SamplingParams {
                    temperature: if i % 3 == 0 { 0.0 } else { 1.0 },
                    max_new_tokens: [40, 3, 25, 60, 9, 33][i as usize],
                    seed: i,
                    ignore_eos: true,
                    ..Default::default()
                },
            })
            .collect();
        let block = KvCache::block_bytes(&reference);
        let run = |budget: Option<usize>, graphs: bool| {
            let mut g = Generator::new(
                reference.deep_copy(dev, Kind::Float).unwrap(),
                GeneratorConfig {
                    max_batch: 6,
                    max_seq_len: 96,
                    kv_cache_bytes: budget,
                    ..Default::default()
                },
            );
            g.set_cuda_graphs(graphs);
            let (done, st) = g.generate(&reqs).unwrap();
            (done, st, g.cuda_graph_stats().1)
        };
        let (want, big, _) = run(None, false);
        assert_eq!(big.kv_preemptions, 0);
        // The longest request needs 5 blocks alone.
        let (got, small, replays) = run(Some(8 * block), true);
        assert!(small.kv_preemptions > 0, "{dev:?}: {small:?}");
        assert!(small.kv_bytes_held_peak <= 8 * block);
        if dev.is_cuda() && cuda_graphs_built() {
            assert!(replays > 0, "{dev:?}: no step replayed a graph");
        }
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.tokens, b.tokens, "{dev:?}: request {}", a.id);
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!(
                    (x - y).abs() < 1e-3,
                    "{dev:?}: request {}: {x} vs {y}",
                    a.id
                );
            }
        }
    });
}
