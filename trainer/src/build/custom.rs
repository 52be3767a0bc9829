//! Roles a program brings itself in place of the built-in ones, for an embedded build
//! and a cluster build alike.

use std::collections::BTreeSet;

use yatt_runtime::ActorId;

use crate::config::checks::invalid;
use crate::config::sections::JobConfig;
use crate::controller::extra_stages::ExtraStage;
use crate::controller::refs::{CriticRef, PolicyRef, RolloutRef, SamplesRef};
use crate::error::JobError;

/// Roles a program brings itself in place of the built-in ones, one per slot (see
/// `examples/custom_role`). They must already run (started with [`crate::spawn_role`] in this
/// process, or spawned on another node with `Node::spawn_remote_linked`), and speak
/// their slot's request and response types. A slot left empty gets the built-in role.
#[derive(Debug, Clone, Default)]
pub struct CustomRoles {
    /// The reward role: takes the step's samples and gives them back with `reward` set.
    pub reward: Option<SamplesRef>,
    /// Rollout replicas, one per head (`job.controllers` of them): generate samples for
    /// a [`yatt_roles::GenerateRequest`] and take the policy's weights after every
    /// update (`RolloutRequest::LoadWeights`). Empty = the built-in rollouts.
    pub rollouts: Vec<RolloutRef>,
    /// The reference role: takes samples and gives them back with `ref_logprobs` set.
    /// Used even when `algorithm.kl_mode = "none"` (then only for the `actor/kl`
    /// metric).
    pub reference: Option<SamplesRef>,
    /// The critic (PPO): answers [`yatt_roles::CriticRequest`]s.
    pub critic: Option<CriticRef>,
    /// The policy: answers [`yatt_roles::PolicyRequest`]s (old log-probs, the update,
    /// weights for the rollouts, checkpoints). Only with one policy replica and no
    /// resume: the replicas' all-reduce ring and the checkpoint's trainer state are the
    /// built-in policy's.
    pub policy: Option<PolicyRef>,
    /// Stages added to the step ([`ExtraStage`]: a filter, a second reward, a
    /// classifier), each after a built-in stage, in this order within a place.
    pub stages: Vec<ExtraStage>,
}

impl CustomRoles {
    /// Whether no slot is taken.
    pub fn is_empty(&self) -> bool {
        self.reward.is_none()
            && self.rollouts.is_empty()
            && self.reference.is_none()
            && self.critic.is_none()
            && self.policy.is_none()
            && self.stages.is_empty()
    }

    /// The slots taken, by name.
    pub fn slots(&self) -> Vec<&'static str> {
        [
            ("reward", self.reward.is_some()),
            ("rollout", !self.rollouts.is_empty()),
            ("reference", self.reference.is_some()),
            ("critic", self.critic.is_some()),
            ("policy", self.policy.is_some()),
        ]
        .into_iter()
        .filter_map(|(n, taken)| taken.then_some(n))
        .collect()
    }

    /// The actors of every slot and stage taken: a node-loss recovery must not put a
    /// built-in role where one of them was.
    pub(crate) fn actor_ids(&self) -> BTreeSet<ActorId> {
        let slots = [
            self.reward.as_ref().map(|r| r.id()),
            self.reference.as_ref().map(|r| r.id()),
            self.critic.as_ref().map(|r| r.id()),
            self.policy.as_ref().map(|r| r.id()),
        ];
        slots
            .into_iter()
            .flatten()
            .chain(self.rollouts.iter().map(|r| r.id()))
            .chain(self.stages.iter().map(|s| s.role.id()))
            .cloned()
            .collect()
    }

    /// Refuses slots this job cannot use, saying why.
    pub(crate) fn check(&self, job: &JobConfig, resume: bool) -> Result<(), JobError> {
        let refuse = |key: &str, found: String, fix: &str| JobError::NotImplemented {
            key: key.into(),
            found,
            fix: fix.into(),
        };
        if !self.rollouts.is_empty() && self.rollouts.len() != job.job.controllers {
            return Err(invalid(
                "job.controllers",
                &format!("{} (one head per custom rollout)", self.rollouts.len()),
                &job.job.controllers.to_string(),
                "give one custom rollout per head, or set job.controllers to their number",
            ));
        }
        if self.critic.is_some() && !job.algorithm.name.needs_critic() {
            return Err(invalid(
                "algorithm.name",
                "an algorithm with a critic (ppo) for a custom critic",
                &format!("{:?}", job.algorithm.name),
                "set algorithm.name = \"ppo\", or leave CustomRoles::critic empty",
            ));
        }
        if self.policy.is_some() && job.job.policy_replicas > 1 {
            return Err(refuse(
                "job.policy_replicas",
                job.job.policy_replicas.to_string(),
                "a custom policy runs as the one policy: the replicas' gradient all-reduce ring is the built-in policy's; set job.policy_replicas = 1",
            ));
        }
        if self.policy.is_some() && job.job.policy_shards > 1 {
            return Err(refuse(
                "job.policy_shards",
                job.job.policy_shards.to_string(),
                "a custom policy runs as it is: sharding is the built-in policy's; set job.policy_shards = 1",
            ));
        }
        if self.reference.is_some() && job.job.reference_shards > 1 {
            return Err(refuse(
                "job.reference_shards",
                job.job.reference_shards.to_string(),
                "a custom reference runs as it is: sharding is the built-in reference's; set job.reference_shards = 1",
            ));
        }
        if self.critic.is_some() && job.job.critic_shards > 1 {
            return Err(refuse(
                "job.critic_shards",
                job.job.critic_shards.to_string(),
                "a custom critic runs as it is: sharding is the built-in critic's; set job.critic_shards = 1",
            ));
        }
        if resume && (self.policy.is_some() || self.critic.is_some()) {
            return Err(refuse(
                "resume",
                "true".into(),
                "a resume restores the built-in policy's and critic's trainer state from the checkpoint, which a custom policy or critic cannot take; start a new run, or resume with the built-in ones",
            ));
        }
        Ok(())
    }
}
