//! `yatt import-gguf`, `yatt bench engine` and `yatt bench gpu`: thin shells over
//! `yatt_engine`.

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

/// Model shapes of `yatt bench gpu` (random weights).
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PresetArg {
    /// The engine's 2-layer tiny test model (CPU tests).
    Tiny,
    /// SmolLM2-135M's shape (hidden 576, 30 layers, 9/3 heads, vocab 49152, tied).
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    /// Llama-3.2-1B-like (hidden 2048, 16 layers, 32/8 heads, MLP 8192), vocab 32000.
    #[value(name = "llama-1b")]
    Llama1b,
    /// Qwen3-1.7B's shape (hidden 2048, 28 layers, 16/8 heads of 128, vocab 151936).
    #[value(name = "qwen3-1.7b")]
    Qwen3_1_7b,
}

impl From<PresetArg> for yatt_engine::bench::Preset {
    fn from(p: PresetArg) -> Self {
        use yatt_engine::bench::Preset;
        match p {
            PresetArg::Tiny => Preset::Tiny,
            PresetArg::Smollm2_135m => Preset::Smollm2_135m,
            PresetArg::Llama1b => Preset::Llama1b,
            PresetArg::Qwen3_1_7b => Preset::Qwen3_1_7b,
        }
    }
}

#[derive(clap::Args)]
pub struct BenchGpuArgs {
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu", value_parser = yatt_engine::parse_device)]
    pub device: yatt_engine::tch::Device,
    /// Model and matmul dtype: f32, bf16 or f16.
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: yatt_engine::tch::Kind,
    /// Model shape (random weights).
    #[arg(long, value_enum, default_value = "smollm2-135m")]
    pub preset: PresetArg,
    /// Decode batch (batch 1 is measured too).
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Prompt length (random ids).
    #[arg(long, default_value_t = 128)]
    pub prompt_len: usize,
    /// New tokens per request.
    #[arg(long, default_value_t = 128)]
    pub new_tokens: usize,
    /// Training batch.
    #[arg(long, default_value_t = 8)]
    pub train_batch: usize,
    /// Training sequence length.
    #[arg(long, default_value_t = 1024)]
    pub train_seq: usize,
    /// Timed training steps (after one warm-up step).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Datasheet peak TFLOP/s for the dtype, for `mfu_datasheet` (default on CUDA in
    /// bf16/f16: 989, the H100/H200 SXM dense figure; on the CPU none is reported).
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// libtorch threads (0: libtorch's default).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Write the figures as JSON here.
    #[arg(long)]
    pub json: Option<std::path::PathBuf>,
    /// Write the figures as a markdown table here.
    #[arg(long)]
    pub markdown: Option<std::path::PathBuf>,
}

fn parse_dtype(s: &str) -> Result<yatt_engine::tch::Kind, String> {
    yatt_engine::parse_kind(s).ok_or_else(|| format!("unknown dtype `{s}`; use f32, bf16 or f16"))
}

pub fn bench_gpu(args: BenchGpuArgs) -> anyhow::Result<()> {
    yatt_engine::set_threads(args.threads);
    let opts = yatt_engine::bench::RooflineOptions {
        device: args.device,
        kind: args.dtype,
        preset: args.preset.into(),
        batch: args.batch,
        prompt_len: args.prompt_len,
        new_tokens: args.new_tokens,
        train_batch: args.train_batch,
        train_seq: args.train_seq,
        steps: args.steps,
        peak_tflops: args.peak_tflops,
    };
    let report = yatt_engine::bench::run_roofline(&opts)?;
    let table = report.markdown();
    println!("{table}");
    let v = report.to_json();
    if let Some(path) = &args.json {
        std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(path) = &args.markdown {
        std::fs::write(path, &table).with_context(|| format!("writing {}", path.display()))?;
    }
    if let Some(f) = v["failures"].as_array().filter(|f| !f.is_empty()) {
        anyhow::bail!("{} case(s) failed: {f:?}", f.len());
    }
    Ok(())
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
