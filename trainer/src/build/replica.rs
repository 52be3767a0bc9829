//! Replacing a lost policy replica of a disaggregated run: where the new one goes, and
//! the hand-over of a surviving replica's trainer state to it.
//!
//! The replicas of a data-parallel policy hold bit-identical weights and optimizer
//! state (every one applies the same averaged gradients). A replacement is spawned
//! fresh, takes a survivor's whole trainer state as bytes ([`PolicyRequest::ExportState`]
//! / [`PolicyRequest::ImportState`], over QUIC: nothing is read back from a checkpoint),
//! and joins the rebuilt ring at the lost replica's rank. The ring sums every segment in
//! rank order, so the replacement changes no bit of any later update.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use yatt_roles::{PolicyRequest, PolicyResponse, RoleRequest, RoleResponse, TrainerState};
use yatt_runtime::{ActorId, Node, RING_CHUNK_BYTES};

use crate::build::heads::job_timeouts;
use crate::build::remote::spawn;
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::data_parallel::join_policy_ring;
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, PolicyRef};
use crate::controller::report::ControllerState;
use crate::error::JobError;

/// What to do when the run cannot go on by itself.
const RESUME: &str = "continue from the last checkpoint with `yatt train --resume` (on any nodes)";

/// Where the roles of a recovering job may go: every alive node but the trainer's,
/// the least loaded first (then by name), policy replicas apart from each other while
/// there is room.
pub(crate) struct Hosting {
    load: BTreeMap<String, usize>,
    candidates: Vec<String>,
    replicas_on: BTreeSet<String>,
}

