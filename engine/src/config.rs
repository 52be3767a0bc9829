//! The model configuration, read from an HF `config.json`.

use crate::error::{EngineError, Result};
use serde_json::Value;
use std::path::Path;

/// Rotary-embedding frequency scaling.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor` (HF "linear").
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.x frequency-band scaling (HF "llama3").
    Llama3 {
        /// Scale of the low-frequency band.
        factor: f64,
        /// Lower band edge factor.
        low_freq_factor: f64,
        /// Upper band edge factor.
        high_freq_factor: f64,
        /// Pre-training context length.
        original_max_position_embeddings: f64,
    },
}

/// Which HF decoder family a config describes. The families differ only in the typed
/// options of [`ModelConfig`] (biases, q/k norm, window, RoPE scaling); the enum keeps
/// the family's defaults and what its config keys mean in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    /// `llama` (and SmolLM's `smollm`/`smollm2` aliases): the base decoder.
    Llama,
    /// `mistral`: Llama plus an optional sliding attention window on every layer.
    Mistral,
    /// `qwen2` (Qwen2 and Qwen2.5): biases on q/k/v; optional window on upper layers.
    Qwen2,
    /// `qwen3`: per-head RMSNorm on q and k, explicit `head_dim`, no biases.
    Qwen3,
}

impl Architecture {
    /// The `model_type` values yatt runs, as they appear in config.json.
    pub const MODEL_TYPES: [&'static str; 6] =
        ["llama", "smollm", "smollm2", "mistral", "qwen2", "qwen3"];

    /// The family of an HF `model_type`.
    pub fn from_model_type(t: &str) -> Option<Self> {
        Some(match t {
            "llama" | "smollm" | "smollm2" => Architecture::Llama,
            "mistral" => Architecture::Mistral,
            "qwen2" => Architecture::Qwen2,
            "qwen3" => Architecture::Qwen3,
            _ => return None,
        })
    }
}

/// A sliding attention window: a token attends to itself and the `size - 1` tokens
/// before it (HF's `kv_idx > q_idx - sliding_window`), on the layers it applies to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlidingWindow {
    /// Positions a token sees, itself included.
    pub size: i64,
    /// Per layer, whether the window applies (Mistral: all; Qwen2/3: HF's `layer_types`).
    pub layers: Vec<bool>,
}

/// A Llama-family decoder configuration.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    /// HF `model_type` (llama, qwen2, mistral, ...).
    pub model_type: String,
    /// The decoder family `model_type` names.
    pub architecture: Architecture,
    /// Width of the residual stream.
    pub hidden_size: i64,
    /// Width of the SwiGLU MLP.
    pub intermediate_size: i64,
    /// Number of decoder layers.
    pub num_hidden_layers: i64,
    /// Query heads.
    pub num_attention_heads: i64,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: i64,
    /// Per-head width.
    pub head_dim: i64,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: i64,
    /// Longest supported context.
    pub max_position_embeddings: i64,
    /// Whether the LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Whether q/k/v projections have biases (Qwen2).
    pub attention_bias: bool,
    /// Whether q and k get an RMSNorm over each head before RoPE (Qwen3's
    /// `self_attn.q_norm` / `k_norm`, weights `[head_dim]`).
    pub qk_norm: bool,
    /// The sliding attention window, if any (Mistral; Qwen2/3 with `use_sliding_window`).
    pub sliding_window: Option<SlidingWindow>,
    /// Beginning-of-sequence token.
    pub bos_token_id: Option<i64>,
    /// End-of-sequence tokens (several allowed).
    pub eos_token_ids: Vec<i64>,
    /// The original `config.json` value (written back by checkpoints).
    pub raw: Value,
}

/// The most decoder layers, and the widest attention head, a config may ask for: far
/// past any real decoder (Llama 3.1 405B has 126 layers; the widest heads, Gemma's, 256
/// dims). A larger value is a corrupt file, and reading the config alone allocates per
/// layer (the window table) and per head dim (the rotary frequencies).
const MAX_LAYERS: i64 = 1 << 16;
const MAX_HEAD_DIM: i64 = 1 << 16;

fn ids(v: Option<&Value>) -> Vec<i64> {
    match v {
        Some(Value::Number(n)) => n.as_i64().into_iter().collect(),
        Some(Value::Array(a)) => a.iter().filter_map(Value::as_i64).collect(),
        _ => vec![],
    }
}

