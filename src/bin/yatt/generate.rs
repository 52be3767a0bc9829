//! `yatt generate MODEL`: ask a model something from the command line, before and after
//! training. A thin shell over `yatt_engine::Generator`.

use anyhow::{bail, Context};
use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use yatt_engine::tch::{Device, Kind};
use yatt_engine::{
    AdapterDir, ChatMessage, FinishReason, Generator, GeneratorConfig, Llama, Request,
    SamplingParams, Tokenizer,
};

#[derive(clap::Args)]
pub struct GenerateArgs {
    /// An HF-style model directory (a checkpoint, an imported GGUF, a PEFT LoRA adapter
    /// directory over its base) or a `.gguf` file,
    /// imported into a temporary directory first.
    pub model: PathBuf,
    /// A prompt (repeatable). Without any, prompts are read from stdin, one per line.
    #[arg(long = "prompt", short = 'p')]
    pub prompts: Vec<String>,
    /// Wrap each prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    /// Greedy decoding (the default is sampling at --temperature).
    #[arg(long, conflicts_with_all = ["temperature", "top_p", "top_k", "seed"])]
    pub greedy: bool,
    /// Sampling temperature (> 0).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    /// Nucleus sampling: keep the most likely tokens up to this probability mass (0, 1].
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Keep only the k most likely tokens (0: no limit).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Seed of the sampling stream (prompt i uses seed + i).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Most tokens generated per prompt.
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// One JSON object per prompt (`prompt`, `text`, `token_ids`, `finish`) instead of text.
    #[arg(long)]
    pub json: bool,
    /// libtorch threads.
    #[arg(long, default_value_t = 2)]
    pub threads: usize,
}

/// The model directory: `model` itself, or a `.gguf` file imported into a temp dir
/// (removed when the returned guard drops).
fn model_dir(model: &Path) -> anyhow::Result<(PathBuf, Option<tempfile::TempDir>)> {
    if model.is_dir() {
        return Ok((model.to_path_buf(), None));
    }
    if !model.exists() {
        bail!(
            "{}: no such file or directory; MODEL is an HF model directory (config.json, \
             model.safetensors, tokenizer.json) or a .gguf file",
            model.display()
        );
    }
    if model.extension().and_then(|e| e.to_str()) != Some("gguf") {
        bail!(
            "{} is a file but not a .gguf: MODEL is an HF model directory or a .gguf file",
            model.display()
        );
    }
    let tmp = tempfile::Builder::new()
        .prefix("yatt-generate-")
        .tempdir()
        .context("creating a directory to import the GGUF into")?;
    yatt_engine::gguf::import_gguf(model, tmp.path(), &Default::default())
        .with_context(|| format!("importing {}", model.display()))?;
    Ok((tmp.path().to_path_buf(), Some(tmp)))
}

fn read_prompts(args: &GenerateArgs) -> anyhow::Result<Vec<String>> {
    if !args.prompts.is_empty() {
        return Ok(args.prompts.clone());
    }
    let mut out = vec![];
    for line in std::io::stdin().lock().lines() {
        let line = line.context("reading prompts from stdin")?;
        if !line.trim().is_empty() {
            out.push(line);
        }
    }
    if out.is_empty() {
        bail!("no prompts: pass --prompt TEXT (repeatable) or give one prompt per line on stdin");
    }
    Ok(out)
}

fn sampling(args: &GenerateArgs) -> anyhow::Result<SamplingParams> {
    if args.max_new_tokens == 0 {
        bail!("--max-new-tokens 0: expected at least 1");
    }
    if args.greedy {
        return Ok(SamplingParams::greedy(args.max_new_tokens));
    }
    if !(args.temperature.is_finite() && args.temperature > 0.0) {
        bail!(
            "--temperature {}: expected a positive number (use --greedy for greedy decoding)",
            args.temperature
        );
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p {}: expected a number in (0, 1]", args.top_p);
    }
    Ok(SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        max_new_tokens: args.max_new_tokens,
        seed: args.seed,
        ..Default::default()
    })
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let params = sampling(&args)?;
    let prompts = read_prompts(&args)?;
    let (dir, _imported) = model_dir(&args.model)?;
    yatt_engine::set_threads(args.threads);
    // A PEFT adapter directory often carries no tokenizer: its base model's serves.
    let tok_dir = if !dir.join("tokenizer.json").exists() && AdapterDir::is_adapter_dir(&dir) {
        AdapterDir::read(&dir)
            .with_context(|| format!("reading {}", args.model.display()))?
            .base
    } else {
        dir.clone()
    };
    let tok = Tokenizer::from_dir(&tok_dir)
        .with_context(|| format!("loading the tokenizer of {}", args.model.display()))?;
    if args.chat && tok.chat_template().is_none() {
        bail!(
            "--chat: {} carries no chat template (no `chat_template` in tokenizer_config.json, no chat_template.jinja); drop --chat",
            args.model.display()
        );
    }
    let model = Llama::load(&dir, Device::Cpu, Kind::Float)
        .with_context(|| format!("loading {}", args.model.display()))?;
    let max_pos = model.config.max_position_embeddings as usize;
    let mut requests = Vec::with_capacity(prompts.len());
    for (i, p) in prompts.iter().enumerate() {
        let ids = if args.chat {
            tok.encode_chat(&[ChatMessage::new("user", p)], true)?
        } else {
            tok.encode(p, true)?
        };
        if ids.is_empty() {
            bail!("prompt {} ({p:?}) encodes to no tokens", i + 1);
        }
        if ids.len() + args.max_new_tokens > max_pos {
            bail!(
                "prompt {} is {} tokens; with --max-new-tokens {} that exceeds the model's max_position_embeddings ({max_pos})",
                i + 1,
                ids.len(),
                args.max_new_tokens
            );
        }
        let mut params = params.clone();
        params.seed = params.seed.wrapping_add(i as u64);
        requests.push(Request {
            id: i as u64,
            prompt: ids,
            params,
        });
    }
    let longest = requests.iter().map(|r| r.prompt.len()).max().unwrap_or(0);
    let tok = Arc::new(tok);
    let mut gen = Generator::new(
        model,
        GeneratorConfig {
            max_batch: requests.len().clamp(1, 16),
            max_seq_len: longest + args.max_new_tokens,
            ..Default::default()
        },
    )
    .with_tokenizer(tok.clone());
    let (mut done, _) = gen.generate(&requests)?;
    done.sort_by_key(|c| c.id);
    for c in &done {
        let i = c.id as usize;
        let text = tok.decode(&c.tokens, true)?;
        if args.json {
            let finish = match &c.finish {
                FinishReason::StopToken(_) | FinishReason::StopString(_) => "stop",
                FinishReason::Length => "length",
            };
            let line = serde_json::json!({
                "prompt": prompts[i], "text": text, "token_ids": c.tokens, "finish": finish,
            });
            println!("{line}");
        } else if done.len() == 1 {
            println!("{text}");
        } else {
            println!("[{}] {}\n{text}\n", i + 1, prompts[i]);
        }
    }
    Ok(())
}
