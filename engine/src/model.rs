//! The Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or
//! untied embeddings), its KV cache and its scalar heads.
//!
//! The canonical parameters fuse q/k/v into one matrix and gate/up into another (fewer,
//! larger GEMMs); the HF names are exposed as views into them
//! ([`Llama::hf_named_tensors`]) for checkpoints and weight sync.

use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

/// One decoder layer's parameters.
#[derive(Debug)]
pub struct Layer {
    /// RMSNorm before attention.
    pub ln1: Tensor,
    /// Fused q/k/v projection, stored input-major `[hidden, (H + 2·KV)·hd]` (the transpose
    /// of HF's layout: `x @ W` runs MKL's fast NN GEMM without repacking the weights).
    pub wqkv: Tensor,
    /// Fused q/k/v bias (Qwen2).
    pub bqkv: Option<Tensor>,
    /// Output projection, input-major `[H·hd, hidden]`.
    pub wo: Tensor,
    /// RMSNorm before the MLP.
    pub ln2: Tensor,
    /// Fused gate/up projection, input-major `[hidden, 2·ffn]`.
    pub w_gate_up: Tensor,
    /// Down projection, input-major `[ffn, hidden]`.
    pub w_down: Tensor,
}

/// A scalar head on the final hidden state (value head or reward head).
#[derive(Debug)]
pub struct ScalarHead {
    /// HF name prefix (`score` for reward models, `v_head` for critics).
    pub prefix: String,
    /// `[1, hidden]`.
    pub weight: Tensor,
    /// `[1]`, if any.
    pub bias: Option<Tensor>,
}

impl ScalarHead {
    /// A zero-initialised head (`bias` included for value heads).
    pub fn new(prefix: &str, hidden: i64, with_bias: bool, device: Device, kind: Kind) -> Self {
        let weight = Tensor::zeros([1, hidden], (kind, device));
        let bias = with_bias.then(|| Tensor::zeros([1], (kind, device)));
        ScalarHead {
            prefix: prefix.to_string(),
            weight,
            bias,
        }
    }
    /// Applies the head: `[.., hidden] → [..]`.
    pub fn forward(&self, h: &Tensor) -> Tensor {
        h.linear(&self.weight, self.bias.as_ref()).squeeze_dim(-1)
    }
}

/// Positions per key block of the cache (see [`KvCache`]).
pub const KV_BLOCK: i64 = 16;

/// A preallocated key/value cache. Per layer, values are `[slots, kv_heads, max_len,
/// head_dim]` and keys are stored in blocks of [`KV_BLOCK`] positions, transposed within
/// each block: `[slots, kv_heads, max_len / KV_BLOCK, head_dim, KV_BLOCK]`. The CPU decode
/// kernel then streams both contiguously: 16 scores at a time from one block of keys
/// (one vector per head dimension, no horizontal sums), and the weighted sum row by row
/// over the values.
#[derive(Debug)]
pub struct KvCache {
    kb: Vec<Tensor>,
    v: Vec<Tensor>,
    /// Number of sequence slots.
    pub slots: i64,
    /// Positions per slot.
    pub max_len: i64,
}

