//! `yatt bench controller`: the controller-overhead benchmark of `yatt_roles::bench`,
//! on an in-process node.

use std::time::Duration;

use anyhow::Context as _;
use yatt::runtime::Node;
use yatt::trainer::{markdown_table, run_controller_bench, ControllerBenchOptions};

#[derive(clap::Args)]
pub struct BenchControllerArgs {
    /// Replica counts, comma-separated.
    #[arg(long, value_delimiter = ',', default_values_t = [1, 2, 4, 8, 16, 32])]
    replicas: Vec<usize>,
    /// Prompts per replica and step.
    #[arg(long, default_value_t = 8)]
    prompts_per_replica: usize,
    /// Samples per prompt.
    #[arg(long, default_value_t = 8)]
    n: u32,
    /// Response tokens per sample.
    #[arg(long, default_value_t = 64)]
    response_len: usize,
    /// Fake generation time per request, milliseconds.
    #[arg(long, default_value_t = 20)]
    gen_ms: u64,
    /// Fake update time per optimizer step, milliseconds.
    #[arg(long, default_value_t = 20)]
    train_ms: u64,
    /// Measured steps per case.
    #[arg(long, default_value_t = 5)]
    steps: usize,
}

pub fn run(a: BenchControllerArgs) -> anyhow::Result<()> {
    if a.replicas.is_empty() || a.replicas.contains(&0) {
        anyhow::bail!("--replicas needs counts >= 1, e.g. --replicas 1,2,4");
    }
    let opts = ControllerBenchOptions {
        replicas: a.replicas,
        prompts_per_replica: a.prompts_per_replica,
        n: a.n,
        response_len: a.response_len,
        gen_time: Duration::from_millis(a.gen_ms),
        train_time: Duration::from_millis(a.train_ms),
        steps: a.steps.max(1),
    };
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(async {
            let certs = tempfile::tempdir()?;
            let node = Node::builder("bench-0")
                .dev_certs(certs.path())
                .start()
                .await
                .context("starting the in-process node")?;
            let rows = run_controller_bench(&node, &opts).await?;
            println!("{}", markdown_table(&rows));
            node.shutdown().await;
            anyhow::Ok(())
        })
}
