//! A step's gradients do not depend on how it is split into micro-batches (by samples
//! or by a token budget), nor on the chunked head, layer recompute or packed rows.

use super::micro::token_groups;
use super::*;
use crate::algo::loss::LossAgg;
use crate::builtin::scoring::score_samples;
use crate::sample::tests::sample;
use tch::{Device, Kind};
use yatt_engine::{tiny_config, Llama, RowLayout, TrainConfig};

/// 14 samples of 4 prompts (GRPO groups), long-tail response lengths, advantages of
/// both signs and some all zero.
pub(super) fn samples(model: &Llama) -> Vec<Sample> {
    let mut out: Vec<Sample> = (0..14u64)
        .map(|i| {
            let r = [1usize, 9, 3, 17, 2, 5, 4, 12, 1, 6, 2, 8, 3, 25][i as usize];
            let mut s = sample(i / 4, (i % 4) as u32, r);
            s.prompt_tokens = (0..3 + (i / 4) as i64 * 2)
                .map(|t| 3 + (t * 7 + i as i64) % 80)
                .collect();
            s.response_tokens = (0..r as i64)
                .map(|t| 2 + (t * 11 + i as i64 * 5) % 90)
                .collect();
            let a = [1.0, -0.5, 0.0, 0.7][i as usize % 4];
            s.advantages = Some(vec![a; r]);
            s
        })
        .collect();
    let rows = score_samples(model, &out, 0, 1.0, 8).unwrap();
    for (s, r) in out.iter_mut().zip(rows) {
        // Old log-probs a little off the current ones, so ratios are not all 1.
        s.old_logprobs = Some(r.iter().map(|x| x - 0.05).collect());
        s.rollout_logprobs = r;
    }
    out
}

fn grads(
    base: &Llama,
    cfg: PolicyConfig,
    memory: yatt_engine::MemoryOptions,
    batch: &[Sample],
) -> Tensor {
    let mut m = base.deep_copy(Device::Cpu, Kind::Float).unwrap();
    m.memory = memory;
    let mut p = PolicyRole::new(Trainer::new(m, TrainConfig::default()), cfg).unwrap();
    p.backward(batch).unwrap();
    let g = p.trainer.flat_grads().unwrap();
    Tensor::from_slice(&g)
}

#[test]
fn gradients_do_not_depend_on_the_split() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 21).unwrap();
    let batch = samples(&base);
    for (agg, entropy_coef) in [
        (LossAgg::TokenMean, 0.0),
        (LossAgg::SeqMeanTokenMean, 0.01),
        (LossAgg::SeqMeanTokenSumNorm { max_len: 25.0 }, 0.0),
    ] {
        let cfg = |micro: usize, tokens: usize| {
            let mut c = PolicyConfig {
                micro_batch_size: micro,
                max_tokens_per_micro_batch: tokens,
                entropy_coef,
                ..Default::default()
            };
            c.loss.agg = agg;
            c
        };
        let plain = yatt_engine::MemoryOptions::default();
        let whole = grads(&base, cfg(14, 0), plain, &batch);
        assert!(whole.abs().max().double_value(&[]) > 1e-6);
        let lean = yatt_engine::MemoryOptions {
            logprob_chunk_tokens: 7,
            activation_checkpointing: true,
            layout: RowLayout::Packed,
            ..Default::default()
        };
        for (what, cfg, memory) in [
            ("2 micro-batches", cfg(7, 0), plain),
            ("7 micro-batches", cfg(2, 0), plain),
            ("40-token micro-batches", cfg(14, 40), plain),
            ("7, chunked, recompute, packed", cfg(2, 0), lean),
        ] {
            let g = grads(&base, cfg, memory, &batch);
            let d = (&g - &whole).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{agg:?}, {what}: gradients differ by {d:e}");
        }
    }
}

#[test]
fn token_groups_balance_within_the_budget() {
    let lens = [30usize, 5, 12, 50, 7, 7, 22, 3, 90];
    let groups = token_groups(&lens, 60);
    let mut seen: Vec<usize> = groups.iter().flatten().copied().collect();
    seen.sort_unstable();
    assert_eq!(seen, (0..lens.len()).collect::<Vec<_>>());
    for g in &groups {
        let t: usize = g.iter().map(|&i| lens[i]).sum();
        assert!(t <= 60 || g.len() == 1, "{g:?} holds {t} tokens");
    }
    // 226 tokens need at least 4 micro-batches of 60; the lone 90 is one of them.
    assert!(groups.len() >= 4 && groups.len() <= 5, "{groups:?}");
}
