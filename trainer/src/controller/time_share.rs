//! Time sharing of one device by colocated roles (`placement.time_share = "offload"`),
//! as verl's and OpenRLHF's "sleep / wake": before generation the policy, critic and
//! reference offload their state and the rollout comes back; after generation the
//! rollout frees its KV cache and offloads its weights, and the others come back. A
//! weight sync into an offloaded rollout waits in the rollout until its reload.
//!
//! Before each reload the controller checks that the device has room: the bytes the
//! role held before its offload plus the bytes every role holds now, against the
//! budget (`placement.device_memory_gb`). The bookkeeping
//! ([`crate::controller::residency::Residency`]) is plain data; the asks are the only
//! I/O.

use std::time::{Duration, Instant};

use yatt_metrics::names;
use yatt_roles::{RoleRequest, RoleResponse};
use yatt_runtime::ActorRef;

use crate::controller::core::{Controller, Prepared};
use crate::controller::error::ControllerError;
use crate::controller::refs::variant;
use crate::controller::report::StepMetrics;

/// The switches of one step: seconds and the bytes measured around each offload.
#[derive(Debug, Default, Clone)]
pub(crate) struct Switches {
    offload_s: f64,
    reload_s: f64,
    /// (role, bytes before its offload, bytes after).
    resident: Vec<(String, u64, u64)>,
}

impl Switches {
    /// Puts the switches in a step's metrics.
    pub(crate) fn record(self, m: &mut StepMetrics) {
        m.set(names::OFFLOAD_S, self.offload_s);
        m.set(names::RELOAD_S, self.reload_s);
        for (role, before, after) in self.resident {
            m.set(
                &format!("{}{role}", names::RESIDENT_BYTES_LOADED_PREFIX),
                before as f64,
            );
            m.set(
                &format!("{}{role}", names::RESIDENT_BYTES_PREFIX),
                after as f64,
            );
        }
    }
}

type RoleRef<Req, Resp> = ActorRef<RoleRequest<Req>, RoleResponse<Resp>>;

