//! Serving and sending the system protocol between nodes.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::spawn_tickets::Finished;
use super::state::Node;
use crate::actor::{CallError, ExitReason};
use crate::addr::{ActorId, ActorName};
use crate::cert_kind::CertKind;
use crate::directory::{Change, DirectoryError, Liveness};
use crate::leadership::{admit, judge_beat, Admission, Beat, BeatReply, Lead};
use crate::membership::{DeviceClaim, Membership, NodeInfo};
use crate::message::{Message, Wire};
use crate::transport::Target;

impl Node {
    pub(super) async fn system_call(
        &self,
        node: &str,
        req: SysRequest,
    ) -> Result<SysResponse, NodeError> {
        self.system_call_within(node, req, self.inner.config.system_timeout)
            .await
    }

    pub(super) async fn system_call_within(
        &self,
        node: &str,
        req: SysRequest,
        timeout: Duration,
    ) -> Result<SysResponse, NodeError> {
        let wire = req
            .into_wire()
            .map_err(|e| CallError::Codec(e.to_string()))?;
        let reply = self
            .inner
            .transport
            .ask(node, Target::System, wire, timeout)
            .await?;
        Ok(SysResponse::from_wire(reply).map_err(|e| CallError::Codec(e.to_string()))?)
    }

    pub(super) async fn system_tell(&self, node: &str, req: SysRequest) {
        let Ok(wire) = req.into_wire() else { return };
        if let Err(e) = self
            .inner
            .transport
            .tell(node, Target::System, wire, true)
            .await
        {
            tracing::debug!(%node, error = %e, "system message not sent");
        }
    }

    pub(super) async fn system_ask(
        &self,
        from: &str,
        kind: CertKind,
        wire: Wire,
    ) -> Result<Wire, CallError> {
        let req = SysRequest::from_wire(wire).map_err(|e| CallError::Codec(e.to_string()))?;
        self.handle_system(from, kind, req)
            .await
            .into_wire()
            .map_err(|e| CallError::Codec(e.to_string()))
    }

