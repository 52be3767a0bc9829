//! The decoder's numerical checks: packed and fused paths against plain tch operations,
//! prefix-shared prefill against a plain one, adopted weights against their source.

use super::attention::Attn;
use super::kv_cache::KvCache;
use super::llama::Llama;
use tch::{Device, Kind, Tensor};

/// A tiny random model and an unpacked copy. `wide`: SmolLM's head layout (head_dim
/// 64, three query heads per kv head), which the decode kernel has a fixed-size path
/// for; otherwise head_dim 16, two per kv head (its generic path).
fn tiny(bias: bool, wide: bool) -> (Llama, Llama) {
    let mut cfg = crate::config::tiny_config();
    cfg.attention_bias = bias;
    if wide {
        cfg.hidden_size = 384;
        cfg.num_attention_heads = 6;
        cfg.num_key_value_heads = 2;
        cfg.head_dim = 64;
    }
    let a = Llama::random(cfg, Device::Cpu, Kind::Float, 3).unwrap();
    let b = a.deep_copy(Device::Cpu, Kind::Float).unwrap();
    (a, b)
}

fn prompt_batch(prompts: &[Vec<i64>]) -> (Tensor, Tensor, Vec<i64>) {
    let n = prompts.len() as i64;
    let t = prompts.iter().map(|p| p.len()).max().unwrap() as i64;
    let mut ids = vec![0i64; (n * t) as usize];
    for (i, p) in prompts.iter().enumerate() {
        ids[i * t as usize..i * t as usize + p.len()].copy_from_slice(p);
    }
    let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([n, t], true);
    let lens = prompts.iter().map(|p| p.len() as i64).collect();
    (Tensor::from_slice(&ids).view([n, t]), pos, lens)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// A packed inference model that adopts a trainer's snapshot computes what the
/// trainer does, shares the snapshot's storage (no copy), repacks, and is not
/// touched when the trainer trains on; a bad snapshot is refused with the name and
/// leaves the weights as they were.
#[test]
fn adopting_a_snapshot_shares_it_and_computes_like_the_source() {
    let (mut trainer, mut rollout) = tiny(false, false);
    let other = Llama::random(trainer.config.clone(), Device::Cpu, Kind::Float, 9).unwrap();
    trainer
        .copy_weights_from(
            other
                .hf_named_tensors()
                .iter()
                .map(|(n, t)| (n.as_str(), t)),
        )
        .unwrap();
    let packed = rollout.pack_for_inference(16);
    let ids = Tensor::from_slice(&[5i64, 17, 3, 9, 41, 2]).view([2, 3]);
    let want = tch::no_grad(|| trainer.forward(&ids, None));
    let snap = trainer.weights_snapshot();
    assert_eq!(rollout.adopt_weights(&snap).unwrap(), snap.len());
    assert_eq!(rollout.is_packed(), packed);
    let got = tch::no_grad(|| rollout.forward(&ids, None));
    assert!(max_diff(&want, &got) < 1e-5, "{}", max_diff(&want, &got));
    let (name, shared) = &snap[0];
    let mine = rollout
        .parameters()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap()
        .1;
    assert_eq!(mine.data_ptr(), shared.data_ptr(), "`{name}` was copied");
    // The first pass after an adopt may round differently in the last bit (on AVX2-only
    // CPUs oneDNN's first call takes another path); the passes after it agree exactly.
    let settled = tch::no_grad(|| rollout.forward(&ids, None));
    // The trainer's own tensors are not the snapshot: training on leaves it alone.
    tch::no_grad(|| {
        for (_, t) in trainer.parameters_mut() {
            let _ = t.g_add_scalar_(1.0);
        }
    });
    let after = tch::no_grad(|| rollout.forward(&ids, None));
    assert!(max_diff(&settled, &after) == 0.0);
    // A snapshot missing a tensor, or with one of another shape, is refused whole.
    let before = rollout.parameters();
    let mut short = trainer.weights_snapshot();
    let (missing, _) = short.pop().unwrap();
    let e = rollout.adopt_weights(&short).unwrap_err().to_string();
    assert!(e.contains(&missing), "{e}");
    let mut bad = trainer.weights_snapshot();
    bad[0].1 = Tensor::zeros([3], (Kind::Float, Device::Cpu));
    let e = rollout.adopt_weights(&bad).unwrap_err().to_string();
    assert!(e.contains(&bad[0].0) && e.contains("shape"), "{e}");
    for ((n, x), (_, y)) in before.iter().zip(rollout.parameters()) {
        assert_eq!(
            x.data_ptr(),
            y.data_ptr(),
            "`{n}` changed after a refused snapshot"
        );
    }
    // A model that trains cannot adopt shared weights.
    trainer.set_requires_grad(true);
    let e = trainer.adopt_weights(&snap).unwrap_err().to_string();
    assert!(e.contains("requires gradients"), "{e}");
}

/// The fused CPU decode step (packed weights) and the tch path agree on hidden states
/// and on what they write into the cache, with rows at different positions. Row 3
/// repeats row 2's prompt and, in the fused cache, holds row 2's blocks instead of its
/// own (a shared prompt): the full block is read where row 2 has it, the partial one is
/// copied when either writes into it, so a wrong read or a write into the shared block
/// would show.
#[test]
fn fused_decode_matches_tch_ops() {
    if !crate::onednn::available() {
        return;
    }
    for (bias, wide) in [(false, false), (true, false), (false, true)] {
        let (mut fused, plain) = tiny(bias, wide);
        let hidden = fused.config.hidden_size;
        assert!(fused.pack_for_inference(4));
        // Lengths around the 16-position key blocks; decoding crosses a boundary.
        let mut prompts: Vec<Vec<i64>> = [14i64, 2, 17]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 7 + n) % 90 + 2).collect())
            .collect();
        prompts.push(prompts[2].clone());
        let (ids, pos, lens) = prompt_batch(&prompts);
        let mut ca = KvCache::new(&fused, 4, 40);
        let mut cb = KvCache::new(&plain, 4, 40);
        tch::no_grad(|| {
            for (m, c) in [(&fused, &mut ca), (&plain, &mut cb)] {
                let _ = m.hidden(
                    &ids,
                    &pos,
                    Attn::Prefill {
                        cache: c,
                        start: 0,
                        offset: 0,
                        lens: None,
                    },
                );
            }
            let before = ca.held_blocks();
            ca.copy_slots(&[2], &[3], lens[2]);
            assert_eq!(
                ca.held_blocks(),
                before - 2,
                "row 3's two blocks are shared"
            );
            let mut p = lens.clone();
            for step in 0..4 {
                let tok =
                    Tensor::from_slice(&[20 + step, 30 + step, 40 + step, 50 + step]).view([4, 1]);
                let pt = Tensor::from_slice(&p).view([4, 1]);
                let span = p.iter().max().unwrap() + 1;
                let ha = fused.hidden(
                    &tok,
                    &pt,
                    Attn::Decode {
                        cache: &mut ca,
                        span,
                        table: None,
                    },
                );
                let hb = plain.hidden(
                    &tok,
                    &pt,
                    Attn::Decode {
                        cache: &mut cb,
                        span,
                        table: None,
                    },
                );
                assert_eq!(ha.size(), vec![4, 1, hidden]);
                let d = max_diff(&ha, &hb);
                assert!(
                    d < 1e-4,
                    "{bias} {wide}, step {step}: hidden differs by {d}"
                );
                p.iter_mut().for_each(|x| *x += 1);
            }
            for (i, &l) in p.iter().enumerate() {
                let i = i as i64;
                let from = 0;
                for layer in 0..2 {
                    let (ka, kb) = (ca.keys(layer, i, 1, l), cb.keys(layer, i, 1, l));
                    let (va, vb) = (ca.values(layer, i, 1, l), cb.values(layer, i, 1, l));
                    let n = l - from;
                    assert!(max_diff(&ka.narrow(2, from, n), &kb.narrow(2, from, n)) < 1e-5);
                    assert!(max_diff(&va.narrow(2, from, n), &vb.narrow(2, from, n)) < 1e-5);
                }
            }
        });
    }
}

