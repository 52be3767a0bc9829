//! What a train request did: a leaf of `policy`, so its parts can share it without
//! importing each other.

use crate::sample::SampleId;

/// What one train request did (means over micro-batches, sums where noted).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct TrainReport {
    /// The samples trained on (for the ledger).
    pub trained: Vec<SampleId>,
    /// Optimizer steps taken by this request.
    pub optimizer_steps: u64,
    /// Optimizer steps taken so far: the weights version after the update.
    pub version: u64,
    /// Mean total loss.
    pub loss: f64,
    /// Mean gradient norm before clipping.
    pub grad_norm: f64,
    /// Fraction of tokens where the clipped surrogate was active.
    pub pg_clipfrac: f64,
    /// k1 estimate of KL(old ‖ new).
    pub approx_kl: f64,
    /// Mean KL-loss estimate against the reference (0 without a KL loss).
    pub kl_loss: f64,
    /// Mean per-token entropy.
    pub entropy: f64,
    /// Learning rate of the last optimizer step.
    pub lr: f64,
    /// Seconds spent.
    pub seconds: f64,
    /// The replicas averaged this update's gradients through NCCL (not the QUIC ring).
    #[serde(default)]
    pub nccl_all_reduce: bool,
    /// A sharded policy's memory and traffic in this update (`None` unsharded).
    pub sharded: Option<ShardReport>,
}

/// What the ranks of a sharded policy held and moved in one update.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ShardReport {
    /// Ranks of the replica.
    pub shards: usize,
    /// The most training state one rank held: its shards of the f32 master weights,
    /// gradients and both moments, plus the most gathered at once.
    pub train_state_bytes: u64,
    /// Bytes one rank received in all-gathers (the mean over ranks).
    pub gathered_bytes: u64,
    /// Bytes one rank sent in reduce-scatters (the mean over ranks).
    pub reduced_bytes: u64,
    /// Seconds the slowest rank spent in all-gathers.
    pub gather_s: f64,
    /// Seconds of those the slowest rank's compute waited for (not hidden by prefetch).
    pub gather_exposed_s: f64,
    /// Bytes one rank sent averaging its gradient shards with its peers in the other
    /// replicas (HSDP; the mean over ranks, 0 without replicas).
    pub replica_bytes: u64,
}

impl TrainReport {
    /// The heads' reports of one data-parallel update as one: every head's trained
    /// samples and the loss statistics averaged, both in head order (so the result is
    /// the same every run); the optimizer fields and `seconds` are left to the caller.
    pub fn merge_heads(reports: &[&TrainReport]) -> TrainReport {
        let k = reports.len().max(1) as f64;
        let mean = |f: fn(&TrainReport) -> f64| reports.iter().map(|r| f(r)).sum::<f64>() / k;
        TrainReport {
            trained: reports
                .iter()
                .flat_map(|r| r.trained.iter().copied())
                .collect(),
            loss: mean(|r| r.loss),
            pg_clipfrac: mean(|r| r.pg_clipfrac),
            approx_kl: mean(|r| r.approx_kl),
            kl_loss: mean(|r| r.kl_loss),
            entropy: mean(|r| r.entropy),
            ..Default::default()
        }
    }
}
