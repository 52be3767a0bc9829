//! Parallel controllers: one per data-parallel head.
//!
//! What belongs here: [`Controller`], which owns its prompt shard ([`Dataloader`]) and
//! drives one RLHF step through the roles, the step's [`StepMetrics`] (verl-style
//! names), the checkpointable [`ControllerState`], and [`spawn_role`] for the embedded,
//! single-process mode. The controller talks to roles only through `ActorRef`s to their
//! [`RoleActor`]s, each ask with a deadline, so the same code drives roles in this
//! process or on other nodes ([`crate::remote`]).
//!
//! One step:
//! 1. take `prompts_per_step` prompts from the shard and expect `n` samples of each in
//!    the [`SampleLedger`];
//! 2. rollout → reward → reference (optional) → policy old log-probs, each stage's
//!    answer recorded and verified in the ledger before the next stage starts, so a
//!    dropped or duplicated sample fails the step before the optimizer sees the batch;
//! 3. advantages here (GRPO by default; RLOO, REINFORCE++; optional KL-in-reward);
//! 4. policy update, then weight sync: the policy exports its weights as buckets and
//!    the rollout loads them in place (in-process the buckets are moved, not copied);
//! 5. close the ledger and report metrics.
//!
//! Several controllers, each with its own shard and rollout, meet only at the policy's
//! update: [`step_data_parallel`] has the policy compute each one's gradients on its
//! own samples and average them before one optimizer step. With a policy replica per
//! head (in this process or on cluster nodes), the replicas compute their shards side
//! by side and average them in a ring all-reduce straight between the replicas, over
//! the runtime's messages ([`yatt_runtime::RingMember`]), so their weights stay
//! bit-identical.
//!
//! PPO adds a critic: its values are a stage after the reference, advantages come from
//! GAE on token rewards, and the critic trains on the returns alongside the policy's
//! update. DAPO's dynamic sampling sits after the reward stage: prompt groups whose
//! rewards are all equal are dropped (recorded in the ledger as dropped, so they may
//! not reach a later stage) and more prompts are generated until the step has
//! `prompts_per_step` groups with signal or the round limit is hit.
//!
//! Weight sync goes through the controller (policy → controller → rollout).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};
use yatt_engine::SamplingParams;
use yatt_runtime::ActorId;
use yatt_runtime::Node;
use yatt_runtime::RingSpec;
use yatt_runtime::{ActorRef, CallError};

use crate::algo::{
    dynamic_sampling_filter, gae_advantage, grpo_advantage, kl_estimate, masked_mean,
    overlong_penalty, reinforce_pp_advantage, rloo_advantage, token_level_rewards, AlgoError,
    GaeConfig, GrpoConfig, KlEstimator, ReinforcePpConfig,
};
use crate::builtin::{
    CriticReport, CriticRequest, CriticResponse, GenerateRequest, GradShard, PolicyRequest,
    PolicyResponse, RolloutRequest, RolloutResponse, SampleSink, TrainReport,
};
use crate::data::{DataError, Dataloader, LoaderState};
use crate::ledger::{LedgerError, LedgerReport, SampleLedger, Stage};
use crate::role::{DeviceGroup, Role, RoleActor, RoleError, RoleRequest, RoleResponse};
use crate::sample::{
    group_indices, response_mask, split_rows, token_matrix, Sample, SampleError, SampleId,
    TokenField,
};

/// A reference to a rollout role's actor.
pub type RolloutRef = ActorRef<RoleRequest<RolloutRequest>, RoleResponse<RolloutResponse>>;
/// A reference to a role that takes samples and gives them back with a field filled in
/// (reward, reference).
pub type SamplesRef = ActorRef<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>>;
/// A reference to the policy role's actor.
pub type PolicyRef = ActorRef<RoleRequest<PolicyRequest>, RoleResponse<PolicyResponse>>;
/// A reference to the critic role's actor.
pub type CriticRef = ActorRef<RoleRequest<CriticRequest>, RoleResponse<CriticResponse>>;

/// The roles one controller drives.
#[derive(Debug, Clone)]
pub struct RoleRefs {
    /// Generation.
    pub rollout: RolloutRef,
    /// Further rollout replicas the controller spreads each generation round over,
    /// with `rollout` (single-driver mode: one controller, many replicas). Empty for a
    /// parallel-controller head, which owns one replica.
    pub extra_rollouts: Vec<RolloutRef>,
    /// Rewards.
    pub reward: SamplesRef,
    /// Reference log-probs (needed for a KL penalty, a KL loss and the `actor/kl` metric).
    pub reference: Option<SamplesRef>,
    /// The trainer.
    pub policy: PolicyRef,
    /// The value model (PPO with GAE needs one; the other estimators ignore it).
    pub critic: Option<CriticRef>,
}

/// Which advantage estimator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AdvantageEstimator {
    /// Group-normalised outcome rewards.
    Grpo(GrpoConfig),
    /// Leave-one-out baseline within the prompt group.
    Rloo,
    /// Token returns normalised over the batch.
    ReinforcePp(ReinforcePpConfig),
    /// PPO: generalised advantage estimation on the critic's values.
    Gae(GaeConfig),
}

/// DAPO dynamic sampling: drop prompt groups whose rewards are all equal and generate
/// more prompts until the step has `prompts_per_step` groups with signal.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DynamicSamplingConfig {
    /// Generation rounds per step at most (the first included); after the last round
    /// the step trains on the groups it has.
    pub max_rounds: usize,
    /// Rewards closer than this count as equal.
    pub tolerance: f64,
}

/// DAPO soft overlong punishment added to the reward of long responses.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OverlongConfig {
    /// Length at which the penalty reaches −1 (usually `max_new_tokens`).
    pub max_len: usize,
    /// The buffer before `max_len` over which the penalty ramps from 0 to −1.
    pub buffer: usize,
    /// Scale of the penalty.
    pub coef: f64,
}

/// A KL penalty folded into the rewards (KL-in-reward).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KlPenalty {
    /// Estimator of KL(old policy ‖ reference) per token.
    pub estimator: KlEstimator,
    /// Coefficient.
    pub coef: f64,
}

/// Deadlines of the controller's asks.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timeouts {
    /// Generation.
    pub generate: Duration,
    /// Reward, reference and old-log-prob scoring.
    pub score: Duration,
    /// The policy update.
    pub train: Duration,
    /// Weight export and load.
    pub sync: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        let m = Duration::from_secs(600);
        Timeouts {
            generate: m,
            score: m,
            train: m,
            sync: m,
        }
    }
}

/// How a controller runs its steps.
#[derive(Debug, Clone)]
pub struct ControllerConfig {
    /// Prompts per step (from this controller's shard).
    pub prompts_per_step: usize,
    /// Samples per prompt.
    pub n: u32,
    /// Sampling parameters (the seed is replaced per sample).
    pub sampling: SamplingParams,
    /// Seed of the per-sample sampling seeds.
    pub seed: u64,
    /// Advantage estimator.
    pub advantage: AdvantageEstimator,
    /// Optional KL penalty in the reward (needs a reference role).
    pub kl_in_reward: Option<KlPenalty>,
    /// Estimator of the `actor/kl` metric (old policy vs reference).
    pub kl_metric: KlEstimator,
    /// DAPO dynamic sampling (off when `None`).
    pub dynamic_sampling: Option<DynamicSamplingConfig>,
    /// DAPO overlong penalty (off when `None`).
    pub overlong: Option<OverlongConfig>,
    /// Stream samples out of the rollouts as they finish and score their rewards
    /// while generation goes on (in-process rollouts only: the stream is a channel).
    pub stream: bool,
    /// Devices this controller's roles use (the divisor of `perf/throughput`).
    pub devices: usize,
    /// Deadlines.
    pub timeouts: Timeouts,
}

