//! Logging set-up shared by the binaries: `tracing` with an env filter (`RUST_LOG`,
//! default `info`) and an optional JSON format.

use tracing_subscriber::{fmt, EnvFilter};

/// Errors from [`init`].
#[derive(Debug)]
pub struct LoggingError(String);

impl std::fmt::Display for LoggingError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "logging set-up failed: {}", self.0)
    }
}
impl std::error::Error for LoggingError {}

/// Installs the global subscriber. `RUST_LOG` selects what is logged (default `info`);
/// `json` switches to one JSON object per line, for log collectors.
pub fn init(json: bool) -> Result<(), LoggingError> {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new("info"))
        .map_err(|e| LoggingError(e.to_string()))?;
    let builder = fmt().with_env_filter(filter).with_writer(std::io::stderr);
    let result = if json {
        builder.json().try_init()
    } else {
        builder.try_init()
    };
    result.map_err(|e| LoggingError(e.to_string()))
}