/// Prefilling a shared prefix once, copying it, and prefilling the rest at an offset
/// gives the states and cache of a plain prefill.
#[test]
fn prefill_at_offset_after_a_shared_prefix_matches_a_plain_prefill() {
    let (model, _) = tiny(false, false);
    let prefix = vec![3i64, 4, 5, 6, 7];
    let prompts: Vec<Vec<i64>> = [vec![8i64, 9, 10], vec![11], vec![12, 13]]
        .iter()
        .map(|s| [prefix.clone(), s.clone()].concat())
        .collect();
    let (ids, pos, lens) = prompt_batch(&prompts);
    tch::no_grad(|| {
        let mut plain = KvCache::new(&model, 3, 16);
        let h_plain = model.hidden(
            &ids,
            &pos,
            Attn::Prefill {
                cache: &mut plain,
                start: 0,
                offset: 0,
                lens: None,
            },
        );
        let mut shared = KvCache::new(&model, 4, 16);
        let p = prefix.len() as i64;
        // Slots 1..4, so the copy source is not slot 0.
        let _ = model.hidden(
            &Tensor::from_slice(&prefix).view([1, p]),
            &Tensor::arange(p, (Kind::Int64, Device::Cpu)).unsqueeze(0),
            Attn::Prefill {
                cache: &mut shared,
                start: 1,
                offset: 0,
                lens: None,
            },
        );
        shared.copy_slots(&[1, 1], &[2, 3], p);
        let rest = ids.narrow(1, p, ids.size()[1] - p);
        let rpos = pos.narrow(1, p, ids.size()[1] - p);
        // Ragged: the padding of the shorter rows is skipped.
        let rest_lens: Vec<i64> = lens.iter().map(|l| l - p).collect();
        let h = model.hidden(
            &rest,
            &rpos,
            Attn::Prefill {
                cache: &mut shared,
                start: 1,
                offset: p,
                lens: Some(&rest_lens),
            },
        );
        for (i, &l) in lens.iter().enumerate() {
            let want = h_plain.get(i as i64).narrow(0, 0, l);
            let got = h.get(i as i64).narrow(0, 0, l - p);
            let d = max_diff(&want.narrow(0, p, l - p), &got);
            assert!(d < 1e-5, "prompt {i}: hidden differs by {d}");
            for layer in 0..2 {
                let (a, b) = (i as i64, i as i64 + 1);
                let (ka, kb) = (plain.keys(layer, a, 1, l), shared.keys(layer, b, 1, l));
                let (va, vb) = (plain.values(layer, a, 1, l), shared.values(layer, b, 1, l));
                assert!(max_diff(&ka, &kb) < 1e-5);
                assert!(max_diff(&va, &vb) < 1e-5);
            }
        }
    });
}

