//! Building the live placement: groups, the first plan, the first replicas.

use std::collections::BTreeMap;
use std::sync::Arc;

use tch::{Device, Kind};
use yatt_engine::Llama;
use yatt_placement::ForecastParams;
use yatt_placement::GroupId;
use yatt_placement::{
    CostSetup, GpuSpec, Inventory, JobShape, Limits, ModelSpec, PlacementPolicy, Plan, Pool,
    RewardKind,
};
use yatt_placement::{Role as PRole, RoleSet};
use yatt_roles::TextCodec;
use yatt_runtime::Node;
use yatt_runtime::NodeInfo;

use crate::build::custom::CustomRoles;
use crate::build::data::training_prompts;
use crate::build::devices::role_group;
use crate::build::first_sync::initial_weight_sync;
use crate::build::parts::base_model;
use crate::build::remote::{job_text, wait_for_nodes};
use crate::build::reward::spawn_reward;
use crate::checkpoint::restore_controllers;
use crate::config::checks::invalid;
use crate::config::modes::{KlMode, PlacementMode};
use crate::config::sections::JobConfig;
use crate::controller::probe::GenProbe;
use crate::controller::refs::{spawn_role, PolicyRef};
use crate::controller::release::{stop_if_failed, StartedRoles};
use crate::error::JobError;
use crate::live::errors::me;
use crate::live::state::node_desc;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;
use crate::live::state::Restartable;
use crate::live::state::Shared;
use yatt_placement::NodeDesc;

pub(crate) fn rset(r: PRole) -> RoleSet {
    RoleSet::of(&[r])
}

/// A virtual device of one libtorch thread, as the cost model sees it. The figures are
/// effective rates of a small model on one x86 core (op dispatch dominates decoding);
/// the online fit corrects them within its bounds from the first steps.
pub(crate) fn cpu_thread_spec() -> GpuSpec {
    GpuSpec {
        name: "cpu-thread".into(),
        memory_bytes: 8e9,
        flops: 5e10,
        hbm_bytes_per_s: 4e8,
        pcie_bytes_per_s: 4e9,
        net_bytes_per_s: 2e9,
        host_memory_bytes: 16e9,
    }
}

/// Sequences one rollout replica decodes at once (its engine's slots).
pub(crate) fn rollout_slots(job: &JobConfig) -> u32 {
    let all = job.data.prompts_per_step as u32 * job.data.samples_per_prompt;
    match job.rollout.max_batch {
        0 => all,
        cap => all.min(cap as u32),
    }
}

/// `placement.groups` virtual groups of one thread in this process.
pub(crate) fn embedded_inventory(job: &JobConfig, gpu: &GpuSpec) -> Result<Inventory, JobError> {
    let groups = job.placement.groups;
    Inventory::uniform(1, groups as u32, 1, gpu.memory_bytes, gpu.host_memory_bytes).map_err(|e| {
        invalid(
            "placement.groups",
            "a valid inventory",
            &groups.to_string(),
            &e.to_string(),
        )
    })
}

/// The devices the alive nodes of `placement.nodes` advertise in the directory, one
/// group each, in the order the section lists the nodes.
pub(crate) async fn cluster_inventory(
    job: &JobConfig,
    node: &Node,
) -> Result<(Inventory, Vec<NodeInfo>), JobError> {
    let p = &job.placement;
    let mut named: Vec<(String, String)> = p
        .nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (format!("placement.nodes[{i}]"), n.clone()))
        .collect();
    named.push(("placement.reward".into(), p.reward.clone()));
    if job.algorithm.kl_mode != KlMode::None {
        named.push(("placement.reference".into(), p.reference.clone()));
    }
    wait_for_nodes(node, &named).await?;
    let infos: Vec<NodeInfo> = node.directory().read(|d| {
        p.nodes
            .iter()
            .filter_map(|want| d.alive_nodes().find(|n| n.name == *want).cloned())
            .collect()
    });
    let descs: Vec<NodeDesc> = infos.iter().map(node_desc).collect();
    let inventory = Inventory::from_nodes(&descs, 1).map_err(|e| {
        invalid(
            "placement.nodes",
            "nodes whose devices form groups of one",
            &format!("{:?}", p.nodes),
            &e.to_string(),
        )
    })?;
    let heads = job.job.controllers;
    if inventory.len() != heads + 1 {
        let offered: Vec<String> = infos
            .iter()
            .map(|n| format!("{} ({} device(s))", n.name, n.devices.len()))
            .collect();
        return Err(invalid(
            "placement.nodes",
            &format!(
                "job.controllers + 1 = {} devices in all (the rollout and the policy each take 1 or job.controllers groups)",
                heads + 1
            ),
            &format!("{} device(s): {}", inventory.len(), offered.join(", ")),
            "list nodes offering that many devices (`yatt-node run --virtual-devices N` on machines without GPUs), or change job.controllers",
        ));
    }
    Ok((inventory, infos))
}

