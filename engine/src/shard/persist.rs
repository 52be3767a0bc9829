//! Sharded checkpoints: every rank writes its own shard of each unit (f32 master
//! weights and both AdamW moments) in parallel, into a temporary sibling that is renamed
//! into place once all have written (a crash never leaves half a checkpoint). Loading
//! with another rank count reshards each unit on the way in, reading only the old
//! shards the new one overlaps; [`merge_sharded_checkpoint`] writes one HF directory.
//!
//! Layout of `DIR`: `sharded_state.json` (format, step, rank count, optimizer settings,
//! unit sizes), `config.json` (the model's HF config), the tokenizer files, and
//! `shard-RRRRR-of-NNNNN.safetensors` per rank with `master.UNIT`, `m.UNIT`, `v.UNIT`.

use super::group::{ReduceOp, ShardGroup};
use super::layout::{model_layout_with_head, reshard, UnitLayout};
use super::trainer::{check_world, decay_ranges, ShardedTrainer, UnitState};
use crate::checkpoint::{copy_tokenizer_files, save_pretrained, write_safetensors};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::{HeadShape, Llama};
use crate::train::TrainConfig;
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use tch::{Device, Kind, Tensor};

const FORMAT: &str = "yatt-sharded-v1";
const STATE: &str = "sharded_state.json";

fn shard_file(dir: &Path, rank: usize, world: usize) -> PathBuf {
    dir.join(format!("shard-{rank:05}-of-{world:05}.safetensors"))
}

fn partial(dir: &Path) -> PathBuf {
    dir.with_extension("partial")
}

/// Whether `dir` holds a sharded checkpoint.
pub fn is_sharded_checkpoint(dir: &Path) -> bool {
    dir.join(STATE).exists()
}

impl ShardedTrainer {
    /// Writes this rank's shard, and with the others (a collective: every rank calls
    /// it) the whole checkpoint, to `dir`. `tokenizer_from`: where rank 0 copies the
    /// tokenizer files from.
    pub fn save_sharded(&mut self, dir: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
        if self.is_frozen() {
            return Err(EngineError::InvalidArgument(
                "a frozen sharded model (a reference) writes no training checkpoint".into(),
            ));
        }
        let (rank, _) = self.rank();
        let tmp = partial(dir);
        if rank == 0 {
            let _ = std::fs::remove_dir_all(&tmp);
        }
        // Rank 0 clears the temporary directory before anyone writes into it.
        self.group.all_reduce(&mut [0.0], ReduceOp::Sum)?;
        let written = self.write_own(&tmp, tokenizer_from);
        let mut failed = [f64::from(u8::from(written.is_err()))];
        self.group.all_reduce(&mut failed, ReduceOp::Sum)?;
        written?;
        if failed[0] > 0.0 {
            return Err(EngineError::Checkpoint {
                path: dir.into(),
                msg: format!(
                    "{} rank(s) failed to write their shard; the previous checkpoint is kept",
                    failed[0]
                ),
            });
        }
        let renamed = match rank {
            0 => {
                let _ = std::fs::remove_dir_all(dir);
                std::fs::rename(&tmp, dir).map_err(|e| EngineError::io("renaming into", dir, e))
            }
            _ => Ok(()),
        };
        // No rank returns before the checkpoint is in place.
        let mut failed = [f64::from(u8::from(renamed.is_err()))];
        self.group.all_reduce(&mut failed, ReduceOp::Sum)?;
        renamed?;
        if failed[0] > 0.0 {
            return Err(EngineError::Checkpoint {
                path: dir.into(),
                msg: "rank 0 could not move the checkpoint into place".into(),
            });
        }
        Ok(())
    }

