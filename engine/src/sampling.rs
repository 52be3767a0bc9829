//! Sampling one token per row of logits: temperature, top-k, top-p and greedy, with the
//! sampled token's log-prob under the temperature-scaled distribution; a one-pass CPU
//! sampler in the C++ shim, tch operations elsewhere.

use tch::{Device, Kind, Tensor};

/// Per-row sampling settings for [`sample`].
#[derive(Debug, Clone, Default)]
pub struct RowParams {
    /// Temperatures (0 = greedy).
    pub temperature: Vec<f32>,
    /// top-k (0 = off).
    pub top_k: Vec<usize>,
    /// top-p (1 = off).
    pub top_p: Vec<f32>,
    /// One uniform in `[0, 1)` per row.
    pub uniform: Vec<f32>,
}

/// Largest top-k the one-pass CPU sampler handles (it keeps the k best in a heap).
const FAST_TOP_K: usize = 1024;

/// Samples one token per row of `logits` `[n, vocab]`. Returns the tokens and their
/// log-probs under `log_softmax(logits / T)`. For f32 logits on the CPU with every row
/// greedy or top-k limited, one pass per row in the C++ shim; otherwise tch operations
/// and one host transfer of `2n` numbers.
pub fn sample(logits: &Tensor, p: &RowParams) -> (Vec<i64>, Vec<f32>) {
    let fast = crate::onednn::available()
        && logits.device() == Device::Cpu
        && logits.kind() == Kind::Float
        && p.temperature
            .iter()
            .zip(&p.top_k)
            .all(|(&t, &k)| t <= 0.0 || (1..=FAST_TOP_K).contains(&k));
    if fast {
        let v = logits.size().last().copied().unwrap_or(1);
        let ks: Vec<i64> = p.top_k.iter().map(|&k| (k as i64).clamp(1, v)).collect();
        if let Ok(out) =
            crate::onednn::sample_topk(logits, &p.temperature, &ks, &p.top_p, &p.uniform)
        {
            return out;
        }
    }
    sample_tch(logits, p)
}

/// Copies a small host tensor to `device` without making the host wait. A copy from
/// pageable memory to a GPU blocks the host until the stream is idle: after a decode
/// step's graph launch, the sampling parameters' copy held the host for the whole replay,
/// and only then could it queue sampling's ~15 operations, one after another, while the
/// GPU waited. From pinned memory the copy is queued like a kernel (libtorch keeps the
/// pinned block until the copy is done), so the host queues sampling during the replay.
pub(crate) fn upload(host: Tensor, device: Device) -> Tensor {
    if device.is_cuda() {
        // `_pin_memory`: `pin_memory` warns on every call that its device argument is
        // deprecated, and tch always passes one.
        if let Ok(pinned) = host.f_internal_pin_memory(device) {
            return pinned.to_device_(device, pinned.kind(), true, false);
        }
    }
    host.to_device(device)
}