    /// Serves a system request from `from`, whose certificate is of kind `kind` (this
    /// node's own requests come with its own kind).
    pub(super) async fn handle_system(
        &self,
        from: &str,
        kind: CertKind,
        req: SysRequest,
    ) -> SysResponse {
        let dir = &self.inner.directory;
        match req {
            SysRequest::Join { mut info, hosted } => {
                // What the member may do is what its certificate says, not what it says.
                info.kind = kind;
                self.handle_join(from, info, hosted).await
            }
            SysRequest::Heartbeat(beat) => self.handle_beat(beat),
            SysRequest::Update(update) => {
                let lead = self.lead();
                if update.term > lead.term {
                    if !kind.may_lead() {
                        self.refused(from, kind, "to lead the directory");
                        return SysResponse::Error(format!(
                            "{from} holds a {kind} certificate, which may not lead the directory"
                        ));
                    }
                    // The first word of a new term (or a deposed leader's replica is
                    // behind): follow its leader, who sends its directory.
                    self.follow(Lead {
                        term: update.term,
                        leader: from.to_string(),
                    });
                    return SysResponse::Ack;
                }
                if update.term < lead.term || from != lead.leader {
                    return SysResponse::Ack; // a deposed leader's; its heartbeat learns
                }
                match dir.apply_update(&update) {
                    Ok(true) => self.follow_update(&update),
                    Ok(false) => {}
                    Err(DirectoryError::Gap { .. } | DirectoryError::Term { .. }) => {
                        let node = self.clone();
                        tokio::spawn(async move { node.resync().await });
                    }
                    Err(e) => {
                        tracing::warn!(node = %self.name(), error = %e, "a directory update did not apply")
                    }
                }
                SysResponse::Ack
            }
            SysRequest::Propose(change) => {
                if !self.is_leader() {
                    return self.redirect();
                }
                if let Err(e) = own_change(from, &change) {
                    self.refused(from, kind, "to change another node's directory entries");
                    return SysResponse::Error(e);
                }
                match dir.apply(change) {
                    Ok(Some(update)) => {
                        self.broadcast(update).await;
                        SysResponse::Ack
                    }
                    Ok(None) => SysResponse::Ack,
                    Err(e) => SysResponse::Error(e.to_string()),
                }
            }
            SysRequest::Snapshot => SysResponse::Directory(dir.snapshot()),
            SysRequest::LeaderCheck { leader } => {
                let lead = self.lead();
                let hears = leader == self.name()
                    || (lead.leader == leader && self.recently_heard(&leader));
                SysResponse::LeaderSeen {
                    lead,
                    hears,
                    version: dir.read(|d| d.version()),
                }
            }
            SysRequest::Spawn {
                role,
                replica,
                args,
                linked,
                ticket,
            } => {
                if !kind.may_spawn() && from != self.name() {
                    self.refused(from, kind, "to spawn actors on other nodes");
                    return SysResponse::Error(format!(
                        "node {} refuses to spawn {role} for {from}: {from} holds a {kind} certificate, which may not spawn actors on other nodes; a program that places roles needs a trainer certificate (`yatt-node cert --kind trainer --name {from}`)",
                        self.name()
                    ));
                }
                if self.inner.stopping.load(Ordering::Acquire) {
                    return SysResponse::Error(format!("node {} is shutting down", self.name()));
                }
                if let Membership::Rejoining { reason } = self.membership() {
                    return SysResponse::Error(format!(
                        "node {} is rejoining the cluster (it was declared dead: {reason}); spawn on it again once it has rejoined",
                        self.name()
                    ));
                }
                let Some(factory) = self.inner.factories.get(&role).cloned() else {
                    return SysResponse::Error(format!(
                        "no factory:{}",
                        self.factory_roles().join(",")
                    ));
                };
                let replica = replica.unwrap_or_else(|| self.next_free_replica(&role));
                let name = match ActorName::new(self.name(), &role, replica) {
                    Ok(n) => n,
                    Err(e) => return SysResponse::Error(e.to_string()),
                };
                if !self.lock_spawn_tickets().begin(from, ticket) {
                    return SysResponse::Error(format!(
                        "{from} cancelled its spawn of {role} before it started"
                    ));
                }
                match factory(self, name, &args).await {
                    Ok(id) => {
                        if linked && from != self.name() {
                            if let Some(h) = self.lock_hosted().get_mut(&id.name) {
                                h.owner = Some(from.to_string());
                            }
                        }
                        if self.lock_spawn_tickets().finish(from, ticket, &id) == Finished::Undo {
                            self.release_cancelled_spawn(from, &id);
                            return SysResponse::Error(format!(
                                "{from} cancelled its spawn of {id} while it started; it is released"
                            ));
                        }
                        // Answer once the leader has the registration, so the caller
                        // can resolve it right away.
                        let want = id.clone();
                        dir.wait_until(self.inner.config.system_timeout, |d| {
                            d.resolve(&want.name) == Some(&want)
                        })
                        .await;
                        SysResponse::Spawned(id)
                    }
                    Err(e) => SysResponse::Error(e),
                }
            }
            SysRequest::CancelSpawn { ticket } => {
                self.cancel_spawn_of(from, ticket);
                SysResponse::Ack
            }
            SysRequest::Leave { node } => {
                if !self.is_leader() {
                    return self.redirect();
                }
                if node != from {
                    return SysResponse::Error(format!(
                        "{from} cannot announce that {node} leaves; only {node} can"
                    ));
                }
                self.lock_detector().forget(&node);
                let change = Change::NodeDown {
                    node,
                    reason: ExitReason::Normal,
                };
                if let Ok(Some(update)) = dir.apply(change) {
                    self.broadcast(update).await;
                }
                SysResponse::Ack
            }
        }
    }

    /// Logs a request its sender's certificate does not allow (throttled per sender:
    /// a misbehaving member must not fill the log).
    fn refused(&self, from: &str, kind: CertKind, what: &str) {
        if let Some(suppressed) = self
            .inner
            .refusals
            .admit(from.to_string(), std::time::Instant::now())
        {
            tracing::warn!(node = %self.name(), %from, %kind, suppressed, "refused a request: a {kind} certificate does not allow {what} (suppressed: refusals of this member not logged in the last 10 s)");
        }
    }

    /// Not the leader: where the leader is (the member expected to take over, while the
    /// leader is silent).
    pub(super) fn redirect(&self) -> SysResponse {
        let mut lead = self.lead();
        if let Some(next) = self.lock_succession().awaiting() {
            lead = Lead {
                term: lead.term + 1,
                leader: next.to_string(),
            };
        }
        let addr = self.addr_of(&lead.leader);
        SysResponse::Redirect { lead, addr }
    }

    /// Whether `node` was heard from within half the failure bound: a member that died
    /// with the candidate watching has been silent about a whole bound everywhere.
    fn recently_heard(&self, node: &str) -> bool {
        let half = self.inner.config.failure_timeout / 2;
        self.lock_detector()
            .silent_for(node, Instant::now())
            .is_some_and(|s| s <= half)
    }

