//! From one dataset row (a JSON object, whatever the file format) to a [`Prompt`]:
//! which columns hold the prompt, the ground truth, the data source and the extra info
//! ([`DataFields`], verl's names by default), and the file formats ([`DataFormat`]).
//!
//! A row maps to a prompt as follows:
//! - prompt: the `prompt_key` column, a string or a chat (a list of `{role, content}`
//!   messages); with the default key, `question` and `messages` are tried too;
//! - ground truth: the `ground_truth_key` column (a dotted path reaches into a struct:
//!   verl's `reward_model.ground_truth`); with the default key, a top-level
//!   `ground_truth`, `answer` or `reference` is tried too. A string or a number; a list
//!   or an object is kept as its JSON text;
//! - `data_source_key` → `metadata["data_source"]`, `extra_info_key` →
//!   `metadata["extra_info"]` (what a Python reward's `compute_score` receives);
//! - id: an `id` column (a non-negative integer, or a string that is hashed), else a
//!   hash of the prompt text and its occurrence count;
//! - every other column stays in `metadata`.

use std::collections::HashMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use yatt_engine::ChatMessage;

use crate::data::prompt::{fnv1a, transcript, Prompt};

/// A dataset file's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, schemars::JsonSchema)]
pub enum DataFormat {
    /// One JSON object per line.
    #[serde(rename = "jsonl")]
    Jsonl,
    /// An Apache Parquet file (verl's layout, or any table with a prompt column).
    #[serde(rename = "parquet")]
    Parquet,
    /// A Hugging Face dataset saved with `Dataset.save_to_disk`: a directory with
    /// `dataset_info.json`, `state.json` and `data-*.arrow` (Arrow IPC streams).
    #[serde(rename = "hf-disk")]
    HfDisk,
}

impl DataFormat {
    /// The word a config uses.
    pub fn name(self) -> &'static str {
        match self {
            DataFormat::Jsonl => "jsonl",
            DataFormat::Parquet => "parquet",
            DataFormat::HfDisk => "hf-disk",
        }
    }

    /// The format a path implies: a directory is `hf-disk`, `*.parquet` / `*.pq` is
    /// `parquet`, `*.jsonl` / `*.json` / `*.ndjson` is `jsonl`; `None` otherwise.
    pub fn from_path(path: &Path) -> Option<Self> {
        if path.is_dir() {
            return Some(DataFormat::HfDisk);
        }
        match path.extension()?.to_str()?.to_ascii_lowercase().as_str() {
            "parquet" | "pq" => Some(DataFormat::Parquet),
            "jsonl" | "json" | "ndjson" => Some(DataFormat::Jsonl),
            _ => None,
        }
    }
}

impl std::fmt::Display for DataFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Which columns of a row hold what (verl's `data.prompt_key` & co).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DataFields {
    /// The prompt: a string or a list of chat messages. Default `prompt`.
    pub prompt_key: String,
    /// The ground truth, a dotted path into structs. Default `reward_model.ground_truth`.
    pub ground_truth_key: String,
    /// The data source handed to the reward. Default `data_source`.
    pub data_source_key: String,
    /// The extra info handed to the reward. Default `extra_info`.
    pub extra_info_key: String,
}

/// verl's prompt column.
pub const DEFAULT_PROMPT_KEY: &str = "prompt";
/// verl's ground-truth field.
pub const DEFAULT_GROUND_TRUTH_KEY: &str = "reward_model.ground_truth";

impl Default for DataFields {
    fn default() -> Self {
        DataFields {
            prompt_key: DEFAULT_PROMPT_KEY.into(),
            ground_truth_key: DEFAULT_GROUND_TRUTH_KEY.into(),
            data_source_key: "data_source".into(),
            extra_info_key: "extra_info".into(),
        }
    }
}

impl DataFields {
    fn prompt_keys(&self) -> Vec<&str> {
        if self.prompt_key == DEFAULT_PROMPT_KEY {
            vec!["prompt", "question", "messages"]
        } else {
            vec![self.prompt_key.as_str()]
        }
    }

    fn ground_truth_keys(&self) -> Vec<&str> {
        if self.ground_truth_key == DEFAULT_GROUND_TRUTH_KEY {
            vec![
                DEFAULT_GROUND_TRUTH_KEY,
                "ground_truth",
                "answer",
                "reference",
            ]
        } else {
            vec![self.ground_truth_key.as_str()]
        }
    }
}

/// Why a row is not a prompt.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum RowFault {
    /// A column is missing or holds the wrong thing.
    Field {
        /// The column (dotted for a struct field).
        column: String,
        /// What is wrong and how to fix it.
        reason: String,
    },
    /// The row's explicit id was used by an earlier row.
    DuplicateId {
        /// The id.
        id: u64,
        /// Where it was first used (the caller's line or row number).
        first: usize,
    },
}

fn fault(column: &str, reason: String) -> RowFault {
    RowFault::Field {
        column: column.to_string(),
        reason,
    }
}

