//! The crate's integration tests, one binary: each file under `tests/` is a module
//! of it, so the tests link against libtorch once rather than once per file.
//! Run one file's tests with its name as a filter, e.g. `cargo nextest run
//! --release -p yatt-engine architectures::`.

mod architectures;
mod colocation_memory;
mod devices;
mod generate;
mod gguf;
mod long_bench;
mod long_sequences;
mod lora;
mod paged;
mod parity;
mod sharded;
mod sharded_critic;
mod train;
