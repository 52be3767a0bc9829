//! Carrying out the policy's decisions: migrations and their roll-back.

use std::time::Instant;

use yatt_placement::GroupId;
use yatt_placement::Role as PRole;
use yatt_placement::{finite, Record};
use yatt_placement::{Decision, Event, Plan, Reason};

use crate::controller::core::Controller;
use crate::controller::refs::PolicyRef;
use crate::error::JobError;
use crate::live::errors::placement_err;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;

impl LivePlacement {
    /// Carries out the policy's decisions after `step`, records each and its outcome,
    /// and reports the outcome back to the policy.
    pub(crate) async fn apply(
        &mut self,
        decisions: Vec<Decision>,
        step: u64,
    ) -> Result<(), JobError> {
        for d in decisions {
            let Decision::Migrate(mig) = d;
            self.write(&Record::Decision {
                step,
                id: mig.id,
                reason: mig.reason,
                from: self.plan.summary(),
                to: mig.target.summary(),
                moves: mig.moves.clone(),
                predicted_before_s: finite(mig.predicted_s.0),
                predicted_after_s: finite(mig.predicted_s.1),
                cost_s: mig.cost_s,
            })?;
            let t = Instant::now();
            let outcome = self.migrate(&mig).await;
            let secs = t.elapsed().as_secs_f64();
            let (ok, detail) = match &outcome {
                Ok(d) => (true, d.clone()),
                Err(e) => (false, e.to_string()),
            };
            self.write(&Record::Migrated {
                id: mig.id,
                ok,
                seconds: secs,
                detail,
            })?;
            let event = match outcome {
                Ok(_) => {
                    // What a start really costs here, for the next decision.
                    let starts = mig.moves.iter().filter(|m| !m.to.is_empty()).count();
                    let per_group = secs / starts.max(1) as f64;
                    self.policy
                        .cost_model_mut()
                        .set_start_costs(per_group, per_group);
                    Event::MigrationDone { id: mig.id }
                }
                Err(e) => {
                    // Rolled back: the heads run on the old plan. A rollback that
                    // failed too stops the run loudly rather than fail the next step,
                    // and so does a lost node's re-plan (the old plan has lost groups).
                    if !self.rolled_back || mig.reason == Reason::NodeLost {
                        return Err(e);
                    }
                    Event::MigrationFailed {
                        id: mig.id,
                        reason: e.to_string(),
                    }
                }
            };
            self.policy.on_event(event);
            self.write_policy_log(step)?;
            self.publish(step + 1)?;
        }
        Ok(())
    }

    /// Migrates to `target` now, between two steps: a move asked for by an operator or
    /// the embedding program rather than decided by the policy, carried out, recorded
    /// and rolled back on failure as the policy's own are (a cooldown follows). Refused,
    /// with nothing moved, while a migration is in flight, when `target` does not fit
    /// the groups, or when it is the plan in force.
    pub async fn move_to(&mut self, target: Plan) -> Result<(), JobError> {
        let step = self
            .controllers
            .first()
            .map_or(0, |c| c.step_count().saturating_sub(1));
        let decisions = self.policy.on_event(Event::PlanRequested(target.clone()));
        let said = self.policy.take_log();
        for line in &said {
            self.write(&Record::Search {
                step,
                line: line.clone(),
            })?;
        }
        if decisions.is_empty() {
            return Err(placement_err(format!(
                "the requested plan {} was not migrated to: {}",
                target.summary(),
                said.join("; ")
            )));
        }
        self.apply(decisions, step).await?;
        if self.plan != target {
            return Err(placement_err(format!(
                "the move to {} failed and was rolled back to {}: see {}",
                target.summary(),
                self.plan.summary(),
                self.log_path.display()
            )));
        }
        Ok(())
    }

    /// Carries out one migration at a step boundary. If a step of it fails (a drain,
    /// a gaining role that does not start, the new routing), it is undone: the groups
    /// get back the roles of the plan in force (stopping what the migration started,
    /// restarting what it stopped: a policy replica from a survivor's state), the heads
    /// are routed by that plan again and synced, and the error is returned for
    /// [`Event::MigrationFailed`]. A rollback that itself fails is returned with both
    /// errors, and the run stops.
    pub(crate) async fn migrate(
        &mut self,
        mig: &yatt_placement::Migration,
    ) -> Result<String, JobError> {
        let old = self.plan.clone();
        let states: Vec<_> = self.controllers.iter().map(Controller::state).collect();
        self.rolled_back = false;
        match self.migrate_forward(mig, states.clone()).await {
            Ok(done) => {
                self.before_move = Some(old);
                Ok(done)
            }
            Err(e) => {
                let (what, fix) = match e {
                    JobError::Placement { what, fix } => (what, fix),
                    other => (other.to_string(), "see the nodes' logs".to_string()),
                };
                match self.roll_back(&old, states).await {
                    Ok(restored) => {
                        self.rolled_back = true;
                        Err(JobError::Placement {
                            what: format!("{what}; rolled back to {} ({restored})", old.summary()),
                            fix})
                    }
                    Err(again) => Err(JobError::Placement {
                        what: format!("{what}; the rollback failed too: {again}"),
                        fix: "the groups are in no known plan, so the run stops; see the nodes' logs and resume the run (see below for its last checkpoint)".into()})}
            }
        }
    }

