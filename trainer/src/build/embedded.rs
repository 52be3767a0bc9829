//! A job whose roles all run in this process (`placement.mode = "colocate"`).

use std::path::Path;
use yatt_engine::Trainer;
use yatt_runtime::Node;
use yatt_runtime::RING_CHUNK_BYTES;

use crate::build::devices::role_group;
use crate::build::heads::controllers;
use crate::build::parts::{
    base_model, critic_role, policy_ring, policy_role_from, policy_trainer, reference_role,
    rollout_role,
};
use crate::build::reward::spawn_reward;
use crate::checkpoint::{load_trainer, restore_controllers};
use crate::config::checks::invalid;
use crate::config::modes::{KlMode, PlacementMode};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::data_parallel::join_policy_ring;
use crate::controller::extra_stages::ExtraStage;
use crate::controller::refs::{spawn_role, CriticRef, PolicyRef, RoleRefs, RolloutRef, SamplesRef};
use crate::error::JobError;

/// Builds the models, roles (on `node`, with `spawn_local`) and the controllers of an
/// embedded job: one policy (or one per head), reference, reward and (PPO) critic role,
/// and one rollout role per data-parallel head.
pub async fn build_embedded(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    build_embedded_with(job, node, None, &CustomRoles::default()).await
}

/// Roles a program brings itself in place of the built-in ones, one per slot (see
/// `examples/custom_role`). They must already run (started with [`spawn_role`] in this
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

    /// Refuses slots this job cannot use, saying why.
    fn check(&self, job: &JobConfig, resume: bool) -> Result<(), JobError> {
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

/// [`build_embedded`] with `custom` roles, resuming from the run directory `resume`
/// when given: the policy (weights, optimizer, step), the critic and every
/// controller's position come from `RESUME/checkpoint`, the rollouts start with the
/// policy's weights, and the reference is rebuilt from `model.source` (it is the
/// initial policy).
pub async fn build_embedded_with(
    job: &JobConfig,
    node: &Node,
    resume: Option<&Path>,
    custom: &CustomRoles,
) -> Result<Vec<Controller>, JobError> {
    job.validate()?;
    if job.placement.mode != PlacementMode::Colocate {
        return Err(invalid(
            "placement.mode",
            "\"colocate\" for a run in this process",
            &job.placement.mode.to_string(),
            "run it on a cluster with `yatt train CONFIG --cluster SEED_ADDR`, or set placement.mode = \"colocate\"",
        ));
    }
    custom.check(job, resume.is_some())?;
    let group = role_group(job, node.name())?;
    let (dev, kind) = (group.torch_device(), job.model.dtype.kind());
    let (model, codec, pad_id) = base_model(job)?;
    let me = |e: yatt_engine::EngineError| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: e.to_string(),
    };
    let ckpt = resume.map(|d| d.join("checkpoint"));
    let load = |role: &str| -> Result<Option<Trainer>, JobError> {
        match &ckpt {
            Some(dir) if role == "critic" => {
                Ok(Some(load_trainer(&dir.join("critic"), role, dev, kind)?))
            }
            Some(dir) => Ok(Some(load_trainer(dir, role, dev, kind)?)),
            None => Ok(None),
        }
    };
    // Every policy replica starts from the same trainer (fresh or resumed); a custom
    // policy brings its own.
    let builtin_policies = if custom.policy.is_some() {
        0
    } else {
        job.job.policy_replicas
    };
    let mut trainers = Vec::with_capacity(builtin_policies);
    for _ in 0..builtin_policies {
        trainers.push(match load("policy")? {
            Some(t) => t,
            None => policy_trainer(job, model.deep_copy(dev, kind).map_err(me)?)?,
        });
    }
    let g = || group.clone();
    // Rollouts start from the policy's weights (the initial model, or the checkpoint).
    let mut rollouts = custom.rollouts.clone();
    for i in rollouts.len()..job.job.controllers {
        // A LoRA policy's rollouts start from the base: adapter syncs fold into the
        // weights a rollout starts with (a resumed run's first sync brings them).
        let from = trainers
            .first()
            .filter(|t| t.model.lora().is_none())
            .map_or(&model, |t| &t.model);
        let m = from.deep_copy(dev, kind).map_err(me)?;
        let role = rollout_role(job, m, codec.clone());
        rollouts.push(spawn_role(node, role, i as u32, g()).await?);
    }
    let critic = if let Some(c) = &custom.critic {
        Some(c.clone())
    } else if job.algorithm.name.needs_critic() {
        let m = model.deep_copy(dev, kind).map_err(me)?;
        let role = critic_role(job, m, load("critic")?, pad_id)?;
        Some(spawn_role(node, role, 0, g()).await?)
    } else {
        None
    };
    let replicated = trainers.len() > 1;
    let mut policies: Vec<PolicyRef> = custom.policy.iter().cloned().collect();
    for (i, t) in trainers.into_iter().enumerate() {
        let mut role = policy_role_from(job, t, pad_id)?;
        if replicated {
            role = role.with_ring(policy_ring(node, i as u32)?);
        }
        policies.push(spawn_role(node, role, i as u32, g()).await?);
    }
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward: match &custom.reward {
            Some(r) => r.clone(),
            None => spawn_reward(job, node, g()).await?,
        },
        // The reference is the initial policy, also when resuming; with no KL term
        // there is nothing to hold or run.
        reference: match job.algorithm.kl_mode {
            _ if custom.reference.is_some() => custom.reference.clone(),
            KlMode::None => None,
            KlMode::Loss | KlMode::Reward => {
                let m = model.deep_copy(dev, kind).map_err(me)?;
                Some(spawn_role(node, reference_role(job, m, pad_id), 0, g()).await?)
            }
        },
        policy: policies[0].clone(),
        critic,
    };
    let mut controllers: Vec<Controller> = controllers(job, shared, rollouts, policies)?
        .into_iter()
        .map(|c| c.with_extra_stages(custom.stages.iter().cloned()))
        .collect();
    if replicated {
        join_policy_ring(&mut controllers, RING_CHUNK_BYTES).await?;
    }
    if let Some(dir) = &ckpt {
        restore_controllers(&mut controllers, dir).await?;
    }
    Ok(controllers)
}

/// Builds the job where its placement says: in this process (`colocate`), or on the
/// cluster `node` belongs to (`disaggregated`, see [`crate::build::cluster::build_cluster`]).
pub async fn build(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    match job.placement.mode {
        PlacementMode::Disaggregated => crate::build::cluster::build_cluster(job, node).await,
        PlacementMode::Colocate => build_embedded(job, node).await,
    }
}