impl Default for ControllerConfig {
    fn default() -> Self {
        ControllerConfig {
            prompts_per_step: 8,
            n: 4,
            sampling: SamplingParams::default(),
            seed: 0,
            advantage: AdvantageEstimator::Grpo(GrpoConfig::default()),
            kl_in_reward: None,
            kl_metric: KlEstimator::K3,
            dynamic_sampling: None,
            overlong: None,
            stream: false,
            devices: 1,
            timeouts: Timeouts::default(),
        }
    }
}

/// Why a step (or setting up a controller) failed.
#[derive(Debug, thiserror::Error)]
pub enum ControllerError {
    /// A role did not answer, or answered with an error.
    #[error("step {step}, {stage}: asking {role}: {source}")]
    Call {
        /// The step.
        step: u64,
        /// What the controller was doing.
        stage: &'static str,
        /// The role asked.
        role: &'static str,
        /// The runtime's error (timeout, handler error, ...).
        #[source]
        source: CallError,
    },
    /// A role answered with the wrong kind of response.
    #[error("step {step}: {role} answered {got} to a {asked} request")]
    Protocol {
        /// The step.
        step: u64,
        /// The role.
        role: &'static str,
        /// What was asked.
        asked: &'static str,
        /// What came back.
        got: String,
    },
    /// The sample ledger does not balance: a sample is missing, doubled or unexpected.
    #[error("step {step}: sample ledger: {source}")]
    Ledger {
        /// The step.
        step: u64,
        /// Which sample and stage.
        #[source]
        source: LedgerError,
    },
    /// A sample lacks what a stage needs.
    #[error("step {step}: {source}")]
    Sample {
        /// The step.
        step: u64,
        /// What is missing.
        #[source]
        source: SampleError,
    },
    /// The advantage or KL maths rejected the batch.
    #[error("step {step}: advantages: {source}")]
    Algo {
        /// The step.
        step: u64,
        /// The algorithm's error.
        #[source]
        source: AlgoError,
    },
    /// The rollout generated with weights other than the policy's latest.
    #[error("step {step}: {id} was generated with weights v{got}, but the policy is at v{want}; weight sync did not reach the rollout")]
    StaleWeights {
        /// The step.
        step: u64,
        /// The first stale sample.
        id: SampleId,
        /// Its weights version.
        got: u64,
        /// The policy's version.
        want: u64,
    },
    /// The configuration cannot work.
    #[error("controller config: {0}")]
    Config(String),
    /// Dynamic sampling found no prompt group whose rewards differ.
    #[error("step {step}: dynamic sampling found no prompt group with differing rewards in {rounds} generation rounds ({groups} groups dropped); raise algorithm.max_sampling_rounds or the temperature, or check the reward")]
    NoSignal {
        /// The step.
        step: u64,
        /// Generation rounds tried.
        rounds: usize,
        /// Groups seen and dropped.
        groups: usize,
    },
    /// The dataloader state could not be restored.
    #[error("restoring the controller: {0}")]
    Restore(#[source] DataError),
    /// A role could not be started or spawned.
    #[error("starting role {role}: {reason}")]
    Spawn {
        /// The role.
        role: String,
        /// Why.
        reason: String,
    },
}

/// One step's metrics, by verl-style name (`timing_s/gen`, `critic/rewards/mean`, ...).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepMetrics {
    /// The step.
    pub step: u64,
    /// Metric name → value.
    pub values: BTreeMap<String, f64>,
}

impl StepMetrics {
    /// A metric's value.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name).copied()
    }

    fn set(&mut self, name: &str, v: f64) {
        self.values.insert(name.to_string(), v);
    }
}

/// What one step produced.
#[derive(Debug, Clone)]
pub struct StepReport {
    /// Metrics.
    pub metrics: StepMetrics,
    /// The closed ledger.
    pub ledger: LedgerReport,
    /// The step's samples with every stage's fields (as sent to training).
    pub samples: Vec<Sample>,
    /// The policy update's report.
    pub train: TrainReport,
    /// The critic update's report (PPO).
    pub critic: Option<CriticReport>,
}

/// A controller's position, to checkpoint next to the policy's weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControllerState {
    /// Steps completed.
    pub step: u64,
    /// Policy weights version the rollout holds.
    pub weights_version: u64,
    /// The dataloader's position.
    pub loader: LoaderState,
}

/// What a streamed generation round produced.
struct Streamed {
    /// The rewarded samples, in `(prompt, k)` order.
    samples: Vec<Sample>,
    /// Generation counters.
    stats: crate::builtin::RolloutStats,
    /// Seconds until the last rollout finished.
    gen_s: f64,
    /// Seconds from then until the last reward came back (the part not overlapped).
    reward_tail_s: f64,
    /// Samples sent to the reward role before generation finished.
    early: usize,
}

/// A step between its advantages and its update.
struct Prepared {
    t_step: Instant,
    metrics: StepMetrics,
    ledger: SampleLedger,
    samples: Vec<Sample>,
    gen: crate::builtin::RolloutStats,
}

/// Runs one step of several controllers (data-parallel heads, each with its own shard
/// and rollout): each prepares its samples; then either their one shared policy
/// computes each head's gradients, averages them and takes one optimizer step, or,
/// with a policy replica per head (joined with [`join_policy_ring`]), the replicas
/// average their gradients among themselves and each takes the same step. Then every
/// controller syncs its rollout and closes its ledger. The controllers meet only at
/// the update. Their steps must be at the same count.
pub async fn step_data_parallel(
    controllers: &mut [Controller],
) -> Result<Vec<StepReport>, ControllerError> {
    let Some(first) = controllers.first() else {
        return Err(ControllerError::Config(
            "step_data_parallel needs at least one controller".into(),
        ));
    };
    let policy = first.roles.policy.clone();
    let step = first.step;
    if controllers.len() > 1 && controllers.iter().any(|c| c.roles.critic.is_some()) {
        return Err(ControllerError::Config(
            "a critic (PPO) is supported with one controller only; set job.controllers = 1 or use grpo/rloo/reinforce++".into(),
        ));
    }
    if let Some(c) = controllers.iter().find(|c| c.step != step) {
        return Err(ControllerError::Config(format!(
            "data-parallel controllers must be at the same step (found one at step {}, expected {step})",
            c.step
        )));
    }
    // Either every head shares one policy, or each has its own replica.
    let ids: std::collections::BTreeSet<_> = controllers
        .iter()
        .map(|c| c.roles.policy.id().clone())
        .collect();
    let replicated = ids.len() == controllers.len() && controllers.len() > 1;
    if !replicated && ids.len() != 1 {
        return Err(ControllerError::Config(format!(
            "data-parallel controllers must share one policy or each have their own replica ({} controllers, {} distinct policies; the first is {})",
            controllers.len(),
            ids.len(),
            policy.id()
        )));
    }
    // The heads prepare concurrently: each drives its own rollout replica.
    let prepared =
        futures::future::try_join_all(controllers.iter_mut().map(|c| c.prepare())).await?;
    let t = Instant::now();
    let train = if replicated && controllers.iter().all(|c| c.in_policy_ring) {
        all_reduce_update(controllers, &prepared).await?
    } else {
        // Replicas outside a ring (the live placement's) get every head's gradients
        // through the controllers and apply the same average.
        let shards = gather_shards(controllers, &prepared).await?;
        let appliers = if replicated {
            &controllers[..]
        } else {
            &controllers[..1]
        };
        let trained = apply_shards(appliers, shards).await?;
        check_replicas_agree(&trained)?;
        trained.into_iter().next().expect("at least one controller")
    };
    let secs = t.elapsed().as_secs_f64();
    let mut reports = Vec::with_capacity(prepared.len());
    for (c, p) in controllers.iter_mut().zip(prepared) {
        // Each ledger records the trained ids of its own samples only.
        let mine: std::collections::BTreeSet<SampleId> = p.samples.iter().map(|s| s.id).collect();
        let own = TrainReport {
            trained: train
                .trained
                .iter()
                .copied()
                .filter(|id| mine.contains(id))
                .collect(),
            ..train.clone()
        };
        reports.push(c.finish(p, own, None, secs).await?);
    }
    Ok(reports)
}

