//! Losing a policy replica's node under live placement on a cluster while another
//! replica survives: the policy's `NodeLost` re-plan runs the heads on the groups
//! left (every head may share the survivor, the global batch unchanged), and the
//! step runs again.

use crate::build::heads::job_timeouts;
use crate::build::replica::{export_state, survivor_version};
use crate::build::respawn::wait_for_loss;
use crate::controller::error::ControllerError;
use crate::controller::report::ControllerState;
use crate::error::JobError;
use crate::live::state::{Hosts, LivePlacement, Replica};
use crate::live::step::gone_nodes;

/// What a lost policy replica's recovery found.
pub(crate) struct LostReplica {
    /// The survivor's version when it took the failed step's update before its peer
    /// died (that update is kept and not taken again).
    pub(crate) committed: Option<u64>,
}

impl LivePlacement {
    /// Whether `failed`, a call to a policy replica, is explained by a policy replica
    /// lost with its node while another one survives on a live node: waits up to twice
    /// the failure bound (plus a second) for the directory to declare a node of the plan
    /// dead. Checks the survivor's version against the step's (`before`): at it, or one
    /// past it when the survivor took the update.
    pub(crate) async fn lost_policy_replica(
        &self,
        failed: &ControllerError,
        before: &[ControllerState],
    ) -> Result<Option<LostReplica>, JobError> {
        // A call to a policy replica (the lost one's, or a survivor's whose ring lost
        // its peer) is what such a loss fails.
        let to_policy = matches!(failed, ControllerError::Call { role: "policy", .. });
        if !to_policy || !matches!(self.hosts, Hosts::Cluster { .. }) {
            return Ok(None);
        }
        wait_for_loss(&self.node, |d| !gone_nodes(d, &self.known_nodes).is_empty()).await;
        let dead = self.dead_nodes();
        let mut lost = 0;
        let mut survivor = None;
        for (g, r) in &self.replicas {
            let Replica::Policy(p) = r else { continue };
            match dead.iter().any(|n| self.node_of(*g).is_ok_and(|x| x == n)) {
                true => lost += 1,
                false => survivor = survivor.or(Some(p.clone())),
            }
        }
        let (true, Some(survivor)) = (lost > 0, survivor) else {
            return Ok(None);
        };
        let want = before.first().map_or(0, |s| s.weights_version);
        let t = job_timeouts(&self.job).sync;
        let at = survivor_version(&survivor, &export_state(&survivor, t).await?, want)?;
        Ok(Some(LostReplica {
            committed: (at == want + 1).then_some(at),
        }))
    }
}
