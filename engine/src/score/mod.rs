//! Scoring: per-token log-probs and entropy of given sequences, values from a value
//! head, scores from a reward head.
//!
//! A public namespace because the function names say what is scored, not that it is
//! scoring: `score::values`, `score::rewards` read well; a bare `values` at the crate root
//! would not. This file only re-exports.

mod chunked;
mod heads;
mod seq_batch;

pub use chunked::{chunked_backward, head_scores, HeadInput, DEFAULT_CHUNK_TOKENS};
pub use heads::{
    last_hidden, rewards, token_logprobs, token_logprobs_backward, values, TokenScores,
};
pub(crate) use heads::{predicting_rows, token_layout};
pub use seq_batch::SeqBatch;
