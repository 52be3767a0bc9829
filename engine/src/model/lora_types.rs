//! LoRA adapters on the decoder's linear layers, in PEFT's layout and names: the
//! settings, the adapter tensors and PEFT's files (what the decoder's LoRA methods in
//! `lora.rs` work on; this file imports no other file of the model, so the decoder's
//! files can name these types without an import cycle).
//!
//! A targeted projection computes `x·W + s·(x·A)·B` with `A` `[in, r]`, `B` `[r, out]`
//! (stored input-major like the base matrices; PEFT's `lora_A.weight` is `Aᵀ`
//! `[r, in]`, `lora_B.weight` is `Bᵀ` `[out, r]`) and `s = alpha / r`. While adapters
//! are attached only they (and a scalar head) are trainable: the base stays frozen, so
//! AdamW keeps state for a few MB instead of the whole model.
//!
//! Inference models take adapter updates by folding them into their own matrices
//! ([`Llama::copy_weights_from`] with adapter names): they keep a copy of the base
//! matrices they fold into, so every update is `W = W_base + s·A·B`, exactly, however
//! many arrive. The fused CPU decode step then runs on plain matrices.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A linear layer LoRA can adapt (PEFT's `target_modules` names).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum LoraTarget {
    /// `self_attn.q_proj`.
    QProj,
    /// `self_attn.k_proj`.
    KProj,
    /// `self_attn.v_proj`.
    VProj,
    /// `self_attn.o_proj`.
    OProj,
    /// `mlp.gate_proj`.
    GateProj,
    /// `mlp.up_proj`.
    UpProj,
    /// `mlp.down_proj`.
    DownProj,
}

/// One of a layer's four stored (fused) matrices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Matrix {
    /// `wqkv`: q, k and v side by side.
    Qkv = 0,
    /// `wo`.
    O = 1,
    /// `w_gate_up`: gate and up side by side.
    GateUp = 2,
    /// `w_down`.
    Down = 3,
}

impl Matrix {
    /// The four, in index order.
    pub(super) const ALL: [Matrix; 4] = [Matrix::Qkv, Matrix::O, Matrix::GateUp, Matrix::Down];
}

impl LoraTarget {
    /// Every target, in the order of the columns they own.
    pub const ALL: [LoraTarget; 7] = [
        LoraTarget::QProj,
        LoraTarget::KProj,
        LoraTarget::VProj,
        LoraTarget::OProj,
        LoraTarget::GateProj,
        LoraTarget::UpProj,
        LoraTarget::DownProj,
    ];

