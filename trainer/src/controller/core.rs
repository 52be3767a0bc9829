//! The controller of one data-parallel head: its state, role calls and the step.

use std::time::{Duration, Instant};
use yatt_roles::{
    CriticReport, CriticRequest, CriticResponse, Dataloader, PolicyRequest, PolicyResponse,
    RoleRequest, RoleResponse, Sample, TrainReport,
};
use yatt_runtime::ActorId;
use yatt_runtime::{ActorRef, CallError};

use crate::controller::config::ControllerConfig;
use crate::controller::error::ControllerError;
use crate::controller::probe::GenProbe;
use crate::controller::refs::{variant, PolicyRef, RoleRefs, RolloutRef};
use crate::controller::report::{ControllerState, StepMetrics, StepReport};
use crate::controller::residency::Residency;
use crate::ledger::{LedgerError, SampleLedger, Stage};
use yatt_metrics::names;
use yatt_roles::AdvantageEstimator;

/// What a controller has learnt about CUDA IPC weight sync so far (`weights_ipc.rs`).
#[derive(Debug, Default)]
pub(crate) struct IpcRoute {
    /// The policy said it cannot export through IPC: buckets from now on.
    pub(crate) off: bool,
    /// Rollouts that could not map the policy's buffer: buckets for them.
    pub(crate) refused: std::collections::BTreeSet<ActorId>,
    /// A forced `cuda_ipc` or `nccl` was tried before the first generation.
    pub(crate) checked: bool,
}

/// What a controller has learnt about NCCL weight sync so far (`weights_nccl.rs`).
#[derive(Debug, Default)]
pub(crate) struct NcclRoute {
    /// NCCL cannot be used (unavailable, or a broadcast failed): buckets from now on.
    pub(crate) off: bool,
    /// The group that last broadcast: its id and its receivers in rank order (none
    /// once it failed). Other receivers need a new group.
    pub(crate) group: Option<(yatt_roles::UniqueId, Vec<ActorId>)>,
    /// Rollouts that said they can receive by broadcast, and those that cannot (they
    /// get buckets); each is asked once, before its first broadcast.
    pub(crate) ready: std::collections::HashSet<ActorId>,
    pub(crate) unable: std::collections::HashSet<ActorId>,
}

/// How many rollouts one weight sync reached by each route, and the bytes it exported.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SyncRoutes {
    /// Bytes the policy exported.
    pub(crate) bytes: u64,
    /// Rollouts that took the weights through CUDA IPC.
    pub(crate) via_ipc: usize,
    /// Rollouts that took them by NCCL broadcast.
    pub(crate) via_nccl: usize,
    /// Rollouts the policy's process sent byte buckets to itself (one hop).
    pub(crate) via_direct: usize,
}

/// One data-parallel head: its shard and the roles it drives.
pub struct Controller {
    pub(crate) config: ControllerConfig,
    /// Behind a lock so that generation (which draws prompts) can run alongside the
    /// update with a shared borrow ([`Controller::step`] with staleness ≥ 1).
    pub(crate) loader: std::sync::Mutex<Dataloader>,
    pub(crate) roles: RoleRefs,
    pub(crate) step: u64,
    pub(crate) weights_version: u64,
    /// The bytes the last weight sync exported and the routes it took.
    pub(crate) last_sync: SyncRoutes,
    /// What weight sync has learnt about CUDA IPC (`rollout.weight_sync`).
    pub(crate) ipc: std::sync::Mutex<IpcRoute>,
    /// What weight sync has learnt about NCCL.
    pub(crate) nccl: std::sync::Mutex<NcclRoute>,
    /// The policy cannot send its weights to the rollouts itself: this controller
    /// sends them (`weights_direct.rs`).
    pub(crate) direct_push_off: std::sync::atomic::AtomicBool,
    /// Its policy replica averages gradients in a ring with the other heads' replicas
    /// ([`join_policy_ring`]).
    pub(crate) in_policy_ring: bool,
    /// The heads share one sharded policy: it takes every head's samples in one
    /// optimizer step (it computes no gradients for the heads to average).
    pub(crate) policy_sharded: bool,
    /// The other heads' policy replicas (in the ring, bit-identical to this head's):
    /// a weight sync whose own replica died after the update exports from one of them.
    pub(crate) peer_policies: Vec<PolicyRef>,
    /// Set by a recovery when a surviving replica had already taken the lost step's
    /// update (to this version) before its peer died: the step runs again for its
    /// ledger and metrics, but its update is not taken twice.
    pub(crate) update_committed: Option<u64>,
    /// Rollout replicas a generation request goes to when its own replica is lost.
    pub(crate) spare_rollouts: Vec<RolloutRef>,
    /// Rollout replicas a call found lost (dead node, deadline): skipped by weight sync
    /// until the head is rebuilt.
    pub(crate) lost_rollouts: std::collections::BTreeSet<ActorId>,
    /// Generation calls in flight, for whoever watches ([`Controller::set_probe`]).
    pub(crate) probe: Option<GenProbe>,
    /// Batches generated ahead of the steps that train them (staleness ≥ 1), oldest
    /// first.
    pub(crate) pending: std::collections::VecDeque<GenBatch>,
    /// Whether the train/rollout log-prob mismatch warning was given.
    pub(crate) warned_mismatch: std::sync::atomic::AtomicBool,
    /// A user's stages added to the step ([`Controller::with_extra_stages`]).
    pub(crate) extra: Vec<crate::controller::extra_stages::ExtraStage>,
    /// Device bytes its roles hold, for time sharing's budget check.
    pub(crate) residency: Residency,
    /// A built-in critic on a cluster: what replaces it when its node is lost.
    pub(crate) critic_recovery: Option<crate::controller::critic_log::CriticRecovery>,
    /// The policy's updates since its last checkpoint, when a lost policy is rebuilt
    /// from them (one policy, one head: `build/policy_rebuild.rs`).
    pub(crate) policy_recovery: Option<crate::controller::update_log::LoggedUpdates>,
}

