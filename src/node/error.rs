//! The daemon's error.

/// Why the daemon stopped with an error.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// A step failed; `context` says which.
    #[error("{context}: {source}")]
    Failed {
        /// What the daemon was doing.
        context: String,
        /// Why it failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The daemon refused its configuration or its roles; the text says how to fix it.
    #[error("{0}")]
    Refused(String),
}