/// Each head's gradients on its own samples (side by side when the policy is
/// replicated; one after the other on a shared one). The shards keep head order
/// whatever order they finish in, so their average is the same every run.
async fn gather_shards(
    controllers: &[Controller],
    prepared: &[Prepared],
) -> Result<Vec<GradShard>, ControllerError> {
    futures::future::try_join_all(controllers.iter().zip(prepared).map(|(c, p)| async move {
        match c
            .serve_policy(
                PolicyRequest::Gradients(p.samples.clone()),
                "update_actor",
                c.config.timeouts.train,
            )
            .await?
        {
            PolicyResponse::Gradients(g) => Ok(g),
            other => Err(c.protocol("policy", "Gradients", format!("{other:?}"))),
        }
    }))
    .await
}

/// Has the policy of each of `appliers` average `shards` and take one optimizer step.
async fn apply_shards(
    appliers: &[Controller],
    shards: Vec<GradShard>,
) -> Result<Vec<TrainReport>, ControllerError> {
    let n = appliers.len();
    let mut shards = Some(shards);
    let applies = appliers.iter().enumerate().map(|(i, c)| {
        // Every applier but the last gets a copy; the last takes the shards themselves.
        let mine = if i + 1 == n {
            shards.take().unwrap_or_default()
        } else {
            shards.clone().unwrap_or_default()
        };
        async move {
            match c
                .serve_policy(
                    PolicyRequest::ApplyGradients(mine),
                    "update_actor",
                    c.config.timeouts.train,
                )
                .await?
            {
                PolicyResponse::Trained(r) => Ok(r),
                other => Err(c.protocol("policy", "ApplyGradients", format!("{other:?}"))),
            }
        }
    });
    futures::future::try_join_all(applies).await
}

/// Identical gradients give bit-identical norms: a differing norm or version after the
/// same update means the replicas' weights no longer agree.
fn check_replicas_agree(trained: &[TrainReport]) -> Result<(), ControllerError> {
    let Some(first) = trained.first() else {
        return Ok(());
    };
    match trained.iter().enumerate().find(|(_, r)| {
        r.version != first.version || r.grad_norm.to_bits() != first.grad_norm.to_bits()
    }) {
        Some((i, r)) => Err(ControllerError::Config(format!(
            "policy replicas diverged: replica 0 is at version {} with gradient norm {}, replica {i} at version {} with {} after the same update",
            first.version, first.grad_norm, r.version, r.grad_norm
        ))),
        None => Ok(()),
    }
}

/// The update of heads with a policy replica each: every replica computes its head's
/// gradients and averages them with the others' in a ring all-reduce that runs between
/// the replicas themselves (no gradient passes through a controller), then takes the
/// same optimizer step. Returns one report for all: the heads' loss statistics
/// averaged in head order (as `ApplyGradients` gives them), the optimizer's from the
/// first replica after checking that every replica agrees.
async fn all_reduce_update(
    controllers: &[Controller],
    prepared: &[Prepared],
) -> Result<TrainReport, ControllerError> {
    // Every replica must be in the exchange at once: they wait on each other.
    let trained =
        futures::future::try_join_all(controllers.iter().zip(prepared).map(|(c, p)| async move {
            match c
                .serve_policy(
                    PolicyRequest::TrainAllReduce(p.samples.clone()),
                    "update_actor",
                    c.config.timeouts.train,
                )
                .await?
            {
                PolicyResponse::Trained(r) => Ok(r),
                other => Err(c.protocol("policy", "TrainAllReduce", format!("{other:?}"))),
            }
        }))
        .await?;
    check_replicas_agree(&trained)?;
    let first = &trained[0];
    let reports: Vec<&TrainReport> = trained.iter().collect();
    Ok(TrainReport {
        optimizer_steps: first.optimizer_steps,
        version: first.version,
        grad_norm: first.grad_norm,
        lr: first.lr,
        // The replicas work side by side: the update took as long as the slowest.
        seconds: trained.iter().map(|r| r.seconds).fold(0.0, f64::max),
        ..TrainReport::merge_heads(&reports)
    })
}

/// Sets up the gradient all-reduce of heads with a policy replica each: asks each
/// replica for its ring inbox, then has every replica join the ring of all of them in
/// head order. The heads' train deadline bounds each ask and each wait inside the
/// all-reduce; `chunk_bytes` is the largest message of it.
pub async fn join_policy_ring(
    controllers: &mut [Controller],
    chunk_bytes: u64,
) -> Result<(), ControllerError> {
    const STAGE: &str = "join_policy_ring";
    let mut members = Vec::with_capacity(controllers.len());
    for c in controllers.iter() {
        match c
            .serve_policy(PolicyRequest::RingInbox, STAGE, c.config.timeouts.train)
            .await?
        {
            PolicyResponse::RingInbox(id) => members.push(id),
            other => return Err(c.protocol("policy", "RingInbox", format!("{other:?}"))),
        }
    }
    let joins = controllers.iter().enumerate().map(|(rank, c)| {
        let spec = RingSpec {
            rank: rank as u32,
            members: members.clone(),
            timeout: c.config.timeouts.train,
            chunk_bytes,
        };
        async move {
            match c
                .serve_policy(
                    PolicyRequest::JoinRing(spec),
                    STAGE,
                    c.config.timeouts.train,
                )
                .await?
            {
                PolicyResponse::Joined => Ok(()),
                other => Err(c.protocol("policy", "JoinRing", format!("{other:?}"))),
            }
        }
    });
    futures::future::try_join_all(joins).await?;
    for c in controllers.iter_mut() {
        c.in_policy_ring = true;
    }
    Ok(())
}

/// One data-parallel head: its shard and the roles it drives.
pub struct Controller {
    config: ControllerConfig,
    loader: Dataloader,
    roles: RoleRefs,
    step: u64,
    weights_version: u64,
    /// Its policy replica averages gradients in a ring with the other heads' replicas
    /// ([`join_policy_ring`]).
    in_policy_ring: bool,
    /// Rollout replicas a generation request goes to when its own replica is lost.
    spare_rollouts: Vec<RolloutRef>,
    /// Rollout replicas a call found lost (dead node, deadline): skipped by weight sync
    /// until the head is rebuilt.
    lost_rollouts: std::collections::BTreeSet<ActorId>,
    /// Generation calls in flight, for whoever watches ([`Controller::set_probe`]).
    probe: Option<GenProbe>,
}

