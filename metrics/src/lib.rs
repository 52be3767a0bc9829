//! # yatt-metrics
//!
//! A training run's metrics on disk, and pictures of them:
//! - [`RunWriter`] writes each step to `RUN_DIR/metrics.jsonl` (one JSON object per
//!   line, [`METRICS_FILE`]) and to a TensorBoard event file
//!   `RUN_DIR/events.out.tfevents.<secs>.<host>` ([`EventWriter`]);
//! - [`read_jsonl`] reads `metrics.jsonl` back as [`StepRecord`]s;
//! - [`process_memory`] reads the job process's resident memory and its peak;
//! - [`names`] are the metric names `yatt train` writes, for writers and readers alike;
//! - `plot_run` (feature `plot`) draws a run's reward, KL, stage timing and throughput as PNGs.
//!
//! What belongs here: the metrics file formats, their writers and readers, the metric
//! names, and pictures of a run. No tch and no actors: anything that has per-step
//! numbers can use it; what a metric means for placement or the simulator belongs
//! with them.
//!
//! ```
//! use std::collections::BTreeMap;
//! use yatt_metrics::names;
//! let dir = tempfile::tempdir()?;
//! let mut w = yatt_metrics::RunWriter::create(dir.path())?;
//! for step in 1..=3 {
//!     let m = BTreeMap::from([(names::REWARDS_MEAN.to_string(), 0.1 * step as f64)]);
//!     w.write_step(step, &m)?;
//! }
//! let steps = yatt_metrics::read_jsonl(w.metrics_path())?;
//! assert_eq!(steps[2].get(names::REWARDS_MEAN), Some(0.30000000000000004));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod crc32c;
mod error;
mod jsonl;
pub mod names;
#[cfg(feature = "plot")]
mod plot;
mod process;
mod tfevents;
mod writer;

pub use error::{MetricsError, WriteError};
pub use jsonl::{
    format_line, parse_line, read_jsonl, StepRecord, EVAL_FILE_NAME as EVAL_FILE,
    FILE_NAME as METRICS_FILE,
};
#[cfg(feature = "plot")]
pub use plot::{plot_compare, plot_run, PlotReport};
pub use process::{process_memory, ProcessMemory};
pub use tfevents::{read_records as read_event_records, EventWriter};
pub use writer::RunWriter;
