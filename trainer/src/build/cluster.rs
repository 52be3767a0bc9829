//! A job whose roles run on other `yatt-node`s (`placement.mode = "disaggregated"`):
//! the role factories a node registers, and the build that spawns roles there.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use yatt_roles::{
    DeviceGroup, EnvFactory, EnvRole, PushingPolicy, RemoteEnvPool, Role, RoleError, Sample,
    SpawnEnvActor,
};
use yatt_runtime::ActorName;
use yatt_runtime::RING_CHUNK_BYTES;
use yatt_runtime::{Node, NodeBuilder};

use crate::build::critic::ClusterCritic;
use crate::build::custom::CustomRoles;
use crate::build::data::training_prompts;
use crate::build::devices::model_here;
use crate::build::first_sync::initial_weight_sync;
use crate::build::heads::{controllers, job_timeouts};
use crate::build::parts::{
    critic_role, env_settings, policy_ring, policy_role, policy_role_from, reference_role,
    rollout_role_with_envs,
};
use crate::build::policy_rebuild::policy_log;
use crate::build::remote::{job_text, spawn, spawn_with, start_role, wait_for_nodes, RoleArgs};
use crate::build::reward::reward_role;
use crate::build::sharded_cluster::{
    start_rank, start_sharded_critic, start_sharded_policy, start_sharded_reference, RankArgs,
    ShardedArgs,
};
use crate::checkpoint::{load_trainer, restore_controllers};
use crate::config::checks::invalid;
use crate::config::modes::{KlMode, PlacementMode, Task};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::critic_log::{critic_log, CriticRecovery};
use crate::controller::data_parallel::join_policy_ring;
use crate::controller::error::ControllerError;
use crate::controller::refs::{PolicyRef, RoleRefs, RolloutRef};
use crate::controller::release::{stop_if_failed, StartedRoles};
use crate::controller::update_log::LoggedUpdates;
use crate::error::JobError;

/// Registers the built-in roles (rollout, policy, reference, reward, critic) as factories that
/// take [`RoleArgs`]. A policy spawned for a job with several replicas also starts its
/// ring inbox on the node, as `node/policy-ring/REPLICA` (see [`crate::build::parts::POLICY_RING`]).
pub fn register(builder: NodeBuilder) -> NodeBuilder {
    builder
        // A job's preflight checks on this node (paths, model, reward): one request.
        .factory_with_node("preflight", crate::preflight::probe::ProbeActor::new)
        .factory_with_node("rollout", |node: &Node, _: &ActorName, a: RoleArgs| {
            let node = node.clone();
            async move {
                let envs = remote_envs(&node, &a).await?;
                start_role(a, "rollout", move |job| {
                    let (model, codec, _) = model_here(job)?;
                    Ok(rollout_role_with_envs(job, model, codec, envs))
                })
                .await
            }
        })
        .factory_async("env", |a: RoleArgs| {
            start_role(a, "env", |job| {
                let e = job.rollout.env.as_ref().ok_or_else(|| {
                    invalid(
                        "rollout.env",
                        "an environment for an env actor",
                        "none",
                        "add rollout.env = { kind = ... } to the job",
                    )
                })?;
                Ok(EnvRole::new(env_settings(job, e).factory))
            })
        })
        .factory_with_node("policy", |node: &Node, name: &ActorName, a: RoleArgs| {
            let replicated = JobConfig::parse(&a.job, "the job config sent by the controller", &[])
                .is_ok_and(|job| job.job.policy_replicas > 1);
            let ring_on = replicated.then(|| (node.clone(), name.replica));
            let root = node.config().data_dir.clone();
            let here = node.downgrade();
            async move {
                let ring = match ring_on {
                    Some((node, replica)) => {
                        Some(policy_ring(&node, replica).map_err(|e| e.to_string())?)
                    }
                    None => None,
                };
                let checkpoint = a.checkpoint.clone();
                let role = start_role(a, "policy", move |job| {
                    let (model, _, pad_id) = model_here(job)?;
                    let role = match checkpoint {
                        Some(dir) => {
                            let trainer =
                                load_trainer(&dir, "policy", model.device(), model.kind())?;
                            policy_role_from(job, trainer, pad_id)?
                        }
                        None => policy_role(job, model, pad_id)?,
                    }
                    .with_write_root(root);
                    Ok(match ring {
                        Some(r) => role.with_ring(r),
                        None => role,
                    })
                })
                .await?;
                // Its actor sends the weights to the rollouts itself (one hop).
                Ok::<_, String>(PushingPolicy::new(role, here))
            }
        })
        // A sharded policy replica: rank 0 (the policy the controller drives) and the
        // ranks it spawns (`job.policy_shards > 1`).
        .factory_with_node(
            "policy-sharded",
            |node: &Node, name: &ActorName, a: ShardedArgs| {
                let (node, name) = (node.clone(), name.clone());
                async move { start_sharded_policy(&node, &name, a).await }
            },
        )
        // A sharded reference's rank 0 (`job.reference_shards > 1`); its other ranks
        // are `policy-rank`s started frozen.
        .factory_with_node(
            "reference-sharded",
            |node: &Node, name: &ActorName, a: ShardedArgs| {
                let (node, name) = (node.clone(), name.clone());
                async move { start_sharded_reference(&node, &name, a).await }
            },
        )
        // A sharded critic's rank 0 (`job.critic_shards > 1`); its other ranks are
        // `policy-rank`s started as critic ranks.
        .factory_with_node(
            "critic-sharded",
            |node: &Node, name: &ActorName, a: ShardedArgs| {
                let (node, name) = (node.clone(), name.clone());
                async move { start_sharded_critic(&node, &name, a).await }
            },
        )
        .factory_with_node(
            "policy-rank",
            |node: &Node, name: &ActorName, a: RankArgs| {
                let (node, name) = (node.clone(), name.clone());
                async move { start_rank(&node, &name, a).await }
            },
        )
        .factory_async("reference", |a: RoleArgs| {
            start_role(a, "reference", |job| {
                let (model, _, pad_id) = model_here(job)?;
                Ok(reference_role(job, model, pad_id))
            })
        })
        .factory_async("reward", |a: RoleArgs| {
            start_role(a, "reward", JobReward::of)
        })
        .factory_with_node("critic", |node: &Node, _: &ActorName, a: RoleArgs| {
            let root = node.config().data_dir.clone();
            let checkpoint = a.checkpoint.clone();
            start_role(a, "critic", move |job| {
                let (model, _, pad_id) = model_here(job)?;
                let trainer = match checkpoint {
                    Some(dir) => Some(load_trainer(
                        &dir.join("critic"),
                        "critic",
                        model.device(),
                        model.kind(),
                    )?),
                    None => None,
                };
                Ok(critic_role(job, model, trainer, pad_id)?.with_write_root(root))
            })
        })
}

