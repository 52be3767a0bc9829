//! `yatt bench gpu`: where the engine stands against the device's own limits, all
//! measured in one run on one device: memory bandwidth (a large device-to-device copy),
//! matmul throughput, decode (response tokens/s and the fraction of the memory bandwidth a
//! decode step uses) and a training step (tokens/s and model FLOPs utilisation).
//!
//! The models are random ([`Llama::random`] on an in-code shape): the GPU machine this is
//! written for cannot be given weights, and speed does not depend on the values.
//!
//! Each case runs under `catch_unwind`: tch's infallible methods panic on a libtorch error
//! (CUDA out of memory, say), and a failed case is reported as `failed: ...` while the
//! others still run.

use super::compare::{mean_nll, random_train_batch, train_config};
use crate::config::{tiny_config, ModelConfig};
use crate::error::{EngineError, Result};
use crate::generate::{Generator, GeneratorConfig, Request, RequestRng, SamplingParams};
use crate::model::Llama;
use crate::schedule::BatchingMode;
use crate::train::Trainer;
use serde_json::{json, Value};
use std::time::Instant;
use tch::{Device, Kind, Tensor};

/// The model shapes the benchmark builds (random weights).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// The engine's [`tiny_config`] (2 layers, hidden 64): for tests on the CPU.
    Tiny,
    /// SmolLM2-135M's shape: hidden 576, 30 layers, 9 heads (3 KV), MLP 1536, vocab
    /// 49152, tied embeddings.
    Smollm2_135m,
    /// Llama-3.2-1B-like: hidden 2048, 16 layers, 32 heads (8 KV), MLP 8192, untied, but
    /// vocab 32000 instead of 128256 (keeps the training step's f32 logits small).
    Llama1b,
    /// Qwen3-1.7B's shape: hidden 2048, 28 layers, 16 heads (8 KV) of width 128, MLP
    /// 6144, q/k norms, vocab 151936, tied embeddings.
    Qwen3_1_7b,
}

impl Preset {
    /// The CLI name.
    pub fn name(self) -> &'static str {
        match self {
            Preset::Tiny => "tiny",
            Preset::Smollm2_135m => "smollm2-135m",
            Preset::Llama1b => "llama-1b",
            Preset::Qwen3_1_7b => "qwen3-1.7b",
        }
    }

    /// The model config (through `config.json`'s fields, like a loaded model's).
    pub fn config(self) -> Result<ModelConfig> {
        // (hidden, MLP, layers, heads, KV heads, vocab, rope theta, tied embeddings)
        let (h, f, l, nh, nkv, v, theta, tied) = match self {
            Preset::Tiny => return Ok(tiny_config()),
            Preset::Smollm2_135m => (576, 1536, 30, 9, 3, 49152, 1e5, true),
            Preset::Llama1b => (2048, 8192, 16, 32, 8, 32000, 5e5, false),
            Preset::Qwen3_1_7b => (2048, 6144, 28, 16, 8, 151936, 1e6, true),
        };
        let mut raw = json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
            "intermediate_size": f, "num_hidden_layers": l, "num_attention_heads": nh,
            "num_key_value_heads": nkv, "vocab_size": v, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": theta, "tie_word_embeddings": tied,
            "eos_token_id": 2, "bos_token_id": 1, "hidden_act": "silu"
        });
        if self == Preset::Qwen3_1_7b {
            // Qwen3: q/k norms (from the model type) and heads of 128, not hidden / heads.
            raw["architectures"] = json!(["Qwen3ForCausalLM"]);
            raw["model_type"] = json!("qwen3");
            raw["head_dim"] = json!(128);
            raw["rms_norm_eps"] = json!(1e-6);
        }
        ModelConfig::from_json(&raw).map_err(EngineError::InvalidArgument)
    }
}