impl KvCache {
    /// Allocates a cache for `model`.
    pub fn new(model: &Llama, slots: i64, max_len: i64) -> Self {
        let c = &model.config;
        let opts = (model.kind, model.device);
        let (nkv, hd) = (c.num_key_value_heads, c.head_dim);
        let blocks = (max_len + KV_BLOCK - 1) / KV_BLOCK;
        let kb = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([slots, nkv, blocks, hd, KV_BLOCK], opts))
            .collect();
        let v = (0..c.num_hidden_layers)
            .map(|_| Tensor::zeros([slots, nkv, max_len, hd], opts))
            .collect();
        KvCache {
            kb,
            v,
            slots,
            max_len,
        }
    }

    /// Keys of slots `start..start+n`, positions `0..len`, as a dense
    /// `[n, kv_heads, len, head_dim]` copy.
    fn keys(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        let k = self.kb[layer]
            .narrow(0, start, n)
            .narrow(2, 0, (len + KV_BLOCK - 1) / KV_BLOCK)
            .permute([0, 1, 2, 4, 3]);
        let (kv, hd) = (k.size()[1], k.size()[4]);
        k.reshape([n, kv, -1, hd]).narrow(2, 0, len)
    }

    /// Values of slots `start..start+n`, positions `0..len`: a view
    /// `[n, kv_heads, len, head_dim]`.
    fn values(&self, layer: usize, start: i64, n: i64, len: i64) -> Tensor {
        self.v[layer].narrow(0, start, n).narrow(2, 0, len)
    }

    /// Where the keys of `positions` `[n, t]` in `slots` `[n]` go: (row, lane) indices into
    /// a layer's keys viewed as `[slots · kv_heads · blocks, head_dim, KV_BLOCK]`, ordered
    /// like `k.reshape([-1, head_dim])` for `k` `[n, kv_heads, t, head_dim]`.
    fn key_index(&self, slots: &Tensor, positions: &Tensor) -> (Tensor, Tensor) {
        let size = self.kb[0].size();
        let (nkv, blocks) = (size[1], size[2]);
        let dev = self.device();
        let (n, t) = positions.size2().expect("positions must be [n, t]");
        let heads = Tensor::arange(nkv, (Kind::Int64, dev)).reshape([1, nkv, 1]);
        let slot_rows = slots.reshape([n, 1, 1]) * nkv + heads; // [n, kv, 1]
        let pos = positions.reshape([n, 1, t]);
        let row = (slot_rows * blocks + pos.floor_divide_scalar(KV_BLOCK)).reshape([-1]);
        let lane = pos
            .remainder(KV_BLOCK)
            .expand([n, nkv, t], false)
            .reshape([-1]);
        (row, lane)
    }

    /// Writes keys and values `[n, kv_heads, t, head_dim]` of one layer: the keys where
    /// `index` (from [`KvCache::key_index`]) says, the values where `at` says.
    fn write(
        &mut self,
        layer: usize,
        index: &(Tensor, Tensor),
        k: &Tensor,
        v: &Tensor,
        at: ValueSlots<'_>,
    ) {
        let size = self.kb[layer].size();
        let hd = size[3];
        let mut flat = self.kb[layer].view([-1, hd, KV_BLOCK]);
        let _ = flat.index_put_(
            &[Some(&index.0), None, Some(&index.1)],
            &k.reshape([-1, hd]),
            false,
        );
        match at {
            ValueSlots::Range { start, offset } => {
                let (n, t) = (v.size()[0], v.size()[2]);
                self.v[layer]
                    .narrow(0, start, n)
                    .narrow(2, offset, t)
                    .copy_(v);
            }
            ValueSlots::Rows { rows, pos } => {
                let _ = self.v[layer].index_put_(
                    &[Some(rows), None, Some(pos)],
                    &v.squeeze_dim(2),
                    false,
                );
            }
        }
    }

    /// Copies the first `len` positions of slot `from` into slot `to`.
    pub fn move_slot(&mut self, from: i64, to: i64, len: i64) {
        if from == to || len == 0 {
            return;
        }
        self.copy_slots(&[from], &[to], len);
    }

    /// Copies the first `len` positions of slot `src[i]` into slot `dst[i]`, for every
    /// `i` (prefix sharing: prompts prefilled once are copied into the other slots). No
    /// slot may be both a source and a destination.
    pub fn copy_slots(&mut self, src: &[i64], dst: &[i64], len: i64) {
        assert_eq!(
            src.len(),
            dst.len(),
            "copy_slots: one source per destination"
        );
        if src.is_empty() || len == 0 {
            return;
        }
        let dev = self.device();
        let si = Tensor::from_slice(src).to_device(dev);
        let di = Tensor::from_slice(dst).to_device(dev);
        tch::no_grad(|| {
            for t in self.kb.iter_mut() {
                let mut view = t.narrow(2, 0, (len + KV_BLOCK - 1) / KV_BLOCK);
                let rows = view.index_select(0, &si);
                let _ = view.index_copy_(0, &di, &rows);
            }
            for t in self.v.iter_mut() {
                let mut view = t.narrow(2, 0, len);
                let rows = view.index_select(0, &si);
                let _ = view.index_copy_(0, &di, &rows);
            }
        });
    }

    /// Data pointer of the first layer's key tensor (identity check for reuse).
    pub fn k_ptr(&self) -> usize {
        self.kb.first().map(|t| t.data_ptr() as usize).unwrap_or(0)
    }

    /// The device the cache lives on.
    pub fn device(&self) -> Device {
        self.kb.first().map(|t| t.device()).unwrap_or(Device::Cpu)
    }

    /// Bytes held by the cache.
    pub fn bytes(&self) -> usize {
        self.kb
            .iter()
            .chain(self.v.iter())
            .map(|t| t.numel() * t.kind().elt_size_in_bytes())
            .sum()
    }
}

/// Where [`KvCache::write`] puts values.
enum ValueSlots<'a> {
    /// Slots `start..start+n`, positions `offset..offset+t`.
    Range { start: i64, offset: i64 },
    /// One token per row: slot `rows[i]`, position `pos[i]`.
    Rows { rows: &'a Tensor, pos: &'a Tensor },
}