    fn write_own(&self, tmp: &Path, tokenizer_from: Option<&Path>) -> Result<()> {
        let (rank, world) = self.rank();
        std::fs::create_dir_all(tmp).map_err(|e| EngineError::io("creating", tmp, e))?;
        let mut named = Vec::with_capacity(3 * self.layout.len());
        for (ul, s) in self.layout.iter().zip(&self.state) {
            named.push((format!("master.{}", ul.unit), s.master.shallow_clone()));
            named.push((format!("m.{}", ul.unit), s.m.shallow_clone()));
            named.push((format!("v.{}", ul.unit), s.v.shallow_clone()));
        }
        write_safetensors(&shard_file(tmp, rank, world), &named)?;
        if rank != 0 {
            return Ok(());
        }
        let state = json!({
            "format": FORMAT,
            "step": self.step,
            "world": world,
            "config": self.config,
            "kind": format!("{:?}", self.model.kind()),
            "scalar_head": self.model.head_shape(),
            "units": self.layout.iter().map(|u| json!({"unit": u.unit.to_string(), "numel": u.numel})).collect::<Vec<_>>(),
        });
        write_json(&tmp.join(STATE), &state)?;
        write_json(&tmp.join("config.json"), &self.model.config.raw)?;
        if let Some(src) = tokenizer_from {
            copy_tokenizer_files(src, tmp)?;
        }
        Ok(())
    }

    /// Loads a sharded checkpoint onto this rank of `group`, whatever rank count wrote
    /// it: each unit is resharded from the old shards it overlaps. The model computes
    /// in `kind` on `device`; the state stays f32.
    pub fn load_sharded(
        dir: &Path,
        device: Device,
        kind: Kind,
        group: Box<dyn ShardGroup>,
    ) -> Result<Self> {
        let saved = SavedState::read(dir)?;
        let (rank, world) = (group.rank(), group.world());
        check_world(&saved.layout, world)?;
        let mut files = ShardFiles::open(dir, saved.world)?;
        let mut state = Vec::with_capacity(saved.layout.len());
        for ul in &saved.layout {
            let mut part = |what: &str| {
                let name = format!("{what}.{}", ul.unit);
                reshard(ul.numel, saved.world, |r| files.read(r, &name), rank, world)
                    .map(|t| t.to_device(device))
            };
            let mut s = UnitState::new(
                part("master")?,
                decay_ranges(ul, &saved.config, rank, world),
            );
            s.m = part("m")?;
            s.v = part("v")?;
            state.push(s);
        }
        let model = Llama::skeleton_with_head(saved.model, saved.head.as_ref(), device, kind);
        let mut tr = ShardedTrainer::assemble(model, saved.config, saved.layout, state, group)?;
        tr.step = saved.step;
        Ok(tr)
    }
}

/// Writes the f32 master weights of the sharded checkpoint `dir` as one HF model
/// directory `out` (config, `model.safetensors`, tokenizer files), loadable by
/// transformers. Holds the whole model in f32.
pub fn merge_sharded_checkpoint(dir: &Path, out: &Path) -> Result<()> {
    let model = load_sharded_weights(dir, Device::Cpu, Kind::Float)?;
    save_pretrained(&model, out, Some(dir))
}

/// The model of the sharded checkpoint `dir`, whole, on `device` in `kind` (its master
/// weights, without the optimizer state): for evaluating or serving a checkpoint
/// without merging it to disk first.
pub fn load_sharded_weights(dir: &Path, device: Device, kind: Kind) -> Result<Llama> {
    let saved = SavedState::read(dir)?;
    let mut files = ShardFiles::open(dir, saved.world)?;
    let mut model = Llama::skeleton_with_head(saved.model, saved.head.as_ref(), device, kind);
    for ul in &saved.layout {
        let name = format!("master.{}", ul.unit);
        let parts = (0..saved.world)
            .map(|r| files.read(r, &name))
            .collect::<Result<Vec<_>>>()?;
        ul.install(
            &mut model,
            &Tensor::cat(&parts, 0).to_device(device).to_kind(kind),
        );
    }
    Ok(model)
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v).expect("json"))
        .map_err(|e| EngineError::io("writing", path, e))
}

/// What `sharded_state.json` and `config.json` say.
struct SavedState {
    step: u64,
    world: usize,
    config: TrainConfig,
    model: ModelConfig,
    /// The scalar head (a critic's), if the model has one.
    head: Option<HeadShape>,
    layout: Vec<UnitLayout>,
}

