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
use crate::env::api::{Env, EnvError, EnvStep, Tool};
use crate::env::tool_call::{parse_tool_call, ParsedTurn, TOOL_CALL_OPEN};

/// An environment that offers tools (see the module docs).
pub struct ToolEnv {
    tools: Vec<Box<dyn Tool>>,
    /// Put before the prompt at reset: how to call the tools.
    instructions: String,
    /// The opening of a call of the first tool, written at the start of the first
    /// turn (see [`ToolEnv::with_call_prefix`]).
    call_prefix: Option<String>,
    /// Steps taken since the reset.
    steps: u32,
}

impl ToolEnv {
    /// An environment with `tools`.
    pub fn new(tools: Vec<Box<dyn Tool>>) -> Self {
        // Small models copy a worked example far more often than they follow a schema:
        // the first tool's example call and result are shown as an exchange, before
        // the question.
        let mut instructions = String::from("You have tools:");
        for t in &tools {
            instructions.push_str("\n- ");
            instructions.push_str(t.description());
        }
        if let Some(t) = tools.first() {
            instructions.push_str(&format!(
                "\nDo not work it out by hand: call a tool, then answer. Example:\nQuestion: {}\nAssistant: <tool_call>{{\"name\": \"{}\", \"arguments\": {}}}</tool_call>\n<tool_response>\n{}\n</tool_response>\nAssistant: {}\n\nQuestion: ",
                t.example_question(),
                t.name(),
                t.example_arguments(),
                t.example_result(),
                t.example_result(),
            ));
        }
        ToolEnv {
            tools,
            instructions,
            call_prefix: None,
            steps: 0,
        }
    }

    /// Starts the first model turn with the opening of a call of the first tool, up to
    /// its first argument's value (`<tool_call>{"name": "calculator", "arguments":
    /// {"expression": "`): a scaffold for a model too small to ever write the format
    /// itself, so that the call's content, the use of its result and the answer can be
    /// learnt. Calling is then not the model's choice on the first turn.
    pub fn with_call_prefix(mut self) -> Self {
        self.call_prefix = self.tools.first().map(|t| {
            let first_arg = serde_json::from_str::<Map<String, Value>>(t.example_arguments())
                .ok()
                .and_then(|m| m.keys().next().cloned())
                .unwrap_or_default();
            format!(
                "{TOOL_CALL_OPEN}{{\"name\": \"{}\", \"arguments\": {{\"{first_arg}\": \"",
                t.name()
            )
        });
        self
    }
}

impl Env for ToolEnv {
    fn turn_prefix(&mut self) -> Option<String> {
        match self.steps {
            0 => self.call_prefix.clone(),
            _ => None,
        }
    }

    fn reset(&mut self, prompt: &Prompt) -> Result<String, EnvError> {
        self.steps = 0;
        Ok(format!("{}{}", self.instructions, prompt.text))
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
        self.steps += 1;
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
    use crate::env::calculator::CalculatorTool;

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
        assert!(first.ends_with("Question: What is 12 * 34?"), "{first}");
        assert!(first.contains("calculator"), "{first}");
        let s = env
            .step(r#"<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>"#)
            .unwrap();
        assert_eq!(
            (s.observation.as_str(), s.done, s.tool_calls, s.tool_errors),
            ("<tool_response>\n408\n</tool_response>", false, 1, 0)
        );
        let s = env.step("<tool_call>{oops}</tool_call>").unwrap();
        assert!(
            s.observation.contains("not valid JSON"),
            "{}",
            s.observation
        );
        assert_eq!((s.done, s.tool_calls, s.tool_errors), (false, 1, 1));
        let s = env
            .step(r#"<tool_call>{"name": "search", "arguments": {}}</tool_call>"#)
            .unwrap();
        assert!(
            s.observation.contains("no tool \"search\""),
            "{}",
            s.observation
        );
        let s = env
            .step(r#"<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}</tool_call>"#)
            .unwrap();
        assert!(s.observation.contains("division by zero"));
        assert_eq!(s.tool_errors, 1);
        let s = env.step("So the answer is 408.").unwrap();
        assert!(s.done);
        assert_eq!(s.tool_calls, 0);
        assert_eq!(env.turn_prefix(), None);

        // With the scaffold, the first turn opens a calculator call, and only the first.
        let mut env = ToolEnv::new(vec![Box::new(CalculatorTool)]).with_call_prefix();
        env.reset(&prompt("What is 2 * 3?")).unwrap();
        let prefix = env.turn_prefix().unwrap();
        assert_eq!(
            prefix,
            r#"<tool_call>{"name": "calculator", "arguments": {"expression": ""#
        );
        let s = env.step(&format!("{prefix}2*3\"}}}}</tool_call>")).unwrap();
        assert_eq!(s.observation, "<tool_response>\n6\n</tool_response>");
        assert_eq!(env.turn_prefix(), None);
    }
}
