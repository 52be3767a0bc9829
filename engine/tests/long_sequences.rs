//! Long sequences in bounded memory: the chunked LM head, layer recompute and packed
//! rows give what the plain computation gives, in f32.

use tch::{Device, Kind, Tensor};
use yatt_engine::score::{token_logprobs, token_logprobs_backward, SeqBatch, TokenScores};
use yatt_engine::{positions_from_mask, tiny_config, Architecture, Attn, Llama, SlidingWindow};

fn batch() -> SeqBatch {
    let seqs: Vec<Vec<i64>> = [(7usize, 11usize), (3, 2), (5, 9), (1, 4)]
        .iter()
        .enumerate()
        .map(|(i, &(p, r))| {
            (0..p + r)
                .map(|t| 2 + ((t * 13 + 7 * i) % 90) as i64)
                .collect()
        })
        .collect();
    let pairs: Vec<(&[i64], &[i64])> = seqs
        .iter()
        .zip([7usize, 3, 5, 1])
        .map(|(s, p)| (&s[..p], &s[p..]))
        .collect();
    SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap()
}

/// A loss that weighs every token and entropy differently, so each gradient matters.
fn loss(s: &TokenScores) -> Tensor {
    let w = Tensor::arange(s.logprobs.numel() as i64, (Kind::Float, Device::Cpu))
        .view(s.logprobs.size().as_slice())
        / 9.0
        - 2.0;
    (&s.logprobs * &w).sum(Kind::Float) + (&s.entropy * 0.3 * &w).sum(Kind::Float)
}

fn model(seed: i64) -> Llama {
    let mut m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, seed).unwrap();
    m.set_requires_grad(true);
    m
}