/// What `yatt bench gpu` runs.
#[derive(Debug, Clone)]
pub struct RooflineOptions {
    /// The device every case runs on.
    pub device: Device,
    /// Model and matmul dtype.
    pub kind: Kind,
    /// Model shape.
    pub preset: Preset,
    /// Decode batch (a batch-1 run is measured as well).
    pub batch: usize,
    /// Prompt length of every decode request (random ids).
    pub prompt_len: usize,
    /// New tokens per decode request.
    pub new_tokens: usize,
    /// Training batch.
    pub train_batch: usize,
    /// Training sequence length.
    pub train_seq: usize,
    /// Timed training steps (after one warm-up step).
    pub steps: usize,
    /// The device's datasheet peak for `kind`, in TFLOP/s, for `mfu_datasheet` (`None`:
    /// 989 for bf16/f16 on CUDA, the H100/H200 SXM dense figure; none otherwise).
    pub peak_tflops: Option<f64>,
}

/// A case's outcome: its figures, or why it failed.
pub type Case = std::result::Result<Value, String>;

/// Everything one run measured.
#[derive(Debug, Clone)]
pub struct RooflineReport {
    /// What ran where: device, device_name, dtype, preset, parameter counts.
    pub header: Value,
    /// Device-to-device copy bandwidth.
    pub copy: Case,
    /// Matmul throughput.
    pub matmul: Case,
    /// Decode at `--batch`.
    pub decode: Case,
    /// Decode at batch 1.
    pub decode_b1: Case,
    /// Decode at `--batch` without CUDA graphs (CUDA only: the eager path, side by side).
    pub decode_eager: Option<Case>,
    /// Training step.
    pub train: Case,
}

/// The dtype's CLI name.
pub fn kind_name(k: Kind) -> &'static str {
    match k {
        Kind::Float => "f32",
        Kind::BFloat16 => "bf16",
        Kind::Half => "f16",
        _ => "other",
    }
}

fn sync(device: Device) {
    if let Device::Cuda(i) = device {
        tch::Cuda::synchronize(i as i64);
    }
}

/// The device's name: the CPU model from /proc/cpuinfo, or the GPU's from `nvidia-smi`
/// (libtorch has no device-name call in tch), else `cuda:N`.
pub fn device_name(device: Device) -> String {
    match device {
        Device::Cuda(i) => nvidia_smi("name")
            .and_then(|l| l.get(i).cloned())
            .unwrap_or_else(|| format!("cuda:{i}")),
        _ => std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|n| n.trim().to_string())
            })
            .unwrap_or_else(|| "cpu".into()),
    }
}

/// One `nvidia-smi --query-gpu=FIELD` line per GPU, when nvidia-smi runs.
fn nvidia_smi(field: &str) -> Option<Vec<String>> {
    let out = std::process::Command::new("nvidia-smi")
        .args([
            &format!("--query-gpu={field}"),
            "--format=csv,noheader,nounits",
        ])
        .output()
        .ok()?;
    out.status.success().then(|| {
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| l.trim().to_string())
            .collect()
    })
}

/// GPU memory in use (MiB) per `nvidia-smi`: libtorch's caching allocator keeps what it
/// reserved, so after a case this is about the case's peak reservation plus the CUDA
/// context. tch exposes no allocator statistics, hence the detour. `None` on the CPU.
fn gpu_mem_used_mib(device: Device) -> Option<f64> {
    match device {
        Device::Cuda(i) => nvidia_smi("memory.used")?.get(i)?.parse().ok(),
        _ => None,
    }
}

/// Runs a case, turning a returned error or a panic (tch's infallible calls panic on a
/// libtorch error, e.g. CUDA out of memory) into `Err("failed: ...")`.
fn guarded(name: &str, device: Device, f: impl FnOnce() -> Result<Value>) -> Case {
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let out = match r {
        Ok(Ok(mut v)) => {
            if let Some(m) = gpu_mem_used_mib(device) {
                v["gpu_mem_used_mib"] = json!(m);
            }
            Ok(v)
        }
        Ok(Err(e)) => Err(format!("failed: {e}")),
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "panic".into());
            // The first line carries the libtorch message; the rest is its C++ backtrace.
            Err(format!("failed: {}", msg.lines().next().unwrap_or("")))
        }
    };
    match &out {
        Ok(v) => eprintln!("{name}: {v}"),
        Err(e) => eprintln!("{name}: {e}"),
    }
    out
}

