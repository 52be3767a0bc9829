//! The live placement actor: a thin async shell around
//! [`yatt_placement::PlacementPolicy`], the same deterministic policy the simulator
//! drives.
//!
//! The job's rollout and policy roles sit on device groups of one device each: a group
//! serves either a rollout replica or a policy replica. Embedded, the groups are
//! `placement.groups` virtual groups of one libtorch thread in this process; on a
//! cluster they are the devices the nodes of `placement.nodes` advertise (membership),
//! and a group's replica runs on its node, started through the node's factory and
//! stopped over QUIC. Everything else is shared by both. The job's `job.controllers` heads (data-parallel controllers) are routed
//! over them: with one rollout group every head generates on it; with one policy group
//! every head trains on it (gradients summed there); with as many groups as heads each
//! head has its own (gradients all-reduced). Reward (and reference) run outside the
//! groups.
//!
//! After every step the shell turns the heads' stage times (`timing_s/*`) and samples
//! into the policy's [`yatt_placement::StepMetrics`] and feeds it. When the policy
//! decides to move a group, the shell migrates at the step boundary:
//! 1. the group leaves routing (no head sends to it any more);
//! 2. its role is drained (a step boundary has no work in flight; whatever a drain
//!    hands back is failed loudly rather than lost, because the next step's ledger
//!    expects only its own samples); a group lost with its node is skipped here;
//! 3. its memory is freed: offload, then stop (the role's thread ends and drops it);
//! 4. the gaining role starts there: a rollout replica from the policy's weights, or a
//!    policy replica with a surviving one's whole trainer state (weights, optimizer,
//!    step), sent as bytes ([`PolicyRequest::ExportState`] /
//!    [`PolicyRequest::ImportState`]); on a cluster, replicas of a head each then join
//!    a new gradient ring;
//! 5. every head syncs weights to its rollout;
//! 6. a new routing version is published (and the directory's epoch recorded), and
//!    the heads follow it from the next step.
//!
//! A migration that fails part-way is rolled back: the groups get their roles under
//! the old plan back (a stopped policy replica restarts from a survivor's state), the
//! heads are routed by it again and the policy hears [`Event::MigrationFailed`].
//!
//! On a cluster the shell also follows membership at every step boundary. Each head's
//! spare rollouts are the other heads' rollout replicas: when a rollout replica's node
//! dies mid-step, the head's generation call fails (when the directory declares the
//! node dead, or at its deadline), the samples in flight there are requeued in the
//! head's ledger and generated on a spare, and the step completes. After the step the
//! node is fed as [`Event::NodeLeft`] and the policy's `NodeLost` migration takes its
//! groups out of the plan. With no spare (a single rollout group), nothing is trained
//! yet when generation fails: the heads go back to before the step, the loss is
//! carried out (a policy group becomes the rollout) and the step runs again. A lost policy replica (its optimizer state is gone) fails
//! the run with an error that says so. A node of `placement.nodes` that joins (or
//! restarts) is fed as [`Event::NodeJoined`]: its devices become groups the policy may
//! use.
//!
//! Everything it sees and does goes to `OUTPUT_DIR/placement.jsonl`
//! ([`yatt_placement::Record`]), which `yatt placement show RUN_DIR` renders.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tch::{Device, Kind};
use yatt_engine::{Llama, Trainer};
use yatt_placement::{
    finite, CostSetup, Decision, DeviceDesc, Event, ForecastParams, GpuSpec, GroupId, GroupUse,
    Inventory, JobShape, Limits, ModelSpec, NodeDesc, PlacementPolicy, Plan, Pool, Reason, Record,
    RewardKind, Role as PRole, RoleSet, Stage, StageObs,
};
use yatt_runtime::actor::{ActorRef, ExitReason};
use yatt_runtime::collective::RING_CHUNK_BYTES;
use yatt_runtime::directory::Change;
use yatt_runtime::membership::{DeviceKind, NodeInfo};
use yatt_runtime::message::Message;
use yatt_runtime::node::Node;
use yatt_runtime::ActorId;

use crate::builtin::{PolicyRequest, PolicyResponse, TextCodec};
use crate::controller::{
    join_policy_ring, spawn_role, step_data_parallel, Controller, GenProbe, PolicyRef, RoleRefs,
    RolloutRef, StepMetrics, StepReport,
};
use crate::job::{
    base_model, controllers, policy_role_from, rollout_role, spawn_reward, train_config, JobConfig,
    JobError,
};
use crate::ledger::LedgerReport;
use crate::remote::{self, job_text, wait_for_nodes};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, RoleRequest, RoleResponse};
use crate::sample::Sample;

/// A node as placement sees it: its name, host memory and devices (GPUs, or the
/// virtual devices of a node without).
fn node_desc(info: &NodeInfo) -> NodeDesc {
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

/// The `growing` task's reward role: pays for a response of the step's target length
/// (the step comes from each sample's id).
pub struct GrowingLengthReward(pub crate::data::GrowingLength);

impl Role for GrowingLengthReward {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        for s in &mut samples {
            s.reward = Some(self.0.score(s.id.step, s.response_len()));
        }
        Ok(samples)
    }
}

/// What runs on a group.
#[derive(Clone)]
enum Replica {
    Rollout(RolloutRef),
    Policy(PolicyRef),
}

/// Per head: the group and replica of its rollout, and of its policy.
type Routes = (Vec<(GroupId, RolloutRef)>, Vec<(GroupId, PolicyRef)>);

/// The roles every head shares, outside the groups.
struct Shared {
    reward: crate::controller::SamplesRef,
    reference: Option<crate::controller::SamplesRef>,
}

/// Seconds one step's stages kept each group busy, and the policy's view of the step.
struct Observed {
    metrics: yatt_placement::StepMetrics,
    groups: Vec<GroupUse>,
}