impl LivePlacement {
    /// Checks that `job` can run under live placement, builds its roles on the starting
    /// plan (`placement.rollout_groups` rollout groups, the rest policy) and writes the
    /// first plan to `OUTPUT_DIR/placement.jsonl`. Embedded (`placement.mode =
    /// "colocate"`): the groups are `placement.groups` virtual groups of `node`'s
    /// process. On a cluster (`"disaggregated"`, `node` a member): the groups are the
    /// devices the nodes of `placement.nodes` advertise, one group each, and the roles
    /// start on those nodes through their factories.
    pub async fn build(job: &JobConfig, node: &Node) -> Result<Self, JobError> {
        Self::build_from(job, node, None, &CustomRoles::default()).await
    }

    /// [`LivePlacement::build`], resuming from the run's `checkpoint` when given: the
    /// first policy replica loads its trainer state (the others copy it), the controllers
    /// take their positions and the rollouts the restored weights; the reference stays
    /// the initial model. The placement starts again from its first plan. `custom`'s
    /// reward, reference and stages replace or join the built-in ones (its other slots
    /// are refused before: the placement builds the replicas in the groups).
    pub(crate) async fn build_from(
        job: &JobConfig,
        node: &Node,
        checkpoint: Option<&std::path::Path>,
        custom: &CustomRoles,
    ) -> Result<Self, JobError> {
        job.validate()?;
        let prompts = training_prompts(job)?;
        let p = &job.placement;
        let cluster = p.mode == PlacementMode::Disaggregated;
        let (mut model, codec, pad_id) = base_model(job)?;
        tch::set_num_threads(1);
        let (inventory, members) = match cluster {
            false => (embedded_inventory(job, &cpu_thread_spec())?, Vec::new()),
            true => cluster_inventory(job, node).await?,
        };
        let (policy, plan) = placement_policy(job, &mut model, inventory)?;
        let out = job.job.output_dir.clone();
        std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
            path: out.clone(),
            source,
        })?;
        let log_path = out.join(yatt_placement::RECORD_FILE);
        // A resumed run appends to its placement record.
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(checkpoint.is_some())
            .write(true)
            .truncate(checkpoint.is_none())
            .open(&log_path)
            .map_err(|source| JobError::Write {
                path: log_path.clone(),
                source,
            })?;
        // The last step before roles start: nothing above leaves any running, and a
        // failure in here stops the shared roles it had started.
        let (hosts, shared) = stop_if_failed(node, job, |started| {
            shared_roles(job, node, model, codec, pad_id, custom, started)
        })
        .await?;
        let mut live = LivePlacement {
            job: job.clone(),
            prompts,
            node: node.clone(),
            hosts,
            policy,
            plan: plan.clone(),
            replicas: BTreeMap::new(),
            shared,
            controllers: Vec::new(),
            routing_version: 0,
            next_replica: 0,
            log,
            log_path,
            before_move: None,
            last_ledgers: Vec::new(),
            probe: GenProbe::default(),
            known_nodes: members
                .iter()
                .map(|n| (n.name.clone(), n.incarnation))
                .collect(),
            start_faults: 0,
            rolled_back: false,
            resume_from: checkpoint.map(std::path::Path::to_path_buf),
        };
        if let Err(e) = live.start_groups(checkpoint, custom).await {
            // A build that fails part-way stops what it started; the caller's roles stay.
            let started = StartedRoles::default();
            live.add_roles_to(&started);
            started.forget(&custom.actor_ids());
            started.stop_all(node, job).await;
            return Err(e);
        }
        Ok(live)
    }

    /// Starts every group's replica of the plan, routes the heads over them, and gives
    /// them the first policy replica's weights (or the checkpoint's state).
    async fn start_groups(
        &mut self,
        checkpoint: Option<&std::path::Path>,
        custom: &CustomRoles,
    ) -> Result<(), JobError> {
        let plan = self.plan.clone();
        // Every policy replica starts from the first one's state (a fresh trainer):
        // across processes nothing else guarantees the same weights.
        let mut first: Option<PolicyRef> = None;
        for pool in &plan.pools {
            if self.sharded_pool() && pool.roles.contains(PRole::Policy) {
                first = Some(self.start_sharded_policy(&pool.groups).await?);
                continue;
            }
            for g in &pool.groups {
                let r = if pool.roles.contains(PRole::Rollout) {
                    Replica::Rollout(self.start_rollout(*g).await?)
                } else {
                    let r = self.start_policy(*g, first.as_ref()).await?;
                    first.get_or_insert_with(|| r.clone());
                    Replica::Policy(r)
                };
                self.replicas.insert(*g, r);
            }
        }
        self.route(None).await?;
        self.resume_from = None;
        match checkpoint {
            Some(dir) => restore_controllers(&mut self.controllers, dir).await?,
            None => self.sync_all().await?,
        }
        // A reference built here starts from the model; one elsewhere (a cluster's, or
        // the user's) takes the initial policy's weights, as the other builds do.
        let takes_weights =
            matches!(self.hosts, Hosts::Cluster { .. }) || custom.reference.is_some();
        if let (Some(reference), Some(policy), true, None) =
            (&self.shared.reference, &first, takes_weights, checkpoint)
        {
            // The reference is the initial policy, whichever node built it; loaded from
            // the policy's node where it can, so this process holds no copy.
            let (mode, t) = (self.job.rollout.weight_sync, self.deadline());
            let policies = std::slice::from_ref(policy);
            initial_weight_sync(policies, &[], Some(reference), mode, t).await?;
        }
        self.publish(0)?;
        Ok(())
    }
}

