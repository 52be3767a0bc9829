//! Building a model: from an HF directory, from named tensors, at random, or as a deep
//! copy of another.

use super::heads::ScalarHead;
use super::llama::{DecoderLayer, Llama};
use super::lora_types::AdapterDir;
use super::rope::rope_tables;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

fn take(map: &mut HashMap<String, Tensor>, name: &str) -> Result<Tensor> {
    map.remove(name).ok_or_else(|| {
        EngineError::Weights(format!("tensor `{name}` is missing from the checkpoint"))
    })
}

/// Refuses tensors the config does not name: a checkpoint whose config.json says fewer
/// layers (or no scalar head) than its weights hold would otherwise load as a smaller
/// model without a word. HF's rotary `inv_freq` buffers are recomputed, not parameters.
fn check_all_used(left: &HashMap<String, Tensor>, c: &ModelConfig) -> Result<()> {
    let mut extra: Vec<&str> = left
        .keys()
        .map(String::as_str)
        .filter(|n| !n.ends_with("rotary_emb.inv_freq"))
        .collect();
    if extra.is_empty() {
        return Ok(());
    }
    extra.sort_unstable();
    let shown = extra
        .iter()
        .take(4)
        .copied()
        .collect::<Vec<_>>()
        .join("`, `");
    Err(EngineError::Weights(format!(
        "{} tensor(s) the config does not name (`{shown}`{}); the config describes {} layers: \
         fix config.json (e.g. num_hidden_layers) to match the weights, or remove the extra tensors",
        extra.len(),
        if extra.len() > 4 { ", ..." } else { "" },
        c.num_hidden_layers
    )))
}

fn check_shape(name: &str, t: &Tensor, want: &[i64]) -> Result<()> {
    if t.size() != want {
        return Err(EngineError::Weights(format!(
            "tensor `{name}` has shape {:?}, the config implies {want:?}",
            t.size()
        )));
    }
    Ok(())
}

/// Reads every tensor of an HF model directory (`model.safetensors` or a sharded
/// `model.safetensors.index.json`), on the CPU in their stored dtype.
pub fn read_safetensors_dir(dir: &Path) -> Result<HashMap<String, Tensor>> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<std::path::PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let s =
            std::fs::read_to_string(&index).map_err(|e| EngineError::io("reading", &index, e))?;
        let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| EngineError::Json {
            path: index.clone(),
            source: e,
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| EngineError::Safetensors {
                path: index.clone(),
                msg: "no `weight_map` object".into(),
            })?;
        let mut fs: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        fs.sort();
        fs.dedup();
        fs.into_iter().map(|f| dir.join(f)).collect()
    } else {
        return Err(EngineError::Missing {
            what: "model weights",
            path: single,
            hint:
                "expected model.safetensors or model.safetensors.index.json in the model directory",
        });
    };
    let mut out = HashMap::new();
    for f in files {
        let ts = Tensor::read_safetensors(&f).map_err(|e| EngineError::Safetensors {
            path: f.clone(),
            msg: e.to_string(),
        })?;
        out.extend(ts);
    }
    Ok(out)
}

impl Llama {
    /// Loads an HF model directory onto `device` as `kind`. A PEFT adapter directory
    /// (`adapter_config.json`) loads as its base model with the adapters folded in:
    /// a plain model that computes what the adapted one does.
    pub fn load(dir: impl AsRef<Path>, device: Device, kind: Kind) -> Result<Self> {
        let dir = dir.as_ref();
        if AdapterDir::is_adapter_dir(dir) {
            let mut m = Llama::load_with_adapter(dir, device, kind)?;
            m.merge_lora();
            return Ok(m);
        }
        Self::load_base(dir, device, kind)
    }

