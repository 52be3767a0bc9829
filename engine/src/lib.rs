//! # yatt-engine
//!
//! The compute under every role, built on tch (libtorch). What belongs here: the
//! Llama-family decoder and its heads, loading HF directories and importing GGUF files,
//! tokenizers and chat templates, batched generation with a KV cache and continuous
//! batching, log-probs and entropy, training steps, weight buckets and checkpoints.
//! It knows nothing of actors: roles wrap it. Everything is synchronous (tch calls
//! block): run it on a dedicated OS thread.
//!
//! ## Map
//! - Models: [`Llama::load`] (HF dir), [`gguf::import_gguf`] (GGUF → HF dir),
//!   [`Tokenizer::from_dir`] (+ chat template), [`Llama::attach_head`] (value/reward head),
//!   [`Llama::deep_copy`] (frozen reference policy).
//! - Rollouts: [`Generator`] with [`Request`]/[`SamplingParams`]; results stream per
//!   sample via [`Generator::generate_with`] (callback) or
//!   [`Generator::generate_to_channel`]; [`Generator::update_weights`] syncs weights in
//!   place between batches.
//! - Scoring: [`score::token_logprobs`], [`score::values`], [`score::rewards`] on a
//!   [`SeqBatch`].
//! - Training: [`Trainer::step`] with a caller-defined loss; [`Trainer::grad_buckets`] /
//!   [`Trainer::set_grads`] for all-reduce; [`Trainer::offload`] / [`Trainer::reload`];
//!   [`Trainer::save_checkpoint`] / [`Trainer::load_checkpoint`].
//! - Weight sync: [`to_buckets`] / [`WeightBucket`] (plain header + raw bytes).

pub mod bench;
pub mod checkpoint;
pub mod config;
pub mod device;
pub mod error;
pub mod fixtures;
pub mod generate;
pub mod gguf;
pub mod mkl;
pub mod model;
pub mod onednn;
pub mod score;
pub mod tokenizer;
pub mod train;
pub mod weights;

pub use config::ModelConfig;
pub use error::{EngineError, Result};
pub use generate::{
    BatchingMode, Completion, FinishReason, GenerateStats, Generator, GeneratorConfig, Request,
    SamplingParams,
};
pub use model::{KvCache, Llama};
pub use score::{SeqBatch, TokenScores};
pub use tch;
pub use tokenizer::{ChatMessage, Tokenizer};
pub use train::{LrSchedule, StepStats, TrainConfig, Trainer};
pub use weights::{to_buckets, BucketDtype, BucketEntry, WeightBucket};