/// Rejects scaling factors that would make the rotary frequencies zero, infinite or NaN.
fn check_rope_scaling(rs: Option<&RopeScaling>) -> std::result::Result<(), String> {
    let bad = |k: &str, x: f64| {
        format!("rope_scaling.{k} = {x}: expected a positive finite number; fix `rope_scaling` in config.json")
    };
    match *rs.unwrap_or(&RopeScaling::Linear { factor: 1.0 }) {
        RopeScaling::Linear { factor } => {
            if !(factor.is_finite() && factor > 0.0) {
                return Err(bad("factor", factor));
            }
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => {
            for (k, x) in [
                ("factor", factor),
                ("low_freq_factor", low_freq_factor),
                ("high_freq_factor", high_freq_factor),
                (
                    "original_max_position_embeddings",
                    original_max_position_embeddings,
                ),
            ] {
                if !(x.is_finite() && x > 0.0) {
                    return Err(bad(k, x));
                }
            }
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "rope_scaling.high_freq_factor = {high_freq_factor} must exceed low_freq_factor ({low_freq_factor}); fix `rope_scaling` in config.json"
                ));
            }
        }
    }
    Ok(())
}

/// The `rope_scaling` (or transformers 5's `rope_parameters`) object: its type, then
/// that type's fields. Types HF computes differently from a fixed table (dynamic NTK
/// follows the sequence length, YaRN and LongRoPE rescale attention) are refused.
fn parse_rope_scaling(rs: &Value) -> std::result::Result<Option<RopeScaling>, String> {
    let ty = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    let f = |k: &str, d: f64| -> std::result::Result<f64, String> {
        match rs.get(k) {
            None | Some(Value::Null) => Ok(d),
            Some(x) => x.as_f64().ok_or_else(|| {
                format!(
                    "rope_scaling.{k} = {x}: expected a number; fix `rope_scaling` in config.json"
                )
            }),
        }
    };
    Ok(match ty {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: f("factor", 1.0)? }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: f("factor", 8.0)?,
            low_freq_factor: f("low_freq_factor", 1.0)?,
            high_freq_factor: f("high_freq_factor", 4.0)?,
            original_max_position_embeddings: f("original_max_position_embeddings", 8192.0)?,
        }),
        other => {
            return Err(format!(
                "rope_scaling type {other:?} is not implemented by yatt (supported: \"default\", \"linear\", \"llama3\"); \
                 a model that needs it would run with wrong positions, so it is refused"
            ))
        }
    })
}

/// Keys whose HF meaning yatt does not implement, refused by name rather than ignored.
fn refuse_unimplemented(v: &Value, arch: Architecture) -> std::result::Result<(), String> {
    let truthy = |k: &str| v.get(k).and_then(Value::as_bool).unwrap_or(false);
    if truthy("mlp_bias") {
        return Err(
            "mlp_bias = true: yatt's MLP has no biases; only checkpoints with mlp_bias = false run"
                .into(),
        );
    }
    // Llama and Qwen3 put `attention_bias` on o_proj too; yatt's biases are q/k/v only
    // (Qwen2's layout, which HF hard-codes and has no key for).
    if truthy("attention_bias") && matches!(arch, Architecture::Llama | Architecture::Qwen3) {
        return Err(format!(
            "attention_bias = true for model_type {arch:?}: HF then biases o_proj as well, which yatt does not implement; \
             only attention_bias = false runs for this family"
        ));
    }
    if let Some(p) = v.get("partial_rotary_factor").and_then(Value::as_f64) {
        if p != 1.0 {
            return Err(format!(
                "partial_rotary_factor = {p}: yatt rotates the whole head (1.0 only)"
            ));
        }
    }
    Ok(())
}

