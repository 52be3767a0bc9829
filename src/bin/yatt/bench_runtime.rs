//! `yatt bench runtime`: actor-runtime latency and throughput.

#[derive(clap::Args)]
pub struct BenchRuntimeArgs {}

pub fn run(_args: BenchRuntimeArgs) -> anyhow::Result<()> {
    anyhow::bail!("bench runtime is not built yet")
}