    /// PEFT's name (`q_proj`, ...).
    pub fn name(self) -> &'static str {
        match self {
            LoraTarget::QProj => "q_proj",
            LoraTarget::KProj => "k_proj",
            LoraTarget::VProj => "v_proj",
            LoraTarget::OProj => "o_proj",
            LoraTarget::GateProj => "gate_proj",
            LoraTarget::UpProj => "up_proj",
            LoraTarget::DownProj => "down_proj",
        }
    }

    /// The target PEFT calls `name`.
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.name() == name)
    }

    /// The module path under `model.layers.{i}`.
    pub(super) fn module(self) -> &'static str {
        match self {
            LoraTarget::QProj => "self_attn.q_proj",
            LoraTarget::KProj => "self_attn.k_proj",
            LoraTarget::VProj => "self_attn.v_proj",
            LoraTarget::OProj => "self_attn.o_proj",
            LoraTarget::GateProj => "mlp.gate_proj",
            LoraTarget::UpProj => "mlp.up_proj",
            LoraTarget::DownProj => "mlp.down_proj",
        }
    }

    /// `(in, out)` widths.
    pub(super) fn dims(self, c: &ModelConfig) -> (i64, i64) {
        let (h, f) = (c.hidden_size, c.intermediate_size);
        let (nq, nkv) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match self {
            LoraTarget::QProj => (h, nq),
            LoraTarget::KProj | LoraTarget::VProj => (h, nkv),
            LoraTarget::OProj => (nq, h),
            LoraTarget::GateProj | LoraTarget::UpProj => (h, f),
            LoraTarget::DownProj => (f, h),
        }
    }

    /// The stored matrix holding this projection, and its first column there.
    pub(super) fn place(self, c: &ModelConfig) -> (Matrix, i64) {
        let (nq, nkv) = (
            c.num_attention_heads * c.head_dim,
            c.num_key_value_heads * c.head_dim,
        );
        match self {
            LoraTarget::QProj => (Matrix::Qkv, 0),
            LoraTarget::KProj => (Matrix::Qkv, nq),
            LoraTarget::VProj => (Matrix::Qkv, nq + nkv),
            LoraTarget::OProj => (Matrix::O, 0),
            LoraTarget::GateProj => (Matrix::GateUp, 0),
            LoraTarget::UpProj => (Matrix::GateUp, c.intermediate_size),
            LoraTarget::DownProj => (Matrix::Down, 0),
        }
    }

    pub(super) fn parts(m: Matrix) -> &'static [LoraTarget] {
        match m {
            Matrix::Qkv => &[LoraTarget::QProj, LoraTarget::KProj, LoraTarget::VProj],
            Matrix::O => &[LoraTarget::OProj],
            Matrix::GateUp => &[LoraTarget::GateProj, LoraTarget::UpProj],
            Matrix::Down => &[LoraTarget::DownProj],
        }
    }
}

/// LoRA settings (PEFT's `r`, `lora_alpha`, `lora_dropout`, `target_modules`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LoraConfig {
    /// Rank `r` of every adapter.
    pub rank: i64,
    /// `lora_alpha`: the update is scaled by `alpha / rank`.
    pub alpha: f64,
    /// Dropout on the adapter's input while training (0 = none).
    pub dropout: f64,
    /// The adapted projections.
    pub targets: Vec<LoraTarget>,
}

impl LoraConfig {
    /// `alpha / rank`, the factor on `A·B`.
    pub fn scaling(&self) -> f64 {
        self.alpha / self.rank as f64
    }

    /// Why these settings cannot train, if they cannot.
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.rank < 1 {
            return Err(format!("rank {} must be at least 1", self.rank));
        }
        if !(self.alpha.is_finite() && self.alpha > 0.0) {
            return Err(format!("alpha {} must be a positive number", self.alpha));
        }
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(format!("dropout {} must be in [0, 1)", self.dropout));
        }
        if self.targets.is_empty() {
            return Err("target_modules is empty: name at least one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj".into());
        }
        Ok(())
    }
}

/// One adapter: `A` `[in, r]` and `B` `[r, out]`, input-major.
#[derive(Debug)]
pub struct LoraPair {
    /// The down projection (PEFT's `lora_A.weight`, transposed).
    pub a: Tensor,
    /// The up projection (PEFT's `lora_B.weight`, transposed); zero at initialisation.
    pub b: Tensor,
}

/// The adapters attached to a model.
#[derive(Debug)]
pub struct Adapters {
    /// The settings.
    pub config: LoraConfig,
    /// Per layer, the adapted projections.
    pub layers: Vec<BTreeMap<LoraTarget, LoraPair>>,
    /// The base model's directory, written as PEFT's `base_model_name_or_path`; a
    /// checkpoint without it stores the base weights beside the adapters.
    pub base_path: Option<PathBuf>,
}

/// The adapters' parameters by canonical name (`lora.{layer}.{target}.a|b`).
pub(super) fn adapter_parameters(ad: Option<&mut Adapters>) -> Vec<(String, &mut Tensor)> {
    let mut v: Vec<(String, &mut Tensor)> = Vec::new();
    for (i, layer) in ad.into_iter().flat_map(|a| a.layers.iter_mut()).enumerate() {
        for (t, p) in layer.iter_mut() {
            v.push((format!("lora.{i}.{}.a", t.name()), &mut p.a));
            v.push((format!("lora.{i}.{}.b", t.name()), &mut p.b));
        }
    }
    v
}

