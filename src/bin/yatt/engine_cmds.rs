//! `yatt import-gguf` and `yatt bench engine`: thin shells over `yatt_engine`.

#[derive(clap::Args)]
pub struct ImportGgufArgs {
    /// The .gguf file to import.
    pub file: std::path::PathBuf,
    /// The HF-format directory to write (config.json, model.safetensors, tokenizer.json, ...).
    pub out_dir: std::path::PathBuf,
}

#[derive(clap::Args)]
pub struct BenchEngineArgs {}

pub fn import_gguf(_args: ImportGgufArgs) -> anyhow::Result<()> {
    anyhow::bail!("import-gguf is not built yet")
}

pub fn bench_engine(_args: BenchEngineArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench engine is not built yet")
}
