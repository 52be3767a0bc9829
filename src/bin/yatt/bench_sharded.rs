//! `yatt bench sharded`: sharded training (ZeRO-3) against the replicated trainer, each
//! rank its own process with its own node, the ranks talking over the runtime's ring
//! (QUIC on loopback). Per rank count: the step time, each rank's training state and
//! peak resident memory, the bytes each rank moved against 3·(N−1)/N·Ψ·b, the time
//! spent gathering and the part of it prefetch left exposed; and the step the cost
//! model (`yatt_placement::ShardedStep`) predicts from the first sharded row's compute
//! and probes of the ring's bandwidth and of the share of a core each rank gets, against
//! the measured one. With `--mem-cap-mb` every rank runs under a memory cap (a cgroup,
//! else RLIMIT_AS): a model whose state does not fit one rank fails at N = 1, by name,
//! and trains when sharded.

mod cap;
mod predict;

use anyhow::{anyhow, bail, Context, Result};
use cap::MemoryCap;
use predict::{Calibration, Probe, RankTimes, StepTimes};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use yatt_engine::score::{token_logprobs_backward, SeqBatch, TokenScores};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::{
    model_layout, random_model_by_units, set_threads, ModelConfig, ShardedTrainer, TrainConfig,
    Trainer,
};
use yatt_roles::RingShardGroup;
use yatt_runtime::{Node, NodeConfig, RingMember, RingSpec, RING_CHUNK_BYTES};

/// How the ranks hold the model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
pub enum Layout {
    /// ZeRO-3: each rank a shard of the state, units gathered as they run.
    Sharded,
    /// Every rank the whole model and optimizer; gradients averaged by ring all-reduce.
    Replicated,
}

#[derive(clap::Args, Clone)]
pub struct BenchShardedArgs {
    /// Model shapes, with random weights: `smollm2-135m`, `smollm2-360m`, `tiny`, or a
    /// model directory's config.json.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Rank counts of the sharded runs.
    #[arg(long, value_delimiter = ',', default_values_t = [1usize, 2, 4])]
    pub shards: Vec<usize>,
    /// Rank counts of the replicated runs (the baseline), none by default.
    #[arg(long, value_delimiter = ',')]
    pub replicated: Vec<usize>,
    /// Optimizer steps per run (the first is warm-up and not timed).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Sequences per step over all ranks (the global batch).
    #[arg(long, default_value_t = 4)]
    pub global_batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 64)]
    pub seq_len: usize,
    /// Caps each rank process's memory, MiB (cgroup v2 `memory.max`, cgroup v1
    /// `memory.limit_in_bytes`, else RLIMIT_AS).
    #[arg(long)]
    pub mem_cap_mb: Option<u64>,
    /// libtorch threads per rank.
    #[arg(long, default_value_t = 1)]
    pub threads: usize,
    /// Deadline of each collective, seconds.
    #[arg(long, default_value_t = 300)]
    pub collective_s: u64,
    /// glibc's mmap threshold in the ranks, KiB (fixed, so that freed tensors above it
    /// go back to the OS); unset: glibc's dynamic default.
    #[arg(long)]
    pub mmap_threshold_kb: Option<i32>,
    /// Deadline of a whole run, seconds.
    #[arg(long, default_value_t = 3600)]
    pub run_s: u64,
    /// Sharded ranks wait on each collective as they submit it: no gather prefetched,
    /// no reduce-scatter behind compute (the baseline prefetch is measured against).
    #[arg(long)]
    pub no_prefetch: bool,
    #[command(flatten)]
    pub rank: RankArgs,
}

/// What the lead passes to a rank process (hidden: internal).
#[derive(clap::Args, Clone, Default)]
pub struct RankArgs {
    #[arg(long, hide = true)]
    pub rank: Option<usize>,
    #[arg(long, hide = true)]
    pub world: Option<usize>,
    #[arg(long, hide = true, value_enum)]
    pub layout: Option<Layout>,
    #[arg(long, hide = true)]
    pub lead: Option<SocketAddr>,
    #[arg(long, hide = true)]
    pub ca_dir: Option<PathBuf>,
    /// Also time a step of one sequence per rank (the cost model's calibration row).
    #[arg(long, hide = true)]
    pub calibrate: bool,
}

