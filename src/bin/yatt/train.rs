//! `yatt train CONFIG [--set key=value ...] [--cluster SEED_ADDR]`: a training run.
//! Embedded (no `--cluster`): one node starts in this process (dev certificates in a
//! temp dir) and the job's roles are built on it. With `--cluster`: this process joins
//! the cluster as a node and spawns each role on the node `[placement]` names. Then
//! `job.steps` steps run; metrics go to `OUTPUT_DIR/metrics.jsonl` and the policy to
//! `OUTPUT_DIR/checkpoint`. The logic is in `yatt_roles::job` and `yatt_roles::remote`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use yatt::roles::job::{train, JobConfig, Progress};
use yatt::runtime::tls::NodeIdentity;
use yatt::runtime::Node;

#[derive(clap::Args)]
pub struct TrainArgs {
    /// The job config (TOML), e.g. config/demo-letters.toml.
    config: PathBuf,
    /// Override a config value: a dotted key and a TOML value, e.g. `--set job.steps=10`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
    /// Join the cluster through this member and run each role on the node that
    /// `[placement]` names (placement.mode = "disaggregated").
    #[arg(long, value_name = "SEED_ADDR")]
    cluster: Option<SocketAddr>,
    /// With --cluster: this process's node name (its certificate's CN).
    #[arg(long, default_value = "train", requires = "cluster")]
    name: String,
    /// With --cluster: the certificate directory (ca.pem, NAME.pem, NAME.key; with
    /// --dev, the dev CA the nodes were started with).
    #[arg(long, default_value = "certs", requires = "cluster")]
    certs: PathBuf,
    /// With --cluster: issue this node's certificate from the dev CA in --certs (as
    /// `yatt-node run --dev` does).
    #[arg(long, requires = "cluster")]
    dev: bool,
    /// With --cluster: QUIC listen address of this process's node; the nodes must be
    /// able to reach it.
    #[arg(long, default_value = "127.0.0.1:0", requires = "cluster")]
    listen: SocketAddr,
}

pub fn run(args: TrainArgs) -> anyhow::Result<()> {
    let job = JobConfig::load(&args.config, &args.sets)?;
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run_job(job, args))
}

/// The node this run lives on: a throw-away embedded one, or a member of the cluster.
async fn start_node(
    job: &JobConfig,
    args: &TrainArgs,
) -> anyhow::Result<(Node, Option<tempfile::TempDir>)> {
    let disaggregated = job.placement.mode == "disaggregated";
    let Some(seed) = args.cluster else {
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
        return Ok((node, Some(certs)));
    };
    anyhow::ensure!(
        disaggregated,
        "--cluster runs roles on cluster nodes: set placement.mode = \"disaggregated\" and a node per role under [placement] (--set placement.mode=disaggregated ...)"
    );
    let mut builder = Node::builder(&args.name).listen(args.listen).seed(seed);
    builder = if args.dev {
        builder.dev_certs(&args.certs)
    } else {
        builder.identity(NodeIdentity::load(&args.certs, &args.name)?)
    };
    let node = yatt::register_roles(builder)
        .start()
        .await
        .with_context(|| format!("joining the cluster through {seed} as {}", args.name))?;
    Ok((node, None))
}

fn progress_line(p: &Progress<'_>) -> String {
    let m = |k: &str| p.metrics.get(k).unwrap_or(f64::NAN);
    let eta = p.elapsed_s / p.step as f64 * (p.total - p.step) as f64;
    format!(
        "step {:>w$}/{} reward {:.3} kl {:.4} gen {:.0} tok/s step {:.2}s elapsed {:.1}s eta {:.1}s",
        p.step,
        p.total,
        m("critic/rewards/mean"),
        m("actor/kl"),
        m("perf/gen_tokens_per_s"),
        m("timing_s/step"),
        p.elapsed_s,
        eta,
        w = p.total.to_string().len(),
    )
}

async fn run_job(job: JobConfig, args: TrainArgs) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let (node, _certs) = start_node(&job, &args).await?;
    println!(
        "job {}: {} steps, model {}, task {}, {} x {} samples per step, {} controller(s), output {}",
        job.job.name,
        job.job.steps,
        job.model.source,
        if job.data.jsonl.is_empty() { &job.data.task } else { &job.data.jsonl },
        job.data.prompts_per_step,
        job.data.samples_per_prompt,
        job.job.controllers,
        job.job.output_dir.display()
    );
    if args.cluster.is_some() {
        let p = &job.placement;
        println!(
            "cluster: joined as {} through {}; rollout on {}, policy on {}, reference on {}, reward on {}",
            node.name(),
            args.cluster.map(|a| a.to_string()).unwrap_or_default(),
            p.rollout,
            p.policy,
            p.reference,
            p.reward
        );
    }
    let result = train(&job, &node, |p| println!("{}", progress_line(p))).await;
    // Leaving the cluster releases the roles this run spawned, on success or failure.
    node.shutdown().await;
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
        "metrics: {}\ncheckpoint: {}",
        summary.metrics_path.display(),
        summary.checkpoint_dir.display()
    );
    Ok(())
}
