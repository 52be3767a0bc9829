//! `yatt bench engine`: generation throughput side by side with HF transformers
//! `generate`, continuous vs static batching on a long-tail workload, the paged KV cache
//! on long-tail rollouts at a fixed memory budget, and training-step
//! throughput against PyTorch eager — all in one run, same weights, same thread count.

use super::row::{sampled_requests, BenchRow};
use crate::error::Result;
use crate::fixtures::run_reference;
use crate::generate::{Generator, GeneratorConfig, Request, SamplingParams};
use crate::model::Llama;
use crate::schedule::BatchingMode;
use crate::score::{token_logprobs, SeqBatch};
use crate::tokenizer::{ChatMessage, Tokenizer};
use crate::train::{TrainConfig, Trainer};
use serde_json::json;
use std::path::PathBuf;
use tch::{Device, Kind, Tensor};

/// What to run.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// HF model directory.
    pub model_dir: PathBuf,
    /// libtorch threads (and the reference's).
    pub threads: usize,
    /// Generation batch sizes.
    pub batches: Vec<usize>,
    /// New tokens per sample.
    pub new_tokens: usize,
    /// Run the HF transformers side (needs the virtualenv).
    pub with_reference: bool,
    /// Run the long-tail case.
    pub long_tail: bool,
    /// Run the training case.
    pub train: bool,
    /// Requests in the long-tail case.
    pub long_tail_requests: usize,
    /// Training batch and sequence length.
    pub train_batch: usize,
    /// Training sequence length.
    pub train_seq: usize,
    /// Also time a LoRA training step of this rank on every linear layer, alternating
    /// steps with the full one (0: no LoRA case).
    pub lora_rank: i64,
    /// Rounds of the generation comparison (yatt then the reference, alternating); the
    /// best round of each side is reported, which damps noise from other load.
    pub rounds: usize,
    /// Let yatt prefill repeated prompts and the common prefix once
    /// ([`GeneratorConfig::share_prefixes`]); off for an ablation.
    pub prefix_sharing: bool,
}

/// The benchmark's questions, each wrapped in the chat template (35–42 tokens; the
/// template's system prompt is the first 24). The first 8 are the GRPO-style groups' prompts.
const QUESTIONS: &[&str] = &[
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain photosynthesis in simple terms.",
    "Give me three tips for learning a new language.",
    "What is 17 times 23?",
    "Describe a cat to someone who has never seen one.",
    "Why is the sky blue?",
    "Suggest a name for a bakery.",
    "How do airplanes stay in the air?",
    "Write a haiku about autumn leaves.",
    "What causes the seasons on Earth?",
    "List three healthy breakfast ideas.",
    "Explain what a black hole is.",
    "How many legs does a spider have?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Write a limerick about a lazy dog.",
    "How do I make a cup of tea?",
    "What is the boiling point of water?",
    "Describe the taste of a lemon.",
    "Why do we need to sleep?",
    "Give me a riddle and its answer.",
    "What is the largest planet in our solar system?",
    "Explain how a rainbow forms.",
    "Suggest a weekend activity for a family.",
    "What does a computer processor do?",
    "Write a two-line story about a robot.",
    "How do bees make honey?",
    "What is the tallest mountain in the world?",
    "Explain gravity to a five-year-old.",
    "Name three famous painters.",
    "What is the square root of 144?",
    "How does a refrigerator keep food cold?",
    "Describe a sunset over the ocean.",
    "What are the primary colors?",
    "Give me a tip for staying focused.",
    "Why do leaves change color in the fall?",
    "What is the speed of light?",
    "Write a thank-you note to a teacher.",
    "How do fish breathe underwater?",
    "What is the meaning of the word \"ephemeral\"?",
    "Explain what an atom is.",
    "Suggest a good book for a long trip.",
    "How many continents are there?",
    "What makes thunder so loud?",
    "Describe the smell of fresh bread.",
    "Why is exercise good for you?",
    "What is the freezing point of water in Fahrenheit?",
    "Give me three words that rhyme with cat.",
    "How do plants drink water?",
    "What is a prime number?",
    "Write a short slogan for a bike shop.",
    "How does the moon affect the tides?",
    "What is the chemical symbol for gold?",
    "Explain why the ocean is salty.",
    "Name a few animals that live in the desert.",
    "How do I fold a paper airplane?",
    "What is the longest river in the world?",
    "Describe the sound of rain on a roof.",
    "Why do cats purr?",
    "What is 144 divided by 12?",
    "Give me a compliment for a friend.",
    "How do vaccines help the body?",
    "What is the opposite of generous?",
];

/// Questions in the GRPO-style case: each is sampled `batch / GROUPED_QUESTIONS` times.
const GROUPED_QUESTIONS: usize = 8;

