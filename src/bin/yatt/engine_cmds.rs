//! `yatt import-gguf` and `yatt bench engine`: thin shells over `yatt_engine`.

use anyhow::Context;

#[derive(clap::Args)]
pub struct ImportGgufArgs {
    /// The .gguf file to import.
    pub file: std::path::PathBuf,
    /// The HF-format directory to write (config.json, model.safetensors, tokenizer.json, ...).
    pub out_dir: std::path::PathBuf,
    /// Store the weights as bfloat16 instead of float32.
    #[arg(long)]
    pub bf16: bool,
}

#[derive(clap::Args)]
pub struct BenchEngineArgs {}

pub fn import_gguf(args: ImportGgufArgs) -> anyhow::Result<()> {
    let opts = yatt_engine::gguf::ImportOptions {
        dtype: if args.bf16 { yatt_engine::gguf::ImportDtype::Bf16 } else { yatt_engine::gguf::ImportDtype::F32 },
    };
    let t = std::time::Instant::now();
    let r = yatt_engine::gguf::import_gguf(&args.file, &args.out_dir, &opts)
        .with_context(|| format!("importing {}", args.file.display()))?;
    println!(
        "imported {} ({}): {} tensors, {} parameters, source types {:?} -> {} in {:.1}s",
        args.file.display(),
        r.architecture,
        r.tensors,
        r.parameters,
        r.source_types,
        r.out_dir.display(),
        t.elapsed().as_secs_f64()
    );
    Ok(())
}

pub fn bench_engine(_args: BenchEngineArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench engine is not built yet")
}
