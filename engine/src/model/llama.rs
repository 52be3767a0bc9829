//! The model's parameters and what is done to them as a whole: heads, parameter lists,
//! HF names, copying and adopting weights, moving devices, oneDNN packing.

use super::heads::ScalarHead;
use super::lora_types::{adapter_parameters, is_adapter_name, Adapters, Matrix};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use std::collections::HashMap;
use tch::{Device, Kind, Tensor};

/// One decoder layer's parameters.
#[derive(Debug)]
pub struct DecoderLayer {
    /// RMSNorm before attention.
    pub ln1: Tensor,
    /// Fused q/k/v projection, stored input-major `[hidden, (H + 2·KV)·hd]` (the transpose
    /// of HF's layout: `x @ W` runs MKL's fast NN GEMM without repacking the weights).
    pub wqkv: Tensor,
    /// Fused q/k/v bias (Qwen2).
    pub bqkv: Option<Tensor>,
    /// Per-head RMSNorm weights `[head_dim]` of q and k, before RoPE (Qwen3).
    pub qk_norm: Option<(Tensor, Tensor)>,
    /// Output projection, input-major `[H·hd, hidden]`.
    pub wo: Tensor,
    /// RMSNorm before the MLP.
    pub ln2: Tensor,
    /// Fused gate/up projection, input-major `[hidden, 2·ffn]`.
    pub w_gate_up: Tensor,
    /// Down projection, input-major `[ffn, hidden]`.
    pub w_down: Tensor,
}

impl DecoderLayer {
    /// Decoder layer `i`'s parameters in their fixed order, with canonical names.
    pub(super) fn parameters_mut(&mut self, i: usize) -> Vec<(String, &mut Tensor)> {
        let l = self;
        let mut v: Vec<(String, &mut Tensor)> = vec![
            (format!("layers.{i}.ln1"), &mut l.ln1),
            (format!("layers.{i}.wqkv"), &mut l.wqkv),
        ];
        if let Some(b) = l.bqkv.as_mut() {
            v.push((format!("layers.{i}.bqkv"), b));
        }
        if let Some((qn, kn)) = l.qk_norm.as_mut() {
            v.push((format!("layers.{i}.q_norm"), qn));
            v.push((format!("layers.{i}.k_norm"), kn));
        }
        v.push((format!("layers.{i}.wo"), &mut l.wo));
        v.push((format!("layers.{i}.ln2"), &mut l.ln2));
        v.push((format!("layers.{i}.w_gate_up"), &mut l.w_gate_up));
        v.push((format!("layers.{i}.w_down"), &mut l.w_down));
        v
    }

    /// One of the four stored matrices (LoRA folds into them by this index).
    pub(super) fn matrix(&self, m: Matrix) -> &Tensor {
        match m {
            Matrix::Qkv => &self.wqkv,
            Matrix::O => &self.wo,
            Matrix::GateUp => &self.w_gate_up,
            Matrix::Down => &self.w_down,
        }
    }

    pub(super) fn matrix_mut(&mut self, m: Matrix) -> &mut Tensor {
        match m {
            Matrix::Qkv => &mut self.wqkv,
            Matrix::O => &mut self.wo,
            Matrix::GateUp => &mut self.w_gate_up,
            Matrix::Down => &mut self.w_down,
        }
    }
}

/// A Llama-family causal LM.
#[derive(Debug)]
pub struct Llama {
    /// The configuration.
    pub config: ModelConfig,
    /// Token embedding, stored transposed `[hidden, vocab]` (input-major for the tied LM head).
    pub embed: Tensor,
    /// The decoder layers.
    pub layers: Vec<DecoderLayer>,
    /// The final RMSNorm.
    pub norm: Tensor,
    /// The untied LM head, input-major `[hidden, vocab]`, or `None` when tied to `embed`.
    pub lm_head: Option<Tensor>,
    /// A scalar head (critic / reward), if attached.
    pub head: Option<ScalarHead>,
    /// LoRA adapters, if attached: then only they (and `head`) train.
    pub(super) lora: Option<Adapters>,
    /// Per layer, a copy of the base matrices (by [`Matrix`] index) that adapter weight
    /// syncs fold into; taken at the first one.
    pub(super) merge_base: Option<Vec<[Tensor; 4]>>,
    pub(super) device: Device,
    pub(super) kind: Kind,
    pub(super) cos: Tensor,
    pub(super) sin: Tensor,
    pub(super) packed: Option<Packed>,
    /// How training and scoring trade compute for memory.
    pub memory: MemoryOptions,
}