fn prompts(tok: &Tokenizer) -> Result<Vec<Vec<i64>>> {
    QUESTIONS
        .iter()
        .map(|q| tok.encode_chat(&[ChatMessage::new("user", q)], true))
        .collect()
}

/// Which prompts a generation case runs. Prefix sharing makes this matter to yatt (not to
/// HF), so every figure says which it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PromptSet {
    /// Every request has its own question (only the chat template's system prompt is
    /// common).
    Distinct,
    /// GRPO-style: 8 questions, each sampled `batch / 8` times.
    Grouped,
}

impl PromptSet {
    /// The questions this set draws from (requests cycle through them).
    fn base(self, all: &[Vec<i64>], batch: usize) -> Vec<Vec<i64>> {
        match self {
            PromptSet::Distinct => all.iter().take(batch.max(1)).cloned().collect(),
            PromptSet::Grouped => all.iter().take(GROUPED_QUESTIONS).cloned().collect(),
        }
    }

    /// How the case is labelled in the table.
    fn label(self, all: &[Vec<i64>], batch: usize) -> String {
        let k = self.base(all, batch).len();
        match self {
            PromptSet::Distinct if k >= batch => format!("{batch} distinct prompts"),
            PromptSet::Distinct => format!(
                "{batch} prompts from {k} questions (only {k} distinct questions are defined)"
            ),
            PromptSet::Grouped => {
                format!(
                    "GRPO-style, {k} prompts × {} samples each",
                    batch.div_ceil(k)
                )
            }
        }
    }
}

/// Generation throughput (response tokens/s) at batch `b`, requests cycling through
/// `prompts`; also the positions prefill computed and the prompts' total length.
fn gen_throughput(
    g: &mut Generator,
    prompts: &[Vec<i64>],
    b: usize,
    new_tokens: usize,
    top_k: usize,
) -> Result<(f64, usize, usize, usize)> {
    let reqs: Vec<Request> = (0..b)
        .map(|i| Request {
            id: i as u64,
            prompt: prompts[i % prompts.len()].clone(),
            params: SamplingParams {
                temperature: 1.0,
                top_k,
                max_new_tokens: new_tokens,
                ignore_eos: true,
                seed: i as u64,
                ..Default::default()
            },
        })
        .collect();
    // Warm-up on a couple of short requests.
    let warm: Vec<Request> = reqs
        .iter()
        .take(2)
        .cloned()
        .map(|mut r| {
            r.params.max_new_tokens = 4;
            r
        })
        .collect();
    g.generate(&warm)?;
    let (outs, st) = g.generate(&reqs)?;
    let n: usize = outs.iter().map(|c| c.tokens.len()).sum();
    let prompt_tokens = reqs.iter().map(|r| r.prompt.len()).sum();
    Ok((
        n as f64 / st.seconds,
        n,
        st.prefill_positions,
        prompt_tokens,
    ))
}

/// The training cases' optimizer settings.
pub(crate) fn train_config() -> TrainConfig {
    TrainConfig {
        lr: 1e-5,
        weight_decay: 0.0,
        max_grad_norm: Some(1.0),
        ..Default::default()
    }
}

/// The training cases' batch: random ids `[bsz, t]`, every position real.
pub(crate) fn random_train_batch(
    vocab: i64,
    bsz: usize,
    t: usize,
    device: Device,
) -> Result<SeqBatch> {
    let ids = Tensor::f_randint(vocab, [bsz as i64, t as i64], (Kind::Int64, device))?;
    Ok(SeqBatch {
        attention_mask: ids.ones_like(),
        response_mask: ids.ones_like(),
        prompt_lens: vec![0; bsz],
        lens: vec![t; bsz],
        ids,
    })
}

/// The training cases' loss: mean token NLL over the predicted positions.
pub(crate) fn mean_nll(m: &Llama, b: &SeqBatch) -> Result<Tensor> {
    let t = b.ids.size().get(1).copied().unwrap_or(1);
    let s = token_logprobs(m, b, 1.0, false);
    Ok(-s.logprobs.sum(Kind::Float) / (b.len() as i64 * (t - 1)).max(1) as f64)
}