/// The live placement shell of one job, embedded or on a cluster.
pub struct LivePlacement {
    job: JobConfig,
    node: Node,
    hosts: Hosts,
    policy: PlacementPolicy,
    plan: Plan,
    replicas: BTreeMap<GroupId, Replica>,
    shared: Shared,
    controllers: Vec<Controller>,
    routing_version: u64,
    next_replica: u32,
    log: std::fs::File,
    log_path: PathBuf,
    /// The plan before the last migration: the "no move" baseline.
    before_move: Option<Plan>,
    /// The last step's ledgers, one per head.
    last_ledgers: Vec<LedgerReport>,
    /// The generation calls in flight, shared by every head.
    probe: GenProbe,
    /// On a cluster: the nodes of `placement.nodes` whose groups are in the inventory,
    /// with the incarnation seen (a restarted node is lost, then joins again).
    known_nodes: BTreeMap<String, u64>,
    /// Role starts still to fail on purpose ([`LivePlacement::fail_next_starts`]).
    start_faults: usize,
    /// Whether the last failed migration was rolled back (the heads run on the old
    /// plan) rather than left half-done.
    rolled_back: bool,
}

/// Where the groups are, and so how a role starts on one.
enum Hosts {
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

fn rset(r: PRole) -> RoleSet {
    RoleSet::of(&[r])
}

/// A virtual device of one libtorch thread, as the cost model sees it. The figures are
/// effective rates of a small model on one x86 core (op dispatch dominates decoding);
/// the online fit corrects them within its bounds from the first steps.
fn cpu_thread_spec() -> GpuSpec {
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
fn rollout_slots(job: &JobConfig) -> u32 {
    let all = job.data.prompts_per_step as u32 * job.data.samples_per_prompt;
    match job.rollout.max_batch {
        0 => all,
        cap => all.min(cap as u32),
    }
}

fn me(job: &JobConfig) -> impl Fn(yatt_engine::EngineError) -> JobError + '_ {
    move |e| JobError::Model {
        source_desc: job.model.source.clone(),
        reason: e.to_string(),
    }
}

fn invalid(key: &str, expected: &str, found: &str, fix: &str) -> JobError {
    JobError::Invalid {
        key: key.into(),
        expected: expected.into(),
        found: found.into(),
        fix: fix.into(),
    }
}

/// `placement.groups` virtual groups of one thread in this process.
fn embedded_inventory(job: &JobConfig, gpu: &GpuSpec) -> Result<Inventory, JobError> {
    let (heads, groups) = (job.job.controllers, job.placement.groups);
    if groups != heads + 1 {
        return Err(invalid(
            "placement.groups",
            &format!("job.controllers + 1 = {}", heads + 1),
            &groups.to_string(),
            "the rollout and the policy each take 1 or job.controllers groups",
        ));
    }
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
async fn cluster_inventory(
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
    if job.algorithm.kl_mode != "none" {
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
        job.validate()?;
        let p = &job.placement;
        let heads = job.job.controllers;
        if heads < 2 || job.job.driver != "parallel" {
            return Err(invalid(
                "job.controllers",
                "at least 2 parallel heads under placement.live",
                &heads.to_string(),
                "set job.controllers = 2 and job.driver = \"parallel\"",
            ));
        }
        if p.rollout_groups != 1 && p.rollout_groups != heads {
            return Err(invalid(
                "placement.rollout_groups",
                &format!("1 or job.controllers ({heads})"),
                &p.rollout_groups.to_string(),
                "set rollout_groups = 1",
            ));
        }
        if job.model.threads != 1 {
            return Err(invalid(
                "model.threads",
                "1 under placement.live (a group is one libtorch thread)",
                &job.model.threads.to_string(),
                "set model.threads = 1; add groups for more threads",
            ));
        }
        if job.algorithm.name == "ppo" {
            return Err(JobError::NotImplemented {
                key: "algorithm.name".into(),
                found: "ppo with placement.live".into(),
                fix:
                    "live placement moves rollout and policy groups; use grpo, rloo or reinforce++"
                        .into(),
            });
        }
        let with_reference = job.algorithm.kl_mode != "none";
        let cluster = p.mode == "disaggregated";
        if cluster && with_reference && p.reference.is_empty() {
            return Err(invalid(
                "placement.reference",
                &format!(
                    "the node of the reference, as algorithm.kl_mode = {:?}",
                    job.algorithm.kl_mode
                ),
                "nothing",
                "add reference = \"NODE\" under [placement], or set algorithm.kl_mode = \"none\"",
            ));
        }
        let (mut model, codec, pad_id) = base_model(job)?;
        tch::set_num_threads(1);
        let params = model.num_parameters() as f64;
        let cfg = &model.config;
        let spec = ModelSpec {
            name: job.model.source.clone(),
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
        let (inventory, members) = match cluster {
            false => (embedded_inventory(job, &gpu)?, Vec::new()),
            true => cluster_inventory(job, node).await?,
        };
        let setup = CostSetup {
            job: shape,
            gpu,
            group_devices: 1,
            staleness: 0,
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
        let mut policy = PlacementPolicy::starting_from(
            p.replan,
            inventory,
            setup,
            forecast,
            plan.clone(),
            limits,
        )
        .map_err(|e| invalid("[placement]", "a plan that fits", "", &e.to_string()))?;
        // Starting a role here takes a fraction of a second, not a GPU engine's 10 s;
        // the first migration replaces the guess with a measurement.
        policy.cost_model_mut().set_start_costs(0.2, 0.2);
        let (hosts, shared) = match cluster {
            false => {
                let group = DeviceGroup::cpu(node.name());
                let shared = Shared {
                    reward: spawn_reward(job, node, group.clone()).await?,
                    reference: match with_reference {
                        false => None,
                        true => Some(
                            spawn_role(
                                node,
                                crate::job::reference_role(
                                    job,
                                    model.deep_copy(Device::Cpu, Kind::Float).map_err(me(job))?,
                                    pad_id,
                                ),
                                0,
                                group.clone(),
                            )
                            .await?,
                        ),
                    },
                };
                let hosts = Hosts::Embedded {
                    codec,
                    pad_id,
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
                    reward: remote::spawn(job, &text, node, "reward", &p.reward).await?,
                    reference: match with_reference {
                        false => None,
                        true => {
                            Some(remote::spawn(job, &text, node, "reference", &p.reference).await?)
                        }
                    },
                };
                (Hosts::Cluster { text }, shared)
            }
        };
        drop(model);
        let out = job.job.output_dir.clone();
        std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
            path: out.clone(),
            source,
        })?;
        let log_path = out.join(yatt_placement::RECORD_FILE);
        let log = std::fs::File::create(&log_path).map_err(|source| JobError::Write {
            path: log_path.clone(),
            source,
        })?;
        let mut live = LivePlacement {
            job: job.clone(),
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
        };
        // Every policy replica starts from the first one's state (a fresh trainer):
        // across processes nothing else guarantees the same weights.
        let mut first: Option<PolicyRef> = None;
        for pool in &plan.pools {
            for g in &pool.groups {
                let r = if pool.roles.contains(PRole::Rollout) {
                    Replica::Rollout(live.start_rollout(*g).await?)
                } else {
                    let r = live.start_policy(*g, first.as_ref()).await?;
                    first.get_or_insert_with(|| r.clone());
                    Replica::Policy(r)
                };
                live.replicas.insert(*g, r);
            }
        }
        live.route(None).await?;
        live.sync_all().await?;
        if let (Some(reference), Some(policy), Hosts::Cluster { .. }) =
            (&live.shared.reference, &first, &live.hosts)
        {
            // The reference is the initial policy, whichever node built it.
            let t = live.deadline();
            let update = match ask_policy(policy, PolicyRequest::ExportWeights, t).await? {
                PolicyResponse::Weights(u) => u,
                other => return Err(unexpected("ExportWeights", &other)),
            };
            reference
                .ask(RoleRequest::LoadWeights(update), t)
                .await
                .map_err(|e| placement_err(format!("the reference did not take weights: {e}")))?;
        }
        live.publish(0)?;
        Ok(live)
    }

    /// The plan the heads are routed by.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// The heads (for checkpoints and tests).
    pub fn controllers(&self) -> &[Controller] {
        &self.controllers
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
    fn injected_fault(&mut self, g: GroupId, role: &str) -> Result<(), JobError> {
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
    fn deadline(&self) -> Duration {
        Duration::from_secs(self.job.placement.spawn_timeout_s)
    }

    fn node_of(&self, g: GroupId) -> Result<&str, JobError> {
        self.policy
            .inventory()
            .group(g)
            .map(|group| group.node.as_str())
            .ok_or_else(|| placement_err(format!("{g} is not a group of the inventory")))
    }

    /// Starts a rollout replica on group `g`; it gets the policy's weights at the next
    /// weight sync.
    async fn start_rollout(&mut self, g: GroupId) -> Result<RolloutRef, JobError> {
        self.injected_fault(g, "rollout")?;
        match &self.hosts {
            Hosts::Embedded {
                codec, template, ..
            } => {
                let m = template
                    .deep_copy(Device::Cpu, Kind::Float)
                    .map_err(me(&self.job))?;
                let role = rollout_role(&self.job, m, codec.clone());
                self.spawn_here(g, role).await
            }
            Hosts::Cluster { text } => self.spawn_there(g, text, "rollout").await,
        }
    }

    /// Starts `role` on a thread of this process for group `g` and records it in the
    /// directory (an actor only this process reaches is not registered by itself).
    async fn spawn_here<R: Role>(
        &mut self,
        g: GroupId,
        role: R,
    ) -> Result<ActorRef<RoleRequest<R::Request>, RoleResponse<R::Response>>, JobError> {
        self.next_replica += 1;
        let r = spawn_role(&self.node, role, self.next_replica, self.device_group(g)).await?;
        self.announce(Change::ActorUp(r.id().clone())).await?;
        Ok(r)
    }

    /// Starts `role` on group `g`'s node through its factory (the hosting node records
    /// the actor in the directory itself).
    async fn spawn_there<Req: Message, Resp: Message>(
        &self,
        g: GroupId,
        text: &str,
        role: &'static str,
    ) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, JobError> {
        let target = self.node_of(g)?;
        Ok(remote::spawn(&self.job, text, &self.node, role, target).await?)
    }

    /// Records a replica's start or stop in the runtime's directory (a new epoch).
    async fn announce(&self, change: Change) -> Result<(), JobError> {
        self.node
            .propose(change)
            .await
            .map_err(|e| JobError::Placement {
                what: format!("the directory refused a change: {e}"),
                fix: "see the node's log".into(),
            })
    }

    /// Starts a policy replica on group `g`, with `from`'s whole trainer state (weights,
    /// optimizer, step) when given. A replica that fails to take the state is stopped
    /// again, so nothing is left behind.
    async fn start_policy(
        &mut self,
        g: GroupId,
        from: Option<&PolicyRef>,
    ) -> Result<PolicyRef, JobError> {
        self.injected_fault(g, "policy")?;
        let r = match &self.hosts {
            Hosts::Embedded {
                template, pad_id, ..
            } => {
                let m = template
                    .deep_copy(Device::Cpu, Kind::Float)
                    .map_err(me(&self.job))?;
                let t = Trainer::new(m, train_config(&self.job));
                let role = policy_role_from(&self.job, t, *pad_id)?;
                self.spawn_here(g, role).await?
            }
            Hosts::Cluster { text } => self.spawn_there(g, text, "policy").await?,
        };
        if let Some(src) = from {
            if let Err(e) = self.hand_off(src, &r).await {
                let _ = self.stop(&Replica::Policy(r)).await;
                return Err(e);
            }
        }
        Ok(r)
    }

    /// Copies `src`'s trainer state to `dst` as bytes (over QUIC when either is remote).
    async fn hand_off(&self, src: &PolicyRef, dst: &PolicyRef) -> Result<(), JobError> {
        let t = self.deadline();
        let state = match ask_policy(src, PolicyRequest::ExportState, t).await? {
            PolicyResponse::State(s) => s,
            other => return Err(unexpected("ExportState", &other)),
        };
        match ask_policy(dst, PolicyRequest::ImportState(state), t).await? {
            PolicyResponse::Imported => Ok(()),
            other => Err(unexpected("ImportState", &other)),
        }
    }

    /// Drains, offloads and stops a replica (its thread ends and drops its tensors);
    /// returns the work items a drain gave up.
    async fn stop(&self, replica: &Replica) -> Result<Vec<u64>, JobError> {
        let t = self.deadline();
        let (drained, id) = match replica {
            Replica::Rollout(r) => (drain_and_stop(r, t).await?, r.id().clone()),
            Replica::Policy(p) => (drain_and_stop(p, t).await?, p.id().clone()),
        };
        // A remote node records its actor's exit in the directory itself.
        if let Hosts::Embedded { .. } = self.hosts {
            self.announce(Change::ActorDown {
                id,
                reason: ExitReason::Normal,
            })
            .await?;
        }
        Ok(drained)
    }

    fn device_group(&self, g: GroupId) -> DeviceGroup {
        DeviceGroup {
            node: self.node.name().to_string(),
            devices: vec![g.0],
            cuda: false,
        }
    }

    fn of_role(&self, role: PRole) -> Vec<(GroupId, Replica)> {
        let pool = self
            .plan
            .pool_of(role)
            .map(|p| p.groups.clone())
            .unwrap_or_default();
        pool.iter()
            .filter_map(|g| self.replicas.get(g).map(|r| (*g, r.clone())))
            .collect()
    }

    /// Which rollout and policy group each head uses under the plan.
    fn routes(&self) -> Result<Routes, JobError> {
        let heads = self.job.job.controllers;
        let rollouts: Vec<(GroupId, RolloutRef)> = self
            .of_role(PRole::Rollout)
            .into_iter()
            .filter_map(|(g, r)| match r {
                Replica::Rollout(r) => Some((g, r)),
                Replica::Policy(_) => None,
            })
            .collect();
        let policies: Vec<(GroupId, PolicyRef)> = self
            .of_role(PRole::Policy)
            .into_iter()
            .filter_map(|(g, r)| match r {
                Replica::Policy(p) => Some((g, p)),
                Replica::Rollout(_) => None,
            })
            .collect();
        if rollouts.is_empty() || !(policies.len() == 1 || policies.len() == heads) {
            return Err(JobError::NotImplemented {
                key: "placement".into(),
                found: self.plan.summary(),
                fix: format!(
                    "the live executor routes {heads} heads over 1..{heads} rollout groups and 1 or {heads} policy groups"
                ),
            });
        }
        let r = (0..heads)
            .map(|i| rollouts[i % rollouts.len()].clone())
            .collect();
        let p = (0..heads)
            .map(|i| policies[i % policies.len()].clone())
            .collect();
        Ok((r, p))
    }

    /// Rebuilds the heads over the plan's replicas, keeping each head's position; on a
    /// cluster, replicas of a head each join a new gradient ring of the replica set.
    async fn route(
        &mut self,
        states: Option<Vec<crate::controller::ControllerState>>,
    ) -> Result<(), JobError> {
        let (r, p) = self.routes()?;
        // Each head's spares: the routing's other rollout replicas.
        let mut rollouts: Vec<RolloutRef> = Vec::new();
        for (_, x) in &r {
            if !rollouts.iter().any(|y| y.id() == x.id()) {
                rollouts.push(x.clone());
            }
        }
        let shared = RoleRefs {
            rollout: r[0].1.clone(),
            extra_rollouts: Vec::new(),
            reward: self.shared.reward.clone(),
            reference: self.shared.reference.clone(),
            policy: p[0].1.clone(),
            critic: None,
        };
        let mut heads = controllers(
            &self.job,
            shared,
            r.into_iter().map(|x| x.1).collect(),
            p.into_iter().map(|x| x.1).collect(),
        )?;
        if let Some(states) = states {
            for (c, s) in heads.iter_mut().zip(states) {
                c.restore(s)?;
            }
        }
        // Replicas built in this process have no ring inbox: the heads average their
        // gradients through the controllers instead.
        let replicated = self.of_role(PRole::Policy).len() == heads.len() && heads.len() > 1;
        if replicated && matches!(self.hosts, Hosts::Cluster { .. }) {
            join_policy_ring(&mut heads, RING_CHUNK_BYTES).await?;
        }
        for c in &mut heads {
            let own = c.roles().rollout.id().clone();
            let spares = rollouts.iter().filter(|x| *x.id() != own).cloned();
            c.set_spare_rollouts(spares.collect());
            c.set_probe(self.probe.clone());
        }
        self.controllers = heads;
        self.routing_version += 1;
        Ok(())
    }

    async fn sync_all(&mut self) -> Result<(), JobError> {
        for c in &mut self.controllers {
            c.sync_weights().await?;
        }
        Ok(())
    }

    fn write(&mut self, r: &Record) -> Result<(), JobError> {
        let line = serde_json::to_string(r).expect("records serialise");
        writeln!(self.log, "{line}")
            .and_then(|_| self.log.flush())
            .map_err(|source| JobError::Write {
                path: self.log_path.clone(),
                source,
            })
    }

    fn publish(&mut self, step: u64) -> Result<(), JobError> {
        let r = Record::Plan {
            step,
            routing_version: self.routing_version,
            directory_epoch: self.node.directory().epoch(),
            plan: self.plan.clone(),
        };
        self.write(&r)
    }

    /// Runs one step of every head, feeds the policy, and carries out what it decides
    /// before the next step. Returns the step's metrics, averaged over the heads, with
    /// `placement/*` added.
    ///
    /// On a cluster it first follows membership: a node of `placement.nodes` that died
    /// (or left) is fed as [`Event::NodeLeft`] and the policy's `NodeLost` re-plan is
    /// carried out at once; one that joined (or restarted) is fed as
    /// [`Event::NodeJoined`], its devices becoming groups the policy may use. A rollout
    /// replica lost during the step does not fail it: its samples are requeued in the
    /// head's ledger and generated on another rollout replica of the routing.
    pub async fn step(&mut self) -> Result<StepMetrics, JobError> {
        let t = Instant::now();
        let before: Vec<_> = self.controllers.iter().map(Controller::state).collect();
        let reports = match step_data_parallel(&mut self.controllers).await {
            Ok(r) => r,
            // Generation failed with no spare to take it over (a single rollout group)
            // and a node is gone: nothing was trained yet, so the heads go back to
            // before the step, the loss is carried out (a policy group may become the
            // rollout), and the step runs again on the new plan.
            Err(crate::controller::ControllerError::Call { stage: "gen", .. })
                if matches!(self.hosts, Hosts::Cluster { .. }) && !self.dead_nodes().is_empty() =>
            {
                for (c, s) in self.controllers.iter_mut().zip(before) {
                    c.restore(s)?;
                }
                let step = self.controllers.first().map_or(0, Controller::step_count);
                self.write(&Record::Search {
                    step,
                    line: format!(
                        "step {step}: generation lost its only rollout replica with node(s) {}; the step runs again after the re-plan",
                        self.dead_nodes().join(", ")
                    ),
                })?;
                self.follow_membership(step).await?;
                match step_data_parallel(&mut self.controllers).await {
                    Ok(r) => r,
                    Err(e) => return Err(self.explain_failed_step(e.into())),
                }
            }
            Err(e) => return Err(self.explain_failed_step(e.into())),
        };
        let wall = t.elapsed().as_secs_f64();
        self.last_ledgers = reports.iter().map(|r| r.ledger.clone()).collect();
        let step = reports.first().map_or(0, |r| r.metrics.step);
        let obs = self.observe(&reports, wall)?;
        // Membership first: a lost node's re-plan bypasses the policy's hysteresis, and
        // the metrics then meet the plan in force.
        self.follow_membership(step).await?;
        let decisions = self.policy.on_event(Event::Metrics(obs.metrics));
        let predicted = self.policy.predict_plan(&self.plan, 0.0).step_s;
        let no_move = self
            .before_move
            .as_ref()
            .map(|p| self.policy.predict_plan(p, 0.0).step_s);
        self.write(&Record::Step {
            step,
            step_s: wall,
            predicted_s: finite(predicted),
            no_move_s: no_move.and_then(finite),
            groups: obs.groups,
        })?;
        self.write_policy_log(step)?;
        let mut m = average(&reports);
        m.values.insert("timing_s/step_wall".into(), wall);
        m.values.insert("placement/predicted_s".into(), predicted);
        if let Some(x) = no_move {
            m.values.insert("placement/no_move_s".into(), x);
        }
        let requeued: u64 = self.last_ledgers.iter().map(|l| l.requeued).sum();
        m.values
            .insert("placement/requeued".into(), requeued as f64);
        self.apply(decisions, step).await?;
        let count = |r: PRole| self.plan.pool_of(r).map_or(0, |p| p.groups.len()) as f64;
        m.values
            .insert("placement/rollout_groups".into(), count(PRole::Rollout));
        m.values
            .insert("placement/policy_groups".into(), count(PRole::Policy));
        m.values.insert(
            "placement/routing_version".into(),
            self.routing_version as f64,
        );
        Ok(m)
    }

    /// A failed step's error, naming the nodes of the plan the directory has declared
    /// dead (the likely cause) and what would have let the run go on.
    fn explain_failed_step(&self, e: JobError) -> JobError {
        let dead = self.dead_nodes();
        if dead.is_empty() {
            return e;
        }
        let hosted: Vec<String> = self
            .replicas()
            .into_iter()
            .filter(|(_, n, ..)| dead.contains(n))
            .map(|(g, n, role, _)| format!("{role} on {g} ({n})"))
            .collect();
        JobError::Placement {
            what: format!(
                "the step failed after node(s) {} left the cluster, with the replicas {}: {e}",
                dead.join(", "),
                hosted.join(", ")
            ),
            fix: "live placement survives losing nodes that host only rollout replicas; a lost policy replica cannot be recovered: resume the run from its last checkpoint".into(),
        }
    }

    /// Nodes whose groups are in the inventory but which the directory no longer lists
    /// alive in the incarnation the shell knows.
    fn dead_nodes(&self) -> Vec<String> {
        let known = &self.known_nodes;
        self.node.directory().read(|d| {
            known
                .iter()
                .filter(|(name, inc)| {
                    !d.alive_nodes()
                        .any(|n| n.name == **name && n.incarnation == **inc)
                })
                .map(|(name, _)| name.clone())
                .collect()
        })
    }

    /// The policy's reasoning since the last call, as `Search` records.
    fn write_policy_log(&mut self, step: u64) -> Result<(), JobError> {
        for line in self.policy.take_log() {
            self.write(&Record::Search { step, line })?;
        }
        Ok(())
    }

    /// On a cluster: feeds the policy the nodes of `placement.nodes` that left (or
    /// restarted) and joined since the last step, and carries out its decisions.
    async fn follow_membership(&mut self, step: u64) -> Result<(), JobError> {
        if !matches!(self.hosts, Hosts::Cluster { .. }) {
            return Ok(());
        }
        for node in self.dead_nodes() {
            self.lose_node(&node, step).await?;
        }
        let wanted = self.job.placement.nodes.clone();
        let alive: Vec<NodeInfo> = self.node.directory().read(|d| {
            wanted
                .iter()
                .filter_map(|w| d.alive_nodes().find(|n| n.name == *w).cloned())
                .collect()
        });
        for info in alive {
            if !self.known_nodes.contains_key(&info.name) {
                self.join_node(info, step).await?;
            }
        }
        Ok(())
    }

    /// A node of the plan is gone: its groups leave the inventory and the plan. Its
    /// rollout replicas are dropped (their samples were requeued during the step); the
    /// policy's `NodeLost` migration moves the plan onto the remaining groups.
    async fn lose_node(&mut self, node: &str, step: u64) -> Result<(), JobError> {
        let groups: Vec<GroupId> = self
            .policy
            .inventory()
            .groups()
            .filter(|g| g.node == node)
            .map(|g| g.id)
            .collect();
        let policy_on: Vec<String> = groups
            .iter()
            .filter(|g| matches!(self.replicas.get(g), Some(Replica::Policy(_))))
            .map(|g| g.to_string())
            .collect();
        if !policy_on.is_empty() {
            return Err(JobError::Placement {
                what: format!(
                    "node {node} left the cluster with the policy replica(s) of {}: the trainer state (weights, optimizer) there is lost",
                    policy_on.join(", ")
                ),
                fix: "live placement recovers from losing nodes that host only rollout replicas; resume the run from its last checkpoint (job.checkpoint_every) on nodes that stay up".into(),
            });
        }
        self.known_nodes.remove(node);
        for g in &groups {
            self.replicas.remove(g);
        }
        let names: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        self.write(&Record::Search {
            step,
            line: format!(
                "node {node} left the cluster (declared dead or gone): its group(s) {} leave the inventory",
                names.join(" ")
            ),
        })?;
        let decisions = self.policy.on_event(Event::NodeLeft { node: node.into() });
        self.write_policy_log(step)?;
        let used = self.plan.roles_by_group();
        if decisions.is_empty() && groups.iter().any(|g| used.contains_key(g)) {
            return Err(JobError::Placement {
                what: format!(
                    "after losing node {node} ({}), no plan of the {} remaining group(s) fits the live executor (a rollout group and 1 or job.controllers policy groups)",
                    names.join(" "),
                    self.policy.inventory().len()
                ),
                fix: "start a node of placement.nodes again (it joins the run) before the next step, or resume the run from its last checkpoint".into(),
            });
        }
        self.apply(decisions, step).await
    }

    /// A node of `placement.nodes` joined (or came back): its devices become groups of
    /// the inventory, which the policy may use from its next search.
    async fn join_node(&mut self, info: NodeInfo, step: u64) -> Result<(), JobError> {
        let decisions = self.policy.on_event(Event::NodeJoined(node_desc(&info)));
        let added: Vec<GroupId> = self
            .policy
            .inventory()
            .groups()
            .filter(|g| g.node == info.name)
            .map(|g| g.id)
            .collect();
        self.known_nodes.insert(info.name.clone(), info.incarnation);
        let names: Vec<String> = added.iter().map(|g| g.to_string()).collect();
        self.write(&Record::Search {
            step,
            line: format!(
                "node {} joined the cluster with {} device(s): group(s) {} join the inventory ({} group(s) in all)",
                info.name,
                info.devices.len(),
                names.join(" "),
                self.policy.inventory().len()
            ),
        })?;
        self.write_policy_log(step)?;
        self.apply(decisions, step).await
    }

    /// Carries out the policy's decisions after `step`, records each and its outcome,
    /// and reports the outcome back to the policy.
    async fn apply(&mut self, decisions: Vec<Decision>, step: u64) -> Result<(), JobError> {
        for d in decisions {
            let Decision::Migrate(mig) = d;
            self.write(&Record::Decision {
                step,
                id: mig.id,
                reason: mig.reason,
                from: self.plan.summary(),
                to: mig.target.summary(),
                moves: mig.moves.clone(),
                predicted_before_s: finite(mig.predicted_s.0),
                predicted_after_s: finite(mig.predicted_s.1),
                cost_s: mig.cost_s,
            })?;
            let t = Instant::now();
            let outcome = self.migrate(&mig).await;
            let secs = t.elapsed().as_secs_f64();
            let (ok, detail) = match &outcome {
                Ok(d) => (true, d.clone()),
                Err(e) => (false, e.to_string()),
            };
            self.write(&Record::Migrated {
                id: mig.id,
                ok,
                seconds: secs,
                detail,
            })?;
            let event = match outcome {
                Ok(_) => {
                    // What a start really costs here, for the next decision.
                    let starts = mig.moves.iter().filter(|m| !m.to.is_empty()).count();
                    let per_group = secs / starts.max(1) as f64;
                    self.policy
                        .cost_model_mut()
                        .set_start_costs(per_group, per_group);
                    Event::MigrationDone { id: mig.id }
                }
                Err(e) => {
                    // Rolled back: the heads run on the old plan. A rollback that
                    // failed too stops the run loudly rather than fail the next step,
                    // and so does a lost node's re-plan (the old plan has lost groups).
                    if !self.rolled_back || mig.reason == Reason::NodeLost {
                        return Err(e);
                    }
                    Event::MigrationFailed {
                        id: mig.id,
                        reason: e.to_string(),
                    }
                }
            };
            self.policy.on_event(event);
            self.write_policy_log(step)?;
            self.publish(step + 1)?;
        }
        Ok(())
    }

    /// Carries out one migration at a step boundary. If a step of it fails (a drain,
    /// a gaining role that does not start, the new routing), it is undone: the groups
    /// get back the roles of the plan in force (stopping what the migration started,
    /// restarting what it stopped: a policy replica from a survivor's state), the heads
    /// are routed by that plan again and synced, and the error is returned for
    /// [`Event::MigrationFailed`]. A rollback that itself fails is returned with both
    /// errors, and the run stops.
    async fn migrate(&mut self, mig: &yatt_placement::Migration) -> Result<String, JobError> {
        let old = self.plan.clone();
        let states: Vec<_> = self.controllers.iter().map(Controller::state).collect();
        self.rolled_back = false;
        match self.migrate_forward(mig, states.clone()).await {
            Ok(done) => {
                self.before_move = Some(old);
                Ok(done)
            }
            Err(e) => {
                let (what, fix) = match e {
                    JobError::Placement { what, fix } => (what, fix),
                    other => (other.to_string(), "see the nodes' logs".to_string()),
                };
                match self.roll_back(&old, states).await {
                    Ok(restored) => {
                        self.rolled_back = true;
                        Err(JobError::Placement {
                            what: format!("{what}; rolled back to {} ({restored})", old.summary()),
                            fix,
                        })
                    }
                    Err(again) => Err(JobError::Placement {
                        what: format!("{what}; the rollback failed too: {again}"),
                        fix: "the groups are in no known plan, so the run stops; see the nodes' logs and resume the run from its last checkpoint".into(),
                    }),
                }
            }
        }
    }

    /// The migration's steps, in order (see the module docs).
    async fn migrate_forward(
        &mut self,
        mig: &yatt_placement::Migration,
        states: Vec<crate::controller::ControllerState>,
    ) -> Result<String, JobError> {
        let mut done = Vec::new();
        for mv in &mig.moves {
            // 1. Out of routing: the plan without this group serves until the new one
            // is published (the heads are rebuilt at the end). A lost group's replica
            // is already gone; a group new to the plan runs nothing yet.
            let replica = self.replicas.remove(&mv.group);
            if replica.is_none() && !mv.from.is_empty() && !self.lost(mv.group) {
                return Err(JobError::Placement {
                    what: format!("a move of {} which runs nothing", mv.group),
                    fix: "report this: the policy and the executor disagree on the plan".into(),
                });
            }
            // A policy replica that leaves hands its state to whoever gains the group.
            let survivor = self.survivor();
            // 2–3. Drain, free (offload, then stop: the thread drops the tensors).
            if let Some(replica) = &replica {
                let drained = self.stop(replica).await?;
                if !drained.is_empty() {
                    return Err(JobError::Placement {
                        what: format!("{} work items in flight on {}", drained.len(), mv.group),
                        fix: "migrations run at step boundaries, where nothing is in flight".into(),
                    });
                }
            }
            // 4. Start the gaining role: a policy replica continues from a survivor's
            // weights and optimizer state. A group that leaves the plan gains nothing.
            if mv.to.contains(PRole::Rollout) {
                let r = self.start_rollout(mv.group).await?;
                self.replicas.insert(mv.group, Replica::Rollout(r));
            } else if mv.to.contains(PRole::Policy) {
                let Some(src) = survivor.or(match replica {
                    Some(Replica::Policy(p)) => Some(p),
                    _ => None,
                }) else {
                    return Err(JobError::Placement {
                        what: "no policy replica left to copy".into(),
                        fix: "keep at least one policy group".into(),
                    });
                };
                let p = self.start_policy(mv.group, Some(&src)).await?;
                self.replicas.insert(mv.group, Replica::Policy(p));
            }
            let to = match mv.to.is_empty() {
                true => "(out of the plan)".to_string(),
                false => mv.to.to_string(),
            };
            done.push(format!("{}: {} -> {to}", mv.group, mv.from));
        }
        let old = std::mem::replace(&mut self.plan, mig.target.clone());
        if let Err(e) = self.route(Some(states)).await {
            self.plan = old;
            return Err(e);
        }
        // 5. Weight sync to every head's rollout (new replicas included).
        self.sync_all().await?;
        // 6. Publication is the caller's (it writes the plan record).
        Ok(done.join("; "))
    }

    /// Whether group `g` left the inventory with its node.
    fn lost(&self, g: GroupId) -> bool {
        self.policy.inventory().group(g).is_none()
    }

    /// A running policy replica, whose state a new one copies.
    fn survivor(&self) -> Option<PolicyRef> {
        self.replicas.values().find_map(|r| match r {
            Replica::Policy(p) => Some(p.clone()),
            Replica::Rollout(_) => None,
        })
    }

    /// Gives every group of `old` that is still in the inventory its role under `old`
    /// again, stops what runs on groups outside it, and routes the heads by it from
    /// `states`. Returns what it restored.
    async fn roll_back(
        &mut self,
        old: &Plan,
        states: Vec<crate::controller::ControllerState>,
    ) -> Result<String, JobError> {
        let want = old.roles_by_group();
        let mut restored = Vec::new();
        // Groups the migration gave a role outside the old plan.
        let extra: Vec<GroupId> = self
            .replicas
            .keys()
            .filter(|g| !want.contains_key(g))
            .copied()
            .collect();
        for g in extra {
            if let Some(r) = self.replicas.remove(&g) {
                self.stop(&r).await?;
                restored.push(format!("{g} stopped"));
            }
        }
        for (g, roles) in &want {
            if self.lost(*g) {
                continue;
            }
            let rollout = roles.contains(PRole::Rollout);
            match self.replicas.get(g) {
                Some(Replica::Rollout(_)) if rollout => continue,
                Some(Replica::Policy(_)) if !rollout => continue,
                Some(_) => {
                    let r = self.replicas.remove(g).expect("just seen");
                    self.stop(&r).await?;
                }
                None => {}
            }
            let r = match rollout {
                true => Replica::Rollout(self.start_rollout(*g).await?),
                false => {
                    let Some(src) = self.survivor() else {
                        return Err(placement_err(format!(
                            "no policy replica is left to restart {g}'s from"
                        )));
                    };
                    Replica::Policy(self.start_policy(*g, Some(&src)).await?)
                }
            };
            self.replicas.insert(*g, r);
            restored.push(format!("{g}: {roles} again"));
        }
        self.plan = old.clone();
        self.route(Some(states)).await?;
        self.sync_all().await?;
        if restored.is_empty() {
            restored.push("nothing had changed".into());
        }
        Ok(restored.join("; "))
    }

    /// What the step did, as the cost model reads it, and each group's busy seconds.
    fn observe(&self, reports: &[StepReport], wall: f64) -> Result<Observed, JobError> {
        let (routes_r, routes_p) = self.routes()?;
        let get = |r: &StepReport, k: &str| r.metrics.get(k).unwrap_or(0.0);
        let mut gen_busy: BTreeMap<GroupId, f64> = BTreeMap::new();
        let mut pol_busy: BTreeMap<GroupId, (f64, f64)> = BTreeMap::new();
        let update = reports
            .first()
            .map_or(0.0, |r| get(r, "timing_s/update_actor"));
        for (i, r) in reports.iter().enumerate() {
            // Heads sharing a replica queue on it: the last to finish saw it busy all along.
            let g = routes_r[i].0;
            let e = gen_busy.entry(g).or_insert(0.0);
            *e = e.max(get(r, "timing_s/gen"));
            // The update's wall time keeps every policy group busy (a shared policy
            // computes the heads' gradients one after the other within it).
            let g = routes_p[i].0;
            let e = pol_busy.entry(g).or_insert((0.0, update));
            e.0 = e.0.max(get(r, "timing_s/old_log_prob"));
        }
        let samples: Vec<&Sample> = reports.iter().flat_map(|r| &r.samples).collect();
        let n = samples.len().max(1) as f64;
        let lens: Vec<f64> = samples.iter().map(|s| s.response_len() as f64).collect();
        let prompts: Vec<f64> = samples
            .iter()
            .map(|s| s.prompt_tokens.len() as f64)
            .collect();
        let tokens: f64 = lens.iter().sum();
        let all_tokens: f64 = tokens + prompts.iter().sum::<f64>();
        let ctx: f64 = lens
            .iter()
            .zip(&prompts)
            .map(|(l, p)| p * l + l * l / 2.0)
            .sum();
        let slots = rollout_slots(&self.job) as usize;
        let iterations: f64 = reports
            .iter()
            .map(|r| {
                let lens: Vec<usize> = r.samples.iter().map(Sample::response_len).collect();
                decode_iterations(&lens, slots) as f64
            })
            .sum();
        let logs: Vec<f64> = lens.iter().map(|l| l.max(1.0).ln()).collect();
        let log_mean = logs.iter().sum::<f64>() / n;
        let log_std = (logs.iter().map(|x| (x - log_mean).powi(2)).sum::<f64>() / n).sqrt();
        let obs = |stage, group_s, tokens| StageObs {
            stage,
            group_s,
            group_devices: 1,
            tokens,
            iterations: None,
            context_tokens: None,
            prefill_tokens: None,
        };
        let stages = vec![
            StageObs {
                iterations: Some(iterations),
                context_tokens: Some(ctx),
                prefill_tokens: Some(prompts.iter().sum()),
                ..obs(Stage::Gen, gen_busy.values().sum(), tokens)
            },
            obs(
                Stage::OldLogProb,
                pol_busy.values().map(|b| b.0).sum(),
                all_tokens,
            ),
            obs(
                Stage::TrainActor,
                pol_busy.values().map(|b| b.1).sum(),
                all_tokens,
            ),
        ];
        let sync = reports
            .iter()
            .map(|r| get(r, "timing_s/weight_sync"))
            .fold(0.0, f64::max);
        let mut groups = Vec::new();
        for (g, b) in &gen_busy {
            groups.push(GroupUse {
                group: *g,
                roles: rset(PRole::Rollout),
                busy_s: *b,
            });
        }
        for (g, b) in &pol_busy {
            groups.push(GroupUse {
                group: *g,
                roles: rset(PRole::Policy),
                busy_s: b.0 + b.1,
            });
        }
        groups.sort_by_key(|u| u.group);
        Ok(Observed {
            metrics: yatt_placement::StepMetrics {
                step: reports.first().map_or(0, |r| r.metrics.step),
                step_s: wall,
                stages,
                response_len_mean: tokens / n,
                response_log_mean: log_mean,
                response_log_std: log_std,
                prompt_len_mean: prompts.iter().sum::<f64>() / n,
                weight_sync_s: Some(sync),
                weight_sync_local: false,
                ..Default::default()
            },
            groups,
        })
    }
}

/// Decoding iterations of a continuous batch of `slots` over sequences of `lens`
/// tokens, each slot taking the next sequence as soon as it is free.
fn decode_iterations(lens: &[usize], slots: usize) -> usize {
    let mut free = vec![0usize; slots.max(1)];
    for l in lens {
        let (i, _) = free
            .iter()
            .enumerate()
            .min_by_key(|(_, t)| **t)
            .expect("at least one slot");
        free[i] += l;
    }
    free.into_iter().max().unwrap_or(0)
}

async fn drain_and_stop<Req: Send + 'static, Resp: Send + 'static>(
    r: &yatt_runtime::actor::ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    t: Duration,
) -> Result<Vec<u64>, JobError> {
    let call = |e: yatt_runtime::actor::CallError| JobError::Placement {
        what: format!("{} did not stop: {e}", r.id()),
        fix: "see the role's log".into(),
    };
    let drained = match r.ask(RoleRequest::Drain, t).await.map_err(call)? {
        RoleResponse::Drained(ids) => ids,
        _ => Vec::new(),
    };
    r.ask(RoleRequest::Offload, t).await.map_err(call)?;
    r.ask(RoleRequest::Stop, t).await.map_err(call)?;
    Ok(drained)
}

/// Asks a policy replica, with deadline `t`.
async fn ask_policy(
    p: &PolicyRef,
    request: PolicyRequest,
    t: Duration,
) -> Result<PolicyResponse, JobError> {
    match p.ask(RoleRequest::Serve(request), t).await {
        Ok(RoleResponse::Served(r)) => Ok(r),
        Ok(other) => Err(placement_err(format!(
            "{} answered {}",
            p.id(),
            crate::controller::variant(&other)
        ))),
        Err(e) => Err(placement_err(format!("{} did not answer: {e}", p.id()))),
    }
}

fn unexpected(asked: &str, got: &PolicyResponse) -> JobError {
    let got = format!("{got:?}");
    let got: String = got.chars().take(120).collect();
    placement_err(format!("the policy answered {asked} with {got}"))
}

fn placement_err(what: String) -> JobError {
    JobError::Placement {
        what,
        fix: "see the nodes' logs; the run stops rather than train on a broken plan".into(),
    }
}

/// The heads' metrics averaged (as [`crate::job::run_steps`] reports them).
fn average(reports: &[StepReport]) -> StepMetrics {
    let mut sum: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for r in reports {
        for (k, v) in &r.metrics.values {
            let e = sum.entry(k.clone()).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    StepMetrics {
        step: reports.first().map_or(0, |r| r.metrics.step),
        values: sum
            .into_iter()
            .map(|(k, (s, n))| (k, s / n as f64))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::decode_iterations;

    #[test]
    fn decode_iterations_follow_the_slots() {
        assert_eq!(decode_iterations(&[5, 9, 3], 8), 9);
        assert_eq!(decode_iterations(&[5, 9, 3], 1), 17);
        assert_eq!(decode_iterations(&[5, 9, 3, 4], 2), 12);
        assert_eq!(decode_iterations(&[], 2), 0);
    }
}
