//! The Llama-family decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU, tied or
//! untied embeddings), its KV cache and its scalar heads.
//!
//! The canonical parameters fuse q/k/v into one matrix and gate/up into another (fewer,
//! larger GEMMs); the HF names are exposed as views into them
//! ([`Llama::hf_named_tensors`]) for checkpoints and weight sync.
//!
//! This file only declares and re-exports; each concern is a leaf file.

mod attention;
mod blocks;
mod cuda_graph;
mod forward;
mod heads;
mod kv_cache;
mod llama;
mod loading;
mod lora;
mod lora_types;
mod recompute;
mod rope;
#[cfg(test)]
mod tests;
mod units;

pub use attention::Attn;
pub use blocks::{blocks_for, KV_BLOCK};
pub use cuda_graph::{cuda_graphs_built, load_cuda_graph_shim, DecodeGraphs};
pub use heads::{HeadShape, ScalarHead};
pub use kv_cache::KvCache;
pub use llama::{DecoderLayer, Llama, MemoryOptions, RowLayout, DEFAULT_CHUNK_TOKENS};
pub use loading::read_safetensors_dir;
pub use lora_types::{AdapterDir, Adapters, LoraConfig, LoraPair, LoraTarget, LORA_SCALING_TENSOR};
pub use recompute::{backward_with, recompute_backward, Tape};
pub use rope::positions_from_mask;
pub use units::{unit_shapes, Unit, UnitPass};