/// PEFT's tensor-name prefix of layer `i`'s projection `t`.
pub(super) fn peft_prefix(i: usize, t: LoraTarget) -> String {
    format!("base_model.model.model.layers.{i}.{}", t.module())
}

/// The tensor an adapter weight sync carries `alpha / rank` in (a 0-d f32), beside the
/// PEFT-named adapter tensors: the receiver folds `s·A·B` into its base.
pub const LORA_SCALING_TENSOR: &str = "lora.scaling";

/// Whether `name` is an adapter tensor of a weight sync (PEFT name or the scaling).
pub(super) fn is_adapter_name(name: &str) -> bool {
    name == LORA_SCALING_TENSOR
        || name.ends_with(".lora_A.weight")
        || name.ends_with(".lora_B.weight")
}

/// Which half of an adapter a PEFT name holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Half {
    /// `lora_A`.
    A,
    /// `lora_B`.
    B,
}

/// `(layer, target, half)` of a PEFT adapter tensor name.
pub(super) fn parse_peft_name(name: &str) -> Option<(usize, LoraTarget, Half)> {
    let rest = name.strip_prefix("base_model.model.model.layers.")?;
    let (i, rest) = rest.split_once('.')?;
    let i: usize = i.parse().ok()?;
    let (module, half) = if let Some(m) = rest.strip_suffix(".lora_A.weight") {
        (m, Half::A)
    } else {
        (rest.strip_suffix(".lora_B.weight")?, Half::B)
    };
    let target = LoraTarget::ALL.into_iter().find(|t| t.module() == module)?;
    Some((i, target, half))
}

impl Adapters {
    /// Fresh adapters as PEFT initialises them: `A` Kaiming-uniform (bound
    /// `1/sqrt(in)`), `B` zero, so the adapted model starts as the base.
    pub(super) fn init(config: LoraConfig, c: &ModelConfig, device: Device, kind: Kind) -> Self {
        let layers = (0..c.num_hidden_layers)
            .map(|_| {
                config
                    .targets
                    .iter()
                    .map(|&t| {
                        let (i, o) = t.dims(c);
                        let bound = 1.0 / (i as f64).sqrt();
                        let a = (Tensor::rand([i, config.rank], (Kind::Float, Device::Cpu)) * 2.0
                            - 1.0)
                            * bound;
                        let b = Tensor::zeros([config.rank, o], (Kind::Float, Device::Cpu));
                        let conv = |x: Tensor| x.to_device(device).to_kind(kind);
                        (
                            t,
                            LoraPair {
                                a: conv(a),
                                b: conv(b),
                            },
                        )
                    })
                    .collect()
            })
            .collect();
        Adapters {
            config,
            layers,
            base_path: None,
        }
    }

    /// The adapter tensors by PEFT name (`lora_A.weight` `[r, in]`, `lora_B.weight`
    /// `[out, r]`), as transposed views.
    pub fn peft_named_tensors(&self) -> Vec<(String, Tensor)> {
        let mut v = Vec::new();
        for (i, layer) in self.layers.iter().enumerate() {
            for (&t, p) in layer {
                let pre = peft_prefix(i, t);
                v.push((format!("{pre}.lora_A.weight"), p.a.tr()));
                v.push((format!("{pre}.lora_B.weight"), p.b.tr()));
            }
        }
        v
    }

    /// PEFT's `adapter_config.json` for these adapters.
    pub fn peft_config(&self, base: &str) -> serde_json::Value {
        json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "base_model_name_or_path": base,
            "r": self.config.rank,
            "lora_alpha": self.config.alpha,
            "lora_dropout": self.config.dropout,
            "target_modules": self.config.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "inference_mode": true,
            "init_lora_weights": true,
            "use_rslora": false,
            "use_dora": false,
            "modules_to_save": null,
            "layers_to_transform": null,
            "layers_pattern": null,
            "rank_pattern": {},
            "alpha_pattern": {},
            "revision": null,
        })
    }
}

