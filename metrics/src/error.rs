//! What can go wrong writing, reading or plotting a run's metrics.

use std::path::PathBuf;

/// Writing a metrics file failed.
#[derive(Debug, thiserror::Error)]
#[error("writing {path}: {source}")]
pub struct WriteError {
    /// The file or directory.
    pub path: PathBuf,
    /// The OS error.
    pub source: std::io::Error,
}

/// Reading a run's metrics or plotting them failed.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The run directory has no `metrics.jsonl`.
    #[error(
        "{path} not found; fix: pass a run's output directory (the job's `job.output_dir`, \
         e.g. runs/demo-letters), where `yatt train` writes metrics.jsonl"
    )]
    NoMetrics {
        /// The path looked for.
        path: PathBuf,
    },
    /// `metrics.jsonl` exists but could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// A line of `metrics.jsonl` is not a step's metrics.
    #[error(
        "{path}:{line}: {reason}; fix: every line must be a JSON object with an integer \
         \"step\" and numbers (or null) for the metrics, as `yatt train` writes them"
    )]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        reason: String,
    },
    /// `metrics.jsonl` has no steps to plot.
    #[error("{path} has no steps yet; fix: plot after the run's first step has finished")]
    Empty {
        /// The file.
        path: PathBuf,
    },
    /// No step of the file has the metric asked for.
    #[error("{path} has no `{metric}` at any step; fix: name a metric the run records (see its first line)")]
    NoSuchMetric {
        /// The file.
        path: PathBuf,
        /// The metric asked for.
        metric: String,
    },
    /// Drawing a plot failed.
    #[error("drawing {path}: {reason}")]
    Draw {
        /// The PNG being drawn.
        path: PathBuf,
        /// The drawing library's message.
        reason: String,
    },
    /// Writing a plot failed.
    #[error(transparent)]
    Write(#[from] WriteError),
}
