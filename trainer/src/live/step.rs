//! One step under live placement.

use std::collections::BTreeMap;
use std::time::Instant;

use yatt_runtime::Directory;

use yatt_placement::Event;
use yatt_placement::Role as PRole;
use yatt_placement::{finite, Record};

use crate::controller::core::Controller;
use crate::controller::data_parallel::step_data_parallel;
use crate::controller::error::ControllerError;
use crate::controller::report::{average_heads, StepMetrics};
use crate::error::JobError;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use yatt_metrics::names;

impl LivePlacement {
    /// Runs one step of every head, feeds the policy, and carries out what it decides
    /// before the next step. Returns the step's metrics, averaged over the heads, with
    /// `placement/*` added.
    ///
    /// On a cluster it first follows membership: a node of `placement.nodes` that died
    /// (or left) is fed as [`Event::NodeLeft`] and the policy's `NodeLost` re-plan is
    /// carried out at once; one that joined (or restarted) is fed as
    /// [`Event::NodeJoined`], its devices becoming groups the policy may use. A rollout
    /// replica lost during the step does not fail it: its samples are requeued in the
    /// head's ledger and generated on another rollout replica of the routing.
    pub async fn step(&mut self) -> Result<StepMetrics, JobError> {
        let t = Instant::now();
        let before: Vec<_> = self.controllers.iter().map(Controller::state).collect();
        let mut respawned = 0;
        let mut committed = false;
        let reports = match step_data_parallel(&mut self.controllers).await {
            Ok(r) => r,
            Err(e) => {
                // Generation failed with no spare to take it over (a single rollout
                // group) and a node is gone; or the reward or reference was lost with
                // its node. Nothing was trained yet: the heads go back to before the
                // step, the loss is carried out (a policy group may become the
                // rollout; a lost shared role starts again elsewhere), and the step
                // runs again on the new plan.
                let lost_gen = matches!(e, ControllerError::Call { stage: "gen", .. })
                    && matches!(self.hosts, Hosts::Cluster { .. })
                    && !self.dead_nodes().is_empty();
                let lost_shared = match lost_gen {
                    true => Vec::new(),
                    false => self.lost_shared(&e).await,
                };
                let lost_replica = match lost_gen || !lost_shared.is_empty() {
                    true => None,
                    false => self.lost_policy_replica(&e, &before).await?,
                };
                if !lost_gen && lost_shared.is_empty() && lost_replica.is_none() {
                    return Err(self.explain_failed_step(e.into()));
                }
                for (c, s) in self.controllers.iter_mut().zip(before) {
                    c.restore(s)?;
                }
                let step = self.controllers.first().map_or(0, Controller::step_count);
                if lost_gen {
                    self.write(&Record::Search {
                        step,
                        line: format!(
                            "step {}: generation lost its only rollout replica with node(s) {}; the step runs again after the re-plan",
                            step + 1,
                            self.dead_nodes().join(", ")
                        )})?;
                }
                self.follow_membership(step).await?;
                if let Some(lost) = &lost_replica {
                    tracing::warn!(step = step + 1, error = %e, plan = %self.plan.summary(), "a policy replica was lost with its node; the heads run on the replicas left and the step runs again");
                    // The survivor took the step's update before its peer died: it is
                    // kept, and the step runs again for its ledger without a second.
                    for c in self.controllers.iter_mut() {
                        c.update_committed = lost.committed;
                    }
                    committed = lost.committed.is_some();
                }
                if !lost_shared.is_empty() {
                    let moved = self.respawn_shared(&lost_shared, step).await?;
                    tracing::warn!(step = step + 1, error = %e, ?moved, "a node was lost; its roles run elsewhere and the step runs again");
                    respawned = moved.len();
                }
                match step_data_parallel(&mut self.controllers).await {
                    Ok(r) => r,
                    Err(e) => return Err(self.explain_failed_step(e.into())),
                }
            }
        };
        let wall = t.elapsed().as_secs_f64();
        self.last_ledgers = reports.iter().map(|r| r.ledger.clone()).collect();
        let step = reports.first().map_or(0, |r| r.metrics.step);
        let obs = self.observe(&reports, wall)?;
        // Membership first: a lost node's re-plan bypasses the policy's hysteresis, and
        // the metrics then meet the plan in force.
        self.follow_membership(step).await?;
        let decisions = self.policy.on_event(Event::Metrics(obs.metrics));
        let predicted = self.policy.predict_plan(&self.plan, 0.0).step_s;
        let no_move = self
            .before_move
            .as_ref()
            .map(|p| self.policy.predict_plan(p, 0.0).step_s);
        self.write(&Record::Step {
            step,
            step_s: wall,
            predicted_s: finite(predicted),
            no_move_s: no_move.and_then(finite),
            groups: obs.groups,
        })?;
        self.write_policy_log(step)?;
        let mut m = average_heads(&reports);
        m.values.insert(names::STEP_WALL_S.into(), wall);
        // The heads report their own (last) attempt; a step that recovered from a lost
        // node took the whole wall time, detection and re-plan included.
        m.values.insert(names::STEP_S.into(), wall);
        m.values
            .insert(names::PLACEMENT_PREDICTED_S.into(), predicted);
        if let Some(x) = no_move {
            m.values.insert(names::PLACEMENT_NO_MOVE_S.into(), x);
        }
        let requeued: u64 = self.last_ledgers.iter().map(|l| l.requeued).sum();
        m.values
            .insert(names::PLACEMENT_REQUEUED.into(), requeued as f64);
        if respawned > 0 {
            m.values
                .insert(names::RECOVERY_RESPAWNED.into(), respawned as f64);
        }
        if committed {
            m.values
                .insert(names::RECOVERY_UPDATE_COMMITTED.into(), 1.0);
        }
        self.apply(decisions, step).await?;
        let count = |r: PRole| self.plan.pool_of(r).map_or(0, |p| p.groups.len()) as f64;
        m.values.insert(
            names::PLACEMENT_ROLLOUT_GROUPS.into(),
            count(PRole::Rollout),
        );
        m.values
            .insert(names::PLACEMENT_POLICY_GROUPS.into(), count(PRole::Policy));
        m.values.insert(
            names::PLACEMENT_ROUTING_VERSION.into(),
            self.routing_version as f64,
        );
        Ok(m)
    }