/// The default number of tokens per chunk of the LM head: 1,024 tokens of a 150k
/// vocabulary are 600 MB of f32 logits, small beside a long sequence's activations.
pub const DEFAULT_CHUNK_TOKENS: usize = 1024;

/// How training and scoring trade compute for memory on long sequences.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryOptions {
    /// Tokens per chunk of the LM head in scoring and training (log-probs and entropy):
    /// the `[tokens, vocab]` logits never exist whole.
    pub logprob_chunk_tokens: usize,
    /// Layer recompute in training: keep each decoder layer's input alone and run the
    /// layer again in backward. With LoRA dropout the recompute draws fresh dropout
    /// masks (the RNG is not replayed), so gradients then differ from keeping the
    /// activations by that noise.
    pub activation_checkpointing: bool,
    /// How a micro-batch's sequences are laid out for scoring and training.
    pub layout: RowLayout,
    /// With layer recompute, tokens per part of a layer's forward and backward: runs of
    /// whole sequences (a longer one alone), the MLP in chunks of as many tokens, so
    /// that a layer's activations are bounded however many tokens a micro-batch holds.
    /// Exact, but a micro-batch split in several parts rounds its f32 sums in another
    /// order (about 1e-7 of the gradients' scale); one that fits is unchanged.
    pub recompute_chunk_tokens: usize,
}

/// How a micro-batch's sequences are laid out for scoring and training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RowLayout {
    /// One row per sequence, right-padded to the longest; a prompt shared by several
    /// samples (a GRPO group) runs once.
    #[default]
    Padded,
    /// Every sequence back to back in one row, attention confined to each: no padding
    /// (long-tail lengths waste no compute), no prompt sharing.
    Packed,
}

impl Default for MemoryOptions {
    fn default() -> Self {
        MemoryOptions {
            logprob_chunk_tokens: DEFAULT_CHUNK_TOKENS,
            activation_checkpointing: false,
            layout: RowLayout::Padded,
            recompute_chunk_tokens: DEFAULT_CHUNK_TOKENS,
        }
    }
}

/// oneDNN-prepacked copies of the matrices, for inference on CPU.
#[derive(Debug)]
pub(super) struct Packed {
    pub(super) batch: i64,
    /// Per layer: wqkv, wo, w_gate_up, w_down.
    pub(super) layers: Vec<[Tensor; 4]>,
    pub(super) lm_head: Tensor,
}

impl Llama {
    /// The device the weights live on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The weights' dtype.
    pub fn kind(&self) -> Kind {
        self.kind
    }

    /// Attaches a zero-initialised scalar head: `"v_head"` (value, with bias) or `"score"`
    /// (reward, HF `LlamaForSequenceClassification` layout, no bias).
    pub fn attach_head(&mut self, prefix: &str) {
        let bias = prefix != "score";
        self.head = Some(ScalarHead::new(
            prefix,
            self.config.hidden_size,
            bias,
            self.device,
            self.kind,
        ));
    }

