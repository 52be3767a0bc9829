//! Writes an HF-format model directory from a GGUF file.

use super::file::{GgufFile, GgufTensorInfo, GgufValue};
use super::tokenizer::build_tokenizer_json;
use crate::error::{EngineError, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// What the imported weights are stored as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ImportDtype {
    /// 32-bit floats (exact dequantized values).
    #[default]
    F32,
    /// bfloat16 (half the size; rounds the dequantized values).
    Bf16,
}

/// Options for [`import_gguf`].
#[derive(Debug, Clone, Default)]
pub struct ImportOptions {
    /// The dtype of the written safetensors.
    pub dtype: ImportDtype,
}

/// What [`import_gguf`] wrote.
#[derive(Debug, Clone)]
pub struct ImportReport {
    /// The output directory.
    pub out_dir: PathBuf,
    /// GGUF architecture (e.g. `llama`).
    pub architecture: String,
    /// Number of tensors written.
    pub tensors: usize,
    /// Number of parameters written.
    pub parameters: u64,
    /// GGUF tensor types seen, with their counts.
    pub source_types: BTreeMap<String, usize>,
}

fn meta_u64(g: &GgufFile, key: &str) -> Result<u64> {
    g.get(key)
        .and_then(GgufValue::as_u64)
        .ok_or_else(|| EngineError::Config {
            path: g.path().into(),
            msg: format!("metadata key `{key}` is missing or not an integer"),
        })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let s = serde_json::to_string_pretty(v).map_err(|e| EngineError::Json {
        path: path.into(),
        source: e,
    })?;
    std::fs::write(path, s).map_err(|e| EngineError::io("writing", path, e))
}