/// How attention sees the past in one forward call.
pub enum Attn<'a> {
    /// No cache: causal attention over the given tokens, with an optional key mask
    /// `[B, T]` (1 = real token).
    Full {
        /// The padding mask, if any.
        mask: Option<&'a Tensor>,
    },
    /// Prefill slots `start..start+B` of a cache from position `offset` (right-padded
    /// input). Positions `0..offset` must already hold the slots' shared prefix; the new
    /// tokens attend to it and, causally, to each other.
    Prefill {
        /// The cache.
        cache: &'a mut KvCache,
        /// The first slot.
        start: i64,
        /// Cache positions already filled (0: a fresh prompt).
        offset: i64,
        /// Each row's real length (the rest is padding): the per-token work (projections,
        /// MLP) then skips the padding; only attention sees the padded layout.
        lens: Option<&'a [i64]>,
    },
    /// Like `Full` without a mask (right-padded rows), and keeps each layer's keys and
    /// values (after RoPE, still in the autograd graph) in `kv` for a later
    /// [`Attn::Continue`] call: a prompt shared by several rows runs once.
    Capture {
        /// Filled with one `(keys, values)` pair per layer, `[P, kv_heads, Lp, head_dim]`.
        kv: &'a mut Vec<(Tensor, Tensor)>,
    },
    /// Tokens that continue prefixes computed by an earlier [`Attn::Capture`] call (e.g.
    /// GRPO's samples of one prompt continue that prompt). Row `i` attends to the first
    /// `lens[i]` positions of prefix `rows[i]` and, causally, to its own tokens; the
    /// forward's positions must start at `lens[i]`. Gradients flow into the prefix's
    /// keys and values, summed over the rows that share it.
    Continue {
        /// The prefixes' keys and values, per layer (from `Capture`).
        kv: &'a [(Tensor, Tensor)],
        /// Which prefix each row continues `[B]` (int64).
        rows: &'a Tensor,
        /// The real length of each row's prefix `[B]` (int64); the rest is padding.
        lens: &'a Tensor,
    },
    /// One new token per slot `0..B`, at the per-slot positions given to the forward.
    Decode {
        /// The cache.
        cache: &'a mut KvCache,
        /// Number of cache positions to attend over (max position + 1).
        span: i64,
        /// Per row, `(slot, len)`: its positions below `len` hold the same keys and
        /// values as `slot`'s (len 0: none), e.g. samples of one prompt. A hint: the CPU
        /// decode kernel then reads one copy for all rows sharing it (it stays in cache);
        /// results are the same without it.
        shared: Option<&'a [(i64, i64)]>,
    },
}

