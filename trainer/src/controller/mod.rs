//! Parallel controllers: one per data-parallel head, each driving its shard of prompts
//! through rollout → reward → reference → values → advantages → update, meeting the
//! other heads only at the update.
pub(crate) mod advantages;
pub(crate) mod config;
pub(crate) mod core;
pub(crate) mod critic_log;
pub(crate) mod critic_recovery;
pub(crate) mod data_parallel;
pub(crate) mod error;
pub(crate) mod extra_stages;
pub(crate) mod generate;
pub(crate) mod pipeline;
pub(crate) mod probe;
pub(crate) mod refs;
pub(crate) mod release;
pub(crate) mod report;
pub(crate) mod residency;
pub(crate) mod stages;
pub(crate) mod time_share;
pub(crate) mod update_log;
pub(crate) mod weights;
pub(crate) mod weights_direct;
pub(crate) mod weights_ipc;
pub(crate) mod weights_nccl;
