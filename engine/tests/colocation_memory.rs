//! Full colocation on CPU, measured: a rollout (generator) and a policy (trainer) take
//! turns on one device, each freeing its memory while the other runs, as the rollout
//! and policy roles do on `offload`/`reload`. Checked: tensor storage (exact), process
//! RSS (what the OS sees), and that training after an offload/reload round trip is
//! bit-identical to training without one. The figures are printed for
//! `docs/benchmarks.md` ("Full colocation memory").

use serde_json::json;
use yatt_engine::score::token_logprobs;
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

/// A 4-layer, 512-wide Llama (~11.7M parameters, 47 MB in f32): big enough that its
/// state dwarfs allocator noise in RSS.
fn model(seed: i64) -> Llama {
    let c = ModelConfig::from_json(&json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512,
        "intermediate_size": 1376, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 4, "vocab_size": 97, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "eos_token_id": 1, "bos_token_id": 0, "hidden_act": "silu"
    }))
    .unwrap();
    Llama::random(c, Device::Cpu, Kind::Float, seed).unwrap()
}

/// Resident set size of this process, bytes.
fn rss() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf only reads a system constant.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) }
}

fn mib(b: i64) -> f64 {
    b as f64 / (1 << 20) as f64
}

fn batch() -> SeqBatch {
    let pairs: Vec<(Vec<i64>, Vec<i64>)> = (0..16)
        .map(|i| {
            (
                vec![0, 5 + i, 6],
                (0..24).map(|k| 10 + (i + k) % 80).collect(),
            )
        })
        .collect();
    let refs: Vec<(&[i64], &[i64])> = pairs
        .iter()
        .map(|(a, b)| (a.as_slice(), b.as_slice()))
        .collect();
    SeqBatch::from_pairs(&refs, 1, Device::Cpu).unwrap()
}

fn nll(m: &Llama, b: &SeqBatch) -> Result<Tensor> {
    let s = token_logprobs(m, b, 1.0, false);
    let mask = b.response_mask.to_kind(Kind::Float);
    Ok(-(s.logprobs * &mask).sum(Kind::Float) / mask.sum(Kind::Float))
}

#[test]
fn full_colocation_frees_and_restores_memory_between_phases() {
    tch::set_num_threads(1);
    let mut trainer = Trainer::new(model(3), TrainConfig::default());
    let mut twin = Trainer::new(model(3), TrainConfig::default());
    let (max_batch, max_seq) = (64usize, 256usize);
    let mut gen = Generator::new(
        model(3),
        GeneratorConfig {
            max_batch,
            max_seq_len: max_seq,
            ..Default::default()
        },
    );
    // 2 (K, V) × layers × slots × positions × kv heads × head dim × 4 bytes.
    let kv_bytes = (2 * 4 * max_batch * max_seq * 4 * 64 * 4) as i64;
    let reqs: Vec<Request> = (0..max_batch as u64)
        .map(|i| Request {
            id: i,
            prompt: vec![0, 3 + (i % 50) as i64, 4],
            params: SamplingParams {
                max_new_tokens: 8,
                ignore_eos: true,
                seed: i,
                ..Default::default()
            },
        })
        .collect();
    let mut rows: Vec<(String, i64, i64)> = Vec::new();
    let mut mark = |what: &str, t: &mut Trainer| {
        yatt_engine::release_host_memory();
        rows.push((what.into(), rss(), t.resident_bytes() as i64));
    };
    mark("start (both models loaded)", &mut trainer);

    // Phase 1: generate (the policy has no optimizer state yet).
    gen.generate(&reqs).unwrap();
    mark("gen: KV cache allocated", &mut trainer);
    // Switch to training: the rollout frees its KV cache, the policy reloads.
    gen.free_cache();
    mark("rollout offloaded (KV cache freed)", &mut trainer);
    trainer.reload().unwrap();
    trainer.step(&[batch()], nll).unwrap();
    twin.step(&[batch()], nll).unwrap();
    mark("train: grads + AdamW state", &mut trainer);
    let trained = trainer.resident_bytes() as i64;
    // Switch back to generation: the policy offloads.
    trainer.offload().unwrap();
    mark("policy offloaded", &mut trainer);
    assert_eq!(trainer.resident_bytes(), 0, "offload drops every tensor");
    gen.generate(&reqs).unwrap();
    gen.free_cache();
    trainer.reload().unwrap();
    mark("policy reloaded", &mut trainer);
    let params = trainer.model.num_parameters() as i64 * 4;
    // Reload brings back weights and AdamW moments, and zero gradients where there
    // were gradients (the next backward would allocate them anyway).
    assert_eq!(trainer.resident_bytes() as i64, trained);

    for (what, r, t) in &rows {
        println!("| {what} | {:.1} MiB | {:.1} MiB |", mib(*r), mib(*t));
    }
    println!(
        "KV cache {:.1} MiB, parameters {:.1} MiB",
        mib(kv_bytes),
        mib(params)
    );
    // The KV cache really leaves the process (the pages go back to the OS).
    let freed_kv = rows[1].1 - rows[2].1;
    assert!(
        freed_kv > kv_bytes / 2,
        "freeing the KV cache gave back {:.1} MiB of {:.1} MiB",
        mib(freed_kv),
        mib(kv_bytes)
    );

    // After the round trip the policy trains exactly as one that never left.
    trainer.step(&[batch()], nll).unwrap();
    twin.step(&[batch()], nll).unwrap();
    for ((n, x), (_, y)) in trainer
        .model
        .parameters()
        .iter()
        .zip(twin.model.parameters().iter())
    {
        assert!(x.equal(y), "{n} differs after offload/reload");
    }
}
