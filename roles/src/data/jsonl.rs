//! JSONL prompt files: one JSON object per line, e.g.
//! `{"prompt": "What is 2+3?", "answer": "5"}`.
//!
//! - prompt text: `prompt` or `question` (string);
//! - reference: `answer`, `reference` or `ground_truth` (string or number; optional);
//! - id: `id` (non-negative integer, or a string that is hashed) if present, else a
//!   hash of the prompt text and its occurrence count (stable under reordering, distinct
//!   for duplicate prompts);
//! - every other key goes to `metadata`. Blank lines are skipped.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::data::prompt::{fnv1a, DataError, Prompt};

const PROMPT_KEYS: [&str; 2] = ["prompt", "question"];
const ANSWER_KEYS: [&str; 3] = ["answer", "reference", "ground_truth"];

/// Reads and parses a JSONL prompt file (see the module docs for the format).
pub fn load_jsonl(path: impl AsRef<Path>) -> Result<Vec<Prompt>, DataError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_jsonl(&text, path)
}

/// Parses JSONL text; `path` only names the source in errors.
pub fn parse_jsonl(text: &str, path: impl AsRef<Path>) -> Result<Vec<Prompt>, DataError> {
    let path: PathBuf = path.as_ref().to_path_buf();
    let err = |line: usize, reason: String| DataError::Line {
        path: path.clone(),
        line,
        reason,
    };
    let mut out = Vec::new();
    let mut explicit_ids: HashMap<u64, usize> = HashMap::new();
    let mut occurrences: HashMap<String, u64> = HashMap::new();
    for (i, raw) in text.lines().enumerate() {
        let line = i + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(raw).map_err(|e| {
            err(
                line,
                format!("not valid JSON ({e}); each line must be one JSON object"),
            )
        })?;
        let Value::Object(mut obj) = value else {
            return Err(err(
                line,
                format!(
                    "expected a JSON object like {{\"prompt\": ..., \"answer\": ...}}, got {}",
                    kind(&value)
                ),
            ));
        };
        let text = take_prompt(&mut obj).map_err(|r| err(line, r))?;
        let reference = take_answer(&mut obj).map_err(|r| err(line, r))?;
        let id = match obj.remove("id") {
            Some(v) => {
                let id = match &v {
                    Value::Number(n) => n.as_u64().ok_or_else(|| {
                        err(line, format!("\"id\" {n} is not a non-negative integer"))
                    })?,
                    Value::String(s) => fnv1a(&[b"id", s.as_bytes()]),
                    other => {
                        return Err(err(
                            line,
                            format!("\"id\" must be an integer or a string, got {}", kind(other)),
                        ))
                    }
                };
                if let Some(first_line) = explicit_ids.insert(id, line) {
                    return Err(DataError::DuplicateId {
                        path: path.clone(),
                        line,
                        first_line,
                        id,
                    });
                }
                id
            }
            None => {
                let k = occurrences.entry(text.clone()).or_insert(0);
                *k += 1;
                fnv1a(&[b"prompt", text.as_bytes(), &k.to_le_bytes()])
            }
        };
        out.push(Prompt {
            id,
            text,
            reference,
            metadata: Value::Object(obj),
        });
    }
    if out.is_empty() {
        return Err(DataError::Empty(path));
    }
    Ok(out)
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn take_prompt(obj: &mut Map<String, Value>) -> Result<String, String> {
    for k in PROMPT_KEYS {
        if let Some(v) = obj.remove(k) {
            return match v {
                Value::String(s) if !s.trim().is_empty() => Ok(s),
                Value::String(_) => Err(format!("\"{k}\" is empty")),
                other => Err(format!("\"{k}\" must be a string, got {}", kind(&other))),
            };
        }
    }
    let keys: Vec<&String> = obj.keys().collect();
    Err(format!(
        "no prompt: expected a \"prompt\" or \"question\" string field; keys present: {keys:?}"
    ))
}

fn take_answer(obj: &mut Map<String, Value>) -> Result<Option<String>, String> {
    for k in ANSWER_KEYS {
        if let Some(v) = obj.remove(k) {
            return match v {
                Value::String(s) => Ok(Some(s)),
                Value::Number(n) => Ok(Some(n.to_string())),
                Value::Null => Ok(None),
                other => Err(format!(
                    "\"{k}\" must be a string or a number, got {}",
                    kind(&other)
                )),
            };
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_keys_ids_and_metadata() {
        let text = r#"{"prompt": "What is 2+3?", "answer": "5", "level": 1}

{"question": "What is 4*4?", "ground_truth": 16}
{"prompt": "Say hi"}
{"prompt": "Say hi"}
{"prompt": "x", "reference": null, "id": 77}
"#;
        let ps = parse_jsonl(text, "mem.jsonl").unwrap();
        assert_eq!(ps.len(), 5);
        assert_eq!(ps[0].text, "What is 2+3?");
        assert_eq!(ps[0].reference.as_deref(), Some("5"));
        assert_eq!(ps[0].metadata, serde_json::json!({"level": 1}));
        assert_eq!(ps[1].reference.as_deref(), Some("16"));
        assert_eq!(ps[2].reference, None);
        // duplicate prompts get distinct ids; explicit ids are kept
        assert_ne!(ps[2].id, ps[3].id);
        assert_eq!(ps[4].id, 77);
        // ids are stable: same text, same ids; reordering keeps each prompt's id
        let again = parse_jsonl(text, "other.jsonl").unwrap();
        assert_eq!(
            ps.iter().map(|p| p.id).collect::<Vec<_>>(),
            again.iter().map(|p| p.id).collect::<Vec<_>>()
        );
        let swapped = parse_jsonl("{\"prompt\": \"b\"}\n{\"prompt\": \"a\"}", "s").unwrap();
        let straight = parse_jsonl("{\"prompt\": \"a\"}\n{\"prompt\": \"b\"}", "s").unwrap();
        assert_eq!(swapped[0].id, straight[1].id);
    }

    #[test]
    fn errors_name_file_line_and_problem() {
        let cases = [
            (
                "{\"prompt\": \"a\"}\n{not json}",
                "f.jsonl:2:",
                "not valid JSON",
            ),
            ("[1, 2]", "f.jsonl:1:", "expected a JSON object"),
            (
                "{\"prompt\": \"a\"}\n\n{\"text\": \"a\"}",
                "f.jsonl:3:",
                "\"prompt\" or \"question\"",
            ),
            ("{\"prompt\": 5}", "f.jsonl:1:", "must be a string"),
            (
                "{\"prompt\": \"a\", \"answer\": [1]}",
                "f.jsonl:1:",
                "\"answer\" must be a string or a number",
            ),
            (
                "{\"prompt\": \"a\", \"id\": -1}",
                "f.jsonl:1:",
                "non-negative",
            ),
            (
                "{\"prompt\": \"a\", \"id\": 3}\n{\"prompt\": \"b\", \"id\": 3}",
                "f.jsonl:2:",
                "line 1",
            ),
            ("\n  \n", "f.jsonl", "empty"),
        ];
        for (text, loc, what) in cases {
            let e = parse_jsonl(text, "f.jsonl").unwrap_err().to_string();
            assert!(e.contains(loc) && e.contains(what), "{text:?} → {e}");
        }
    }

    #[test]
    fn loads_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("d.jsonl");
        std::fs::write(&path, "{\"prompt\": \"p\", \"answer\": \"a\"}\n").unwrap();
        assert_eq!(
            load_jsonl(&path).unwrap()[0].reference.as_deref(),
            Some("a")
        );
        let e = load_jsonl(dir.path().join("missing.jsonl"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.jsonl") && e.contains("cannot read"),
            "{e}"
        );
    }
}
