//! Parity with HF transformers for every architecture yatt runs, on tiny random models
//! that transformers itself makes (`py/arch_ref.py`: `from_config`, re-initialised so
//! that biases, q/k norms and norm weights matter, `save_pretrained`): nothing is
//! downloaded. Each model is checked through every attention path: the plain forward,
//! a left-padded batch, scoring, `Attn::Capture`/`Continue`, generation (fused CPU
//! decode with prefix sharing, and under a KV budget that preempts) and the tch
//! prefill/decode path through the paged cache, and a trained
//! checkpoint that yatt writes is read back by transformers.
//!
//! These tests need `.venv` (scripts/bootstrap.sh): without it they fail, never skip.

use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use yatt_engine::fixtures::arch_ref;
use yatt_engine::score::{token_logprobs, SeqBatch};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

const TOL: f64 = 1e-4;
const NEW_TOKENS: usize = 24;
const VOCAB: i64 = 128;

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Prompts longer than the smallest window (5) and the generation beyond it; the last
/// shares its first 12 tokens with the first (prefix-shared prefill).
fn prompts() -> Vec<Vec<i64>> {
    let a: Vec<i64> = (0..20).map(|i| (i * 37 + 11) % VOCAB).collect();
    let b: Vec<i64> = (0..13).map(|i| (i * 53 + 7) % VOCAB).collect();
    let c: Vec<i64> = (0..7).map(|i| (i * 29 + 3) % VOCAB).collect();
    let mut d = a[..12].to_vec();
    d.extend((0..6).map(|i| (i * 71 + 5) % VOCAB));
    vec![a, b, c, d]
}

fn base_config() -> Value {
    json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false, "bos_token_id": null, "eos_token_id": null,
    })
}

struct Made {
    work: PathBuf,
    dir: PathBuf,
    reference: HashMap<String, Tensor>,
}