/// Scaled dot-product attention (libtorch's fused kernel; GQA heads shared), causal
/// when no mask is given: every call site either masks explicitly or is plain causal.
fn attend(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> Tensor {
    Tensor::scaled_dot_product_attention(q, k, v, mask, 0.0, mask.is_none(), None, true)
}

/// A Llama-family causal LM.
#[derive(Debug)]
pub struct Llama {
    /// The configuration.
    pub config: ModelConfig,
    /// Token embedding, stored transposed `[hidden, vocab]` (input-major for the tied LM head).
    pub embed: Tensor,
    /// The decoder layers.
    pub layers: Vec<Layer>,
    /// The final RMSNorm.
    pub norm: Tensor,
    /// The untied LM head, input-major `[hidden, vocab]`, or `None` when tied to `embed`.
    pub lm_head: Option<Tensor>,
    /// A scalar head (critic / reward), if attached.
    pub head: Option<ScalarHead>,
    device: Device,
    kind: Kind,
    cos: Tensor,
    sin: Tensor,
    packed: Option<Packed>,
}

/// oneDNN-prepacked copies of the matrices, for inference on CPU.
#[derive(Debug)]
struct Packed {
    batch: i64,
    /// Per layer: wqkv, wo, w_gate_up, w_down.
    layers: Vec<[Tensor; 4]>,
    lm_head: Tensor,
}

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
    /// Loads an HF model directory onto `device` as `kind`.
    pub fn load(dir: impl AsRef<Path>, device: Device, kind: Kind) -> Result<Self> {
        let dir = dir.as_ref();
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
            let f = c.intermediate_size;
            let gate = g(&mut t, "mlp.gate_proj.weight", &[f, h])?;
            let up = g(&mut t, "mlp.up_proj.weight", &[f, h])?;
            layers.push(Layer {
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

    /// The canonical (trainable) parameters with stable names, for optimizers.
    pub fn parameters_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        // The caller may change the weights: drop packed inference copies.
        self.packed = None;
        let mut v: Vec<(String, &mut Tensor)> = vec![("embed".into(), &mut self.embed)];
        for (i, l) in self.layers.iter_mut().enumerate() {
            v.push((format!("layers.{i}.ln1"), &mut l.ln1));
            v.push((format!("layers.{i}.wqkv"), &mut l.wqkv));
            if let Some(b) = l.bqkv.as_mut() {
                v.push((format!("layers.{i}.bqkv"), b));
            }
            v.push((format!("layers.{i}.wo"), &mut l.wo));
            v.push((format!("layers.{i}.ln2"), &mut l.ln2));
            v.push((format!("layers.{i}.w_gate_up"), &mut l.w_gate_up));
            v.push((format!("layers.{i}.w_down"), &mut l.w_down));
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
        v
    }

    /// The canonical parameters (shallow clones sharing storage).
    pub fn parameters(&mut self) -> Vec<(String, Tensor)> {
        self.parameters_mut()
            .into_iter()
            .map(|(n, t)| (n, t.shallow_clone()))
            .collect()
    }

    /// Total number of parameters.
    pub fn num_parameters(&mut self) -> i64 {
        self.parameters_mut()
            .iter()
            .map(|(_, t)| t.numel() as i64)
            .sum()
    }

    /// Sets `requires_grad` on every parameter.
    pub fn set_requires_grad(&mut self, on: bool) {
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
    /// `src` are left as they are.
    pub fn copy_weights_from<'a>(
        &mut self,
        src: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<usize> {
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
    pub fn weights_snapshot(&mut self) -> Vec<(String, Tensor)> {
        tch::no_grad(|| {
            self.parameters_mut()
                .into_iter()
                .map(|(n, t)| (n, t.detach().copy()))
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
        let adopted = adopt_into(self.parameters_mut(), snapshot, device, kind);
        if let Some(b) = repack {
            self.pack_for_inference(b);
        }
        adopted
    }

    /// A deep copy on `device` as `kind` (e.g. a frozen reference policy). The copy does
    /// not require gradients.
    pub fn deep_copy(&self, device: Device, kind: Kind) -> Result<Llama> {
        let tensors: HashMap<String, Tensor> = tch::no_grad(|| {
            self.hf_named_tensors()
                .into_iter()
                .map(|(n, t)| (n, t.detach().to_device(device).to_kind(kind).copy()))
                .collect()
        });
        let mut m = Llama::from_tensors(self.config.clone(), tensors, device, kind)?;
        m.set_requires_grad(false);
        Ok(m)
    }

    /// Moves every parameter to `device` (e.g. CPU for offload, back to CUDA for reload);
    /// the old storage is released once nothing else references it.
    pub fn to_device(&mut self, device: Device) {
        tch::no_grad(|| {
            for (_, t) in self.parameters_mut() {
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

    /// Prepacks the matrices with oneDNN for calls of about `batch` rows (f32 on CPU
    /// only; a no-op elsewhere). Inference calls then use the packed copies (extra memory
    /// the size of the weights); any mutable access to the parameters drops them, and
    /// [`Llama::copy_weights_from`] repacks. Returns whether packing is active.
    pub fn pack_for_inference(&mut self, batch: i64) -> bool {
        self.packed = None;
        if self.device != Device::Cpu || self.kind != Kind::Float || !crate::onednn::available() {
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

    /// `x @ w (+ bias)`, through the packed copy when there is one.
    fn mm(&self, x: &Tensor, w: &Tensor, packed: Option<&Tensor>, bias: Option<&Tensor>) -> Tensor {
        if let Some(p) = packed {
            if let Ok(y) = crate::onednn::linear(x, p, bias, w.size()[1]) {
                return y;
            }
        }
        match bias {
            Some(b) => x.matmul(w) + b,
            None => x.matmul(w),
        }
    }

    fn rms(&self, x: &Tensor, w: &Tensor) -> Tensor {
        let eps = self.config.rms_norm_eps;
        if self.kind == Kind::Float {
            x.rms_norm([self.config.hidden_size], Some(w), eps)
        } else {
            let xf = x.to_kind(Kind::Float);
            let var = xf.square().mean_dim(-1, true, Kind::Float);
            (xf * (var + eps).rsqrt()).to_kind(self.kind) * w
        }
    }

    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor) -> Tensor {
        // x [B, heads, T, hd]; cos/sin [B, 1, T, hd/2]
        let half = self.config.head_dim / 2;
        let x1 = x.narrow(-1, 0, half);
        let x2 = x.narrow(-1, half, half);
        Tensor::cat(&[&x1 * cos - &x2 * sin, &x2 * cos + &x1 * sin], -1)
    }

    /// The fused CPU decode step (`csrc/decode_step.cpp`): one call for the whole decoder
    /// stack instead of ~70 tch operations per layer. `None` when it does not apply
    /// (weights not packed, autograd on, more than one token per row) or fails, in which
    /// case the caller takes the tch path.
    fn decode_fused(
        &self,
        ids: &Tensor,
        positions: &Tensor,
        cache: &KvCache,
        shared: Option<&[(i64, i64)]>,
    ) -> Option<Tensor> {
        let packed = self
            .packed
            .as_ref()
            .filter(|_| !self.embed.requires_grad())?;
        let (b, t) = ids.size2().ok()?;
        if t != 1 || b > cache.slots {
            return None;
        }
        let c = &self.config;
        let x = Tensor::embedding(&self.embed.tr(), &ids.reshape([b]), -1, false, false);
        let pos = positions.reshape([b]).to_kind(Kind::Int64).contiguous();
        let shared = match shared {
            Some(sh) if sh.len() == b as usize && sh.iter().any(|&(_, l)| l > 0) => {
                let slots: Vec<i64> = sh.iter().map(|&(s, _)| s).collect();
                let lens: Vec<i64> = sh.iter().map(|&(_, l)| l).collect();
                Some((Tensor::from_slice(&slots), Tensor::from_slice(&lens)))
            }
            _ => None,
        };
        let layers: Vec<crate::onednn::DecodeLayer<'_>> = self
            .layers
            .iter()
            .zip(&packed.layers)
            .enumerate()
            .map(|(i, (l, p))| crate::onednn::DecodeLayer {
                ln1: &l.ln1,
                wqkv: &p[0],
                bqkv: l.bqkv.as_ref(),
                wo: &p[1],
                ln2: &l.ln2,
                wgu: &p[2],
                wdown: &p[3],
                kb: &cache.kb[i],
                v: &cache.v[i],
            })
            .collect();
        match crate::onednn::decode_layers(
            &x,
            &pos,
            shared.as_ref().map(|(s, l)| (s, l)),
            &self.cos,
            &self.sin,
            &layers,
            (c.num_attention_heads, c.num_key_value_heads, c.head_dim),
            c.rms_norm_eps,
        ) {
            Ok(x) => Some(self.rms(&x, &self.norm).unsqueeze(1)),
            Err(e) => {
                // A failure here is a bug, not bad input; the tch path gives the same
                // result, so say so once and carry on.
                static WARN: std::sync::Once = std::sync::Once::new();
                WARN.call_once(|| {
                    eprintln!("yatt-engine: fused decode step failed, using tch ops: {e}")
                });
                None
            }
        }
    }

    // `x = x + f(x)` on purpose: an in-place `+=` would modify a tensor autograd saved.
    #[allow(clippy::assign_op_pattern)]
    /// Embeds tokens and runs the decoder stack; returns the final-normed hidden states
    /// `[B, T, hidden]`. `positions` `[B, T]` are the rotary positions.
    pub fn hidden(&self, ids: &Tensor, positions: &Tensor, mut attn: Attn<'_>) -> Tensor {
        if let Attn::Decode { cache, shared, .. } = &attn {
            if let Some(h) = self.decode_fused(ids, positions, cache, *shared) {
                return h;
            }
        }
        let c = &self.config;
        let (b, t) = ids.size2().expect("ids must be [B, T]");
        let (nh, nkv, hd) = (c.num_attention_heads, c.num_key_value_heads, c.head_dim);
        // Ragged prefill: real tokens only, as rows of [n, hidden]; `pad` restores the
        // [b, t, ..] layout (zeros in the padding) where attention needs it.
        let real = match &attn {
            Attn::Prefill {
                lens: Some(lens), ..
            } if lens.iter().any(|&l| l < t) => {
                let mut idx = Vec::with_capacity(lens.iter().sum::<i64>() as usize);
                for (i, &l) in lens.iter().enumerate() {
                    idx.extend((0..l.min(t)).map(|j| i as i64 * t + j));
                }
                Some(Tensor::from_slice(&idx).to_device(self.device))
            }
            _ => None,
        };
        let pad = |z: Tensor| -> Tensor {
            match &real {
                Some(idx) => {
                    let w = *z.size().last().expect("rows have a width");
                    z.new_zeros([b * t, w], (z.kind(), z.device()))
                        .index_copy(0, idx, &z)
                        .view([b, t, w])
                }
                None => z,
            }
        };
        let mut x = Tensor::embedding(&self.embed.tr(), ids, -1, false, false);
        if let Some(idx) = &real {
            x = x.reshape([b * t, -1]).index_select(0, idx);
        }
        let cos = self
            .cos
            .index_select(0, &positions.reshape([-1]))
            .reshape([b, 1, t, hd / 2])
            .to_kind(self.kind);
        let sin = self
            .sin
            .index_select(0, &positions.reshape([-1]))
            .reshape([b, 1, t, hd / 2])
            .to_kind(self.kind);
        // Attention masks, built once for all layers.
        let full_mask = match &attn {
            Attn::Full { mask: Some(m) } => {
                let causal = Tensor::ones([t, t], (Kind::Bool, self.device)).tril(0);
                let keys = m.to_kind(Kind::Bool).reshape([b, 1, 1, t]);
                let eye = Tensor::eye(t, (Kind::Bool, self.device));
                Some(causal.logical_and(&keys).logical_or(&eye))
            }
            // New token i sees the whole shared prefix and new tokens 0..=i.
            Attn::Prefill { offset, .. } if *offset > 0 => {
                let keys = Tensor::arange(offset + t, (Kind::Int64, self.device));
                let rows = Tensor::arange(t, (Kind::Int64, self.device)).unsqueeze(1) + *offset;
                Some(
                    keys.unsqueeze(0)
                        .le_tensor(&rows)
                        .reshape([1, 1, t, offset + t]),
                )
            }
            Attn::Decode { span, .. } => {
                let ar =
                    Tensor::arange(*span, (Kind::Int64, self.device)).reshape([1, 1, 1, *span]);
                Some(ar.le_tensor(&positions.reshape([b, 1, 1, 1])))
            }
            // Prefix keys below the row's prefix length, then causal over its own tokens.
            Attn::Continue { kv, lens, .. } => {
                let lp = kv.first().map_or(0, |(k, _)| k.size()[2]);
                let keys = Tensor::arange(lp, (Kind::Int64, self.device)).reshape([1, 1, 1, lp]);
                let prefix = keys
                    .lt_tensor(&lens.reshape([b, 1, 1, 1]))
                    .expand([b, 1, t, lp], false);
                let causal = Tensor::ones([t, t], (Kind::Bool, self.device))
                    .tril(0)
                    .reshape([1, 1, t, t])
                    .expand([b, 1, t, t], false);
                Some(Tensor::cat(&[prefix, causal], 3))
            }
            _ => None,
        };
        let rows = Tensor::arange(b, (Kind::Int64, self.device));
        let pos_flat = if matches!(attn, Attn::Decode { .. }) {
            Some(positions.reshape([b]))
        } else {
            None
        };
        // Packed weights only serve inference: with autograd on, use the parameters.
        let packed = if self.packed.is_some() && !self.embed.requires_grad() {
            self.packed.as_ref()
        } else {
            None
        };
        // Cache indices of the new keys, the same for every layer.
        let mut key_index: Option<(Tensor, Tensor)> = None;
        for (li, l) in self.layers.iter().enumerate() {
            let pl = packed.map(|p| &p.layers[li]);
            let hn = self.rms(&x, &l.ln1);
            let qkv = pad(self.mm(&hn, &l.wqkv, pl.map(|p| &p[0]), l.bqkv.as_ref()));
            let q = qkv
                .narrow(-1, 0, nh * hd)
                .view([b, t, nh, hd])
                .transpose(1, 2);
            let k = qkv
                .narrow(-1, nh * hd, nkv * hd)
                .view([b, t, nkv, hd])
                .transpose(1, 2);
            let v = qkv
                .narrow(-1, (nh + nkv) * hd, nkv * hd)
                .view([b, t, nkv, hd])
                .transpose(1, 2);
            let q = self.rope(&q, &cos, &sin);
            let k = self.rope(&k, &cos, &sin);
            let o = match &mut attn {
                Attn::Capture { kv } => {
                    kv.push((k.shallow_clone(), v.shallow_clone()));
                    attend(&q, &k, &v, None)
                }
                Attn::Continue { kv, rows, .. } => {
                    let (pk, pv) = &kv[li];
                    let keys = Tensor::cat(&[pk.index_select(0, rows), k], 2);
                    let values = Tensor::cat(&[pv.index_select(0, rows), v], 2);
                    attend(&q, &keys, &values, full_mask.as_ref())
                }
                Attn::Full { .. } => attend(&q, &k, &v, full_mask.as_ref()),
                Attn::Prefill {
                    cache,
                    start,
                    offset,
                    ..
                } => {
                    let index = key_index.get_or_insert_with(|| {
                        let slots =
                            Tensor::arange_start(*start, *start + b, (Kind::Int64, self.device));
                        cache.key_index(&slots, positions)
                    });
                    let at = ValueSlots::Range {
                        start: *start,
                        offset: *offset,
                    };
                    cache.write(li, index, &k, &v, at);
                    if *offset == 0 {
                        attend(&q, &k, &v, None)
                    } else {
                        let len = *offset + t;
                        attend(
                            &q,
                            &cache.keys(li, *start, b, len),
                            &cache.values(li, *start, b, len),
                            full_mask.as_ref(),
                        )
                    }
                }
                Attn::Decode { cache, span, .. } => {
                    let pos = pos_flat.as_ref().expect("decode positions");
                    let index = key_index.get_or_insert_with(|| cache.key_index(&rows, positions));
                    cache.write(li, index, &k, &v, ValueSlots::Rows { rows: &rows, pos });
                    attend(
                        &q,
                        &cache.keys(li, 0, b, *span),
                        &cache.values(li, 0, b, *span),
                        full_mask.as_ref(),
                    )
                }
            };
            let mut o = o.transpose(1, 2).reshape([b, t, nh * hd]);
            if let Some(idx) = &real {
                o = o.reshape([b * t, nh * hd]).index_select(0, idx);
            }
            x = x + self.mm(&o, &l.wo, pl.map(|p| &p[1]), None);
            let hn = self.rms(&x, &l.ln2);
            let gu = self.mm(&hn, &l.w_gate_up, pl.map(|p| &p[2]), None);
            let f = c.intermediate_size;
            let act = gu.narrow(-1, 0, f).silu() * gu.narrow(-1, f, f);
            x = x + self.mm(&act, &l.w_down, pl.map(|p| &p[3]), None);
        }
        pad(self.rms(&x, &self.norm))
    }

    /// LM logits for hidden states `[.., hidden] → [.., vocab]`.
    pub fn logits(&self, h: &Tensor) -> Tensor {
        let w = self.lm_head.as_ref().unwrap_or(&self.embed);
        let packed = self
            .packed
            .as_ref()
            .filter(|_| !self.embed.requires_grad())
            .map(|p| &p.lm_head);
        self.mm(h, w, packed, None)
    }

    /// Full forward: logits `[B, T, vocab]` for token ids `[B, T]` with an optional
    /// padding mask `[B, T]` (1 = token). Positions count real tokens (left padding works).
    pub fn forward(&self, ids: &Tensor, mask: Option<&Tensor>) -> Tensor {
        let positions = positions_from_mask(ids, mask);
        let h = self.hidden(ids, &positions, Attn::Full { mask });
        self.logits(&h)
    }
}

/// Rotary positions for a batch: `cumsum(mask) - 1` (clamped at 0), or `0..T`.
pub fn positions_from_mask(ids: &Tensor, mask: Option<&Tensor>) -> Tensor {
    let (b, t) = ids.size2().expect("ids must be [B, T]");
    match mask {
        Some(m) => (m.to_kind(Kind::Int64).cumsum(1, Kind::Int64) - 1).clamp_min(0),
        None => Tensor::arange(t, (Kind::Int64, ids.device()))
            .unsqueeze(0)
            .expand([b, t], false),
    }
}

fn rope_tables(c: &ModelConfig, device: Device) -> (Tensor, Tensor) {
    let inv: Vec<f32> = c.rope_inv_freq().into_iter().map(|x| x as f32).collect();
    let inv = Tensor::from_slice(&inv);
    let n = c.max_position_embeddings.max(1);
    let pos = Tensor::arange(n, (Kind::Float, Device::Cpu));
    let freqs = pos.unsqueeze(1) * inv.unsqueeze(0); // [n, hd/2] in f32, like HF
    (freqs.cos().to_device(device), freqs.sin().to_device(device))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny random model and an unpacked copy. `wide`: SmolLM's head layout (head_dim
    /// 64, three query heads per kv head), which the decode kernel has a fixed-size path
    /// for; otherwise head_dim 16, two per kv head (its generic path).
    fn tiny(bias: bool, wide: bool) -> (Llama, Llama) {
        let mut cfg = crate::fixtures::tiny_config();
        cfg.attention_bias = bias;
        if wide {
            cfg.hidden_size = 384;
            cfg.num_attention_heads = 6;
            cfg.num_key_value_heads = 2;
            cfg.head_dim = 64;
        }
        let a = Llama::random(cfg, Device::Cpu, Kind::Float, 3).unwrap();
        let b = a.deep_copy(Device::Cpu, Kind::Float).unwrap();
        (a, b)
    }

    fn prompt_batch(prompts: &[Vec<i64>]) -> (Tensor, Tensor, Vec<i64>) {
        let n = prompts.len() as i64;
        let t = prompts.iter().map(|p| p.len()).max().unwrap() as i64;
        let mut ids = vec![0i64; (n * t) as usize];
        for (i, p) in prompts.iter().enumerate() {
            ids[i * t as usize..i * t as usize + p.len()].copy_from_slice(p);
        }
        let pos = Tensor::arange(t, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .expand([n, t], true);
        let lens = prompts.iter().map(|p| p.len() as i64).collect();
        (Tensor::from_slice(&ids).view([n, t]), pos, lens)
    }

    fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
        (a - b).abs().max().double_value(&[])
    }

    /// A packed inference model that adopts a trainer's snapshot computes what the
    /// trainer does, shares the snapshot's storage (no copy), repacks, and is not
    /// touched when the trainer trains on; a bad snapshot is refused with the name and
    /// leaves the weights as they were.
    #[test]
    fn adopting_a_snapshot_shares_it_and_computes_like_the_source() {
        let (mut trainer, mut rollout) = tiny(false, false);
        let other = Llama::random(trainer.config.clone(), Device::Cpu, Kind::Float, 9).unwrap();
        trainer
            .copy_weights_from(
                other
                    .hf_named_tensors()
                    .iter()
                    .map(|(n, t)| (n.as_str(), t)),
            )
            .unwrap();
        let packed = rollout.pack_for_inference(16);
        let ids = Tensor::from_slice(&[5i64, 17, 3, 9, 41, 2]).view([2, 3]);
        let want = tch::no_grad(|| trainer.forward(&ids, None));
        let snap = trainer.weights_snapshot();
        assert_eq!(rollout.adopt_weights(&snap).unwrap(), snap.len());
        assert_eq!(rollout.is_packed(), packed);
        let got = tch::no_grad(|| rollout.forward(&ids, None));
        assert!(max_diff(&want, &got) < 1e-5, "{}", max_diff(&want, &got));
        let (name, shared) = &snap[0];
        let mine = rollout
            .parameters()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap()
            .1;
        assert_eq!(mine.data_ptr(), shared.data_ptr(), "`{name}` was copied");
        // The trainer's own tensors are not the snapshot: training on leaves it alone.
        tch::no_grad(|| {
            for (_, t) in trainer.parameters_mut() {
                let _ = t.g_add_scalar_(1.0);
            }
        });
        let after = tch::no_grad(|| rollout.forward(&ids, None));
        assert!(max_diff(&got, &after) == 0.0);
        // A snapshot missing a tensor, or with one of another shape, is refused whole.
        let before = rollout.parameters();
        let mut short = trainer.weights_snapshot();
        let (missing, _) = short.pop().unwrap();
        let e = rollout.adopt_weights(&short).unwrap_err().to_string();
        assert!(e.contains(&missing), "{e}");
        let mut bad = trainer.weights_snapshot();
        bad[0].1 = Tensor::zeros([3], (Kind::Float, Device::Cpu));
        let e = rollout.adopt_weights(&bad).unwrap_err().to_string();
        assert!(e.contains(&bad[0].0) && e.contains("shape"), "{e}");
        for ((n, x), (_, y)) in before.iter().zip(rollout.parameters()) {
            assert_eq!(
                x.data_ptr(),
                y.data_ptr(),
                "`{n}` changed after a refused snapshot"
            );
        }
        // A model that trains cannot adopt shared weights.
        trainer.set_requires_grad(true);
        let e = trainer.adopt_weights(&snap).unwrap_err().to_string();
        assert!(e.contains("requires gradients"), "{e}");
    }

    /// The fused CPU decode step (packed weights) and the tch path agree on hidden states
    /// and on what they write into the cache, with rows at different positions. Row 3
    /// repeats row 2's prompt and reads its first key block from row 2's slot: its own
    /// copy is zeroed in the fused cache, so a wrong read would show.
    #[test]
    fn fused_decode_matches_tch_ops() {
        if !crate::onednn::available() {
            return;
        }
        for (bias, wide) in [(false, false), (true, false), (false, true)] {
            let (mut fused, plain) = tiny(bias, wide);
            let hidden = fused.config.hidden_size;
            assert!(fused.pack_for_inference(4));
            // Lengths around the 16-position key blocks; decoding crosses a boundary.
            let mut prompts: Vec<Vec<i64>> = [14i64, 2, 17]
                .iter()
                .map(|&n| (0..n).map(|i| (i * 7 + n) % 90 + 2).collect())
                .collect();
            prompts.push(prompts[2].clone());
            let (ids, pos, lens) = prompt_batch(&prompts);
            let mut ca = KvCache::new(&fused, 4, 40);
            let mut cb = KvCache::new(&plain, 4, 40);
            tch::no_grad(|| {
                for (m, c) in [(&fused, &mut ca), (&plain, &mut cb)] {
                    let _ = m.hidden(
                        &ids,
                        &pos,
                        Attn::Prefill {
                            cache: c,
                            start: 0,
                            offset: 0,
                            lens: None,
                        },
                    );
                }
                for layer in 0..ca.kb.len() {
                    let _ = ca.kb[layer].get(3).narrow(1, 0, 1).zero_();
                    let _ = ca.v[layer].get(3).narrow(1, 0, KV_BLOCK).zero_();
                }
                let shared = [(0, 0), (1, 0), (2, 0), (2, 17)];
                let mut p = lens.clone();
                for step in 0..4 {
                    let tok = Tensor::from_slice(&[20 + step, 30 + step, 40 + step, 50 + step])
                        .view([4, 1]);
                    let pt = Tensor::from_slice(&p).view([4, 1]);
                    let span = p.iter().max().unwrap() + 1;
                    let ha = fused.hidden(
                        &tok,
                        &pt,
                        Attn::Decode {
                            cache: &mut ca,
                            span,
                            shared: Some(&shared),
                        },
                    );
                    let hb = plain.hidden(
                        &tok,
                        &pt,
                        Attn::Decode {
                            cache: &mut cb,
                            span,
                            shared: None,
                        },
                    );
                    assert_eq!(ha.size(), vec![4, 1, hidden]);
                    let d = max_diff(&ha, &hb);
                    assert!(
                        d < 1e-4,
                        "{bias} {wide}, step {step}: hidden differs by {d}"
                    );
                    p.iter_mut().for_each(|x| *x += 1);
                }
                for (i, &l) in p.iter().enumerate() {
                    let i = i as i64;
                    // Row 3's zeroed copy of the first block is not compared.
                    let from = if i == 3 { KV_BLOCK } else { 0 };
                    for layer in 0..2 {
                        let (ka, kb) = (ca.keys(layer, i, 1, l), cb.keys(layer, i, 1, l));
                        let (va, vb) = (ca.values(layer, i, 1, l), cb.values(layer, i, 1, l));
                        let n = l - from;
                        assert!(max_diff(&ka.narrow(2, from, n), &kb.narrow(2, from, n)) < 1e-5);
                        assert!(max_diff(&va.narrow(2, from, n), &vb.narrow(2, from, n)) < 1e-5);
                    }
                }
            });
        }
    }

    /// Prefilling a shared prefix once, copying it, and prefilling the rest at an offset
    /// gives the states and cache of a plain prefill.
    #[test]
    fn prefill_at_offset_after_a_shared_prefix_matches_a_plain_prefill() {
        let (model, _) = tiny(false, false);
        let prefix = vec![3i64, 4, 5, 6, 7];
        let prompts: Vec<Vec<i64>> = [vec![8i64, 9, 10], vec![11], vec![12, 13]]
            .iter()
            .map(|s| [prefix.clone(), s.clone()].concat())
            .collect();
        let (ids, pos, lens) = prompt_batch(&prompts);
        tch::no_grad(|| {
            let mut plain = KvCache::new(&model, 3, 16);
            let h_plain = model.hidden(
                &ids,
                &pos,
                Attn::Prefill {
                    cache: &mut plain,
                    start: 0,
                    offset: 0,
                    lens: None,
                },
            );
            let mut shared = KvCache::new(&model, 4, 16);
            let p = prefix.len() as i64;
            // Slots 1..4, so the copy source is not slot 0.
            let _ = model.hidden(
                &Tensor::from_slice(&prefix).view([1, p]),
                &Tensor::arange(p, (Kind::Int64, Device::Cpu)).unsqueeze(0),
                Attn::Prefill {
                    cache: &mut shared,
                    start: 1,
                    offset: 0,
                    lens: None,
                },
            );
            shared.copy_slots(&[1, 1], &[2, 3], p);
            let rest = ids.narrow(1, p, ids.size()[1] - p);
            let rpos = pos.narrow(1, p, ids.size()[1] - p);
            // Ragged: the padding of the shorter rows is skipped.
            let rest_lens: Vec<i64> = lens.iter().map(|l| l - p).collect();
            let h = model.hidden(
                &rest,
                &rpos,
                Attn::Prefill {
                    cache: &mut shared,
                    start: 1,
                    offset: p,
                    lens: Some(&rest_lens),
                },
            );
            for (i, &l) in lens.iter().enumerate() {
                let want = h_plain.get(i as i64).narrow(0, 0, l);
                let got = h.get(i as i64).narrow(0, 0, l - p);
                let d = max_diff(&want.narrow(0, p, l - p), &got);
                assert!(d < 1e-5, "prompt {i}: hidden differs by {d}");
                for layer in 0..2 {
                    let (a, b) = (i as i64, i as i64 + 1);
                    let (ka, kb) = (plain.keys(layer, a, 1, l), shared.keys(layer, b, 1, l));
                    let (va, vb) = (plain.values(layer, a, 1, l), shared.values(layer, b, 1, l));
                    assert!(max_diff(&ka, &kb) < 1e-5);
                    assert!(max_diff(&va, &vb) < 1e-5);
                }
            }
        });
    }
}