    /// Loads an HF model directory (`config.json` + safetensors), ignoring adapters.
    pub(super) fn load_base(dir: &Path, device: Device, kind: Kind) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let tensors = read_safetensors_dir(dir)?;
        Self::from_tensors(config, tensors, device, kind)
    }

    /// Builds the model from HF-named tensors (any dtype/device; they are converted).
    pub fn from_tensors(
        config: ModelConfig,
        mut t: HashMap<String, Tensor>,
        device: Device,
        kind: Kind,
    ) -> Result<Self> {
        let c = &config;
        let (h, hd) = (c.hidden_size, c.head_dim);
        let (nq, nkv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let conv = |x: Tensor| x.to_device(device).to_kind(kind).contiguous();
        // Matrices are stored input-major (transposed).
        let conv_t = |x: Tensor| x.to_device(device).to_kind(kind).tr().contiguous();
        let embed = take(&mut t, "model.embed_tokens.weight")?;
        check_shape("model.embed_tokens.weight", &embed, &[c.vocab_size, h])?;
        let mut layers = Vec::new();
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            let g = |t: &mut HashMap<String, Tensor>, n: &str, shape: &[i64]| -> Result<Tensor> {
                let name = format!("{p}.{n}");
                let x = take(t, &name)?;
                check_shape(&name, &x, shape)?;
                Ok(x)
            };
            let q = g(&mut t, "self_attn.q_proj.weight", &[nq, h])?;
            let k = g(&mut t, "self_attn.k_proj.weight", &[nkv, h])?;
            let v = g(&mut t, "self_attn.v_proj.weight", &[nkv, h])?;
            let bqkv = if c.attention_bias {
                let qb = g(&mut t, "self_attn.q_proj.bias", &[nq])?;
                let kb = g(&mut t, "self_attn.k_proj.bias", &[nkv])?;
                let vb = g(&mut t, "self_attn.v_proj.bias", &[nkv])?;
                Some(conv(Tensor::cat(
                    &[
                        qb.to_kind(Kind::Float),
                        kb.to_kind(Kind::Float),
                        vb.to_kind(Kind::Float),
                    ],
                    0,
                )))
            } else {
                None
            };
            let qk_norm = if c.qk_norm {
                let qn = g(&mut t, "self_attn.q_norm.weight", &[hd])?;
                let kn = g(&mut t, "self_attn.k_norm.weight", &[hd])?;
                Some((conv(qn), conv(kn)))
            } else {
                None
            };
            let f = c.intermediate_size;
            let gate = g(&mut t, "mlp.gate_proj.weight", &[f, h])?;
            let up = g(&mut t, "mlp.up_proj.weight", &[f, h])?;
            layers.push(DecoderLayer {
                ln1: conv(g(&mut t, "input_layernorm.weight", &[h])?),
                wqkv: conv_t(Tensor::cat(
                    &[
                        q.to_kind(Kind::Float),
                        k.to_kind(Kind::Float),
                        v.to_kind(Kind::Float),
                    ],
                    0,
                )),
                bqkv,
                qk_norm,
                wo: conv_t(g(&mut t, "self_attn.o_proj.weight", &[h, nq])?),
                ln2: conv(g(&mut t, "post_attention_layernorm.weight", &[h])?),
                w_gate_up: conv_t(Tensor::cat(
                    &[gate.to_kind(Kind::Float), up.to_kind(Kind::Float)],
                    0,
                )),
                w_down: conv_t(g(&mut t, "mlp.down_proj.weight", &[h, f])?),
            });
        }
        let norm = conv(take(&mut t, "model.norm.weight")?);
        let lm_head = if c.tie_word_embeddings {
            t.remove("lm_head.weight");
            None
        } else {
            let w = take(&mut t, "lm_head.weight")?;
            check_shape("lm_head.weight", &w, &[c.vocab_size, h])?;
            Some(conv_t(w))
        };
        let mut head = None;
        for prefix in ["score", "v_head"] {
            if let Some(w) = t.remove(&format!("{prefix}.weight")) {
                check_shape(&format!("{prefix}.weight"), &w, &[1, h])?;
                let b = t.remove(&format!("{prefix}.bias")).map(conv);
                head = Some(ScalarHead {
                    prefix: prefix.into(),
                    weight: conv(w),
                    bias: b,
                });
            }
        }
        check_all_used(&t, c)?;
        let (cos, sin) = rope_tables(&config, device);
        Ok(Llama {
            embed: conv_t(embed),
            layers,
            norm,
            lm_head,
            head,
            device,
            kind,
            cos,
            sin,
            config,
            packed: None,
            lora: None,
            merge_base: None,
            memory: Default::default(),
        })
    }

    /// A randomly initialised model (normal(0, 0.02) matrices, unit norms), for tests.
    pub fn random(config: ModelConfig, device: Device, kind: Kind, seed: i64) -> Result<Self> {
        tch::manual_seed(seed);
        let c = &config;
        let (h, hd, f) = (c.hidden_size, c.head_dim, c.intermediate_size);
        let (nq, nkv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let r = |shape: &[i64]| Tensor::randn(shape, (Kind::Float, Device::Cpu)) * 0.02;
        let mut t = HashMap::new();
        t.insert(
            "model.embed_tokens.weight".to_string(),
            r(&[c.vocab_size, h]),
        );
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            t.insert(
                format!("{p}.input_layernorm.weight"),
                Tensor::ones([h], (Kind::Float, Device::Cpu)),
            );
            t.insert(
                format!("{p}.post_attention_layernorm.weight"),
                Tensor::ones([h], (Kind::Float, Device::Cpu)),
            );
            t.insert(format!("{p}.self_attn.q_proj.weight"), r(&[nq, h]));
            t.insert(format!("{p}.self_attn.k_proj.weight"), r(&[nkv, h]));
            t.insert(format!("{p}.self_attn.v_proj.weight"), r(&[nkv, h]));
            if c.attention_bias {
                t.insert(format!("{p}.self_attn.q_proj.bias"), r(&[nq]));
                t.insert(format!("{p}.self_attn.k_proj.bias"), r(&[nkv]));
                t.insert(format!("{p}.self_attn.v_proj.bias"), r(&[nkv]));
            }
            if c.qk_norm {
                for n in ["q_norm", "k_norm"] {
                    t.insert(
                        format!("{p}.self_attn.{n}.weight"),
                        Tensor::ones([hd], (Kind::Float, Device::Cpu)),
                    );
                }
            }
            t.insert(format!("{p}.self_attn.o_proj.weight"), r(&[h, nq]));
            t.insert(format!("{p}.mlp.gate_proj.weight"), r(&[f, h]));
            t.insert(format!("{p}.mlp.up_proj.weight"), r(&[f, h]));
            t.insert(format!("{p}.mlp.down_proj.weight"), r(&[h, f]));
        }
        t.insert(
            "model.norm.weight".to_string(),
            Tensor::ones([h], (Kind::Float, Device::Cpu)),
        );
        if !c.tie_word_embeddings {
            t.insert("lm_head.weight".to_string(), r(&[c.vocab_size, h]));
        }
        Self::from_tensors(config, t, device, kind)
    }

    /// A deep copy on `device` as `kind` (e.g. a frozen reference policy). The copy does
    /// not require gradients; LoRA adapters are folded into its weights.
    pub fn deep_copy(&self, device: Device, kind: Kind) -> Result<Llama> {
        let tensors: HashMap<String, Tensor> = tch::no_grad(|| {
            self.merged_hf_named_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.detach().to_device(device).to_kind(kind).copy()))
                .collect()
        });
        let mut m = Llama::from_tensors(self.config.clone(), tensors, device, kind)?;
        m.set_requires_grad(false);
        m.memory = self.memory;
        Ok(m)
    }
}
