//! Model export: an HF-compatible directory (`config.json`, `model.safetensors`, the
//! tokenizer files when given) that `transformers` loads. The trainer's resumable
//! checkpoint builds on it in `resume.rs`; this file knows nothing of the optimizer.

use crate::error::{EngineError, Result};
use crate::model::Llama;
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

fn st_dtype(k: Kind) -> Result<safetensors::Dtype> {
    Ok(match k {
        Kind::Float => safetensors::Dtype::F32,
        Kind::BFloat16 => safetensors::Dtype::BF16,
        Kind::Half => safetensors::Dtype::F16,
        Kind::Int64 => safetensors::Dtype::I64,
        other => {
            return Err(EngineError::Weights(format!(
                "cannot store dtype {other:?} in safetensors"
            )))
        }
    })
}

/// Writes named tensors to a safetensors file with `{"format": "pt"}` metadata.
pub fn write_safetensors(path: &Path, named: &[(String, Tensor)]) -> Result<()> {
    let mut blobs = Vec::with_capacity(named.len());
    for (n, t) in named {
        let t = t.detach().to_device(Device::Cpu).contiguous();
        let len = t.numel() * t.kind().elt_size_in_bytes();
        let mut buf = vec![0u8; len];
        t.f_copy_data_u8(&mut buf, t.numel())?;
        blobs.push((
            n.clone(),
            st_dtype(t.kind())?,
            t.size().iter().map(|&d| d as usize).collect::<Vec<_>>(),
            buf,
        ));
    }
    let views = blobs
        .iter()
        .map(|(n, d, s, b)| {
            safetensors::tensor::TensorView::new(*d, s.clone(), b)
                .map(|v| (n.clone(), v))
                .map_err(|e| EngineError::Safetensors {
                    path: path.into(),
                    msg: e.to_string(),
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let meta = HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::tensor::serialize_to_file(views, Some(meta), path).map_err(|e| {
        EngineError::Safetensors {
            path: path.into(),
            msg: e.to_string(),
        }
    })
}

fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::BFloat16 => "bfloat16",
        Kind::Half => "float16",
        _ => "float32",
    }
}

/// Saves `model` as an HF directory (tokenizer files copied from `tokenizer_from`).
/// LoRA adapters are folded into the weights: the directory is a plain model.
pub fn save_pretrained(model: &Llama, dir: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
    save_model_files(model, model.merged_hf_named_tensors(), dir, tokenizer_from)
}

/// Saves `model`'s config with `named` as its weights (the base alone, or merged).
pub(crate) fn save_model_files(
    model: &Llama,
    named: Vec<(String, Tensor)>,
    dir: &Path,
    tokenizer_from: Option<&Path>,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io("creating", dir, e))?;
    let mut cfg = model.config.raw.clone();
    cfg["torch_dtype"] = json!(kind_name(model.kind()));
    if let Some(h) = &model.head {
        if h.prefix == "score" {
            cfg["architectures"] = json!(["LlamaForSequenceClassification"]);
            cfg["num_labels"] = json!(1);
        }
    }
    let p = dir.join("config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&cfg).expect("json"))
        .map_err(|e| EngineError::io("writing", &p, e))?;
    write_safetensors(&dir.join("model.safetensors"), &named)?;
    if let Some(src) = tokenizer_from {
        copy_tokenizer_files(src, dir)?;
    }
    Ok(())
}

/// Copies the tokenizer and generation files a model directory carries.
pub(crate) fn copy_tokenizer_files(src: &Path, dir: &Path) -> Result<()> {
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "chat_template.jinja",
    ] {
        let s = src.join(f);
        if s.exists() {
            std::fs::copy(&s, dir.join(f)).map_err(|e| EngineError::io("copying", &s, e))?;
        }
    }
    Ok(())
}

impl Llama {
    /// Writes the adapters as PEFT does: `adapter_config.json` and
    /// `adapter_model.safetensors`. `base` is written as `base_model_name_or_path`.
    pub fn save_adapter(&self, dir: &Path, base: &str) -> Result<()> {
        let ad = self.lora().ok_or_else(|| {
            EngineError::InvalidArgument("the model has no LoRA adapters to save".into())
        })?;
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io("creating", dir, e))?;
        let p = dir.join("adapter_config.json");
        std::fs::write(
            &p,
            serde_json::to_string_pretty(&ad.peft_config(base)).expect("json"),
        )
        .map_err(|e| EngineError::io("writing", &p, e))?;
        write_safetensors(
            &dir.join("adapter_model.safetensors"),
            &ad.peft_named_tensors(),
        )
    }
}