/// What a rank reports.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct RankResult {
    rank: usize,
    step_s: Vec<f64>,
    loss: Vec<f64>,
    moved_bytes: Vec<u64>,
    gather_s: Vec<f64>,
    reduce_s: Vec<f64>,
    update_s: Vec<f64>,
    /// CPU seconds of the compute thread per step.
    cpu_s: Vec<f64>,
    /// Tokens this rank trains on per step.
    tokens: usize,
    /// The ring probe before the steps (sharded, more than one rank).
    probe: Option<Probe>,
    /// The share of a core the rank got while every rank spun, before and after the
    /// steps (sharded).
    core_share: Option<f64>,
    /// A step of one sequence per rank (with `--calibrate`).
    small: Option<StepTimes>,
    /// The part of `gather_s` the rank's compute waited for.
    gather_exposed_s: Vec<f64>,
    train_state_bytes: u64,
    peak_rss_bytes: u64,
    /// Peak resident memory once the trainer was built, before the first step.
    built_rss_bytes: u64,
}

const SEED: i64 = 7;

pub fn run(args: BenchShardedArgs) -> Result<()> {
    if args.rank.rank.is_some() {
        return rank_main(&args);
    }
    let config = model_config(&args.model)?;
    let psi: i64 = model_layout(&config).iter().map(|u| u.numel).sum();
    println!(
        "sharded training, {} shapes ({:.1} M parameters, random weights), global batch {} × {} tokens, {} thread(s) per rank, {} core(s){}, prefetch {}\n",
        args.model,
        psi as f64 / 1e6,
        args.global_batch,
        args.seq_len,
        args.threads,
        predict::cores(),
        args.mem_cap_mb
            .map(|m| format!(", each rank capped at {m} MiB"))
            .unwrap_or_default(),
        if args.no_prefetch { "off" } else { "on" },
    );
    println!("| {} |", COLUMNS.join(" | "));
    println!("|{}", "---|".repeat(COLUMNS.len()));
    let runs = (args.shards.iter().map(|&n| (Layout::Sharded, n)))
        .chain(args.replicated.iter().map(|&n| (Layout::Replicated, n)));
    let mut calib = None;
    for (layout, world) in runs {
        let calibrate = layout == Layout::Sharded && calib.is_none();
        match run_ranks(&args, layout, world, calibrate) {
            Ok(results) => print_row(layout, world, &config, &results, &mut calib),
            Err(e) => println!(
                "| {layout:?} | {world} | failed: {} |{}",
                format!("{e:#}").replace('|', "/").replace('\n', " "),
                " |".repeat(COLUMNS.len() - 3)
            ),
        }
    }
    if let Some(c) = calib {
        println!(
            "\npredicted: a rank's compute from the Sharded {} row, on a core of its own: {:.0} µs per token, {:.2} s per micro-batch whatever its tokens, {:.2} s of optimizer over the whole model (1/N of it per rank), at the share of a core the row's compute got (or the probe found), plus the schedule's bytes over the probed ring bandwidth, none of it hidden (no prefetch)",
            c.ranks,
            c.s_per_token * 1e6,
            c.s_per_micro_batch,
            c.update_s,
        );
    }
    Ok(())
}

/// The table's columns.
const COLUMNS: [&str; 18] = [
    "layout",
    "ranks",
    "step (s)",
    "state / rank (GB)",
    "peak RSS / rank (GB)",
    "RSS built (GB)",
    "moved / rank / step (MB)",
    "schedule (MB)",
    "3(N−1)/N·Ψ·b (MB)",
    "gather (s/step)",
    "exposed (s/step)",
    "loss, step 1",
    "ring probe (MB/s)",
    "core share: probe / steps",
    "predicted (s): compute + comm",
    "measured (s): compute + collectives",
    "measured / predicted",
    "measured / predicted at the probed share",
];

/// The mean over the steps after the first (warm caches and allocator).
fn timed(v: &[f64]) -> f64 {
    let t = if v.len() > 1 { &v[1..] } else { v };
    t.iter().sum::<f64>() / t.len().max(1) as f64
}

