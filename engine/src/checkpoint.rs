//! Checkpoints: an HF-compatible directory (`config.json`, `model.safetensors`, the
//! tokenizer files when given) that `transformers` loads, plus `optimizer.safetensors`
//! (AdamW moments and f32 master weights) and `trainer_state.json` (step, settings,
//! seed) for exact resume.

use crate::error::{EngineError, Result};
use crate::model::Llama;
use crate::train::{ParamState, TrainConfig, Trainer};
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
pub fn save_pretrained(model: &Llama, dir: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
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
    let named: Vec<(String, Tensor)> = model.hf_named_tensors();
    write_safetensors(&dir.join("model.safetensors"), &named)?;
    if let Some(src) = tokenizer_from {
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
    }
    Ok(())
}

pub(crate) fn save_trainer(tr: &Trainer, dir: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
    // Write into a temporary sibling and rename, so a crash never leaves half a checkpoint.
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    save_pretrained(&tr.model, &tmp, tokenizer_from)?;
    let mut opt = Vec::new();
    for s in &tr.state {
        opt.push((format!("m.{}", s.name), s.m.shallow_clone()));
        opt.push((format!("v.{}", s.name), s.v.shallow_clone()));
        if let Some(w) = &s.master {
            opt.push((format!("w.{}", s.name), w.shallow_clone()));
        }
    }
    write_safetensors(&tmp.join("optimizer.safetensors"), &opt)?;
    let state = json!({"step": tr.step, "config": tr.config, "format": "yatt-trainer-v1", "head": tr.model.head.as_ref().map(|h| h.prefix.clone())});
    let p = tmp.join("trainer_state.json");
    std::fs::write(&p, serde_json::to_string_pretty(&state).expect("json"))
        .map_err(|e| EngineError::io("writing", &p, e))?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| EngineError::io("renaming into", dir, e))
}

pub(crate) fn load_trainer(dir: &Path, device: Device, kind: Kind) -> Result<Trainer> {
    let sp = dir.join("trainer_state.json");
    if !sp.exists() {
        return Err(EngineError::Missing {
            what: "trainer_state.json",
            path: sp,
            hint: "not a yatt training checkpoint (HF model dirs load with Llama::load)",
        });
    }
    let s = std::fs::read_to_string(&sp).map_err(|e| EngineError::io("reading", &sp, e))?;
    let v: serde_json::Value = serde_json::from_str(&s).map_err(|e| EngineError::Json {
        path: sp.clone(),
        source: e,
    })?;
    let config: TrainConfig =
        serde_json::from_value(v["config"].clone()).map_err(|e| EngineError::Json {
            path: sp.clone(),
            source: e,
        })?;
    let step = v["step"].as_u64().ok_or_else(|| EngineError::Checkpoint {
        path: dir.into(),
        msg: "trainer_state.json has no step".into(),
    })?;
    let model = Llama::load(dir, device, kind)?;
    let mut tr = Trainer::new(model, config);
    tr.step = step;
    let op = dir.join("optimizer.safetensors");
    let mut opt: HashMap<String, Tensor> = Tensor::read_safetensors(&op)
        .map_err(|e| EngineError::Safetensors {
            path: op.clone(),
            msg: e.to_string(),
        })?
        .into_iter()
        .collect();
    let mut take = |k: String| {
        opt.remove(&k).ok_or_else(|| EngineError::Checkpoint {
            path: dir.into(),
            msg: format!("optimizer.safetensors lacks `{k}`"),
        })
    };
    for ParamState {
        name, m, v, master, ..
    } in tr.state.iter_mut()
    {
        *m = take(format!("m.{name}"))?.to_device(device);
        *v = take(format!("v.{name}"))?.to_device(device);
        if master.is_some() {
            *master = Some(take(format!("w.{name}"))?.to_device(device));
        }
    }
    Ok(tr)
}