/// Attention reads through the block tables: a cache that hands out its blocks in
/// reverse order gives what one handing them out in order gives, through prefill, a
/// shared prompt and decode steps that cross a 16-position block (the tch path); and the
/// decode attention of grouped queries equals attention over keys and values repeated
/// for every query head (the GQA definition).
#[test]
fn paged_reads_follow_the_tables_and_grouped_decode_attention_is_gqa() {
    for wide in [false, true] {
        let (model, _) = tiny(false, wide);
        let prompts: Vec<Vec<i64>> = [14i64, 2, 17]
            .iter()
            .map(|&n| (0..n).map(|i| (i * 5 + n) % 90 + 2).collect())
            .collect();
        let (ids, pos, lens) = prompt_batch(&prompts);
        tch::no_grad(|| {
            let mut caches = [KvCache::new(&model, 4, 40), KvCache::new(&model, 4, 40)];
            // Every block taken and returned in table order: the free list now hands
            // them out from the highest down.
            assert!(caches[1].reserve(0, 0, 4 * 48));
            caches[1].release(0);
            for c in caches.iter_mut() {
                let _ = model.hidden(
                    &ids,
                    &pos,
                    Attn::Prefill {
                        cache: c,
                        start: 0,
                        offset: 0,
                        lens: Some(&lens),
                    },
                );
                // Row 3 continues row 2's prompt from a copy.
                c.copy_slots(&[2], &[3], lens[2]);
            }
            let mut p: Vec<i64> = lens.iter().copied().chain([lens[2]]).collect();
            for step in 0..4 {
                let tok =
                    Tensor::from_slice(&[20 + step, 30 + step, 40 + step, 50 + step]).view([4, 1]);
                let pt = Tensor::from_slice(&p).view([4, 1]);
                let span = p.iter().max().unwrap() + 1;
                let [blocked, dense] = &mut caches;
                let hb = model.hidden(
                    &tok,
                    &pt,
                    Attn::Decode {
                        cache: blocked,
                        span,
                        table: None,
                    },
                );
                let hd = model.hidden(
                    &tok,
                    &pt,
                    Attn::Decode {
                        cache: dense,
                        span,
                        table: None,
                    },
                );
                let d = max_diff(&hb, &hd);
                assert!(d < 1e-5, "wide {wide}, step {step}: hidden differs by {d}");
                p.iter_mut().for_each(|x| *x += 1);
            }
            for (i, &l) in p.iter().enumerate() {
                let [blocked, dense] = &caches;
                let i = i as i64;
                let k = (blocked.keys(1, i, 1, l), dense.keys(1, i, 1, l));
                assert!(max_diff(&k.0, &k.1) < 1e-6, "row {i}: keys differ");
            }
        });
        // Grouped decode attention against the repeated heads.
        let c = &model.config;
        let (nh, nkv, hd, b, s) = (
            c.num_attention_heads,
            c.num_key_value_heads,
            c.head_dim,
            3,
            21,
        );
        let opts = (Kind::Float, Device::Cpu);
        let q = Tensor::randn([b, nh, 1, hd], opts);
        let k = Tensor::randn([b, nkv, s, hd], opts);
        let v = Tensor::randn([b, nkv, s, hd], opts);
        let lens = Tensor::from_slice(&[5i64, 21, 12]).reshape([b, 1, 1, 1]);
        let mask = Tensor::arange(s, (Kind::Int64, Device::Cpu))
            .reshape([1, 1, 1, s])
            .lt_tensor(&lens);
        let g = nh / nkv;
        let want = super::attention::attend(
            &q,
            &k.repeat_interleave_self_int(g, 1, None),
            &v.repeat_interleave_self_int(g, 1, None),
            Some(&mask),
        );
        let got = super::attention::attend_decode(&q, &k, &v, &mask);
        let d = max_diff(&want, &got);
        assert!(
            d < 1e-5,
            "wide {wide}: grouped decode attention differs by {d}"
        );
    }
}