fn print_row(
    layout: Layout,
    world: usize,
    config: &ModelConfig,
    rs: &[RankResult],
    calib: &mut Option<Calibration>,
) {
    let units = model_layout(config);
    let psi: i64 = units.iter().map(|u| u.numel).sum();
    let mean = |f: &dyn Fn(&RankResult) -> f64| rs.iter().map(f).sum::<f64>() / rs.len() as f64;
    let step = rs.iter().map(|r| timed(&r.step_s)).fold(0.0, f64::max);
    let moved = mean(&|r| timed(&r.moved_bytes.iter().map(|&b| b as f64).collect::<Vec<_>>()));
    let (schedule, formula) = match layout {
        Layout::Sharded => (
            predict::schedule_bytes(&units, world),
            3.0 * (world as f64 - 1.0) / world as f64 * psi as f64 * 4.0,
        ),
        Layout::Replicated => {
            let ring = 2.0 * (world as f64 - 1.0) / world as f64 * psi as f64 * 4.0;
            (ring, ring)
        }
    };
    let model = match layout {
        Layout::Sharded => {
            let times: Vec<RankTimes> = rs
                .iter()
                .map(|r| RankTimes {
                    steps: StepTimes {
                        step_s: timed(&r.step_s),
                        collectives_s: timed(&r.gather_s) + timed(&r.reduce_s),
                        update_s: timed(&r.update_s),
                        cpu_s: timed(&r.cpu_s),
                        tokens: r.tokens as f64,
                    },
                    small: r.small,
                    probe: r.probe,
                    core_share: r.core_share.unwrap_or(1.0),
                })
                .collect();
            let f = predict::fit(&units, world, &times, calib);
            let p = &f.predicted;
            format!(
                "{} | {:.2} / {:.2} | {:.2} + {:.2} = {:.2} | {:.2} + {:.2} = {:.2} | {:.2} | {:.2}",
                match f.link_bytes_per_s.is_finite() {
                    true => format!("{:.0}", f.link_bytes_per_s / 1e6),
                    false => "–".into(),
                },
                f.share_probe,
                f.share_steps,
                p.compute_s,
                p.exposed_comm_s,
                p.step_s,
                f.compute_s,
                f.collectives_s,
                f.step_s,
                f.step_s / p.step_s,
                f.step_s / f.predicted_probe.step_s,
            )
        }
        Layout::Replicated => "– | – | – | – | – | –".into(),
    };
    println!(
        "| {layout:?} | {world} | {step:.2} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.1}{} | {:.3} | {:.3} | {:.6} | {model} |",
        mean(&|r| r.train_state_bytes as f64) / 1e9,
        rs.iter().map(|r| r.peak_rss_bytes).max().unwrap_or(0) as f64 / 1e9,
        rs.iter().map(|r| r.built_rss_bytes).max().unwrap_or(0) as f64 / 1e9,
        moved / 1e6,
        schedule / 1e6,
        formula / 1e6,
        if layout == Layout::Replicated {
            " (2(N−1)/N)"
        } else {
            ""
        },
        mean(&|r| timed(&r.gather_s)),
        mean(&|r| timed(&r.gather_exposed_s)),
        // A replicated rank reports its own part of the loss; a sharded step's is
        // already summed over the ranks.
        match layout {
            Layout::Sharded => rs[0].loss.first().copied().unwrap_or(f64::NAN),
            Layout::Replicated => rs.iter().filter_map(|r| r.loss.first()).sum(),
        },
    );
}

/// The shapes `name` stands for.
pub(crate) fn model_config(name: &str) -> Result<ModelConfig> {
    let preset = |h: i64, f: i64, l: i64, heads: i64, kv: i64| {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": h,
            "intermediate_size": f, "num_hidden_layers": l, "num_attention_heads": heads,
            "num_key_value_heads": kv, "vocab_size": 49152, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "tie_word_embeddings": true,
            "bos_token_id": 1, "eos_token_id": 2
        })
    };
    let v = match name {
        "smollm2-135m" => preset(576, 1536, 30, 9, 3),
        "smollm2-360m" => preset(960, 2560, 32, 15, 5),
        "tiny" => return Ok(yatt_engine::tiny_config()),
        path => {
            let p = PathBuf::from(path);
            let dir = if p.is_dir() {
                p
            } else {
                p.parent().map(PathBuf::from).unwrap_or(p)
            };
            return ModelConfig::from_dir(&dir).with_context(|| {
                format!("--model {name}: not a preset (smollm2-135m, smollm2-360m, tiny) nor a model directory")
            });
        }
    };
    ModelConfig::from_json(&v).map_err(|e| anyhow!("preset {name}: {e}"))
}