/// A batch generated and rewarded, waiting for the step that trains it.
pub(crate) struct GenBatch {
    /// The step that trains it (its samples' ids carry it).
    pub(crate) step: u64,
    /// Updates the policy had taken when it was generated (the step generating it):
    /// the weights every one of its samples started with.
    pub(crate) generated_at: u64,
    pub(crate) ledger: SampleLedger,
    pub(crate) samples: Vec<Sample>,
    pub(crate) gen: yatt_roles::RolloutStats,
    /// Its generation's metrics (timings, dynamic sampling).
    pub(crate) metrics: StepMetrics,
    /// Rollout replicas found lost while generating it.
    pub(crate) lost: Vec<ActorId>,
}

/// A step between its advantages and its update.
pub(crate) struct Prepared {
    pub(crate) t_step: Instant,
    pub(crate) metrics: StepMetrics,
    pub(crate) ledger: SampleLedger,
    pub(crate) samples: Vec<Sample>,
    pub(crate) gen: yatt_roles::RolloutStats,
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
        if config.time_share.is_some() && config.staleness > 0 {
            return Err(ControllerError::Config(
                "time sharing (placement.time_share = \"offload\") needs rollout.staleness = 0: with staleness >= 1 generation overlaps the update and both need the device at once".into(),
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
            loader: std::sync::Mutex::new(loader),
            roles,
            step: 0,
            weights_version: 0,
            last_sync: SyncRoutes::default(),
            ipc: Default::default(),
            nccl: Default::default(),
            direct_push_off: Default::default(),
            in_policy_ring: false,
            policy_sharded: false,
            peer_policies: Vec::new(),
            update_committed: None,
            spare_rollouts: Vec::new(),
            lost_rollouts: Default::default(),
            probe: None,
            pending: Default::default(),
            extra: Vec::new(),
            warned_mismatch: Default::default(),
            residency: Residency::default(),
            critic_recovery: None,
            policy_recovery: None,
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

    /// Marks this head's policy as one sharded replica that every head shares: a
    /// data-parallel update sends it every head's samples at once.
    pub(crate) fn set_policy_sharded(&mut self, sharded: bool) {
        self.policy_sharded = sharded;
    }

    /// Reports every generation call this head makes to `probe` while it is in flight.
    pub fn set_probe(&mut self, probe: GenProbe) {
        self.probe = Some(probe);
    }

    /// The rollout replicas this head found lost (skipped by weight sync from then on).
    pub fn lost_rollouts(&self) -> &std::collections::BTreeSet<ActorId> {
        &self.lost_rollouts
    }

    /// Adds a user's stages to every step, in order within each place.
    pub fn with_extra_stages(
        mut self,
        stages: impl IntoIterator<Item = crate::controller::extra_stages::ExtraStage>,
    ) -> Self {
        self.extra.extend(stages);
        self
    }

    /// The roles this controller drives.
    pub fn roles(&self) -> &RoleRefs {
        &self.roles
    }

    /// Steps completed.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The 1-based number of the step in progress: what the progress line shows for it
    /// and what its errors name (`step_count` is the steps completed before it).
    pub(crate) fn step_no(&self) -> u64 {
        self.step + 1
    }

    /// The position to checkpoint (with the policy's checkpoint).
    pub fn state(&self) -> ControllerState {
        ControllerState {
            step: self.step,
            weights_version: self.weights_version,
            loader: self.lock_loader().state(),
            pending: self.pending.iter().map(GenBatch::to_pending).collect(),
        }
    }

    pub(crate) fn lock_loader(&self) -> std::sync::MutexGuard<'_, Dataloader> {
        // A panic elsewhere cannot leave the loader half-updated: its methods do not
        // panic midway, so a poisoned lock still guards a consistent loader.
        self.loader.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Resumes from a checkpointed position (the policy and rollout must be restored to
    /// the same weights by whoever restores the controller).
    pub fn restore(&mut self, state: ControllerState) -> Result<(), ControllerError> {
        self.lock_loader()
            .restore(state.loader)
            .map_err(ControllerError::Restore)?;
        self.step = state.step;
        self.weights_version = state.weights_version;
        self.adopt_replaced_critic();
        if let Some(r) = &self.critic_recovery {
            r.lock_log().rewind(state.step);
        }
        if let Some(r) = &self.policy_recovery {
            r.lock().rewind(state.step);
        }
        self.pending = state
            .pending
            .into_iter()
            .map(|p| self.from_pending(p))
            .collect::<Result<_, _>>()?;
        Ok(())
    }

    /// Its role actors and their roles.
    pub(crate) fn role_ids(&self) -> Vec<(ActorId, &'static str)> {
        let mut ids = Vec::new();
        let r = &self.roles;
        ids.push((r.rollout.id().clone(), "rollout"));
        for x in &r.extra_rollouts {
            ids.push((x.id().clone(), "rollout"));
        }
        ids.push((r.reward.id().clone(), "reward"));
        if let Some(x) = &r.reference {
            ids.push((x.id().clone(), "reference"));
        }
        ids.push((r.policy.id().clone(), "policy"));
        for s in &self.extra {
            ids.push((s.role.id().clone(), s.name));
        }
        if let Some(x) = &r.critic {
            ids.push((x.id().clone(), "critic"));
        }
        ids
    }

    pub(crate) fn protocol(
        &self,
        role: &'static str,
        asked: &'static str,
        got: String,
    ) -> ControllerError {
        let got: String = got.chars().take(80).collect();
        ControllerError::Protocol {
            step: self.step_no(),
            role,
            asked,
            got,
        }
    }

    pub(crate) fn call(
        &self,
        stage: &'static str,
        role: &'static str,
    ) -> impl FnOnce(CallError) -> ControllerError {
        let step = self.step_no();
        move |source| ControllerError::Call {
            step,
            stage,
            role,
            source,
        }
    }

    pub(crate) async fn serve<Req: Send + 'static, Resp: Send + 'static>(
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

    pub(crate) async fn serve_policy(
        &self,
        req: PolicyRequest,
        stage: &'static str,
        t: Duration,
    ) -> Result<PolicyResponse, ControllerError> {
        self.serve(&self.roles.policy, req, stage, "policy", t)
            .await
    }

    pub(crate) fn ledger_err(&self) -> impl Fn(LedgerError) -> ControllerError {
        let step = self.step_no();
        move |source| ControllerError::Ledger { step, source }
    }

    pub(crate) fn stage_done(
        &self,
        ledger: &mut SampleLedger,
        samples: &[Sample],
        stage: Stage,
    ) -> Result<(), ControllerError> {
        ledger.record_all(samples.iter().map(|s| &s.id), stage);
        ledger.verify_stage(stage).map_err(self.ledger_err())
    }

    /// Runs one step. On error the step's prompts are consumed; restore a
    /// [`ControllerState`] taken before the step to retry it. With
    /// `staleness` ≥ 1 the next batches generate while this one trains
    /// (`Controller::step_pipelined`).
    pub async fn step(&mut self) -> Result<StepReport, ControllerError> {
        if self.config.staleness > 0 {
            return self.step_pipelined().await;
        }
        let mut p = self.prepare().await?;
        let (train, critic, secs) = self.update(&mut p).await?;
        self.finish(p, train, critic, secs, None).await
    }

    /// The policy's update on a prepared batch, and the critic's beside it: their
    /// reports and the policy update's seconds.
    pub(crate) async fn update(
        &self,
        p: &mut Prepared,
    ) -> Result<(TrainReport, Option<CriticReport>, f64), ControllerError> {
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
            let Some(c) = self.critic() else {
                return Ok(None);
            };
            let t = Instant::now();
            let r = self
                .serve_critic(
                    &c,
                    || CriticRequest::Train(p.samples.clone()),
                    "update_critic",
                    self.config.timeouts.train,
                )
                .await?;
            match r {
                CriticResponse::Trained(r) => {
                    self.log_critic_update(&p.samples);
                    Ok(Some((r, t.elapsed().as_secs_f64())))
                }
                other => Err(self.protocol("critic", "Train", format!("{other:?}"))),
            }
        };
        let ((train, secs), critic) = tokio::join!(policy, critic);
        let train = match train? {
            PolicyResponse::Trained(r) => r,
            other => return Err(self.protocol("policy", "Train", format!("{other:?}"))),
        };
        if let Some(r) = &self.policy_recovery {
            r.lock().record(self.step + 1, &p.samples);
        }
        let critic = match critic? {
            Some((r, secs)) => {
                p.metrics.set(names::UPDATE_CRITIC_S, secs);
                Some(r)
            }
            None => None,
        };
        Ok((train, critic, secs))
    }
}
