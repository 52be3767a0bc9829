//! Measurements for issue 49 on SmolLM2-135M (ignored: they need the imported model at
//! `models/smollm2-135m` and take minutes):
//!   OMP_WAIT_POLICY=PASSIVE cargo nextest run --release -p yatt-engine long_bench \
//!     --run-ignored only --no-capture
//! - packed against padded rows, tokens/s of a training forward+backward on a long-tail
//!   mix of lengths;
//! - the chunked LM head against the whole logits on a short batch.

use std::time::Instant;
use tch::{Device, Kind, Tensor};
use yatt_engine::score::{
    chunked_backward, token_logprobs, token_logprobs_backward, HeadInput, SeqBatch,
};
use yatt_engine::{Attn, Llama};

fn smollm2() -> Option<Llama> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m");
    let mut m = Llama::load(&dir, Device::Cpu, Kind::Float).ok()?;
    m.set_requires_grad(true);
    Some(m)
}

fn seqs(lens: &[usize]) -> Vec<Vec<i64>> {
    lens.iter()
        .enumerate()
        .map(|(i, &l)| {
            (0..l)
                .map(|t| 100 + ((t * 31 + i * 7) % 20000) as i64)
                .collect()
        })
        .collect()
}

fn zero(m: &mut Llama) {
    for (_, p) in m.parameters_mut() {
        p.zero_grad();
    }
}

/// One training forward + backward of `mb` packed into one row: layer recompute (when
/// the model has it on) and the chunked LM head (1,024 rows a chunk), the loss the sum
/// of the log-probs of every token after the first of each sequence. Returns the peak
/// resident memory (`VmHWM`, kB) when the decoder's forward pass was done.
fn packed_step(m: &Llama, mb: &[Vec<i64>]) -> u64 {
    let ids: Vec<i64> = mb.iter().flatten().copied().collect();
    let pos: Vec<i64> = mb.iter().flat_map(|s| 0..s.len() as i64).collect();
    let seg: Vec<i64> = mb.iter().map(|s| s.len() as i64).collect();
    let n = ids.len() as i64;
    let ids_t = Tensor::from_slice(&ids).view([1, n]);
    let pos_t = Tensor::from_slice(&pos).view([1, n]);
    let attn = Attn::Packed { lens: &seg };
    // Row i predicts token i+1 within its sequence.
    let mut at = Vec::new();
    let mut start = 0i64;
    for &l in &seg {
        at.extend(start..start + l - 1);
        start += l;
    }
    let at = Tensor::from_slice(&at);
    let targets = ids_t.view([n]).index_select(0, &(&at + 1));
    let (rows, tapes) = if m.memory.activation_checkpointing {
        let (h, tape) = m.hidden_recompute(&ids_t, &pos_t, attn);
        (h.view([n, -1]).index_select(0, &at), vec![tape])
    } else {
        let h = m.hidden(&ids_t, &pos_t, attn);
        (h.view([n, -1]).index_select(0, &at), vec![])
    };
    let forward_peak = status_kb("VmHWM");
    let input = HeadInput {
        rows,
        targets,
        tapes,
    };
    let _ = chunked_backward(m, input, 1.0, 1024, |lp, _| Ok(lp.sum(Kind::Float))).unwrap();
    forward_peak
}

/// A long-tail mix (most short, a few long, capped at 2,048), in micro-batches of 8.
#[test]
#[ignore]
fn packed_against_padded_on_a_long_tail() {
    let Some(mut m) = smollm2() else { return };
    m.memory.activation_checkpointing = true;
    // Deterministic long tail: lengths ~ 2^(6 + 5u^3), u uniform, capped at
    // YATT_LONG_TAIL_CAP (2,048); YATT_LONG_TAIL_N sequences (16).
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(d)
    };
    let (n, cap) = (env("YATT_LONG_TAIL_N", 16), env("YATT_LONG_TAIL_CAP", 2048));
    let lens: Vec<usize> = (0..n)
        .map(|i| {
            let u = ((i * 37 + 11) % n) as f64 / (n - 1).max(1) as f64;
            (2f64.powf(6.0 + 5.0 * u.powi(3)) as usize).min(cap)
        })
        .collect();
    let real: usize = lens.iter().sum();
    let all = seqs(&lens);
    let (mut padded_s, mut packed_s) = (0.0, 0.0);
    for mb in all.chunks(8) {
        let pairs: Vec<(&[i64], &[i64])> = mb.iter().map(|s| (&s[..1], &s[1..])).collect();
        let b = SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap();
        let t0 = Instant::now();
        token_logprobs_backward(&m, &b, 1.0, |s| Ok(s.logprobs.sum(Kind::Float))).unwrap();
        padded_s += t0.elapsed().as_secs_f64();
        zero(&mut m);
        let t0 = Instant::now();
        let _ = packed_step(&m, mb);
        packed_s += t0.elapsed().as_secs_f64();
        zero(&mut m);
    }
    let padded_tokens: usize = all
        .chunks(8)
        .map(|mb| mb.len() * mb.iter().map(Vec::len).max().unwrap())
        .sum();
    println!(
        "long tail {lens:?}: {real} real tokens ({padded_tokens} padded); padded {:.0} tok/s ({padded_s:.1} s), packed {:.0} tok/s ({packed_s:.1} s), {:.2}x",
        real as f64 / padded_s,
        real as f64 / packed_s,
        padded_s / packed_s
    );
}

