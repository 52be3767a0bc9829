//! The engine's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the engine. Each variant names what was wrong and,
/// where there is one, how to fix it.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be read or written.
    #[error("{action} {path}: {source}")]
    Io {
        /// What was being done ("reading", "writing", ...).
        action: &'static str,
        /// The file or directory concerned.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// A file the engine needs is missing.
    #[error("missing {what}: {path} does not exist ({hint})")]
    Missing {
        /// What the file is (e.g. "config.json").
        what: &'static str,
        /// Where it was looked for.
        path: PathBuf,
        /// How to fix it.
        hint: &'static str,
    },
    /// A GGUF file is malformed or truncated.
    #[error("malformed GGUF file {path}: {msg}")]
    GgufFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A GGUF tensor uses a quantization type the importer cannot dequantize.
    #[error("GGUF tensor `{tensor}` has type {ty}, which yatt cannot dequantize (supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1); re-quantize the model to one of these, e.g. with llama.cpp's llama-quantize")]
    UnsupportedGgufType {
        /// The tensor's name.
        tensor: String,
        /// The GGUF type name (e.g. "Q4_K").
        ty: String,
    },
    /// The GGUF file describes an architecture or tokenizer the importer does not handle.
    #[error("unsupported GGUF content: {0}")]
    UnsupportedGguf(String),
    /// A model configuration (config.json or GGUF metadata) is invalid.
    #[error("invalid model config {path}: {msg}")]
    Config {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// JSON could not be parsed or produced.
    #[error("JSON in {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: serde_json::Error,
    },
    /// The tokenizer failed to load or to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to parse or render.
    #[error("chat template: {0}")]
    ChatTemplate(String),
    /// A weight tensor is missing or has the wrong shape.
    #[error("weights: {0}")]
    Weights(String),
    /// A safetensors file could not be read or written.
    #[error("safetensors {path}: {msg}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        msg: String,
    },
    /// libtorch reported an error.
    #[error("libtorch: {0}")]
    Torch(#[from] tch::TchError),
    /// A request or argument was invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A weight bucket's header or payload is malformed.
    #[error("weight bucket: {0}")]
    Bucket(String),
    /// A checkpoint is incomplete or inconsistent.
    #[error("checkpoint {path}: {msg}")]
    Checkpoint {
        /// The checkpoint directory.
        path: PathBuf,
        /// What is wrong.
        msg: String,
    },
    /// A collective between the ranks of a sharded replica failed: a rank left, the
    /// deadline passed, or the ranks disagreed on what they were doing.
    #[error("collective {op} on rank {rank}: {msg}")]
    Collective {
        /// The operation ("all-gather", "reduce-scatter", "all-reduce").
        op: &'static str,
        /// The rank that saw the failure.
        rank: usize,
        /// What went wrong, and how to fix it where that is known.
        msg: String,
    },
    /// An external process (e.g. the reference Python) failed.
    #[error("external command `{cmd}` failed: {msg}")]
    External {
        /// The command.
        cmd: String,
        /// What went wrong (its stderr tail).
        msg: String,
    },
}

/// Result alias for the engine.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;

impl EngineError {
    pub(crate) fn io(
        action: &'static str,
        path: impl Into<PathBuf>,
        source: std::io::Error,
    ) -> Self {
        EngineError::Io {
            action,
            path: path.into(),
            source,
        }
    }
}
