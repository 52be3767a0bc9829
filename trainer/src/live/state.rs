//! The live placement actor's state and what it exposes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use yatt_engine::Llama;
use yatt_placement::GroupId;
use yatt_placement::GroupUse;
use yatt_placement::Role as PRole;
use yatt_placement::{PlacementPolicy, Plan};
use yatt_roles::{DeviceGroup, TextCodec};
use yatt_runtime::ActorId;
use yatt_runtime::Node;

use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::probe::GenProbe;
use crate::controller::refs::{PolicyRef, RolloutRef};
use crate::error::JobError;
use crate::ledger::LedgerReport;
use crate::live::errors::placement_err;
use yatt_placement::{DeviceDesc, NodeDesc};
use yatt_runtime::{DeviceKind, NodeInfo};

/// What runs on a group.
#[derive(Clone)]
pub(crate) enum Replica {
    Rollout(RolloutRef),
    Policy(PolicyRef),
}

/// Per head: the group and replica of its rollout, and of its policy.
pub(crate) type Routes = (Vec<(GroupId, RolloutRef)>, Vec<(GroupId, PolicyRef)>);

/// The roles every head shares, outside the groups.
pub(crate) struct Shared {
    pub(crate) reward: crate::controller::refs::SamplesRef,
    pub(crate) reference: Option<crate::controller::refs::SamplesRef>,
    /// The user's stages, in every head.
    pub(crate) stages: Vec<crate::controller::extra_stages::ExtraStage>,
    /// Which of the reward and reference this trainer started (not the user's), and so
    /// can start again when their node is lost.
    pub(crate) restartable: Restartable,
}

/// Which shared roles the trainer started itself.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Restartable {
    pub(crate) reward: bool,
    pub(crate) reference: bool,
}

/// Seconds one step's stages kept each group busy, and the policy's view of the step.
pub(crate) struct Observed {
    pub(crate) metrics: yatt_placement::StepMetrics,
    pub(crate) groups: Vec<GroupUse>,
}

/// The live placement shell of one job, embedded or on a cluster.
pub struct LivePlacement {
    pub(crate) job: JobConfig,
    /// The job's prompts, taken once: every routing shards them over its heads.
    pub(crate) prompts: std::sync::Arc<[yatt_roles::Prompt]>,
    pub(crate) node: Node,
    pub(crate) hosts: Hosts,
    pub(crate) policy: PlacementPolicy,
    pub(crate) plan: Plan,
    pub(crate) replicas: BTreeMap<GroupId, Replica>,
    pub(crate) shared: Shared,
    pub(crate) controllers: Vec<Controller>,
    pub(crate) routing_version: u64,
    pub(crate) next_replica: u32,
    pub(crate) log: std::fs::File,
    pub(crate) log_path: PathBuf,
    /// The plan before the last migration: the "no move" baseline.
    pub(crate) before_move: Option<Plan>,
    /// The last step's ledgers, one per head.
    pub(crate) last_ledgers: Vec<LedgerReport>,
    /// The generation calls in flight, shared by every head.
    pub(crate) probe: GenProbe,
    /// On a cluster: the nodes of `placement.nodes` whose groups are in the inventory,
    /// with the incarnation seen (a restarted node is lost, then joins again).
    pub(crate) known_nodes: BTreeMap<String, u64>,
    /// Role starts still to fail on purpose ([`LivePlacement::fail_next_starts`]).
    pub(crate) start_faults: usize,
    /// Whether the last failed migration was rolled back (the heads run on the old
    /// plan) rather than left half-done.
    pub(crate) rolled_back: bool,
    /// A resumed run's checkpoint, which the first policy replica loads.
    pub(crate) resume_from: Option<std::path::PathBuf>,
}

/// Where the groups are, and so how a role starts on one.
pub(crate) enum Hosts {
    /// Virtual groups of this process: roles start on threads here.
    Embedded {
        codec: Arc<dyn TextCodec>,
        pad_id: i64,
        /// A model of the right shape; rollouts start from a copy and get the policy's
        /// weights by sync.
        template: Box<Llama>,
    },
    /// Devices of cluster nodes: roles start through the nodes' factories, linked to
    /// this node.
    Cluster {
        /// The job config the factories build roles from.
        text: String,
    },
}

impl LivePlacement {
    /// The plan the heads are routed by.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The heads (for checkpoints and tests).
    pub fn controllers(&self) -> &[Controller] {
        &self.controllers
    }

