//! `yatt train CONFIG [--set key=value ...] [--cluster SEED_ADDR]`, or
//! `yatt train --resume RUN_DIR`: a training run. Embedded (no `--cluster`): one node
//! starts in this process (dev certificates in a temp dir) and the job's roles are built
//! on it. With `--cluster`: this process joins the cluster as a node and spawns each
//! role on the node `[placement]` names. Then `job.steps` steps run; metrics go to
//! `OUTPUT_DIR/metrics.jsonl` and a TensorBoard event file there, the policy to
//! `OUTPUT_DIR/checkpoint`. The logic is in `yatt_trainer` (`train_with`, `build_cluster`).
//! On a terminal progress is a bar; otherwise (CI, pipes) a line per step.

use std::io::IsTerminal as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use yatt::runtime::Node;
use yatt::runtime::{CertKind, NodeIdentity};
use yatt::trainer::{
    dry_run, train_with, Certificate, JobConfig, Progress, TrainOptions, JOB_FILE,
};

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The job config (TOML), e.g. config/demo-letters.toml.
    #[arg(required_unless_present = "resume", conflicts_with = "resume")]
    config: Option<PathBuf>,
    /// Continue the run in RUN_DIR from its checkpoint (its job.toml is the config;
    /// `--set job.steps=N` sets the new total).
    #[arg(long, value_name = "RUN_DIR")]
    resume: Option<PathBuf>,
    /// Override a config value: a dotted key and a TOML value, e.g. `--set job.steps=10`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Join the cluster through this member and run each role on the node that
    /// `[placement]` names (placement.mode = "disaggregated"). An address or
    /// HOST:PORT (e.g. yatt-node-0.yatt:7400), looked up for up to 2 minutes.
    #[arg(long, value_name = "SEED_ADDR")]
    cluster: Option<String>,
    /// With --cluster: this process's node name (its certificate's CN). Default: with
    /// --dev, a name of its own per process (`train-<pid>-<random>`), so that
    /// concurrent runs never share one; otherwise "train" (the certificate's name in
    /// --certs). Two live members may not share a name: the second is refused.
    #[arg(long, requires = "cluster")]
    name: Option<String>,
    /// With --cluster: the certificate directory (ca.pem, NAME.pem, NAME.key; with
    /// --dev, the dev CA the nodes were started with).
    #[arg(long, default_value = "certs", requires = "cluster")]
    certs: PathBuf,
    /// With --cluster: issue this node's certificate from the dev CA in --certs (as
    /// `yatt-node run --dev` does).
    #[arg(long, requires = "cluster")]
    dev: bool,
    /// With --cluster: QUIC listen address of this process's node (an address, or
    /// HOST:PORT of this machine); the nodes must be able to reach it.
    #[arg(long, default_value = "127.0.0.1:0", requires = "cluster")]
    listen: String,
    /// With --cluster: a `yatt-node` config file (config/node.toml) whose `[transport]`
    /// and `[membership]` settings this process's node takes, as the daemons do; the
    /// `YATT_NODE__SECTION__KEY` environment overrides apply with or without it. Its
    /// name, listen address and seed come from the flags above.
    #[arg(long, value_name = "FILE", requires = "cluster")]
    node_config: Option<PathBuf>,
    /// Serve the live view of this run and its cluster (a page at `/`, with `/health`
    /// and `/metrics`) on this address: HOST:PORT, or a port on loopback (port 0: any
    /// free one). Read-only; the URL is printed. Off by default.
    #[arg(long, value_name = "ADDR")]
    http: Option<String>,
    /// Check the job without training it: build it, run every preflight check, spawn
    /// every role, do one weight sync and one step through every stage, stop
    /// everything, and print what would run where and each check's result. Exits 0
    /// only if every check passed.
    #[arg(long)]
    dry_run: bool,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let (job, resume) = match (&args.config, &args.resume) {
        (_, Some(dir)) => {
            let path = dir.join(JOB_FILE);
            if !path.is_file() {
                anyhow::bail!(
                    "{} has no {JOB_FILE}: --resume takes the output_dir of an earlier `yatt train` run",
                    dir.display()
                );
            }
            let mut job = JobConfig::load(&path, &args.sets)?;
            // The run continues where it is, wherever the config said it was.
            job.job.output_dir = dir.clone();
            (job, true)
        }
        (Some(config), None) => (JobConfig::load(config, &args.sets)?, false),
        (None, None) => anyhow::bail!("give a job config, or --resume RUN_DIR"),
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run_job(job, resume, args))
}

