//! Tool calls in a model's text, in the Hermes/Qwen format:
//! `<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>`.
//!
//! Pure parsing, no I/O. A malformed call is not an error of the parser's caller: it is
//! an answer ([`ParsedTurn::Malformed`]) whose message the environment hands back to the
//! model as its observation, so the model can learn the format.

use serde_json::{Map, Value};

/// The opening tag of a tool call.
pub const TOOL_CALL_OPEN: &str = "<tool_call>";
/// The closing tag of a tool call (a model turn stops at it: see the rollout).
pub const TOOL_CALL_CLOSE: &str = "</tool_call>";

/// One well-formed tool call.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    /// The tool's name.
    pub name: String,
    /// Its arguments (a JSON object; empty when the call gave none).
    pub arguments: Map<String, Value>,
}

/// What a model turn asked for.
#[derive(Debug, Clone, PartialEq)]
pub enum ParsedTurn {
    /// No tool call: a final answer.
    Answer,
    /// The first tool call of the turn (later ones are ignored: one call per turn).
    Call(ToolCall),
    /// Something that tried to be a tool call and is not one; the message says what is
    /// wrong and how a right one looks.
    Malformed(String),
}

/// Parses the first tool call of a model turn.
pub fn parse_tool_call(turn: &str) -> ParsedTurn {
    let Some(start) = turn.find(TOOL_CALL_OPEN) else {
        return ParsedTurn::Answer;
    };
    let body = &turn[start + TOOL_CALL_OPEN.len()..];
    // A turn cut off by its token budget has no closing tag: take what is there.
    let body = match body.find(TOOL_CALL_CLOSE) {
        Some(end) => &body[..end],
        None => body,
    };
    let example =
        r#"<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>"#;
    let value: Value = match serde_json::from_str(body.trim()) {
        Ok(v) => v,
        Err(e) => {
            return ParsedTurn::Malformed(format!(
                "the tool call is not valid JSON ({e}); write one JSON object, e.g. {example}"
            ))
        }
    };
    let Value::Object(mut obj) = value else {
        return ParsedTurn::Malformed(format!(
            "the tool call must be a JSON object with \"name\" and \"arguments\", e.g. {example}"
        ));
    };
    let name = match obj.remove("name") {
        Some(Value::String(n)) if !n.trim().is_empty() => n.trim().to_string(),
        _ => {
            return ParsedTurn::Malformed(format!(
                "the tool call has no \"name\" string; e.g. {example}"
            ))
        }
    };
    let arguments = match obj.remove("arguments") {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(a)) => a,
        // Some models write the arguments as a JSON string holding an object.
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(Value::Object(a)) => a,
            _ => {
                return ParsedTurn::Malformed(format!(
                    "\"arguments\" of tool {name:?} must be a JSON object, e.g. {example}"
                ))
            }
        },
        Some(_) => {
            return ParsedTurn::Malformed(format!(
                "\"arguments\" of tool {name:?} must be a JSON object, e.g. {example}"
            ))
        }
    };
    ParsedTurn::Call(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_hermes_calls_and_explains_bad_ones() {
        assert_eq!(parse_tool_call("The answer is 42."), ParsedTurn::Answer);
        let t = r#"Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>"#;
        match parse_tool_call(t) {
            ParsedTurn::Call(c) => {
                assert_eq!(c.name, "calculator");
                assert_eq!(c.arguments["expression"], "2*3");
            }
            other => panic!("{other:?}"),
        }
        // Arguments given as a string holding JSON, and a call cut off before its tag.
        let t = r#"<tool_call>{"name":"python","arguments":"{\"code\": \"print(1)\"}"}"#;
        assert!(
            matches!(parse_tool_call(t), ParsedTurn::Call(c) if c.arguments["code"] == "print(1)")
        );
        for (bad, says) in [
            (
                "<tool_call>{name: calculator}</tool_call>",
                "not valid JSON",
            ),
            ("<tool_call>[1, 2]</tool_call>", "must be a JSON object"),
            (r#"<tool_call>{"arguments": {}}</tool_call>"#, "no \"name\""),
            (
                r#"<tool_call>{"name": "c", "arguments": 3}</tool_call>"#,
                "\"arguments\"",
            ),
        ] {
            match parse_tool_call(bad) {
                ParsedTurn::Malformed(m) => assert!(m.contains(says), "{bad}: {m}"),
                other => panic!("{bad}: {other:?}"),
            }
        }
    }
}