    /// The trainable parameters with stable names, for optimizers: every canonical
    /// parameter, or with LoRA adapters attached only the adapters and a scalar head.
    pub fn parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        if self.lora.is_none() {
            return self.all_parameters_mut();
        }
        self.packed = None;
        let mut v = Vec::new();
        if let Some(hd) = self.head.as_mut() {
            v.push((format!("{}.weight", hd.prefix), &mut hd.weight));
            if let Some(b) = hd.bias.as_mut() {
                v.push((format!("{}.bias", hd.prefix), b));
            }
        }
        let mut lora = adapter_parameters(self.lora.as_mut());
        lora.append(&mut v);
        lora
    }

    /// Every canonical parameter with its stable name: the base weights, a scalar
    /// head and LoRA adapters.
    pub fn all_parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        // The caller may change the weights: drop packed inference copies.
        self.packed = None;
        let mut v: Vec<(String, &mut Tensor)> = vec![("embed".into(), &mut self.embed)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            v.append(&mut l.parameters_mut(i));
        }
        v.push(("norm".into(), &mut self.norm));
        if let Some(w) = self.lm_head.as_mut() {
            v.push(("lm_head".into(), w));
        }
        if let Some(hd) = self.head.as_mut() {
            v.push((format!("{}.weight", hd.prefix), &mut hd.weight));
            if let Some(b) = hd.bias.as_mut() {
                v.push((format!("{}.bias", hd.prefix), b));
            }
        }
        v.append(&mut adapter_parameters(self.lora.as_mut()));
        v
    }

    /// The canonical parameters (shallow clones sharing storage).
    pub fn parameters(&mut self) -> Vec<(String, Tensor)> {
        self.all_parameters_mut()
            .into_iter()
            .map(|(n, t)| (n, t.shallow_clone()))
            .collect()
    }

    /// Total number of parameters (adapters included).
    pub fn num_parameters(&mut self) -> i64 {
        self.all_parameters_mut()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum()
    }

    /// Sets `requires_grad` on every trainable parameter; with LoRA adapters the base
    /// stays frozen.
    pub fn set_requires_grad(&mut self, on: bool) {
        let frozen = self.lora.is_some();
        for (_, t) in self.all_parameters_mut() {
            let _ = t.requires_grad_(on && !frozen);
        }
        for (_, t) in self.parameters_mut() {
            let _ = t.requires_grad_(on);
        }
    }

    /// HF-named tensors, as views into the canonical parameters (writes through).
    pub fn hf_named_tensors(&self) -> Vec<(String, Tensor)> {
        let c = &self.config;
        let hd = c.head_dim;
        let (nq, nkv, f) = (
            c.num_attention_heads * hd,
            c.num_key_value_heads * hd,
            c.intermediate_size,
        );
        let mut v = vec![("model.embed_tokens.weight".to_string(), self.embed.tr())];
        for (i, l) in self.layers.iter().enumerate() {
            let p = format!("model.layers.{i}");
            v.push((format!("{p}.input_layernorm.weight"), l.ln1.shallow_clone()));
            v.push((
                format!("{p}.self_attn.q_proj.weight"),
                l.wqkv.narrow(1, 0, nq).tr(),
            ));
            v.push((
                format!("{p}.self_attn.k_proj.weight"),
                l.wqkv.narrow(1, nq, nkv).tr(),
            ));
            v.push((
                format!("{p}.self_attn.v_proj.weight"),
                l.wqkv.narrow(1, nq + nkv, nkv).tr(),
            ));
            if let Some(b) = &l.bqkv {
                v.push((format!("{p}.self_attn.q_proj.bias"), b.narrow(0, 0, nq)));
                v.push((format!("{p}.self_attn.k_proj.bias"), b.narrow(0, nq, nkv)));
                v.push((
                    format!("{p}.self_attn.v_proj.bias"),
                    b.narrow(0, nq + nkv, nkv),
                ));
            }
            if let Some((qn, kn)) = &l.qk_norm {
                v.push((format!("{p}.self_attn.q_norm.weight"), qn.shallow_clone()));
                v.push((format!("{p}.self_attn.k_norm.weight"), kn.shallow_clone()));
            }
            v.push((format!("{p}.self_attn.o_proj.weight"), l.wo.tr()));
            v.push((
                format!("{p}.post_attention_layernorm.weight"),
                l.ln2.shallow_clone(),
            ));
            v.push((
                format!("{p}.mlp.gate_proj.weight"),
                l.w_gate_up.narrow(1, 0, f).tr(),
            ));
            v.push((
                format!("{p}.mlp.up_proj.weight"),
                l.w_gate_up.narrow(1, f, f).tr(),
            ));
            v.push((format!("{p}.mlp.down_proj.weight"), l.w_down.tr()));
        }
        v.push(("model.norm.weight".into(), self.norm.shallow_clone()));
        if let Some(w) = &self.lm_head {
            v.push(("lm_head.weight".into(), w.tr()));
        }
        if let Some(hd) = &self.head {
            v.push((format!("{}.weight", hd.prefix), hd.weight.shallow_clone()));
            if let Some(b) = &hd.bias {
                v.push((format!("{}.bias", hd.prefix), b.shallow_clone()));
            }
        }
        v
    }

    /// Copies HF-named tensors into the weights in place (no reallocation): every name
    /// must exist and match in shape; dtype/device are converted. Names absent from
    /// `src` are left as they are. LoRA adapter tensors (PEFT names with
    /// `lora.scaling`, an adapter weight sync) are folded into the base matrices
    /// instead (see `lora.rs`).
    pub fn copy_weights_from<'a>(
        &mut self,
        src: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<usize> {
        let (adapters, plain): (Vec<(&str, &Tensor)>, Vec<(&str, &Tensor)>) =
            src.into_iter().partition(|(n, _)| is_adapter_name(n));
        let mut n = 0;
        if !plain.is_empty() {
            n += self.copy_plain_weights(plain)?;
            // New base weights: a later adapter sync folds into these, not the old ones.
            self.merge_base = None;
        }
        if !adapters.is_empty() {
            n += self.take_adapter_update(adapters)?;
        }
        Ok(n)
    }

    fn copy_plain_weights(&mut self, src: Vec<(&str, &Tensor)>) -> Result<usize> {
        let dst: HashMap<String, Tensor> = self.hf_named_tensors().into_iter().collect();
        let mut n = 0;
        tch::no_grad(|| -> Result<()> {
            for (name, t) in src {
                let mut d = dst
                    .get(name)
                    .ok_or_else(|| {
                        EngineError::Weights(format!("no parameter named `{name}` in this model"))
                    })?
                    .shallow_clone();
                if d.size() != t.size() {
                    return Err(EngineError::Weights(format!(
                        "`{name}`: shape {:?} does not match the model's {:?}",
                        t.size(),
                        d.size()
                    )));
                }
                d.f_copy_(t)?;
                n += 1;
            }
            Ok(())
        })?;
        if let Some(b) = self.packed.as_ref().map(|p| p.batch) {
            self.pack_for_inference(b);
        }
        Ok(n)
    }

    /// A deep copy of the parameters by canonical name (detached, contiguous, in their
    /// own dtype and device): weights another model in this process can take over with
    /// [`Llama::adopt_weights`], without the byte buckets a weight sync between
    /// processes needs. One pass over the weights.
    ///
    /// With LoRA adapters the snapshot is the merged model without adapters: what an
    /// inference model of the base's shape adopts.
    pub fn weights_snapshot(&mut self) -> Vec<(String, Tensor)> {
        let merged: HashMap<String, Tensor> = tch::no_grad(|| {
            let mut m = HashMap::new();
            for i in 0..self.layers.len() {
                for (mat, name) in [
                    (Matrix::Qkv, "wqkv"),
                    (Matrix::O, "wo"),
                    (Matrix::GateUp, "w_gate_up"),
                    (Matrix::Down, "w_down"),
                ] {
                    if let Some(w) = self.merged_matrix(i, mat) {
                        m.insert(format!("layers.{i}.{name}"), w);
                    }
                }
            }
            m
        });
        let adapted = self.lora.is_some();
        tch::no_grad(|| {
            self.all_parameters_mut()
                .into_iter()
                .filter(|(n, _)| !(adapted && n.starts_with("lora.")))
                .map(|(n, t)| match merged.get(&n) {
                    Some(w) => (n, w.shallow_clone()),
                    None => (n, t.detach().copy()),
                })
                .collect()
        })
    }

    /// Takes `snapshot`'s tensors (from [`Llama::weights_snapshot`] of a model with the
    /// same config) as this model's weights, without copying them: models adopting the
    /// same snapshot share its storage. Only a tensor of another dtype or device is
    /// converted. For inference models only (none of the parameters may require
    /// gradients: training would write into the shared storage). Every parameter must
    /// be in the snapshot with its shape. Repacks packed inference weights. Returns how
    /// many tensors were adopted.
    pub fn adopt_weights(&mut self, snapshot: &[(String, Tensor)]) -> Result<usize> {
        let (device, kind) = (self.device, self.kind);
        // Mutable access to the parameters drops the packed copies: repack after, also
        // when the snapshot is refused.
        let repack = self.packed.as_ref().map(|p| p.batch);
        let adopted = adopt_into(self.all_parameters_mut(), snapshot, device, kind);
        if let Some(b) = repack {
            self.pack_for_inference(b);
        }
        adopted
    }

    /// Moves every parameter to `device` (e.g. CPU for offload, back to CUDA for reload);
    /// the old storage is released once nothing else references it.
    pub fn to_device(&mut self, device: Device) {
        tch::no_grad(|| {
            for (_, t) in self.all_parameters_mut() {
                let rg = t.requires_grad();
                let moved = t.detach().to_device(device);
                *t = if rg {
                    moved.set_requires_grad(true)
                } else {
                    moved
                };
            }
        });
        self.packed = None;
        self.cos = self.cos.to_device(device);
        self.sin = self.sin.to_device(device);
        self.device = device;
    }

    /// The row-count hint the model is packed for inference with, if it is packed
    /// ([`Llama::pack_for_inference`]): what to repack with after writing weights.
    pub fn inference_pack_batch(&self) -> Option<i64> {
        self.packed.as_ref().map(|p| p.batch)
    }

    /// Prepacks the matrices with oneDNN for calls of about `batch` rows (f32 on CPU
    /// only; a no-op elsewhere). Inference calls then use the packed copies (extra memory
    /// the size of the weights); any mutable access to the parameters drops them, and
    /// [`Llama::copy_weights_from`] repacks. Returns whether packing is active.
    pub fn pack_for_inference(&mut self, batch: i64) -> bool {
        self.packed = None;
        // Packed copies hold the base matrices alone: a model with adapters runs them
        // on the tch path (merge the adapters first to serve it fast).
        if self.lora.is_some()
            || self.device != Device::Cpu
            || self.kind != Kind::Float
            || !crate::onednn::available()
        {
            return false;
        }
        // oneDNN picks the weight layout from this row-count hint. Below ~128 rows it keeps
        // the plain layout and runs its `gemm:jit` path, which repacks the weights on every
        // call; from 128 up it picks a blocked layout (AB16b64a on AVX-512) for its brgemm
        // kernels, which are 2-3x faster even for 16-row decode steps. So the hint is never
        // below that.
        let b = batch.max(512);
        let pk = |w: &Tensor| crate::onednn::pack(&w.tr(), b);
        let mut layers = Vec::with_capacity(self.layers.len());
        for l in &self.layers {
            match (pk(&l.wqkv), pk(&l.wo), pk(&l.w_gate_up), pk(&l.w_down)) {
                (Ok(a), Ok(o), Ok(g), Ok(d)) => layers.push([a, o, g, d]),
                _ => return false,
            }
        }
        let Ok(lm_head) = pk(self.lm_head.as_ref().unwrap_or(&self.embed)) else {
            return false;
        };
        self.packed = Some(Packed {
            batch: b,
            layers,
            lm_head,
        });
        true
    }

    /// Whether oneDNN-packed inference weights are active.
    pub fn is_packed(&self) -> bool {
        self.packed.is_some()
    }
}