/// Best (smallest) seconds of `samples` timings of `reps` calls of `f`, after one warm-up.
fn best_of(
    device: Device,
    samples: usize,
    reps: usize,
    mut f: impl FnMut() -> Result<()>,
) -> Result<f64> {
    f()?;
    sync(device);
    let mut best = f64::INFINITY;
    for _ in 0..samples {
        sync(device);
        let t0 = Instant::now();
        for _ in 0..reps {
            f()?;
        }
        sync(device);
        best = best.min(t0.elapsed().as_secs_f64() / reps as f64);
    }
    Ok(best)
}

/// Copy bandwidth in GB/s: bytes read + written by one `copy_` of 1 GiB (128 MiB on the
/// CPU) divided by its best time.
fn copy_case(device: Device, kind: Kind) -> Result<Value> {
    let bytes: i64 = if device.is_cuda() { 1 << 30 } else { 128 << 20 };
    let n = bytes / kind.elt_size_in_bytes() as i64;
    let src = Tensor::f_ones([n], (kind, device))?;
    let mut dst = Tensor::f_empty([n], (kind, device))?;
    let reps = if device.is_cuda() { 10 } else { 1 };
    let s = best_of(device, 5, reps, || Ok(dst.f_copy_(&src)?))?;
    let gbps = 2.0 * bytes as f64 / s / 1e9;
    Ok(json!({"copy_gbps": gbps, "copy_bytes": bytes, "copy_ms": s * 1e3}))
}

/// Matmul TFLOP/s of an n×n×n product in `kind` (n = 8192 on CUDA, 1024 on the CPU).
fn matmul_case(device: Device, kind: Kind) -> Result<Value> {
    let n: i64 = if device.is_cuda() { 8192 } else { 1024 };
    let a = Tensor::f_randn([n, n], (kind, device))?;
    let b = Tensor::f_randn([n, n], (kind, device))?;
    let reps = if device.is_cuda() { 10 } else { 1 };
    let s = best_of(device, 5, reps, || {
        let _ = a.f_matmul(&b)?;
        Ok(())
    })?;
    let tflops = 2.0 * (n as f64).powi(3) / s / 1e12;
    Ok(json!({"matmul_tflops": tflops, "matmul_n": n, "matmul_ms": s * 1e3}))
}

/// Parameter counts: all, and the matmul weights a decode step or a training step runs
/// through (every layer's projections and the LM head; not the embedding lookup, nor the
/// norms). With tied embeddings the LM head is the embedding matrix.
#[derive(Debug, Clone, Copy)]
struct Counts {
    total: i64,
    matmul: i64,
}

