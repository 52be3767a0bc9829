//! Stopping the roles a job started: when the job ends, and when its build fails part
//! way. A role left running holds its model (on a GPU, its device memory) and its name,
//! so the next job on the same node could neither fit nor start ("already running").
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::future::BoxFuture;
use yatt_roles::{RoleRequest, RoleResponse};
use yatt_runtime::{ActorId, ActorRef, CallError, Directory, Liveness, Node};

use crate::build::custom::CustomRoles;
use crate::build::heads::job_timeouts;
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::error::JobError;

/// A role, whatever its messages: `RoleRequest::Stop` is the same for every role.
trait StopRole: Send + Sync {
    fn stop(&self, within: Duration) -> BoxFuture<'static, Result<(), CallError>>;
}

impl<Req: Send + 'static, Resp: Send + 'static> StopRole
    for ActorRef<RoleRequest<Req>, RoleResponse<Resp>>
{
    fn stop(&self, within: Duration) -> BoxFuture<'static, Result<(), CallError>> {
        let r = self.clone();
        Box::pin(async move { r.ask(RoleRequest::Stop, within).await.map(drop) })
    }
}

/// How long the end of a job waits for each of its roles to stop. An idle role stops at
/// once; one still serving the call that failed the job stops when that call ends, and
/// the job's error should not wait for that.
const STOP_WAIT: Duration = Duration::from_secs(30);

/// Each role's deadline to stop: the job's `timeouts.sync_s`, at most [`STOP_WAIT`].
fn stop_within(job: &JobConfig) -> Duration {
    job_timeouts(job).sync.min(STOP_WAIT)
}

/// The roles to stop, each once (by actor id). Shared by the concurrent spawns of a
/// build, so the lock is never held across an await.
#[derive(Default, Clone)]
pub(crate) struct StartedRoles(Arc<Mutex<BTreeMap<ActorId, Arc<dyn StopRole>>>>);

impl StartedRoles {
    fn roles(&self) -> std::sync::MutexGuard<'_, BTreeMap<ActorId, Arc<dyn StopRole>>> {
        // A panic elsewhere cannot leave the map half-updated: inserts and removes are
        // single calls.
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `r` and hands it back, so a spawn reads `started.keep(spawn(..).await?)`.
    pub(crate) fn keep<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    ) -> ActorRef<RoleRequest<Req>, RoleResponse<Resp>> {
        self.add(&r);
        r
    }

    pub(crate) fn add<Req: Send + 'static, Resp: Send + 'static>(
        &self,
        r: &ActorRef<RoleRequest<Req>, RoleResponse<Resp>>,
    ) {
        self.roles()
            .entry(r.id().clone())
            .or_insert_with(|| Arc::new(r.clone()));
    }

    /// Every role `c` drives: its rollouts (spares too), policy and peers, critic,
    /// reward, reference and stages.
    pub(crate) fn add_controller(&self, c: &Controller) {
        let r = &c.roles;
        self.add(&r.rollout);
        r.extra_rollouts.iter().for_each(|x| self.add(x));
        c.spare_rollouts.iter().for_each(|x| self.add(x));
        self.add(&r.policy);
        c.peer_policies.iter().for_each(|x| self.add(x));
        r.critic.iter().for_each(|x| self.add(x));
        self.add(&r.reward);
        r.reference.iter().for_each(|x| self.add(x));
        c.extra.iter().for_each(|s| self.add(&s.role));
    }

    /// Every role of `roles`' slots and stages.
    pub(crate) fn add_custom(&self, roles: &CustomRoles) {
        roles.reward.iter().for_each(|x| self.add(x));
        roles.reference.iter().for_each(|x| self.add(x));
        roles.critic.iter().for_each(|x| self.add(x));
        roles.policy.iter().for_each(|x| self.add(x));
        roles.rollouts.iter().for_each(|x| self.add(x));
        roles.stages.iter().for_each(|s| self.add(&s.role));
    }

    /// Leaves these alone: roles the caller brought are the caller's to stop.
    pub(crate) fn forget<'a>(&self, ids: impl IntoIterator<Item = &'a ActorId>) {
        let mut roles = self.roles();
        for id in ids {
            roles.remove(id);
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.roles().len()
    }

    /// Asks every role to stop, all at once, each within `within`; a role's answer comes
    /// after its thread has ended and dropped its model. One already gone is skipped; one
    /// that does not answer is logged: stopping is best effort, and a remote role linked
    /// to this node is released anyway when this node leaves. Then waits (within
    /// `within`) until the stopped roles' names are free, on this node and in the
    /// directory, so a job started next can take them. Returns how many stopped.
    pub(crate) async fn stop_all(&self, node: &Node, job: &JobConfig) -> usize {
        let within = stop_within(job);
        let roles: Vec<(ActorId, Arc<dyn StopRole>)> =
            std::mem::take(&mut *self.roles()).into_iter().collect();
        let asks = roles.iter().map(|(id, r)| async move {
            match r.stop(within).await {
                Ok(()) => Some(id.clone()),
                // Already gone: stopped by a migration, or its node died.
                Err(CallError::Closed { .. } | CallError::Stale { .. } | CallError::NodeDown { .. }) => {
                    None
                }
                // Still serving the call that failed the job: the stop waits in its
                // mailbox and takes effect when that call ends.
                Err(CallError::Timeout { .. }) => {
                    tracing::info!(role = %id, within = ?within, "a role of the job is still busy; it stops when its current call ends");
                    None
                }
                Err(e) => {
                    tracing::warn!(role = %id, error = %e, "could not stop a role of the job");
                    None
                }
            }
        });
        let stopped: Vec<ActorId> = futures::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect();
        // An actor leaves its node's table just after its last answer; a remote one's
        // node then records the exit in the directory.
        let here = node.name().to_string();
        let is_free = || {
            let hosted = node.hosted();
            node.directory().read(|d: &Directory| {
                stopped.iter().all(|id| {
                    if id.name.node == here {
                        !hosted.contains(id)
                    } else {
                        d.actor(&id.name)
                            .is_none_or(|e| e.id != *id || e.liveness != Liveness::Alive)
                    }
                })
            })
        };
        let deadline = tokio::time::Instant::now() + within;
        while !is_free() {
            if tokio::time::Instant::now() >= deadline {
                tracing::warn!(
                    within = ?within,
                    "stopped roles of the job still hold their names; a job started next may find them taken"
                );
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        stopped.len()
    }
}

/// Runs `build` with the set its spawns record into; if it fails, stops what it had
/// started before answering, so nothing of it stays running.
pub(crate) async fn stop_if_failed<T, Fut>(
    node: &Node,
    job: &JobConfig,
    build: impl FnOnce(StartedRoles) -> Fut,
) -> Result<T, JobError>
where
    Fut: std::future::Future<Output = Result<T, JobError>>,
{
    let started = StartedRoles::default();
    let built = build(started.clone()).await;
    if built.is_err() {
        started.stop_all(node, job).await;
    }
    built
}