/// The rollout replicas that generation calls are in flight to, shared by the heads
/// that report to it ([`Controller::set_probe`]): a step's progress seen from outside,
/// e.g. by a test that must act while a step generates on a given replica.
#[derive(Clone, Default, Debug)]
pub struct GenProbe(std::sync::Arc<std::sync::Mutex<BTreeMap<ActorId, usize>>>);

impl GenProbe {
    /// Whether a generation call to `replica` is in flight now.
    pub fn in_flight(&self, replica: &ActorId) -> bool {
        self.lock().get(replica).is_some_and(|n| *n > 0)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ActorId, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn enter(&self, replica: &ActorId) -> GenProbeGuard<'_> {
        *self.lock().entry(replica.clone()).or_insert(0) += 1;
        GenProbeGuard {
            probe: self,
            replica: replica.clone(),
        }
    }
}

/// Counts one call out of the probe when dropped (answered, failed or cancelled).
struct GenProbeGuard<'a> {
    probe: &'a GenProbe,
    replica: ActorId,
}

impl Drop for GenProbeGuard<'_> {
    fn drop(&mut self) {
        let mut m = self.probe.lock();
        if let Some(n) = m.get_mut(&self.replica) {
            *n = n.saturating_sub(1);
        }
    }
}

/// Whether a failed call means the replica is gone (its node died or left, its actor
/// stopped, or it missed its deadline) rather than that it refused the request: only
/// then is its work worth handing to another replica.
fn replica_lost(e: &CallError) -> bool {
    !matches!(e, CallError::Handler { .. })
}

/// One generation request's outcome: the rollout's answer, the samples requeued on
/// another replica on the way, and the replicas found lost.
struct GenOutcome {
    answer: RolloutResponse,
    requeued: Vec<SampleId>,
    lost: Vec<ActorId>,
}

/// One generation round: its samples, the rollouts' stats, its wall seconds, the
/// samples requeued on a spare replica and the replicas found lost.
#[derive(Default)]
struct Generated {
    samples: Vec<Sample>,
    stats: crate::builtin::RolloutStats,
    seconds: f64,
    requeued: Vec<SampleId>,
    lost: Vec<ActorId>,
}

/// Starts `role` on its own thread on `group` and spawns its actor on `node` as
/// `node/name/replica`, reachable from this process only (its messages are moved, never
/// encoded). Roles on other nodes are spawned through their factories
/// ([`crate::remote`]).
pub async fn spawn_role<R: Role>(
    node: &Node,
    role: R,
    replica: u32,
    group: DeviceGroup,
) -> Result<ActorRef<RoleRequest<R::Request>, RoleResponse<R::Response>>, ControllerError> {
    let name = role.name().to_string();
    let actor = RoleActor::start(role, group, 4)
        .await
        .map_err(|e: RoleError| ControllerError::Spawn {
            role: name.clone(),
            reason: e.to_string(),
        })?;
    node.spawn_local(&name, replica, actor)
        .map_err(|e| ControllerError::Spawn {
            role: name,
            reason: e.to_string(),
        })
}

pub(crate) fn variant<T>(r: &RoleResponse<T>) -> String {
    match r {
        RoleResponse::Served(_) => "a served answer".into(),
        RoleResponse::Done => "Done".into(),
        RoleResponse::Drained(_) => "Drained".into(),
        RoleResponse::Profile(_) => "Profile".into(),
    }
}

impl Controller {
    /// A controller over its shard `loader`, driving `roles`.
    pub fn new(
        config: ControllerConfig,
        loader: Dataloader,
        roles: RoleRefs,
    ) -> Result<Self, ControllerError> {
        if config.prompts_per_step == 0 || config.n == 0 {
            return Err(ControllerError::Config(
                "prompts_per_step and n must be >= 1".into(),
            ));
        }
        if config.prompts_per_step > loader.shard_len() {
            return Err(ControllerError::Config(format!(
                "prompts_per_step {} exceeds the shard's {} prompts: a step would take a prompt twice",
                config.prompts_per_step,
                loader.shard_len()
            )));
        }
        if config.kl_in_reward.is_some() && roles.reference.is_none() {
            return Err(ControllerError::Config(
                "kl_in_reward needs a reference role".into(),
            ));
        }
        if config.devices == 0 {
            return Err(ControllerError::Config("devices must be >= 1".into()));
        }
        if matches!(config.advantage, AdvantageEstimator::Gae(_)) && roles.critic.is_none() {
            return Err(ControllerError::Config(
                "GAE (PPO) needs a critic role; set algorithm.name to grpo, rloo or reinforce++, or add the critic".into(),
            ));
        }
        if let Some(d) = config.dynamic_sampling {
            if d.max_rounds == 0 {
                return Err(ControllerError::Config(
                    "dynamic_sampling.max_rounds must be >= 1".into(),
                ));
            }
        }
        Ok(Controller {
            config,
            loader,
            roles,
            step: 0,
            weights_version: 0,
            in_policy_ring: false,
            spare_rollouts: Vec::new(),
            lost_rollouts: Default::default(),
            probe: None,
        })
    }

    /// Rollout replicas (of other heads) that take over a generation request whose own
    /// replica is lost mid-step (its node died: the call fails when the directory
    /// declares the node dead, or at the deadline). The request's samples are requeued
    /// in the step's ledger ([`SampleLedger::requeue`]) and generated on the first
    /// spare that answers, so the step completes with every sample once. Without
    /// spares a lost replica fails the step, as before. Non-streamed generation only.
    pub fn set_spare_rollouts(&mut self, spares: Vec<RolloutRef>) {
        self.spare_rollouts = spares;
    }

    /// Reports every generation call this head makes to `probe` while it is in flight.
    pub fn set_probe(&mut self, probe: GenProbe) {
        self.probe = Some(probe);
    }

    /// The rollout replicas this head found lost (skipped by weight sync from then on).
    pub fn lost_rollouts(&self) -> &std::collections::BTreeSet<ActorId> {
        &self.lost_rollouts
    }

    /// The roles this controller drives.
    pub fn roles(&self) -> &RoleRefs {
        &self.roles
    }

    /// Steps completed.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The position to checkpoint (with the policy's checkpoint).
    pub fn state(&self) -> ControllerState {
        ControllerState {
            step: self.step,
            weights_version: self.weights_version,
            loader: self.loader.state(),
        }
    }

    /// Resumes from a checkpointed position (the policy and rollout must be restored to
    /// the same weights by whoever restores the controller).
    pub fn restore(&mut self, state: ControllerState) -> Result<(), ControllerError> {
        self.loader
            .restore(state.loader)
            .map_err(ControllerError::Restore)?;
        self.step = state.step;
        self.weights_version = state.weights_version;
        Ok(())
    }