fn counts(model: &mut Llama) -> Counts {
    let c = model.config.clone();
    let (h, hd, f) = (c.hidden_size, c.head_dim, c.intermediate_size);
    let (nq, nkv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let per_layer = h * (nq + 2 * nkv) + nq * h + 3 * h * f;
    Counts {
        total: model.num_parameters(),
        matmul: c.num_hidden_layers * per_layer + c.vocab_size * h,
    }
}

/// Random prompts of `len` ids (ids 3.. so no special token of the presets).
fn prompts(n: usize, len: usize, vocab: i64, seed: u64) -> Vec<Vec<i64>> {
    let mut rng = RequestRng::new(seed);
    let span = (vocab - 3).max(1) as u64;
    (0..n)
        .map(|_| {
            (0..len)
                .map(|_| 3 + (rng.next_u64() % span) as i64)
                .collect()
        })
        .collect()
}

/// Decode at batch `b`: response tokens/s, the prefill time (a prefill-only call: one
/// new token comes from prefill's logits, so no decode step runs), the mean decode step
/// and the share of the copy bandwidth the step's compulsory reads would take.
fn decode_case(
    g: &mut Generator,
    opts: &RooflineOptions,
    b: usize,
    matmul_params: i64,
    copy_gbps: Option<f64>,
) -> Result<Value> {
    let device = opts.device;
    g.config_mut().max_batch = b;
    let ps = prompts(b, opts.prompt_len, g.model().config.vocab_size, 7);
    let reqs = |new: usize| -> Vec<Request> {
        ps.iter()
            .enumerate()
            .map(|(i, p)| Request {
                id: i as u64,
                prompt: p.clone(),
                params: SamplingParams {
                    temperature: 1.0,
                    top_k: 50,
                    max_new_tokens: new,
                    ignore_eos: true,
                    seed: i as u64,
                    ..Default::default()
                },
            })
            .collect()
    };
    // Warm-up at the timed length: the cache, kernels, the allocator's blocks for every
    // span, and the CUDA graphs of every (rows, span) bucket the timed run meets.
    g.generate(&reqs(opts.new_tokens))?;
    // Prefill alone, best of 3 (subtracted from the full run below).
    let mut prefill_s = f64::INFINITY;
    for _ in 0..3 {
        sync(device);
        let t0 = Instant::now();
        g.generate(&reqs(1))?;
        sync(device);
        prefill_s = prefill_s.min(t0.elapsed().as_secs_f64());
    }
    sync(device);
    let t0 = Instant::now();
    let (outs, st) = g.generate(&reqs(opts.new_tokens))?;
    sync(device);
    let total_s = t0.elapsed().as_secs_f64();
    let tokens: usize = outs.iter().map(|c| c.tokens.len()).sum();
    let steps = st.decode_steps.max(1);
    let step_s = ((total_s - prefill_s) / steps as f64).max(1e-9);
    // Compulsory reads of one step: every matmul weight once, and each row's keys and
    // values up to the mean context length over the steps.
    let c = &g.model().config;
    let elt = opts.kind.elt_size_in_bytes() as f64;
    let mean_ctx = opts.prompt_len as f64 + opts.new_tokens as f64 / 2.0;
    let kv = 2.0
        * (c.num_hidden_layers * c.num_key_value_heads * c.head_dim) as f64
        * mean_ctx
        * b as f64
        * elt;
    let bytes = matmul_params as f64 * elt + kv;
    let (recorded, replays, graph_failure) = g.cuda_graph_stats();
    let mut v = json!({
        "cuda_graphs": {"recorded": recorded, "replays": replays, "failure": graph_failure},
        "batch": b,
        "prompt_len": opts.prompt_len,
        "new_tokens": opts.new_tokens,
        "sampling": "T=1, top-k 50, ignore_eos",
        "tokens_per_s": tokens as f64 / total_s,
        "decode_tokens_per_s": (st.decode_steps * b) as f64 / (total_s - prefill_s).max(1e-9),
        "total_s": total_s,
        "prefill_s": prefill_s,
        "decode_steps": st.decode_steps,
        "step_ms": step_s * 1e3,
        "bytes_per_step": bytes,
        "kv_bytes_per_step": kv,
    });
    if let Some(gbps) = copy_gbps {
        v["hbm_fraction"] = json!(bytes / step_s / (gbps * 1e9));
    }
    if crate::profile::enabled() {
        // Where a decode step's time goes (YATT_PROFILE=1 waits for the device at every
        // mark, so the timed figures above are slowed too): ms per step by phase.
        crate::profile::take();
        let (_, st) = g.generate(&reqs(opts.new_tokens))?;
        v["profile"] = profile_phases(st.decode_steps);
    }
    Ok(v)
}

/// The phases [`crate::profile`] recorded since the last call, in ms per step.
fn profile_phases(steps: usize) -> Value {
    let steps = steps.max(1) as f64;
    let phases: serde_json::Map<String, Value> = crate::profile::take()
        .into_iter()
        .map(|(k, s, n)| {
            (
                k.to_string(),
                json!({"ms_per_step": s * 1e3 / steps, "marks": n}),
            )
        })
        .collect();
    Value::Object(phases)
}

/// A training step (fwd + bwd + clip + AdamW; f32 master weights when `kind` is not f32)
/// on random ids, loss = mean token NLL. FLOPs per token = 6·N_matmul + 12·L·(heads·
/// head_dim)·T (PaLM's count: the attention scores and values over the full T×T, though
/// causal attention needs half). N_matmul excludes the embedding lookup and the norms and
/// includes the LM head.
fn train_case(opts: &RooflineOptions, c: Counts, matmul_tflops: Option<f64>) -> Result<Value> {
    let (device, bsz, t) = (opts.device, opts.train_batch, opts.train_seq);
    let config = opts.preset.config()?;
    let model = Llama::random(config.clone(), device, opts.kind, 1)?;
    let mut tr = Trainer::new(model, train_config());
    let batch = random_train_batch(config.vocab_size, bsz, t, device)?;
    let loss = mean_nll;
    tr.step(std::slice::from_ref(&batch), loss)?; // warm-up
    sync(device);
    let steps = opts.steps.max(1);
    let t0 = Instant::now();
    let mut last = None;
    for _ in 0..steps {
        last = Some(tr.step(std::slice::from_ref(&batch), loss)?);
    }
    sync(device);
    let step_s = t0.elapsed().as_secs_f64() / steps as f64;
    let tps = (bsz * t) as f64 / step_s;
    let l = config.num_hidden_layers as f64;
    let q_width = (config.num_attention_heads * config.head_dim) as f64;
    let flops_per_token = 6.0 * c.matmul as f64 + 12.0 * l * q_width * t as f64;
    let achieved = flops_per_token * tps;
    let peak = opts.peak_tflops.or_else(|| {
        (device.is_cuda() && matches!(opts.kind, Kind::BFloat16 | Kind::Half)).then_some(989.0)
    });
    let resident = tr.resident_bytes();
    let loss = last.map(|s| s.loss);
    let mfu_measured = matmul_tflops.map(|m| achieved / (m * 1e12));
    // No datasheet figure on the CPU.
    let peak = peak.filter(|_| device.is_cuda());
    let mfu_datasheet = peak.map(|p| achieved / (p * 1e12));
    // Where a step's time goes (one more step, waiting for the device at each phase).
    let profile = crate::profile::enabled()
        .then(|| -> Result<Value> {
            crate::profile::take();
            tr.step(std::slice::from_ref(&batch), mean_nll)?;
            Ok(profile_phases(1))
        })
        .transpose()?;
    Ok(json!({
        "profile": profile,
        "batch": bsz,
        "seq": t,
        "steps": steps,
        "tokens_per_s": tps,
        "step_s": step_s,
        "loss": loss,
        "flops_per_token": flops_per_token,
        "achieved_tflops": achieved / 1e12,
        "mfu_measured": mfu_measured,
        "mfu_datasheet": mfu_datasheet,
        "peak_tflops": peak,
        "state_bytes": resident,
    }))
}

/// Runs every case, printing each figure to stderr as it is measured.
pub fn run(opts: &RooflineOptions) -> Result<RooflineReport> {
    let device = opts.device;
    if opts.batch == 0 || opts.prompt_len == 0 || opts.new_tokens == 0 {
        return Err(EngineError::InvalidArgument(
            "--batch, --prompt-len and --new-tokens must be positive".into(),
        ));
    }
    if opts.train_batch == 0 || opts.train_seq < 2 {
        return Err(EngineError::InvalidArgument(
            "--train-batch must be positive and --train-seq at least 2".into(),
        ));
    }
    let config = opts.preset.config()?;
    let max_len = (opts.prompt_len + opts.new_tokens + 8) as i64;
    let train_len = opts.train_seq as i64;
    if max_len > config.max_position_embeddings || train_len > config.max_position_embeddings {
        return Err(EngineError::InvalidArgument(format!(
            "preset {} has {} positions: lower --prompt-len + --new-tokens and --train-seq",
            opts.preset.name(),
            config.max_position_embeddings
        )));
    }
    let mut model = Llama::random(config, device, opts.kind, 0)?;
    let c = counts(&mut model);
    let header = json!({
        "device": match device {
            Device::Cuda(i) => format!("cuda:{i}"),
            _ => "cpu".to_string(),
        },
        "device_name": device_name(device),
        "dtype": kind_name(opts.kind),
        "preset": opts.preset.name(),
        "params": c.total,
        "params_matmul": c.matmul,
        "libtorch_threads": tch::get_num_threads(),
    });
    eprintln!("roofline: {header}");
    let copy = guarded("copy", device, || copy_case(device, opts.kind));
    let matmul = guarded("matmul", device, || matmul_case(device, opts.kind));
    let gbps = copy.as_ref().ok().and_then(|v| v["copy_gbps"].as_f64());
    let tflops = matmul
        .as_ref()
        .ok()
        .and_then(|v| v["matmul_tflops"].as_f64());
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: opts.batch,
            max_seq_len: max_len as usize,
            mode: BatchingMode::Continuous,
            max_prefill_batch: opts.batch,
            share_prefixes: false,
            kv_cache_bytes: None,
        },
    );
    let decode = guarded("decode", device, || {
        decode_case(&mut g, opts, opts.batch, c.matmul, gbps)
    });
    let decode_b1 = guarded("decode batch 1", device, || {
        decode_case(&mut g, opts, 1, c.matmul, gbps)
    });
    let decode_eager = matches!(device, Device::Cuda(_)).then(|| {
        g.set_cuda_graphs(false);
        let r = guarded("decode without CUDA graphs", device, || {
            decode_case(&mut g, opts, opts.batch, c.matmul, gbps)
        });
        g.set_cuda_graphs(true);
        r
    });
    drop(g);
    let train = guarded("train", device, || train_case(opts, c, tflops));
    Ok(RooflineReport {
        header,
        copy,
        matmul,
        decode,
        decode_b1,
        decode_eager,
        train,
    })
}

