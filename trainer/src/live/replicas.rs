//! Starting, handing state to and stopping role replicas on groups.

use std::time::Duration;

use yatt_placement::GroupId;
use yatt_roles::{Role, RoleRequest, RoleResponse};
use yatt_runtime::DirectoryChange as Change;
use yatt_runtime::Message;
use yatt_runtime::{ActorRef, ExitReason};

use crate::build::parts::{policy_role_from, policy_trainer, rollout_role};
use crate::build::replica::{export_state, import_state};
use crate::checkpoint::load_trainer;
use crate::controller::refs::{spawn_role, PolicyRef, RolloutRef};
use crate::error::JobError;
use crate::live::errors::me;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;

impl LivePlacement {
    /// Starts a rollout replica on group `g`; it gets the policy's weights at the next
    /// weight sync.
    pub(crate) async fn start_rollout(&mut self, g: GroupId) -> Result<RolloutRef, JobError> {
        self.injected_fault(g, "rollout")?;
        match &self.hosts {
            Hosts::Embedded {
                codec, template, ..
            } => {
                let dev = self.device_group(g).torch_device();
                let m = template
                    .deep_copy(dev, self.job.model.dtype.kind())
                    .map_err(me(&self.job))?;
                let role = rollout_role(&self.job, m, codec.clone());
                self.spawn_here(g, role).await
            }
            Hosts::Cluster { text } => self.spawn_there(g, text, "rollout", None).await,
        }
    }

    /// Starts `role` on a thread of this process for group `g` and records it in the
    /// directory (an actor only this process reaches is not registered by itself).
    pub(crate) async fn spawn_here<R: Role>(
        &mut self,
        g: GroupId,
        role: R,
    ) -> Result<ActorRef<RoleRequest<R::Request>, RoleResponse<R::Response>>, JobError> {
        self.next_replica += 1;
        let group = self.device_group(g);
        let claim = Some(group.claim());
        let r = spawn_role(&self.node, role, self.next_replica, group).await?;
        self.announce(Change::ActorUp {
            id: r.id().clone(),
            claim,
        })
        .await?;
        Ok(r)
    }

    /// Starts `role` on group `g`'s node through its factory (the hosting node records
    /// the actor in the directory itself).
    pub(crate) async fn spawn_there<Req: Message, Resp: Message>(
        &self,
        g: GroupId,
        text: &str,
        role: &'static str,
        checkpoint: Option<&std::path::Path>,
    ) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, JobError> {
        let target = self.node_of(g)?;
        let spawned =
            crate::build::remote::spawn(&self.job, text, &self.node, role, target, checkpoint);
        Ok(spawned.await?)
    }

    /// Records a replica's start or stop in the runtime's directory (a new epoch).
    pub(crate) async fn announce(&self, change: Change) -> Result<(), JobError> {
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
    pub(crate) async fn start_policy(
        &mut self,
        g: GroupId,
        from: Option<&PolicyRef>,
    ) -> Result<PolicyRef, JobError> {
        self.injected_fault(g, "policy")?;
        // A resumed run's first replica loads the checkpoint; the rest copy it.
        let checkpoint = self.resume_from.clone().filter(|_| from.is_none());
        let r = match &self.hosts {
            Hosts::Embedded {
                template, pad_id, ..
            } => {
                let (dev, kind) = (
                    self.device_group(g).torch_device(),
                    self.job.model.dtype.kind(),
                );
                let trainer = match &checkpoint {
                    Some(dir) => load_trainer(dir, "policy", dev, kind)?,
                    None => policy_trainer(
                        &self.job,
                        template.deep_copy(dev, kind).map_err(me(&self.job))?,
                    )?,
                };
                let role = policy_role_from(&self.job, trainer, *pad_id)?;
                self.spawn_here(g, role).await?
            }
            Hosts::Cluster { text } => {
                self.spawn_there(g, text, "policy", checkpoint.as_deref())
                    .await?
            }
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
    pub(crate) async fn hand_off(&self, src: &PolicyRef, dst: &PolicyRef) -> Result<(), JobError> {
        let t = self.deadline();
        let state = export_state(src, t).await?;
        import_state(dst, state, t).await
    }

    /// Drains, offloads and stops a replica (its thread ends and drops its tensors);
    /// returns the work items a drain gave up.
    pub(crate) async fn stop(&self, replica: &Replica) -> Result<Vec<u64>, JobError> {
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
}

pub(crate) async fn drain_and_stop<Req: Send + 'static, Resp: Send + 'static>(
    r: &yatt_runtime::ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    t: Duration,
) -> Result<Vec<u64>, JobError> {
    let call = |e: yatt_runtime::CallError| JobError::Placement {
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