fn grads(m: &mut Llama) -> Vec<(String, Tensor)> {
    let out = m
        .parameters()
        .iter()
        .map(|(n, p)| (n.clone(), p.grad().copy()))
        .collect();
    for (_, p) in m.parameters_mut() {
        p.zero_grad();
    }
    out
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn same_grads(a: &[(String, Tensor)], b: &[(String, Tensor)], tol: f64) {
    assert_eq!(a.len(), b.len());
    for ((n, x), (_, y)) in a.iter().zip(b) {
        assert!(x.defined() && y.defined(), "{n}: no gradient");
        let d = max_diff(x, y);
        assert!(d < tol, "{n}: gradients differ by {d:e}");
    }
}

/// Chunked log-probs and entropies, and their gradients w.r.t. every parameter, equal
/// the unchunked ones (the whole `[tokens, vocab]` logits at once); no log-prob > 0.
#[test]
fn chunked_head_matches_the_whole_logits() {
    let mut m = model(11);
    let b = batch();
    let t = 0.7;
    m.memory.logprob_chunk_tokens = usize::MAX >> 1;
    let whole = token_logprobs(&m, &b, t, true);
    loss(&whole).backward();
    let g_whole = grads(&mut m);
    for chunk in [1usize, 5, 16] {
        m.memory.logprob_chunk_tokens = chunk;
        let part = tch::no_grad(|| token_logprobs(&m, &b, t, true));
        assert!(max_diff(&part.logprobs, &whole.logprobs) < 1e-5);
        assert!(max_diff(&part.entropy, &whole.entropy) < 1e-5);
        assert!(
            part.logprobs.max().double_value(&[]) <= 0.0,
            "a log-prob above 0"
        );
        let v = token_logprobs_backward(&m, &b, t, |s| Ok(loss(s))).unwrap();
        assert!((v - loss(&whole).double_value(&[])).abs() < 1e-4);
        same_grads(&grads(&mut m), &g_whole, 1e-5);
    }
}

/// Layer recompute gives the gradients of keeping every activation.
#[test]
fn layer_recompute_matches_kept_activations() {
    let mut m = model(12);
    let b = batch();
    m.memory.logprob_chunk_tokens = 8;
    token_logprobs_backward(&m, &b, 1.0, |s| Ok(loss(s))).unwrap();
    let plain = grads(&mut m);
    m.memory.activation_checkpointing = true;
    token_logprobs_backward(&m, &b, 1.0, |s| Ok(loss(s))).unwrap();
    same_grads(&grads(&mut m), &plain, 1e-6);
}

fn arch(a: Architecture) -> Llama {
    let mut c = tiny_config();
    c.architecture = a;
    match a {
        Architecture::Qwen2 => c.attention_bias = true,
        Architecture::Qwen3 => c.qk_norm = true,
        Architecture::Mistral => {
            c.sliding_window = Some(SlidingWindow {
                size: 4,
                layers: vec![true; c.num_hidden_layers as usize],
            })
        }
        Architecture::Llama => {}
    }
    Llama::random(c, Device::Cpu, Kind::Float, 13).unwrap()
}

/// Sequences packed into one row (positions restarting, attention confined to each)
/// score as they do right-padded, on the four architectures (Mistral with a window
/// shorter than the sequences).
#[test]
fn packed_rows_score_like_padded_ones() {
    let b = batch();
    for a in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Mistral,
    ] {
        let m = arch(a);
        tch::no_grad(|| {
            let pos = positions_from_mask(&b.ids, Some(&b.attention_mask));
            let padded = m.hidden(&b.ids, &pos, Attn::Full { mask: None });
            let t = b.ids.size()[1];
            let (mut ids, mut pos, mut at) =
                (Vec::<i64>::new(), Vec::<i64>::new(), Vec::<i64>::new());
            for (i, &l) in b.lens.iter().enumerate() {
                let row: Vec<i64> = Vec::try_from(b.ids.get(i as i64)).unwrap();
                ids.extend(&row[..l]);
                pos.extend(0..l as i64);
                at.extend((0..l as i64).map(|j| i as i64 * t + j));
            }
            let n = ids.len() as i64;
            let lens: Vec<i64> = b.lens.iter().map(|&l| l as i64).collect();
            let packed = m.hidden(
                &Tensor::from_slice(&ids).view([1, n]),
                &Tensor::from_slice(&pos).view([1, n]),
                Attn::Packed { lens: &lens },
            );
            let hidden = padded.size()[2];
            let want = padded
                .reshape([-1, hidden])
                .index_select(0, &Tensor::from_slice(&at));
            let got = packed.reshape([-1, hidden]);
            let lp = |h: &Tensor| m.logits(h).log_softmax(-1, Kind::Float);
            let d = max_diff(&lp(&got), &lp(&want));
            assert!(d < 1e-5, "{a:?}: packed log-probs differ by {d:e}");
        });
    }
}

/// Packed rows and layer recompute together train like padded rows.
#[test]
fn packed_recompute_gradients_match() {
    let mut m = model(14);
    m.memory.activation_checkpointing = true;
    let lens = [5i64, 9, 3];
    let ids: Vec<i64> = (0..17).map(|t| 2 + (t * 17 % 90)).collect();
    let pos: Vec<i64> = lens.iter().flat_map(|&l| 0..l).collect();
    let ids = Tensor::from_slice(&ids).view([1, 17]);
    let pos = Tensor::from_slice(&pos).view([1, 17]);
    let w = Tensor::arange(17, (Kind::Float, Device::Cpu)) / 5.0 - 1.0;
    let (h, tape) = m.hidden_recompute(&ids, &pos, Attn::Packed { lens: &lens });
    (m.logits(&h)
        .log_softmax(-1, Kind::Float)
        .select(2, 3)
        .reshape([-1])
        * &w)
        .sum(Kind::Float)
        .backward();
    tape.backward();
    let a = grads(&mut m);
    let h = m.hidden(&ids, &pos, Attn::Packed { lens: &lens });
    (m.logits(&h)
        .log_softmax(-1, Kind::Float)
        .select(2, 3)
        .reshape([-1])
        * &w)
        .sum(Kind::Float)
        .backward();
    same_grads(&a, &grads(&mut m), 1e-6);
}

