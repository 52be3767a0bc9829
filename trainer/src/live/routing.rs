//! Routing heads to replicas, and publishing each routing version.

use std::io::Write;

use yatt_placement::GroupId;
use yatt_placement::Record;
use yatt_placement::Role as PRole;
use yatt_runtime::RING_CHUNK_BYTES;

use crate::build::heads::controllers;
use crate::controller::data_parallel::join_policy_ring;
use crate::controller::refs::{PolicyRef, RoleRefs, RolloutRef};
use crate::error::JobError;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;
use crate::live::state::Routes;

impl LivePlacement {
    /// Which rollout and policy group each head uses under the plan.
    pub(crate) fn routes(&self) -> Result<Routes, JobError> {
        let heads = self.job.job.controllers;
        let rollouts: Vec<(GroupId, RolloutRef)> = self
            .of_role(PRole::Rollout)
            .into_iter()
            .filter_map(|(g, r)| match r {
                Replica::Rollout(r) => Some((g, r)),
                Replica::Policy(_) => None,
            })
            .collect();
        let mut policies: Vec<(GroupId, PolicyRef)> = self
            .of_role(PRole::Policy)
            .into_iter()
            .filter_map(|(g, r)| match r {
                Replica::Policy(p) => Some((g, p)),
                Replica::Rollout(_) => None,
            })
            .collect();
        // A sharded policy is one replica over all its groups.
        let mut seen = std::collections::BTreeSet::new();
        policies.retain(|(_, p)| seen.insert(p.id().clone()));
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
    pub(crate) async fn route(
        &mut self,
        states: Option<Vec<crate::controller::report::ControllerState>>,
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
            self.prompts.clone(),
            shared,
            r.into_iter().map(|x| x.1).collect(),
            p.into_iter().map(|x| x.1).collect(),
        )?
        .into_iter()
        .map(|c| c.with_extra_stages(self.shared.stages.iter().cloned()))
        .collect::<Vec<_>>();
        if let Some(states) = states {
            for (c, s) in heads.iter_mut().zip(states) {
                c.restore(s)?;
            }
        }
        // Replicas built in this process have no ring inbox: the heads average their
        // gradients through the controllers instead.
        let replicated = !self.sharded_pool()
            && self.of_role(PRole::Policy).len() == heads.len()
            && heads.len() > 1;
        if replicated && matches!(self.hosts, Hosts::Cluster { .. }) {
            join_policy_ring(&mut heads, RING_CHUNK_BYTES).await?;
        }
        for c in &mut heads {
            let own = c.roles().rollout.id().clone();
            let spares = rollouts.iter().filter(|x| *x.id() != own).cloned();
            c.set_spare_rollouts(spares.collect());
            c.set_probe(self.probe.clone());
            c.set_policy_sharded(self.sharded_pool());
        }
        self.controllers = heads;
        self.routing_version += 1;
        Ok(())
    }

    pub(crate) async fn sync_all(&mut self) -> Result<(), JobError> {
        for c in &mut self.controllers {
            c.sync_weights().await?;
        }
        Ok(())
    }

    pub(crate) fn write(&mut self, r: &Record) -> Result<(), JobError> {
        let line = serde_json::to_string(r).expect("records serialise");
        writeln!(self.log, "{line}")
            .and_then(|_| self.log.flush())
            .map_err(|source| JobError::Write {
                path: self.log_path.clone(),
                source,
            })
    }

    pub(crate) fn publish(&mut self, step: u64) -> Result<(), JobError> {
        let r = Record::Plan {
            step,
            routing_version: self.routing_version,
            directory_epoch: self.node.directory().epoch(),
            plan: self.plan.clone(),
            places: self
                .policy
                .inventory()
                .groups()
                .map(|g| yatt_placement::GroupPlace {
                    group: g.id,
                    node: g.node.clone(),
                    devices: g.devices.clone(),
                })
                .collect(),
        };
        self.write(&r)
    }
}