/// A JSON value's kind, for error messages.
pub(crate) fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Turns rows into prompts, keeping the state that makes ids unique and stable.
#[derive(Debug)]
pub(crate) struct RowConverter<'a> {
    fields: &'a DataFields,
    explicit_ids: HashMap<u64, usize>,
    occurrences: HashMap<String, u64>,
}

impl<'a> RowConverter<'a> {
    pub(crate) fn new(fields: &'a DataFields) -> Self {
        RowConverter {
            fields,
            explicit_ids: HashMap::new(),
            occurrences: HashMap::new(),
        }
    }

    /// The prompt of one row; `at` is the row's position, named in duplicate-id faults.
    pub(crate) fn convert(
        &mut self,
        mut row: Map<String, Value>,
        at: usize,
    ) -> Result<Prompt, RowFault> {
        let (text, messages) = self.take_prompt(&mut row)?;
        let reference = self.take_ground_truth(&mut row)?;
        let mut metadata = Map::new();
        for (key, name) in [
            (&self.fields.data_source_key, "data_source"),
            (&self.fields.extra_info_key, "extra_info"),
        ] {
            match take_path(&mut row, key) {
                None | Some(Value::Null) => {}
                Some(Value::String(s)) if name == "data_source" => {
                    metadata.insert(name.into(), Value::String(s));
                }
                Some(other) if name == "data_source" => {
                    return Err(fault(
                        key,
                        format!("the data source must be a string, got {}", kind(&other)),
                    ))
                }
                Some(v) => {
                    metadata.insert(name.into(), v);
                }
            }
        }
        let id = match row.remove("id") {
            Some(Value::Null) | None => {
                let k = self.occurrences.entry(text.clone()).or_insert(0);
                *k += 1;
                fnv1a(&[b"prompt", text.as_bytes(), &k.to_le_bytes()])
            }
            Some(v) => {
                let id = match &v {
                    Value::Number(n) => n.as_u64().ok_or_else(|| {
                        fault("id", format!("\"id\" {n} is not a non-negative integer"))
                    })?,
                    Value::String(s) => fnv1a(&[b"id", s.as_bytes()]),
                    other => {
                        return Err(fault(
                            "id",
                            format!("\"id\" must be an integer or a string, got {}", kind(other)),
                        ))
                    }
                };
                if let Some(first) = self.explicit_ids.insert(id, at) {
                    return Err(RowFault::DuplicateId { id, first });
                }
                id
            }
        };
        // What is left stays with the prompt; the named fields win over leftovers.
        for (k, v) in row {
            metadata.entry(k).or_insert(v);
        }
        Ok(Prompt {
            id,
            text,
            messages,
            reference,
            metadata: Value::Object(metadata),
        })
    }

    fn take_prompt(
        &self,
        row: &mut Map<String, Value>,
    ) -> Result<(String, Vec<ChatMessage>), RowFault> {
        let keys = self.fields.prompt_keys();
        for k in &keys {
            let Some(v) = take_path(row, k) else { continue };
            return match v {
                Value::String(s) if !s.trim().is_empty() => Ok((s, Vec::new())),
                Value::String(_) => Err(fault(k, format!("\"{k}\" is empty; give the prompt text"))),
                Value::Array(items) => {
                    let messages = chat_messages(k, items)?;
                    Ok((transcript(&messages), messages))
                }
                other => Err(fault(
                    k,
                    format!(
                        "the prompt must be a string or a list of {{\"role\", \"content\"}} messages, got {}",
                        kind(&other)
                    ),
                )),
            };
        }
        let present: Vec<&String> = row.keys().collect();
        Err(fault(
            &self.fields.prompt_key,
            format!(
                "no prompt: expected a {} column; columns present: {present:?}; set data.prompt_key to the prompt's column",
                keys.iter().map(|k| format!("\"{k}\"")).collect::<Vec<_>>().join(" or ")
            ),
        ))
    }

    fn take_ground_truth(&self, row: &mut Map<String, Value>) -> Result<Option<String>, RowFault> {
        for k in self.fields.ground_truth_keys() {
            let Some(v) = take_path(row, k) else { continue };
            return match v {
                Value::Null => Ok(None),
                Value::String(s) => Ok(Some(s)),
                Value::Number(n) => Ok(Some(n.to_string())),
                Value::Bool(b) => Ok(Some(b.to_string())),
                other @ (Value::Array(_) | Value::Object(_)) => Ok(Some(other.to_string())),
            };
        }
        Ok(None)
    }
}

/// Removes the value at a dotted path (`a.b` is field `b` of struct column `a`); a key
/// with a dot in its own name is tried whole first.
fn take_path(row: &mut Map<String, Value>, path: &str) -> Option<Value> {
    if let Some(v) = row.remove(path) {
        return Some(v);
    }
    let (head, rest) = path.split_once('.')?;
    match row.get_mut(head)? {
        Value::Object(inner) => {
            let v = take_path(inner, rest)?;
            if inner.is_empty() {
                row.remove(head);
            }
            Some(v)
        }
        _ => None,
    }
}

