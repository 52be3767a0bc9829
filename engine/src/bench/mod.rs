//! Benchmarks (feature `bench`): what `yatt bench engine` and `yatt bench gpu` run, and
//! the engine internals the probe examples time one by one. Kept off the production path: it drives the HF
//! reference through the test fixtures.
//!
//! A namespace rather than crate-root items, so `bench::run` cannot be mistaken for
//! anything a trainer calls. This file only re-exports.

mod compare;
mod paged;
mod roofline;
mod row;

pub use compare::{markdown_table, run, BenchOptions};
pub use roofline::{
    device_name, kind_name, run as run_roofline, Case, Preset, RooflineOptions, RooflineReport,
};
pub use row::BenchRow;

/// The pieces of a decode step, exposed only so `examples/probe.rs` can time each alone.
pub mod kernels {
    pub use crate::generate::{sample, RowParams};
    pub use crate::onednn::{linear, pack};
}
