//! The live placement over a sharded policy (`placement.policy_pool = "sharded"`): the
//! policy groups are the ranks of one policy replica sharded over them (ZeRO-3), which
//! every head shares. A group that moves to the rollout takes a rank with it: the
//! policy reshards in place, N → N−1 ranks, between two steps (its ranks hand their
//! states over and the new ranks take their parts; weights, moments and step carry
//! over), then the rollout starts there. A group that comes back from the rollout
//! stops its rollout first, then the policy reshards N → N+1. Nothing is restarted and
//! no checkpoint is written.
//!
//! Embedded only: the ranks are threads of this process, so this gives the move's
//! mechanics and the same training, not memory per device. The policy's device claim
//! in the directory follows its groups.

use yatt_placement::GroupId;
use yatt_placement::Plan;
use yatt_placement::Role as PRole;
use yatt_roles::{PolicyRequest, PolicyResponse, RoleRequest, RoleResponse};
use yatt_runtime::DirectoryChange as Change;

use crate::build::parts::sharded_policy_role;
use crate::config::modes::PolicyPool;
use crate::controller::refs::PolicyRef;
use crate::error::JobError;
use crate::live::errors::placement_err;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;

impl LivePlacement {
    /// Whether the policy groups are the ranks of one sharded policy.
    pub(crate) fn sharded_pool(&self) -> bool {
        self.job.placement.policy_pool == PolicyPool::Sharded
    }

    /// Starts the policy sharded over `groups`, one rank each (a fresh one, or a
    /// resumed run's checkpoint at whatever rank count wrote it), and makes it every
    /// one of those groups' replica.
    pub(crate) async fn start_sharded_policy(
        &mut self,
        groups: &[GroupId],
    ) -> Result<PolicyRef, JobError> {
        let Some(&first) = groups.first() else {
            return Err(placement_err("a sharded policy with no group".into()));
        };
        self.injected_fault(first, "policy")?;
        let Hosts::Embedded {
            template, pad_id, ..
        } = &self.hosts
        else {
            return Err(placement_err(
                "a sharded policy pool on a cluster (refused by placement.policy_pool)".into(),
            ));
        };
        let mut job = self.job.clone();
        job.job.policy_shards = groups.len();
        let at = (
            self.device_group(first).torch_device(),
            self.job.model.dtype.kind(),
        );
        let from = self.resume_from.as_deref();
        let role = sharded_policy_role(&job, template, from, *pad_id, at)?;
        let p = self.spawn_here(first, role).await?;
        for g in groups {
            self.replicas.insert(*g, Replica::Policy(p.clone()));
        }
        self.claim_groups(&p, groups).await?;
        Ok(p)
    }

    /// Records in the directory that the policy holds the devices of `groups` (its
    /// ranks'), so that whoever reads the holders sees them follow a reshard.
    async fn claim_groups(&self, p: &PolicyRef, groups: &[GroupId]) -> Result<(), JobError> {
        let mut claim = self.device_group(groups[0]).claim();
        for g in &groups[1..] {
            claim.devices.extend(self.device_group(*g).claim().devices);
        }
        self.announce(Change::ActorClaim {
            id: p.id().clone(),
            claim: Some(claim),
        })
        .await
    }

    /// Has the sharded policy reshard itself over `shards` ranks, in place.
    async fn reshard_policy(&self, p: &PolicyRef, shards: usize) -> Result<String, JobError> {
        let request = PolicyRequest::Reshard {
            shards: shards as u32,
        };
        let failed = |why: String| JobError::Placement {
            what: format!("resharding the policy over {shards} ranks: {why}"),
            fix: "see the policy's log".into(),
        };
        match p.ask(RoleRequest::Serve(request), self.deadline()).await {
            Ok(RoleResponse::Served(PolicyResponse::Resharded { from, to })) => {
                Ok(format!("policy resharded {from} -> {to} ranks"))
            }
            Ok(_) => Err(failed("it answered something else".into())),
            Err(e) => Err(failed(e.to_string())),
        }
    }

    /// Gives every group its role under `plan`: rollouts on groups that leave the
    /// rollout stop, the policy reshards over the plan's policy groups, rollouts start
    /// on groups that join it. Returns what changed.
    async fn regroup_sharded(&mut self, plan: &Plan) -> Result<Vec<String>, JobError> {
        // The sharded policy every policy group is a rank of.
        let Some(policy) = self.survivor() else {
            return Err(placement_err("no sharded policy is running".into()));
        };
        let want = plan.roles_by_group();
        let wants_rollout = |g: &GroupId| want.get(g).is_some_and(|r| r.contains(PRole::Rollout));
        let mut done = Vec::new();
        // 1. Rollouts whose group leaves the rollout, drained (a step boundary: nothing
        // in flight) and stopped, freeing the group first.
        let leaving: Vec<GroupId> = self
            .replicas
            .iter()
            .filter(|(g, r)| matches!(r, Replica::Rollout(_)) && !wants_rollout(g))
            .map(|(g, _)| *g)
            .collect();
        for g in leaving {
            let Some(r) = self.replicas.remove(&g) else {
                continue;
            };
            let drained = self.stop(&r).await?;
            if !drained.is_empty() {
                return Err(placement_err(format!(
                    "{} work items in flight on {g}: migrations run at step boundaries",
                    drained.len()
                )));
            }
            done.push(format!("{g}: rollout stopped"));
        }
        // 2. The policy over the plan's policy groups.
        let groups = plan
            .pool_of(PRole::Policy)
            .map(|p| p.groups.clone())
            .unwrap_or_default();
        if groups.is_empty() {
            return Err(placement_err(format!(
                "{} has no policy group",
                plan.summary()
            )));
        }
        self.replicas
            .retain(|_, r| matches!(r, Replica::Rollout(_)));
        done.push(self.reshard_policy(&policy, groups.len()).await?);
        for g in &groups {
            self.replicas.insert(*g, Replica::Policy(policy.clone()));
        }
        self.claim_groups(&policy, &groups).await?;
        // 3. Rollouts on the groups that joined the rollout.
        let joining: Vec<GroupId> = want
            .iter()
            .filter(|(g, roles)| roles.contains(PRole::Rollout) && !self.replicas.contains_key(g))
            .map(|(g, _)| *g)
            .collect();
        for g in joining {
            let r = self.start_rollout(g).await?;
            self.replicas.insert(g, Replica::Rollout(r));
            done.push(format!("{g}: rollout started"));
        }
        Ok(done)
    }

    /// [`LivePlacement::migrate_forward`] over a sharded policy.
    pub(crate) async fn migrate_sharded(
        &mut self,
        mig: &yatt_placement::Migration,
        states: Vec<crate::controller::report::ControllerState>,
    ) -> Result<String, JobError> {
        let done = self.regroup_sharded(&mig.target).await?;
        self.route_to(&mig.target, states).await?;
        Ok(done.join("; "))
    }

    /// [`LivePlacement::roll_back`] over a sharded policy: the groups, and the policy's
    /// ranks, as `old` has them.
    pub(crate) async fn roll_back_sharded(
        &mut self,
        old: &Plan,
        states: Vec<crate::controller::report::ControllerState>,
    ) -> Result<String, JobError> {
        let done = self.regroup_sharded(old).await?;
        self.route_to(old, states).await?;
        Ok(done.join("; "))
    }
}