/// The packed step of `packed_recompute_gradients_match` on `m`, through a tape when
/// the model has layer recompute on; returns every parameter's gradient.
fn packed_grads(m: &mut Llama, lens: &[i64]) -> Vec<(String, Tensor)> {
    let n: i64 = lens.iter().sum();
    let ids: Vec<i64> = (0..n).map(|t| 2 + (t * 17 % 90)).collect();
    let pos: Vec<i64> = lens.iter().flat_map(|&l| 0..l).collect();
    let ids = Tensor::from_slice(&ids).view([1, n]);
    let pos = Tensor::from_slice(&pos).view([1, n]);
    let w = Tensor::arange(n, (Kind::Float, Device::Cpu)) / 5.0 - 1.0;
    let loss = |h: &Tensor| {
        (m.logits(h)
            .log_softmax(-1, Kind::Float)
            .select(2, 3)
            .reshape([-1])
            * &w)
            .sum(Kind::Float)
    };
    if m.memory.activation_checkpointing {
        let (h, tape) = m.hidden_recompute(&ids, &pos, Attn::Packed { lens });
        loss(&h).backward();
        tape.backward();
    } else {
        loss(&m.hidden(&ids, &pos, Attn::Packed { lens })).backward();
    }
    grads(m)
}

/// Gradients equal to within f32 rounding of another summation order: 1e-6 of each
/// gradient's largest entry (the chunks' matmuls round their sums in another order, about
/// 1e-7 relative; the largest gradients here are ~40).
fn same_grads_to_scale(a: &[(String, Tensor)], b: &[(String, Tensor)], what: &str) {
    for ((n, x), (_, y)) in a.iter().zip(b) {
        let scale = y.abs().max().double_value(&[]).max(1.0);
        let d = max_diff(x, y);
        assert!(
            d < 1e-6 * scale,
            "{what}: {n} differs by {d:e} (scale {scale:.1})"
        );
    }
}

/// A recomputed layer runs part by part (runs of whole sequences or rows of at most
/// `recompute_chunk_tokens` tokens, a longer sequence alone) and its MLP in chunks of as
/// many tokens: gradients equal keeping every activation, packed on the four
/// architectures (windows and q/k norms cut per part) and padded, whatever the chunk;
/// bit for bit when the micro-batch fits in one part.
#[test]
fn recompute_in_parts_and_chunks_matches_kept_activations() {
    let lens = [5i64, 9, 3, 1, 6];
    for a in [
        Architecture::Llama,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Mistral,
    ] {
        let mut m = arch(a);
        m.set_requires_grad(true);
        let kept = packed_grads(&mut m, &lens);
        m.memory.activation_checkpointing = true;
        for chunk in [1usize, 4, 8, 15, 1024] {
            m.memory.recompute_chunk_tokens = chunk;
            let parts = packed_grads(&mut m, &lens);
            same_grads_to_scale(&parts, &kept, &format!("{a:?}, chunk {chunk}"));
            if chunk >= 24 {
                same_grads(&parts, &kept, 1e-12);
            }
        }
    }
    let mut m = model(15);
    let b = batch();
    m.memory.logprob_chunk_tokens = 5;
    token_logprobs_backward(&m, &b, 1.0, |s| Ok(loss(s))).unwrap();
    let kept = grads(&mut m);
    m.memory.activation_checkpointing = true;
    for chunk in [1usize, 7, 18, 40, 1024] {
        m.memory.recompute_chunk_tokens = chunk;
        token_logprobs_backward(&m, &b, 1.0, |s| Ok(loss(s))).unwrap();
        let g = grads(&mut m);
        same_grads_to_scale(&g, &kept, &format!("padded, chunk {chunk}"));
        if chunk >= 72 {
            same_grads(&g, &kept, 1e-12);
        }
    }
}
