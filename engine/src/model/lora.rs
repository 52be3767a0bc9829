//! LoRA on [`Llama`]: attaching adapters, the adapted forward's extra term, folding
//! them in (merge, HF export, weight sync into an inference model) and loading PEFT
//! adapter directories. The types and PEFT's files are in `lora_types.rs`; the
//! checkpoint side (`save_adapter`) in `checkpoint.rs`.
//!
//! A targeted projection computes `x·W + s·(x·A)·B` with `A` `[in, r]`, `B` `[r, out]`
//! (stored input-major like the base matrices) and `s = alpha / r`. While adapters are
//! attached only they (and a scalar head) are trainable: the base stays frozen, so AdamW
//! keeps state for a few MB instead of the whole model.
//!
//! Inference models take adapter updates by folding them into their own matrices
//! ([`Llama::copy_weights_from`] with adapter names): they keep a copy of the base
//! matrices they fold into, so every update is `W = W_base + s·A·B`, exactly, however
//! many arrive. The fused CPU decode step then runs on plain matrices.

use super::llama::Llama;
use super::lora_types::{
    parse_peft_name, peft_prefix, AdapterDir, Adapters, Half, LoraConfig, LoraTarget, Matrix,
    LORA_SCALING_TENSOR,
};
use crate::error::{EngineError, Result};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use tch::{Device, Kind, Tensor};

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
                    Matrix::ALL
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
                    .map(|l| Matrix::ALL.map(|m| l.matrix(m).detach().copy()))
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
                let mm = Matrix::ALL[m];
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
