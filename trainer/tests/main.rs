//! The crate's integration tests, one binary: each file under `tests/` is a module
//! of it, so the tests link against libtorch once rather than once per file.
//! Run one file's tests with its name as a filter, e.g. `cargo nextest run
//! --release -p yatt-trainer algorithms::`.

mod algorithms;
mod asynchronous;
mod common;
mod configs;
mod custom_slots;
mod datasets;
mod env_config;
mod env_episodes;
mod extra_stages;
mod job;
mod judge;
mod lora;
mod pipeline;
mod placement_live;
mod placement_sharded;
mod precision;
mod python_reward;
mod reward_models;
mod sharded;
mod step_credit;
mod streaming;
mod time_share;
mod weight_push;