/// Runs the benchmark, printing progress to stderr.
pub fn run(opts: &BenchOptions) -> Result<Vec<BenchRow>> {
    crate::device::set_threads(opts.threads);
    let device = Device::Cpu;
    let tok = Tokenizer::from_dir(&opts.model_dir)?;
    let ps = prompts(&tok)?;
    let mut rows = Vec::new();
    let max_prompt = ps.iter().map(|p| p.len()).max().unwrap_or(1);
    let top_k = 50;

    // 1. Generation throughput, side by side.
    let maxb = opts.batches.iter().copied().max().unwrap_or(16);
    let model = Llama::load(&opts.model_dir, device, Kind::Float)?;
    let mut g = Generator::new(
        model,
        GeneratorConfig {
            max_batch: maxb,
            max_seq_len: max_prompt + opts.new_tokens.max(300) + 8,
            mode: BatchingMode::Continuous,
            max_prefill_batch: 64,
            share_prefixes: opts.prefix_sharing,
            kv_cache_bytes: None,
        },
    );
    let sets = [PromptSet::Distinct, PromptSet::Grouped];
    let cases: Vec<(PromptSet, usize)> = sets
        .iter()
        .flat_map(|&s| opts.batches.iter().map(move |&b| (s, b)))
        .collect();
    let mut ours = vec![0.0f64; cases.len()];
    let mut prefill = vec![(0usize, 0usize); cases.len()];
    let mut theirs: Vec<Option<f64>> = vec![None; cases.len()];
    for round in 0..opts.rounds.max(1) {
        for (i, &(set, b)) in cases.iter().enumerate() {
            g.config_mut().max_batch = b;
            let base = set.base(&ps, b);
            let (tps, n, pre, total) = gen_throughput(&mut g, &base, b, opts.new_tokens, top_k)?;
            eprintln!(
                "round {round}: yatt generate batch {b}, {set:?}: {tps:.1} tokens/s ({n} tokens; prefilled {pre} positions for {total} prompt tokens)"
            );
            ours[i] = ours[i].max(tps);
            prefill[i] = (pre, total);
        }
        if opts.with_reference {
            for set in sets {
                let base = set.base(&ps, maxb);
                let r = run_reference(
                    "generate",
                    &json!({"model": opts.model_dir, "threads": opts.threads, "batches": opts.batches, "new_tokens": opts.new_tokens, "prompts": base, "top_k": top_k, "temperature": 1.0}),
                    Some(opts.threads),
                )?;
                for (i, &(s, b)) in cases.iter().enumerate() {
                    if s != set {
                        continue;
                    }
                    if let Some(x) = r[b.to_string()]["tokens_per_s"].as_f64() {
                        eprintln!(
                            "round {round}: HF transformers generate batch {b}, {set:?}: {x:.1} tokens/s"
                        );
                        theirs[i] = Some(theirs[i].unwrap_or(0.0).max(x));
                    }
                }
            }
        }
    }
    for (i, &(set, b)) in cases.iter().enumerate() {
        let (pre, total) = prefill[i];
        rows.push(BenchRow {
            case: format!(
                "generate, batch {b}, {}, {} new tokens, sampling (T=1, top-k {top_k})",
                set.label(&ps, b),
                opts.new_tokens
            ),
            yatt: ours[i],
            reference: theirs[i],
            unit: "response tokens/s".into(),
            note: format!(
                "reference: HF transformers generate; best of {} alternating rounds each; yatt prefilled {pre} positions for {total} prompt tokens (prefix sharing {})",
                opts.rounds.max(1),
                if opts.prefix_sharing { "on" } else { "off" }
            ),
        });
    }

    // 2. Long tail: continuous vs static batching.
    if opts.long_tail {
        let n = opts.long_tail_requests;
        let mut rng = crate::generate::RequestRng::new(42);
        // Skewed lengths: most responses short, a few long (Pareto-like).
        let lens: Vec<usize> = (0..n)
            .map(|_| {
                let u = rng.uniform().max(1e-3) as f64;
                ((16.0 / u.powf(0.8)) as usize).clamp(8, 256)
            })
            .collect();
        let reqs = sampled_requests(&ps, &lens, top_k);
        let b = 16.min(maxb);
        g.config_mut().max_batch = b;
        let total: usize = lens.iter().sum();
        let mut res = Vec::new();
        for mode in [BatchingMode::Static, BatchingMode::Continuous] {
            g.set_mode(mode);
            let (_, st) = g.generate(&reqs)?;
            let util = st.slot_steps as f64 / (st.decode_steps.max(1) * b) as f64;
            eprintln!(
                "long tail {mode:?}: {:.1}s, {:.1} tokens/s, slot utilisation {:.0}%",
                st.seconds,
                total as f64 / st.seconds,
                util * 100.0
            );
            res.push((total as f64 / st.seconds, st.seconds, util));
        }
        g.set_mode(BatchingMode::Continuous);
        let max_len = lens.iter().max().copied().unwrap_or(0);
        let median = {
            let mut l = lens.clone();
            l.sort();
            l[l.len() / 2]
        };
        rows.push(BenchRow {
            case: format!("long tail: {n} requests, batch {b}, lengths 8..{max_len} (median {median}), continuous vs static batching"),
            yatt: res[1].0,
            reference: Some(res[0].0),
            unit: "response tokens/s".into(),
            note: format!(
                "reference: yatt static batching; wall {:.1}s vs {:.1}s; slot utilisation {:.0}% vs {:.0}%",
                res[1].1,
                res[0].1,
                res[1].2 * 100.0,
                res[0].2 * 100.0
            ),
        });
    }
    drop(g);
    if opts.long_tail {
        let model = Llama::load(&opts.model_dir, device, Kind::Float)?;
        rows.push(super::paged::long_tail_row(
            model,
            &ps,
            opts.long_tail_requests.max(2),
            top_k,
        )?);
    }

    // 3. Training step.
    if opts.train {
        let (bsz, t) = (opts.train_batch, opts.train_seq);
        let model = Llama::load(&opts.model_dir, device, Kind::Float)?;
        let v = model.config.vocab_size;
        let mut tr = Trainer::new(model, train_config());
        tch::manual_seed(0);
        let batch = random_train_batch(v, bsz, t, device)?;
        let loss = mean_nll;
        tr.step(std::slice::from_ref(&batch), loss)?; // warm-up
        let steps = 3;
        // The LoRA trainer, stepped in turn with the full one so that load drift hits
        // both alike.
        let mut lora = if opts.lora_rank > 0 {
            let mut m = Llama::load(&opts.model_dir, device, Kind::Float)?;
            m.add_lora(
                crate::model::LoraConfig {
                    rank: opts.lora_rank,
                    alpha: 2.0 * opts.lora_rank as f64,
                    dropout: 0.0,
                    targets: crate::model::LoraTarget::ALL.to_vec(),
                },
                0,
            )?;
            let mut l = Trainer::new(m, tr.config.clone());
            l.step(std::slice::from_ref(&batch), loss)?; // warm-up
            Some((l, 0.0f64))
        } else {
            None
        };
        let mut full_s = 0.0;
        for _ in 0..steps {
            let t0 = std::time::Instant::now();
            tr.step(std::slice::from_ref(&batch), loss)?;
            full_s += t0.elapsed().as_secs_f64();
            if let Some((l, s)) = lora.as_mut() {
                let t0 = std::time::Instant::now();
                l.step(std::slice::from_ref(&batch), loss)?;
                *s += t0.elapsed().as_secs_f64();
            }
        }
        if let Some((mut l, s)) = lora.take() {
            let sec = s / steps as f64;
            let state = l.resident_bytes() as f64 / 1e6;
            eprintln!(
                "yatt LoRA r={} train step B={bsz} T={t}: {sec:.2}s/step",
                opts.lora_rank
            );
            rows.push(BenchRow {
                case: format!(
                    "training step with LoRA r={} on every linear layer, batch {bsz} × {t} tokens",
                    opts.lora_rank
                ),
                yatt: (bsz * t) as f64 / sec,
                reference: None,
                unit: "tokens/s".into(),
                note: format!(
                    "steps alternate with the full step's; weights + grads + AdamW: {state:.0} MB"
                ),
            });
        }
        let sec = full_s / steps as f64;
        let tps = (bsz * t) as f64 / sec;
        eprintln!("yatt train step B={bsz} T={t}: {sec:.2}s/step, {tps:.0} tokens/s");
        let full_state = tr.resident_bytes() as f64 / 1e6;
        drop(tr);
        let rf = if opts.with_reference {
            let r = run_reference(
                "train",
                &json!({"model": opts.model_dir, "threads": opts.threads, "batch": bsz, "seq": t, "steps": steps}),
                Some(opts.threads),
            )?;
            r["tokens_per_s"].as_f64()
        } else {
            None
        };
        if let Some(x) = rf {
            eprintln!("PyTorch eager train step: {x:.0} tokens/s");
        }
        rows.push(BenchRow {
            case: format!("training step (fwd+bwd+AdamW+clip), batch {bsz} × {t} tokens"),
            yatt: tps,
            reference: rf,
            unit: "tokens/s".into(),
            note: format!(
                "reference: PyTorch eager (transformers model, torch.optim.AdamW); weights + grads + AdamW: {full_state:.0} MB"
            ),
        });
    }
    Ok(rows)
}

/// Renders rows as a markdown table.
pub fn markdown_table(rows: &[BenchRow]) -> String {
    let mut s = String::from(
        "| case | yatt | reference | ratio | unit | notes |\n|---|---:|---:|---:|---|---|\n",
    );
    for r in rows {
        s += &format!(
            "| {} | {:.1} | {} | {} | {} | {} |\n",
            r.case,
            r.yatt,
            r.reference
                .map(|x| format!("{x:.1}"))
                .unwrap_or_else(|| "–".into()),
            r.ratio()
                .map(|x| format!("{x:.2}×"))
                .unwrap_or_else(|| "–".into()),
            r.unit,
            r.note
        );
    }
    s
}