/// The window from `sliding_window`, and, for Qwen2/3, `use_sliding_window` and
/// `layer_types` (or `max_window_layers` in files without them), like HF.
fn sliding_window(
    v: &Value,
    arch: Architecture,
    layers: i64,
) -> std::result::Result<Option<SlidingWindow>, String> {
    let size = match v.get("sliding_window") {
        None | Some(Value::Null) => None,
        Some(x) => Some(x.as_i64().filter(|n| *n > 0).ok_or_else(|| {
            format!("sliding_window = {x}: expected a positive integer or null; fix `sliding_window` in config.json")
        })?),
    };
    let n = layers as usize;
    let per_layer: Vec<bool> = match (arch, v.get("layer_types")) {
        (_, Some(Value::Array(types))) => {
            if types.len() != n {
                return Err(format!(
                    "layer_types has {} entries, num_hidden_layers is {layers}; fix `layer_types` in config.json",
                    types.len()
                ));
            }
            types
                .iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => Err(format!(
                        "layer_types entry {t}: yatt runs \"full_attention\" and \"sliding_attention\" layers only"
                    )),
                })
                .collect::<std::result::Result<_, _>>()?
        }
        (Architecture::Mistral, _) => vec![true; n],
        (Architecture::Qwen2 | Architecture::Qwen3, _) => {
            let on = v
                .get("use_sliding_window")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            let from = v
                .get("max_window_layers")
                .and_then(Value::as_i64)
                .unwrap_or(layers);
            (0..layers).map(|i| on && i >= from).collect()
        }
        (Architecture::Llama, _) => vec![false; n],
    };
    // Qwen configs keep `sliding_window` set even when `use_sliding_window` is off; HF
    // then ignores it (and `layer_types`), and so does yatt.
    let qwen_off = matches!(arch, Architecture::Qwen2 | Architecture::Qwen3)
        && !v
            .get("use_sliding_window")
            .and_then(Value::as_bool)
            .unwrap_or(false);
    Ok(match size {
        Some(size) if !qwen_off && per_layer.iter().any(|&s| s) => Some(SlidingWindow {
            size,
            layers: per_layer,
        }),
        _ => None,
    })
}

impl ModelConfig {
    /// The attention window of layer `i`, if it has one.
    pub fn window(&self, layer: usize) -> Option<i64> {
        self.sliding_window
            .as_ref()
            .filter(|w| w.layers.get(layer).copied().unwrap_or(false))
            .map(|w| w.size)
    }

