//! `yatt plot RUN_DIR [--out DIR]`: PNG plots of a run's `metrics.jsonl` (reward, KL,
//! stage timing, throughput). The logic is in `yatt_metrics::plot`.

use std::path::PathBuf;

use yatt::metrics::plot_run;

#[derive(clap::Args)]
pub struct PlotArgs {
    /// The run's output directory (`job.output_dir`), e.g. runs/demo-letters.
    run_dir: PathBuf,
    /// Where the PNGs go [default: RUN_DIR/plots].
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
}

pub fn run(args: PlotArgs) -> anyhow::Result<()> {
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