/// Starts `world` rank processes around a lead node, hands them the ring, and collects
/// their results.
fn run_ranks(
    args: &BenchShardedArgs,
    layout: Layout,
    world: usize,
    calibrate: bool,
) -> Result<Vec<RankResult>> {
    let dir = tempfile::tempdir()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let lead = rt.block_on(
        Node::builder("shard-lead")
            .config(node_config())
            .dev_certs(dir.path())
            .start(),
    )?;
    let exe = std::env::current_exe().context("locating the yatt binary")?;
    let (tx, rx) = std::sync::mpsc::channel::<(usize, Option<String>)>();
    let mut ranks = Vec::with_capacity(world);
    for r in 0..world {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "sharded", "--model", &args.model])
            .args(["--steps", &args.steps.to_string()])
            .args(["--global-batch", &args.global_batch.to_string()])
            .args(["--seq-len", &args.seq_len.to_string()])
            .args(["--threads", &args.threads.to_string()])
            .args(["--collective-s", &args.collective_s.to_string()])
            .args(args.no_prefetch.then_some("--no-prefetch"))
            .args(
                args.mmap_threshold_kb
                    .map(|k| vec!["--mmap-threshold-kb".to_string(), k.to_string()])
                    .unwrap_or_default(),
            )
            .args(["--rank", &r.to_string(), "--world", &world.to_string()])
            .args(["--layout", &format!("{layout:?}").to_lowercase()])
            .args(calibrate.then_some("--calibrate"))
            .args(["--lead", &lead.addr().to_string()])
            .arg("--ca-dir")
            .arg(dir.path())
            .env("OMP_NUM_THREADS", args.threads.to_string())
            .env("OMP_WAIT_POLICY", "PASSIVE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let cap = args
            .mem_cap_mb
            .map(|mb| MemoryCap::new(mb, &format!("yatt-bench-{}-{r}", std::process::id())))
            .transpose()?;
        if let Some(c) = &cap {
            c.before_spawn(&mut cmd);
        }
        let mut child = cmd.spawn().context("starting a rank process")?;
        if let Some(c) = &cap {
            c.after_spawn(child.id())?;
        }
        let out = child.stdout.take().expect("piped");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out)
                .lines()
                .map_while(std::result::Result::ok)
            {
                let _ = tx.send((r, Some(line)));
            }
            let _ = tx.send((r, None));
        });
        ranks.push(cap::Rank { child, cap });
    }
    let until = Instant::now() + Duration::from_secs(args.run_s);
    let mut ids = vec![None; world];
    let mut results: Vec<Option<RankResult>> = vec![None; world];
    let mut sent = false;
    while results.iter().any(Option::is_none) {
        let left = until.saturating_duration_since(Instant::now());
        let (r, line) = rx
            .recv_timeout(left.max(Duration::from_millis(1)))
            .map_err(|_| anyhow!("the ranks did not finish within --run-s {}", args.run_s))?;
        match line {
            Some(l) if l.starts_with("READY ") => ids[r] = Some(l[6..].trim().to_string()),
            Some(l) if l.starts_with("RESULT ") => {
                results[r] = Some(serde_json::from_str(&l[7..]).context("a rank's RESULT line")?)
            }
            Some(_) => {}
            None if results[r].is_none() => return Err(ranks[r].died(r)),
            None => {}
        }
        if !sent && ids.iter().all(Option::is_some) {
            let members: Vec<String> = ids.iter().flatten().cloned().collect();
            for rk in &mut ranks {
                let stdin = rk.child.stdin.as_mut().expect("piped");
                writeln!(stdin, "{}", members.join(","))?;
                stdin.flush()?;
            }
            sent = true;
        }
    }
    for rk in &mut ranks {
        rk.finish(Duration::from_secs(30));
    }
    rt.block_on(lead.shutdown());
    Ok(results.into_iter().flatten().collect())
}

