//! The checks of a sharded policy (`job.policy_shards`): what is built so far, and
//! whether the model's units can be split over the ranks.

use crate::config::checks::{invalid, positive};
use crate::config::modes::{PlacementMode, PolicyPool, TimeShare};
use crate::config::sections::JobConfig;
use crate::error::JobError;

/// What a sharded policy cannot be combined with yet: `(key, why, fix)` for `job`.
fn unbuilt(job: &JobConfig) -> Option<(&'static str, &'static str, &'static str)> {
    let p = &job.placement;
    if job.model.lora.is_some() {
        return Some((
            "model.lora",
            "LoRA on a sharded frozen base is not built yet",
            "remove [model.lora], or set job.policy_shards = 1",
        ));
    }
    if p.live {
        return Some((
            "placement.live",
            "under the live placement the policy groups set the rank count",
            "set job.policy_shards = 1 and placement.policy_pool = \"sharded\"",
        ));
    }
    if p.time_share != TimeShare::Off {
        return Some((
            "placement.time_share",
            "a sharded policy is not offloaded between phases yet",
            "set placement.time_share = \"off\", or job.policy_shards = 1",
        ));
    }
    None
}

impl JobConfig {
    /// Checks `job.policy_shards` against the rest of the job (the model's units are
    /// checked when the model is known: [`JobConfig::check_policy_shards_fit`]).
    pub(crate) fn validate_shards(&self) -> Result<(), JobError> {
        let n = self.job.policy_shards;
        positive(
            "job.policy_shards",
            n as f64,
            "policy_shards = 1 for the whole model in one trainer",
        )?;
        if n == 1 {
            return Ok(());
        }
        match unbuilt(self) {
            Some((key, why, fix)) => Err(JobError::NotImplemented {
                key: "job.policy_shards".into(),
                found: n.to_string(),
                fix: format!("{why} (see {key}): {fix}"),
            }),
            None => Ok(()),
        }
    }

    /// Checks `placement.policy_pool`: a sharded pool is the live placement's, embedded.
    pub(crate) fn validate_policy_pool(&self) -> Result<(), JobError> {
        let p = &self.placement;
        if p.policy_pool != PolicyPool::Sharded {
            return Ok(());
        }
        let refuse = |key: &str, why: &str, fix: &str| {
            Err(JobError::NotImplemented {
                key: "placement.policy_pool".into(),
                found: "\"sharded\"".into(),
                fix: format!("{why} (see {key}): {fix}"),
            })
        };
        if !p.live {
            return Err(invalid(
                "placement.policy_pool",
                "\"replicas\" without placement.live (a fixed placement shards the policy by job.policy_shards)",
                "\"sharded\"",
                "set job.policy_shards = N and placement.policy_pool = \"replicas\", or placement.live = true",
            ));
        }
        if p.mode == PlacementMode::Disaggregated {
            return refuse(
                "placement.mode",
                "the live placement reshards a policy whose ranks are threads of the training process; ranks on yatt-node daemons are resharded by a resume",
                "set placement.mode = \"colocate\", or placement.policy_pool = \"replicas\"",
            );
        }
        if self.model.lora.is_some() {
            return refuse(
                "model.lora",
                "LoRA on a sharded frozen base is not built yet",
                "remove [model.lora], or set placement.policy_pool = \"replicas\"",
            );
        }
        Ok(())
    }

    /// Checks `job.reference_shards` against the rest of the job.
    pub(crate) fn validate_reference_shards(&self) -> Result<(), JobError> {
        let n = self.job.reference_shards;
        positive(
            "job.reference_shards",
            n as f64,
            "reference_shards = 1 for the whole reference in one process",
        )?;
        if n == 1 {
            return Ok(());
        }
        let p = &self.placement;
        let refuse = |key: &str, why: &str, fix: &str| {
            Err(JobError::NotImplemented {
                key: "job.reference_shards".into(),
                found: n.to_string(),
                fix: format!("{why} (see {key}): {fix}"),
            })
        };
        if p.live {
            return refuse(
                "placement.live",
                "the live placement does not start a sharded reference",
                "set placement.live = false, or job.reference_shards = 1",
            );
        }
        if p.time_share != TimeShare::Off {
            return refuse(
                "placement.time_share",
                "a sharded reference is not offloaded between phases",
                "set placement.time_share = \"off\", or job.reference_shards = 1",
            );
        }
        // On a cluster, rank r runs on placement.policy[r].
        let named = p.policy_nodes(1).len();
        if p.mode == crate::config::modes::PlacementMode::Disaggregated && named > 1 && named < n {
            return Err(invalid(
                "job.reference_shards",
                &format!("at most the {named} node(s) placement.policy names: the reference's rank r runs on placement.policy[r]"),
                &n.to_string(),
                "name more nodes in placement.policy, or lower job.reference_shards",
            ));
        }
        Ok(())
    }

    /// Checks `job.critic_shards` against the rest of the job (the model's units are
    /// checked when the critic is built).
    pub(crate) fn validate_critic_shards(&self) -> Result<(), JobError> {
        let n = self.job.critic_shards;
        positive(
            "job.critic_shards",
            n as f64,
            "critic_shards = 1 for the whole critic in one trainer",
        )?;
        if n == 1 {
            return Ok(());
        }
        if !self.algorithm.name.needs_critic() {
            return Err(invalid(
                "job.critic_shards",
                "1: the algorithm has no critic to shard",
                &n.to_string(),
                "set job.critic_shards = 1, or algorithm.name = \"ppo\"",
            ));
        }
        let p = &self.placement;
        let refuse = |key: &str, why: &str, fix: &str| {
            Err(JobError::NotImplemented {
                key: "job.critic_shards".into(),
                found: n.to_string(),
                fix: format!("{why} (see {key}): {fix}"),
            })
        };
        // On a cluster, rank r runs on placement.policy[r].
        let named = p.policy_nodes(1).len();
        if p.mode == PlacementMode::Disaggregated && named > 1 && named < n {
            return Err(invalid(
                "job.critic_shards",
                &format!("at most the {named} node(s) placement.policy names: the critic's rank r runs on placement.policy[r]"),
                &n.to_string(),
                "name more nodes in placement.policy, or lower job.critic_shards",
            ));
        }
        if p.live {
            return refuse(
                "placement.live",
                "the live placement does not start a sharded critic",
                "set placement.live = false, or job.critic_shards = 1",
            );
        }
        if p.time_share != TimeShare::Off {
            return refuse(
                "placement.time_share",
                "a sharded critic is not offloaded between phases",
                "set placement.time_share = \"off\", or job.critic_shards = 1",
            );
        }
        Ok(())
    }

    /// Refuses a shard count the units of `model` (its config) cannot be split over,
    /// naming the largest that can.
    pub(crate) fn check_policy_shards_fit(
        &self,
        model: &yatt_engine::ModelConfig,
    ) -> Result<(), JobError> {
        let n = self.job.policy_shards;
        if n <= 1 {
            return Ok(());
        }
        yatt_engine::check_shards(model, n).map_err(|e| {
            invalid(
                "job.policy_shards",
                "a shard count every unit of the model (a decoder layer, the embeddings, the head) can be split over",
                &n.to_string(),
                &e.to_string(),
            )
        })
    }
}
