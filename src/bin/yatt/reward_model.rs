//! `yatt reward-model CONFIG --data FILE.jsonl --out DIR`: trains a scalar reward model
//! (the job's model with a `score` head) on scored responses or preference pairs and
//! saves it as an HF directory for `reward.kind = "model"`. The logic is in
//! `yatt_roles::train_reward_model`.

use std::path::PathBuf;

use yatt::roles::{load_rm_jsonl, train_reward_model, RmTrainConfig};
use yatt::trainer::{base_model, JobConfig};

#[derive(clap::Args)]
pub struct RewardModelArgs {
    /// The job config (TOML): its `model.source` is the backbone, its codec (tokenizer,
    /// chat template) reads the text as the rollout does.
    config: PathBuf,
    /// Training set, JSONL: `{"prompt", "response", "score"}` or
    /// `{"prompt", "chosen", "rejected"}` per line.
    #[arg(long)]
    data: PathBuf,
    /// Where to write the reward model (an HF directory).
    #[arg(long)]
    out: PathBuf,
    /// Optimizer steps.
    #[arg(long, default_value_t = 200)]
    steps: usize,
    /// Examples per step.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// Learning rate (AdamW).
    #[arg(long, default_value_t = 1e-4)]
    lr: f64,
    /// Override a config value, as for `yatt train`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    sets: Vec<String>,
}

pub fn run(args: RewardModelArgs) -> anyhow::Result<()> {
    let job = JobConfig::load(&args.config, &args.sets)?;
    let examples = load_rm_jsonl(&args.data)?;
    let (model, codec, pad_id) = base_model(&job)?;
    let config = RmTrainConfig {
        steps: args.steps,
        batch: args.batch,
        optim: yatt::engine::TrainConfig {
            lr: args.lr,
            max_grad_norm: Some(1.0),
            seed: job.job.seed,
            ..Default::default()
        },
        pad_id,
    };
    let t = std::time::Instant::now();
    let (model, stats) = train_reward_model(model, &*codec, &examples, &config)?;
    let tokenizer = job.model.source.dir().map(PathBuf::from);
    yatt::engine::save_pretrained(&model, &args.out, tokenizer.as_deref())?;
    let loss = |s: &[yatt::engine::StepStats]| {
        s.iter().map(|s| s.loss).sum::<f64>() / s.len().max(1) as f64
    };
    let k = (stats.len() / 10).max(1);
    println!(
        "reward model: {} examples, {} steps in {:.1}s, loss {:.4} (first {k} steps) → {:.4} (last {k}); saved to {}\nuse it with: [reward] kind = \"model\", model = {:?}",
        examples.len(),
        stats.len(),
        t.elapsed().as_secs_f64(),
        loss(&stats[..k]),
        loss(&stats[stats.len() - k..]),
        args.out.display(),
        args.out.display().to_string()
    );
    Ok(())
}