/// An adapter directory's `adapter_config.json`, as yatt reads it.
#[derive(Debug, Clone)]
pub struct AdapterDir {
    /// The settings.
    pub config: LoraConfig,
    /// The base model's directory (relative paths resolved against the adapter dir).
    pub base: PathBuf,
}

impl AdapterDir {
    /// Whether `dir` holds a PEFT adapter (`adapter_config.json`).
    pub fn is_adapter_dir(dir: &Path) -> bool {
        dir.join("adapter_config.json").is_file()
    }

    /// Reads `dir/adapter_config.json`; refuses what yatt does not implement.
    pub fn read(dir: &Path) -> Result<Self> {
        let p = dir.join("adapter_config.json");
        let s = std::fs::read_to_string(&p).map_err(|e| EngineError::io("reading", &p, e))?;
        let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| EngineError::Json {
            path: p.clone(),
            source: e,
        })?;
        let bad = |key: &str, why: String| EngineError::Config {
            path: p.clone(),
            msg: format!("`{key}`: {why}"),
        };
        if v["peft_type"].as_str() != Some("LORA") {
            return Err(bad(
                "peft_type",
                format!("is {}; yatt reads LORA adapters only", v["peft_type"]),
            ));
        }
        for (key, off) in [
            ("use_dora", false),
            ("use_rslora", false),
            ("fan_in_fan_out", false),
        ] {
            if v[key].as_bool().unwrap_or(off) != off {
                return Err(bad(key, "is true; yatt implements plain LoRA only".into()));
            }
        }
        if v["bias"].as_str().is_some_and(|b| b != "none") {
            return Err(bad(
                "bias",
                format!(
                    "is {}; yatt adapters train no biases (use \"none\")",
                    v["bias"]
                ),
            ));
        }
        for key in ["rank_pattern", "alpha_pattern"] {
            if v[key].as_object().is_some_and(|m| !m.is_empty()) {
                return Err(bad(
                    key,
                    "per-module ranks are not implemented; use one r and lora_alpha".into(),
                ));
            }
        }
        if !v["modules_to_save"].is_null() || !v["layers_to_transform"].is_null() {
            return Err(bad(
                "modules_to_save / layers_to_transform",
                "not implemented; adapt every layer".into(),
            ));
        }
        let rank = v["r"]
            .as_i64()
            .ok_or_else(|| bad("r", "missing or not an integer".into()))?;
        let alpha = v["lora_alpha"]
            .as_f64()
            .ok_or_else(|| bad("lora_alpha", "missing or not a number".into()))?;
        let dropout = v["lora_dropout"].as_f64().unwrap_or(0.0);
        let targets = match &v["target_modules"] {
            serde_json::Value::Array(a) => a
                .iter()
                .map(|n| {
                    n.as_str().and_then(LoraTarget::parse).ok_or_else(|| {
                        bad("target_modules", format!("{n} is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj"))
                    })
                })
                .collect::<Result<Vec<_>>>()?,
            other => return Err(bad("target_modules", format!("is {other}; give a list of module names"))),
        };
        let config = LoraConfig {
            rank,
            alpha,
            dropout,
            targets,
        };
        config
            .check()
            .map_err(|e| bad("r / lora_alpha / lora_dropout / target_modules", e))?;
        let base = v["base_model_name_or_path"].as_str().ok_or_else(|| {
            bad(
                "base_model_name_or_path",
                "missing: yatt needs the base model's directory".into(),
            )
        })?;
        let base = if Path::new(base).is_absolute() {
            PathBuf::from(base)
        } else {
            dir.join(base)
        };
        Ok(AdapterDir { config, base })
    }
}
