//! What the critic is asked and answers, and how it trains: the messages of a critic,
//! whole or sharded.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::algo::loss::ValueLossConfig;
use crate::role::RoleError;
use crate::sample::{Sample, SampleId};

/// What the critic is asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CriticRequest {
    /// Fill in `values`.
    Values(Vec<Sample>),
    /// Train on the samples' `returns` (needs `values` from before the update too).
    Train(Vec<Sample>),
    /// Save a checkpoint (HF safetensors with the `v_head`, plus optimizer state).
    SaveCheckpoint(PathBuf),
}

/// What the critic answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum CriticResponse {
    /// Samples with `values` set.
    Valued(Vec<Sample>),
    /// The update's report.
    Trained(CriticReport),
    /// The checkpoint was written.
    Saved,
}

/// What one critic update did (means over optimizer steps / micro-batches).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CriticReport {
    /// The samples trained on (for the ledger).
    pub trained: Vec<SampleId>,
    /// Mean value loss (`critic/vf_loss`).
    pub vf_loss: f64,
    /// Fraction of tokens where the clipped value error was larger (`critic/vf_clipfrac`).
    pub vf_clipfrac: f64,
    /// Mean predicted value (`critic/vpred_mean`).
    pub vpred_mean: f64,
    /// Mean gradient norm before clipping.
    pub grad_norm: f64,
    /// Seconds spent.
    pub seconds: f64,
}

/// How the critic trains.
#[derive(Debug, Clone, PartialEq)]
pub struct CriticConfig {
    /// Value clipping and aggregation.
    pub loss: ValueLossConfig,
    /// Samples per forward/backward pass.
    pub micro_batch_size: usize,
    /// Optimizer steps per update.
    pub mini_batches: usize,
    /// Token id used to pad batches.
    pub pad_id: i64,
}

impl Default for CriticConfig {
    fn default() -> Self {
        CriticConfig {
            loss: ValueLossConfig::default(),
            micro_batch_size: 8,
            mini_batches: 1,
            pad_id: 0,
        }
    }
}

impl CriticConfig {
    /// Refuses micro-batch or mini-batch counts of 0.
    pub(crate) fn check(&self) -> Result<(), RoleError> {
        if self.micro_batch_size == 0 || self.mini_batches == 0 {
            return Err(RoleError::BadRequest(
                "critic micro_batch_size and mini_batches must be >= 1".into(),
            ));
        }
        Ok(())
    }
}