/// [`sample`] with tch operations (any device, dtype and top-k).
fn sample_tch(logits: &Tensor, p: &RowParams) -> (Vec<i64>, Vec<f32>) {
    let (n, v) = logits.size2().expect("logits must be [n, vocab]");
    let dev = logits.device();
    let logits = logits.to_kind(Kind::Float);
    let greedy: Vec<bool> = p.temperature.iter().map(|&t| t <= 0.0).collect();
    let temps: Vec<f32> = p
        .temperature
        .iter()
        .map(|&t| if t <= 0.0 { 1.0 } else { t })
        .collect();
    let all_temp_one = temps.iter().all(|&t| t == 1.0);
    let ks: Vec<i64> = p
        .top_k
        .iter()
        .map(|&k| if k == 0 || k as i64 >= v { v } else { k as i64 })
        .collect();
    // Every per-row parameter in one host-to-device copy (one transfer per step on a GPU
    // instead of up to five), as `[n, 1]` columns: temperature, uniform, top-k (exact in
    // f32 below 2^24), greedy (0/1), top-p.
    let cols = Tensor::from_slice(
        &[
            temps,
            p.uniform.clone(),
            ks.iter().map(|&k| k as f32).collect(),
            greedy.iter().map(|&g| f32::from(u8::from(g))).collect(),
            p.top_p.clone(),
        ]
        .concat(),
    )
    .view([5, n]);
    let cols = upload(cols, dev);
    let param = |i: i64| cols.get(i).unsqueeze(1);
    let scaled = if all_temp_one {
        logits
    } else {
        logits / param(0)
    };
    let lse = scaled.logsumexp([1], true);
    let any_top_p = p.top_p.iter().any(|&x| x < 1.0);
    let all_greedy = greedy.iter().all(|&g| g);
    let kmax = ks.iter().copied().max().unwrap_or(v);
    let tok = if all_greedy {
        scaled.argmax(1, true)
    } else if kmax == v && !any_top_p {
        // Plain sampling over the whole vocabulary: inverse CDF, no sort.
        let probs = (&scaled - &lse).exp();
        let cum = probs.cumsum(1, Kind::Float);
        let u = param(1);
        let total = cum.narrow(1, v - 1, 1);
        let choice = cum
            .lt_tensor(&(u * total))
            .sum_dim_intlist(1, true, Kind::Int64)
            .clamp_max(v - 1);
        if greedy.iter().any(|&g| g) {
            let g = param(3).gt(0.5);
            scaled.argmax(1, true).where_self(&g, &choice)
        } else {
            choice
        }
    } else {
        let (mut vals, idx) = scaled.topk(kmax, 1, true, true);
        // Rows with a smaller top-k drop their extra candidates (4 operations, each a
        // kernel and a dispatch on a GPU: skipped when every row has the same k).
        if ks.iter().any(|&k| k != kmax) {
            let col = Tensor::arange(kmax, (Kind::Int64, dev)).unsqueeze(0);
            vals = vals.masked_fill(&col.ge_tensor(&param(2)), f64::NEG_INFINITY);
        }
        if any_top_p {
            let probs = vals.softmax(1, Kind::Float);
            let cum = probs.cumsum(1, Kind::Float);
            let tp = param(4);
            let remove = (cum - &probs).gt_tensor(&tp);
            vals = vals.masked_fill(&remove, f64::NEG_INFINITY);
        }
        let probs = vals.softmax(1, Kind::Float);
        let cum = probs.cumsum(1, Kind::Float);
        let u = param(1);
        let total = cum.narrow(1, kmax - 1, 1);
        let mut choice = cum
            .lt_tensor(&(u * total))
            .sum_dim_intlist(1, true, Kind::Int64)
            .clamp_max(kmax - 1);
        if greedy.iter().any(|&g| g) {
            let g = param(3).gt(0.5);
            choice = choice.zeros_like().where_self(&g, &choice);
        }
        idx.gather(1, &choice, false)
    };
    let lp = scaled.gather(1, &tok, false) - lse;
    // Tokens and log-probs in one transfer, as f32 (token ids are exact below 2^24;
    // f64 beyond, for a vocabulary that large).
    let kind = if v < 1 << 24 {
        Kind::Float
    } else {
        Kind::Double
    };
    let both = Tensor::cat(&[tok.to_kind(kind), lp.to_kind(kind)], 1).to_device(Device::Cpu);
    let flat: Vec<f64> =
        Vec::<f64>::try_from(both.reshape([-1]).to_kind(Kind::Double)).expect("cpu f64");
    let toks = (0..n as usize).map(|i| flat[2 * i] as i64).collect();
    let lps = (0..n as usize).map(|i| flat[2 * i + 1] as f32).collect();
    (toks, lps)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Uniforms in `[0, 1)` from a fixed linear congruential stream.
    fn uniforms(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (x >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect()
    }

    fn params(n: usize, t: f32, k: usize, p: f32, u: f32) -> RowParams {
        RowParams {
            temperature: vec![t; n],
            top_k: vec![k; n],
            top_p: vec![p; n],
            uniform: vec![u; n],
        }
    }

    #[test]
    fn sampler_greedy_topk_topp() {
        // probs ∝ [0.5, 0.25, 0.15, 0.1]
        let probs = [0.5f64, 0.25, 0.15, 0.1];
        let logits = Tensor::from_slice(&probs.map(|p| p.ln() as f32)).unsqueeze(0);
        // greedy
        let (t, lp) = sample(&logits, &params(1, 0.0, 0, 1.0, 0.99));
        assert_eq!(t, vec![0]);
        assert!((lp[0] - 0.5f32.ln()).abs() < 1e-5);
        // full sampling: inverse CDF picks by uniform
        assert_eq!(sample(&logits, &params(1, 1.0, 0, 1.0, 0.1)).0, vec![0]);
        assert_eq!(sample(&logits, &params(1, 1.0, 0, 1.0, 0.6)).0, vec![1]);
        assert_eq!(sample(&logits, &params(1, 1.0, 0, 1.0, 0.95)).0, vec![3]);
        // top-k 2: renormalised over {0, 1}: u = 0.95 → token 1
        assert_eq!(sample(&logits, &params(1, 1.0, 2, 1.0, 0.95)).0, vec![1]);
        // top-k 1 is greedy
        assert_eq!(sample(&logits, &params(1, 1.0, 1, 1.0, 0.99)).0, vec![0]);
        // top-p 0.7: nucleus {0, 1} (0.5 < 0.7, 0.75 ≥ 0.7)
        let (t, lp) = sample(&logits, &params(1, 1.0, 0, 0.7, 0.99));
        assert_eq!(t, vec![1]);
        assert!(
            (lp[0] - 0.25f32.ln()).abs() < 1e-5,
            "log-prob is before filtering"
        );
        // top-p 0.4 keeps only the top token
        assert_eq!(sample(&logits, &params(1, 1.0, 0, 0.4, 0.99)).0, vec![0]);
        // temperature: log-prob under logits / T
        let (_, lp) = sample(&logits, &params(1, 2.0, 0, 1.0, 0.0));
        let z: f64 = probs.iter().map(|p| p.sqrt()).sum();
        assert!((lp[0] as f64 - (0.5f64.sqrt() / z).ln()).abs() < 1e-5);
    }

    /// The one-pass CPU sampler and the tch sampler pick the same tokens with the same
    /// log-probs, across temperatures, top-k and top-p.
    #[test]
    fn fast_sampler_matches_tch_sampler() {
        if !crate::onednn::available() {
            return;
        }
        tch::manual_seed(5);
        let n = 48;
        let logits = Tensor::randn([n, 3000], (Kind::Float, Device::Cpu)) * 3.0;
        let rp = RowParams {
            temperature: (0..n)
                .map(|i| [0.0, 0.7, 1.0, 1.3][i as usize % 4])
                .collect(),
            top_k: (0..n)
                .map(|i| [1, 5, 50, 1000][i as usize / 4 % 4])
                .collect(),
            top_p: (0..n)
                .map(|i| [1.0, 0.9, 0.5][i as usize / 16 % 3])
                .collect(),
            uniform: uniforms(n as usize, 3),
        };
        let (fast_t, fast_lp) = sample(&logits, &rp);
        let (ref_t, ref_lp) = sample_tch(&logits, &rp);
        assert_eq!(fast_t, ref_t);
        for (a, b) in fast_lp.iter().zip(&ref_lp) {
            assert!((a - b).abs() < 1e-4, "{a} vs {b}");
        }
    }

    #[test]
    fn sampler_mixed_rows() {
        let logits = Tensor::from_slice(&[0.0f32, 1.0, 2.0, 3.0, 3.0, 2.0, 1.0, 0.0]).view([2, 4]);
        let rp = RowParams {
            temperature: vec![0.0, 1.0],
            top_k: vec![0, 1],
            top_p: vec![1.0, 1.0],
            uniform: vec![0.5, 0.5],
        };
        assert_eq!(sample(&logits, &rp).0, vec![3, 0]);
    }

    #[test]
    fn sampler_frequencies_follow_probabilities() {
        let probs = [0.6f64, 0.3, 0.1];
        let logits = Tensor::from_slice(&probs.map(|p| p.ln() as f32))
            .unsqueeze(0)
            .repeat([2000, 1]);
        let mut rp = params(2000, 1.0, 0, 1.0, 0.0);
        rp.uniform = uniforms(2000, 1);
        let (t, _) = sample(&logits, &rp);
        let f0 = t.iter().filter(|&&x| x == 0).count() as f64 / 2000.0;
        let f2 = t.iter().filter(|&&x| x == 2).count() as f64 / 2000.0;
        assert!((f0 - 0.6).abs() < 0.04, "{f0}");
        assert!((f2 - 0.1).abs() < 0.03, "{f2}");
    }
}