/// Maps a GGUF tensor name to its HF name.
fn hf_name(name: &str) -> Option<String> {
    let direct = match name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(d) = direct {
        return Some(d.to_string());
    }
    let rest = name.strip_prefix("blk.")?;
    let (layer, part) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (stem, suffix) = part.rsplit_once('.')?;
    let hf = match stem {
        "attn_norm" => "input_layernorm",
        "ffn_norm" => "post_attention_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// The `llama3` `rope_scaling` whose per-frequency divisors are `factors` (GGUF's
/// `rope_freqs.weight`): the file keeps only the divisors, so the parameters Llama 3.1 to
/// 3.3 use (low/high frequency factors 1 and 4 over 8,192 original positions, `factor`
/// the largest divisor) are taken when they reproduce every divisor, and the file is
/// refused otherwise.
fn llama3_from_factors(config: &Value, factors: &[f32]) -> std::result::Result<Value, String> {
    let factor = factors.iter().copied().fold(f32::MIN, f32::max) as f64;
    let scaling = json!({"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192});
    let inv_freq = |rs: &Value| -> std::result::Result<Vec<f64>, String> {
        let mut c = config.clone();
        c["rope_scaling"] = rs.clone();
        Ok(crate::config::ModelConfig::from_json(&c)?.rope_inv_freq())
    };
    let (plain, scaled) = (inv_freq(&Value::Null)?, inv_freq(&scaling)?);
    let fits = plain.len() == factors.len()
        && plain
            .iter()
            .zip(&scaled)
            .zip(factors)
            .all(|((p, s), &f)| (p / s - f as f64).abs() <= 1e-4 * (p / s));
    if !fits {
        return Err(format!(
            "tensor rope_freqs.weight ({} per-frequency RoPE divisors, largest {factor}) does not match Llama 3's `llama3` \
             scaling (low_freq_factor 1, high_freq_factor 4, original_max_position_embeddings 8192) for head_dim {}; \
             yatt cannot write a config.json for it: load the original HF checkpoint instead",
            factors.len(),
            2 * plain.len()
        ));
    }
    Ok(scaling)
}

/// Undoes llama.cpp's rotary permutation of Q/K rows: GGUF row `h*hd + 2*j + i` holds HF
/// row `h*hd + i*hd/2 + j`.
pub(crate) fn unpermute_rows(data: &[f32], n_heads: usize, rows: usize, cols: usize) -> Vec<f32> {
    let hd = rows / n_heads;
    let half = hd / 2;
    let mut out = vec![0f32; data.len()];
    for h in 0..n_heads {
        for i in 0..2 {
            for j in 0..half {
                let dst = h * hd + i * half + j;
                let src = h * hd + 2 * j + i;
                out[dst * cols..(dst + 1) * cols]
                    .copy_from_slice(&data[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

/// Imports a GGUF file into an HF-format directory: `config.json`, `model.safetensors`,
/// `tokenizer.json`, `tokenizer_config.json`, `special_tokens_map.json`,
/// `generation_config.json` (and `chat_template.jinja` when the file has one).
pub fn import_gguf(
    file: impl AsRef<Path>,
    out_dir: impl AsRef<Path>,
    opts: &ImportOptions,
) -> Result<ImportReport> {
    let g = GgufFile::open(file.as_ref())?;
    let out_dir = out_dir.as_ref();
    let arch = g
        .get("general.architecture")
        .and_then(GgufValue::as_str)
        .unwrap_or("")
        .to_string();
    let (model_type, hf_arch, permute) = match arch.as_str() {
        "llama" => ("llama", "LlamaForCausalLM", true),
        // llama.cpp permutes Llama's q/k rows for its RoPE layout, not Qwen's.
        "qwen2" => ("qwen2", "Qwen2ForCausalLM", false),
        "qwen3" => ("qwen3", "Qwen3ForCausalLM", false),
        other => {
            return Err(EngineError::UnsupportedGguf(format!(
                "general.architecture = {other:?}; yatt imports \"llama\", \"qwen2\" and \"qwen3\" models"
            )))
        }
    };
    let k = |s: &str| format!("{arch}.{s}");
    let hidden = meta_u64(&g, &k("embedding_length"))?;
    let layers = meta_u64(&g, &k("block_count"))?;
    let ffn = meta_u64(&g, &k("feed_forward_length"))?;
    let n_heads = meta_u64(&g, &k("attention.head_count"))?;
    let n_kv = g
        .get(&k("attention.head_count_kv"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(n_heads);
    let bad_meta = |key: String, v: u64, expected: String| {
        EngineError::Config {
        path: g.path().into(),
        msg: format!(
            "metadata `{key}` = {v}: expected {expected}; the file is malformed, re-convert the model (e.g. with llama.cpp's convert_hf_to_gguf.py)"
        ),
    }
    };
    for (key, v) in [
        ("embedding_length", hidden),
        ("attention.head_count", n_heads),
    ] {
        if v == 0 {
            return Err(bad_meta(k(key), v, "a positive integer".into()));
        }
    }
    if n_kv == 0 || n_heads % n_kv != 0 {
        return Err(bad_meta(
            k("attention.head_count_kv"),
            n_kv,
            format!("a positive divisor of attention.head_count ({n_heads})"),
        ));
    }
    let ctx = g
        .get(&k("context_length"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(2048);
    let eps = g
        .get(&k("attention.layer_norm_rms_epsilon"))
        .and_then(GgufValue::as_f64)
        .unwrap_or(1e-5);
    let theta = g
        .get(&k("rope.freq_base"))
        .and_then(GgufValue::as_f64)
        .unwrap_or(10000.0);
    let head_dim = g
        .get(&k("attention.key_length"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(hidden / n_heads);
    let rope_dim = g
        .get(&k("rope.dimension_count"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(head_dim);
    if rope_dim != head_dim {
        return Err(EngineError::UnsupportedGguf(format!(
            "partial rotary embeddings (rope.dimension_count {rope_dim} != head dim {head_dim})"
        )));
    }
    // Llama 3.1+ GGUFs bake `llama3` RoPE scaling into per-frequency divisors.
    let rope_factors = match g.tensor("rope_freqs.weight") {
        Some(t) => Some(g.dequantize(t)?),
        None => None,
    };
    let tok_json = build_tokenizer_json(&g)?;
    let tokens = g
        .get("tokenizer.ggml.tokens")
        .and_then(GgufValue::as_array)
        .map(|a| a.len())
        .unwrap_or(0);
    let vocab = g
        .get(&k("vocab_size"))
        .and_then(GgufValue::as_u64)
        .unwrap_or(tokens as u64);
    let tok_id = |key: &str| g.get(key).and_then(GgufValue::as_u64);
    let bos = tok_id("tokenizer.ggml.bos_token_id");
    let eos = tok_id("tokenizer.ggml.eos_token_id");
    let pad = tok_id("tokenizer.ggml.padding_token_id");
    let unk = tok_id("tokenizer.ggml.unknown_token_id");
    let tied = g.tensor("output.weight").is_none();

    let mut rope_scaling = Value::Null;
    if let Some(ty) = g.get(&k("rope.scaling.type")).and_then(GgufValue::as_str) {
        let factor = g
            .get(&k("rope.scaling.factor"))
            .and_then(GgufValue::as_f64)
            .unwrap_or(1.0);
        match ty {
            "none" => {}
            "linear" => rope_scaling = json!({"rope_type": "linear", "factor": factor}),
            other => {
                return Err(EngineError::UnsupportedGguf(format!(
                    "metadata {} = {other:?}: yatt imports \"none\" and \"linear\" RoPE scaling",
                    k("rope.scaling.type")
                )))
            }
        }
    }

    std::fs::create_dir_all(out_dir).map_err(|e| EngineError::io("creating", out_dir, e))?;
    let mut config = json!({
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": ctx,
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "attention_bias": arch == "qwen2",
        "mlp_bias": false,
        "torch_dtype": match opts.dtype { ImportDtype::F32 => "float32", ImportDtype::Bf16 => "bfloat16" },
        "bos_token_id": bos,
        "eos_token_id": eos,
    });
    if let Some(p) = pad {
        config["pad_token_id"] = json!(p);
    }
    if let Some(factors) = &rope_factors {
        config["rope_scaling"] =
            llama3_from_factors(&config, factors).map_err(|msg| EngineError::Config {
                path: g.path().into(),
                msg,
            })?;
    }
    // What the model loader will check; failing here names the GGUF file, not a config.json
    // the import would have written.
    crate::config::ModelConfig::from_json(&config).map_err(|msg| EngineError::Config {
        path: g.path().into(),
        msg: format!("the config.json imported from its metadata is invalid: {msg}"),
    })?;
    write_json(&out_dir.join("config.json"), &config)?;

    // Tensors.
    let mut names: Vec<(String, &GgufTensorInfo)> = Vec::new();
    let mut source_types = BTreeMap::new();
    for t in g.tensors.iter().filter(|t| t.name != "rope_freqs.weight") {
        let name = hf_name(&t.name).ok_or_else(|| {
            EngineError::UnsupportedGguf(format!(
                "tensor `{}` has no HF counterpart known to yatt",
                t.name
            ))
        })?;
        if !t.ty.is_supported() {
            return Err(EngineError::UnsupportedGgufType {
                tensor: t.name.clone(),
                ty: t.ty.name(),
            });
        }
        *source_types.entry(t.ty.name()).or_insert(0) += 1;
        names.push((name, t));
    }
    names.sort_by(|a, b| a.0.cmp(&b.0));
    // GGUF names are unique (the parser checks), but two can map to one HF name
    // (`blk.1.` and `blk.01.`); safetensors cannot hold both.
    if let Some(w) = names.windows(2).find(|w| w[0].0 == w[1].0) {
        return Err(EngineError::GgufFormat {
            path: g.path().into(),
            msg: format!(
                "tensors `{}` and `{}` both map to the HF tensor `{}`: re-convert the model",
                w[0].1.name, w[1].1.name, w[0].0
            ),
        });
    }
    let mut blobs: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::with_capacity(names.len());
    let mut parameters = 0u64;
    for (name, t) in &names {
        let shape = t.shape();
        let mut data = g.dequantize(t)?;
        let permuted_heads = if t.name.ends_with("attn_q.weight") {
            Some(n_heads)
        } else if t.name.ends_with("attn_k.weight") {
            Some(n_kv)
        } else {
            None
        };
        if let (true, &[rows, cols], Some(heads)) = (permute, shape.as_slice(), permuted_heads) {
            // The permutation is per head of head_dim rows, so the rows must be exactly
            // that (else the loader refuses the shape anyway, and 2^40 heads of no rows
            // made 2^41 empty iterations).
            if heads.checked_mul(head_dim) != Some(rows as u64) {
                return Err(EngineError::GgufFormat {
                    path: g.path().into(),
                    msg: format!(
                        "tensor `{}` has {rows} rows, the metadata implies {heads} heads × head_dim {head_dim}: re-convert the model",
                        t.name
                    ),
                });
            }
            data = unpermute_rows(&data, heads as usize, rows, cols);
        }
        parameters += data.len() as u64;
        let bytes: Vec<u8> = match opts.dtype {
            ImportDtype::F32 => data.iter().flat_map(|x| x.to_le_bytes()).collect(),
            ImportDtype::Bf16 => data
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect(),
        };
        blobs.push((name.clone(), shape, bytes));
    }
    let st_dtype = match opts.dtype {
        ImportDtype::F32 => safetensors::Dtype::F32,
        ImportDtype::Bf16 => safetensors::Dtype::BF16,
    };
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = blobs
        .iter()
        .map(|(n, s, b)| {
            let v = safetensors::tensor::TensorView::new(st_dtype, s.clone(), b)
                .map_err(|e| EngineError::Weights(format!("{n}: {e}")))?;
            Ok((n.clone(), v))
        })
        .collect::<Result<_>>()?;
    let st_path = out_dir.join("model.safetensors");
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    safetensors::tensor::serialize_to_file(views, Some(meta), &st_path).map_err(|e| {
        EngineError::Safetensors {
            path: st_path.clone(),
            msg: e.to_string(),
        }
    })?;

    // Tokenizer files.
    write_json(&out_dir.join("tokenizer.json"), &tok_json)?;
    let tokens_arr = g.get("tokenizer.ggml.tokens").and_then(GgufValue::as_array);
    let tok_str = |id: Option<u64>| -> Value {
        id.and_then(|i| {
            tokens_arr
                .and_then(|a| a.get(i as usize))
                .and_then(GgufValue::as_str)
        })
        .map(|s| json!(s))
        .unwrap_or(Value::Null)
    };
    let template = g.get("tokenizer.chat_template").and_then(GgufValue::as_str);
    let mut tcfg = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": tok_str(bos),
        "eos_token": tok_str(eos),
        "unk_token": tok_str(unk),
        "pad_token": tok_str(pad),
        "add_bos_token": g.get("tokenizer.ggml.add_bos_token").and_then(GgufValue::as_bool).unwrap_or(false),
        "add_eos_token": g.get("tokenizer.ggml.add_eos_token").and_then(GgufValue::as_bool).unwrap_or(false),
        "clean_up_tokenization_spaces": false,
        "model_max_length": ctx,
    });
    if let Some(t) = template {
        tcfg["chat_template"] = json!(t);
        std::fs::write(out_dir.join("chat_template.jinja"), t)
            .map_err(|e| EngineError::io("writing", out_dir.join("chat_template.jinja"), e))?;
    }
    write_json(&out_dir.join("tokenizer_config.json"), &tcfg)?;
    let mut stm = serde_json::Map::new();
    for (k, id) in [
        ("bos_token", bos),
        ("eos_token", eos),
        ("unk_token", unk),
        ("pad_token", pad),
    ] {
        if id.is_some() {
            stm.insert(k.into(), tok_str(id));
        }
    }
    write_json(
        &out_dir.join("special_tokens_map.json"),
        &Value::Object(stm),
    )?;
    write_json(
        &out_dir.join("generation_config.json"),
        &json!({"bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad}),
    )?;

    Ok(ImportReport {
        out_dir: out_dir.into(),
        architecture: arch,
        tensors: blobs.len(),
        parameters,
        source_types,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(n_head, 2, hd/2, cols).swapaxes(1, 2).reshape(...)
        let (n_heads, hd, cols) = (2, 4, 3);
        let rows = n_heads * hd;
        let hf: Vec<f32> = (0..rows * cols).map(|x| x as f32).collect();
        let mut gguf = vec![0f32; hf.len()];
        for h in 0..n_heads {
            for i in 0..2 {
                for j in 0..hd / 2 {
                    let src = h * hd + i * (hd / 2) + j; // (h, i, j)
                    let dst = h * hd + j * 2 + i; // (h, j, i)
                    gguf[dst * cols..(dst + 1) * cols]
                        .copy_from_slice(&hf[src * cols..(src + 1) * cols]);
                }
            }
        }
        assert_eq!(unpermute_rows(&gguf, n_heads, rows, cols), hf);
    }

    #[test]
    fn names() {
        assert_eq!(
            hf_name("blk.12.attn_q.weight").unwrap(),
            "model.layers.12.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.0.ffn_down.weight").unwrap(),
            "model.layers.0.mlp.down_proj.weight"
        );
        assert_eq!(hf_name("output_norm.weight").unwrap(), "model.norm.weight");
        assert!(hf_name("blk.0.weird.weight").is_none());
    }
}