impl RooflineReport {
    /// The whole report as one JSON object: the header's fields, then `copy_gbps` and
    /// `matmul_tflops` at the top level, and `copy`, `matmul`, `decode`, `decode_b1`,
    /// `train` objects (a failed case: `{"failed": "..."}`).
    pub fn to_json(&self) -> Value {
        let mut v = self.header.clone();
        let case = |c: &Case| match c {
            Ok(x) => x.clone(),
            Err(e) => json!({ "failed": e }),
        };
        v["copy"] = case(&self.copy);
        v["matmul"] = case(&self.matmul);
        v["decode"] = case(&self.decode);
        v["decode_b1"] = case(&self.decode_b1);
        if let Some(c) = &self.decode_eager {
            v["decode_eager"] = case(c);
        }
        v["train"] = case(&self.train);
        v["copy_gbps"] = v["copy"]["copy_gbps"].clone();
        v["matmul_tflops"] = v["matmul"]["matmul_tflops"].clone();
        let failures: Vec<&String> = [
            &self.copy,
            &self.matmul,
            &self.decode,
            &self.decode_b1,
            &self.train,
        ]
        .into_iter()
        .chain(self.decode_eager.as_ref())
        .filter_map(|c| c.as_ref().err())
        .collect();
        v["failures"] = json!(failures);
        v
    }

