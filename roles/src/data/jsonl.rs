//! JSONL prompt files: one JSON object per line, e.g.
//! `{"prompt": "What is 2+3?", "answer": "5"}` or
//! `{"messages": [{"role": "user", "content": "2+3?"}], "ground_truth": "5"}`.
//!
//! Each line is a row, mapped to a prompt by [`DataFields`] (see `fields` for the
//! rules: prompt string or chat, ground truth, data source, extra info, id, metadata).
//! Blank lines are skipped.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::data::fields::{kind, DataFields, RowConverter, RowFault};
use crate::data::prompt::{DataError, Prompt};

/// Reads and parses a JSONL prompt file with the default fields.
pub fn load_jsonl(path: impl AsRef<Path>) -> Result<Vec<Prompt>, DataError> {
    load_jsonl_with(path, &DataFields::default())
}

/// Reads and parses a JSONL prompt file with the given fields.
pub(crate) fn load_jsonl_with(
    path: impl AsRef<Path>,
    fields: &DataFields,
) -> Result<Vec<Prompt>, DataError> {
    let path = path.as_ref();
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    parse_jsonl_with(&text, path, fields)
}

/// Parses JSONL text with the default fields; `path` only names the source in errors.
pub fn parse_jsonl(text: &str, path: impl AsRef<Path>) -> Result<Vec<Prompt>, DataError> {
    parse_jsonl_with(text, path, &DataFields::default())
}

fn parse_jsonl_with(
    text: &str,
    path: impl AsRef<Path>,
    fields: &DataFields,
) -> Result<Vec<Prompt>, DataError> {
    let path: PathBuf = path.as_ref().to_path_buf();
    let err = |line: usize, reason: String| DataError::Line {
        path: path.clone(),
        line,
        reason,
    };
    let mut rows = RowConverter::new(fields);
    let mut out = Vec::new();
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
        let Value::Object(obj) = value else {
            return Err(err(
                line,
                format!(
                    "expected a JSON object like {{\"prompt\": ..., \"answer\": ...}}, got {}",
                    kind(&value)
                ),
            ));
        };
        match rows.convert(obj, line) {
            Ok(p) => out.push(p),
            Err(RowFault::Field { column, reason }) => {
                return Err(err(line, format!("field \"{column}\": {reason}")))
            }
            Err(RowFault::DuplicateId { id, first }) => {
                return Err(DataError::DuplicateId {
                    path: path.clone(),
                    line,
                    first_line: first,
                    id,
                })
            }
        }
    }
    if out.is_empty() {
        return Err(DataError::Empty(path));
    }
    Ok(out)
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
                "{\"messages\": [{\"role\": \"user\", \"content\": 1}]}",
                "f.jsonl:1:",
                "field \"messages\": message 0 (user) needs a string \"content\"",
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
