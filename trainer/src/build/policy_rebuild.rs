//! A disaggregated run with one policy and one head survives the loss of the policy's
//! node. The controller logs the batches the policy trained on since its state was last
//! saved (`controller/update_log.rs`, on the trainer's disk); a new policy on the
//! least-loaded surviving node loads that checkpoint (or the job's model, as the first
//! one did) and trains on them again, which gives the lost policy's weights, AdamW
//! moments and step, bit for bit on nodes that compute alike. The step then runs again
//! from its start, as after any other loss, and its weight sync gives the rollouts the
//! new policy's weights.
//!
//! A second replica (`job.policy_replicas`) keeps the state on another node at the cost
//! of a second trainer; the log costs a file and, at the loss, one update's time per
//! step since the last checkpoint.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use yatt_roles::{PolicyRequest, PolicyResponse};
use yatt_runtime::{ActorId, Node};

use crate::build::remote::spawn;
use crate::build::replica::Hosting;
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::refs::PolicyRef;
use crate::controller::release::stop_if_failed;
use crate::controller::update_log::UpdateLog;
use crate::error::JobError;

/// The policy's update log, in the run's output directory `output_dir`, starting from
/// the checkpoint `base` (or the job's fresh policy). It keeps whole samples: the
/// policy's loss reads most of their fields.
pub(crate) fn policy_log(base: Option<PathBuf>, output_dir: &Path) -> UpdateLog {
    let path = output_dir.join("policy-updates.bin");
    UpdateLog::new("policy", None, base, path)
}

/// Why a lost policy cannot be rebuilt after a step that failed where a critic may
/// have taken its update already (`past_update`); `None`: it can.
pub(crate) fn why_not_rebuilt(
    controllers: &[Controller],
    past_update: bool,
) -> Option<&'static str> {
    let [c] = controllers else {
        return Some("several heads share it");
    };
    if c.policy_recovery.is_none() {
        return Some("the program brought it");
    }
    // A critic that took this step's update cannot take it again when the step reruns.
    if c.roles.critic.is_some() && past_update {
        return Some("the critic may have taken this step's update already");
    }
    None
}

/// Starts a new policy in place of the lost one of `c` (see the module) and gives it to
/// `c`; the step is to run again from `completed` steps. Returns what moved.
pub(crate) async fn rebuild_lost_policy(
    job: &JobConfig,
    text: &str,
    node: &Node,
    c: &mut Controller,
    completed: u64,
    hosting: &mut Hosting,
    lost: &BTreeSet<ActorId>,
) -> Result<String, JobError> {
    let Some(r) = &c.policy_recovery else {
        return Err(JobError::Recovery {
            what: "the policy was lost, and this run keeps no log of its updates".into(),
            fix: "resume from the last checkpoint".into(),
        });
    };
    let unreplayable = |why: String| JobError::Recovery {
        what: format!("the policy was lost, and a new policy cannot take its state: {why}"),
        fix: "resume from the last checkpoint".into(),
    };
    let (base, updates) = {
        let mut log = r.lock();
        // An update the failed step made is undone: the step runs again.
        log.rewind(completed);
        log.replayable().map_err(unreplayable)?;
        (log.base().map(Path::to_path_buf), log.len())
    };
    let target = hosting.pick(lost)?;
    let timeout = c.config.timeouts.train;
    let replaying: &Controller = c;
    let (at, from) = (target.as_str(), base.as_deref());
    // A new policy that cannot take the log is stopped, not left holding its model
    // while the recovery tries again.
    let new = stop_if_failed(node, job, |started| async move {
        let new: PolicyRef = started.keep(spawn(job, text, node, "policy", at, from).await?);
        for i in 0..updates {
            let batch = r.lock().batch(i).map_err(unreplayable)?;
            let request = PolicyRequest::Train(batch);
            match replaying
                .serve(&new, request, "policy_replay", "policy", timeout)
                .await?
            {
                PolicyResponse::Trained(_) => {}
                other => {
                    let e = replaying.protocol("policy", "Train", format!("{other:?}"));
                    return Err(e.into());
                }
            }
        }
        Ok(new)
    })
    .await?;
    r.count_replayed(updates as u64);
    let old = std::mem::replace(&mut c.roles.policy, new);
    // The NCCL group's rank 0 went with the old policy.
    c.nccl.lock().unwrap_or_else(|p| p.into_inner()).group = None;
    let from = base.map_or("the job's model".into(), |b| b.display().to_string());
    Ok(format!(
        "policy: {} -> {target} (from {from} and {updates} updates)",
        old.id().name.node
    ))
}
