//! `yatt plot RUN_DIR [--out DIR]`: PNG plots of a run's `metrics.jsonl` (reward, KL,
//! stage timing, throughput); `yatt plot --compare RUN... --metric NAME --out FILE`:
//! one metric of several runs on one chart. The logic is in `yatt_metrics::plot`.

use std::path::PathBuf;

use anyhow::Context;
use yatt::metrics::{plot_compare, plot_run};

#[derive(clap::Args)]
pub struct PlotArgs {
    /// The run's output directory (`job.output_dir`), e.g. runs/demo-letters.
    run_dir: PathBuf,
    /// Where the PNGs go [default: RUN_DIR/plots]; with --compare, the PNG file.
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// More runs to draw with RUN_DIR on one chart of --metric.
    #[arg(long, num_args = 1.., value_name = "RUN_DIR")]
    compare: Vec<PathBuf>,
    /// With --compare: the metric to draw.
    #[arg(long, default_value = "critic/rewards/mean")]
    metric: String,
    /// With --compare: the file each run holds the metric in (its format is
    /// metrics.jsonl's).
    #[arg(long, default_value = "metrics.jsonl")]
    file: String,
}

pub fn run(args: PlotArgs) -> anyhow::Result<()> {
    if !args.compare.is_empty() {
        let mut runs = vec![args.run_dir.clone()];
        runs.extend(args.compare);
        let out = args.out.context("--compare needs --out FILE.png")?;
        plot_compare(&runs, &args.file, &args.metric, &args.metric, &out)?;
        println!("{}", out.display());
        return Ok(());
    }
    let out = args.out.unwrap_or_else(|| args.run_dir.join("plots"));
    let report = plot_run(&args.run_dir, &out)?;
    for path in &report.written {
        println!("{}", path.display());
    }
    for (file, why) in &report.skipped {
        println!("skipped {file}: {why}");
    }
    Ok(())
}