    /// Reads `config.json` from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let path = dir.as_ref().join("config.json");
        if !path.exists() {
            return Err(EngineError::Missing {
                what: "config.json",
                path,
                hint: "a model directory needs an HF config.json; `yatt import-gguf FILE DIR` writes one",
            });
        }
        let s = std::fs::read_to_string(&path).map_err(|e| EngineError::io("reading", &path, e))?;
        let v: Value = serde_json::from_str(&s).map_err(|e| EngineError::Json {
            path: path.clone(),
            source: e,
        })?;
        Self::from_json(&v).map_err(|msg| EngineError::Config { path, msg })
    }

    /// Parses a config from its JSON value.
    pub fn from_json(v: &Value) -> std::result::Result<Self, String> {
        let int = |k: &str| {
            v.get(k)
                .and_then(Value::as_i64)
                .ok_or_else(|| format!("`{k}` is missing or not an integer"))
        };
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("llama")
            .to_string();
        let architecture = Architecture::from_model_type(&model_type).ok_or_else(|| {
            format!(
                "model_type = {model_type:?} is not a decoder yatt runs (supported: {}); \
                 use a checkpoint of one of these families",
                Architecture::MODEL_TYPES.join(", ")
            )
        })?;
        refuse_unimplemented(v, architecture)?;
        let act = v
            .get("hidden_act")
            .and_then(Value::as_str)
            .unwrap_or("silu");
        if act != "silu" {
            return Err(format!(
                "hidden_act {act:?}: only \"silu\" (SwiGLU) is supported"
            ));
        }
        let pos = |k: &str| {
            let n = int(k)?;
            if n <= 0 {
                return Err(format!(
                    "{k} = {n}: expected a positive integer; fix `{k}` in config.json"
                ));
            }
            Ok(n)
        };
        let hidden_size = pos("hidden_size")?;
        let num_attention_heads = pos("num_attention_heads")?;
        let num_key_value_heads = match v.get("num_key_value_heads") {
            None | Some(Value::Null) => num_attention_heads,
            Some(_) => int("num_key_value_heads")?,
        };
        if num_key_value_heads <= 0 || num_attention_heads % num_key_value_heads != 0 {
            return Err(format!(
                "num_key_value_heads = {num_key_value_heads}: expected a positive divisor of num_attention_heads ({num_attention_heads}); \
                 fix `num_key_value_heads` in config.json (or remove it for full multi-head attention)"
            ));
        }
        let head_dim = match v.get("head_dim") {
            None | Some(Value::Null) => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(format!(
                        "hidden_size = {hidden_size} is not a multiple of num_attention_heads ({num_attention_heads}): \
                         the head width is undefined; fix one of them or set `head_dim` in config.json"
                    ));
                }
                hidden_size / num_attention_heads
            }
            Some(_) => int("head_dim")?,
        };
        if head_dim <= 0 || head_dim % 2 != 0 {
            return Err(format!(
                "head_dim = {head_dim}: expected a positive even number (rotary embeddings rotate pairs); \
                 fix `head_dim` (or hidden_size / num_attention_heads) in config.json"
            ));
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(format!(
                "head_dim = {head_dim}: expected at most {MAX_HEAD_DIM}; \
                 fix `head_dim` (or hidden_size / num_attention_heads) in config.json"
            ));
        }
        let intermediate_size = pos("intermediate_size")?;
        let num_hidden_layers = pos("num_hidden_layers")?;
        if num_hidden_layers > MAX_LAYERS {
            return Err(format!(
                "num_hidden_layers = {num_hidden_layers}: expected at most {MAX_LAYERS}; \
                 fix `num_hidden_layers` in config.json"
            ));
        }
        let vocab_size = pos("vocab_size")?;
        let max_position_embeddings = match v.get("max_position_embeddings") {
            None | Some(Value::Null) => 4096,
            Some(_) => pos("max_position_embeddings")?,
        };
        let float = |k: &str, d: f64| -> std::result::Result<f64, String> {
            let x = match v.get(k) {
                None | Some(Value::Null) => return Ok(d),
                Some(x) => x.as_f64().ok_or_else(|| {
                    format!("{k} = {x}: expected a number; fix `{k}` in config.json")
                })?,
            };
            if !(x.is_finite() && x > 0.0) {
                return Err(format!(
                    "{k} = {x}: expected a positive finite number; fix `{k}` in config.json"
                ));
            }
            Ok(x)
        };
        let rms_norm_eps = float("rms_norm_eps", 1e-6)?;
        // transformers 5 writes `rope_parameters` (theta and scaling in one object);
        // older files have top-level `rope_theta` and `rope_scaling`.
        let rope_params = v.get("rope_parameters").filter(|x| !x.is_null());
        let rope_theta = match rope_params.and_then(|p| p.get("rope_theta")) {
            Some(t) => t
                .as_f64()
                .filter(|x| x.is_finite() && *x > 0.0)
                .ok_or_else(|| {
                    format!("rope_parameters.rope_theta = {t}: expected a positive finite number; fix it in config.json")
                })?,
            None => float("rope_theta", 10000.0)?,
        };
        let rope_scaling = match rope_params.or_else(|| v.get("rope_scaling")) {
            None | Some(Value::Null) => None,
            Some(rs) => parse_rope_scaling(rs)?,
        };
        check_rope_scaling(rope_scaling.as_ref())?;
        let mut eos_token_ids = ids(v.get("eos_token_id"));
        eos_token_ids.dedup();
        let bos_token_id = v.get("bos_token_id").and_then(Value::as_i64);
        for (k, id) in eos_token_ids
            .iter()
            .map(|&id| ("eos_token_id", id))
            .chain(bos_token_id.map(|id| ("bos_token_id", id)))
        {
            if !(0..vocab_size).contains(&id) {
                return Err(format!(
                    "{k} = {id}: expected a token id in 0..vocab_size ({vocab_size}); fix `{k}` or `vocab_size` in config.json"
                ));
            }
        }
        Ok(ModelConfig {
            model_type: model_type.clone(),
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta,
            rope_scaling,
            vocab_size,
            max_position_embeddings,
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            // HF's Qwen2 attention always has q/k/v biases, whatever the config says.
            attention_bias: architecture == Architecture::Qwen2,
            qk_norm: architecture == Architecture::Qwen3,
            sliding_window: sliding_window(v, architecture, num_hidden_layers)?,
            architecture,
            bos_token_id,
            eos_token_ids,
            raw: v.clone(),
        })
    }

    /// The inverse frequencies of the rotary embedding (length `head_dim / 2`).
    pub fn rope_inv_freq(&self) -> Vec<f64> {
        let d = self.head_dim as f64;
        let base = self.rope_theta;
        let mut inv: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / base.powf(2.0 * i as f64 / d))
            .collect();
        match self.rope_scaling {
            Some(RopeScaling::Linear { factor }) => inv.iter_mut().for_each(|f| *f /= factor),
            Some(RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            }) => {
                let low_wl = old / low_freq_factor;
                let high_wl = old / high_freq_factor;
                for f in inv.iter_mut() {
                    let wl = 2.0 * std::f64::consts::PI / *f;
                    if wl > low_wl {
                        *f /= factor;
                    } else if wl >= high_wl {
                        let smooth =
                            (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                        *f = (1.0 - smooth) * *f / factor + smooth * *f;
                    }
                }
            }
            _ => {}
        }
        inv
    }
}

