//! # yatt-engine
//!
//! The compute under every role, built on tch (libtorch). What belongs here: the
//! Llama-family decoder and its heads, loading HF directories and importing GGUF files,
//! tokenizers and chat templates, batched generation with a KV cache and continuous
//! batching, log-probs and entropy, training steps, weight buckets and checkpoints.
//!
//! What does not: actors, messages, networking, job configs or RL algorithms. The engine
//! knows nothing of actors; roles (`yatt-roles`) wrap it. Everything here is synchronous
//! (tch calls block): run it on a dedicated OS thread.
//!
//! ## Map
//! - Models: [`Llama::load`] (HF dir), [`gguf::import_gguf`] (GGUF → HF dir),
//!   [`Tokenizer::from_dir`] (+ chat template), [`Llama::attach_head`] (value/reward head),
//!   [`Llama::deep_copy`] (frozen reference policy), [`Llama::random`] on
//!   [`tiny_config`] (the demo's tiny model).
//! - Rollouts: [`Generator`] with [`Request`]/[`SamplingParams`]; results stream per
//!   sample via [`Generator::generate_with`] (callback) or
//!   [`Generator::generate_to_channel`]; [`Generator::update_weights`] syncs weights in
//!   place between batches.
//! - Scoring: [`score::token_logprobs`], [`score::values`], [`score::rewards`] on a
//!   [`SeqBatch`].
//! - Training: [`Trainer::step`] with a caller-defined loss; [`Trainer::grad_buckets`] /
//!   [`Trainer::set_grads`] for all-reduce; [`Trainer::offload`] / [`Trainer::reload`];
//!   [`Trainer::save_checkpoint`] / [`Trainer::load_checkpoint`]; [`save_pretrained`]
//!   exports a model alone.
//! - Weight sync: [`to_buckets`] / [`WeightBucket`] (plain header + raw bytes).
//!
//! Every module is private and the API is re-exported here. Four namespaces stay, each a
//! file that only re-exports: [`gguf`] and [`score`], whose names read well only
//! qualified, and, behind features, `fixtures` (`test-fixtures`: the real test model and
//! the HF reference) and `bench` (`bench`: `yatt bench engine`), which keep test
//! scaffolding and benchmarks off the production path.

mod checkpoint;
mod config;
mod device;
mod error;
mod generate;
mod kept;
mod mkl;
mod model;
mod onednn;
mod profile;
mod resume;
mod sampling;
mod schedule;
mod shard;
mod tokenizer;
mod train;
mod weights;

#[cfg(feature = "bench")]
pub mod bench;
#[cfg(feature = "test-fixtures")]
pub mod fixtures;
pub mod gguf;
pub mod score;

pub use checkpoint::{save_pretrained, write_safetensors};
pub use config::{tiny_config, Architecture, ModelConfig, RopeScaling, SlidingWindow};
pub use device::{
    cuda_device_count, default_device, libtorch_dir, load_cuda_backend, parse_device, parse_kind,
    release_host_memory, set_threads, test_devices, tune_host_allocator,
    tune_host_allocator_for_shards,
};
pub use error::{EngineError, Result};
pub use generate::{
    Completion, FinishReason, GenerateStats, Generator, GeneratorConfig, Request, SamplingParams,
};
pub use model::{
    backward_with, blocks_for, cuda_graphs_built, load_cuda_graph_shim, positions_from_mask,
    read_safetensors_dir, recompute_backward, unit_shapes, AdapterDir, Adapters, Attn,
    DecoderLayer, HeadShape, KvCache, Llama, LoraConfig, LoraPair, LoraTarget, MemoryOptions,
    RowLayout, ScalarHead, Tape, Unit, UnitPass, KV_BLOCK, LORA_SCALING_TENSOR,
};
pub use schedule::BatchingMode;
pub use score::{SeqBatch, TokenScores};
pub use shard::{
    check_shards, is_sharded_checkpoint, layout_of, load_sharded_weights, merge_sharded_checkpoint,
    model_layout, model_layout_with_head, moved_bytes_per_micro_batch, random_model_by_units,
    random_unit, reshard, shard_len, shard_of, unit_slice_name, write_unit_slices, CommStats,
    LocalGroup, ParamSlot, RankState, ReduceOp, ShardGroup, ShardedStepStats, ShardedTrainer,
    UnitLayout, PREFETCH_DEPTH,
};
pub use tch;
pub use tokenizer::{render_chat_template, ChatMessage, Tokenizer};
pub use train::{LrSchedule, StepStats, TrainConfig, Trainer};
pub use weights::{to_buckets, BucketDtype, BucketEntry, BucketViews, WeightBucket};
