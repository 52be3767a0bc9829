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
mod api;
mod calculator;
mod deadline;
mod episode;
mod guess;
mod python_tool;
mod tool_call;
mod tools;

use std::sync::Arc;

use crate::data::prompt::Prompt;

pub use actor::{
    EnvActorRef, EnvRequest, EnvResponse, EnvRole, RemoteEnvPool, SpawnEnvActor,
    MAX_EPISODES_PER_ACTOR,
};
pub use api::{
    Env, EnvError, EnvFactory, EnvKind, EnvSettings, EnvStep, EpisodeLimits, PrefixUse, Tool,
    ToolError,
};
pub use calculator::{evaluate_expression, format_number, CalculatorTool};
pub(crate) use deadline::{call_all, EnvSlot};
pub use episode::{Episode, TurnOutcome};
pub use guess::GuessNumberEnv;
pub use python_tool::{NetIsolation, PythonTool, PythonToolConfig};
pub use tool_call::{parse_tool_call, ParsedTurn, ToolCall, TOOL_CALL_CLOSE, TOOL_CALL_OPEN};
pub use tools::ToolEnv;

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
        Box::new(if call_prefix {
            env.with_call_prefix()
        } else {
            env
        })
    };
    match kind {
        EnvKind::Calculator => Arc::new(move |_: &Prompt| -> Result<Box<dyn Env>, EnvError> {
            Ok(tool_env(Box::new(CalculatorTool)))
        }),
        EnvKind::Python => {
            let isolation = NetIsolation::detect();
            Arc::new(move |_: &Prompt| -> Result<Box<dyn Env>, EnvError> {
                Ok(tool_env(Box::new(PythonTool::new(
                    python.clone(),
                    isolation,
                ))))
            })
        }
        EnvKind::GuessNumber => Arc::new(|p: &Prompt| -> Result<Box<dyn Env>, EnvError> {
            Ok(Box::new(GuessNumberEnv::for_prompt(p)))
        }),
    }
}
