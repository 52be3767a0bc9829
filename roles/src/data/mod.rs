//! Prompt datasets.
//!
//! What belongs here: the [`Prompt`] type, loaders that turn files into prompts
//! ([`jsonl`]), deterministic synthetic tasks with a difficulty/length schedule
//! ([`synthetic`]), and the sharded, checkpointable [`Dataloader`] each controller uses
//! for its shard ([`loader`]). No actors and no tokenisation: rollout tokenises.
//!
//! Prompt ids are stable: the same dataset gives the same ids on every machine and every
//! run, so the sample ledger can key on them.

pub mod jsonl;
pub mod loader;
pub(crate) mod prompt;
pub use prompt::{DataError, Prompt};
pub mod synthetic;

pub use jsonl::{load_jsonl, parse_jsonl};
pub use loader::{Dataloader, LoaderState};
pub use synthetic::{GrowingLength, LengthSchedule, SyntheticTask, SyntheticTaskKind};
