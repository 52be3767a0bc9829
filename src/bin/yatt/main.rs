//! `yatt`: the command-line front end. Each subcommand is a thin shell over a library
//! crate; the logic lives there.

mod bench_controller;
mod bench_reshard;
mod bench_runtime;
mod bench_sharded;
mod checkpoint;
mod config_cmd;
mod demo;
mod engine_cmds;
mod eval;
mod generate;
mod placement;
mod plot;
mod reward_model;
mod sim;
mod train;
mod view;

use clap::{Parser, Subcommand};

#[global_allocator]
static ALLOC: yatt::Allocator = yatt::Allocator;

#[derive(Parser)]
#[command(
    name = "yatt",
    version,
    about = "RLHF training with addressable actors over QUIC"
)]
pub(crate) struct Cli {
    /// Log as JSON lines instead of human-readable text.
    #[arg(long, global = true, env = "YATT_LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The embedded single-machine default: a local cluster in this process, shown working.
    Demo(demo::DemoArgs),
    /// Train: run a job config (TOML) on an in-process node (embedded mode).
    Train(train::TrainArgs),
    /// Serve a run directory's live view (curves, stage timeline, placement decisions,
    /// recoveries) on loopback and print its URL.
    View(view::ViewArgs),
    /// Plot a run's metrics.jsonl as PNGs: reward, KL, stage timing, throughput.
    Plot(plot::PlotArgs),
    /// Train a scalar reward model (backbone + `score` head) on scored responses or
    /// preference pairs, for `reward.kind = "model"`.
    RewardModel(reward_model::RewardModelArgs),
    /// Evaluate: greedy accuracy of a job's model or checkpoint on held-out prompts.
    Eval(eval::EvalArgs),
    /// Simulate placements of an RLHF job on clusters of 8 to 4,096 GPUs (colocation,
    /// the best static split, dynamic placement) against the lower bound; or time the
    /// plan search (--bench), or fit the simulator to a run's metrics (--calibrate).
    Sim(sim::SimArgs),
    /// The live placement of a run: `yatt placement show RUN_DIR`.
    #[command(subcommand)]
    Placement(placement::PlacementCommand),
    /// Generate from a model directory or .gguf file: prompts from --prompt or stdin,
    /// greedy or sampled, as text or JSON lines.
    Generate(generate::GenerateArgs),
    /// Sharded checkpoints: `yatt checkpoint merge SOURCE OUT` writes one HF model
    /// directory.
    #[command(subcommand)]
    Checkpoint(checkpoint::CheckpointCommand),
    /// Import a GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1) as an HF model directory.
    ImportGguf(engine_cmds::ImportGgufArgs),
    /// The generated references: every config key (`yatt config reference`) and every
    /// command's help (`yatt config cli-reference`), as Markdown.
    #[command(subcommand)]
    Config(config_cmd::ConfigCommand),
    /// Benchmarks; figures go to stdout as a markdown table.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand)]
enum BenchCommand {
    /// Generation, scoring and training throughput of the engine.
    Engine(engine_cmds::BenchEngineArgs),
    /// The roofline: copy bandwidth, matmul TFLOP/s, decode and training throughput of a
    /// random model, all on one device (cpu or cuda), with the fraction of each limit used.
    Gpu(engine_cmds::BenchGpuArgs),
    /// Actor-runtime latency and throughput: two processes, and in-process.
    Runtime(bench_runtime::BenchRuntimeArgs),
    /// Per-step controller overhead, parallel controllers vs a single driver, as the
    /// rollout replicas grow (fake compute).
    Controller(bench_controller::BenchControllerArgs),
    /// Sharded training (ZeRO-3) against the replicated trainer: each rank a process
    /// over the QUIC ring; step time, memory per rank, bytes moved, memory caps.
    Sharded(bench_sharded::BenchShardedArgs),
    /// Resharding a sharded replica N → M: in memory (the live placement's move of a
    /// rank) against through a checkpoint on disk (a resume at another rank count).
    Reshard(bench_reshard::BenchReshardArgs),
}

fn main() -> std::process::ExitCode {
    yatt::exit_code(real_main())
}

fn real_main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    yatt::logging::init(cli.log_json)?;
    match cli.command {
        Command::Demo(args) => demo::run(args),
        Command::Train(args) => train::run(args),
        Command::Plot(args) => plot::run(args),
        Command::View(args) => view::run(args),
        Command::Eval(args) => eval::run(args),
        Command::RewardModel(args) => reward_model::run(args),
        Command::Sim(args) => sim::run(args),
        Command::Placement(cmd) => placement::run(cmd),
        Command::Generate(args) => generate::run(args),
        Command::ImportGguf(args) => engine_cmds::import_gguf(args),
        Command::Checkpoint(cmd) => checkpoint::run(cmd),
        Command::Config(cmd) => config_cmd::run(cmd),
        Command::Bench(BenchCommand::Engine(args)) => engine_cmds::bench_engine(args),
        Command::Bench(BenchCommand::Gpu(args)) => engine_cmds::bench_gpu(args),
        Command::Bench(BenchCommand::Runtime(args)) => bench_runtime::run(args),
        Command::Bench(BenchCommand::Controller(args)) => bench_controller::run(args),
        Command::Bench(BenchCommand::Sharded(args)) => bench_sharded::run(args),
        Command::Bench(BenchCommand::Reshard(args)) => bench_reshard::run(args),
    }
}
