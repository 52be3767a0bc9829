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
pub struct BenchEngineArgs {
    /// HF model directory (default: SmolLM2-135M imported from the virtualenv's GGUF).
    #[arg(long)]
    pub model_dir: Option<std::path::PathBuf>,
    /// libtorch threads, for yatt and for the reference alike.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
    /// Generation batch sizes.
    #[arg(long, value_delimiter = ',', default_values_t = [16usize, 64])]
    pub batches: Vec<usize>,
    /// New tokens per sample.
    #[arg(long, default_value_t = 64)]
    pub new_tokens: usize,
    /// Skip the HF transformers / PyTorch reference runs.
    #[arg(long)]
    pub no_reference: bool,
    /// Skip the long-tail continuous-vs-static case.
    #[arg(long)]
    pub no_long_tail: bool,
    /// Skip the training-step case.
    #[arg(long)]
    pub no_train: bool,
    /// Requests in the long-tail case.
    #[arg(long, default_value_t = 64)]
    pub long_tail_requests: usize,
    /// Training batch size.
    #[arg(long, default_value_t = 8)]
    pub train_batch: usize,
    /// Training sequence length.
    #[arg(long, default_value_t = 128)]
    pub train_seq: usize,
    /// Also time a LoRA training step of this rank (every linear layer), its steps
    /// alternating with the full one's (0: skip).
    #[arg(long, default_value_t = 0)]
    pub lora_rank: i64,
    /// Rounds of the generation comparison (alternating yatt / reference; best of each).
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Prefill every prompt in full in yatt (no prefix sharing), for an ablation.
    #[arg(long)]
    pub no_prefix_sharing: bool,
    /// Replace the `## Engine` section of this markdown file with the results.
    #[arg(long)]
    pub write_docs: Option<std::path::PathBuf>,
}

pub fn import_gguf(args: ImportGgufArgs) -> anyhow::Result<()> {
    let opts = yatt_engine::gguf::ImportOptions {
        dtype: if args.bf16 {
            yatt_engine::gguf::ImportDtype::Bf16
        } else {
            yatt_engine::gguf::ImportDtype::F32
        },
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

pub fn bench_engine(args: BenchEngineArgs) -> anyhow::Result<()> {
    let model_dir = match args.model_dir {
        Some(d) => d,
        None => yatt_engine::fixtures::smollm2_hf_dir()
            .context("importing the SmolLM2 GGUF for the benchmark")?,
    };
    let opts = yatt_engine::bench::BenchOptions {
        model_dir: model_dir.clone(),
        threads: args.threads,
        batches: args.batches,
        new_tokens: args.new_tokens,
        with_reference: !args.no_reference,
        long_tail: !args.no_long_tail,
        train: !args.no_train,
        long_tail_requests: args.long_tail_requests,
        train_batch: args.train_batch,
        train_seq: args.train_seq,
        lora_rank: args.lora_rank,
        rounds: args.rounds,
        prefix_sharing: !args.no_prefix_sharing,
    };
    let rows = yatt_engine::bench::run(&opts)?;
    let table = yatt_engine::bench::markdown_table(&rows);
    println!("{table}");
    if let Some(path) = args.write_docs {
        let cmd: Vec<String> = std::env::args().collect();
        let section = format!(
            "## Engine\n\nMachine: 2-core CI-class x86-64 VM, no GPU. Date: 2026-11-21. Model: SmolLM2-135M-Instruct \
             (imported from the Q4_1 GGUF, run in f32), {} threads for yatt and for the reference, measured one after the \
             other in a single run of\n\n```\n{}\n```\n\n{}\n",
            opts.threads,
            cmd.join(" "),
            table
        );
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::write(&path, replace_section(&old, &section))
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote the Engine section of {}", path.display());
    }
    Ok(())
}

/// Replaces the `## Engine` section (up to the next `## ` heading) or appends it.
fn replace_section(doc: &str, section: &str) -> String {
    let lines: Vec<&str> = doc.lines().collect();
    let Some(start) = lines.iter().position(|l| l.trim_end() == "## Engine") else {
        let mut s = doc.to_string();
        if s.is_empty() {
            s.push_str("# Benchmarks\n\n");
        } else if !s.ends_with("\n\n") {
            s.push('\n');
        }
        s.push_str(section);
        return s;
    };
    let end = lines[start + 1..]
        .iter()
        .position(|l| l.starts_with("## "))
        .map(|i| start + 1 + i)
        .unwrap_or(lines.len());
    let mut out: Vec<String> = lines[..start].iter().map(|s| s.to_string()).collect();
    out.push(section.trim_end().to_string());
    out.push(String::new());
    out.extend(lines[end..].iter().map(|s| s.to_string()));
    out.join("\n") + "\n"
}
