//! Losing the node of the reward or the reference under live placement on a cluster:
//! both are stateless (the reference is the initial model), so they start again on a
//! live node and the step runs again, as without live placement.

use std::collections::BTreeSet;

use yatt_placement::Record;
use yatt_runtime::ActorId;

use crate::build::remote::spawn;
use crate::build::replica::Hosting;
use crate::build::respawn::{actor_lost, wait_for_loss};
use crate::controller::error::ControllerError;
use crate::error::JobError;
use crate::live::state::{Hosts, LivePlacement, Replica};

/// A role outside the groups that the trainer started and can start again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SharedRole {
    Reward,
    Reference,
}

impl SharedRole {
    fn name(self) -> &'static str {
        match self {
            SharedRole::Reward => "reward",
            SharedRole::Reference => "reference",
        }
    }
}

impl LivePlacement {
    /// The shared roles this trainer started (not the user's), with their actors.
    fn restartable_shared(&self) -> Vec<(ActorId, SharedRole)> {
        let mut ids = Vec::new();
        if self.shared.restartable.reward {
            ids.push((self.shared.reward.id().clone(), SharedRole::Reward));
        }
        if let (Some(r), true) = (&self.shared.reference, self.shared.restartable.reference) {
            ids.push((r.id().clone(), SharedRole::Reference));
        }
        ids
    }

    /// The shared roles whose loss explains `e`, a call to the reward or the reference
    /// that failed on a cluster: waits up to twice the failure bound (plus a second) for
    /// the directory to declare one lost. Empty when `e` is something else.
    pub(crate) async fn lost_shared(&self, e: &ControllerError) -> Vec<SharedRole> {
        let ControllerError::Call { role, .. } = e else {
            return Vec::new();
        };
        if !matches!(self.hosts, Hosts::Cluster { .. }) || !matches!(*role, "reward" | "reference")
        {
            return Vec::new();
        }
        let ids = self.restartable_shared();
        wait_for_loss(&self.node, |d| ids.iter().any(|(id, _)| actor_lost(d, id))).await;
        self.node.directory().read(|d| {
            ids.iter()
                .filter(|(id, _)| actor_lost(d, id))
                .map(|(_, r)| *r)
                .collect()
        })
    }

    /// Starts the `lost` shared roles again, each on the least-loaded live node, and
    /// gives every head the new ones. Returns what moved (`role: old node -> new node`).
    pub(crate) async fn respawn_shared(
        &mut self,
        lost: &[SharedRole],
        step: u64,
    ) -> Result<Vec<String>, JobError> {
        let Hosts::Cluster { text } = &self.hosts else {
            return Ok(Vec::new());
        };
        let text = text.clone();
        let shared = self.restartable_shared();
        let lost_ids: BTreeSet<ActorId> = shared
            .iter()
            .filter(|(_, r)| lost.contains(r))
            .map(|(id, _)| id.clone())
            .collect();
        // Every actor of the job, so that the new roles go where the load is least.
        let mut ids: Vec<(ActorId, &'static str)> = shared
            .iter()
            .map(|(id, r)| (id.clone(), r.name()))
            .collect();
        for r in self.replicas.values() {
            ids.push(match r {
                Replica::Rollout(r) => (r.id().clone(), "rollout"),
                Replica::Policy(p) => (p.id().clone(), "policy"),
            });
        }
        let mut hosting = Hosting::new(&self.node, &ids, &lost_ids);
        let mut moved = Vec::new();
        for (old, role) in shared.iter().filter(|(_, r)| lost.contains(r)) {
            let target = hosting.pick(&lost_ids)?;
            let new = spawn(&self.job, &text, &self.node, role.name(), &target, None).await?;
            moved.push(format!("{}: {} -> {target}", role.name(), old.name.node));
            match role {
                SharedRole::Reward => {
                    self.shared.reward = new.clone();
                    for c in self.controllers.iter_mut() {
                        c.roles.reward = new.clone();
                    }
                }
                SharedRole::Reference => {
                    self.shared.reference = Some(new.clone());
                    for c in self.controllers.iter_mut() {
                        c.roles.reference = Some(new.clone());
                    }
                }
            }
        }
        self.write(&Record::Search {
            step,
            line: format!(
                "step {}: lost with its node, started again: {}",
                step + 1,
                moved.join(", ")
            ),
        })?;
        Ok(moved)
    }
}
