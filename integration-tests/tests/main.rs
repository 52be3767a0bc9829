//! The crate's integration tests, one binary: each file under `tests/` is a module
//! of it, so the tests link against libtorch once rather than once per file.
//! Run one file's tests with its name as a filter, e.g. `cargo nextest run
//! --release -p yatt-integration-tests agentic::`.

mod agentic;
mod chaos;
mod cluster;
mod critic;
mod custom_roles;
mod deploy;
mod launch;
mod live_placement;
mod live_view;
mod policy;
mod preflight;
mod replicas;
mod sharded;
mod training;
mod weight_sync;