/// A tiny Llama config (GQA, untied head, 97-token vocabulary): what the demo job trains
/// from random weights, and what fast tests build models from. Production API, not a test
/// fixture: `yatt train` without a model directory runs on it.
pub fn tiny_config() -> ModelConfig {
    ModelConfig::from_json(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "eos_token_id": 1, "bos_token_id": 0, "hidden_act": "silu"
    }))
    .expect("the tiny config is valid")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn parses_smollm_like() {
        let c = ModelConfig::from_json(&json!({"model_type":"llama","hidden_size":576,"intermediate_size":1536,
            "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
            "rope_theta":100000.0,"tie_word_embeddings":true,"eos_token_id":[2, 2]}))
        .unwrap();
        assert_eq!(c.head_dim, 64);
        assert_eq!(c.eos_token_ids, vec![2]);
        assert_eq!(c.rope_inv_freq().len(), 32);
        assert_eq!(c.rope_inv_freq()[0], 1.0);
    }

    #[test]
    fn rejects_bad() {
        let e = ModelConfig::from_json(&json!({"model_type":"gpt2"})).unwrap_err();
        assert!(e.contains("gpt2"));
        let e = ModelConfig::from_json(
            &json!({"hidden_size":8,"num_attention_heads":3,"num_key_value_heads":2}),
        )
        .unwrap_err();
        assert!(e.contains("positive divisor of num_attention_heads"), "{e}");
    }

    /// Regression (found by the `model_config` fuzz target, `engine/fuzz`): a huge
    /// `num_hidden_layers` made the window table allocate one entry per layer (ASan:
    /// allocation-size-too-big, an abort); a huge `head_dim` would have done the same in
    /// `rope_inv_freq`, which the target calls next. Both are errors naming the key now.
    #[test]
    fn absurd_layer_counts_and_head_dims_are_errors_not_aborts() {
        // The fuzzer's input as libFuzzer's crash minimisation (`cargo fuzz tmin`) left
        // it: 2.3 GB of window flags.
        let text = r#"{"hidden_size":4,"intermediate_size":8,"num_hidden_layers":2333333333,"num_attention_heads":2,"vocab_size":7}"#;
        let v: Value = serde_json::from_str(text).unwrap();
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(
            e.contains("num_hidden_layers = 2333333333: expected at most 65536")
                && e.contains("fix `num_hidden_layers`"),
            "{e}"
        );
        let mut v = v;
        v["num_hidden_layers"] = json!(MAX_LAYERS);
        assert!(ModelConfig::from_json(&v).is_ok());
        v["head_dim"] = json!(1i64 << 40);
        let e = ModelConfig::from_json(&v).unwrap_err();
        assert!(
            e.contains("head_dim = 1099511627776: expected at most 65536"),
            "{e}"
        );
        v["head_dim"] = json!(MAX_HEAD_DIM);
        assert_eq!(
            ModelConfig::from_json(&v).unwrap().rope_inv_freq().len(),
            1 << 15
        );
    }

    #[test]
    fn linear_scaling_divides() {
        let mut c = ModelConfig::from_json(
            &json!({"hidden_size":8,"intermediate_size":8,"num_hidden_layers":1,
            "num_attention_heads":2,"vocab_size":4}),
        )
        .unwrap();
        let base = c.rope_inv_freq();
        c.rope_scaling = Some(RopeScaling::Linear { factor: 4.0 });
        let s = c.rope_inv_freq();
        assert!((s[1] - base[1] / 4.0).abs() < 1e-12);
    }
}
