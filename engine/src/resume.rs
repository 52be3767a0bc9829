//! Resumable training checkpoints: the HF export of `checkpoint.rs` plus
//! `optimizer.safetensors` (AdamW moments and f32 master weights) and
//! `trainer_state.json` (step, settings), so a run resumes exactly. Kept apart from
//! `train.rs` so the trainer does not depend on its own persistence.

use crate::checkpoint::{
    copy_tokenizer_files, save_model_files, save_pretrained, write_safetensors,
};
use crate::error::{EngineError, Result};
use crate::model::Llama;
use crate::train::{ParamState, TrainConfig, Trainer};
use serde_json::json;
use std::collections::HashMap;
use std::path::Path;
use tch::{Device, Kind, Tensor};

impl Trainer {
    /// Saves an HF-loadable model plus optimizer and step state.
    pub fn save_checkpoint(
        &self,
        dir: impl AsRef<Path>,
        tokenizer_from: Option<&Path>,
    ) -> Result<()> {
        self.check_resident()?;
        save_trainer(self, dir.as_ref(), tokenizer_from)
    }

    /// Loads a checkpoint written by [`Trainer::save_checkpoint`] and resumes exactly.
    pub fn load_checkpoint(dir: impl AsRef<Path>, device: Device, kind: Kind) -> Result<Trainer> {
        load_trainer(dir.as_ref(), device, kind)
    }
}

fn save_trainer(tr: &Trainer, dir: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
    // Write into a temporary sibling and rename, so a crash never leaves half a checkpoint.
    let tmp = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&tmp);
    match tr.model.lora() {
        None => save_pretrained(&tr.model, &tmp, tokenizer_from)?,
        // PEFT's layout: the adapters, and where the frozen base is. A base of unknown
        // origin (built in memory) is stored beside them.
        Some(ad) => {
            let base = match &ad.base_path {
                Some(p) => p.display().to_string(),
                None => {
                    save_model_files(&tr.model, tr.model.hf_named_tensors(), &tmp, None)?;
                    ".".to_string()
                }
            };
            tr.model.save_adapter(&tmp, &base)?;
            if let Some(src) = tokenizer_from {
                copy_tokenizer_files(src, &tmp)?;
            }
        }
    }
    let mut opt = Vec::new();
    for s in &tr.state {
        opt.push((format!("m.{}", s.name), s.m.shallow_clone()));
        opt.push((format!("v.{}", s.name), s.v.shallow_clone()));
        if let Some(w) = &s.master {
            opt.push((format!("w.{}", s.name), w.shallow_clone()));
        }
    }
    write_safetensors(&tmp.join("optimizer.safetensors"), &opt)?;
    let state = json!({
        "step": tr.step,
        "config": tr.config,
        "format": "yatt-trainer-v1",
        "head": tr.model.head.as_ref().map(|h| h.prefix.clone()),
        "lora": tr.model.lora().map(|a| &a.config),
    });
    let p = tmp.join("trainer_state.json");
    std::fs::write(&p, serde_json::to_string_pretty(&state).expect("json"))
        .map_err(|e| EngineError::io("writing", &p, e))?;
    let _ = std::fs::remove_dir_all(dir);
    std::fs::rename(&tmp, dir).map_err(|e| EngineError::io("renaming into", dir, e))
}

fn load_trainer(dir: &Path, device: Device, kind: Kind) -> Result<Trainer> {
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
    // A LoRA checkpoint resumes with its adapters apart (trainable), not folded in.
    let model = if v["lora"].is_null() {
        Llama::load(dir, device, kind)?
    } else {
        Llama::load_with_adapter(dir, device, kind)?
    };
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