    /// Weight sync: the policy exports its weights and this controller's rollout loads
    /// them in place. Returns the version the rollout now holds.
    pub async fn sync_weights(&mut self) -> Result<u64, ControllerError> {
        let t = self.config.timeouts.sync;
        // Within one process the rollouts take over a snapshot of the policy's tensors;
        // across processes the weights travel as byte buckets.
        let in_process = self.roles.policy.is_local()
            && self.roles.rollout.is_local()
            && self.roles.extra_rollouts.iter().all(|r| r.is_local());
        let export = if in_process {
            PolicyRequest::ExportLocalWeights
        } else {
            PolicyRequest::ExportWeights
        };
        let update = match self.serve_policy(export, "weight_sync", t).await? {
            PolicyResponse::Weights(u) => u,
            other => return Err(self.protocol("policy", "ExportWeights", format!("{other:?}"))),
        };
        let version = update.version;
        // A replica found lost this step is skipped (another head's spare generated its
        // samples); one lost only now is marked so, when a spare can take its work.
        let live: Vec<RolloutRef> = self
            .roles
            .extra_rollouts
            .iter()
            .chain(std::iter::once(&self.roles.rollout))
            .filter(|r| !self.lost_rollouts.contains(r.id()))
            .cloned()
            .collect();
        // Every replica but the last gets a copy; the last takes the buckets themselves.
        let mut update = Some(update);
        let mut loads = Vec::new();
        for (i, r) in live.iter().enumerate() {
            let u = match i + 1 == live.len() {
                true => update.take(),
                false => update.clone(),
            };
            if let Some(u) = u {
                loads.push(r.ask(RoleRequest::LoadWeights(u), t));
            }
        }
        for (answer, r) in futures::future::join_all(loads)
            .await
            .into_iter()
            .zip(&live)
        {
            match answer {
                Ok(RoleResponse::Done) => {}
                Ok(other) => return Err(self.protocol("rollout", "LoadWeights", variant(&other))),
                Err(e) if replica_lost(&e) && !self.spare_rollouts.is_empty() => {
                    tracing::warn!(step = self.step, replica = %r.id(), error = %e, "rollout lost at weight sync; its work goes to a spare replica");
                    self.lost_rollouts.insert(r.id().clone());
                }
                Err(e) => return Err(self.call("weight_sync", "rollout")(e)),
            }
        }
        self.weights_version = version;
        Ok(version)
    }

    /// Asks the critic (if any) to save a checkpoint to `dir`.
    pub async fn save_critic(&self, dir: std::path::PathBuf) -> Result<(), ControllerError> {
        let Some(c) = &self.roles.critic else {
            return Ok(());
        };
        match self
            .serve(
                c,
                CriticRequest::SaveCheckpoint(dir),
                "checkpoint",
                "critic",
                self.config.timeouts.sync,
            )
            .await?
        {
            CriticResponse::Saved => Ok(()),
            other => Err(self.protocol("critic", "SaveCheckpoint", format!("{other:?}"))),
        }
    }

    /// Asks the policy to save a checkpoint to `dir`.
    pub async fn save_policy(&self, dir: std::path::PathBuf) -> Result<(), ControllerError> {
        match self
            .serve_policy(
                PolicyRequest::SaveCheckpoint(dir),
                "checkpoint",
                self.config.timeouts.sync,
            )
            .await?
        {
            PolicyResponse::Saved => Ok(()),
            other => Err(self.protocol("policy", "SaveCheckpoint", format!("{other:?}"))),
        }
    }

    fn protocol(&self, role: &'static str, asked: &'static str, got: String) -> ControllerError {
        let got: String = got.chars().take(80).collect();
        ControllerError::Protocol {
            step: self.step,
            role,
            asked,
            got,
        }
    }

    fn call(
        &self,
        stage: &'static str,
        role: &'static str,
    ) -> impl FnOnce(CallError) -> ControllerError {
        let step = self.step;
        move |source| ControllerError::Call {
            step,
            stage,
            role,
            source,
        }
    }