    /// A markdown table: one row per figure, each with the device, dtype, preset and
    /// parameter count.
    pub fn markdown(&self) -> String {
        let h = &self.header;
        let who = format!(
            "{} | {} | {} | {:.1}M",
            h["device_name"].as_str().unwrap_or("?"),
            h["dtype"].as_str().unwrap_or("?"),
            h["preset"].as_str().unwrap_or("?"),
            h["params"].as_f64().unwrap_or(0.0) / 1e6
        );
        let mut s = String::from(
            "| figure | value | unit | device | dtype | preset | params | notes |\n|---|---:|---|---|---|---|---:|---|\n",
        );
        let mut row =
            |fig: &str, c: &Case, key: &str, unit: &str, note: &dyn Fn(&Value) -> String| match c {
                Ok(v) => match v[key].as_f64() {
                    Some(x) => s += &format!("| {fig} | {x:.3} | {unit} | {who} | {} |\n", note(v)),
                    None => s += &format!("| {fig} | – | {unit} | {who} | not measured |\n"),
                },
                Err(e) => {
                    s += &format!("| {fig} | – | {unit} | {who} | {} |\n", e.replace('|', "/"))
                }
            };
        let num = |v: &Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
        row("copy bandwidth", &self.copy, "copy_gbps", "GB/s", &|v| {
            format!(
                "device-to-device copy_ of {} MiB, read + written, best of 5",
                num(v, "copy_bytes") / 1048576.0
            )
        });
        row("matmul", &self.matmul, "matmul_tflops", "TFLOP/s", &|v| {
            format!("{0}×{0}×{0}, best of 5", num(v, "matmul_n"))
        });
        let mut decodes = vec![
            ("decode", &self.decode),
            ("decode, batch 1", &self.decode_b1),
        ];
        if let Some(c) = &self.decode_eager {
            decodes.push(("decode without CUDA graphs", c));
        }
        for (name, c) in decodes {
            let note = |v: &Value| {
                format!(
                    "batch {}, prompt {}, {} new tokens, T=1 top-k 50; step {:.2} ms, prefill {:.3} s",
                    num(v, "batch"),
                    num(v, "prompt_len"),
                    num(v, "new_tokens"),
                    num(v, "step_ms"),
                    num(v, "prefill_s")
                )
            };
            row(name, c, "tokens_per_s", "response tokens/s", &note);
            row(
                &format!("{name}: HBM fraction"),
                c,
                "hbm_fraction",
                "of copy bandwidth",
                &|v| {
                    format!(
                        "(weights + KV at mean context) / step time; {:.1} MB per step",
                        num(v, "bytes_per_step") / 1e6
                    )
                },
            );
        }
        let tnote = |v: &Value| {
            format!(
                "batch {} × {}, fwd+bwd+clip+AdamW, step {:.3} s, {:.2} TFLOP/s achieved",
                num(v, "batch"),
                num(v, "seq"),
                num(v, "step_s"),
                num(v, "achieved_tflops")
            )
        };
        row("train", &self.train, "tokens_per_s", "tokens/s", &tnote);
        row(
            "train: MFU vs measured matmul",
            &self.train,
            "mfu_measured",
            "fraction",
            &|_| "6·N_matmul + 12·L·d_q·T FLOPs per token".into(),
        );
        if self
            .train
            .as_ref()
            .is_ok_and(|v| v["mfu_datasheet"].is_number())
        {
            row(
                "train: MFU vs datasheet",
                &self.train,
                "mfu_datasheet",
                "fraction",
                &|v| format!("peak {} TFLOP/s", num(v, "peak_tflops")),
            );
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_shapes() {
        let mut shapes = Vec::new();
        for p in [
            Preset::Tiny,
            Preset::Smollm2_135m,
            Preset::Llama1b,
            Preset::Qwen3_1_7b,
        ] {
            let c = p.config().unwrap();
            shapes.push((c.hidden_size, c.head_dim, c.num_hidden_layers, c.vocab_size));
            assert_eq!(c.qk_norm, p == Preset::Qwen3_1_7b, "{}", p.name());
        }
        assert_eq!(
            shapes,
            [
                (64, 16, 2, 97),
                (576, 64, 30, 49152),
                (2048, 64, 16, 32000),
                (2048, 128, 28, 151936)
            ]
        );
        assert!(!Preset::Llama1b.config().unwrap().tie_word_embeddings);
    }
}
