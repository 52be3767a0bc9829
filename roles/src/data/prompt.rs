//! The prompt type, dataset errors and the seeded hashing behind stable ids.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};
use yatt_engine::ChatMessage;

/// One prompt of a dataset.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Prompt {
    /// Stable id (same dataset → same ids, on every machine and run).
    pub id: u64,
    /// The prompt text given to the policy. For a chat prompt, a plain transcript of
    /// `messages` (what a judge, a log line or a Python reward's `extra_info["prompt"]`
    /// shows); the policy sees `messages` through the chat template.
    pub text: String,
    /// A chat prompt's messages (system, user, few-shot turns), rendered with the
    /// model's chat template; empty for a plain-text prompt.
    #[serde(default)]
    pub messages: Vec<ChatMessage>,
    /// The reference answer for verifiers, when known.
    pub reference: Option<String>,
    /// Everything else the dataset carries (task name, difficulty, source fields).
    #[serde(with = "crate::json_value")]
    pub metadata: serde_json::Value,
}

/// Why a dataset could not be loaded or a loader built.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The file could not be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A line is not valid JSON or not a JSON object.
    #[error("{path}:{line}: {reason}")]
    Line {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// Two lines carry the same explicit `id`.
    #[error("{path}:{line}: id {id} already used on line {first_line}; ids must be unique")]
    DuplicateId {
        /// The file.
        path: PathBuf,
        /// The line with the repeated id.
        line: usize,
        /// The line that used it first.
        first_line: usize,
        /// The id.
        id: u64,
    },
    /// A row of a parquet file or of an Arrow dataset is not a valid prompt.
    #[error("{path}: row {row}: column `{column}`: {reason}")]
    Row {
        /// The file.
        path: PathBuf,
        /// 0-based row number within the file (as pandas and pyarrow count).
        row: usize,
        /// The column (a dotted path for a struct field, e.g. `reward_model.ground_truth`).
        column: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// A file or directory is not a dataset this format can read.
    #[error("{path}: {reason}")]
    Format {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The dataset has no prompts.
    #[error("{0}: dataset is empty (no rows, or only blank lines)")]
    Empty(PathBuf),
    /// Invalid dataloader / synthetic-task parameters.
    #[error("{0}")]
    Config(String),
    /// A checkpointed loader state does not fit this loader.
    #[error("cannot restore loader state: {0}")]
    State(String),
}

impl Prompt {
    /// A plain-text prompt with no reference and no metadata.
    pub fn text(id: u64, text: impl Into<String>) -> Self {
        Prompt {
            id,
            text: text.into(),
            messages: Vec::new(),
            reference: None,
            metadata: serde_json::Value::Null,
        }
    }
}

/// The plain transcript of a chat (`role: content` blocks), the `text` of a chat prompt.
pub(crate) fn transcript(messages: &[ChatMessage]) -> String {
    messages
        .iter()
        .map(|m| format!("{}: {}", m.role, m.content))
        .collect::<Vec<_>>()
        .join("\n\n")
}

/// FNV-1a 64-bit: the stable hash behind prompt ids (fixed forever; do not change).
pub(crate) fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        // separator so ["ab","c"] != ["a","bc"]
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// SplitMix64: a tiny RNG whose stream is fixed forever (unlike `rand`'s `StdRng`), so
/// shuffles and synthetic tasks stay identical across versions.
#[derive(Debug, Clone)]
pub(crate) struct SplitMix64(u64);

impl SplitMix64 {
    pub(crate) fn new(seed: u64) -> Self {
        Self(seed)
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`), by rejection so there is no modulo bias.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        let zone = u64::MAX - (u64::MAX % n);
        loop {
            let x = self.next_u64();
            if x < zone {
                return x % n;
            }
        }
    }

    /// Uniform in `lo..=hi`.
    pub(crate) fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }
}
