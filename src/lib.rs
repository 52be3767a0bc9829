//! # yatt
//!
//! The facade over yatt's crates. Each concern has its own crate; this one re-exports
//! them and holds the `yatt` CLI and the `yatt-node` daemon.
//!
//! | crate | concern |
//! |---|---|
//! | [`runtime`] | actors, addressing, QUIC transport, membership, supervision (no ML) |
//! | [`engine`] | tch models, generation, log-probs, training, checkpoints (no actors) |
//! | [`roles`] | the SDK (`Role`, `Sample`), algorithms, rewards, data, built-in roles |
//! | [`trainer`] | typed job config, controllers, ledger, embedded/cluster builds, live placement, runs |
//! | [`sim`] | `yatt sim`'s scenarios, reports, PNG and calibration (no tch) |
//! | [`placement`] | inventory, plans, cost model, search, the placement policy (no tch, no runtime) |
//! | [`metrics`] | a run's metrics.jsonl and TensorBoard events, reading them, PNG plots |
//!
//! The SDK a user's role is written against is re-exported at the top: [`Role`],
//! [`Sample`] and their companions.

pub use yatt_engine as engine;
pub use yatt_metrics as metrics;
pub use yatt_placement as placement;
pub use yatt_roles as roles;
pub use yatt_runtime as runtime;
pub use yatt_sim as sim;
pub use yatt_trainer as trainer;

// The SDK: what a user's role implements and exchanges.
pub use yatt_roles::{
    DeviceGroup, ResourceProfile, Role, RoleActor, RoleError, RoleRequest, RoleResponse, Sample,
    SampleId, WeightsUpdate,
};

/// The global allocator of `yatt` and `yatt-node`; a daemon of your own
/// (`yatt::node::main_with`) should declare it too:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOC: yatt::Allocator = yatt::Allocator;
/// ```
///
/// Why not the system allocator: glibc's malloc serves the transport's large, short-lived
/// buffers (the segmentation-offload batches quinn assembles, up to ten 64 KiB packets,
/// and received stream chunks) from per-thread arenas that it trims and grows again
/// around every transfer, and from fresh `mmap`s until its adaptive threshold settles.
/// Handoffs over plain QUIC then paid for page faults, and the first tens of 64 MiB
/// handoffs of a process ran 1.5× slower than later ones. mimalloc keeps freed pages
/// for reuse; measured side by side in the same minutes, it took plain-QUIC bulk from
/// 53–60 % to 95–104 % of TCP loopback (docs/benchmarks.md).
/// It governs Rust allocations only: libtorch's tensors keep their own allocator.
pub use mimalloc::MiMalloc as Allocator;

/// A binary's exit code for `result`; an error is printed with its chain of causes and
/// no backtrace (errors are for people; `RUST_BACKTRACE` is for panics).
pub fn exit_code<E: std::fmt::Display>(result: Result<(), E>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

pub mod http;
pub mod launch;
pub mod logging;
pub mod node;
pub mod node_config;
mod reference;
pub mod view;
pub use reference::{cli_reference_page, config_reference_page};

/// Registers every role this build of yatt can spawn on request: the runtime's
/// diagnostic actors (echo, bulk-sink) and the built-in RLHF roles (rollout, policy,
/// reference, reward; see `yatt_trainer::register`).
pub fn register_roles(builder: runtime::NodeBuilder) -> runtime::NodeBuilder {
    trainer::register(runtime::register_builtins(builder))
}