/// A rank process: a node, a ring member, a trainer; steps; its result on stdout.
fn rank_main(args: &BenchShardedArgs) -> Result<()> {
    let ra = &args.rank;
    let (rank, world) = (ra.rank.unwrap_or(0), ra.world.context("--world")?);
    let layout = ra.layout.context("--layout")?;
    let lead = ra.lead.context("--lead")?;
    let ca = ra.ca_dir.clone().context("--ca-dir")?;
    set_threads(args.threads);
    if let Some(kb) = args.mmap_threshold_kb {
        const M_MMAP_THRESHOLD: i32 = -3;
        // SAFETY: mallopt only adjusts allocator tunables.
        unsafe { libc::mallopt(M_MMAP_THRESHOLD, kb.saturating_mul(1024)) };
    }
    let config = model_config(&args.model)?;
    let vocab = config.vocab_size;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let node = rt.block_on(
        Node::builder(&format!("rank{rank}"))
            .config(node_config())
            .dev_certs(&ca)
            .seed(lead)
            .start(),
    )?;
    let mut member = {
        let _inside = rt.enter();
        RingMember::start(&node, "shard", rank as u32)?
    };
    println!("READY {}", member.inbox_id());
    std::io::stdout().flush()?;
    let mut line = String::new();
    std::io::stdin().read_line(&mut line)?;
    let members = line
        .trim()
        .split(',')
        .map(|s| s.parse().map_err(|e| anyhow!("member id {s}: {e}")))
        .collect::<Result<Vec<_>>>()?;
    // Every rank's node must be in this node's directory before the first send (the
    // ring probe comes at once): they joined through the lead, and news of each other
    // may still be on its way.
    let peers: Vec<String> = members
        .iter()
        .map(|m: &yatt_runtime::ActorId| m.name.node.clone())
        .collect();
    rt.block_on(node.directory().wait_until(
        Duration::from_secs(args.collective_s),
        |d: &yatt_runtime::Directory| peers.iter().all(|p| d.alive_nodes().any(|n| n.name == *p)),
    ));
    member.join(RingSpec {
        rank: rank as u32,
        members,
        timeout: Duration::from_secs(args.collective_s),
        chunk_bytes: RING_CHUNK_BYTES,
    })?;
    let train = TrainConfig {
        lr: 1e-4,
        ..TrainConfig::default()
    };
    let mut result = RankResult {
        rank,
        step_s: vec![],
        loss: vec![],
        moved_bytes: vec![],
        gather_s: vec![],
        reduce_s: vec![],
        update_s: vec![],
        cpu_s: vec![],
        tokens: 0,
        probe: None,
        core_share: None,
        small: None,
        gather_exposed_s: vec![],
        train_state_bytes: 0,
        peak_rss_bytes: 0,
        built_rss_bytes: 0,
    };
    let global_tokens = (args.global_batch * (args.seq_len - 8)) as f64;
    let loss = |s: &TokenScores, b: &SeqBatch| {
        -(&s.logprobs * b.response_mask.to_kind(Kind::Float)).sum(Kind::Float) / global_tokens
    };
    match layout {
        Layout::Sharded => {
            let mut group = RingShardGroup::new(member)?;
            if world > 1 {
                result.probe = Some(predict::probe(&mut group, &model_layout(&config), 2)?);
            }
            // Right after the probe's last collective, and again after the last step's:
            // the ranks spin together, before and after the steps they bracket.
            let share_before = predict::core_share(0.5);
            let mut tr = ShardedTrainer::random(
                config,
                Device::Cpu,
                Kind::Float,
                SEED,
                train,
                Box::new(group),
            )?;
            tr.prefetch = !args.no_prefetch;
            result.built_rss_bytes = cap::peak_rss_bytes();
            let mut timed_step = |batches: &[SeqBatch]| {
                let (t0, c0) = (Instant::now(), predict::thread_cpu_s());
                let s = tr.step_tokens(batches, 1.0, |i, sc| Ok(loss(sc, &batches[i])))?;
                let times = StepTimes {
                    step_s: t0.elapsed().as_secs_f64(),
                    collectives_s: s.comm.gather_s + s.comm.reduce_s,
                    update_s: s.update_s,
                    cpu_s: predict::thread_cpu_s() - c0,
                    tokens: tokens_of(batches) as f64,
                };
                anyhow::Ok((s, times))
            };
            for step in 0..args.steps {
                let batches = rank_batch(args, vocab, step, rank, world)?;
                let (s, t) = timed_step(&batches)?;
                result.tokens = t.tokens as usize;
                result.step_s.push(t.step_s);
                result.update_s.push(t.update_s);
                result.cpu_s.push(t.cpu_s);
                result.loss.push(s.step.loss);
                result
                    .moved_bytes
                    .push(s.comm.gathered_bytes + s.comm.reduced_bytes);
                result.gather_s.push(s.comm.gather_s);
                result.reduce_s.push(s.comm.reduce_s);
                result.gather_exposed_s.push(s.comm.gather_exposed_s);
                result.train_state_bytes = result.train_state_bytes.max(s.train_state_bytes);
            }
            if ra.calibrate {
                let one = BenchShardedArgs {
                    global_batch: world,
                    ..args.clone()
                };
                let batches = rank_batch(&one, vocab, args.steps, rank, world)?;
                result.small = Some(timed_step(&batches)?.1);
            }
            result.core_share = Some((share_before + predict::core_share(0.5)) / 2.0);
        }
        Layout::Replicated => {
            let mut model = random_model_by_units(config, Device::Cpu, Kind::Float, SEED);
            model.memory.activation_checkpointing = true;
            let mut tr = Trainer::new(model, train);
            result.built_rss_bytes = cap::peak_rss_bytes();
            result.train_state_bytes = tr.resident_bytes() as u64;
            let psi: usize = tr.model.parameters().iter().map(|(_, p)| p.numel()).sum();
            for step in 0..args.steps {
                let batches = rank_batch(args, vocab, step, rank, world)?;
                result.tokens = tokens_of(&batches);
                let (t0, c0) = (Instant::now(), predict::thread_cpu_s());
                let mut total = 0.0;
                for b in &batches {
                    total += token_logprobs_backward(&tr.model, b, 1.0, |s| Ok(loss(s, b)))?;
                }
                let flat = tr.flat_grads()?;
                let mean = member.all_reduce_mean_blocking(flat, step as u64)?;
                // The losses are over the global token count: the gradient is the sum.
                let sum: Vec<f32> = mean.iter().map(|g| g * world as f32).collect();
                tr.set_flat_grads(&sum)?;
                tr.apply_gradients()?;
                result.step_s.push(t0.elapsed().as_secs_f64());
                result.loss.push(total);
                let moved = 2 * (world - 1) * psi * 4 / world;
                result.moved_bytes.push(moved as u64);
                result.gather_s.push(0.0);
                result.reduce_s.push(0.0);
                result.update_s.push(0.0);
                result.cpu_s.push(predict::thread_cpu_s() - c0);
                result.train_state_bytes = result.train_state_bytes.max(tr.resident_bytes() as u64);
            }
        }
    }
    result.peak_rss_bytes = cap::peak_rss_bytes();
    println!("RESULT {}", serde_json::to_string(&result)?);
    std::io::stdout().flush()?;
    rt.block_on(node.shutdown());
    Ok(())
}