/// With `placement.env`, the rollout's pool of environment actors on that node (spawned
/// from this node, linked to it; a crashed one is spawned again by the pool).
async fn remote_envs(node: &Node, a: &RoleArgs) -> Result<Option<Arc<dyn EnvFactory>>, String> {
    let job = JobConfig::parse(&a.job, "the job config sent by the controller", &[])
        .map_err(|e| e.to_string())?;
    let (Some(e), target) = (&job.rollout.env, job.placement.env.clone()) else {
        return Ok(None);
    };
    if target.is_empty() {
        return Ok(None);
    }
    let spawn_timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    let (node, args) = (node.clone(), a.clone());
    let spawn: SpawnEnvActor = Arc::new(move || {
        let (node, args, target) = (node.clone(), args.clone(), target.clone());
        Box::pin(async move {
            node.spawn_remote_linked(&target, "env", &args, spawn_timeout)
                .await
                .map_err(|e| format!("spawning an environment actor on node {target}: {e}"))
        })
    });
    let timeout = Duration::from_secs_f64(e.timeout_s);
    let pool = RemoteEnvPool::start(e.pool, spawn, timeout).await?;
    Ok(Some(Arc::new(pool)))
}

/// A job's reward role as a node builds it: the `growing` task's length reward, or the
/// job's reward functions (as [`crate::build::reward::spawn_reward`] picks in process).
pub(crate) enum JobReward {
    Growing(yatt_roles::GrowingLengthReward),
    Functions(yatt_roles::RewardRole),
}

impl JobReward {
    fn of(job: &JobConfig) -> Result<Self, JobError> {
        if job.data.dataset().is_none() && job.data.task == Task::Growing {
            let task = crate::build::data::growing_task(job);
            return Ok(JobReward::Growing(yatt_roles::GrowingLengthReward(task)));
        }
        Ok(JobReward::Functions(reward_role(job)?))
    }

    fn role(&mut self) -> &mut dyn Role<Request = Vec<Sample>, Response = Vec<Sample>> {
        match self {
            JobReward::Growing(r) => r,
            JobReward::Functions(r) => r,
        }
    }
}