impl Drop for Made {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

fn make(name: &str, model_type: &str, extra: Value) -> Made {
    let work = std::env::temp_dir().join(format!("yatt-arch-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&work).unwrap();
    let mut config = base_config();
    for (k, v) in extra.as_object().unwrap() {
        config[k] = v.clone();
    }
    let dir = work.join("model");
    let out = work.join("ref.safetensors");
    arch_ref(
        "make",
        &json!({"model_type": model_type, "config": config, "seed": 7, "dir": dir,
                "prompts": prompts(), "new_tokens": NEW_TOKENS, "out": out}),
        &work,
    );
    let reference = read(&out);
    Made {
        work,
        dir,
        reference,
    }
}

/// Worst differences found, by path, for the report line.
#[derive(Default)]
struct Diffs(Vec<(&'static str, f64)>);

impl Diffs {
    fn check(&mut self, arch: &str, what: &'static str, d: f64) {
        assert!(d < TOL, "{arch}: {what}: max |Δlogit| = {d:.3e} ≥ {TOL:e}");
        self.0.push((what, d));
    }
}

fn right_padded(ps: &[Vec<i64>]) -> (Tensor, Vec<i64>) {
    let t = ps.iter().map(Vec::len).max().unwrap();
    let mut ids = vec![0i64; ps.len() * t];
    for (i, p) in ps.iter().enumerate() {
        ids[i * t..i * t + p.len()].copy_from_slice(p);
    }
    let lens = ps.iter().map(|p| p.len() as i64).collect();
    (
        Tensor::from_slice(&ids).view([ps.len() as i64, t as i64]),
        lens,
    )
}

/// Greedy through the tch path: an unpacked model, a KV cache, one ragged prefill of
/// all prompts and `Attn::Decode` steps.
fn greedy_tch(model: &Llama, ps: &[Vec<i64>]) -> Vec<Vec<i64>> {
    let b = ps.len() as i64;
    let mut cache = KvCache::new(model, b, 64);
    let (ids, lens) = right_padded(ps);
    let t = ids.size()[1];
    let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([b, t], true);
    let h = model.hidden(
        &ids,
        &pos,
        Attn::Prefill {
            cache: &mut cache,
            start: 0,
            offset: 0,
            lens: Some(&lens),
        },
    );
    let last = Tensor::from_slice(&lens.iter().map(|l| l - 1).collect::<Vec<_>>());
    let h = h.gather(
        1,
        &last.view([b, 1, 1]).expand([b, 1, h.size()[2]], false),
        false,
    );
    let mut next = model.logits(&h).squeeze_dim(1).argmax(-1, false);
    let mut out = vec![vec![]; ps.len()];
    let mut len = lens.clone();
    for _ in 0..NEW_TOKENS {
        for (i, o) in out.iter_mut().enumerate() {
            o.push(next.int64_value(&[i as i64]));
        }
        let positions = Tensor::from_slice(&len).view([b, 1]);
        let span = len.iter().max().unwrap() + 1;
        let h = model.hidden(
            &next.view([b, 1]),
            &positions,
            Attn::Decode {
                cache: &mut cache,
                span,
                table: None,
            },
        );
        next = model.logits(&h).squeeze_dim(1).argmax(-1, false);
        len.iter_mut().for_each(|l| *l += 1);
    }
    out
}

fn check_arch(name: &str, model_type: &str, extra: Value) {
    tch::set_num_threads(2);
    let made = make(name, model_type, extra);
    let r = &made.reference;
    let ps = prompts();
    let mut d = Diffs::default();
    let model = Llama::load(&made.dir, Device::Cpu, Kind::Float).unwrap();
    let _guard = tch::no_grad_guard();

    // Each prompt alone.
    let mut worst = 0f64;
    for (i, p) in ps.iter().enumerate() {
        let ours = model
            .forward(&Tensor::from_slice(p).unsqueeze(0), None)
            .get(0);
        worst = worst.max(max_diff(&ours, &r[&format!("logits_{i}")]));
    }
    d.check(name, "forward", worst);

    // The prompts as one left-padded batch, against transformers' padded batch.
    let l = ps.iter().map(Vec::len).max().unwrap();
    let mut ids = vec![];
    let mut mask = vec![];
    for p in &ps {
        ids.extend(std::iter::repeat_n(0, l - p.len()).chain(p.iter().copied()));
        mask.extend(std::iter::repeat_n(0i64, l - p.len()).chain(std::iter::repeat_n(1, p.len())));
    }
    let shape = [ps.len() as i64, l as i64];
    let lg = model.forward(
        &Tensor::from_slice(&ids).view(shape),
        Some(&Tensor::from_slice(&mask).view(shape)),
    );
    let mut worst = 0f64;
    for (i, p) in ps.iter().enumerate() {
        let pad = (l - p.len()) as i64;
        let ours = lg.get(i as i64).narrow(0, pad, p.len() as i64);
        let theirs = r["batch_logits"]
            .get(i as i64)
            .narrow(0, pad, p.len() as i64);
        worst = worst.max(max_diff(&ours, &theirs));
    }
    d.check(name, "padded batch", worst);

    // Scoring (right-padded, the trainer's layout): log-probs of each prompt's tokens.
    let pairs: Vec<(&[i64], &[i64])> = ps.iter().map(|p| (&p[..1], &p[1..])).collect();
    let batch = SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap();
    let scores = token_logprobs(&model, &batch, 1.0, false);
    let mut worst = 0f64;
    for (i, p) in ps.iter().enumerate() {
        let n = p.len() as i64;
        let theirs = r[&format!("logits_{i}")]
            .narrow(0, 0, n - 1)
            .log_softmax(-1, Kind::Float)
            .gather(1, &Tensor::from_slice(&p[1..]).unsqueeze(1), false)
            .squeeze_dim(1);
        let ours = scores.logprobs.get(i as i64).narrow(0, 1, n - 1);
        worst = worst.max(max_diff(&ours, &theirs));
    }
    d.check(name, "scoring", worst);

    // Capture the first 9 tokens of prompts 0 and 1, continue rows from them (row 2
    // continues prompt 0 after only 6 of its tokens: a shorter prefix, padded).
    let prefixes = vec![ps[0][..9].to_vec(), ps[1][..9].to_vec()];
    let (pids, _) = right_padded(&prefixes);
    let ppos = Tensor::arange(9, (Kind::Int64, Device::Cpu))
        .unsqueeze(0)
        .expand([2, 9], true);
    let mut kv = vec![];
    let hp = model.hidden(&pids, &ppos, Attn::Capture { kv: &mut kv });
    let rows_of = [(0usize, 0usize, 9usize), (1, 1, 9), (0, 0, 6)];
    let conts: Vec<Vec<i64>> = rows_of
        .iter()
        .map(|&(p, _, k)| ps[p][k..].to_vec())
        .collect();
    let (cids, _) = right_padded(&conts);
    let tc = cids.size()[1];
    let lens = Tensor::from_slice(&rows_of.iter().map(|r| r.2 as i64).collect::<Vec<_>>());
    let rows = Tensor::from_slice(&rows_of.iter().map(|r| r.1 as i64).collect::<Vec<_>>());
    let cpos = lens.unsqueeze(1) + Tensor::arange(tc, (Kind::Int64, Device::Cpu)).unsqueeze(0);
    let hc = model.hidden(
        &cids,
        &cpos,
        Attn::Continue {
            kv: &kv,
            rows: &rows,
            lens: &lens,
        },
    );
    let mut worst = max_diff(&model.logits(&hp.get(0)), &r["logits_0"].narrow(0, 0, 9));
    for (j, &(p, _, k)) in rows_of.iter().enumerate() {
        let n = (ps[p].len() - k) as i64;
        let ours = model.logits(&hc.get(j as i64).narrow(0, 0, n));
        let theirs = r[&format!("logits_{p}")].narrow(0, k as i64, n);
        worst = worst.max(max_diff(&ours, &theirs));
    }
    d.check(name, "capture/continue", worst);

    let reference: Vec<Vec<i64>> = (0..ps.len())
        .map(|i| Vec::<i64>::try_from(&r["greedy"].get(i as i64)).unwrap())
        .collect();
    // The tch prefill and decode path (the model is not packed).
    assert!(!model.is_packed());
    assert_eq!(
        greedy_tch(&model, &ps),
        reference,
        "{name}: greedy ids (tch path)"
    );

    // The generator: packed weights and the fused CPU decode step when the shim is
    // built; prompts 0 and 3 share a prefix, prompt 0 is asked twice.
    let mut g = Generator::new(
        model.deep_copy(Device::Cpu, Kind::Float).unwrap(),
        GeneratorConfig {
            max_batch: 8,
            max_seq_len: 64,
            ..Default::default()
        },
    );
    let greedy = |set: &[usize]| -> Vec<Request> {
        set.iter()
            .enumerate()
            .map(|(j, &i)| Request {
                id: j as u64,
                prompt: ps[i].clone(),
                params: SamplingParams::greedy(NEW_TOKENS),
            })
            .collect()
    };
    for set in [vec![0usize, 1, 2, 3, 0], vec![0, 3, 0]] {
        let (mut done, _) = g.generate(&greedy(&set)).unwrap();
        done.sort_by_key(|c| c.id);
        for (c, &i) in done.iter().zip(&set) {
            assert_eq!(
                c.tokens,
                reference[i],
                "{name}: greedy ids of prompt {i} (generator, packed: {})",
                g.model().is_packed()
            );
        }
    }
    // A KV budget of 5 blocks (one request needs up to 3) preempts sequences and
    // recomputes their prefix: the same greedy ids.
    let budget = 5 * KvCache::block_bytes(&model);
    let mut small = Generator::new(
        model.deep_copy(Device::Cpu, Kind::Float).unwrap(),
        GeneratorConfig {
            max_batch: 8,
            max_seq_len: 64,
            kv_cache_bytes: Some(budget),
            ..Default::default()
        },
    );
    let set = [0usize, 1, 2, 3, 0];
    let (done, st) = small.generate(&greedy(&set)).unwrap();
    assert!(st.kv_preemptions > 0, "{name}: {st:?}");
    for (c, &i) in done.iter().zip(&set) {
        assert_eq!(
            c.tokens, reference[i],
            "{name}: greedy ids of prompt {i} (preempted)"
        );
    }
    drop(_guard);

    // A trained checkpoint: one optimizer step, saved by yatt, read by transformers.
    let mut trainer = Trainer::new(
        model,
        TrainConfig {
            lr: 1e-2,
            ..Default::default()
        },
    );
    trainer
        .step(&[batch], |m, b| {
            Ok(-token_logprobs(m, b, 1.0, false).logprobs.sum(Kind::Float))
        })
        .unwrap();
    let saved = made.work.join("trained");
    save_pretrained(&trainer.model, &saved, None).unwrap();
    let out = made.work.join("trained.safetensors");
    arch_ref(
        "logits",
        &json!({"dir": saved, "prompts": ps, "out": out}),
        &made.work,
    );
    let theirs = read(&out);
    let mut worst = 0f64;
    let mut moved = 0f64;
    for (i, p) in ps.iter().enumerate() {
        let ours = tch::no_grad(|| {
            trainer
                .model
                .forward(&Tensor::from_slice(p).unsqueeze(0), None)
        })
        .get(0);
        worst = worst.max(max_diff(&ours, &theirs[&format!("logits_{i}")]));
        moved = moved.max(max_diff(&ours, &r[&format!("logits_{i}")]));
    }
    assert!(
        moved > 1e-3,
        "{name}: the training step changed nothing ({moved:e})"
    );
    d.check(name, "trained checkpoint", worst);

    let summary: Vec<String> = d.0.iter().map(|(w, x)| format!("{w} {x:.1e}")).collect();
    eprintln!(
        "{name}: max |Δlogit| {}; greedy {NEW_TOKENS} ids equal",
        summary.join(", ")
    );
}

#[test]
fn llama3_rope_scaling_matches_transformers() {
    // original_max_position_embeddings 16 puts the rotary frequencies in all three
    // bands (scaled, smoothed, kept) for head_dim 16.
    check_arch(
        "llama3",
        "llama",
        json!({"tie_word_embeddings": true, "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0,
               "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}}),
    );
}

#[test]
fn qwen2_biases_match_transformers() {
    check_arch(
        "qwen2",
        "qwen2",
        json!({"rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    );
}

#[test]
fn qwen2_sliding_window_on_upper_layers_matches_transformers() {
    // Layer 0 full attention, layer 1 windowed (HF's max_window_layers); head_dim 16
    // takes the decode kernel's generic path.
    check_arch(
        "qwen2-sliding",
        "qwen2",
        json!({"use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1}),
    );
}

#[test]
fn qwen3_qk_norm_and_head_dim_match_transformers() {
    // head_dim 32 is not hidden_size / heads (16): it must come from the config.
    check_arch(
        "qwen3",
        "qwen3",
        json!({"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0}}),
    );
}

#[test]
fn mistral_sliding_window_matches_transformers() {
    // Window 5 against prompts of up to 20 tokens and 24 generated; head_dim 64 with two
    // query heads per kv head takes the decode kernel's fixed-size path.
    check_arch(
        "mistral",
        "mistral",
        json!({"sliding_window": 5, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}),
    );
}

#[test]
fn unsupported_configs_are_refused_by_name() {
    let mut c = base_config();
    c["model_type"] = json!("gpt_neox");
    let e = ModelConfig::from_json(&c).unwrap_err();
    assert!(e.contains("gpt_neox") && e.contains("qwen3"), "{e}");
    for (key, val, needle) in [
        (
            "rope_scaling",
            json!({"rope_type": "yarn", "factor": 4.0}),
            "yarn",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "dynamic", "factor": 2.0}),
            "dynamic",
        ),
        ("mlp_bias", json!(true), "mlp_bias"),
        ("attention_bias", json!(true), "o_proj"),
        ("partial_rotary_factor", json!(0.5), "partial_rotary_factor"),
        (
            "layer_types",
            json!(["full_attention", "chunked_attention"]),
            "chunked_attention",
        ),
    ] {
        let mut c = base_config();
        c["model_type"] = json!("llama");
        c[key] = val;
        let e = ModelConfig::from_json(&c).unwrap_err();
        assert!(e.contains(needle), "{key}: {e}");
    }
}
