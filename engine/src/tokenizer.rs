//! Tokenizer (`tokenizer.json` through the `tokenizers` crate) and chat template
//! (`tokenizer_config.json` / `chat_template.jinja`, rendered with minijinja configured
//! like HF transformers: `trim_blocks` and `lstrip_blocks`).

use crate::error::{EngineError, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// The text.
    pub content: String,
}

impl ChatMessage {
    /// A message with the given role.
    pub fn new(role: &str, content: &str) -> Self {
        ChatMessage {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A model's tokenizer plus its chat template and special tokens.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    chat_template: Option<String>,
    bos_token: Option<String>,
    eos_token: Option<String>,
    /// Ids that end generation (from the eos token and `generation_config.json`).
    pub eos_ids: Vec<i64>,
    /// The padding id (pad token, else eos, else 0).
    pub pad_id: i64,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("vocab", &self.inner.get_vocab_size(true))
            .field("eos_ids", &self.eos_ids)
            .finish()
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let s = std::fs::read_to_string(path).map_err(|e| EngineError::io("reading", path, e))?;
    serde_json::from_str(&s)
        .map(Some)
        .map_err(|e| EngineError::Json {
            path: path.into(),
            source: e,
        })
}

fn token_str(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(String::from),
        _ => None,
    }
}

impl Tokenizer {
    /// Loads `tokenizer.json` (required) and `tokenizer_config.json`, `chat_template.jinja`,
    /// `generation_config.json` (optional) from a model directory.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let tj = dir.join("tokenizer.json");
        if !tj.exists() {
            return Err(EngineError::Missing {
                what: "tokenizer.json",
                path: tj,
                hint: "the model directory needs an HF fast-tokenizer file",
            });
        }
        let inner = tokenizers::Tokenizer::from_file(&tj)
            .map_err(|e| EngineError::Tokenizer(format!("loading {}: {e}", tj.display())))?;
        let cfg = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
        let mut chat_template = match cfg.get("chat_template") {
            Some(Value::String(s)) => Some(s.clone()),
            // A list of named templates: take "default".
            Some(Value::Array(a)) => a
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str).map(String::from)),
            _ => None,
        };
        let jinja = dir.join("chat_template.jinja");
        if chat_template.is_none() && jinja.exists() {
            chat_template = Some(
                std::fs::read_to_string(&jinja)
                    .map_err(|e| EngineError::io("reading", &jinja, e))?,
            );
        }
        let bos_token = token_str(cfg.get("bos_token"));
        let eos_token = token_str(cfg.get("eos_token"));
        let pad_token = token_str(cfg.get("pad_token"));
        let mut eos_ids: Vec<i64> = eos_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .map(|i| i as i64)
            .into_iter()
            .collect();
        if let Some(g) = read_json(&dir.join("generation_config.json"))? {
            match g.get("eos_token_id") {
                Some(Value::Number(n)) => eos_ids.extend(n.as_i64()),
                Some(Value::Array(a)) => eos_ids.extend(a.iter().filter_map(Value::as_i64)),
                _ => {}
            }
        }
        eos_ids.sort();
        eos_ids.dedup();
        let pad_id = pad_token
            .as_deref()
            .and_then(|t| inner.token_to_id(t))
            .map(|i| i as i64)
            .or_else(|| eos_ids.first().copied())
            .unwrap_or(0);
        Ok(Tokenizer {
            inner,
            chat_template,
            bos_token,
            eos_token,
            eos_ids,
            pad_id,
        })
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// Encodes text (`add_special_tokens` as HF's `tokenizer(text)` does by default).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<i64>> {
        let enc = self
            .inner
            .encode(text, add_special_tokens)
            .map_err(|e| EngineError::Tokenizer(format!("encoding {text:?}: {e}")))?;
        Ok(enc.get_ids().iter().map(|&i| i as i64).collect())
    }

    /// Decodes ids to text.
    pub fn decode(&self, ids: &[i64], skip_special_tokens: bool) -> Result<String> {
        let ids: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        self.inner
            .decode(&ids, skip_special_tokens)
            .map_err(|e| EngineError::Tokenizer(format!("decoding: {e}")))
    }

    /// The id of a token string.
    pub fn token_id(&self, token: &str) -> Option<i64> {
        self.inner.token_to_id(token).map(|i| i as i64)
    }

    /// The raw chat template, if the model has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_template.as_deref()
    }

    /// Renders the chat template for `messages`.
    pub fn apply_chat_template(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tpl = self.chat_template.as_deref().ok_or_else(|| {
            EngineError::ChatTemplate("this model has no chat template (no `chat_template` in tokenizer_config.json and no chat_template.jinja)".into())
        })?;
        render_chat_template(
            tpl,
            messages,
            add_generation_prompt,
            self.bos_token.as_deref(),
            self.eos_token.as_deref(),
        )
    }

    /// Renders the chat template and encodes it (no extra special tokens, as HF does).
    pub fn encode_chat(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<Vec<i64>> {
        let s = self.apply_chat_template(messages, add_generation_prompt)?;
        self.encode(&s, false)
    }
}

/// Renders an HF chat template with minijinja.
pub fn render_chat_template(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: Option<&str>,
    eos_token: Option<&str>,
) -> Result<String> {
    let mut env = minijinja::Environment::new();
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
    env.add_function(
        "raise_exception",
        |msg: String| -> std::result::Result<String, minijinja::Error> {
            Err(minijinja::Error::new(
                minijinja::ErrorKind::InvalidOperation,
                msg,
            ))
        },
    );
    env.add_template("chat", template)
        .map_err(|e| EngineError::ChatTemplate(format!("parsing: {e}")))?;
    let t = env
        .get_template("chat")
        .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
    t.render(minijinja::context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token.unwrap_or(""),
        eos_token => eos_token.unwrap_or(""),
    })
    .map_err(|e| EngineError::ChatTemplate(format!("rendering: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_template_trims_blocks() {
        let tpl = "{% for m in messages %}\n{{ '<|im_start|>' + m['role'] + '\\n' + m.content.strip() + '<|im_end|>\\n' }}\n{% endfor %}\n{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        let s = render_chat_template(tpl, &[ChatMessage::new("user", " hi ")], true, None, None)
            .unwrap();
        // Same as jinja2 with trim_blocks + lstrip_blocks (checked against Python).
        assert_eq!(
            s,
            "<|im_start|>user\nhi<|im_end|>\n\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_is_an_error() {
        let e = render_chat_template("{{ raise_exception('bad role') }}", &[], false, None, None)
            .unwrap_err();
        assert!(e.to_string().contains("bad role"), "{e}");
    }
}
