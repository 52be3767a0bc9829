//! `yatt placement show RUN_DIR`: the live placement actor's view of a run, from
//! `RUN_DIR/placement.jsonl` (the plan in force, each group's utilisation, the last
//! decisions with their reasons). The rendering is `yatt_placement::render_records`.

use std::path::PathBuf;

use anyhow::Context;
use yatt_placement::{parse_records, render_records, RECORD_FILE};

#[derive(clap::Subcommand)]
pub enum PlacementCommand {
    /// Print a run's current plan, per-group utilisation and last decisions.
    Show(ShowArgs),
}

#[derive(clap::Args)]
pub struct ShowArgs {
    /// The run's output directory (`job.output_dir`) of a job run with placement.live.
    run_dir: PathBuf,
    /// Steps the utilisation is averaged over.
    #[arg(long, default_value_t = 5)]
    window: usize,
    /// Decisions to show.
    #[arg(long, default_value_t = 5)]
    last: usize,
}

pub fn run(cmd: PlacementCommand) -> anyhow::Result<()> {
    let PlacementCommand::Show(args) = cmd;
    let path = args.run_dir.join(RECORD_FILE);
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "reading {}: run the job with [placement] live = true to get one",
            path.display()
        )
    })?;
    let records = parse_records(&text).with_context(|| path.display().to_string())?;
    print!("{}", render_records(&records, args.window, args.last)?);
    Ok(())
}
