//! A preflight's results: one line per check per node, and the trainer's certificate
//! the checks look at. A leaf of `preflight`, so its parts can share it without
//! importing each other.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::SystemTime;

use super::probe::{Outcome, ProbeResult};
use crate::error::JobError;

/// The trainer's certificate, for the check that it outlives the run.
#[derive(Debug, Clone)]
pub struct Certificate {
    /// Where it is (for messages), e.g. `certs/train.pem`.
    pub path: String,
    /// The node name it was issued for.
    pub name: String,
    /// When it expires.
    pub not_after: SystemTime,
}

/// One check's result on one node.
#[derive(Debug, Clone)]
pub struct CheckLine {
    /// The node it ran on (the trainer's own name for its checks).
    pub node: String,
    /// The check, e.g. `checkpoint path`.
    pub check: String,
    /// The config key it is about.
    pub key: String,
    /// Pass, warning or failure, with what was seen and the fix.
    pub outcome: Outcome,
}

impl std::fmt::Display for CheckLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (tag, text) = match &self.outcome {
            Outcome::Pass(t) => ("ok  ", t),
            Outcome::Warn(t) => ("warn", t),
            Outcome::Fail(t) => ("FAIL", t),
        };
        write!(
            f,
            "{tag} {}: {} ({}): {text}",
            self.node, self.check, self.key
        )
    }
}

/// Every check's result.
#[derive(Debug, Clone, Default)]
pub struct PreflightReport {
    /// One line per check per node.
    pub lines: Vec<CheckLine>,
    /// The data directory of each node that answered (where it writes for peers).
    pub data_dirs: BTreeMap<String, PathBuf>,
}

impl PreflightReport {
    /// The failed checks.
    pub fn failures(&self) -> Vec<&CheckLine> {
        self.lines
            .iter()
            .filter(|l| matches!(l.outcome, Outcome::Fail(_)))
            .collect()
    }

    /// The warnings.
    pub fn warnings(&self) -> Vec<&CheckLine> {
        self.lines
            .iter()
            .filter(|l| matches!(l.outcome, Outcome::Warn(_)))
            .collect()
    }

    /// The report as the error a run stops with, when a check failed.
    pub fn into_result(self) -> Result<Self, JobError> {
        let failed: Vec<String> = self.failures().iter().map(|l| l.to_string()).collect();
        if failed.is_empty() {
            return Ok(self);
        }
        Err(JobError::Preflight {
            checks: self.lines.len(),
            failed,
        })
    }

    pub(crate) fn push(&mut self, node: &str, r: ProbeResult) {
        self.lines.push(CheckLine {
            node: node.into(),
            check: r.check,
            key: r.key,
            outcome: r.outcome,
        });
    }

    pub(crate) fn line(&mut self, node: &str, check: &str, key: &str, outcome: Outcome) {
        self.lines.push(CheckLine {
            node: node.into(),
            check: check.into(),
            key: key.into(),
            outcome,
        });
    }
}
