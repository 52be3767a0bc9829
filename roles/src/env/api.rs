//! The environment SDK's types: what a user's [`Env`] implements and answers, its
//! errors, the factory a rollout makes environments with, and the rollout's settings.
//! A leaf of the `env` module: its siblings import from here.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::data::prompt::Prompt;

/// What an environment answers to one model turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EnvStep {
    /// Text shown to the model as its next user turn (ignored when `done`).
    pub observation: String,
    /// Reward of this step (summed over the episode into `EpisodeInfo::env_reward`).
    pub reward: f64,
    /// The episode is over.
    pub done: bool,
    /// Tool calls this step ran.
    pub tool_calls: u32,
    /// Of those, the ones that failed.
    pub tool_errors: u32,
}

impl EnvStep {
    /// The episode ends with `reward`.
    pub fn done(reward: f64) -> Self {
        EnvStep {
            observation: String::new(),
            reward,
            done: true,
            tool_calls: 0,
            tool_errors: 0,
        }
    }

    /// The episode goes on with `observation`, no reward.
    pub fn observe(observation: impl Into<String>) -> Self {
        EnvStep {
            observation: observation.into(),
            reward: 0.0,
            done: false,
            tool_calls: 0,
            tool_errors: 0,
        }
    }

    /// A tool's result (or error) as the observation, in Hermes' `<tool_response>` tags.
    pub fn tool_result(output: String, failed: bool) -> Self {
        EnvStep {
            tool_calls: 1,
            tool_errors: u32::from(failed),
            ..EnvStep::observe(format!("<tool_response>\n{output}\n</tool_response>"))
        }
    }
}

/// An environment failed: the episode stops and is marked failed (its sample keeps what
/// it has, with `EpisodeInfo::env_failed` saying why).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EnvError {
    /// The environment could not act on this prompt or action.
    #[error("environment error: {0}")]
    Failed(String),
    /// A call ran past its deadline.
    #[error("the environment's {op} ran past its {seconds:.1} s deadline (rollout.env.timeout_s)")]
    Deadline {
        /// `reset` or `step`.
        op: &'static str,
        /// The deadline.
        seconds: f64,
    },
    /// The environment panicked or its worker went away; it is replaced for the next
    /// episode.
    #[error("the environment crashed during {op}: {reason}")]
    Crashed {
        /// `reset` or `step`.
        op: &'static str,
        /// The panic message, or what went away.
        reason: String,
    },
}

/// One episode's environment: what a user implements to add an environment.
pub trait Env: Send {
    /// Starts an episode on `prompt`; returns the first observation: the user turn the
    /// model answers (usually the prompt text, perhaps with instructions).
    fn reset(&mut self, prompt: &Prompt) -> Result<String, EnvError>;
    /// The model's turn `action` (its text); what the environment answers.
    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError>;
    /// Text the environment writes at the start of the model's next turn (after
    /// `reset` or `step`), e.g. the opening of a tool call for a model that never
    /// writes one by itself. The model continues from it, and `step` sees it as part of
    /// the turn; the rollout's [`PrefixUse`] says whether its tokens are masked out of
    /// the loss, trained, or left out.
    fn turn_prefix(&mut self) -> Option<String> {
        None
    }
}

/// Makes one environment per episode.
pub trait EnvFactory: Send + Sync {
    /// A fresh environment for an episode on `prompt`.
    fn make(&self, prompt: &Prompt) -> Result<Box<dyn Env>, EnvError>;
}

impl<F> EnvFactory for F
where
    F: Fn(&Prompt) -> Result<Box<dyn Env>, EnvError> + Send + Sync,
{
    fn make(&self, prompt: &Prompt) -> Result<Box<dyn Env>, EnvError> {
        self(prompt)
    }
}

/// The built-in environments.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "kebab-case")]
pub enum EnvKind {
    /// A `ToolEnv` with the `CalculatorTool`.
    Calculator,
    /// A `ToolEnv` with the sandboxed `PythonTool`.
    Python,
    /// The `GuessNumberEnv` game.
    GuessNumber,
}

impl EnvKind {
    /// The config word.
    pub fn name(self) -> &'static str {
        match self {
            EnvKind::Calculator => "calculator",
            EnvKind::Python => "python",
            EnvKind::GuessNumber => "guess-number",
        }
    }
}

/// What a rollout does with the turn prefix its environments offer.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum PrefixUse {
    /// Every episode takes it, masked out of the loss (its log-probs are 0).
    #[default]
    Masked,
    /// Samples `k < ceil(fraction * n)` of each prompt take it as trained tokens, with
    /// the rollout model's log-probs of them; the others do without it. Fraction 0
    /// drops it everywhere.
    Guide {
        /// Share of each prompt's samples that take the prefix, in [0, 1].
        fraction: f64,
    },
}

impl PrefixUse {
    /// Whether sample `k` of `n` takes the prefix, and if so whether it is trained.
    pub fn for_sample(self, k: u32, n: u32) -> Option<bool> {
        match self {
            PrefixUse::Masked => Some(false),
            PrefixUse::Guide { fraction } => {
                let guided = (fraction.clamp(0.0, 1.0) * f64::from(n)).ceil() as u32;
                (k < guided).then_some(true)
            }
        }
    }
}

/// How a rollout runs its episodes.
#[derive(Clone)]
pub struct EnvSettings {
    /// Makes each episode's environment.
    pub factory: Arc<dyn EnvFactory>,
    /// Turn and token limits.
    pub limits: EpisodeLimits,
    /// Deadline of every `reset` and `step` call.
    pub timeout: Duration,
    /// Keep each episode's KV cache from one turn to the next, so that a turn prefills
    /// only what was appended since the last (see the rollout's `multi_turn`).
    pub keep_kv: bool,
    /// What to do with the environment's turn prefix, when it offers one.
    pub prefix: PrefixUse,
}

impl std::fmt::Debug for EnvSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvSettings")
            .field("limits", &self.limits)
            .field("timeout", &self.timeout)
            .field("keep_kv", &self.keep_kv)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// Limits of an episode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpisodeLimits {
    /// Most model turns.
    pub max_turns: u32,
    /// Most tokens of one observation's content (longer ones are cut).
    pub max_env_tokens: usize,
    /// Most tokens of one model turn (0: the rest of the budget).
    pub max_turn_tokens: usize,
    /// Most response tokens in all, model and observation tokens together
    /// (`rollout.max_new_tokens`).
    pub budget: usize,
}

/// Why a tool call did not give a result. Every variant reaches the model as its
/// observation; none fails the step.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ToolError {
    /// The arguments were not what the tool takes.
    #[error("bad arguments: {0}")]
    BadArguments(String),
    /// The tool ran and failed (a non-zero exit, an exception).
    #[error("the tool failed: {0}")]
    Failed(String),
    /// The tool ran past its deadline and was killed.
    #[error("the tool ran past its {0:.1} s limit and was stopped")]
    Timeout(f64),
}

/// A function a model may call.
pub trait Tool: Send {
    /// The name the model calls it by.
    fn name(&self) -> &str;
    /// One line for the model: what it does and its arguments.
    fn description(&self) -> &str;
    /// An example question the tool answers, its arguments (a JSON object) and its
    /// result: shown to the model as a worked exchange.
    fn example_question(&self) -> &str;
    /// See [`Tool::example_question`].
    fn example_arguments(&self) -> &str;
    /// See [`Tool::example_question`].
    fn example_result(&self) -> &str;
    /// Runs one call.
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<String, ToolError>;
}
