//! The reward-function trait, its input and output, and its errors.

use serde::{Deserialize, Serialize};

/// One sample to score.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardInput {
    /// The prompt text the policy saw.
    pub prompt: String,
    /// The generated response text.
    pub response: String,
    /// The reference answer, when the task has one.
    pub reference: Option<String>,
    /// Free-form task metadata (task name, difficulty, ...).
    #[serde(default)]
    pub metadata: serde_json::Value,
}

/// The score of one sample.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RewardOutput {
    /// The scalar (outcome) reward.
    pub score: f64,
    /// Per-step scores for process rewards, when the reward function gives them.
    pub step_scores: Option<Vec<f32>>,
    /// A short human-readable reason, for logs and debugging.
    pub explanation: String,
}

/// A reward function. Implementations are cheap, pure and thread-safe; the reward role
/// calls them from a blocking pool.
pub trait RewardFn: Send + Sync {
    /// A short name for logs and for `CombinedReward` explanations.
    fn name(&self) -> &str;
    /// Scores one sample. An `Err` means the reward could not be computed (misconfigured
    /// verifier, missing reference) — never a wrong answer, which is a low score.
    fn score(&self, sample: &RewardInput) -> Result<RewardOutput, RewardError>;
}

/// Why a reward could not be computed.
#[derive(Debug, thiserror::Error)]
pub enum RewardError {
    /// The verifier needs a reference answer and the sample has none.
    #[error("{verifier}: sample has no reference answer; load the dataset with an `answer`/`reference`/`ground_truth` field")]
    MissingReference {
        /// The verifier's name.
        verifier: String,
    },
    /// The reference answer could not be parsed as the verifier expects.
    #[error("{verifier}: cannot read reference answer {reference:?}: {reason}")]
    BadReference {
        /// The verifier's name.
        verifier: String,
        /// The reference as given.
        reference: String,
        /// What is wrong.
        reason: String,
    },
    /// A regex pattern does not compile.
    #[error("invalid regex {pattern:?}: {source}")]
    InvalidRegex {
        /// The pattern as given.
        pattern: String,
        /// The regex crate's error.
        #[source]
        source: Box<regex::Error>,
    },
    /// A reward function's configuration is invalid.
    #[error("invalid reward config: {0}")]
    Config(String),
    /// One component of a `CombinedReward` failed.
    #[error("component {name:?} of the combined reward: {source}")]
    Component {
        /// The component's name.
        name: String,
        /// Its error.
        #[source]
        source: Box<RewardError>,
    },
    /// The endpoint URL is not usable.
    #[error("reward endpoint URL {url:?}: {reason}")]
    InvalidUrl {
        /// The URL as given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The endpoint answered with a non-success HTTP status (after retries, if retryable).
    #[error("reward endpoint {url} answered HTTP {status} after {attempts} attempt(s); body: {body_excerpt:?}")]
    HttpStatus {
        /// The endpoint URL.
        url: String,
        /// The HTTP status code.
        status: u16,
        /// The first bytes of the response body.
        body_excerpt: String,
        /// Attempts made.
        attempts: u32,
    },
    /// The endpoint could not be reached (connect/IO error) after all retries.
    #[error("reward endpoint {url} unreachable after {attempts} attempt(s): {message}")]
    Transport {
        /// The endpoint URL.
        url: String,
        /// Attempts made.
        attempts: u32,
        /// The last transport error.
        message: String,
    },
    /// The endpoint did not answer within the per-request timeout, on every attempt.
    #[error("reward endpoint {url} timed out ({timeout_ms} ms per request) on all {attempts} attempt(s)")]
    Timeout {
        /// The endpoint URL.
        url: String,
        /// The per-request timeout.
        timeout_ms: u64,
        /// Attempts made.
        attempts: u32,
    },
    /// The endpoint's answer is not the expected JSON.
    #[error("reward endpoint {url} sent an unusable answer: {reason}; body: {body_excerpt:?}")]
    BadResponse {
        /// The endpoint URL.
        url: String,
        /// What is wrong with it.
        reason: String,
        /// The first bytes of the response body.
        body_excerpt: String,
    },
    /// The endpoint returned a different number of scores than samples sent.
    #[error("reward endpoint {url} returned {got} {what} for {expected} samples; it must return one per sample, in order")]
    CountMismatch {
        /// The endpoint URL.
        url: String,
        /// `"scores"` or `"step_scores"`.
        what: &'static str,
        /// Samples sent.
        expected: usize,
        /// Entries received.
        got: usize,
    },
    /// No final score could be found in an LLM judge's output.
    #[error("judge output has no final score (expected e.g. \"Score: 7/10\"); output starts: {excerpt:?}")]
    NoJudgeScore {
        /// The first characters of the judge output.
        excerpt: String,
    },
}

/// First `max` characters of `s` (char-boundary safe), with "…" when cut.
pub fn excerpt(s: &str, max: usize) -> String {
    let mut out: String = s.chars().take(max).collect();
    if s.chars().nth(max).is_some() {
        out.push('…');
    }
    out
}
