//! LoRA adapters on the decoder's linear layers, in PEFT's layout and names.
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

use super::llama::Llama;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use serde_json::json;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

/// A linear layer LoRA can adapt (PEFT's `target_modules` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
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
    fn module(self) -> &'static str {
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
    fn dims(self, c: &ModelConfig) -> (i64, i64) {
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

    fn parts(m: Matrix) -> &'static [LoraTarget] {
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
fn peft_prefix(i: usize, t: LoraTarget) -> String {
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
enum Half {
    A,
    B,
}

/// `(layer, target, half)` of a PEFT adapter tensor name.
fn parse_peft_name(name: &str) -> Option<(usize, LoraTarget, Half)> {
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
    fn init(config: LoraConfig, c: &ModelConfig, device: Device, kind: Kind) -> Self {
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

impl Llama {
    /// Attaches fresh adapters (PEFT's initialisation; `B = 0`, so outputs do not change)
    /// and freezes the base. Seeds libtorch's RNG with `seed`.
    pub fn add_lora(&mut self, config: LoraConfig, seed: i64) -> Result<()> {
        config.check().map_err(EngineError::InvalidArgument)?;
        if self.lora.is_some() {
            return Err(EngineError::InvalidArgument(
                "the model already has LoRA adapters".into(),
            ));
        }
        tch::manual_seed(seed);
        self.lora = Some(Adapters::init(config, &self.config, self.device, self.kind));
        self.set_requires_grad(false);
        Ok(())
    }

    /// The attached adapters, if any.
    pub fn lora(&self) -> Option<&Adapters> {
        self.lora.as_ref()
    }

    /// The attached adapters, mutably (e.g. to set `base_path`).
    pub fn lora_mut(&mut self) -> Option<&mut Adapters> {
        self.lora.as_mut()
    }

    /// Adapter tensors for a weight sync: PEFT names plus [`LORA_SCALING_TENSOR`].
    /// Empty without adapters.
    pub fn adapter_sync_tensors(&self) -> Vec<(String, Tensor)> {
        let Some(ad) = &self.lora else {
            return Vec::new();
        };
        let mut v = ad.peft_named_tensors();
        v.push((
            LORA_SCALING_TENSOR.to_string(),
            Tensor::from(ad.config.scaling() as f32),
        ));
        v
    }

    /// `s·A·B` (input-major, `[in, out]`) of layer `i`'s projection `t`, if adapted.
    fn lora_delta_weight(&self, i: usize, t: LoraTarget) -> Option<Tensor> {
        let ad = self.lora.as_ref()?;
        let p = ad.layers[i].get(&t)?;
        Some(p.a.matmul(&p.b) * ad.config.scaling())
    }

    /// HF-named tensors with the adapters folded in (new tensors): the model a full
    /// weight sync or an HF export carries. Without adapters, [`Llama::hf_named_tensors`].
    pub fn merged_hf_named_tensors(&self) -> Vec<(String, Tensor)> {
        let named = self.hf_named_tensors();
        if self.lora.is_none() {
            return named;
        }
        let mut deltas: HashMap<String, Tensor> = HashMap::new();
        for i in 0..self.layers.len() {
            for t in LoraTarget::ALL {
                if let Some(d) = self.lora_delta_weight(i, t) {
                    deltas.insert(format!("model.layers.{i}.{}.weight", t.module()), d.tr());
                }
            }
        }
        tch::no_grad(|| {
            named
                .into_iter()
                .map(|(n, w)| match deltas.get(&n) {
                    Some(d) => {
                        let m = &w + d;
                        (n, m)
                    }
                    None => (n, w),
                })
                .collect()
        })
    }

    /// Layer `i`'s stored matrix `m` with the adapters folded in, if any adapts it.
    pub(super) fn merged_matrix(&self, i: usize, m: Matrix) -> Option<Tensor> {
        let mut out: Option<Tensor> = None;
        for &t in LoraTarget::parts(m) {
            if let Some(d) = self.lora_delta_weight(i, t) {
                let w = out.get_or_insert_with(|| self.layers[i].matrix(m).detach().copy());
                let (_, col) = t.place(&self.config);
                let mut part = w.narrow(1, col, d.size()[1]);
                let _ = part.g_add_(&d);
            }
        }
        out
    }

    /// Folds the adapters into the base matrices and drops them: a plain model that
    /// computes what the adapted one did (inference, export).
    pub fn merge_lora(&mut self) {
        if self.lora.is_none() {
            return;
        }
        let merged: Vec<Vec<(Matrix, Tensor)>> = tch::no_grad(|| {
            (0..self.layers.len())
                .map(|i| {
                    [Matrix::Qkv, Matrix::O, Matrix::GateUp, Matrix::Down]
                        .into_iter()
                        .filter_map(|m| self.merged_matrix(i, m).map(|w| (m, w)))
                        .collect()
                })
                .collect()
        });
        self.lora = None;
        self.packed = None;
        for (layer, ms) in self.layers.iter_mut().zip(merged) {
            for (m, w) in ms {
                *layer.matrix_mut(m) = w;
            }
        }
    }

    /// `x·A·B·s` for layer `i`'s stored matrix `m` (the columns of the targets it
    /// holds, zeros for those not adapted), or `None` when no target adapts it.
    /// `dropout` is applied to `x` (training only).
    pub(super) fn lora_forward(
        &self,
        i: usize,
        m: Matrix,
        x: &Tensor,
        train: bool,
    ) -> Option<Tensor> {
        let ad = self.lora.as_ref()?;
        let layer = &ad.layers[i];
        let parts = LoraTarget::parts(m);
        if !parts.iter().any(|t| layer.contains_key(t)) {
            return None;
        }
        let x = if train && ad.config.dropout > 0.0 {
            x.dropout(ad.config.dropout, true)
        } else {
            x.shallow_clone()
        };
        let s = ad.config.scaling();
        let mut outs = Vec::with_capacity(parts.len());
        for &t in parts {
            outs.push(match layer.get(&t) {
                Some(p) => x.matmul(&p.a).matmul(&p.b) * s,
                None => {
                    let (_, o) = t.dims(&self.config);
                    let mut shape = x.size();
                    *shape.last_mut().expect("rows have a width") = o;
                    x.new_zeros(shape.as_slice(), (x.kind(), x.device()))
                }
            });
        }
        Some(if outs.len() == 1 {
            outs.pop().expect("one part")
        } else {
            Tensor::cat(&outs, -1)
        })
    }

    /// Whether this forward trains the adapters (grad mode on, adapters trainable):
    /// dropout applies then only.
    pub(super) fn lora_training(&self) -> bool {
        let Some(ad) = &self.lora else {
            return false;
        };
        if ad.config.dropout == 0.0 {
            return false;
        }
        // libtorch has no public grad-mode query in tch: an op's result requires grad
        // exactly when grad mode is on and an input requires it.
        ad.layers
            .iter()
            .flat_map(|l| l.values())
            .next()
            .is_some_and(|p| p.a.narrow(0, 0, 1).sum(Kind::Float).requires_grad())
    }

    /// Loads PEFT-named adapter tensors into the attached adapters (every adapter must
    /// be given, with its shape).
    pub fn load_lora_tensors(&mut self, named: &HashMap<String, Tensor>) -> Result<()> {
        let (device, kind) = (self.device, self.kind);
        let Some(ad) = self.lora.as_mut() else {
            return Err(EngineError::InvalidArgument(
                "the model has no LoRA adapters to load into".into(),
            ));
        };
        let known: std::collections::HashSet<String> = ad
            .peft_named_tensors()
            .into_iter()
            .map(|(n, _)| n)
            .collect();
        if let Some(extra) = named.keys().find(|n| !known.contains(*n)) {
            return Err(EngineError::Weights(format!(
                "adapter tensor `{extra}` belongs to no adapter of this model (its adapter_config.json names the targets; do rank and target_modules match the weights?)"
            )));
        }
        tch::no_grad(|| -> Result<()> {
            for (i, layer) in ad.layers.iter_mut().enumerate() {
                for (&t, p) in layer.iter_mut() {
                    let pre = peft_prefix(i, t);
                    for (half, dst) in [("lora_A", &mut p.a), ("lora_B", &mut p.b)] {
                        let name = format!("{pre}.{half}.weight");
                        let src = named.get(&name).ok_or_else(|| {
                            EngineError::Weights(format!("adapter tensor `{name}` is missing"))
                        })?;
                        let src = src.tr();
                        if src.size() != dst.size() {
                            return Err(EngineError::Weights(format!(
                                "`{name}`: shape {:?}, the adapter config implies {:?}",
                                src.tr().size(),
                                dst.tr().size()
                            )));
                        }
                        let rg = dst.requires_grad();
                        *dst = src
                            .to_device(device)
                            .to_kind(kind)
                            .contiguous()
                            .set_requires_grad(rg);
                    }
                }
            }
            Ok(())
        })
    }

    /// Folds adapter tensors of a weight sync (PEFT names and [`LORA_SCALING_TENSOR`])
    /// into this model's matrices: `W = W_base + s·A·B` from a copy of the base kept at
    /// the first such update. A model with adapters of its own takes them as its
    /// adapters instead.
    pub(super) fn take_adapter_update(&mut self, named: Vec<(&str, &Tensor)>) -> Result<usize> {
        let n = named.len();
        if self.lora.is_some() {
            let map: HashMap<String, Tensor> = named
                .into_iter()
                .filter(|(k, _)| *k != LORA_SCALING_TENSOR)
                .map(|(k, t)| (k.to_string(), t.shallow_clone()))
                .collect();
            self.load_lora_tensors(&map)?;
            return Ok(n);
        }
        let mut scaling = None;
        let mut pairs: BTreeMap<(usize, LoraTarget), (Option<Tensor>, Option<Tensor>)> =
            BTreeMap::new();
        for (name, t) in named {
            if name == LORA_SCALING_TENSOR {
                scaling = Some(t.to_kind(Kind::Double).double_value(&[]));
                continue;
            }
            let (i, target, half) = parse_peft_name(name).ok_or_else(|| {
                EngineError::Weights(format!("`{name}` is no PEFT LoRA tensor name yatt knows"))
            })?;
            if i >= self.layers.len() {
                return Err(EngineError::Weights(format!(
                    "`{name}`: layer {i}, the model has {}",
                    self.layers.len()
                )));
            }
            let e = pairs.entry((i, target)).or_default();
            match half {
                Half::A => e.0 = Some(t.shallow_clone()),
                Half::B => e.1 = Some(t.shallow_clone()),
            }
        }
        let s = scaling.ok_or_else(|| {
            EngineError::Weights(format!(
                "an adapter update must carry `{LORA_SCALING_TENSOR}` (alpha / rank)"
            ))
        })?;
        let (device, kind) = (self.device, self.kind);
        // Per adapter, `s·A` `[in, r]` and `B` `[r, out]`, input-major: folded below
        // with one in-place GEMM each, no full-size temporary.
        let mut factors: Vec<(usize, LoraTarget, Tensor, Tensor)> = Vec::new();
        for ((i, t), (a, b)) in pairs {
            let name = peft_prefix(i, t);
            let (Some(a), Some(b)) = (a, b) else {
                return Err(EngineError::Weights(format!(
                    "`{name}`: the update carries only one of lora_A and lora_B"
                )));
            };
            let (din, dout) = t.dims(&self.config);
            let (ra, rb) = (a.size(), b.size());
            if ra.len() != 2 || rb.len() != 2 || ra[1] != din || rb[0] != dout || ra[0] != rb[1] {
                return Err(EngineError::Weights(format!(
                    "`{name}`: lora_A {ra:?} and lora_B {rb:?} do not fit [r, {din}] and [{dout}, r]"
                )));
            }
            let (sa, bt) = tch::no_grad(|| {
                (
                    (a.to_device(device).to_kind(Kind::Float).tr() * s).to_kind(kind),
                    b.to_device(device).to_kind(kind).tr().contiguous(),
                )
            });
            factors.push((i, t, sa, bt));
        }
        let repack = self.packed.as_ref().map(|p| p.batch);
        if self.merge_base.is_none() {
            let base = tch::no_grad(|| {
                self.layers
                    .iter()
                    .map(|l| {
                        [Matrix::Qkv, Matrix::O, Matrix::GateUp, Matrix::Down]
                            .map(|m| l.matrix(m).detach().copy())
                    })
                    .collect()
            });
            self.merge_base = Some(base);
        }
        let base = self.merge_base.as_ref().expect("just set");
        tch::no_grad(|| {
            // Every adapted matrix restarts from the base, then takes its deltas.
            let mut touched = std::collections::BTreeSet::new();
            for (i, t, _, _) in &factors {
                touched.insert((*i, t.place(&self.config).0 as usize));
            }
            for &(i, m) in &touched {
                let mm = [Matrix::Qkv, Matrix::O, Matrix::GateUp, Matrix::Down][m];
                let _ = self.layers[i].matrix(mm).shallow_clone().copy_(&base[i][m]);
            }
            for (i, t, sa, bt) in &factors {
                let (m, col) = t.place(&self.config);
                // A column slice of a row-major matrix is a valid GEMM output in place.
                let mut part = self.layers[*i].matrix(m).narrow(1, col, bt.size()[1]);
                let _ = part.addmm_(sa, bt);
            }
        });
        self.packed = None;
        if let Some(b) = repack {
            self.pack_for_inference(b);
        }
        Ok(n)
    }

    /// Writes the adapters as PEFT does: `adapter_config.json` and
    /// `adapter_model.safetensors`. `base` is written as `base_model_name_or_path`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let ad = self.lora.as_ref().ok_or_else(|| {
            EngineError::InvalidArgument("the model has no LoRA adapters to save".into())
        })?;
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io("creating", dir, e))?;
        let p = dir.join("adapter_config.json");
        std::fs::write(
            &p,
            serde_json::to_string_pretty(&ad.peft_config(base)).expect("json"),
        )
        .map_err(|e| EngineError::io("writing", &p, e))?;
        crate::checkpoint::write_safetensors(
            &dir.join("adapter_model.safetensors"),
            &ad.peft_named_tensors(),
        )
    }

    /// Loads a PEFT adapter directory onto its base model (from
    /// `base_model_name_or_path`), keeping the adapters apart (trainable).
    pub fn load_with_adapter(dir: &Path, device: Device, kind: Kind) -> Result<Llama> {
        let spec = AdapterDir::read(dir)?;
        let mut model = Llama::load_base(&spec.base, device, kind).map_err(|e| {
            EngineError::Checkpoint {
                path: dir.into(),
                msg: format!(
                    "loading its base model {} (adapter_config.json's base_model_name_or_path): {e}",
                    spec.base.display()
                ),
            }
        })?;
        model.add_lora(spec.config, 0)?;
        let p = dir.join("adapter_model.safetensors");
        let tensors: HashMap<String, Tensor> = Tensor::read_safetensors(&p)
            .map_err(|e| EngineError::Safetensors {
                path: p.clone(),
                msg: e.to_string(),
            })?
            .into_iter()
            .collect();
        model.load_lora_tensors(&tensors)?;
        if let Some(ad) = model.lora.as_mut() {
            ad.base_path = Some(spec.base);
        }
        Ok(model)
    }
}
