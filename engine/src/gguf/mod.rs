//! GGUF: parse the container, dequantize its tensors, rebuild an HF tokenizer from its
//! metadata and write an HF-format model directory. Pure Rust (no libtorch).
//!
//! A public namespace (the rest of the crate is flat) because these names only make sense
//! as GGUF names: `gguf::import_gguf`, `gguf::GgufFile`, `gguf::dequantize`. This file only
//! re-exports; the code lives in the leaf files.

mod dequant;
mod file;
mod hf;
mod tokenizer;

pub use dequant::{dequantize, GgmlType};
pub use file::{GgufFile, GgufTensorInfo, GgufValue};
pub use hf::{import_gguf, ImportDtype, ImportOptions, ImportReport};
pub use tokenizer::build_tokenizer_json;