    async fn serve<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: &ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
        req: Req,
        stage: &'static str,
        role: &'static str,
        timeout: Duration,
    ) -> Result<Resp, ControllerError> {
        match r
            .ask(RoleRequest::Serve(req), timeout)
            .await
            .map_err(self.call(stage, role))?
        {
            RoleResponse::Served(x) => Ok(x),
            other => Err(self.protocol(role, stage, variant(&other))),
        }
    }

    async fn serve_policy(
        &self,
        req: PolicyRequest,
        stage: &'static str,
        t: Duration,
    ) -> Result<PolicyResponse, ControllerError> {
        self.serve(&self.roles.policy, req, stage, "policy", t)
            .await
    }

    fn ledger_err(&self) -> impl Fn(LedgerError) -> ControllerError {
        let step = self.step;
        move |source| ControllerError::Ledger { step, source }
    }

    fn stage_done(
        &self,
        ledger: &mut SampleLedger,
        samples: &[Sample],
        stage: Stage,
    ) -> Result<(), ControllerError> {
        ledger.record_all(samples.iter().map(|s| &s.id), stage);
        ledger.verify_stage(stage).map_err(self.ledger_err())
    }

    /// Runs one step. On error the step's prompts are consumed; restore a
    /// [`ControllerState`] taken before the step to retry it.
    pub async fn step(&mut self) -> Result<StepReport, ControllerError> {
        let mut p = self.prepare().await?;
        let t = Instant::now();
        let policy = async {
            let r = self
                .serve_policy(
                    PolicyRequest::Train(p.samples.clone()),
                    "update_actor",
                    self.config.timeouts.train,
                )
                .await;
            (r, t.elapsed().as_secs_f64())
        };
        // The critic's update runs alongside the policy's (different roles, no shared
        // state), as in verl.
        let critic = async {
            let Some(c) = &self.roles.critic else {
                return Ok(None);
            };
            let t = Instant::now();
            let r = self
                .serve(
                    c,
                    CriticRequest::Train(p.samples.clone()),
                    "update_critic",
                    "critic",
                    self.config.timeouts.train,
                )
                .await?;
            match r {
                CriticResponse::Trained(r) => Ok(Some((r, t.elapsed().as_secs_f64()))),
                other => Err(self.protocol("critic", "Train", format!("{other:?}"))),
            }
        };
        let ((train, secs), critic) = tokio::join!(policy, critic);
        let train = match train? {
            PolicyResponse::Trained(r) => r,
            other => return Err(self.protocol("policy", "Train", format!("{other:?}"))),
        };
        let critic = match critic? {
            Some((r, secs)) => {
                p.metrics.set("timing_s/update_critic", secs);
                Some(r)
            }
            None => None,
        };
        self.finish(p, train, critic, secs).await
    }

    /// Stages up to the update: generation and reward (repeated by dynamic sampling),
    /// reference, critic values, old log-probs, advantages.
    async fn prepare(&mut self) -> Result<Prepared, ControllerError> {
        let t_step = Instant::now();
        let step = self.step;
        let cfg = self.config.clone();
        let mut m = StepMetrics {
            step,
            values: BTreeMap::new(),
        };
        let mut stages = vec![
            Stage::Generated,
            Stage::Rewarded,
            Stage::OldLogProbs,
            Stage::Advantaged,
            Stage::Trained,
        ];
        if self.roles.reference.is_some() {
            stages.push(Stage::Referenced);
        }
        if self.roles.critic.is_some() {
            stages.extend([Stage::Valued, Stage::CriticTrained]);
        }
        let mut ledger = SampleLedger::new(step, &stages);

        // 1–2. Generation and reward, in rounds when dynamic sampling drops groups.
        let target = cfg.prompts_per_step;
        let rounds = cfg.dynamic_sampling.map_or(1, |d| d.max_rounds);
        let mut kept: Vec<Sample> = Vec::new();
        let mut kept_groups = 0usize;
        let mut seen = std::collections::BTreeSet::new();
        let (mut gen_s, mut reward_s) = (0.0, 0.0);
        let mut gen = crate::builtin::RolloutStats::default();
        let (mut groups_seen, mut groups_dropped, mut round) = (0usize, 0usize, 0usize);
        let mut streamed_early = 0usize;
        let mut want = target;
        while round < rounds {
            round += 1;
            // A step never takes a prompt twice: its sample ids would collide.
            let prompts: Vec<_> = self
                .loader
                .next_batch(want.min(self.loader.shard_len()))
                .into_iter()
                .filter(|p| seen.insert(p.id))
                .collect();
            if prompts.is_empty() {
                break;
            }
            let ids = prompts.iter().flat_map(|p| {
                (0..cfg.n).map(move |k| SampleId {
                    step,
                    prompt: p.id,
                    k,
                })
            });
            ledger.expect(ids).map_err(self.ledger_err())?;
            let mut samples = if cfg.stream {
                let r = self.generate_streamed(prompts, &cfg, &mut ledger).await?;
                gen_s += r.gen_s;
                reward_s += r.reward_tail_s;
                gen.response_tokens += r.stats.response_tokens;
                gen.seconds += r.stats.seconds;
                streamed_early += r.early;
                ledger
                    .verify_stage(Stage::Generated)
                    .map_err(self.ledger_err())?;
                r.samples
            } else {
                let g = self.generate(prompts, &cfg).await?;
                // Samples a lost replica had in flight were generated again elsewhere.
                for id in &g.requeued {
                    ledger.requeue(*id).map_err(self.ledger_err())?;
                }
                self.lost_rollouts.extend(g.lost);
                let samples = g.samples;
                gen_s += g.seconds;
                gen.response_tokens += g.stats.response_tokens;
                gen.seconds += g.stats.seconds;
                self.stage_done(&mut ledger, &samples, Stage::Generated)?;
                self.check_fresh(&samples)?;
                let t = Instant::now();
                let samples = self
                    .serve(
                        &self.roles.reward,
                        samples,
                        "reward",
                        "reward",
                        cfg.timeouts.score,
                    )
                    .await?;
                reward_s += t.elapsed().as_secs_f64();
                samples
            };
            self.stage_done(&mut ledger, &samples, Stage::Rewarded)?;
            if let Some(o) = cfg.overlong {
                self.apply_overlong(&mut samples, o)?;
            }
            let Some(ds) = cfg.dynamic_sampling else {
                kept = samples;
                break;
            };
            let rewards: Vec<f64> = samples
                .iter()
                .map(|s| s.require_reward())
                .collect::<Result<_, _>>()
                .map_err(|source| ControllerError::Sample { step, source })?;
            let groups = group_indices(&samples);
            let f = dynamic_sampling_filter(&rewards, &groups, target - kept_groups, ds.tolerance)
                .map_err(|source| ControllerError::Algo { step, source })?;
            groups_seen += f.keep_groups.len() + f.dropped_groups.len();
            // Keep at most the groups still needed; the surplus is dropped like the
            // groups without signal (DAPO trims to the batch size).
            let keep: Vec<usize> = f
                .keep_groups
                .iter()
                .copied()
                .take(target - kept_groups)
                .collect();
            kept_groups += keep.len();
            let mut dropped = Vec::new();
            for (s, g) in samples.into_iter().zip(&groups) {
                if keep.contains(g) {
                    kept.push(s);
                } else {
                    dropped.push(s);
                }
            }
            groups_dropped += f.dropped_groups.len() + f.keep_groups.len() - keep.len();
            for s in &dropped {
                ledger
                    .drop_after(s.id, Stage::Rewarded)
                    .map_err(self.ledger_err())?;
            }
            if kept_groups >= target {
                break;
            }
            want = f
                .suggested_prompts
                .unwrap_or(2 * (target - kept_groups))
                .max(target - kept_groups);
        }
        if kept.is_empty() {
            // Like verl's DAPO: a step with no signal at all is an error, not a silent
            // no-op update.
            return Err(ControllerError::NoSignal {
                step,
                rounds: round,
                groups: groups_dropped,
            });
        }
        m.set("timing_s/gen", gen_s);
        m.set("timing_s/reward", reward_s);
        if cfg.stream {
            m.set("stream/rewarded_during_gen", streamed_early as f64);
        }
        if cfg.dynamic_sampling.is_some() {
            m.set("dapo/gen_rounds", round as f64);
            m.set("dapo/groups_dropped", groups_dropped as f64);
            m.set(
                "dapo/keep_rate",
                kept_groups as f64 / groups_seen.max(1) as f64,
            );
        }
        let samples = kept;

        // 3. Reference.
        let samples = match &self.roles.reference {
            Some(r) => {
                let t = Instant::now();
                let s = self
                    .serve(r, samples, "ref", "reference", cfg.timeouts.score)
                    .await?;
                m.set("timing_s/ref", t.elapsed().as_secs_f64());
                self.stage_done(&mut ledger, &s, Stage::Referenced)?;
                s
            }
            None => samples,
        };

        // 4. Critic values.
        let samples = match &self.roles.critic {
            Some(c) => {
                let t = Instant::now();
                let s = match self
                    .serve(
                        c,
                        CriticRequest::Values(samples),
                        "values",
                        "critic",
                        cfg.timeouts.score,
                    )
                    .await?
                {
                    CriticResponse::Valued(s) => s,
                    other => return Err(self.protocol("critic", "Values", format!("{other:?}"))),
                };
                m.set("timing_s/values", t.elapsed().as_secs_f64());
                self.stage_done(&mut ledger, &s, Stage::Valued)?;
                s
            }
            None => samples,
        };

        // 5. Old log-probs.
        let t = Instant::now();
        let mut samples = match self
            .serve_policy(
                PolicyRequest::OldLogProbs(samples),
                "old_log_prob",
                cfg.timeouts.score,
            )
            .await?
        {
            PolicyResponse::Scored(s) => s,
            other => return Err(self.protocol("policy", "OldLogProbs", format!("{other:?}"))),
        };
        m.set("timing_s/old_log_prob", t.elapsed().as_secs_f64());
        self.stage_done(&mut ledger, &samples, Stage::OldLogProbs)?;

        // 6. Advantages.
        let t = Instant::now();
        self.advantages(&mut samples, &mut m)?;
        m.set("timing_s/adv", t.elapsed().as_secs_f64());
        self.stage_done(&mut ledger, &samples, Stage::Advantaged)?;

        Ok(Prepared {
            t_step,
            metrics: m,
            ledger,
            samples,
            gen,
        })
    }

    /// A round's generation requests: contiguous, near-equal slices of the prompts, one
    /// per rollout replica.
    fn split_over_replicas(
        &self,
        prompts: Vec<crate::data::Prompt>,
        cfg: &ControllerConfig,
    ) -> Vec<(&RolloutRef, GenerateRequest)> {
        let replicas: Vec<&RolloutRef> = std::iter::once(&self.roles.rollout)
            .chain(&self.roles.extra_rollouts)
            .collect();
        let per = prompts.len().div_ceil(replicas.len()).max(1);
        let mut rest = prompts;
        let mut out = Vec::with_capacity(replicas.len());
        for r in replicas {
            if rest.is_empty() {
                break;
            }
            let tail = rest.split_off(per.min(rest.len()));
            let req = GenerateRequest {
                step: self.step,
                prompts: std::mem::replace(&mut rest, tail),
                n: cfg.n,
                params: cfg.sampling.clone(),
                seed: cfg.seed,
            };
            out.push((r, req));
        }
        out
    }

    /// One generation round: `n` samples of each prompt from the rollout. A request
    /// whose replica is lost goes to a spare ([`Controller::set_spare_rollouts`]); the
    /// samples it had in flight are returned as requeued, with the lost replicas.
    async fn generate(
        &self,
        prompts: Vec<crate::data::Prompt>,
        cfg: &ControllerConfig,
    ) -> Result<Generated, ControllerError> {
        let t = Instant::now();
        let asks: Vec<_> = self
            .split_over_replicas(prompts, cfg)
            .into_iter()
            .map(|(r, req)| self.generate_on(r, req, cfg.timeouts.generate))
            .collect();
        let mut out = Generated::default();
        for g in futures::future::try_join_all(asks).await? {
            out.requeued.extend(g.requeued);
            out.lost.extend(g.lost);
            match g.answer {
                RolloutResponse::Generated {
                    samples: s,
                    stats: st,
                } => {
                    out.samples.extend(s);
                    out.stats.response_tokens += st.response_tokens;
                    // Replicas run side by side: the round takes the slowest one's time.
                    out.stats.seconds = out.stats.seconds.max(st.seconds);
                }
                RolloutResponse::Logits(_) | RolloutResponse::Streamed { .. } => {
                    return Err(self.protocol("rollout", "Generate", "not Generated".into()))
                }
            }
        }
        out.seconds = t.elapsed().as_secs_f64();
        Ok(out)
    }

    /// One generation request to `first`, then, while the replica asked is lost, to
    /// each spare in turn (each spare tried once).
    async fn generate_on(
        &self,
        first: &RolloutRef,
        req: GenerateRequest,
        timeout: Duration,
    ) -> Result<GenOutcome, ControllerError> {
        let mut spares = self
            .spare_rollouts
            .iter()
            .filter(|s| s.id() != first.id() && !self.lost_rollouts.contains(s.id()));
        // A replica found lost in an earlier step missed its weight sync: its work
        // goes straight to a spare (nothing of it was in flight, nothing is requeued).
        let mut asked = match self.lost_rollouts.contains(first.id()) {
            true => spares.next().unwrap_or(first).clone(),
            false => first.clone(),
        };
        let (mut requeued, mut lost) = (Vec::new(), Vec::new());
        loop {
            let answer = {
                let _probe = self.probe.as_ref().map(|p| p.enter(asked.id()));
                asked
                    .ask(
                        RoleRequest::Serve(RolloutRequest::Generate(req.clone())),
                        timeout,
                    )
                    .await
            };
            match answer {
                Ok(RoleResponse::Served(answer)) => {
                    return Ok(GenOutcome {
                        answer,
                        requeued,
                        lost,
                    })
                }
                Ok(other) => return Err(self.protocol("rollout", "gen", variant(&other))),
                Err(e) if replica_lost(&e) => {
                    let Some(next) = spares.next() else {
                        return Err(self.call("gen", "rollout")(e));
                    };
                    tracing::warn!(step = self.step, lost = %asked.id(), to = %next.id(), error = %e,
                        "rollout replica lost mid-step; its samples are requeued on a spare");
                    lost.push(asked.id().clone());
                    requeued.extend(req.prompts.iter().flat_map(|p| {
                        (0..req.n).map(move |k| SampleId {
                            step: req.step,
                            prompt: p.id,
                            k,
                        })
                    }));
                    asked = next.clone();
                }
                Err(e) => return Err(self.call("gen", "rollout")(e)),
            }
        }
    }

    /// Fails with [`ControllerError::StaleWeights`] when a sample was generated with
    /// weights other than the policy's latest.
    fn check_fresh(&self, samples: &[Sample]) -> Result<(), ControllerError> {
        match samples
            .iter()
            .find(|s| s.weights_version != self.weights_version)
        {
            Some(s) => Err(ControllerError::StaleWeights {
                step: self.step,
                id: s.id,
                got: s.weights_version,
                want: self.weights_version,
            }),
            None => Ok(()),
        }
    }

    /// One generation round, streamed: every rollout sends each sample as it finishes
    /// through a bounded channel (backpressure), and samples go on to the reward role
    /// in small batches while generation continues. Each sample is recorded in the
    /// ledger as generated when it arrives; the rewarded samples come back in
    /// `(prompt, k)` order, as [`Self::generate`] gives them, so the rest of the step
    /// does not depend on finishing order.
    async fn generate_streamed(
        &self,
        prompts: Vec<crate::data::Prompt>,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
    ) -> Result<Streamed, ControllerError> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let t = Instant::now();
        let order: std::collections::HashMap<SampleId, usize> = prompts
            .iter()
            .flat_map(|p| {
                (0..cfg.n).map(move |k| SampleId {
                    step: self.step,
                    prompt: p.id,
                    k,
                })
            })
            .enumerate()
            .map(|(i, id)| (id, i))
            .collect();
        let group = cfg.n as usize;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Sample>(group.max(1));
        let asks: Vec<_> = self
            .split_over_replicas(prompts, cfg)
            .into_iter()
            .map(|(r, req)| {
                let req = RolloutRequest::GenerateStream(req, SampleSink(tx.clone()));
                self.serve(r, req, "gen", "rollout", cfg.timeouts.generate)
            })
            .collect();
        // The channel closes when every rollout has dropped its sender.
        drop(tx);
        let gen = futures::future::try_join_all(asks);
        tokio::pin!(gen);
        let mut rewards = FuturesUnordered::new();
        let mut out = Streamed {
            samples: Vec::with_capacity(order.len()),
            stats: crate::builtin::RolloutStats::default(),
            gen_s: 0.0,
            reward_tail_s: 0.0,
            early: 0,
        };
        let (mut gen_done, mut open) = (false, true);
        let mut gen_end = Instant::now();
        while !gen_done || open || !rewards.is_empty() {
            tokio::select! {
                answers = &mut gen, if !gen_done => {
                    for a in answers? {
                        match a {
                            RolloutResponse::Streamed { stats, .. } => {
                                out.stats.response_tokens += stats.response_tokens;
                                out.stats.seconds = out.stats.seconds.max(stats.seconds);
                            }
                            other => {
                                let got = match other {
                                    RolloutResponse::Generated { .. } => "Generated",
                                    _ => "Logits",
                                };
                                return Err(self.protocol("rollout", "GenerateStream", got.into()));
                            }
                        }
                    }
                    gen_done = true;
                    gen_end = Instant::now();
                }
                s = rx.recv(), if open => match s {
                    Some(s) => {
                        // What else has arrived goes along, up to a prompt group.
                        let mut batch = vec![s];
                        while batch.len() < group {
                            match rx.try_recv() {
                                Ok(s) => batch.push(s),
                                Err(_) => break,
                            }
                        }
                        // An id the round did not expect fails the stage's check.
                        for s in &batch {
                            ledger.record(s.id, Stage::Generated);
                        }
                        self.check_fresh(&batch)?;
                        if !gen_done {
                            out.early += batch.len();
                        }
                        rewards.push(self.serve(
                            &self.roles.reward,
                            batch,
                            "reward",
                            "reward",
                            cfg.timeouts.score,
                        ));
                    }
                    None => open = false,
                },
                r = rewards.next(), if !rewards.is_empty() => {
                    if let Some(r) = r {
                        out.samples.extend(r?);
                    }
                }
            }
        }
        out.gen_s = gen_end.duration_since(t).as_secs_f64();
        out.reward_tail_s = gen_end.elapsed().as_secs_f64();
        out.samples
            .sort_by_key(|s| order.get(&s.id).copied().unwrap_or(usize::MAX));
        Ok(out)
    }

    /// Adds DAPO's overlong penalty to each sample's reward.
    fn apply_overlong(
        &self,
        samples: &mut [Sample],
        o: OverlongConfig,
    ) -> Result<(), ControllerError> {
        let step = self.step;
        for s in samples {
            let r = s
                .require_reward()
                .map_err(|source| ControllerError::Sample { step, source })?;
            let p = overlong_penalty(s.response_len(), o.max_len, o.buffer)
                .map_err(|source| ControllerError::Algo { step, source })?;
            s.reward = Some(r + o.coef * p);
        }
        Ok(())
    }

    /// The update's accounting, weight sync, the ledger's close and the metrics.
    async fn finish(
        &mut self,
        p: Prepared,
        train: TrainReport,
        critic: Option<CriticReport>,
        update_s: f64,
    ) -> Result<StepReport, ControllerError> {
        let Prepared {
            t_step,
            metrics: mut m,
            mut ledger,
            samples: kept,
            gen,
        } = p;
        let cfg = self.config.clone();
        m.set("timing_s/update_actor", update_s);
        ledger.record_all(&train.trained, Stage::Trained);
        ledger
            .verify_stage(Stage::Trained)
            .map_err(self.ledger_err())?;
        if let Some(c) = &critic {
            ledger.record_all(&c.trained, Stage::CriticTrained);
            ledger
                .verify_stage(Stage::CriticTrained)
                .map_err(self.ledger_err())?;
            m.set("critic/vf_loss", c.vf_loss);
            m.set("critic/vf_clipfrac", c.vf_clipfrac);
            m.set("critic/vpred_mean", c.vpred_mean);
            m.set("critic/grad_norm", c.grad_norm);
        }

        // 7. Weight sync.
        let t = Instant::now();
        let version = self.sync_weights().await?;
        m.set("timing_s/weight_sync", t.elapsed().as_secs_f64());

        let ledger = ledger.close().map_err(self.ledger_err())?;
        let wall = t_step.elapsed().as_secs_f64();
        m.set("timing_s/step", wall);
        let b = kept.len().max(1) as f64;
        let resp: usize = kept.iter().map(Sample::response_len).sum();
        let prompt: usize = kept.iter().map(|s| s.prompt_tokens.len()).sum();
        m.set("response_length/mean", resp as f64 / b);
        m.set("prompt_length/mean", prompt as f64 / b);
        m.set("perf/total_num_tokens", (resp + prompt) as f64);
        m.set(
            "perf/throughput",
            (resp + prompt) as f64 / wall.max(1e-9) / cfg.devices as f64,
        );
        m.set(
            "perf/gen_tokens_per_s",
            gen.response_tokens as f64 / gen.seconds.max(1e-9),
        );
        m.set("actor/entropy", train.entropy);
        m.set("actor/pg_clipfrac", train.pg_clipfrac);
        m.set("actor/grad_norm", train.grad_norm);
        m.set("actor/pg_loss", train.loss);
        m.set("actor/ppo_kl", train.approx_kl);
        m.set("actor/lr", train.lr);
        if self.config.kl_in_reward.is_none() && train.kl_loss != 0.0 {
            m.set("actor/kl_loss", train.kl_loss);
        }
        m.set("training/weights_version", version as f64);
        self.step += 1;
        m.set("training/dropped_samples", ledger.dropped as f64);
        Ok(StepReport {
            metrics: m,
            ledger,
            samples: kept,
            train,
            critic,
        })
    }

    /// Fills in `advantages` (and the reward/KL metrics).
    fn advantages(
        &self,
        samples: &mut [Sample],
        m: &mut StepMetrics,
    ) -> Result<(), ControllerError> {
        let step = self.step;
        let se = |source| ControllerError::Sample { step, source };
        let ae = |source| ControllerError::Algo { step, source };
        let dev = Device::Cpu;
        let mask = response_mask(samples, dev).map_err(se)?;
        let scores: Vec<f32> = samples
            .iter()
            .map(|s| s.require_reward().map(|r| r as f32))
            .collect::<Result<_, _>>()
            .map_err(se)?;
        let scores = Tensor::from_slice(&scores);
        let groups = group_indices(samples);
        // Per-token KL(old ‖ ref), when a reference is there.
        let kl = if self.roles.reference.is_some() {
            let old = token_matrix(samples, TokenField::OldLogprobs, dev).map_err(se)?;
            let rf = token_matrix(samples, TokenField::RefLogprobs, dev).map_err(se)?;
            let metric = kl_estimate(&old, &rf, &mask, self.config.kl_metric).map_err(ae)?;
            m.set("actor/kl", masked_mean(&metric, &mask).double_value(&[]));
            match self.config.kl_in_reward {
                Some(p) => Some((
                    kl_estimate(&old, &rf, &mask, p.estimator).map_err(ae)?,
                    p.coef,
                )),
                None => None,
            }
        } else {
            None
        };
        // Sequence rewards after the KL penalty (the outcome estimators' input).
        let rewards = match &kl {
            Some((k, coef)) => &scores - k.sum_dim_intlist(1, false, Kind::Float) * *coef,
            None => scores.shallow_clone(),
        };
        let adv = match self.config.advantage {
            AdvantageEstimator::Grpo(c) => grpo_advantage(&rewards, &mask, &groups, &c),
            AdvantageEstimator::Rloo => rloo_advantage(&rewards, &mask, &groups),
            AdvantageEstimator::ReinforcePp(c) => {
                let tr = token_level_rewards(
                    &scores,
                    &mask,
                    kl.as_ref().map(|(k, _)| k),
                    kl.as_ref().map_or(0.0, |(_, c)| *c),
                )
                .map_err(ae)?;
                reinforce_pp_advantage(&tr, &mask, &c)
            }
            AdvantageEstimator::Gae(c) => {
                let tr = token_level_rewards(
                    &scores,
                    &mask,
                    kl.as_ref().map(|(k, _)| k),
                    kl.as_ref().map_or(0.0, |(_, c)| *c),
                )
                .map_err(ae)?;
                let values = token_matrix(samples, TokenField::Values, dev).map_err(se)?;
                gae_advantage(&tr, &values, &mask, &c)
            }
        }
        .map_err(ae)?;
        let rows = split_rows(&adv.advantages, samples);
        let gae = matches!(self.config.advantage, AdvantageEstimator::Gae(_));
        let returns = split_rows(&adv.returns, samples);
        for ((s, a), r) in samples.iter_mut().zip(rows).zip(returns) {
            s.advantages = Some(a);
            if gae {
                s.returns = Some(r);
            }
        }
        if gae {
            m.set(
                "critic/returns/mean",
                masked_mean(&adv.returns, &mask).double_value(&[]),
            );
            let v = token_matrix(samples, TokenField::Values, dev).map_err(se)?;
            m.set(
                "critic/values/mean",
                masked_mean(&v, &mask).double_value(&[]),
            );
        }
        // Process rewards (an LLM judge's per-step scores): kept on the samples for a
        // step-level estimator; their mean shows whether the judge gives any.
        let steps: Vec<f32> = samples
            .iter()
            .filter_map(|s| s.step_rewards.as_deref())
            .flatten()
            .copied()
            .collect();
        if !steps.is_empty() {
            m.set(
                "reward/step_scores/mean",
                steps.iter().map(|&x| x as f64).sum::<f64>() / steps.len() as f64,
            );
        }
        let n = samples.len().max(1) as f64;
        m.set(
            "critic/score/mean",
            scores.sum(Kind::Float).double_value(&[]) / n,
        );
        m.set(
            "critic/rewards/mean",
            rewards.sum(Kind::Float).double_value(&[]) / n,
        );
        m.set(
            "critic/advantages/mean",
            masked_mean(&adv.advantages, &mask).double_value(&[]),
        );
        Ok(())
    }
}
