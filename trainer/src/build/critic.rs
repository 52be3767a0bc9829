//! The cluster's way to replace a lost built-in critic (`controller/critic_log.rs`
//! replays its updates into the new one).

use std::collections::BTreeSet;

use yatt_runtime::{ActorId, WeakNode};

use crate::build::remote::spawn;
use crate::build::replica::Hosting;
use crate::build::respawn::{actor_lost, wait_for_loss};
use crate::config::sections::JobConfig;
use crate::controller::critic_log::{CriticRespawn, RespawnFuture};
use crate::controller::error::ControllerError;

/// Starts a new built-in critic on a cluster (see `controller/critic_log.rs`): on the
/// least-loaded surviving node, from the checkpoint the controller's log starts at.
pub(crate) struct ClusterCritic {
    pub(crate) job: JobConfig,
    pub(crate) text: String,
    /// Weak: the controller must not keep its node alive.
    pub(crate) node: WeakNode,
}

impl CriticRespawn for ClusterCritic {
    fn respawn<'a>(
        &'a self,
        ids: Vec<(ActorId, &'static str)>,
        lost: &'a ActorId,
        base: Option<&'a std::path::Path>,
    ) -> RespawnFuture<'a> {
        Box::pin(async move {
            let Some(node) = self.node.upgrade() else {
                return Ok(None);
            };
            wait_for_loss(&node, |d| actor_lost(d, lost)).await;
            let gone: BTreeSet<ActorId> = node.directory().read(|d| {
                ids.iter()
                    .filter(|(id, _)| actor_lost(d, id))
                    .map(|(id, _)| id.clone())
                    .collect()
            });
            if !gone.contains(lost) {
                return Ok(None);
            }
            let target = Hosting::new(&node, &ids, &gone).pick(&gone).map_err(|e| {
                ControllerError::Spawn {
                    role: "critic".into(),
                    reason: e.to_string(),
                }
            })?;
            let critic = spawn(&self.job, &self.text, &node, "critic", &target, base).await?;
            Ok(Some(critic))
        })
    }
}
