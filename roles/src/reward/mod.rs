//! Reward functions: what turns a (prompt, response, reference) into a score.
//!
//! What belongs here: the [`RewardFn`] trait, rule-based verifiers, weighted
//! combinations, the HTTP reward-endpoint client, and the pure parts of an LLM judge
//! (prompt template, score parser). No actors: the reward *role* wraps these. Anything
//! that needs a model (scalar reward model, generative judge) lives in
//! [`crate::builtin::reward_model`] and [`crate::builtin::judge_model`].
//!
//! | file | concern |
//! |---|---|
//! | [`verify`] | exact numeric answer, exact string match, format/regex, weighted combination |
//! | [`http`] | batched async client for a remote reward endpoint, and its blocking scorer |
//! | [`python`] | a pool of Python worker processes running a user's `compute_score` |
//! | [`judge`] | LLM-judge prompt template and judge-output score parser |

pub mod http;
pub mod judge;
pub mod python;
pub(crate) mod reward_fn;
pub use reward_fn::{excerpt, RewardError, RewardFn, RewardInput, RewardOutput};
pub mod verify;

pub use http::{HttpRewardClient, HttpRewardConfig, HttpRewardScorer};
pub use judge::{parse_judge_output, JudgeTemplate, JudgeVerdict};
pub use python::{default_python, parse_function, PythonReward, PythonRewardConfig};
pub use verify::{
    extract_final_number, CombinedReward, ExactMatchVerifier, FormatVerifier, LettersReward,
    NumericVerifier, LETTERS,
};
