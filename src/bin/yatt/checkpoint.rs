//! `yatt checkpoint merge`: a sharded checkpoint as one HF model directory.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};

#[derive(clap::Subcommand)]
pub enum CheckpointCommand {
    /// Merge a sharded checkpoint (each rank's shard of the f32 master weights) into
    /// one HF model directory (config.json, model.safetensors, tokenizer files) that
    /// transformers loads. SOURCE is the checkpoint, or a run directory whose latest
    /// sharded checkpoint is merged.
    Merge(MergeArgs),
}

#[derive(clap::Args)]
pub struct MergeArgs {
    /// A sharded checkpoint directory (it holds sharded_state.json), or a run
    /// directory holding such checkpoints.
    pub source: PathBuf,
    /// The HF model directory to write.
    pub out: PathBuf,
}

pub fn run(cmd: CheckpointCommand) -> Result<()> {
    match cmd {
        CheckpointCommand::Merge(a) => {
            let dir = latest_sharded(&a.source)?;
            yatt_engine::merge_sharded_checkpoint(&dir, &a.out)
                .with_context(|| format!("merging {}", dir.display()))?;
            println!("merged {} into {}", dir.display(), a.out.display());
            Ok(())
        }
    }
}

/// `source` itself when it is a sharded checkpoint, else the one with the highest step
/// found up to three levels below it.
fn latest_sharded(source: &Path) -> Result<PathBuf> {
    if !source.is_dir() {
        bail!("{} is not a directory", source.display());
    }
    if yatt_engine::is_sharded_checkpoint(source) {
        return Ok(source.to_path_buf());
    }
    let mut best: Option<(u64, PathBuf)> = None;
    let mut stack = vec![(source.to_path_buf(), 0)];
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if !p.is_dir() {
                continue;
            }
            if yatt_engine::is_sharded_checkpoint(&p) {
                let step = std::fs::read_to_string(p.join("sharded_state.json"))
                    .ok()
                    .and_then(|s| serde_json::from_str::<serde_json::Value>(&s).ok())
                    .and_then(|v| v["step"].as_u64())
                    .unwrap_or(0);
                if best.as_ref().is_none_or(|(b, _)| step > *b) {
                    best = Some((step, p));
                }
            } else if depth < 3 {
                stack.push((p, depth + 1));
            }
        }
    }
    match best {
        Some((_, p)) => Ok(p),
        None => bail!(
            "no sharded checkpoint in or under {} (a sharded checkpoint holds sharded_state.json; an unsharded one is already an HF model directory)",
            source.display()
        ),
    }
}
