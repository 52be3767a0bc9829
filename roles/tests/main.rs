//! The crate's integration tests, one binary: each file under `tests/` is a module
//! of it, so the tests link against libtorch once rather than once per file.
//! Run one file's tests with its name as a filter, e.g. `cargo nextest run
//! --release -p yatt-roles datasets::`.

mod datasets;
mod reward_http;
mod reward_python;
mod role_memory;
mod sharded_ring;
