//! # yatt-engine
//!
//! The compute under every role, built on tch (libtorch). What belongs here: the
//! Llama-family decoder and its heads, loading HF directories and importing GGUF files,
//! tokenizers and chat templates, batched generation with a KV cache and continuous
//! batching, log-probs and entropy, training steps, weight buckets and checkpoints.
//! It knows nothing of actors: roles wrap it.

pub mod error;
pub mod gguf;

pub use error::{EngineError, Result};
pub mod config;
pub mod device;
pub mod fixtures;
pub mod model;
pub mod tokenizer;

pub use config::ModelConfig;
pub use model::{KvCache, Llama};
pub use tokenizer::{ChatMessage, Tokenizer};
pub use tch;
pub mod generate;
pub use generate::{BatchingMode, Completion, FinishReason, GenerateStats, Generator, GeneratorConfig, Request, SamplingParams};
pub mod checkpoint;
pub mod score;
pub mod train;
pub mod weights;
pub use score::{SeqBatch, TokenScores};
pub use train::{LrSchedule, StepStats, TrainConfig, Trainer};
pub use weights::{to_buckets, BucketDtype, BucketEntry, WeightBucket};
pub mod bench;
pub mod onednn;