impl SavedState {
    fn read(dir: &Path) -> Result<Self> {
        let bad = |msg: String| EngineError::Checkpoint {
            path: dir.into(),
            msg,
        };
        let p = dir.join(STATE);
        if !p.exists() {
            return Err(EngineError::Missing {
                what: STATE,
                path: p,
                hint: "not a sharded yatt checkpoint (an unsharded one loads with \
                       Trainer::load_checkpoint)",
            });
        }
        let v = read_json(&p)?;
        if v["format"] != FORMAT {
            return Err(bad(format!(
                "{STATE} has format {}, this yatt reads {FORMAT}",
                v["format"]
            )));
        }
        let model = ModelConfig::from_dir(dir)?;
        // Absent in checkpoints of language models written before critics were sharded.
        let head: Option<HeadShape> =
            serde_json::from_value(v["scalar_head"].clone()).map_err(|e| EngineError::Json {
                path: p.clone(),
                source: e,
            })?;
        let layout = model_layout_with_head(&model, head.as_ref());
        let units = v["units"].as_array().cloned().unwrap_or_default();
        let agree = units.len() == layout.len()
            && units
                .iter()
                .zip(&layout)
                .all(|(u, l)| u["unit"] == l.unit.to_string() && u["numel"] == l.numel);
        if !agree {
            return Err(bad(format!(
                "{STATE}'s units do not match config.json's model (was config.json edited?)"
            )));
        }
        let config =
            serde_json::from_value(v["config"].clone()).map_err(|e| EngineError::Json {
                path: p.clone(),
                source: e,
            })?;
        Ok(SavedState {
            step: v["step"]
                .as_u64()
                .ok_or_else(|| bad(format!("{STATE} has no step")))?,
            world: v["world"]
                .as_u64()
                .filter(|&w| w > 0)
                .ok_or_else(|| bad(format!("{STATE} has no rank count `world`")))?
                as usize,
            config,
            model,
            head,
            layout,
        })
    }
}

fn read_json(p: &Path) -> Result<Value> {
    let s = std::fs::read_to_string(p).map_err(|e| EngineError::io("reading", p, e))?;
    serde_json::from_str(&s).map_err(|e| EngineError::Json {
        path: p.into(),
        source: e,
    })
}

/// The old ranks' shard files, mapped, read tensor by tensor.
struct ShardFiles {
    paths: Vec<PathBuf>,
    maps: Vec<memmap2::Mmap>,
}

impl ShardFiles {
    fn open(dir: &Path, world: usize) -> Result<Self> {
        let mut paths = Vec::with_capacity(world);
        let mut maps = Vec::with_capacity(world);
        for r in 0..world {
            let p = shard_file(dir, r, world);
            let f = std::fs::File::open(&p).map_err(|e| EngineError::io("opening", &p, e))?;
            // SAFETY: the checkpoint's files are not modified while it is read (saves go
            // to a sibling directory and are renamed into place).
            let m =
                unsafe { memmap2::Mmap::map(&f) }.map_err(|e| EngineError::io("mapping", &p, e))?;
            paths.push(p);
            maps.push(m);
        }
        Ok(ShardFiles { paths, maps })
    }

    fn read(&mut self, rank: usize, name: &str) -> Result<Tensor> {
        let p = &self.paths[rank];
        let bad = |msg: String| EngineError::Safetensors {
            path: p.clone(),
            msg,
        };
        let st = safetensors::SafeTensors::deserialize(&self.maps[rank])
            .map_err(|e| bad(e.to_string()))?;
        let view = st.tensor(name).map_err(|_| {
            bad(format!(
                "has no tensor `{name}` (a shard from another run?)"
            ))
        })?;
        if view.dtype() != safetensors::Dtype::F32 {
            return Err(bad(format!("`{name}` is {:?}, expected F32", view.dtype())));
        }
        let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
        Ok(Tensor::from_data_size(view.data(), &shape, Kind::Float))
    }
}
