//! The config reference, generated from the typed config: every key of a config with
//! its type, default, allowed words and meaning, as Markdown tables (one per section).
//!
//! It reads the JSON schema that `schemars` derives from the config structs. That
//! schema carries the structs' doc comments, the defaults (serialised from each
//! section's `Default`) and the enums' words, so the page cannot drift from the code.

use schemars::JsonSchema;
use serde_json::{Map, Value};

/// The reference of config type `T` (a struct of sections, as `JobConfig` or the node
/// file): a `###` heading and a table per section, nested tables (`[model.lora]`)
/// after their parent.
pub fn config_reference<T: JsonSchema>() -> String {
    let schema = schemars::generate::SchemaSettings::draft2020_12()
        .into_generator()
        .into_root_schema_for::<T>();
    let root = schema.as_value();
    let empty = Map::new();
    let defs = root
        .get("$defs")
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let page = Page { defs };
    let mut out = String::new();
    let Some(sections) = root.get("properties").and_then(Value::as_object) else {
        return out;
    };
    for (name, field) in sections {
        page.section(&mut out, name, field, None);
    }
    out
}

struct Page<'a> {
    defs: &'a Map<String, Value>,
}

/// What a field's schema describes, once references and `null` alternatives are
/// taken out.
enum Shape<'a> {
    /// A table of keys (a section or subsection).
    Table(&'a Value),
    /// An array of tables (`[[roles.stages]]`).
    TableArray(&'a Value),
    /// A value: its type in words and the words it allows with their meanings.
    Value {
        kind: String,
        words: Vec<(String, String)>,
    },
}

impl<'a> Page<'a> {
    fn resolve(&self, v: &'a Value) -> &'a Value {
        match v.get("$ref").and_then(Value::as_str) {
            Some(r) => r
                .rsplit('/')
                .next()
                .and_then(|name| self.defs.get(name))
                .map(|d| self.resolve(d))
                .unwrap_or(v),
            None => v,
        }
    }

    /// The field's schema without an `Option`'s `null` alternative, and whether it had
    /// one.
    fn strip_null(&self, v: &'a Value) -> (&'a Value, bool) {
        let v = self.resolve(v);
        // `Option<f64>` is `"type": ["number", "null"]`; `Option<Table>` an `anyOf`.
        if let Some(types) = v.get("type").and_then(Value::as_array) {
            if types.iter().any(|t| t == "null") {
                return (v, true);
            }
        }
        if let Some(alts) = v.get("anyOf").and_then(Value::as_array) {
            let non_null: Vec<&Value> = alts
                .iter()
                .filter(|a| a.get("type").and_then(Value::as_str) != Some("null"))
                .collect();
            if non_null.len() == 1 && alts.len() == 2 {
                return (self.resolve(non_null[0]), true);
            }
        }
        (v, false)
    }

    fn shape(&self, v: &'a Value) -> Shape<'a> {
        let (v, _) = self.strip_null(v);
        if v.get("properties").is_some() {
            return Shape::Table(v);
        }
        if let Some(items) = v.get("items") {
            let item = self.resolve(items);
            if item.get("properties").is_some() {
                return Shape::TableArray(item);
            }
            let inner = match self.shape(items) {
                Shape::Value { kind, words } => (kind, words),
                _ => ("table".into(), Vec::new()),
            };
            return Shape::Value {
                kind: format!("list of {}", plural(&inner.0)),
                words: inner.1,
            };
        }
        let words = self.words(v);
        if !words.is_empty() {
            return Shape::Value {
                kind: "word".into(),
                words,
            };
        }
        if let Some(alts) = v.get("anyOf").and_then(Value::as_array) {
            let mut kinds = Vec::new();
            let mut all_words = Vec::new();
            for a in alts {
                if let Shape::Value { kind, words } = self.shape(a) {
                    if !kinds.contains(&kind) {
                        kinds.push(kind);
                    }
                    for w in words {
                        if !all_words.contains(&w) {
                            all_words.push(w);
                        }
                    }
                }
            }
            return Shape::Value {
                kind: kinds.join(" or "),
                words: all_words,
            };
        }
        Shape::Value {
            kind: type_word(v),
            words: Vec::new(),
        }
    }

    /// The words an enum allows, each with its doc comment.
    fn words(&self, v: &Value) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(e) = v.get("enum").and_then(Value::as_array) {
            for w in e {
                if let Some(w) = w.as_str() {
                    out.push((w.to_string(), String::new()));
                }
            }
        }
        for key in ["oneOf", "anyOf"] {
            if let Some(alts) = v.get(key).and_then(Value::as_array) {
                for a in alts {
                    let a = self.resolve(a);
                    if let Some(w) = a.get("const").and_then(Value::as_str) {
                        out.push((w.to_string(), doc(a)));
                    } else if let Some(e) = a.get("enum").and_then(Value::as_array) {
                        for w in e.iter().filter_map(Value::as_str) {
                            out.push((w.to_string(), doc(a)));
                        }
                    }
                }
            }
        }
        out
    }

    fn section(&self, out: &mut String, path: &str, field: &'a Value, array: Option<()>) {
        let (table, optional) = match self.shape(field) {
            Shape::Table(t) => (t, self.strip_null(field).1),
            Shape::TableArray(t) => (t, false),
            Shape::Value { .. } => return,
        };
        let header = if array.is_some() || matches!(self.shape(field), Shape::TableArray(_)) {
            format!("[[{path}]]")
        } else {
            format!("[{path}]")
        };
        out.push_str(&format!("### `{header}`\n\n"));
        // The table's own doc says what it is for; the field's often only names it.
        let about = longest(&[doc(table), doc(field)]);
        if !about.is_empty() {
            out.push_str(&one_line(&about));
            out.push_str("\n\n");
        }
        if optional {
            out.push_str("Optional: absent unless the config has this table.\n\n");
        }
        let Some(props) = table.get("properties").and_then(Value::as_object) else {
            return;
        };
        out.push_str("| Key | Type | Default | Meaning |\n|---|---|---|---|\n");
        let mut nested = Vec::new();
        for (key, prop) in props {
            let meaning = one_line(&doc(prop));
            let default = prop.get("default");
            match self.shape(prop) {
                Shape::Table(_) | Shape::TableArray(_) => {
                    let sub = format!("{path}.{key}");
                    let header = match self.shape(prop) {
                        Shape::TableArray(_) => format!("[[{sub}]]"),
                        _ => format!("[{sub}]"),
                    };
                    out.push_str(&format!(
                        "| `{key}` | table | {} | {} See [`{header}`](#{}). |\n",
                        default.map(show_default).unwrap_or_else(|| "unset".into()),
                        cell(&meaning),
                        anchor(&header),
                    ));
                    nested.push((sub, prop));
                }
                Shape::Value { kind, words } => {
                    let mut meaning = cell(&meaning);
                    if !words.is_empty() {
                        let list: Vec<String> = words
                            .iter()
                            .map(|(w, d)| {
                                if d.is_empty() {
                                    format!("`{w}`")
                                } else {
                                    let d = one_line(d);
                                    format!("`{w}`: {}", cell(d.trim_end_matches('.')))
                                }
                            })
                            .collect();
                        let sep = if words.iter().any(|(_, d)| !d.is_empty()) {
                            "; "
                        } else {
                            ", "
                        };
                        meaning.push_str(&format!(" Words: {}.", list.join(sep)));
                    }
                    let kind = if self.strip_null(prop).1 {
                        format!("{kind} (optional)")
                    } else {
                        kind
                    };
                    out.push_str(&format!(
                        "| `{key}` | {kind} | {} | {} |\n",
                        default.map(show_default).unwrap_or_else(|| "unset".into()),
                        meaning.trim()
                    ));
                }
            }
        }
        out.push('\n');
        for (sub, prop) in nested {
            self.section(out, &sub, prop, None);
        }
    }
}

/// A schema's doc comment: schemars splits a multi-paragraph one into title and
/// description.
fn doc(v: &Value) -> String {
    let title = v.get("title").and_then(Value::as_str).unwrap_or("");
    let description = v.get("description").and_then(Value::as_str).unwrap_or("");
    match (title.is_empty(), description.is_empty()) {
        (true, _) => description.to_string(),
        (false, true) => title.to_string(),
        (false, false) => format!("{title} {description}"),
    }
}

fn longest(docs: &[String]) -> String {
    docs.iter()
        .max_by_key(|d| d.len())
        .cloned()
        .unwrap_or_default()
}

/// A doc comment on one line: its line breaks are the source's wrapping, not meaning.
/// Rustdoc's intra-doc links (`` [`Algorithm::default_clip`] ``) lose their brackets,
/// which point nowhere on the page.
fn one_line(s: &str) -> String {
    let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let mut out = String::with_capacity(joined.len());
    let mut rest = joined.as_str();
    while let Some(start) = rest.find("[`") {
        let Some(len) = rest[start..].find("`]") else {
            break;
        };
        let end = start + len + 2;
        out.push_str(&rest[..start]);
        if rest[end..].starts_with('(') || rest[end..].starts_with('[') {
            out.push_str(&rest[start..end]);
        } else {
            out.push_str(&rest[start + 1..end - 1]);
        }
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

/// Text that is safe inside a Markdown table cell.
fn cell(s: &str) -> String {
    s.replace('|', "\\|")
}

fn type_word(v: &Value) -> String {
    let word = |t: &str| {
        match t {
            "integer" => "integer",
            "number" => "number",
            "boolean" => "boolean",
            "string" => "string",
            "object" => "table",
            "array" => "list",
            other => other,
        }
        .to_string()
    };
    match v.get("type") {
        Some(Value::String(t)) => word(t),
        Some(Value::Array(ts)) => ts
            .iter()
            .filter_map(Value::as_str)
            .filter(|t| *t != "null")
            .map(word)
            .collect::<Vec<_>>()
            .join(" or "),
        _ => "any".into(),
    }
}

fn plural(kind: &str) -> String {
    match kind {
        "word" => "words".into(),
        "string" => "strings".into(),
        "integer" => "integers".into(),
        "number" => "numbers".into(),
        "boolean" => "booleans".into(),
        other => other.into(),
    }
}

/// A default as the TOML would write it.
fn show_default(v: &Value) -> String {
    fn toml(v: &Value) -> String {
        match v {
            Value::Null => "unset".into(),
            // JSON's escapes are TOML's basic-string escapes.
            Value::String(_) => v.to_string(),
            Value::Array(items) => format!(
                "[{}]",
                items.iter().map(toml).collect::<Vec<_>>().join(", ")
            ),
            Value::Object(_) => "(table)".into(),
            other => other.to_string(),
        }
    }
    match v {
        Value::Null => "unset".into(),
        Value::Object(_) => "(table)".into(),
        other => format!("`{}`", cell(&toml(other))),
    }
}

/// The anchor GitHub and mdBook give a `### ` heading of this text in backticks.
fn anchor(header: &str) -> String {
    header
        .chars()
        .filter_map(|c| match c {
            'a'..='z' | '0'..='9' | '_' | '-' => Some(c),
            'A'..='Z' => Some(c.to_ascii_lowercase()),
            ' ' => Some('-'),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A section as the job config writes one.
    #[derive(Default, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
    #[serde(default)]
    struct Sample {
        /// `[first]`: the first section.
        first: First,
    }

    #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
    #[serde(default)]
    struct First {
        /// How many | of them.
        count: u64,
        /// The mode.
        mode: Mode,
        /// Maybe a number.
        limit: Option<f64>,
        /// A nested table.
        inner: Option<Inner>,
    }

    impl Default for First {
        fn default() -> Self {
            First {
                count: 3,
                mode: Mode::Fast,
                limit: None,
                inner: None,
            }
        }
    }

    #[derive(Default, serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
    struct Inner {
        /// Its flag.
        flag: bool,
    }

    #[derive(serde::Serialize, serde::Deserialize, schemars::JsonSchema)]
    #[serde(rename_all = "lowercase")]
    enum Mode {
        /// Quick.
        Fast,
        /// Careful.
        Slow,
    }

    #[test]
    fn renders_keys_types_defaults_and_words() {
        let page = config_reference::<Sample>();
        assert!(page.contains("### `[first]`"), "{page}");
        assert!(page.contains("`[first]`: the first section."), "{page}");
        assert!(
            page.contains("| `count` | integer | `3` | How many \\| of them. |"),
            "{page}"
        );
        assert!(
            page.contains(
                "| `mode` | word | `\"fast\"` | The mode. Words: `fast`: Quick; `slow`: Careful. |"
            ),
            "{page}"
        );
        assert!(
            page.contains("| `limit` | number (optional) | unset | Maybe a number. |"),
            "{page}"
        );
        assert!(page.contains("### `[first.inner]`"), "{page}");
        assert!(page.contains("(#firstinner)"), "{page}");
        assert!(page.contains("| `flag` | boolean |"), "{page}");
    }
}
