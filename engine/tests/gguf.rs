//! GGUF parsing and import on small hand-written files, plus the real SmolLM2 file.

use std::io::Write;
use yatt_engine::gguf::{import_gguf, GgmlType, GgufFile, GgufValue};

/// A minimal GGUF v3 writer for tests.
struct W(Vec<u8>);
impl W {
    fn s(&mut self, s: &str) {
        self.0.extend((s.len() as u64).to_le_bytes());
        self.0.extend(s.as_bytes());
    }
    fn kv_str(&mut self, k: &str, v: &str) {
        self.s(k);
        self.0.extend(8u32.to_le_bytes());
        self.s(v);
    }
    fn kv_u32(&mut self, k: &str, v: u32) {
        self.s(k);
        self.0.extend(4u32.to_le_bytes());
        self.0.extend(v.to_le_bytes());
    }
    fn kv_u64(&mut self, k: &str, v: u64) {
        self.s(k);
        self.0.extend(10u32.to_le_bytes());
        self.0.extend(v.to_le_bytes());
    }
    fn kv_f32(&mut self, k: &str, v: f32) {
        self.s(k);
        self.0.extend(6u32.to_le_bytes());
        self.0.extend(v.to_le_bytes());
    }
    fn kv_strs(&mut self, k: &str, v: &[&str]) {
        self.s(k);
        self.0.extend(9u32.to_le_bytes());
        self.0.extend(8u32.to_le_bytes());
        self.0.extend((v.len() as u64).to_le_bytes());
        for x in v {
            self.s(x);
        }
    }
}

/// Tensors: (name, dims (ggml order), type, bytes).
fn gguf_bytes(
    kvs: impl FnOnce(&mut W) -> u64,
    tensors: &[(&str, Vec<u64>, u32, Vec<u8>)],
) -> Vec<u8> {
    let mut w = W(Vec::new());
    w.0.extend(b"GGUF");
    w.0.extend(3u32.to_le_bytes());
    w.0.extend((tensors.len() as u64).to_le_bytes());
    let count_pos = w.0.len();
    w.0.extend(0u64.to_le_bytes());
    let n = kvs(&mut w);
    w.0[count_pos..count_pos + 8].copy_from_slice(&n.to_le_bytes());
    let mut off = 0u64;
    for (name, dims, ty, data) in tensors {
        w.s(name);
        w.0.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            w.0.extend(d.to_le_bytes());
        }
        w.0.extend(ty.to_le_bytes());
        w.0.extend(off.to_le_bytes());
        off += (data.len() as u64).div_ceil(32) * 32;
    }
    while w.0.len() % 32 != 0 {
        w.0.push(0);
    }
    for (_, _, _, data) in tensors {
        w.0.extend(data);
        while w.0.len() % 32 != 0 {
            w.0.push(0);
        }
    }
    w.0
}

fn write(name: &str, bytes: &[u8]) -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("yatt-gguf-{}-{name}.gguf", std::process::id()));
    std::fs::File::create(&p).unwrap().write_all(bytes).unwrap();
    p
}

/// Imports `bytes` (written as file `name`) and returns the error and the file's path;
/// removes the file and the output directory.
fn import_err(name: &str, bytes: &[u8]) -> (String, String) {
    let p = write(name, bytes);
    let out = std::env::temp_dir().join(format!("yatt-gguf-out-{name}-{}", std::process::id()));
    let e = import_gguf(&p, &out, &Default::default())
        .unwrap_err()
        .to_string();
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&p);
    (e, p.display().to_string())
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn tiny_llama_kvs(w: &mut W) -> u64 {
    llama_shape_kvs(w, 1);
    w.kv_f32("llama.attention.layer_norm_rms_epsilon", 1e-5);
    w.kv_str("tokenizer.ggml.model", "gpt2");
    w.kv_str("tokenizer.ggml.pre", "smollm");
    w.kv_strs(
        "tokenizer.ggml.tokens",
        &["<|endoftext|>", "a", "b", "ab", "Ġ"],
    );
    w.kv_strs("tokenizer.ggml.merges", &["a b"]);
    11
}