/// The node this run lives on: a throw-away embedded one, or a member of the cluster.
async fn start_node(
    job: &JobConfig,
    args: &TrainArgs,
) -> anyhow::Result<(Node, Option<tempfile::TempDir>, Option<Certificate>)> {
    let disaggregated = job.placement.mode == yatt::trainer::PlacementMode::Disaggregated;
    let Some(seed_text) = args.cluster.as_deref() else {
        anyhow::ensure!(
            !disaggregated,
            "placement.mode = \"disaggregated\" puts roles on cluster nodes; add --cluster SEED_ADDR (and --dev --certs DIR for a dev cluster)"
        );
        let certs = tempfile::tempdir()?;
        let node = Node::builder("train-0")
            .dev_certs(certs.path())
            .start()
            .await
            .context("starting the in-process node")?;
        return Ok((node, Some(certs), None));
    };
    anyhow::ensure!(
        disaggregated,
        "--cluster runs roles on cluster nodes: set placement.mode = \"disaggregated\" and a node per role under [placement] (--set placement.mode=disaggregated ...)"
    );
    let name = args
        .name
        .clone()
        .unwrap_or_else(|| default_member_name(args.dev));
    // A launcher knows host names (the StatefulSet's pod 0, the Slurm head).
    let wait = Duration::from_secs(120);
    let seed = yatt::launch::dns::lookup("--cluster", seed_text, wait).await?;
    let listen = yatt::launch::dns::lookup("--listen", &args.listen, wait).await?;
    let mut builder = Node::builder(&name)
        .config(cluster_settings(args, &name, seed, listen)?)
        .listen(listen)
        .seed(seed);
    let mut certificate = None;
    builder = if args.dev {
        builder.dev_certs(&args.certs).dev_kind(CertKind::Trainer)
    } else {
        let identity = NodeIdentity::load(&args.certs, &name)?;
        if let Some(not_after) = identity.not_after() {
            let c = Certificate {
                path: args.certs.join(format!("{name}.pem")).display().to_string(),
                name: name.clone(),
                not_after,
            };
            // An expired one would be refused by every node with a TLS error that
            // names neither the certificate nor the fix: say it first.
            if let Err(e) = yatt::trainer::check_certificate(&c) {
                anyhow::bail!("{e}");
            }
            certificate = Some(c);
        }
        builder.identity(identity)
    };
    let node = yatt::register_roles(builder)
        .start()
        .await
        .with_context(|| format!("joining the cluster through {seed} as {name}"))?;
    Ok((node, None, certificate))
}

/// The transport and membership settings of this run's node on a cluster, from
/// `--node-config` and the `YATT_NODE__` environment, as a daemon reads them.
fn cluster_settings(
    args: &TrainArgs,
    name: &str,
    seed: SocketAddr,
    listen: SocketAddr,
) -> anyhow::Result<yatt::runtime::NodeConfig> {
    let flags = [
        ("node.name", name.to_string()),
        ("node.listen", listen.to_string()),
        ("node.seed", seed.to_string()),
    ];
    let file = args.node_config.as_deref();
    let r = yatt::node_config::load(file, &flags)
        .context("this process's node settings (--node-config, YATT_NODE__ variables)")?;
    Ok(yatt::runtime::NodeConfig {
        transport: r.runtime.transport,
        heartbeat_interval: r.runtime.heartbeat_interval,
        failure_timeout: r.runtime.failure_timeout,
        drain_timeout: r.runtime.drain_timeout,
        ..Default::default()
    })
}