/// The placement policy of the job over `inventory`, and the plan it starts from: the
/// rollout on the first `placement.rollout_groups` groups, the policy on the rest.
pub(crate) fn placement_policy(
    job: &JobConfig,
    model: &mut Llama,
    inventory: Inventory,
) -> Result<(PlacementPolicy, Plan), JobError> {
    let p = &job.placement;
    let heads = job.job.controllers;
    let params = model.num_parameters() as f64;
    let cfg = &model.config;
    let spec = ModelSpec {
        name: job.model.source.to_string(),
        params,
        layers: cfg.num_hidden_layers as u32,
        kv_heads: cfg.num_key_value_heads as u32,
        head_dim: cfg.head_dim as u32,
    };
    let mut shape = JobShape::new(spec, RewardKind::Rule, job.rollout.max_new_tokens as u32);
    // Reward and reference run outside the groups.
    shape.reference = false;
    shape.prompt_len = 4;
    let gpu = cpu_thread_spec();
    let setup = CostSetup {
        job: shape,
        gpu,
        group_devices: 1,
        // The trainer's own bound: the live policy and the simulator decide on the same
        // pipelined step model.
        staleness: job.rollout.staleness,
        partial_rollout: None,
    };
    let ids: Vec<GroupId> = inventory.groups().map(|g| g.id).collect();
    let plan = Plan {
        pools: vec![
            Pool {
                roles: rset(PRole::Rollout),
                groups: ids[..p.rollout_groups].to_vec(),
            },
            Pool {
                roles: rset(PRole::Policy),
                groups: ids[p.rollout_groups..].to_vec(),
            },
        ],
        rollout_batch_cap: Some(rollout_slots(job)),
        lanes: None,
    };
    let batch = heads as u32 * job.data.prompts_per_step as u32;
    let forecast = ForecastParams::lognormal(
        batch,
        job.data.samples_per_prompt,
        (job.rollout.max_new_tokens as f64 / 2.0).max(1.0),
        0.5,
        job.rollout.max_new_tokens as u32,
    );
    let limits = Limits {
        structures: Some(vec![vec![rset(PRole::Rollout), rset(PRole::Policy)]]),
        rollout_cap: plan.rollout_batch_cap,
    };
    let mut policy =
        PlacementPolicy::starting_from(p.replan, inventory, setup, forecast, plan.clone(), limits)
            .map_err(|e| invalid("[placement]", "a plan that fits", "", &e.to_string()))?;
    // Starting a role here takes a fraction of a second, not a GPU engine's 10 s;
    // the first migration replaces the guess with a measurement.
    policy.cost_model_mut().set_start_costs(0.2, 0.2);
    Ok((policy, plan))
}

