//! Prompt datasets.
//!
//! What belongs here: the [`Prompt`] type, loaders that turn files into prompts
//! (JSONL in [`jsonl`], parquet and `save_to_disk` Arrow datasets in `arrow_rows`, the
//! row → prompt mapping and the formats in `fields`, the entry point in `dataset`),
//! deterministic synthetic tasks with a difficulty/length schedule ([`synthetic`]), and
//! the sharded, checkpointable [`Dataloader`] each controller uses for its shard
//! ([`loader`]). No actors and no tokenisation: rollout tokenises (a chat prompt with
//! the model's chat template).
//!
//! Prompt ids are stable: the same dataset gives the same ids on every machine and every
//! run, so the sample ledger can key on them.

mod arrow_rows;
mod dataset;
mod fields;
pub mod jsonl;
pub mod loader;
pub(crate) mod prompt;
pub use prompt::{DataError, Prompt};
pub mod synthetic;

pub use dataset::load_dataset;
pub use fields::{DataFields, DataFormat, DEFAULT_GROUND_TRUTH_KEY, DEFAULT_PROMPT_KEY};
pub use jsonl::{load_jsonl, parse_jsonl};
pub use loader::{Dataloader, LoaderState};
pub use synthetic::{GrowingLength, LengthSchedule, SyntheticTask, SyntheticTaskKind};