impl Role for JobReward {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> yatt_roles::ResourceProfile {
        match self {
            JobReward::Growing(r) => r.profile(),
            JobReward::Functions(r) => r.profile(),
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        self.role().start(group)
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        self.role().serve(samples)
    }

    fn stop(&mut self) {
        self.role().stop()
    }
}

/// Builds a `disaggregated` job on the cluster `node` has joined: spawns each role on
/// the node `[placement]` names (one rollout replica per controller; with
/// `job.policy_replicas > 1` one policy replica per controller, each on its node of
/// `placement.policy`; for PPO the critic on `placement.critic`), gives every rollout, the reference and every policy replica
/// the first replica's initial weights, joins the replicas' gradient all-reduce ring,
/// and returns one controller per rollout, driving the roles over QUIC.
pub async fn build_cluster(job: &JobConfig, node: &Node) -> Result<Vec<Controller>, JobError> {
    build_cluster_from(job, node, None, &CustomRoles::default()).await
}

/// [`build_cluster`], resuming from `checkpoint` when given (a run's, absolute, readable
/// by the policy's and critic's nodes): those roles load their trainer state from it,
/// the controllers take their positions from it and the rollouts the restored weights;
/// the reference stays the initial model. The slots `custom` takes are the user's roles
/// (wherever the user spawned them) instead of built-in ones on the nodes [placement]
/// names, and its stages join every head.
///
/// A build that fails after it started roles stops them before it returns the error.
pub(crate) async fn build_cluster_from(
    job: &JobConfig,
    node: &Node,
    checkpoint: Option<&Path>,
    custom: &CustomRoles,
) -> Result<Vec<Controller>, JobError> {
    stop_if_failed(node, job, |started| {
        build_cluster_in(job, node, checkpoint, custom, started)
    })
    .await
}

async fn build_cluster_in(
    job: &JobConfig,
    node: &Node,
    checkpoint: Option<&Path>,
    custom: &CustomRoles,
    started: StartedRoles,
) -> Result<Vec<Controller>, JobError> {
    job.validate()?;
    let p = &job.placement;
    if p.mode != PlacementMode::Disaggregated {
        return Err(invalid(
            "placement.mode",
            "\"disaggregated\" to run roles on cluster nodes",
            &format!("\"{}\"", p.mode),
            "set placement.mode = \"disaggregated\" and name a node per role, or run without --cluster",
        ));
    }
    custom.check(job, checkpoint.is_some())?;
    let prompts = training_prompts(job)?;
    let ppo = job.algorithm.name.needs_critic();
    let replicas = job.job.policy_replicas;
    wait_for_nodes(node, &p.named_nodes(ppo)).await?;
    let text = job_text(job)?;
    let rollouts = async {
        let mut v = custom.rollouts.clone();
        for _ in v.len()..job.job.controllers {
            v.push(started.keep(spawn(job, &text, node, "rollout", &p.rollout, None).await?));
        }
        Ok::<Vec<RolloutRef>, ControllerError>(v)
    };
    // A sharded replica is one policy actor on its rank 0's node, which starts the
    // other ranks itself.
    // With replicas (HSDP), one per replica, on the node of its rank 0.
    let shards = job.job.policy_shards;
    let sharded = shards > 1;
    let policy_nodes = match (&custom.policy, sharded) {
        (Some(_), _) => Vec::new(),
        (None, true) => p
            .policy_nodes(replicas * shards)
            .into_iter()
            .step_by(shards)
            .collect(),
        (None, false) => p.policy_nodes(replicas),
    };
    let policies = async {
        let mut v: Vec<PolicyRef> = custom.policy.iter().cloned().collect();
        let (text, started) = (&text, &started);
        let spawned = futures::future::try_join_all(policy_nodes.iter().enumerate().map(
            |(replica, target)| async move {
                let policy = match sharded {
                    false => spawn(job, text, node, "policy", target, checkpoint).await?,
                    true => {
                        let args = ShardedArgs {
                            role: RoleArgs {
                                job: text.clone(),
                                node: target.clone(),
                                checkpoint: checkpoint.map(Path::to_path_buf),
                            },
                            replica: replica as u32,
                        };
                        spawn_with(job, node, "policy-sharded", target, &args).await?
                    }
                };
                Ok::<_, ControllerError>(started.keep(policy))
            },
        ))
        .await?;
        v.extend(spawned);
        Ok::<_, ControllerError>(v)
    };
    let critic = async {
        match (&custom.critic, ppo) {
            (Some(c), _) => Ok(Some(c.clone())),
            // Sharded, its rank r runs beside the policy's, on placement.policy[r].
            (None, true) if job.job.critic_shards > 1 => {
                let target = p.policy_nodes(1)[0].clone();
                let args = ShardedArgs {
                    role: RoleArgs {
                        job: text.clone(),
                        node: target.clone(),
                        checkpoint: checkpoint.map(Path::to_path_buf),
                    },
                    replica: 0,
                };
                let c = spawn_with(job, node, "critic-sharded", &target, &args).await?;
                Ok(Some(started.keep(c)))
            }
            (None, true) => Ok(Some(
                started.keep(spawn(job, &text, node, "critic", &p.critic, checkpoint).await?),
            )),
            (None, false) => Ok::<_, ControllerError>(None),
        }
    };
    let reward = async {
        match &custom.reward {
            Some(r) => Ok(r.clone()),
            None => Ok(started.keep(spawn(job, &text, node, "reward", &p.reward, None).await?)),
        }
    };
    // With no KL term there is nothing for a reference to hold or run (as embedded).
    let reference = async {
        match (&custom.reference, job.algorithm.kl_mode) {
            (Some(r), _) => Ok(Some(r.clone())),
            (None, KlMode::None) => Ok(None),
            // Sharded, its rank r runs beside the policy's, on placement.policy[r].
            (None, _) if job.job.reference_shards > 1 => {
                let target = p.policy_nodes(1)[0].clone();
                let args = ShardedArgs {
                    role: RoleArgs {
                        job: text.clone(),
                        node: target.clone(),
                        checkpoint: None,
                    },
                    replica: 0,
                };
                let r = spawn_with(job, node, "reference-sharded", &target, &args).await?;
                Ok(Some(started.keep(r)))
            }
            (None, _) => Ok(Some(
                started.keep(spawn(job, &text, node, "reference", &p.reference, None).await?),
            )),
        }
    };
    // A failure answers at once: the siblings' spawns it drops are cancelled on their
    // nodes, which release a role once it has started (see `Node::spawn_remote`).
    let (rollouts, reward, reference, policies, critic) =
        tokio::try_join!(rollouts, reward, reference, policies, critic)?;
    // A resumed reference stays the initial model (it is rebuilt from model.source).
    // A sharded one builds the initial model itself and takes no sync.
    let fresh_reference = reference
        .as_ref()
        .filter(|_| checkpoint.is_none() && job.job.reference_shards == 1);
    // Every replica of a sharded policy builds the same weights from model.source (or
    // its checkpoint), and is not loaded from another: only the first one sends.
    let sources = if sharded {
        &policies[..1]
    } else {
        &policies[..]
    };
    initial_weight_sync(
        sources,
        &rollouts,
        fresh_reference,
        job.rollout.weight_sync,
        job_timeouts(job).sync,
    )
    .await?;
    let shared = RoleRefs {
        rollout: rollouts[0].clone(),
        extra_rollouts: Vec::new(),
        reward,
        reference,
        policy: policies[0].clone(),
        critic,
    };
    let per_head = if replicas > 1 { policies } else { Vec::new() };
    let mut controllers: Vec<Controller> = controllers(job, prompts, shared, rollouts, per_head)?
        .into_iter()
        .map(|c| c.with_extra_stages(custom.stages.iter().cloned()))
        .collect();
    if replicas > 1 {
        join_policy_ring(&mut controllers, RING_CHUNK_BYTES).await?;
    }
    // The built-in critic survives its node: the controller logs its updates (PPO has
    // one controller). A sharded one is not rebuilt: a lost rank stops the run with the
    // resume hint, as the sharded policy's does.
    if let Some(c) = controllers.first_mut().filter(|c| c.roles.critic.is_some()) {
        if custom.critic.is_none() && job.job.critic_shards == 1 {
            let respawn = ClusterCritic {
                job: job.clone(),
                text: text.clone(),
                node: node.downgrade(),
            };
            let log = critic_log(checkpoint.map(Path::to_path_buf), &job.job.output_dir);
            c.critic_recovery = Some(CriticRecovery::new(log, Arc::new(respawn)));
        }
    }
    // One policy driven by one head survives its node the same way.
    if let [c] = controllers.as_mut_slice() {
        // A sharded replica is not rebuilt: a lost rank stops the run with the resume hint.
        if replicas == 1 && custom.policy.is_none() && !sharded {
            let log = policy_log(checkpoint.map(Path::to_path_buf), &job.job.output_dir);
            c.policy_recovery = Some(LoggedUpdates::new(log));
        }
    }
    if let Some(dir) = checkpoint {
        restore_controllers(&mut controllers, dir).await?;
    }
    Ok(controllers)
}
