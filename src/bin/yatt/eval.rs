//! `yatt eval CONFIG [--checkpoint DIR] [--prompts N]`: the accuracy of a job's base
//! model, or of a checkpoint `yatt train` wrote, with greedy answers on held-out prompts
//! and the job's reward. The logic is in `yatt_roles::eval`.

use std::path::PathBuf;

use anyhow::Context as _;
use yatt::trainer::JobConfig;
use yatt::trainer::{evaluate, EvalOptions, Split};

#[derive(Clone, Copy, clap::ValueEnum)]
enum SplitArg {
    /// The task drawn with another seed, without any training prompt.
    HeldOut,
    /// The first training prompts.
    Train,
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// The job config (TOML), e.g. config/smollm2-addition.toml.
    config: PathBuf,
    /// A checkpoint directory written by `yatt train` (default: the config's base model).
    #[arg(long)]
    checkpoint: Option<PathBuf>,
    /// Number of prompts, one greedy answer each.
    #[arg(long, default_value_t = 200)]
    prompts: usize,
    /// Which prompts.
    #[arg(long, value_enum, default_value = "held-out")]
    split: SplitArg,
    /// Reward at which an answer counts as correct.
    #[arg(long, default_value_t = 1.0)]
    pass_score: f64,
    /// Print this many prompts with their answers.
    #[arg(long, default_value_t = 5)]
    show: usize,
    /// Also write the report, every answer included, as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
    /// Override a config value, as for `yatt train`: e.g. `--set rollout.max_new_tokens=32`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

pub fn run(args: EvalArgs) -> anyhow::Result<()> {
    let job = JobConfig::load(&args.config, &args.sets)?;
    let options = EvalOptions {
        prompts: args.prompts,
        checkpoint: args.checkpoint,
        split: match args.split {
            SplitArg::HeldOut => Split::HeldOut,
            SplitArg::Train => Split::Train,
        },
        pass_score: args.pass_score,
    };
    let report = evaluate(&job, &options)?;
    for s in report.samples.iter().take(args.show) {
        println!(
            "{} {:?} -> {:?} (reference {:?}, reward {:.3})",
            if s.correct { "ok  " } else { "miss" },
            s.prompt,
            s.response,
            s.reference.as_deref().unwrap_or("-"),
            s.reward
        );
    }
    println!(
        "eval {}: {} on {} {} prompts, greedy, at most {} new tokens: accuracy {:.3} ({}/{}), mean reward {:.3}, {:.1}s",
        job.job.name,
        report.model,
        report.prompts,
        report.split,
        report.max_new_tokens,
        report.accuracy,
        report.correct,
        report.prompts,
        report.mean_reward,
        report.seconds
    );
    if let Some(rate) = report.tool_call_rate {
        println!("tool-call rate {rate:.3} (answers that called a tool at least once)");
    }
    if let Some(path) = &args.json {
        let text = serde_json::to_string_pretty(&report)?;
        std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        println!("report: {}", path.display());
    }
    Ok(())
}