/// The roles outside the groups (reward, and the reference with a KL term; the user's
/// where `custom` has them, and its stages), and how the groups' replicas are hosted:
/// threads of this process, or cluster nodes.
pub(crate) async fn shared_roles(
    job: &JobConfig,
    node: &Node,
    model: Llama,
    codec: Arc<dyn TextCodec>,
    pad_id: i64,
    custom: &CustomRoles,
    started: StartedRoles,
) -> Result<(Hosts, Shared), JobError> {
    let p = &job.placement;
    let heads = job.job.controllers;
    let with_reference = job.algorithm.kl_mode != KlMode::None;
    let cluster = p.mode == PlacementMode::Disaggregated;
    let (hosts, shared) = match cluster {
        false => {
            let group = role_group(job, node.name())?;
            let (dev, kind) = (group.torch_device(), job.model.dtype.kind());
            let shared = Shared {
                reward: match &custom.reward {
                    Some(r) => r.clone(),
                    None => started.keep(spawn_reward(job, node, group.clone()).await?),
                },
                reference: match (&custom.reference, with_reference) {
                    (Some(r), _) => Some(r.clone()),
                    (None, false) => None,
                    (None, true) => Some(
                        started.keep(
                            spawn_role(
                                node,
                                crate::build::parts::reference_role(
                                    job,
                                    model.deep_copy(dev, kind).map_err(me(job))?,
                                    pad_id,
                                ),
                                0,
                                group.clone(),
                            )
                            .await?,
                        ),
                    ),
                },
                stages: custom.stages.clone(),
                // Embedded, they live and die with this process.
                restartable: Restartable::default(),
            };
            let hosts = Hosts::Embedded {
                codec,
                pad_id,
                // Kept in f32 on the CPU: each replica copies it to its group's device
                // and dtype (a policy's f32 master weights come from these).
                template: Box::new(model.deep_copy(Device::Cpu, Kind::Float).map_err(me(job))?),
            };
            (hosts, shared)
        }
        true => {
            // Every policy a node builds gets a ring inbox: the replicas all-reduce
            // their gradients among themselves whenever each head has its own.
            let mut sent = job.clone();
            sent.job.policy_replicas = heads;
            let text = job_text(&sent)?;
            let shared = Shared {
                reward: match &custom.reward {
                    Some(r) => r.clone(),
                    None => started.keep(
                        crate::build::remote::spawn(job, &text, node, "reward", &p.reward, None)
                            .await?,
                    ),
                },
                reference: match (&custom.reference, with_reference) {
                    (Some(r), _) => Some(r.clone()),
                    (None, false) => None,
                    (None, true) => Some(
                        started.keep(
                            crate::build::remote::spawn(
                                job,
                                &text,
                                node,
                                "reference",
                                &p.reference,
                                None,
                            )
                            .await?,
                        ),
                    ),
                },
                stages: custom.stages.clone(),
                restartable: Restartable {
                    reward: custom.reward.is_none(),
                    reference: custom.reference.is_none(),
                },
            };
            (Hosts::Cluster { text }, shared)
        }
    };
    Ok((hosts, shared))
}