    /// The migration's steps, in order (see the module docs).
    pub(crate) async fn migrate_forward(
        &mut self,
        mig: &yatt_placement::Migration,
        states: Vec<crate::controller::report::ControllerState>,
    ) -> Result<String, JobError> {
        if self.sharded_pool() {
            return self.migrate_sharded(mig, states).await;
        }
        let mut done = Vec::new();
        for mv in &mig.moves {
            // 1. Out of routing: the plan without this group serves until the new one
            // is published (the heads are rebuilt at the end). A lost group's replica
            // is already gone; a group new to the plan runs nothing yet.
            let replica = self.replicas.remove(&mv.group);
            if replica.is_none() && !mv.from.is_empty() && !self.lost(mv.group) {
                return Err(JobError::Placement {
                    what: format!("a move of {} which runs nothing", mv.group),
                    fix: "report this: the policy and the executor disagree on the plan".into(),
                });
            }
            // A policy replica that leaves hands its state to whoever gains the group.
            let survivor = self.survivor();
            // 2–3. Drain, free (offload, then stop: the thread drops the tensors).
            if let Some(replica) = &replica {
                let drained = self.stop(replica).await?;
                if !drained.is_empty() {
                    return Err(JobError::Placement {
                        what: format!("{} work items in flight on {}", drained.len(), mv.group),
                        fix: "migrations run at step boundaries, where nothing is in flight".into(),
                    });
                }
            }
            // 4. Start the gaining role: a policy replica continues from a survivor's
            // weights and optimizer state. A group that leaves the plan gains nothing.
            if mv.to.contains(PRole::Rollout) {
                let r = self.start_rollout(mv.group).await?;
                self.replicas.insert(mv.group, Replica::Rollout(r));
            } else if mv.to.contains(PRole::Policy) {
                let Some(src) = survivor.or(match replica {
                    Some(Replica::Policy(p)) => Some(p),
                    _ => None,
                }) else {
                    return Err(JobError::Placement {
                        what: "no policy replica left to copy".into(),
                        fix: "keep at least one policy group".into(),
                    });
                };
                let p = self.start_policy(mv.group, Some(&src)).await?;
                self.replicas.insert(mv.group, Replica::Policy(p));
            }
            let to = match mv.to.is_empty() {
                true => "(out of the plan)".to_string(),
                false => mv.to.to_string(),
            };
            done.push(format!("{}: {} -> {to}", mv.group, mv.from));
        }
        // 5. The heads on the new plan, and a weight sync to every head's rollout (new
        // replicas included). 6. Publication is the caller's (it writes the plan record).
        self.route_to(&mig.target, states).await?;
        Ok(done.join("; "))
    }

    /// Routes the heads by `target` from `states` (the plan in force stays if routing
    /// fails), then syncs every head's rollout.
    pub(crate) async fn route_to(
        &mut self,
        target: &Plan,
        states: Vec<crate::controller::report::ControllerState>,
    ) -> Result<(), JobError> {
        let old = std::mem::replace(&mut self.plan, target.clone());
        if let Err(e) = self.route(Some(states)).await {
            self.plan = old;
            return Err(e);
        }
        self.sync_all().await
    }

    /// Whether group `g` left the inventory with its node.
    pub(crate) fn lost(&self, g: GroupId) -> bool {
        self.policy.inventory().group(g).is_none()
    }

    /// A running policy replica, whose state a new one copies.
    pub(crate) fn survivor(&self) -> Option<PolicyRef> {
        self.replicas.values().find_map(|r| match r {
            Replica::Policy(p) => Some(p.clone()),
            Replica::Rollout(_) => None,
        })
    }

    /// Gives every group of `old` that is still in the inventory its role under `old`
    /// again, stops what runs on groups outside it, and routes the heads by it from
    /// `states`. Returns what it restored.
    pub(crate) async fn roll_back(
        &mut self,
        old: &Plan,
        states: Vec<crate::controller::report::ControllerState>,
    ) -> Result<String, JobError> {
        if self.sharded_pool() {
            return self.roll_back_sharded(old, states).await;
        }
        let want = old.roles_by_group();
        let mut restored = Vec::new();
        // Groups the migration gave a role outside the old plan.
        let extra: Vec<GroupId> = self
            .replicas
            .keys()
            .filter(|g| !want.contains_key(g))
            .copied()
            .collect();
        for g in extra {
            if let Some(r) = self.replicas.remove(&g) {
                self.stop(&r).await?;
                restored.push(format!("{g} stopped"));
            }
        }
        for (g, roles) in &want {
            if self.lost(*g) {
                continue;
            }
            let rollout = roles.contains(PRole::Rollout);
            match self.replicas.get(g) {
                Some(Replica::Rollout(_)) if rollout => continue,
                Some(Replica::Policy(_)) if !rollout => continue,
                Some(_) => {
                    let r = self.replicas.remove(g).expect("just seen");
                    self.stop(&r).await?;
                }
                None => {}
            }
            let r = match rollout {
                true => Replica::Rollout(self.start_rollout(*g).await?),
                false => {
                    let Some(src) = self.survivor() else {
                        return Err(placement_err(format!(
                            "no policy replica is left to restart {g}'s from"
                        )));
                    };
                    Replica::Policy(self.start_policy(*g, Some(&src)).await?)
                }
            };
            self.replicas.insert(*g, r);
            restored.push(format!("{g}: {roles} again"));
        }
        self.plan = old.clone();
        self.route(Some(states)).await?;
        self.sync_all().await?;
        if restored.is_empty() {
            restored.push("nothing had changed".into());
        }
        Ok(restored.join("; "))
    }
}
