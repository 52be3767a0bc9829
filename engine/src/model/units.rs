//! The model as a chain of units, for sharded training: a unit is what is gathered, run
//! and freed together. The embeddings are one unit, each decoder layer one, and the
//! final norm with an untied LM head the last. A caller that owns the model runs it unit
//! by unit ([`UnitPass`]) and may swap what a unit's parameters hold between runs (a
//! sharded trainer installs gathered weights and frees them after).

use super::attention::Attn;
use super::forward::Ctx;
use super::heads::{HeadShape, ScalarHead};
use super::llama::{DecoderLayer, Llama};
use super::rope::rope_tables;
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use tch::{Device, Kind, Tensor};

/// One unit of the model (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Unit {
    /// The token embeddings (also the LM head when tied).
    Embed,
    /// Decoder layer `i`.
    Layer(usize),
    /// The final norm and, when untied, the LM head; with a scalar head (a critic's
    /// value head), that head too.
    Head,
}

impl std::fmt::Display for Unit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Unit::Embed => write!(f, "embed"),
            Unit::Layer(i) => write!(f, "layers.{i}"),
            Unit::Head => write!(f, "head"),
        }
    }
}

impl Llama {
    /// The units in forward order: embeddings, layers, head.
    pub fn units(&self) -> Vec<Unit> {
        let mut v = vec![Unit::Embed];
        v.extend((0..self.layers.len()).map(Unit::Layer));
        v.push(Unit::Head);
        v
    }

    /// Whether the LM head is the embedding matrix (then the head needs the
    /// [`Unit::Embed`] weights too).
    pub fn tied_embeddings(&self) -> bool {
        self.lm_head.is_none()
    }