    /// A failed step's error, naming the nodes of the plan the directory has declared
    /// dead (the likely cause) and what would have let the run go on.
    pub(crate) fn explain_failed_step(&self, e: JobError) -> JobError {
        let dead = self.dead_nodes();
        if dead.is_empty() {
            return e;
        }
        let hosted: Vec<String> = self
            .replicas()
            .into_iter()
            .filter(|(_, n, ..)| dead.contains(n))
            .map(|(g, n, role, _)| format!("{role} on {g} ({n})"))
            .collect();
        JobError::Placement {
            what: format!(
                "the step failed after node(s) {} left the cluster, with the replicas {}: {e}",
                dead.join(", "),
                hosted.join(", ")
            ),
            fix: "live placement survives losing nodes that host rollout replicas, the reward, the reference, or policy replicas while another policy replica lives; the last policy replica cannot be recovered: resume the run (see below for its last checkpoint)".into()}
    }

    /// Nodes whose groups are in the inventory but which the directory no longer lists
    /// alive in the incarnation the shell knows.
    pub(crate) fn dead_nodes(&self) -> Vec<String> {
        self.node
            .directory()
            .read(|d| gone_nodes(d, &self.known_nodes))
    }

    /// The policy's reasoning since the last call, as `Search` records.
    pub(crate) fn write_policy_log(&mut self, step: u64) -> Result<(), JobError> {
        for line in self.policy.take_log() {
            self.write(&Record::Search { step, line })?;
        }
        Ok(())
    }
}

/// The nodes of `known` (name and incarnation) that `d` no longer lists alive in that
/// incarnation.
pub(crate) fn gone_nodes(d: &Directory, known: &BTreeMap<String, u64>) -> Vec<String> {
    known
        .iter()
        .filter(|(name, inc)| {
            !d.alive_nodes()
                .any(|n| n.name == **name && n.incarnation == **inc)
        })
        .map(|(name, _)| name.clone())
        .collect()
}