/// The architecture and shape keys of a 2-head Llama with `head_count_kv` KV heads (6 keys).
fn llama_shape_kvs(w: &mut W, head_count_kv: u32) -> u64 {
    w.kv_str("general.architecture", "llama");
    w.kv_u32("llama.embedding_length", 4);
    w.kv_u32("llama.block_count", 1);
    w.kv_u32("llama.feed_forward_length", 8);
    w.kv_u32("llama.attention.head_count", 2);
    w.kv_u32("llama.attention.head_count_kv", head_count_kv);
    6
}

#[test]
fn parses_metadata_and_tensors() {
    let p = write(
        "parse",
        &gguf_bytes(
            tiny_llama_kvs,
            &[("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20]))],
        ),
    );
    let g = GgufFile::open(&p).unwrap();
    assert_eq!(g.version, 3);
    assert_eq!(g.get("llama.block_count"), Some(&GgufValue::U32(1)));
    assert_eq!(
        g.get("tokenizer.ggml.tokens")
            .unwrap()
            .as_array()
            .unwrap()
            .len(),
        5
    );
    let t = g.tensor("token_embd.weight").unwrap();
    assert_eq!(t.shape(), vec![5, 4]);
    assert_eq!(t.ty, GgmlType::F32);
    assert_eq!(g.dequantize(t).unwrap(), vec![0.5; 20]);
    let _ = std::fs::remove_file(p);
}

#[test]
fn unsupported_type_names_type_and_tensor() {
    let p = write(
        "q4k",
        &gguf_bytes(
            tiny_llama_kvs,
            &[("blk.0.attn_q.weight", vec![256, 1], 12, vec![0u8; 144])],
        ),
    );
    let out = std::env::temp_dir().join(format!("yatt-gguf-out-{}", std::process::id()));
    let e = import_gguf(&p, &out, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Q4_K") && e.contains("blk.0.attn_q.weight"),
        "{e}"
    );
    let _ = std::fs::remove_file(p);
}

#[test]
fn malformed_files_are_clear_errors() {
    let p = write("bad", b"NOTAGGUF");
    let e = GgufFile::open(&p).err().unwrap().to_string();
    assert!(e.contains("magic"), "{e}");
    let mut trunc = gguf_bytes(
        tiny_llama_kvs,
        &[("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20]))],
    );
    trunc.truncate(trunc.len() - 40);
    let p2 = write("trunc", &trunc);
    let e = GgufFile::open(&p2).err().unwrap().to_string();
    assert!(
        e.contains("token_embd.weight") && e.contains("past the end"),
        "{e}"
    );
    let e = GgufFile::open("/nonexistent/x.gguf")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("/nonexistent/x.gguf"), "{e}");
    let e = yatt_engine::Llama::load(
        "/nonexistent-model-dir",
        yatt_engine::tch::Device::Cpu,
        yatt_engine::tch::Kind::Float,
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("config.json") && e.contains("/nonexistent-model-dir"),
        "{e}"
    );
    for p in [p, p2] {
        let _ = std::fs::remove_file(p);
    }
}

/// Regression: zero head counts in config.json divided by zero, and absurd GGUF counts
/// panicked with `capacity overflow`; both are now errors naming the file, the field,
/// the value and the fix.
#[test]
fn absurd_model_fields_are_errors_not_panics() {
    let dir = std::env::temp_dir().join(format!("yatt-bad-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let base = serde_json::json!({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97});
    let cases: [(&str, serde_json::Value, &str); 7] = [
        (
            "num_key_value_heads",
            0.into(),
            "num_key_value_heads = 0: expected a positive divisor of num_attention_heads (4)",
        ),
        (
            "num_key_value_heads",
            3.into(),
            "num_key_value_heads = 3: expected a positive divisor",
        ),
        (
            "num_attention_heads",
            0.into(),
            "num_attention_heads = 0: expected a positive integer",
        ),
        (
            "num_attention_heads",
            3.into(),
            "hidden_size = 64 is not a multiple of num_attention_heads (3)",
        ),
        (
            "head_dim",
            0.into(),
            "head_dim = 0: expected a positive even number",
        ),
        (
            "vocab_size",
            0.into(),
            "vocab_size = 0: expected a positive integer",
        ),
        (
            "rms_norm_eps",
            (-1.0).into(),
            "rms_norm_eps = -1: expected a positive finite number",
        ),
    ];
    for (key, value, want) in cases {
        let mut cfg = base.clone();
        cfg[key] = value;
        if key == "num_attention_heads" {
            cfg["num_key_value_heads"] = serde_json::Value::Null;
        }
        std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
        let e = yatt_engine::ModelConfig::from_dir(&dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&dir.join("config.json").display().to_string())
                && e.contains(want)
                && e.contains("fix"),
            "{key}: {e}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);

    // GGUF: a tensor count, a metadata count and an array length of 2^63-1.
    let good = gguf_bytes(
        tiny_llama_kvs,
        &[("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20]))],
    );
    let mut huge_tensors = good.clone();
    huge_tensors[8..16].copy_from_slice(&(i64::MAX as u64).to_le_bytes());
    let mut huge_kvs = good.clone();
    huge_kvs[16..24].copy_from_slice(&(i64::MAX as u64).to_le_bytes());
    let huge_array = gguf_bytes(
        |w| {
            w.s("tokenizer.ggml.tokens");
            w.0.extend(9u32.to_le_bytes());
            w.0.extend(8u32.to_le_bytes());
            w.0.extend((i64::MAX as u64).to_le_bytes());
            1
        },
        &[],
    );
    let huge_dims = gguf_bytes(
        tiny_llama_kvs,
        &[("token_embd.weight", vec![u64::MAX, 2], 0, f32s(&[0.5; 20]))],
    );
    for (name, bytes, want) in [
        (
            "tensors",
            huge_tensors,
            "header tensor_count = 9223372036854775807",
        ),
        (
            "kvs",
            huge_kvs,
            "header metadata_kv_count = 9223372036854775807",
        ),
        ("array", huge_array, "array length = 9223372036854775807"),
        (
            "dims",
            huge_dims,
            "tensor `token_embd.weight` has dims [18446744073709551615, 2], whose product",
        ),
    ] {
        let p = write(&format!("huge-{name}"), &bytes);
        let e = GgufFile::open(&p).err().unwrap().to_string();
        assert!(
            e.contains(&p.display().to_string())
                && e.contains(want)
                && e.contains("re-download or re-convert"),
            "{name}: {e}"
        );
        let _ = std::fs::remove_file(p);
    }

    // A GGUF whose metadata has zero heads is refused at import, naming the key.
    let zero_heads = gguf_bytes(|w| llama_shape_kvs(w, 0), &[]);
    let p = write("zero-kv-heads", &zero_heads);
    let out = std::env::temp_dir().join(format!("yatt-gguf-zero-out-{}", std::process::id()));
    let e = import_gguf(&p, &out, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("`llama.attention.head_count_kv` = 0: expected a positive divisor of attention.head_count (2)"),
        "{e}"
    );
    let _ = std::fs::remove_file(p);
}

#[test]
fn smollm2_import_has_expected_layout() {
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let g = GgufFile::open(yatt_engine::fixtures::smollm2_gguf().unwrap()).unwrap();
    assert_eq!(
        g.get("general.architecture").and_then(|v| v.as_str()),
        Some("llama")
    );
    let cfg = yatt_engine::ModelConfig::from_dir(&dir).unwrap();
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.num_attention_heads,
            cfg.num_key_value_heads
        ),
        (576, 30, 9, 3)
    );
    assert!(cfg.tie_word_embeddings);
    let tok = yatt_engine::Tokenizer::from_dir(&dir).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    assert_eq!(tok.token_id("<|im_end|>"), Some(2));
    assert!(tok.eos_ids.contains(&2));
    assert!(tok.chat_template().unwrap().contains("<|im_start|>"));
}

/// A Qwen3 GGUF (q/k norms, head_dim from `attention.key_length` unlike hidden / heads)
/// imports as `model_type = "qwen3"` with its tensors unpermuted and its norms kept; an
/// architecture yatt does not run is refused by name.
#[test]
fn qwen3_gguf_imports_with_qk_norm_and_head_dim() {
    let kvs = |arch: &'static str| {
        move |w: &mut W| -> u64 {
            w.kv_str("general.architecture", arch);
            w.kv_u32(&format!("{arch}.embedding_length"), 4);
            w.kv_u32(&format!("{arch}.block_count"), 1);
            w.kv_u32(&format!("{arch}.feed_forward_length"), 8);
            w.kv_u32(&format!("{arch}.attention.head_count"), 2);
            w.kv_u32(&format!("{arch}.attention.head_count_kv"), 1);
            w.kv_u32(&format!("{arch}.attention.key_length"), 4);
            w.kv_f32(&format!("{arch}.attention.layer_norm_rms_epsilon"), 1e-6);
            w.kv_str("tokenizer.ggml.model", "gpt2");
            w.kv_str("tokenizer.ggml.pre", "qwen2");
            w.kv_strs(
                "tokenizer.ggml.tokens",
                &["<|endoftext|>", "a", "b", "ab", "Ġ"],
            );
            w.kv_strs("tokenizer.ggml.merges", &["a b"]);
            12
        }
    };
    let vals =
        |n: usize, k: f32| -> Vec<f32> { (0..n).map(|i| ((i as f32) * 0.37 + k).sin()).collect() };
    // (GGUF name, ggml dims (columns first), values)
    let specs: Vec<(&str, Vec<u64>, Vec<f32>)> = vec![
        ("token_embd.weight", vec![4, 5], vals(20, 0.1)),
        ("output_norm.weight", vec![4], vals(4, 0.2)),
        ("blk.0.attn_norm.weight", vec![4], vals(4, 0.3)),
        ("blk.0.attn_q.weight", vec![4, 8], vals(32, 0.4)),
        ("blk.0.attn_k.weight", vec![4, 4], vals(16, 0.5)),
        ("blk.0.attn_v.weight", vec![4, 4], vals(16, 0.6)),
        ("blk.0.attn_q_norm.weight", vec![4], vals(4, 0.7)),
        ("blk.0.attn_k_norm.weight", vec![4], vals(4, 0.8)),
        ("blk.0.attn_output.weight", vec![8, 4], vals(32, 0.9)),
        ("blk.0.ffn_norm.weight", vec![4], vals(4, 1.0)),
        ("blk.0.ffn_gate.weight", vec![4, 8], vals(32, 1.1)),
        ("blk.0.ffn_up.weight", vec![4, 8], vals(32, 1.2)),
        ("blk.0.ffn_down.weight", vec![8, 4], vals(32, 1.3)),
    ];
    let tensors: Vec<(&str, Vec<u64>, u32, Vec<u8>)> = specs
        .iter()
        .map(|(n, d, v)| (*n, d.clone(), 0, f32s(v)))
        .collect();
    let p = write("qwen3", &gguf_bytes(kvs("qwen3"), &tensors));
    let out = std::env::temp_dir().join(format!("yatt-gguf-qwen3-{}", std::process::id()));
    let r = import_gguf(&p, &out, &Default::default()).unwrap();
    assert_eq!(r.architecture, "qwen3");
    let cfg = yatt_engine::ModelConfig::from_dir(&out).unwrap();
    assert_eq!(cfg.architecture, yatt_engine::Architecture::Qwen3);
    assert!(cfg.qk_norm && !cfg.attention_bias);
    assert_eq!(cfg.head_dim, 4);
    let m = yatt_engine::Llama::load(
        &out,
        yatt_engine::tch::Device::Cpu,
        yatt_engine::tch::Kind::Float,
    )
    .unwrap();
    let named: std::collections::HashMap<String, yatt_engine::tch::Tensor> =
        m.hf_named_tensors().into_iter().collect();
    for (gguf, hf) in [
        (
            "blk.0.attn_q_norm.weight",
            "model.layers.0.self_attn.q_norm.weight",
        ),
        (
            "blk.0.attn_k_norm.weight",
            "model.layers.0.self_attn.k_norm.weight",
        ),
        (
            "blk.0.attn_q.weight",
            "model.layers.0.self_attn.q_proj.weight",
        ),
    ] {
        let src = &specs.iter().find(|s| s.0 == gguf).unwrap().2;
        let got: Vec<f32> = Vec::try_from(&named[hf].contiguous().view([-1])).unwrap();
        assert_eq!(
            &got, src,
            "{hf} differs from {gguf} (Qwen rows are not permuted)"
        );
    }
    let logits = m.forward(
        &yatt_engine::tch::Tensor::from_slice(&[1i64, 2, 3]).unsqueeze(0),
        None,
    );
    assert!(logits.isfinite().all().int64_value(&[]) == 1);
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(p);

    let p = write("gemma", &gguf_bytes(kvs("gemma"), &tensors));
    let e = import_gguf(&p, &out, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("\"gemma\"") && e.contains("qwen3"), "{e}");
    let _ = std::fs::remove_file(p);
}

/// A Llama 3.1+ GGUF keeps its `llama3` RoPE scaling only as per-frequency divisors
/// (`rope_freqs.weight`, computed here as llama.cpp's converter does): the import writes
/// the `rope_scaling` that reproduces them, and refuses divisors no such scaling gives.
#[test]
fn llama3_rope_freqs_import_as_rope_scaling() {
    // head_dim 8 and base 500,000: wavelengths 6, 167, 4,443 and 118,000 positions,
    // one in each band (kept, kept, smoothed, divided by the factor).
    let (theta, hd) = (500000f64, 8usize);
    let factors: Vec<f32> = (0..hd / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf(2.0 * i as f64 / hd as f64);
            let wl = 2.0 * std::f64::consts::PI / freq;
            let (low_wl, high_wl) = (8192.0 / 1.0, 8192.0 / 4.0);
            let f: f64 = if wl < high_wl {
                1.0
            } else if wl > low_wl {
                32.0
            } else {
                let smooth = (8192.0 / wl - 1.0) / (4.0 - 1.0);
                1.0 / ((1.0 - smooth) / 32.0 + smooth)
            };
            f as f32
        })
        .collect();
    assert!(
        factors[2] > 1.0 && factors[2] < 32.0 && factors[3] == 32.0,
        "{factors:?}"
    );
    let kvs = |w: &mut W| -> u64 {
        w.kv_str("general.architecture", "llama");
        w.kv_u32("llama.embedding_length", 16);
        w.kv_u32("llama.block_count", 1);
        w.kv_u32("llama.feed_forward_length", 8);
        w.kv_u32("llama.attention.head_count", 2);
        w.kv_f32("llama.rope.freq_base", 500000.0);
        w.kv_str("tokenizer.ggml.model", "gpt2");
        w.kv_str("tokenizer.ggml.pre", "llama-bpe");
        w.kv_strs(
            "tokenizer.ggml.tokens",
            &["<|endoftext|>", "a", "b", "ab", "Ġ"],
        );
        w.kv_strs("tokenizer.ggml.merges", &["a b"]);
        10
    };
    let file = |name: &str, f: &[f32]| {
        write(
            name,
            &gguf_bytes(
                kvs,
                &[
                    ("token_embd.weight", vec![16, 5], 0, f32s(&[0.5; 80])),
                    ("rope_freqs.weight", vec![4], 0, f32s(f)),
                ],
            ),
        )
    };
    let p = file("rope-freqs", &factors);
    let out = std::env::temp_dir().join(format!("yatt-gguf-rope-freqs-{}", std::process::id()));
    import_gguf(&p, &out, &Default::default()).unwrap();
    let cfg = yatt_engine::ModelConfig::from_dir(&out).unwrap();
    assert_eq!(
        cfg.rope_scaling,
        Some(yatt_engine::RopeScaling::Llama3 {
            factor: 32.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192.0
        })
    );
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(p);

    let mut odd = factors.clone();
    odd[2] *= 1.5;
    let p = file("rope-freqs-odd", &odd);
    let e = import_gguf(&p, &out, &Default::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rope_freqs.weight") && e.contains("does not match"),
        "{e}"
    );
    let _ = std::fs::remove_file(p);
}

/// Regression (found by the `gguf` fuzz target, `engine/fuzz`): a file listing a tensor
/// twice imported until the safetensors writer, which panicked (index out of bounds).
/// The parser now refuses a tensor name or a metadata key given twice, and the import
/// two GGUF names that map to one HF name (`blk.0.` and `blk.00.`), naming the file.
#[test]
fn repeated_tensor_names_and_keys_are_errors_not_panics() {
    let norm = |name: &'static str| (name, vec![4], 0, f32s(&[1.0; 4]));
    let embd = ("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20]));
    let twice_tensor = gguf_bytes(
        tiny_llama_kvs,
        &[
            embd.clone(),
            norm("blk.0.attn_norm.weight"),
            norm("blk.0.attn_norm.weight"),
        ],
    );
    let twice_key = gguf_bytes(
        |w| {
            w.kv_u32("llama.block_count", 1);
            tiny_llama_kvs(w) + 1
        },
        &[embd.clone()],
    );
    // The fuzzer's input, minimised (`cargo fuzz tmin`): a Qwen2 file listing
    // blk.0.attn_v.weight twice.
    let found = include_bytes!("data/fuzz-gguf-tensor-twice.gguf").to_vec();
    for (bytes, want) in [
        (found, "tensor `blk.0.attn_v.weight` appears twice"),
        (
            twice_tensor,
            "tensor `blk.0.attn_norm.weight` appears twice",
        ),
        (twice_key, "metadata key `llama.block_count` appears twice"),
    ] {
        let e = GgufFile::from_bytes("twice.gguf", bytes)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("twice.gguf") && e.contains(want) && e.contains("re-convert"),
            "{e}"
        );
    }

    let (e, path) = import_err(
        "same-hf-name",
        &gguf_bytes(
            tiny_llama_kvs,
            &[
                embd,
                norm("blk.0.attn_norm.weight"),
                norm("blk.00.attn_norm.weight"),
            ],
        ),
    );
    assert!(
        e.contains(&path)
            && e.contains("`blk.0.attn_norm.weight` and `blk.00.attn_norm.weight`")
            && e.contains("model.layers.0.input_layernorm.weight"),
        "{e}"
    );
}

/// llama.cpp's Q/K row permutation is undone per head of head_dim rows. With 2^40 heads
/// of 2 dims and a 4-row attn_q, the import wrote a model the loader refuses, after
/// looping over 2^40 heads of no rows (2^41 empty iterations: optimised builds drop the
/// loop, debug builds run it for hours). Found reviewing the code for the `gguf` fuzz
/// target; a Q/K tensor whose rows are not heads × head_dim is an error naming the tensor
/// and the file now.
#[test]
fn qk_rows_must_be_heads_times_head_dim() {
    let kvs = |w: &mut W| {
        w.kv_str("general.architecture", "llama");
        w.kv_u32("llama.embedding_length", 4);
        w.kv_u32("llama.block_count", 1);
        w.kv_u32("llama.feed_forward_length", 8);
        w.kv_u64("llama.attention.head_count", 1 << 40);
        w.kv_u32("llama.attention.key_length", 2);
        w.kv_str("tokenizer.ggml.model", "gpt2");
        w.kv_strs("tokenizer.ggml.tokens", &["a", "b", "ab", "c", "d"]);
        w.kv_strs("tokenizer.ggml.merges", &["a b"]);
        9
    };
    let (e, path) = import_err(
        "qk-rows",
        &gguf_bytes(
            kvs,
            &[
                ("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20])),
                ("blk.0.attn_q.weight", vec![4, 4], 0, f32s(&[0.5; 16])),
            ],
        ),
    );
    assert!(
        e.contains(&path)
            && e.contains("tensor `blk.0.attn_q.weight` has 4 rows, the metadata implies 1099511627776 heads × head_dim 2"),
        "{e}"
    );
}

/// Regression (found by the `gguf` fuzz target, `engine/fuzz`, in its 900 s run): a
/// tensor with a zero dim has no elements, so its bytes fit any file, but the import's
/// safetensors writer multiplies the shape in its own order and overflowed on the other
/// dims (a panic with overflow checks, a wrapped size without). The parser now refuses
/// dims whose product, zeros left out, does not fit in an i64, naming the tensor and the
/// file.
#[test]
fn zero_size_tensors_with_overflowing_dims_are_errors_not_panics() {
    let with_k = |dims: Vec<u64>| {
        gguf_bytes(
            tiny_llama_kvs,
            &[
                ("token_embd.weight", vec![4, 5], 0, f32s(&[0.5; 20])),
                ("blk.0.attn_k.weight", dims, 0, Vec::new()),
            ],
        )
    };
    // The fuzzer's input: a Llama whose attn_k has dims [4, 0, ~2^61.5, ~2^62.7, ~2^58.7, 2^26].
    let found = include_bytes!("data/fuzz-gguf-zero-dim-overflow.gguf").to_vec();
    for (bytes, want) in [
        (found, "tensor `blk.0.attn_k.weight` has dims [4, 0, 3314649325744685056"),
        (
            with_k(vec![4, 0, 1 << 61, 1 << 62]),
            "tensor `blk.0.attn_k.weight` has dims [4, 0, 2305843009213693952, 4611686018427387904]",
        ),
        // 2^63 fits in a u64, not in libtorch's i64 sizes.
        (
            with_k(vec![2, 0, 1 << 62]),
            "tensor `blk.0.attn_k.weight` has dims [2, 0, 4611686018427387904]",
        ),
    ] {
        let e = GgufFile::from_bytes("zero-dim.gguf", bytes.clone())
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("zero-dim.gguf")
                && e.contains(want)
                && e.contains("does not fit in 63 bits")
                && e.contains("re-convert"),
            "{e}"
        );
        let (e, path) = import_err("zero-dim", &bytes);
        assert!(e.contains(&path) && e.contains(want), "{e}");
    }
    // At the bound (4 · 2^31 · 2^29 = 2^62, zeros left out) a zero-size tensor parses and
    // imports (the model loader judges its shape).
    let ok = with_k(vec![4, 0, 1 << 31, 1 << 29]);
    let g = GgufFile::from_bytes("zero-dim.gguf", ok.clone()).unwrap();
    assert_eq!(g.tensor("blk.0.attn_k.weight").unwrap().numel(), 0);
    let p = write("zero-dim-ok", &ok);
    let out =
        std::env::temp_dir().join(format!("yatt-gguf-out-zero-dim-ok-{}", std::process::id()));
    let report = import_gguf(&p, &out, &Default::default());
    let _ = std::fs::remove_dir_all(&out);
    let _ = std::fs::remove_file(&p);
    assert_eq!(report.unwrap().tensors, 2);
}
