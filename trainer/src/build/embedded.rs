//! A job whose roles all run in this process (`placement.mode = "colocate"`).

use std::path::Path;
use yatt_engine::{is_sharded_checkpoint, Trainer};
use yatt_runtime::Node;
use yatt_runtime::RING_CHUNK_BYTES;

use crate::build::custom::CustomRoles;
use crate::build::data::training_prompts;
use crate::build::devices::role_group;
use crate::build::heads::controllers;
use crate::build::parts::{
    base_model, critic_role, policy_ring, policy_role_from, policy_trainer, reference_role,
    replica_rings, rollout_role, sharded_critic_role, sharded_policy_role, sharded_reference_role,
    whole_checkpoint_refused,
};
use crate::build::reward::spawn_reward;
use crate::checkpoint::{load_trainer, restore_controllers};
use crate::config::checks::invalid;
use crate::config::modes::{KlMode, PlacementMode};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::data_parallel::join_policy_ring;
use crate::controller::refs::{spawn_role, PolicyRef, RoleRefs};
use crate::controller::release::{stop_if_failed, StartedRoles};
use crate::error::JobError;

/// Builds the models, roles (on `node`, with `spawn_local`) and the controllers of an
/// embedded job: one policy (or one per head), reference, reward and (PPO) critic role,
/// and one rollout role per data-parallel head.
pub async fn build_embedded(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    build_embedded_with(job, node, None, &CustomRoles::default()).await
}

/// [`build_embedded`] with `custom` roles, resuming from the run directory `resume`
/// when given: the policy (weights, optimizer, step), the critic and every
/// controller's position come from `RESUME/checkpoint`, the rollouts start with the
/// policy's weights, and the reference is rebuilt from `model.source` (it is the
/// initial policy).
///
/// A build that fails after it started roles stops them before it returns the error,
/// so nothing of it stays running on `node`.
pub async fn build_embedded_with(
    job: &JobConfig,
    node: &Node,
    resume: Option<&Path>,
    custom: &CustomRoles,
) -> Result<Vec<Controller>, JobError> {
    stop_if_failed(node, job, |started| {
        build_embedded_in(job, node, resume, custom, started)
    })
    .await
}

async fn build_embedded_in(
    job: &JobConfig,
    node: &Node,
    resume: Option<&Path>,
    custom: &CustomRoles,
    started: StartedRoles,
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
    let prompts = training_prompts(job)?;
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
    // A sharded policy (`job.policy_shards`, or any resume of a sharded checkpoint)
    // runs its ranks here; its rollouts start from its gathered weights.
    let sharded_ckpt = ckpt.as_deref().filter(|d| is_sharded_checkpoint(d));
    let mut sharded = Vec::new();
    let mut resumed_weights = None;
    if custom.policy.is_none() && (job.job.policy_shards > 1 || sharded_ckpt.is_some()) {
        if let (Some(dir), None) = (&ckpt, sharded_ckpt) {
            let n = job.job.policy_shards;
            return Err(whole_checkpoint_refused(
                dir,
                "policy",
                "job.policy_shards",
                n,
            ));
        }
        // One sharded replica per head with job.policy_replicas > 1 (HSDP), each rank
        // with its member of the ring of the same rank in every replica.
        let replicas = job.job.policy_replicas;
        for replica in 0..replicas {
            let mut role = sharded_policy_role(job, &model, sharded_ckpt, pad_id, (dev, kind))?;
            if replicas > 1 {
                let members = replica_rings(node, replica, role.shards())?;
                role = role.with_replica_members(members);
            }
            if sharded_ckpt.is_some() && replica == 0 {
                resumed_weights = Some(role.gathered_model().map_err(|e| JobError::Resume {
                    dir: ckpt.clone().unwrap_or_default(),
                    reason: format!("gathering the sharded policy's weights: {e}"),
                })?);
            }
            sharded.push(role);
        }
    }
    // Every policy replica starts from the same trainer (fresh or resumed); a custom
    // or sharded policy brings its own.
    let builtin_policies = if custom.policy.is_some() || !sharded.is_empty() {
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
            .map(|t| &t.model)
            .or(resumed_weights.as_ref())
            .unwrap_or(&model);
        let m = from.deep_copy(dev, kind).map_err(me)?;
        let role = rollout_role(job, m, codec.clone());
        rollouts.push(started.keep(spawn_role(node, role, i as u32, g()).await?));
    }
    let critic = if let Some(c) = &custom.critic {
        Some(c.clone())
    } else if job.algorithm.name.needs_critic() {
        let m = model.deep_copy(dev, kind).map_err(me)?;
        // A sharded critic (`job.critic_shards`, or any resume of a sharded critic's
        // checkpoint) runs its ranks here.
        let critic_dir = ckpt.as_ref().map(|d| d.join("critic"));
        let sharded_dir = critic_dir.as_deref().filter(|d| is_sharded_checkpoint(d));
        if job.job.critic_shards > 1 || sharded_dir.is_some() {
            if let (Some(dir), None) = (&critic_dir, sharded_dir) {
                let n = job.job.critic_shards;
                return Err(whole_checkpoint_refused(
                    dir,
                    "critic",
                    "job.critic_shards",
                    n,
                ));
            }
            let role = sharded_critic_role(job, m, sharded_dir, pad_id)?;
            Some(started.keep(spawn_role(node, role, 0, g()).await?))
        } else {
            let role = critic_role(job, m, load("critic")?, pad_id)?;
            Some(started.keep(spawn_role(node, role, 0, g()).await?))
        }
    } else {
        None
    };
    let replicated = trainers.len() > 1 || sharded.len() > 1;
    let mut policies: Vec<PolicyRef> = custom.policy.iter().cloned().collect();
    drop(resumed_weights);
    for (i, role) in sharded.into_iter().enumerate() {
        policies.push(started.keep(spawn_role(node, role, i as u32, g()).await?));
    }
    for (i, t) in trainers.into_iter().enumerate() {
        let mut role = policy_role_from(job, t, pad_id)?;
        if replicated {
            role = role.with_ring(policy_ring(node, i as u32)?);
        }
        policies.push(started.keep(spawn_role(node, role, i as u32, g()).await?));
    }
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward: match &custom.reward {
            Some(r) => r.clone(),
            None => started.keep(spawn_reward(job, node, g()).await?),
        },
        // The reference is the initial policy, also when resuming; with no KL term
        // there is nothing to hold or run.
        reference: match job.algorithm.kl_mode {
            _ if custom.reference.is_some() => custom.reference.clone(),
            KlMode::None => None,
            KlMode::Loss | KlMode::Reward => {
                let m = model.deep_copy(dev, kind).map_err(me)?;
                Some(started.keep(match job.job.reference_shards {
                    1 => spawn_role(node, reference_role(job, m, pad_id), 0, g()).await?,
                    _ => spawn_role(node, sharded_reference_role(job, m, pad_id)?, 0, g()).await?,
                }))
            }
        },
        policy: policies[0].clone(),
        critic,
    };
    let mut controllers: Vec<Controller> = controllers(job, prompts, shared, rollouts, policies)?
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