    /// Every role it runs: each group's replica, the shared roles and the heads'.
    pub(crate) fn add_roles_to(&self, started: &crate::controller::release::StartedRoles) {
        for r in self.replicas.values() {
            match r {
                Replica::Rollout(r) => started.add(r),
                Replica::Policy(p) => started.add(p),
            }
        }
        started.add(&self.shared.reward);
        self.shared.reference.iter().for_each(|r| started.add(r));
        self.controllers
            .iter()
            .for_each(|c| started.add_controller(c));
    }

    /// The routing version the heads follow (1 at the start, +1 per migration).
    pub fn routing_version(&self) -> u64 {
        self.routing_version
    }

    /// `OUTPUT_DIR/placement.jsonl`.
    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// The policy (its cost model and plan).
    pub fn policy(&self) -> &PlacementPolicy {
        &self.policy
    }

    /// What runs on each group: `(group, node, "rollout" or "policy", replica)`.
    pub fn replicas(&self) -> Vec<(GroupId, String, &'static str, ActorId)> {
        self.replicas
            .iter()
            .map(|(g, r)| {
                let node = self.node_of(*g).unwrap_or_default().to_string();
                match r {
                    Replica::Rollout(r) => (*g, node, "rollout", r.id().clone()),
                    Replica::Policy(p) => (*g, node, "policy", p.id().clone()),
                }
            })
            .collect()
    }

    /// The ledgers of the last step, one per head (each closed clean, or the step
    /// failed).
    pub fn last_ledgers(&self) -> &[LedgerReport] {
        &self.last_ledgers
    }

    /// The generation calls in flight from every head, by rollout replica: lets a test
    /// (or an operator's tool) act while a step generates on a given replica.
    pub fn gen_probe(&self) -> GenProbe {
        self.probe.clone()
    }

    /// Fault injection for tests and drills: the next `n` role starts on a group (a
    /// migration's gaining role, or a rollback's restart) fail as a refused spawn
    /// would, so the rollback path can be exercised deterministically.
    pub fn fail_next_starts(&mut self, n: usize) {
        self.start_faults = n;
    }

    /// Fails the start of `role` on `g` when a fault is injected.
    pub(crate) fn injected_fault(&mut self, g: GroupId, role: &str) -> Result<(), JobError> {
        if self.start_faults == 0 {
            return Ok(());
        }
        self.start_faults -= 1;
        Err(JobError::Placement {
            what: format!("starting a {role} replica on {g} was refused (injected fault)"),
            fix: "nothing to fix: LivePlacement::fail_next_starts asked for it".into(),
        })
    }

    /// Deadline of every call the shell makes outside a step (`placement.spawn_timeout_s`).
    pub(crate) fn deadline(&self) -> Duration {
        Duration::from_secs(self.job.placement.spawn_timeout_s)
    }

    pub(crate) fn node_of(&self, g: GroupId) -> Result<&str, JobError> {
        self.policy
            .inventory()
            .group(g)
            .map(|group| group.node.as_str())
            .ok_or_else(|| placement_err(format!("{g} is not a group of the inventory")))
    }

    /// The devices group `g` names: its CUDA ordinals when libtorch sees those GPUs here
    /// and `model.device` allows a GPU, virtual devices otherwise (they run on the CPU:
    /// the embedded inventory models GPUs that need not exist).
    pub(crate) fn device_group(&self, g: GroupId) -> DeviceGroup {
        let gpus = match self.job.model.device {
            crate::config::modes::DeviceSetting::Cpu => 0,
            _ => yatt_engine::cuda_device_count(),
        };
        match self.policy.inventory().group(g) {
            Some(group) if group.cuda && group.devices.iter().all(|&d| (d as usize) < gpus) => {
                DeviceGroup {
                    node: self.node.name().to_string(),
                    devices: group.devices.clone(),
                    cuda: true,
                }
            }
            _ => DeviceGroup {
                node: self.node.name().to_string(),
                devices: vec![g.0],
                cuda: false,
            },
        }
    }

    pub(crate) fn of_role(&self, role: PRole) -> Vec<(GroupId, Replica)> {
        let pool = self
            .plan
            .pool_of(role)
            .map(|p| p.groups.clone())
            .unwrap_or_default();
        pool.iter()
            .filter_map(|g| self.replicas.get(g).map(|r| (*g, r.clone())))
            .collect()
    }
}

/// A node as placement sees it: its name, host memory and devices (GPUs, or the
/// virtual devices of a node without). Placement has its own description so that it
/// does not depend on the runtime.
pub(crate) fn node_desc(info: &NodeInfo) -> NodeDesc {
    NodeDesc {
        name: info.name.clone(),
        memory_bytes: info.memory_bytes,
        devices: info
            .devices
            .iter()
            .map(|d| DeviceDesc {
                index: d.index,
                gpu: d.kind == DeviceKind::Cuda,
                memory_bytes: d.memory_bytes,
            })
            .collect(),
    }
}