impl Controller {
    /// A lifecycle ask (offload, reload, profile) with the weight-sync deadline.
    async fn lifecycle<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: &RoleRef<Req, Resp>,
        req: RoleRequest<Req>,
        stage: &'static str,
        role: &'static str,
    ) -> Result<RoleResponse<Resp>, ControllerError> {
        let t: Duration = self.config.timeouts.sync;
        r.ask(req, t).await.map_err(self.call(stage, role))
    }

    /// An offload or a reload (`stage`), answered `Done`.
    async fn switch<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: &RoleRef<Req, Resp>,
        req: RoleRequest<Req>,
        stage: &'static str,
        role: &'static str,
    ) -> Result<(), ControllerError> {
        match self.lifecycle(r, req, stage, role).await? {
            RoleResponse::Done => Ok(()),
            other => Err(self.protocol(role, stage, variant(&other))),
        }
    }

    /// The device bytes `r` holds now.
    async fn resident<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: &RoleRef<Req, Resp>,
        role: &'static str,
    ) -> Result<u64, ControllerError> {
        match self
            .lifecycle(r, RoleRequest::Profile, "time_share", role)
            .await?
        {
            RoleResponse::Profile(p) => Ok(p.resident_bytes),
            other => Err(self.protocol(role, "Profile", variant(&other))),
        }
    }

    /// Offloads `r` (known as `key`), measuring its bytes before and after.
    async fn offload_role<Req: Send + 'static, Resp: Send + 'static>(
        &mut self,
        r: &RoleRef<Req, Resp>,
        role: &'static str,
        key: &str,
        sw: &mut Switches,
    ) -> Result<(), ControllerError> {
        let t = Instant::now();
        let before = self.resident(r, role).await?;
        self.switch(r, RoleRequest::Offload, "offload", role)
            .await?;
        let after = self.resident(r, role).await?;
        self.residency.offloaded(key, before, after);
        sw.resident.push((key.to_string(), before, after));
        sw.offload_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// Reloads `r` (known as `key`) once the budget has room for it.
    async fn reload_role<Req: Send + 'static, Resp: Send + 'static>(
        &mut self,
        r: &RoleRef<Req, Resp>,
        role: &'static str,
        key: &str,
        sw: &mut Switches,
    ) -> Result<(), ControllerError> {
        let budget = self.config.time_share.map_or(0, |t| t.budget_bytes);
        if let Err((need, in_use)) = self.residency.check_room(key, budget) {
            return Err(ControllerError::DeviceBudget {
                step: self.step_no(),
                role: key.to_string(),
                need,
                in_use,
                budget,
            });
        }
        let t = Instant::now();
        self.switch(r, RoleRequest::Reload, "reload", role).await?;
        self.residency.reloaded(key);
        sw.reload_s += t.elapsed().as_secs_f64();
        Ok(())
    }

    /// The rollout replicas this controller drives, with the keys that name them.
    fn rollout_keys(&self) -> Vec<(crate::controller::refs::RolloutRef, String)> {
        let all =
            std::iter::once(self.roles.rollout.clone()).chain(self.roles.extra_rollouts.clone());
        all.enumerate()
            .map(|(i, r)| {
                (
                    r,
                    if i == 0 {
                        "rollout".into()
                    } else {
                        format!("rollout_{i}")
                    },
                )
            })
            .collect()
    }

    /// Before generation: the training roles go, the rollouts come back.
    pub(crate) async fn to_generation(&mut self, sw: &mut Switches) -> Result<(), ControllerError> {
        let roles = self.roles.clone();
        if !self.residency.knows("reward") {
            let b = self.resident(&roles.reward, "reward").await?;
            self.residency.holds("reward", b);
        }
        self.offload_role(&roles.policy, "policy", "policy", sw)
            .await?;
        if let Some(c) = &roles.critic {
            self.offload_role(c, "critic", "critic", sw).await?;
        }
        if let Some(r) = &roles.reference {
            self.offload_role(r, "reference", "reference", sw).await?;
        }
        for (r, key) in self.rollout_keys() {
            if self.residency.knows(&key) {
                self.reload_role(&r, "rollout", &key, sw).await?;
            } else {
                // Never offloaded: it holds its weights (and maybe a cache) now.
                let b = self.resident(&r, "rollout").await?;
                self.residency.holds(&key, b);
            }
        }
        Ok(())
    }

    /// After generation: the rollouts go (KV cache freed, weights to the host), the
    /// training roles come back.
    pub(crate) async fn to_training(&mut self, sw: &mut Switches) -> Result<(), ControllerError> {
        let roles = self.roles.clone();
        for (r, key) in self.rollout_keys() {
            self.offload_role(&r, "rollout", &key, sw).await?;
        }
        self.reload_role(&roles.policy, "policy", "policy", sw)
            .await?;
        if let Some(c) = &roles.critic {
            self.reload_role(c, "critic", "critic", sw).await?;
        }
        if let Some(r) = &roles.reference {
            self.reload_role(r, "reference", "reference", sw).await?;
        }
        Ok(())
    }
}

/// The stages up to the update of every controller, taking turns with the device:
/// every head's switch to generation, the heads' generation side by side, every
/// head's switch to training, then their reference, values, old log-probs and
/// advantages side by side. Heads that share a policy switch it in turn (the second
/// switch finds it switched already), never while another head uses it.
pub(crate) async fn prepare_time_shared(
    controllers: &mut [Controller],
) -> Result<Vec<Prepared>, ControllerError> {
    let t_step = Instant::now();
    let mut switches = vec![Switches::default(); controllers.len()];
    for (c, sw) in controllers.iter_mut().zip(&mut switches) {
        c.to_generation(sw).await?;
    }
    let mut batches =
        futures::future::try_join_all(controllers.iter().map(|c| c.gen_batch(c.step))).await?;
    for ((c, sw), b) in controllers.iter_mut().zip(&mut switches).zip(&mut batches) {
        c.lost_rollouts.extend(b.lost.drain(..));
        c.to_training(sw).await?;
    }
    for (b, sw) in batches.iter_mut().zip(switches) {
        sw.record(&mut b.metrics);
    }
    let shared: &[Controller] = controllers;
    futures::future::try_join_all(
        shared
            .iter()
            .zip(batches)
            .map(|(c, b)| c.prepare_batch(b, t_step)),
    )
    .await
}