    /// Leader: a node joins, rejoins under a new incarnation, or (same incarnation)
    /// reports what it hosts after a leader change.
    async fn handle_join(
        &self,
        from: &str,
        info: NodeInfo,
        hosted: Vec<(ActorId, Option<DeviceClaim>)>,
    ) -> SysResponse {
        if !self.is_leader() {
            return self.redirect();
        }
        if info.name != from {
            return SysResponse::Error(format!(
                "certificate says {from:?} but join says {:?}",
                info.name
            ));
        }
        let dir = &self.inner.directory;
        let bound = self.inner.config.failure_timeout;
        let silent_for = if info.name == self.name() {
            Some(Duration::ZERO) // the leader itself is alive
        } else {
            self.lock_detector().silent_for(&info.name, Instant::now())
        };
        let admission = dir.read(|d| admit(d, &info, silent_for, bound));
        let changes: Vec<Change> = match admission {
            Admission::Admit => {
                tracing::info!(node = %info.name, incarnation = info.incarnation, "node joins");
                // An old life still listed alive (silent past the bound, not yet declared
                // dead) goes through the node-down path first: its linked actors are
                // released everywhere.
                let old_alive = dir.read(|d| {
                    d.node(&info.name)
                        .is_some_and(|e| e.liveness == Liveness::Alive)
                });
                let mut changes = Vec::new();
                if old_alive {
                    changes.push(Change::NodeDown {
                        node: info.name.clone(),
                        reason: ExitReason::NodeDown(format!(
                            "replaced by incarnation {}",
                            info.incarnation
                        )),
                    });
                }
                changes.push(Change::NodeUp(info.clone()));
                changes
            }
            Admission::Known => hosted
                .into_iter()
                .filter(|(id, _)| id.name.node == info.name)
                .map(|(id, claim)| Change::ActorUp { id, claim })
                .collect(),
            Admission::Dead { reason } => {
                return SysResponse::Expelled {
                    reason: format!(
                        "incarnation {} of {} was declared dead: {reason}",
                        info.incarnation, info.name
                    ),
                }
            }
            Admission::NameInUse {
                incarnation,
                silent_for,
            } => {
                let addr = dir
                    .read(|d| d.node(&info.name).map(|e| e.info.addr))
                    .unwrap_or(info.addr);
                tracing::warn!(node = %info.name, joining = info.incarnation, live = incarnation, "refused a join: the name belongs to a live member");
                return SysResponse::NameInUse {
                    incarnation,
                    addr,
                    silent_for_ms: silent_for.as_millis() as u64,
                    bound_ms: bound.as_millis() as u64,
                };
            }
        };
        self.lock_detector().heard(&info.name, Instant::now());
        for change in changes {
            match dir.apply(change) {
                Ok(Some(update)) => self.broadcast(update).await,
                Ok(None) => {}
                Err(e) => return SysResponse::Error(e.to_string()),
            }
        }
        SysResponse::Joined {
            lead: self.lead(),
            directory: dir.snapshot(),
        }
    }

    /// A heartbeat: judged by term and incarnation (see `crate::leadership::judge_beat`).
    fn handle_beat(&self, beat: Beat) -> SysResponse {
        if !self.is_member() {
            return SysResponse::Beat(BeatReply::Ok);
        }
        let lead = self.lead();
        if lead.term == 0 {
            // Not joined yet: a restarted node under a member's name gets the beats
            // meant for its dead earlier life. Following them would make it lead that
            // life's term, and an Ok would tell the sender the dead life is heard. A
            // term-0 lead answers neither: the sender neither follows nor counts it.
            return SysResponse::Beat(BeatReply::Follow(lead));
        }
        let outcome = self
            .inner
            .directory
            .read(|d| judge_beat(self.name(), &lead, d, &beat));
        if let Some(newer) = outcome.follow.clone() {
            self.follow(newer);
        }
        if outcome.heard {
            self.lock_detector().heard(&beat.node, Instant::now());
            let mut succession = self.lock_succession();
            if beat.node == lead.leader && succession.in_progress() && outcome.follow.is_none() {
                tracing::info!(node = %self.name(), leader = %lead.leader, "the leader is heard again");
                succession.settle();
            }
        }
        SysResponse::Beat(outcome.reply)
    }

    pub(super) fn next_free_replica(&self, role: &str) -> u32 {
        loop {
            let r = self.inner.next_replica.fetch_add(1, Ordering::Relaxed);
            let taken = ActorName::new(self.name(), role, r)
                .map(|n| self.lock_hosted().contains_key(&n))
                .unwrap_or(false);
            if !taken {
                return r;
            }
        }
    }
}

/// Whether `from` may propose `change`: a member records only its own actors; nodes
/// join, leave and die through the leader's own paths.
fn own_change(from: &str, change: &Change) -> Result<(), String> {
    match change {
        Change::ActorUp { id, .. } | Change::ActorClaim { id, .. } | Change::ActorDown { id, .. }
            if id.name.node == from =>
        {
            Ok(())
        }
        Change::ActorUp { id, .. } | Change::ActorClaim { id, .. } | Change::ActorDown { id, .. } => Err(format!(
            "{from} may not record a change to {id}, an actor of {}: a member records only its own actors",
            id.name.node
        )),
        Change::NodeUp(info) => Err(format!(
            "{from} may not propose that {} joins: a node joins by itself",
            info.name
        )),
        Change::NodeDown { node, .. } => Err(format!(
            "{from} may not propose that {node} is down: the leader declares deaths, and a node announces its own leave"
        )),
    }
}