    /// A unit's parameters in a fixed order, with the canonical names of
    /// [`Llama::all_parameters_mut`].
    pub fn unit_parameters_mut(&mut self, unit: Unit) -> Vec<(String, &mut Tensor)> {
        self.packed = None;
        match unit {
            Unit::Embed => vec![("embed".into(), &mut self.embed)],
            Unit::Layer(i) => self.layers[i].parameters_mut(i),
            Unit::Head => {
                let mut v: Vec<(String, &mut Tensor)> = vec![("norm".into(), &mut self.norm)];
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
        }
    }

    /// The scalar head's shape, if the model has one (a critic, a reward model).
    pub fn head_shape(&self) -> Option<HeadShape> {
        self.head.as_ref().map(ScalarHead::shape)
    }

    /// Whether sharded training can run this model: no LoRA adapters (theirs are not
    /// parameters of any unit).
    pub fn check_unit_trainable(&self) -> Result<()> {
        if self.lora.is_some() {
            return Err(EngineError::InvalidArgument(
                "sharded training of LoRA adapters is not built yet: set the role's shards \
                 to 1 for a LoRA run"
                    .into(),
            ));
        }
        Ok(())
    }

    /// Starts a forward pass run unit by unit: the tables its units share (rotary
    /// tables, masks), which do not borrow the model. Only the cache-free modes
    /// `Full` without a mask (right padding) and `Packed` apply.
    pub fn unit_pass(&self, ids: &Tensor, positions: &Tensor, attn: Attn<'_>) -> UnitPass {
        let lens = match &attn {
            Attn::Full { mask: None } => None,
            Attn::Packed { lens } => Some(lens.to_vec()),
            _ => panic!("a unit pass takes Attn::Full without a mask or Attn::Packed"),
        };
        let ctx = self.prepare(ids, positions, &attn).without_packed();
        UnitPass {
            ctx,
            lens,
            ids: ids.shallow_clone(),
        }
    }

    /// The embedding unit: the residual stream's input.
    pub fn run_embed(&self, pass: &UnitPass) -> Tensor {
        self.embed_rows(&pass.ids, &pass.ctx)
    }

    /// Decoder layer `li` on the residual stream `x`.
    pub fn run_layer(&self, pass: &UnitPass, li: usize, x: &Tensor) -> Tensor {
        let mut attn = match &pass.lens {
            Some(l) => Attn::Packed { lens: l },
            None => Attn::Full { mask: None },
        };
        self.layer(li, x, &pass.ctx, &mut attn, &mut None)
    }

    /// The final norm on the last layer's output: the hidden states `[B, T, hidden]`
    /// the LM head reads.
    pub fn run_final_norm(&self, pass: &UnitPass, x: &Tensor) -> Tensor {
        self.final_norm(x, &pass.ctx)
    }
}

/// The shared tables of one forward pass run unit by unit ([`Llama::unit_pass`]).
pub struct UnitPass {
    ctx: Ctx<'static>,
    lens: Option<Vec<i64>>,
    ids: Tensor,
}

/// The canonical parameters of `unit` of a model with `config` and, if any, a scalar
/// head of `head`: names (as [`Llama::unit_parameters_mut`] gives them, in the same
/// order) and shapes. The layout of a sharded unit is derived from this alone, so a
/// skeleton without weights and a loaded model agree.
pub fn unit_shapes(
    config: &ModelConfig,
    unit: Unit,
    head: Option<&HeadShape>,
) -> Vec<(String, Vec<i64>)> {
    let c = config;
    let (h, hd, f) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * hd;
    let nq = c.num_attention_heads * hd;
    match unit {
        Unit::Embed => vec![("embed".into(), vec![h, c.vocab_size])],
        Unit::Layer(i) => {
            let mut v = vec![
                (format!("layers.{i}.ln1"), vec![h]),
                (format!("layers.{i}.wqkv"), vec![h, qkv]),
            ];
            if c.attention_bias {
                v.push((format!("layers.{i}.bqkv"), vec![qkv]));
            }
            if c.qk_norm {
                v.push((format!("layers.{i}.q_norm"), vec![hd]));
                v.push((format!("layers.{i}.k_norm"), vec![hd]));
            }
            v.push((format!("layers.{i}.wo"), vec![nq, h]));
            v.push((format!("layers.{i}.ln2"), vec![h]));
            v.push((format!("layers.{i}.w_gate_up"), vec![h, 2 * f]));
            v.push((format!("layers.{i}.w_down"), vec![f, h]));
            v
        }
        Unit::Head => {
            let mut v = vec![("norm".into(), vec![h])];
            if !c.tie_word_embeddings {
                v.push(("lm_head".into(), vec![h, c.vocab_size]));
            }
            if let Some(hd) = head {
                v.push((format!("{}.weight", hd.prefix), vec![1, h]));
                if hd.bias {
                    v.push((format!("{}.bias", hd.prefix), vec![1]));
                }
            }
            v
        }
    }
}

impl Llama {
    /// A model with `config` whose parameters hold nothing (empty tensors): what a
    /// sharded rank holds between unit runs, and what it installs gathered weights
    /// into. Nothing the size of the model is allocated.
    pub fn skeleton(config: ModelConfig, device: Device, kind: Kind) -> Self {
        Self::skeleton_with_head(config, None, device, kind)
    }

    /// [`Llama::skeleton`] with an empty scalar head of `head`, if given.
    pub fn skeleton_with_head(
        config: ModelConfig,
        head: Option<&HeadShape>,
        device: Device,
        kind: Kind,
    ) -> Self {
        let empty = || Tensor::empty([0], (kind, device));
        let layers = (0..config.num_hidden_layers)
            .map(|_| DecoderLayer {
                ln1: empty(),
                wqkv: empty(),
                bqkv: config.attention_bias.then(empty),
                qk_norm: config.qk_norm.then(|| (empty(), empty())),
                wo: empty(),
                ln2: empty(),
                w_gate_up: empty(),
                w_down: empty(),
            })
            .collect();
        let (cos, sin) = rope_tables(&config, device);
        Llama {
            embed: empty(),
            layers,
            norm: empty(),
            lm_head: (!config.tie_word_embeddings).then(empty),
            head: head.map(|h| ScalarHead::empty(h, device, kind)),
            device,
            kind,
            cos,
            sin,
            config,
            packed: None,
            lora: None,
            merge_base: None,
            memory: Default::default(),
        }
    }
}
