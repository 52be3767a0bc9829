//! `yatt train CONFIG [--set key=value ...]`: an embedded training run. One node starts
//! in this process (dev certificates in a temp dir), the job's roles and controllers
//! are built on it, and `job.steps` steps run; metrics go to `OUTPUT_DIR/metrics.jsonl`
//! and the policy to `OUTPUT_DIR/checkpoint`. The logic is in `yatt_roles::job`.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context as _;
use yatt::roles::job::{train_with, JobConfig, Progress, TrainOptions, JOB_FILE};
use yatt::runtime::Node;

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
        .block_on(run_job(job, resume))
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

async fn run_job(job: JobConfig, resume: bool) -> anyhow::Result<()> {
    let t0 = Instant::now();
    let certs = tempfile::tempdir()?;
    let node = Node::builder("train-0")
        .dev_certs(certs.path())
        .start()
        .await
        .context("starting the in-process node")?;
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
    let summary = train_with(
        &job,
        &node,
        TrainOptions {
            resume,
            ..Default::default()
        },
        |p| println!("{}", progress_line(p)),
    )
    .await?;
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
    node.shutdown().await;
    Ok(())
}