/// Loopback nodes with a generous failure bound: ranks computing on every core must
/// not be declared dead because their runtime thread waited for one.
fn node_config() -> NodeConfig {
    NodeConfig {
        failure_timeout: Duration::from_secs(60),
        ..NodeConfig::default()
    }
}

/// Tokens (padding included) in a rank's micro-batches.
fn tokens_of(batches: &[SeqBatch]) -> usize {
    batches.iter().map(|b| b.ids.numel()).sum()
}

/// This rank's share of step `step`'s global batch: sequences `rank`, `rank + world`,
/// ..., deterministic token ids, the first 8 tokens a prompt.
fn rank_batch(
    args: &BenchShardedArgs,
    vocab: i64,
    step: usize,
    rank: usize,
    world: usize,
) -> Result<Vec<SeqBatch>> {
    if args.seq_len <= 8 {
        bail!("--seq-len must be more than 8 (the prompt's length)");
    }
    let rows: Vec<Vec<i64>> = (rank..args.global_batch)
        .step_by(world)
        .map(|i| {
            (0..args.seq_len)
                .map(|t| 3 + ((t * 7919 + i * 104_729 + step * 1_299_709) as i64 % (vocab - 3)))
                .collect()
        })
        .collect();
    if rows.is_empty() {
        return Ok(vec![]);
    }
    let pairs: Vec<(&[i64], &[i64])> = rows.iter().map(|r| (&r[..8], &r[8..])).collect();
    Ok(vec![SeqBatch::from_pairs(&pairs, 0, Device::Cpu)?])
}