/// This run's node name when `--name` is not given. With dev certificates any name can
/// be issued, so each process takes its own (`train-<pid>-<random>`): a second run
/// started while the first runs joins beside it instead of colliding with it. Without
/// them the name must be the one the certificate in `--certs` was issued for.
fn default_member_name(dev: bool) -> String {
    if !dev {
        return "train".into();
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    // Mixed so that two runs started in the same microsecond still differ.
    let random = (nanos ^ std::process::id().rotate_left(16)).wrapping_mul(0x9e37_79b9) >> 8;
    format!("train-{}-{random:06x}", std::process::id())
}

/// A metric of the step, NaN when absent (printed as `NaN`/`-`, never a panic).
fn metric(p: &Progress<'_>, name: &str) -> f64 {
    p.metrics.get(name).unwrap_or(f64::NAN)
}

/// Seconds left at this session's mean pace (a resumed run's earlier steps took no
/// time here).
fn eta_s(p: &Progress<'_>) -> f64 {
    let done_here = p.step.saturating_sub(p.first_step).max(1);
    p.elapsed_s / done_here as f64 * p.total.saturating_sub(p.step) as f64
}

/// `x` with `decimals` decimals and `unit`, or `-` when the step did not report it (a
/// job without a KL term has no `actor/kl`: "kl NaN" read like a failed update).
fn fixed(x: f64, decimals: usize, unit: &str) -> String {
    match x.is_finite() {
        true => format!("{x:.decimals$}{unit}"),
        false => "-".into(),
    }
}

/// The per-step line printed when stdout is not a terminal.
fn progress_line(p: &Progress<'_>) -> String {
    format!(
        "step {:>w$}/{} reward {} kl {} gen {} tok/s step {} elapsed {:.1}s eta {:.1}s",
        p.step,
        p.total,
        fixed(metric(p, "critic/rewards/mean"), 3, ""),
        fixed(metric(p, "actor/kl"), 4, ""),
        fixed(metric(p, "perf/gen_tokens_per_s"), 0, ""),
        fixed(metric(p, "timing_s/step"), 2, "s"),
        p.elapsed_s,
        eta_s(p),
        w = p.total.to_string().len(),
    )
}

/// `x` with a k/M suffix, or `-` when not a number.
fn short(x: f64) -> String {
    match x {
        x if !x.is_finite() => "-".into(),
        x if x.abs() >= 1e6 => format!("{:.1}M", x / 1e6),
        x if x.abs() >= 1e4 => format!("{:.1}k", x / 1e3),
        x => format!("{x:.0}"),
    }
}

/// Seconds as `4.2s`, `5m07s` or `2h03m`.
fn duration(s: f64) -> String {
    if !s.is_finite() {
        return "-".into();
    }
    let whole = s.round() as u64;
    match whole {
        _ if s < 60.0 => format!("{s:.1}s"),
        w if w < 3600 => format!("{}m{:02}s", w / 60, w % 60),
        w => format!("{}h{:02}m", w / 3600, w % 3600 / 60),
    }
}

/// The text beside the bar, short enough to fit an 80-column terminal with it: the
/// step's reward, KL, generation tokens/s (verl-style throughput when the rollout does
/// not report it), step time and ETA.
fn bar_message(p: &Progress<'_>) -> String {
    let mut tok_s = metric(p, "perf/gen_tokens_per_s");
    if !tok_s.is_finite() {
        tok_s = metric(p, "perf/throughput");
    }
    format!(
        "reward {} kl {} {} tok/s {}/step eta {}",
        fixed(metric(p, "critic/rewards/mean"), 3, ""),
        fixed(metric(p, "actor/kl"), 3, ""),
        short(tok_s),
        fixed(metric(p, "timing_s/step"), 2, "s"),
        duration(eta_s(p)),
    )
}

/// Where step progress goes: a bar on a terminal, plain lines elsewhere.
enum Reporter {
    Bar(ProgressBar),
    Lines,
}

impl Reporter {
    fn new(total: u64) -> Self {
        if !std::io::stdout().is_terminal() {
            return Reporter::Lines;
        }
        let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stdout());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner:.green} step {pos}/{len} [{wide_bar:.cyan/blue}] {msg}",
            )
            .expect("a valid indicatif template")
            .progress_chars("=> "),
        );
        // Keeps the spinner and clock moving through set-up and long steps.
        bar.enable_steady_tick(Duration::from_millis(200));
        Reporter::Bar(bar)
    }

    fn step(&self, p: &Progress<'_>) {
        match self {
            Reporter::Bar(bar) => {
                bar.set_position(p.step);
                bar.set_message(bar_message(p));
            }
            Reporter::Lines => println!("{}", progress_line(p)),
        }
    }

    /// Stops the bar, leaving its last state on screen, before the summary or an error
    /// is printed.
    fn finish(&self) {
        if let Reporter::Bar(bar) = self {
            bar.finish();
        }
    }
}

