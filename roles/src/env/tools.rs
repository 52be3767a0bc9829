//! Tools, and the environment that gives a model tools.
//!
//! A [`Tool`] is one function a model may call by name. A [`ToolEnv`] wraps tools into an
//! [`Env`]: each model turn is parsed for a Hermes tool call; a call runs its tool and the
//! result is the observation; a turn with no call is the final answer and ends the
//! episode. A malformed call, an unknown tool or a failing tool never ends the episode
//! and never fails the step: the model is told what went wrong, and it counts as a tool
//! error.

use serde_json::{Map, Value};

use crate::data::prompt::Prompt;
use crate::env::tool_call::{parse_tool_call, ParsedTurn};
use crate::env::{Env, EnvError, EnvStep};

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
    /// Example arguments (a JSON object), shown to the model in a complete call.
    fn example_arguments(&self) -> &str;
    /// Runs one call.
    fn call(&mut self, arguments: &Map<String, Value>) -> Result<String, ToolError>;
}

/// An environment that offers tools (see the module docs).
pub struct ToolEnv {
    tools: Vec<Box<dyn Tool>>,
    /// Appended to the prompt at reset: how to call the tools.
    instructions: String,
}

impl ToolEnv {
    /// An environment with `tools`.
    pub fn new(tools: Vec<Box<dyn Tool>>) -> Self {
        let mut instructions = String::from("\n\nYou can use tools. Tools:");
        for t in &tools {
            instructions.push_str("\n- ");
            instructions.push_str(t.description());
        }
        if let Some(t) = tools.first() {
            instructions.push_str(&format!(
                "\nTo call a tool, write for example: <tool_call>{{\"name\": \"{}\", \"arguments\": {}}}</tool_call>\nThe result comes back in <tool_response>.",
                t.name(),
                t.example_arguments()
            ));
        }
        ToolEnv {
            tools,
            instructions,
        }
    }
}

impl Env for ToolEnv {
    fn reset(&mut self, prompt: &Prompt) -> Result<String, EnvError> {
        Ok(format!("{}{}", prompt.text, self.instructions))
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
        let call = match parse_tool_call(action) {
            ParsedTurn::Answer => return Ok(EnvStep::done(0.0)),
            ParsedTurn::Call(c) => c,
            ParsedTurn::Malformed(why) => {
                return Ok(EnvStep::tool_result(format!("Error: {why}"), true))
            }
        };
        let Some(tool) = self.tools.iter_mut().find(|t| t.name() == call.name) else {
            let names: Vec<&str> = self.tools.iter().map(|t| t.name()).collect();
            return Ok(EnvStep::tool_result(
                format!(
                    "Error: there is no tool {:?}; the tools are {}",
                    call.name,
                    names.join(", ")
                ),
                true,
            ));
        };
        Ok(match tool.call(&call.arguments) {
            Ok(out) => EnvStep::tool_result(out, false),
            Err(e) => EnvStep::tool_result(format!("Error: {e}"), true),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::CalculatorTool;

    fn prompt(text: &str) -> Prompt {
        Prompt {
            id: 1,
            text: text.into(),
            reference: None,
            metadata: Value::Null,
            messages: Vec::new(),
        }
    }

    #[test]
    fn a_tool_env_runs_calls_explains_errors_and_ends_at_an_answer() {
        let mut env = ToolEnv::new(vec![Box::new(CalculatorTool)]);
        let first = env.reset(&prompt("What is 12 * 34?")).unwrap();
        assert!(first.starts_with("What is 12 * 34?"));
        assert!(first.contains("calculator"), "{first}");
        let s = env
            .step(r#"<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>"#)
            .unwrap();
        assert_eq!(
            (s.observation.as_str(), s.done, s.tool_calls, s.tool_errors),
            ("<tool_response>\n408\n</tool_response>", false, 1, 0)
        );
        let s = env.step("<tool_call>{oops}</tool_call>").unwrap();
        assert!(s.observation.contains("not valid JSON"), "{}", s.observation);
        assert_eq!((s.done, s.tool_calls, s.tool_errors), (false, 1, 1));
        let s = env
            .step(r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#)
            .unwrap();
        assert!(s.observation.contains("no tool \"search\""), "{}", s.observation);
        let s = env
            .step(r#"<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>"#)
            .unwrap();
        assert!(s.observation.contains("division by zero"));
        assert_eq!(s.tool_errors, 1);
        let s = env.step("So the answer is 408.").unwrap();
        assert!(s.done);
        assert_eq!(s.tool_calls, 0);
    }
}
