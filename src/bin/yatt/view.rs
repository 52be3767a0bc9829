//! `yatt view RUN_DIR [--http ADDR]`: the live view's run page over a run directory's
//! `metrics.jsonl` (and `placement.jsonl`, `eval.jsonl`), served on loopback until
//! interrupted. A run still writing there is followed as it goes. The page and its
//! data are `yatt::view`'s, as `yatt train --http` serves them.

use std::path::PathBuf;

use anyhow::Context as _;
use yatt::trainer::{JobConfig, JOB_FILE};
use yatt::view::{RunSource, View};

#[derive(clap::Args)]
pub struct ViewArgs {
    /// The run's output directory (`job.output_dir`), holding its metrics.jsonl.
    run_dir: PathBuf,
    /// Where to serve: HOST:PORT, or a port on loopback (0: any free one).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    http: String,
}

pub fn run(args: ViewArgs) -> anyhow::Result<()> {
    let metrics = args.run_dir.join(yatt::metrics::METRICS_FILE);
    anyhow::ensure!(
        metrics.is_file(),
        "{} has no {}: give the output_dir of a `yatt train` run",
        args.run_dir.display(),
        yatt::metrics::METRICS_FILE
    );
    let addr = yatt::view::parse_http_addr(&args.http).map_err(anyhow::Error::msg)?;
    // The job's step count, for the ETA of a run still going; a run without its job
    // file is shown without.
    let total = JobConfig::load(&args.run_dir.join(JOB_FILE), &[])
        .ok()
        .map(|j| j.job.steps);
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?
        .block_on(async move {
            yatt::view::warn_if_exposed(addr);
            let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| {
                format!("cannot listen for HTTP on {addr} (--http; is the port in use?)")
            })?;
            let bound = listener.local_addr()?;
            let app = View::new()
                .run(RunSource::new(&args.run_dir, total))
                .router()
                .layer(axum::middleware::from_fn(yatt::view::limit_query));
            println!(
                "view: http://{bound}/ (run {}; Ctrl-C stops)",
                args.run_dir.display()
            );
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
            yatt::view::serve(listener, app, async move {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            })
            .await
            .context("serving the view")
        })
}
