//! Environments and tools for multi-turn (agentic) rollouts.
//!
//! What belongs here: the [`Env`] trait a user implements (`reset` → first observation,
//! `step(action)` → observation, reward, done), the Hermes tool-call parser, the [`Tool`]
//! trait and the [`ToolEnv`] that offers tools, the built-ins (a calculator, a sandboxed
//! Python tool, a guess-the-number game), the pure multi-turn episode state machine the
//! rollout role drives, and the deadline every environment call runs under.
//!
//! What does not: generation (the rollout role, over `yatt-engine`) and the job config
//! (`yatt-trainer` builds an [`EnvSettings`] from `[rollout.env]`).

mod actor;
mod calculator;
mod deadline;
mod episode;
mod guess;
mod python_tool;
mod tool_call;
mod tools;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::data::prompt::Prompt;

pub use actor::{
    EnvActorRef, EnvRequest, EnvResponse, EnvRole, RemoteEnvPool, SpawnEnvActor,
    MAX_EPISODES_PER_ACTOR,
};
pub use calculator::{evaluate_expression, format_number, CalculatorTool};
pub(crate) use deadline::{call_all, EnvSlot};
pub use episode::{Episode, EpisodeLimits, TurnOutcome};
pub use guess::GuessNumberEnv;
pub use python_tool::{NetIsolation, PythonTool, PythonToolConfig};
pub use tool_call::{parse_tool_call, ParsedTurn, ToolCall, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
pub use tools::{Tool, ToolEnv, ToolError};

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
    /// writes one by itself. Its tokens are the environment's (masked out of the loss);
    /// the model continues from them, and `step` sees them as part of the turn.
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum EnvKind {
    /// A [`ToolEnv`] with the [`CalculatorTool`].
    Calculator,
    /// A [`ToolEnv`] with the sandboxed [`PythonTool`].
    Python,
    /// The [`GuessNumberEnv`] game.
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

/// How a rollout runs its episodes.
#[derive(Clone)]
pub struct EnvSettings {
    /// Makes each episode's environment.
    pub factory: Arc<dyn EnvFactory>,
    /// Turn and token limits.
    pub limits: EpisodeLimits,
    /// Deadline of every `reset` and `step` call.
    pub timeout: Duration,
}

impl std::fmt::Debug for EnvSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EnvSettings")
            .field("limits", &self.limits)
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

/// The factory of a built-in environment; `python` configures the Python tool;
/// `call_prefix` starts a tool environment's first turn with a call's opening
/// ([`ToolEnv::with_call_prefix`]).
pub fn builtin_env_factory(
    kind: EnvKind,
    python: PythonToolConfig,
    call_prefix: bool,
) -> Arc<dyn EnvFactory> {
    let tool_env = move |tool: Box<dyn Tool>| -> Box<dyn Env> {
        let env = ToolEnv::new(vec![tool]);
        Box::new(if call_prefix { env.with_call_prefix() } else { env })
    };
    match kind {
        EnvKind::Calculator => Arc::new(move |_: &Prompt| -> Result<Box<dyn Env>, EnvError> {
            Ok(tool_env(Box::new(CalculatorTool)))
        }),
        EnvKind::Python => {
            let isolation = NetIsolation::detect();
            Arc::new(move |_: &Prompt| -> Result<Box<dyn Env>, EnvError> {
                Ok(tool_env(Box::new(PythonTool::new(python.clone(), isolation))))
            })
        }
        EnvKind::GuessNumber => Arc::new(|p: &Prompt| -> Result<Box<dyn Env>, EnvError> {
            Ok(Box::new(GuessNumberEnv::for_prompt(p)))
        }),
    }
}
