//! The crate's integration tests, one binary: each file under `tests/` is a module
//! of it, so the tests link against libtorch once rather than once per file.
//! Run one file's tests with its name as a filter, e.g. `cargo nextest run
//! --release -p yatt bench_gpu::`.

mod bench_gpu;
mod bench_sharded;
mod bootstrap;
mod docs;
mod generate_cli;
mod kill_resume;
mod layout;
mod placement_show;
mod reference;