/// A short job's batch (16 × 60 tokens): the chunked head's training pass against the
/// whole logits'.
#[test]
#[ignore]
fn chunked_head_on_a_short_batch() {
    let Some(mut m) = smollm2() else { return };
    let all = seqs(&[60; 16]);
    let pairs: Vec<(&[i64], &[i64])> = all.iter().map(|s| (&s[..45], &s[45..])).collect();
    let b = SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap();
    let (mut whole, mut chunked) = (f64::MAX, f64::MAX);
    for _ in 0..3 {
        m.memory.logprob_chunk_tokens = usize::MAX >> 1;
        let t0 = Instant::now();
        token_logprobs(&m, &b, 0.7, true)
            .logprobs
            .sum(Kind::Float)
            .backward();
        whole = whole.min(t0.elapsed().as_secs_f64());
        zero(&mut m);
        m.memory.logprob_chunk_tokens = 1024;
        let t0 = Instant::now();
        token_logprobs_backward(&m, &b, 0.7, |s| Ok(s.logprobs.sum(Kind::Float))).unwrap();
        chunked = chunked.min(t0.elapsed().as_secs_f64());
        zero(&mut m);
    }
    println!(
        "short batch 16x60: whole logits {whole:.3} s, chunked head {chunked:.3} s, ratio {:.3}",
        chunked / whole
    );
}

/// A field of `/proc/self/status` in kB (`VmHWM`: the peak resident memory since the
/// process started or since [`reset_peak`]; `VmRSS`: resident now).
fn status_kb(field: &str) -> u64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

/// Starts a new peak: writing 5 to `clear_refs` resets `VmHWM` to the current RSS.
fn reset_peak() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

fn env_or<T: std::str::FromStr>(key: &str, default: T) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Peak resident memory of one training step (forward + backward, chunked head, layer
/// recompute) against tokens per micro-batch, in one process, smallest first (issue
/// 49). Knobs: `YATT_STEP_TOKENS` (1024,2048,4096,8192,16384), `YATT_STEP_SEQS` (8
/// sequences a micro-batch, of equal length), `YATT_STEP_LAYOUT` (packed | padded),
/// `YATT_STEP_RECOMPUTE` (1).
#[test]
#[ignore]
fn peak_memory_per_trained_token() {
    let Some(mut m) = smollm2() else { return };
    m.memory.activation_checkpointing = env_or("YATT_STEP_RECOMPUTE", 1) == 1;
    let padded = std::env::var("YATT_STEP_LAYOUT").is_ok_and(|v| v == "padded");
    let sizes: Vec<usize> = std::env::var("YATT_STEP_TOKENS")
        .unwrap_or_else(|_| "1024,2048,4096,8192,16384".into())
        .split(',')
        .filter_map(|v| v.trim().parse().ok())
        .collect();
    let per_mb = env_or("YATT_STEP_SEQS", 8usize);
    // Returns the peak at the end of the decoder's forward pass (packed rows only).
    let step = |m: &Llama, mb: &[Vec<i64>]| {
        if padded {
            let pairs: Vec<(&[i64], &[i64])> = mb.iter().map(|s| (&s[..1], &s[1..])).collect();
            let b = SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap();
            token_logprobs_backward(m, &b, 1.0, |s| Ok(s.logprobs.sum(Kind::Float))).unwrap();
            0
        } else {
            packed_step(m, mb)
        }
    };
    // A short step first, so that the gradients (the model's size, allocated by the
    // first backward) are in the baseline.
    let _ = step(&m, &seqs(&[16; 2]));
    zero(&mut m);
    println!(
        "step-memory layout={} recompute={} seqs={per_mb} baseline_rss_kb={}",
        if padded { "padded" } else { "packed" },
        m.memory.activation_checkpointing,
        status_kb("VmRSS")
    );
    let mut first: Option<(usize, u64)> = None;
    for tokens in sizes {
        let mb = seqs(&vec![tokens / per_mb; per_mb]);
        let before = status_kb("VmRSS");
        reset_peak();
        let t0 = Instant::now();
        let forward_peak = step(&m, &mb);
        let secs = t0.elapsed().as_secs_f64();
        let peak = status_kb("VmHWM");
        zero(&mut m);
        let (t1, p1) = *first.get_or_insert((tokens, peak));
        // /proc's kB are KiB; the growth is in KB (1,000 bytes), the unit.
        let per_token = match tokens > t1 {
            true => format!(
                "{:.1}",
                (peak as f64 - p1 as f64) * 1.024 / (tokens - t1) as f64
            ),
            false => "-".into(),
        };
        println!(
            "step-memory tokens={tokens} rss_before_kb={before} forward_peak_kb={forward_peak} \
             peak_kb={peak} growth_from_first_kb_per_token={per_token} secs={secs:.1}"
        );
    }
}