/// [`Llama::adopt_weights`] on the parameters: checks everything first, so a bad
/// snapshot leaves them as they were.
fn adopt_into(
    mut params: Vec<(String, &mut Tensor)>,
    snapshot: &[(String, Tensor)],
    device: Device,
    kind: Kind,
) -> Result<usize> {
    let by_name: HashMap<&str, &Tensor> = snapshot.iter().map(|(n, t)| (n.as_str(), t)).collect();
    for (name, t) in &params {
        if t.requires_grad() {
            return Err(EngineError::Weights(format!(
                "`{name}` requires gradients: only an inference model can adopt shared weights; copy them in with copy_weights_from"
            )));
        }
        let src = by_name
            .get(name.as_str())
            .ok_or_else(|| EngineError::Weights(format!("the snapshot has no `{name}`")))?;
        if src.size() != t.size() {
            return Err(EngineError::Weights(format!(
                "`{name}`: shape {:?} in the snapshot, {:?} in the model",
                src.size(),
                t.size()
            )));
        }
    }
    if let Some((extra, _)) = snapshot
        .iter()
        .find(|(n, _)| !params.iter().any(|(m, _)| m == n))
    {
        return Err(EngineError::Weights(format!(
            "`{extra}` in the snapshot is no parameter of this model"
        )));
    }
    tch::no_grad(|| {
        for (name, t) in params.iter_mut() {
            **t = by_name[name.as_str()]
                .to_device(device)
                .to_kind(kind)
                .shallow_clone();
        }
    });
    Ok(params.len())
}