/// Serves the live view of the run in `job.job.output_dir` and of `node`'s cluster on
/// `addr` (see `yatt::view`); prints its URL. Returns what stops it.
async fn serve_view(
    job: &JobConfig,
    node: &Node,
    addr: &str,
) -> anyhow::Result<(
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
)> {
    use yatt::view::{RunSource, View};
    let addr = yatt::view::parse_http_addr(addr).map_err(anyhow::Error::msg)?;
    yatt::view::warn_if_exposed(addr);
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
        format!("cannot listen for HTTP on {addr} (--http; is the port in use?)")
    })?;
    let bound = listener.local_addr()?;
    let view = View::new()
        .cluster(node)
        .run(RunSource::new(&job.job.output_dir, Some(job.job.steps)));
    let app = yatt::http::with_view(node, view);
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(async move {
        let _ = yatt::view::serve(listener, app, async {
            let _ = stopped.await;
        })
        .await;
    });
    println!("view: http://{bound}/");
    Ok((stop, task))
}

async fn run_job(job: JobConfig, resume: bool, args: TrainArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let (node, _certs, certificate) = start_node(&job, &args).await?;
    if args.dry_run {
        let options = TrainOptions {
            resume,
            certificate,
            ..Default::default()
        };
        let result = dry_run(&job, &node, options).await;
        // Leaving the cluster releases anything of this run still on the nodes.
        node.shutdown().await;
        let dry = result?;
        println!("{dry}");
        anyhow::ensure!(
            dry.passed(),
            "the dry run found failures (FAIL lines above)"
        );
        return Ok(());
    }
    println!(
        "job {}: {} steps, model {}, task {}, {} x {} samples per step, {} controller(s), output {}",
        job.job.name,
        job.job.steps,
        job.model.source,
        if job.data.jsonl.is_empty() { job.data.task.to_string() } else { job.data.jsonl.clone() },
        job.data.prompts_per_step,
        job.data.samples_per_prompt,
        job.job.controllers,
        job.job.output_dir.display()
    );
    if args.cluster.is_some() {
        let p = &job.placement;
        let critic = match job.algorithm.name.needs_critic() {
            true => format!(", critic on {}", p.critic),
            false => String::new(),
        };
        let joined = format!(
            "cluster: joined as {} through {}",
            node.name(),
            args.cluster.clone().unwrap_or_default()
        );
        if p.live {
            let reference = match job.algorithm.kl_mode {
                yatt::trainer::KlMode::None => String::new(),
                // An empty one is refused with its fix when the job is built.
                _ if p.reference.is_empty() => String::new(),
                _ => format!(", reference on {}", p.reference),
            };
            println!(
                "{joined}; live placement over the devices of {}{reference}, reward on {}",
                p.nodes.join(", "),
                p.reward
            );
        } else {
            println!(
                "{joined}; rollout on {}, policy on {}, reference on {}, reward on {}{critic}",
                p.rollout, p.policy, p.reference, p.reward
            );
        }
    }
    let view = match &args.http {
        Some(addr) => Some(serve_view(&job, &node, addr).await?),
        None => None,
    };
    let reporter = Reporter::new(job.job.steps);
    let options = TrainOptions {
        resume,
        certificate,
        ..Default::default()
    };
    let result = train_with(&job, &node, options, |p| reporter.step(p)).await;
    reporter.finish();
    // Leaving the cluster releases the roles this run spawned, on success or failure.
    node.shutdown().await;
    if let Some((stop, task)) = view {
        let _ = stop.send(());
        let _ = task.await;
    }
    let summary = result?;
    let r = &summary.rewards;
    let k = r.len().min(5);
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    println!(
        "done: {} steps in {:.1}s (total {:.1}s); reward first {k} steps {:.3}, last {k} {:.3}",
        summary.steps,
        summary.seconds,
        t0.elapsed().as_secs_f64(),
        mean(&r[..k]),
        mean(&r[r.len() - k..]),
    );
    println!(
        "metrics: {}\ntensorboard: tensorboard --logdir {}\nplots: yatt plot {}\ncheckpoint: {}",
        summary.metrics_path.display(),
        job.job.output_dir.display(),
        job.job.output_dir.display(),
        summary.checkpoint_dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use yatt::trainer::StepMetrics;

    #[test]
    fn dev_runs_get_names_of_their_own() {
        let a = default_member_name(true);
        assert!(
            a.starts_with(&format!("train-{}-", std::process::id())),
            "{a}"
        );
        yatt::runtime::validate_node_name(&a).unwrap();
        assert_eq!(default_member_name(false), "train");
    }

    fn progress(metrics: &StepMetrics) -> Progress<'_> {
        Progress {
            step: 2,
            total: 10,
            elapsed_s: 1.0,
            first_step: 0,
            metrics,
        }
    }

    /// Regression: after `--resume` the ETA divided this session's time by every step
    /// of the run, so it came out far too short.
    #[test]
    fn a_resumed_run_paces_its_eta_on_this_sessions_steps() {
        let m = StepMetrics::default();
        let p = Progress {
            step: 42,
            total: 80,
            elapsed_s: 4.0,
            first_step: 40,
            metrics: &m,
        };
        // Two steps in 4 s: 2 s a step, 38 to go.
        assert_eq!(eta_s(&p), 76.0);
    }

    #[test]
    fn the_bar_shows_reward_kl_tokens_step_time_and_eta() {
        let m = StepMetrics {
            step: 2,
            values: [
                ("critic/rewards/mean", 0.5),
                ("actor/kl", 0.0125),
                ("perf/gen_tokens_per_s", 75_234.0),
                ("timing_s/step", 0.5),
            ]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v))
            .collect(),
        };
        assert_eq!(
            bar_message(&progress(&m)),
            "reward 0.500 kl 0.013 75.2k tok/s 0.50s/step eta 4.0s"
        );
        assert!(progress_line(&progress(&m))
            .starts_with("step  2/10 reward 0.500 kl 0.0125 gen 75234 tok/s"));
    }

    #[test]
    fn missing_metrics_show_as_absent_and_throughput_stands_in() {
        let m = StepMetrics {
            step: 2,
            values: [("perf/throughput".to_string(), 1_500_000.0)].into(),
        };
        assert_eq!(
            bar_message(&progress(&m)),
            "reward - kl - 1.5M tok/s -/step eta 4.0s"
        );
        assert!(
            progress_line(&progress(&m))
                .starts_with("step  2/10 reward - kl - gen - tok/s step - elapsed"),
            "{}",
            progress_line(&progress(&m))
        );
    }

    #[test]
    fn durations_read_at_a_glance() {
        assert_eq!(duration(4.3), "4.3s");
        assert_eq!(duration(307.0), "5m07s");
        assert_eq!(duration(7380.0), "2h03m");
        assert_eq!(duration(f64::NAN), "-");
    }
}
