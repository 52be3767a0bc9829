//! Builds an HF `tokenizer.json` from GGUF tokenizer metadata (byte-level BPE models,
//! `tokenizer.ggml.model = "gpt2"`).

use super::file::{GgufFile, GgufValue};
use crate::error::{EngineError, Result};
use serde_json::{json, Map, Value};

/// GGUF token types.
const TYPE_CONTROL: i64 = 3;
const TYPE_USER_DEFINED: i64 = 4;

/// The split regex for a llama.cpp pre-tokenizer name, and whether digits are split
/// one by one before it (SmolLM).
fn pre_tokenizer(pre: &str) -> Option<Value> {
    let byte_level = |use_regex: bool| json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": use_regex});
    let split = |re: &str| json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    Some(match pre {
        "smollm" => json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level(true)]}),
        "gpt2" | "default" | "gpt-2" => byte_level(true),
        "llama-bpe" | "llama3" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        "qwen2" => json!({"type": "Sequence", "pretokenizers": [
            split(r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"),
            byte_level(false)]}),
        _ => return None,
    })
}

fn strings<'a>(g: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let arr = g.get(key).and_then(GgufValue::as_array).ok_or_else(|| {
        EngineError::UnsupportedGguf(format!(
            "{} has no `{key}` array; cannot build a tokenizer",
            g.path().display()
        ))
    })?;
    arr.iter()
        .map(|v| {
            v.as_str()
                .ok_or_else(|| EngineError::UnsupportedGguf(format!("`{key}` holds a non-string")))
        })
        .collect()
}

/// Builds the `tokenizer.json` value for a GGUF file's tokenizer.
pub fn build_tokenizer_json(g: &GgufFile) -> Result<Value> {
    let model = g
        .get("tokenizer.ggml.model")
        .and_then(GgufValue::as_str)
        .unwrap_or("");
    if model != "gpt2" {
        return Err(EngineError::UnsupportedGguf(format!(
            "tokenizer.ggml.model = {model:?}: only byte-level BPE (\"gpt2\") tokenizers can be rebuilt; \
             for other models import the weights and supply the original tokenizer.json"
        )));
    }
    let pre = g
        .get("tokenizer.ggml.pre")
        .and_then(GgufValue::as_str)
        .unwrap_or("default");
    let pre_tok = pre_tokenizer(pre).ok_or_else(|| {
        EngineError::UnsupportedGguf(format!(
            "tokenizer.ggml.pre = {pre:?} is not known to yatt (known: smollm, gpt2, default, llama-bpe, qwen2)"
        ))
    })?;
    let tokens = strings(g, "tokenizer.ggml.tokens")?;
    let merges = strings(g, "tokenizer.ggml.merges")?;
    let types: Vec<i64> = match g
        .get("tokenizer.ggml.token_type")
        .and_then(GgufValue::as_array)
    {
        Some(a) => a.iter().map(|v| v.as_i64().unwrap_or(1)).collect(),
        None => vec![1; tokens.len()],
    };
    let mut vocab = Map::new();
    let mut added = Vec::new();
    for (id, tok) in tokens.iter().enumerate() {
        vocab.insert(tok.to_string(), json!(id));
        let ty = types.get(id).copied().unwrap_or(1);
        if ty == TYPE_CONTROL || ty == TYPE_USER_DEFINED {
            added.push(json!({
                "id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": ty != TYPE_CONTROL, "special": ty == TYPE_CONTROL,
            }));
        }
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| {
            let (a, b) = m.split_once(' ').unwrap_or((m, ""));
            json!([a, b])
        })
        .collect();
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tok,
        "post_processor": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
        "decoder": {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": vocab, "merges": merges,
        },
    }))
}