impl Hosting {
    /// `ids`: the job's role actors; `lost`: those gone.
    pub(crate) fn new(
        node: &Node,
        ids: &[(ActorId, &'static str)],
        lost: &BTreeSet<ActorId>,
    ) -> Self {
        let mut load: BTreeMap<String, usize> = BTreeMap::new();
        let mut replicas_on = BTreeSet::new();
        for (id, role) in ids.iter().filter(|(id, _)| !lost.contains(id)) {
            *load.entry(id.name.node.clone()).or_insert(0) += 1;
            if *role == "policy" {
                replicas_on.insert(id.name.node.clone());
            }
        }
        let candidates: Vec<String> = node.directory().read(|d| {
            d.alive_nodes()
                .map(|n| n.name.clone())
                .filter(|n| n != node.name())
                .collect()
        });
        Hosting {
            load,
            candidates,
            replicas_on,
        }
    }

    /// The node that takes the next lost role.
    pub(crate) fn pick(&mut self, lost: &BTreeSet<ActorId>) -> Result<String, JobError> {
        self.pick_among(lost, |_| true)
    }

    /// The node that takes a lost policy replica: one without a replica if any.
    fn pick_replica(&mut self, lost: &BTreeSet<ActorId>) -> Result<String, JobError> {
        let apart = self
            .candidates
            .iter()
            .any(|c| !self.replicas_on.contains(c));
        let taken = self.replicas_on.clone();
        let target = self.pick_among(lost, |n| !apart || !taken.contains(n))?;
        self.replicas_on.insert(target.clone());
        Ok(target)
    }

    fn pick_among(
        &mut self,
        lost: &BTreeSet<ActorId>,
        allowed: impl Fn(&str) -> bool,
    ) -> Result<String, JobError> {
        let target = self
            .candidates
            .iter()
            .filter(|n| allowed(n))
            .min_by_key(|n| (self.load.get(*n).copied().unwrap_or(0), (*n).clone()))
            .cloned()
            .ok_or_else(|| {
                let gone: BTreeSet<&str> = lost.iter().map(|id| id.name.node.as_str()).collect();
                JobError::Recovery {
                    what: format!(
                        "no surviving node can host the roles lost with node(s) {gone:?}"
                    ),
                    fix: format!("start a yatt-node that joins the cluster, then {RESUME}"),
                }
            })?;
        *self.load.entry(target.clone()).or_insert(0) += 1;
        Ok(target)
    }
}

/// Replaces every lost policy replica of `controllers` (one per head) with a new one on
/// a surviving node that takes a surviving replica's trainer state, then rebuilds the
/// ring. Refuses (with the way to resume) when every replica is lost.
///
/// A replica can die after its peers finished the ring with its gradients and took the
/// step's update, before it answered: no exchange closes that window, since whichever
/// message commits the update, a replica can die just after it. The survivors are then
/// one version past `before`. That update is kept: every replica (replacements and any
/// survivor still at `before`) takes the newest survivor's state, and each head is
/// marked [`Controller::update_committed`] so that the step runs again for its ledger
/// without a second update. Returns what moved.
pub(crate) async fn replace_lost_replicas(
    job: &JobConfig,
    text: &str,
    node: &Node,
    controllers: &mut [Controller],
    before: &[ControllerState],
    lost: &BTreeSet<ActorId>,
    hosting: &mut Hosting,
) -> Result<Vec<String>, JobError> {
    let heads: Vec<usize> = (0..controllers.len())
        .filter(|&i| lost.contains(controllers[i].roles.policy.id()))
        .collect();
    if heads.is_empty() {
        return Ok(Vec::new());
    }
    let survivors: Vec<usize> = (0..controllers.len())
        .filter(|i| !heads.contains(i))
        .collect();
    if survivors.is_empty() {
        let gone: Vec<String> = controllers
            .iter()
            .map(|c| c.roles.policy.id().to_string())
            .collect();
        return Err(JobError::Recovery {
            what: format!(
                "every policy replica was lost ({}): no surviving replica holds the trainer state",
                gone.join(", ")
            ),
            fix: RESUME.into(),
        });
    }
    let t = job_timeouts(job).sync;
    let want = before[survivors[0]].weights_version;
    // Every survivor's version (from its state): with more than two replicas, some may
    // have taken the update and others not.
    let mut states = Vec::with_capacity(survivors.len());
    for &i in &survivors {
        let source = controllers[i].roles.policy.clone();
        let state = export_state(&source, t).await?;
        let at = survivor_version(&source, &state, want)?;
        states.push((i, at, state));
    }
    let newest = states.iter().map(|(_, at, _)| *at).max().unwrap_or(want);
    let (_, _, state) = states
        .iter()
        .find(|(_, at, _)| *at == newest)
        .expect("one survivor at least");
    let state = state.clone();
    let mut moved = Vec::new();
    for (i, at, _) in &states {
        if *at != newest {
            import_state(&controllers[*i].roles.policy, state.clone(), t).await?;
            tracing::info!(
                replica = i,
                version = newest,
                "a surviving policy replica caught up with its peers"
            );
        }
    }
    for i in heads {
        let target = hosting.pick_replica(lost)?;
        let new: PolicyRef = spawn(job, text, node, "policy", &target, None).await?;
        import_state(&new, state.clone(), t).await?;
        let old = controllers[i].roles.policy.id().name.node.clone();
        moved.push(format!("policy replica {i}: {old} -> {target}"));
        controllers[i].roles.policy = new;
    }
    join_policy_ring(controllers, RING_CHUNK_BYTES).await?;
    if newest == want + 1 {
        tracing::warn!(
            version = newest,
            "the lost step's update was taken before the replica died: it is kept, and the step runs again without it"
        );
        for c in controllers.iter_mut() {
            c.update_committed = Some(newest);
        }
    }
    Ok(moved)
}

/// A policy's whole trainer state (weights, optimizer, step), as bytes.
pub(crate) async fn export_state(src: &PolicyRef, t: Duration) -> Result<TrainerState, JobError> {
    match ask(src, PolicyRequest::ExportState, t).await? {
        PolicyResponse::State(s) => Ok(s),
        other => Err(answered(src, "ExportState", &other)),
    }
}

/// Has `dst` replace its trainer with `state` (another replica's [`export_state`]).
pub(crate) async fn import_state(
    dst: &PolicyRef,
    state: TrainerState,
    t: Duration,
) -> Result<(), JobError> {
    match ask(dst, PolicyRequest::ImportState(state), t).await? {
        PolicyResponse::Imported => Ok(()),
        other => Err(answered(dst, "ImportState", &other)),
    }
}

async fn ask(
    p: &PolicyRef,
    request: PolicyRequest,
    t: Duration,
) -> Result<PolicyResponse, JobError> {
    match p.ask(RoleRequest::Serve(request), t).await {
        Ok(RoleResponse::Served(r)) => Ok(r),
        Ok(other) => Err(JobError::Placement {
            what: format!("{} answered {}", p.id(), variant(&other)),
            fix: "see the nodes' logs".into(),
        }),
        Err(source) => Err(ControllerError::Call {
            step: 0,
            stage: "policy_state_hand_off",
            role: "policy",
            source,
        }
        .into()),
    }
}

fn answered(p: &PolicyRef, asked: &str, got: &PolicyResponse) -> JobError {
    let got: String = format!("{got:?}").chars().take(120).collect();
    JobError::Placement {
        what: format!("{} answered {asked} with {got}", p.id()),
        fix: "see the nodes' logs".into(),
    }
}

/// The version of a surviving replica `source`, whose exported state is `state`, after
/// a step that started at version `want` failed: `want`, or `want + 1` when it took the
/// step's update before a peer died. Anything else cannot be reconciled.
pub(crate) fn survivor_version(
    source: &PolicyRef,
    state: &TrainerState,
    want: u64,
) -> Result<u64, JobError> {
    let at = state_step(state)?;
    if at != want && at != want + 1 {
        return Err(JobError::Recovery {
            what: format!(
                "policy replica {} is at version {at}, but the failed step started at version {want}",
                source.id()
            ),
            fix: RESUME.into(),
        });
    }
    Ok(at)
}

/// The optimizer steps a trainer state has taken (its `trainer_state.json`): the
/// policy's version.
fn state_step(state: &TrainerState) -> Result<u64, JobError> {
    let bad = |why: String| JobError::Recovery {
        what: format!("a policy replica's exported state: {why}"),
        fix: "see the nodes' logs".into(),
    };
    let (_, json) = state
        .files
        .iter()
        .find(|(n, _)| n == "trainer_state.json")
        .ok_or_else(|| bad("it has no trainer_state.json".into()))?;
    let v: serde_json::Value = serde_json::from_slice(json).map_err(|e| bad(e.to_string()))?;
    v["step"]
        .as_u64()
        .ok_or_else(|| bad("trainer_state.json has no step".into()))
}