const ROLES: [&str; 4] = ["system", "user", "assistant", "tool"];

/// A chat from a list of `{role, content}` objects.
fn chat_messages(key: &str, items: Vec<Value>) -> Result<Vec<ChatMessage>, RowFault> {
    if items.is_empty() {
        return Err(fault(
            key,
            "the chat has no messages; give at least one {\"role\": \"user\", \"content\": ...}"
                .into(),
        ));
    }
    let mut out = Vec::with_capacity(items.len());
    for (i, item) in items.into_iter().enumerate() {
        let Value::Object(mut m) = item else {
            return Err(fault(
                key,
                format!(
                    "message {i} must be an object {{\"role\": ..., \"content\": ...}}, got {}",
                    kind(&item)
                ),
            ));
        };
        let role = match m.remove("role") {
            Some(Value::String(r)) if ROLES.contains(&r.as_str()) => r,
            Some(Value::String(r)) => {
                return Err(fault(
                    key,
                    format!("message {i} has role {r:?}; use one of {ROLES:?}"),
                ))
            }
            other => {
                return Err(fault(
                    key,
                    format!(
                        "message {i} needs a string \"role\" (one of {ROLES:?}), got {}",
                        other.as_ref().map_or("nothing", kind)
                    ),
                ))
            }
        };
        let content = match m.remove("content") {
            Some(Value::String(c)) => c,
            other => {
                return Err(fault(
                    key,
                    format!(
                        "message {i} ({role}) needs a string \"content\", got {} (multi-part content is not supported: join the text parts)",
                        other.as_ref().map_or("nothing", kind)
                    ),
                ))
            }
        };
        out.push(ChatMessage { role, content });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn row(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    #[test]
    fn verl_row_maps_every_field() {
        let fields = DataFields::default();
        let mut c = RowConverter::new(&fields);
        let p = c
            .convert(
                row(json!({
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": "5"},
                    "extra_info": {"split": "train", "index": 7},
                })),
                0,
            )
            .unwrap();
        assert_eq!(p.messages.len(), 2);
        assert_eq!(p.messages[1], ChatMessage::new("user", "2+3?"));
        assert_eq!(p.text, "system: Be brief.\n\nuser: 2+3?");
        assert_eq!(p.reference.as_deref(), Some("5"));
        assert_eq!(p.metadata["data_source"], "openai/gsm8k");
        assert_eq!(
            p.metadata["extra_info"],
            json!({"split": "train", "index": 7})
        );
        assert_eq!(p.metadata["ability"], "math");
        assert_eq!(p.metadata["reward_model"], json!({"style": "rule"}));
    }

    #[test]
    fn custom_keys_and_faults() {
        let fields = DataFields {
            prompt_key: "q".into(),
            ground_truth_key: "sol.value".into(),
            data_source_key: "src".into(),
            extra_info_key: "info".into(),
        };
        let mut c = RowConverter::new(&fields);
        let p = c
            .convert(
                row(json!({"q": "hi", "sol": {"value": 3}, "src": "s", "info": [1]})),
                0,
            )
            .unwrap();
        assert_eq!(p.reference.as_deref(), Some("3"));
        assert_eq!(p.metadata, json!({"data_source": "s", "extra_info": [1]}));
        // the default fallbacks do not apply to a custom key
        let e = c.convert(row(json!({"prompt": "hi"})), 1).unwrap_err();
        assert!(
            matches!(&e, RowFault::Field { column, reason } if column == "q" && reason.contains("data.prompt_key")),
            "{e:?}"
        );
        let e = c
            .convert(row(json!({"q": [{"role": "bot", "content": "x"}]})), 2)
            .unwrap_err();
        assert!(
            matches!(&e, RowFault::Field { reason, .. } if reason.contains("\"bot\"")),
            "{e:?}"
        );
        let e = c
            .convert(row(json!({"q": [{"role": "user"}]})), 3)
            .unwrap_err();
        assert!(
            matches!(&e, RowFault::Field { reason, .. } if reason.contains("\"content\"")),
            "{e:?}"
        );
        let e = c.convert(row(json!({"q": "a", "src": 5})), 4).unwrap_err();
        assert!(
            matches!(&e, RowFault::Field { column, .. } if column == "src"),
            "{e:?}"
        );
        c.convert(row(json!({"q": "a", "id": 9})), 5).unwrap();
        let e = c.convert(row(json!({"q": "b", "id": 9})), 6).unwrap_err();
        assert_eq!(e, RowFault::DuplicateId { id: 9, first: 5 });
    }

    #[test]
    fn format_from_path() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(DataFormat::from_path(dir.path()), Some(DataFormat::HfDisk));
        assert_eq!(
            DataFormat::from_path(Path::new("a/train.parquet")),
            Some(DataFormat::Parquet)
        );
        assert_eq!(
            DataFormat::from_path(Path::new("a.JSONL")),
            Some(DataFormat::Jsonl)
        );
        assert_eq!(DataFormat::from_path(Path::new("a.csv")), None);
    }
}
