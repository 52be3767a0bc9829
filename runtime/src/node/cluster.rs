//! Cluster membership from a node's side: joining (through any member, following
//! redirects to the leader), heartbeats, failure detection, following the leader's
//! directory, leaving. Fail-over and rejoining are in `failover.rs`.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::state::{Hosted, Node};
use crate::actor::{CallError, ExitReason};
use crate::addr::{ActorId, ActorName};
use crate::directory::{Change, Directory, Liveness, Update};
use crate::leadership::{describe, Beat, BeatReply, Lead};
use crate::membership::{FailureDetector, Membership};

/// Redirects a join follows before it gives up on a seed.
const MAX_REDIRECTS: usize = 4;

/// Why one attempt to join failed.
enum JoinFailure {
    /// Worth another try (a member unreachable, no leader yet).
    Retry(NodeError),
    /// The name belongs to a live member: another try helps only once that member has
    /// been declared dead, so tries go on for one failure bound.
    NameInUse(NodeError),
    /// No retry helps (e.g. the certificate does not match the name).
    Final(NodeError),
}

impl Node {
    pub(super) fn lock_detector(&self) -> std::sync::MutexGuard<'_, FailureDetector> {
        self.inner
            .detector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Side effects of a directory change on this node: forget dead peers and release
    /// the actors they owned; notice that its own incarnation or its leader is gone.
    pub(super) fn follow_update(&self, update: &Update) {
        if let Change::NodeDown { node, reason } = &update.change {
            self.node_gone(node, *reason == ExitReason::Normal);
        }
        self.check_own_entry();
    }

    /// `node` left (`left`: on its own, announced) or was declared dead (seen in an
    /// update or a snapshot).
    pub(super) fn node_gone(&self, node: &str, left: bool) {
        if node == self.name() {
            return;
        }
        match left {
            true => (self.inner.transport).forget_departed(node, self.inner.config.system_timeout),
            false => self.inner.transport.forget(node),
        }
        self.release_owned_by(node);
        if node == self.leader() && !self.is_leader() {
            // The leader announced its own departure (graceful leave).
            self.leader_lost(node, true);
        }
    }

    /// Drops this node's references to the actors `owner` spawned linked; each stops
    /// when its last reference is gone, and its exit is recorded in the directory.
    pub(super) fn release_owned_by(&self, owner: &str) {
        let released: Vec<Hosted> = {
            let mut hosted = self.lock_hosted();
            let names: Vec<ActorName> = hosted
                .iter()
                .filter(|(_, h)| h.owner.as_deref() == Some(owner))
                .map(|(n, _)| n.clone())
                .collect();
            names.iter().filter_map(|n| hosted.remove(n)).collect()
        };
        for h in released {
            tracing::info!(actor = %h.id, %owner, "its owner left the cluster: releasing it");
        }
    }

    /// `caller` gave up on its spawn `ticket` here: releases the actor if the spawn is
    /// done, else marks it to be undone when it finishes (see `spawn_tickets.rs`).
    pub(super) fn cancel_spawn_of(&self, caller: &str, ticket: u64) {
        let done = self.lock_spawn_tickets().cancel(caller, ticket);
        if let Some(id) = done {
            self.release_cancelled_spawn(caller, &id);
        }
    }

    /// Drops this node's reference to `id`, whose spawn `caller` gave up on (see
    /// `spawn_tickets.rs`); it stops when its last reference is gone.
    pub(super) fn release_cancelled_spawn(&self, caller: &str, id: &ActorId) {
        let released = {
            let mut hosted = self.lock_hosted();
            match hosted.get(&id.name) {
                Some(h) if h.id == *id => hosted.remove(&id.name),
                _ => None,
            }
        };
        if released.is_some() {
            tracing::info!(actor = %id, %caller, "its caller gave up on the spawn: releasing it");
        }
    }

    /// Leader: sends an update to every alive member, in order.
    pub(super) async fn broadcast(&self, update: Update) {
        self.follow_update(&update);
        self.send_to_members(update).await;
    }

    /// Leader: sends an update it already follows to every alive member.
    async fn send_to_members(&self, update: Update) {
        let members = self.alive_members();
        let sends = members.into_iter().map(|m| {
            let node = self.clone();
            let update = update.clone();
            async move { node.system_tell(&m, SysRequest::Update(update)).await }
        });
        futures::future::join_all(sends).await;
    }

    /// The alive members other than this node, in name order.
    pub(super) fn alive_members(&self) -> Vec<String> {
        self.inner.directory.read(|d| {
            d.alive_nodes()
                .filter(|n| n.name != self.name())
                .map(|n| n.name.clone())
                .collect()
        })
    }

    /// Where `node` is, when the directory holds it alive.
    pub(super) fn addr_of(&self, node: &str) -> Option<SocketAddr> {
        self.inner.directory.read(|d| {
            d.node(node)
                .filter(|e| e.liveness == Liveness::Alive)
                .map(|e| e.info.addr)
        })
    }

    /// Joins through the first of `seeds` that answers, following redirects to the
    /// leader; tries again until `deadline` (and, while the name belongs to a live member,
    /// until that member would have been declared dead).
    pub(super) async fn join_through(
        &self,
        seeds: &[SocketAddr],
        deadline: Instant,
    ) -> Result<(), NodeError> {
        let pause = self.inner.config.heartbeat_interval;
        let bound = self.inner.config.failure_timeout;
        let mut deadline = deadline;
        let mut name_deadline: Option<Instant> = None;
        let mut last = NodeError::Join {
            seed: self.addr(),
            reason: "no member address to join through (give a seed)".into(),
        };
        loop {
            for &seed in seeds {
                match self.join_once(seed).await {
                    Ok(()) => return Ok(()),
                    Err(JoinFailure::Final(e)) => return Err(e),
                    Err(JoinFailure::Retry(e)) => last = e,
                    Err(JoinFailure::NameInUse(e)) => {
                        // The holder may be a crashed life of this node that the leader
                        // has not declared dead yet: wait out one bound, no longer (a
                        // holder still heard from after that is a live duplicate).
                        deadline = *name_deadline.get_or_insert(Instant::now() + bound + 2 * pause);
                        last = e;
                        break;
                    }
                }
            }
            if Instant::now() + pause >= deadline {
                return Err(last);
            }
            tokio::time::sleep(pause).await;
        }
    }

    async fn join_once(&self, seed: SocketAddr) -> Result<(), JoinFailure> {
        let fail = |reason: String| NodeError::Join { seed, reason };
        let mut addr = seed;
        for _ in 0..MAX_REDIRECTS {
            let member = self
                .inner
                .transport
                .connect_seed(addr)
                .await
                .map_err(|e| JoinFailure::Retry(fail(e.to_string())))?;
            // Another process under this name goes on (it redirects, and the leader
            // refuses the name); this very node cannot be its own seed.
            if member == self.name() && addr == self.addr() {
                return Err(JoinFailure::Final(fail(format!(
                    "{addr} is this node ({member}) itself; give the address of another member"
                ))));
            }
            let request = SysRequest::Join {
                info: self.info(),
                hosted: Vec::new(),
            };
            let reply = self
                .system_call(&member, request)
                .await
                .map_err(|e| JoinFailure::Retry(fail(format!("{member} at {addr}: {e}"))))?;
            match reply {
                SysResponse::Joined { lead, directory } => {
                    // The lead first: the directory may show the old leader gone.
                    self.adopt_lead(lead);
                    self.install_directory(directory, true);
                    return Ok(());
                }
                SysResponse::Redirect {
                    lead,
                    addr: Some(next),
                } => {
                    tracing::info!(node = %self.name(), via = %member, leader = %lead.leader, term = lead.term, "joining through the leader");
                    addr = next;
                }
                SysResponse::Redirect { lead, addr: None } => {
                    return Err(JoinFailure::Retry(fail(format!(
                        "{member} is not the leader and does not know where {} (term {}) is",
                        lead.leader, lead.term
                    ))))
                }
                SysResponse::NameInUse {
                    incarnation,
                    addr: holder,
                    silent_for_ms,
                    bound_ms,
                } => {
                    return Err(JoinFailure::NameInUse(NodeError::NameInUse {
                        name: self.name().to_string(),
                        incarnation,
                        addr: holder,
                        silent_for: Duration::from_millis(silent_for_ms),
                        bound: Duration::from_millis(bound_ms),
                    }))
                }
                SysResponse::Expelled { reason } => {
                    return Err(JoinFailure::Retry(fail(format!(
                        "{member} holds this incarnation dead: {reason}"
                    ))))
                }
                SysResponse::Error(e) => return Err(JoinFailure::Final(fail(e))),
                other => {
                    return Err(JoinFailure::Final(fail(format!(
                        "unexpected answer {other:?}"
                    ))))
                }
            }
        }
        Err(JoinFailure::Retry(fail(format!(
            "more than {MAX_REDIRECTS} redirects; the members disagree on the leader"
        ))))
    }

    /// Follows `lead` as the result of a join: the leader is now the only peer watched.
    fn adopt_lead(&self, lead: Lead) {
        let leader = lead.leader.clone();
        *self.lock_lead() = lead;
        self.lock_succession().settle();
        self.lock_detector()
            .watch_only([leader.as_str()], Instant::now());
    }

    /// Installs a leader's directory (`force`: even when older than the replica, as after
    /// a join), with the side effects of the nodes it shows gone.
    pub(super) fn install_directory(&self, directory: Directory, force: bool) {
        let departed = if force {
            Some(self.inner.directory.replace(directory))
        } else {
            self.inner.directory.reset(directory)
        };
        for node in departed.unwrap_or_default() {
            self.node_gone(&node, false);
        }
        self.check_own_entry();
    }

    /// Expels this node when the directory holds its incarnation dead.
    pub(super) fn check_own_entry(&self) {
        if self.is_stopping() || !self.is_member() {
            return;
        }
        let incarnation = self.incarnation();
        let dead = self.inner.directory.read(|d| {
            d.node(self.name()).and_then(|e| match &e.liveness {
                Liveness::Dead(r) if e.info.incarnation == incarnation => Some(describe(r)),
                _ => None,
            })
        });
        if let Some(reason) = dead {
            self.expel(reason);
        }
    }

    pub(super) async fn resync(&self) {
        let leader = self.leader();
        if let Ok(SysResponse::Directory(d)) = self.system_call(&leader, SysRequest::Snapshot).await
        {
            self.install_directory(d, false);
        }
    }

    pub(super) async fn heartbeat_loop(self) {
        let mut shutdown = self.inner.shutdown.subscribe();
        let mut tick = tokio::time::interval(self.inner.config.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Silence is checked more often than heartbeats are sent, so detection takes
        // at most failure_timeout plus this, not plus a whole heartbeat period.
        let mut check = tokio::time::interval(self.check_interval());
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                // Checked first: after a stall, this node's pause is noticed before its
                // peers' apparent silence is judged.
                biased;
                _ = shutdown.changed() => return,
                _ = check.tick() => self.check_peers().await,
                _ = tick.tick() => self.send_heartbeats(),
            }
        }
    }

    pub(super) fn check_interval(&self) -> Duration {
        self.inner
            .config
            .heartbeat_interval
            .min(Duration::from_millis(100))
    }

    pub(super) fn send_heartbeats(&self) {
        if !self.is_member() {
            return;
        }
        let lead = self.lead();
        let beat = SysRequest::Heartbeat(Beat {
            node: self.name().to_string(),
            incarnation: self.incarnation(),
            lead: lead.clone(),
        });
        let targets: Vec<String> = if lead.leader == self.name() {
            self.alive_members()
        } else {
            let succession = self.lock_succession();
            if succession.in_progress() {
                // The leader is silent. The next in line answers with the new term once
                // it leads (its replica may lack this node, so it might not call).
                succession
                    .awaiting()
                    .map(String::from)
                    .into_iter()
                    .collect()
            } else {
                vec![lead.leader.clone()]
            }
        };
        let within = self.inner.config.failure_timeout;
        for t in targets {
            let (node, beat, lead) = (self.clone(), beat.clone(), lead.clone());
            tokio::spawn(async move {
                let sent = Instant::now();
                let mut reply = node.system_call_within(&t, beat.clone(), within).await;
                // Lost with its connection (the peer closed it: it declared this node
                // dead while it stood still): send it again at once, on a new one.
                let lost = matches!(&reply, Err(NodeError::Call(CallError::Transport { .. })));
                if lost && sent.elapsed() < node.inner.config.heartbeat_interval {
                    reply = node.system_call_within(&t, beat, within).await;
                }
                if let Ok(SysResponse::Beat(reply)) = reply {
                    node.on_beat_reply(&t, &lead, reply);
                }
            });
        }
    }

    /// What `to` answered to the heartbeat this node sent while following `sent`.
    fn on_beat_reply(&self, to: &str, sent: &Lead, reply: BeatReply) {
        let lead = self.lead();
        if lead != *sent || !self.is_member() {
            return;
        }
        match reply {
            BeatReply::Ok => {
                let mut detector = self.lock_detector();
                let now = Instant::now();
                if detector.silent_for(to, now).is_some() {
                    detector.heard(to, now);
                }
            }
            BeatReply::Follow(newer) => self.follow(newer),
            BeatReply::Dead { reason } if to == lead.leader => self.expel(reason),
            BeatReply::Dead { .. } => {}
        }
    }

    /// On the check timer: notice this node's own stall, then its peers' silence.
    pub(super) async fn check_peers(&self) {
        let now = Instant::now();
        let stalled = self
            .inner
            .pause
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tick(now);
        if let Some(stall) = stalled {
            tracing::warn!(node = %self.name(), ?stall, "this node stood still: its peers get a fresh failure bound instead of being judged by its own silence");
            self.lock_detector().restart_all(now);
            return;
        }
        if !self.is_member() || self.is_stopping() {
            return;
        }
        let lead = self.lead();
        let expired = self.lock_detector().expired(now);
        if lead.leader == self.name() {
            self.declare_dead(expired);
        } else if expired.contains(&lead.leader) {
            tracing::warn!(node = %self.name(), leader = %lead.leader, term = lead.term, timeout = ?self.inner.config.failure_timeout, "the directory's leader is silent");
            self.leader_lost(&lead.leader, false);
        } else {
            let step = {
                let dir = self.inner.directory.snapshot();
                let patience = self.succession_patience();
                self.lock_succession()
                    .tick(&dir, self.name(), now, patience)
            };
            self.run_step(step);
        }
    }

    /// Leader: declares silent members dead. The directory changes at once; the
    /// updates go out from a task of their own, in order. Sent from here, they held up
    /// the heartbeat loop: a member killed in the same moment has no connection, and
    /// the handshake to it waits out its deadline, long enough for every member to find
    /// the leader silent and elect another.
    fn declare_dead(&self, silent: Vec<String>) {
        let mut updates = Vec::new();
        for node in silent {
            tracing::warn!(%node, timeout = ?self.inner.config.failure_timeout, "peer silent: declaring it dead");
            let change = Change::NodeDown {
                node: node.clone(),
                reason: ExitReason::NodeDown(format!(
                    "no heartbeat for {:?}",
                    self.inner.config.failure_timeout
                )),
            };
            if let Ok(Some(update)) = self.inner.directory.apply(change) {
                self.follow_update(&update);
                updates.push(update);
            }
        }
        if updates.is_empty() {
            return;
        }
        let leader = self.clone();
        tokio::spawn(async move {
            for update in updates {
                leader.send_to_members(update).await;
            }
        });
    }

    /// Graceful shutdown: refuse new work, drain in-flight requests (bounded), leave
    /// the cluster, close connections.
    pub async fn shutdown(&self) {
        if self.inner.stopping.swap(true, Ordering::AcqRel) {
            return;
        }
        tracing::info!(node = %self.name(), "shutting down: draining");
        self.inner.transport.stop_accepting();
        let drained = tokio::time::timeout(self.inner.config.drain_timeout, async {
            while self.in_flight() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        if drained.is_err() {
            tracing::warn!(
                in_flight = self.in_flight(),
                "drain timed out; closing anyway"
            );
        }
        let _ = self.inner.shutdown.send(true);
        if self.is_leader() {
            // The members see their leader leave and the next in line takes over at
            // once. Asked, not told: a told update still queued when the endpoint
            // closes is lost, and the members would wait out the failure bound.
            if let Ok(Some(update)) = self.inner.directory.apply(Change::NodeDown {
                node: self.name().to_string(),
                reason: ExitReason::Normal,
            }) {
                let within = self.inner.config.system_timeout;
                let asks = self.alive_members().into_iter().map(|m| {
                    let (node, update) = (self.clone(), update.clone());
                    async move {
                        node.system_call_within(&m, SysRequest::Update(update), within)
                            .await
                    }
                });
                futures::future::join_all(asks).await;
            }
        } else if self.is_member() {
            self.leave().await;
        }
        self.inner.transport.close().await;
        tracing::info!(node = %self.name(), "left the cluster");
    }

    /// Tells the leader this node leaves, following a redirect if the leader changed.
    async fn leave(&self) {
        let mut leader = self.leader();
        let request = SysRequest::Leave {
            node: self.name().to_string(),
        };
        for _ in 0..MAX_REDIRECTS {
            let reply = tokio::time::timeout(
                self.inner.config.system_timeout,
                self.system_call(&leader, request.clone()),
            )
            .await;
            match reply {
                Ok(Ok(SysResponse::Redirect { lead, .. })) if lead.leader != leader => {
                    leader = lead.leader;
                }
                Ok(Ok(_)) => return,
                Ok(Err(e)) => {
                    tracing::warn!(node = %self.name(), %leader, error = %e, "could not tell the leader this node leaves; it will be declared dead after the failure bound");
                    return;
                }
                Err(_) => return,
            }
        }
    }

    /// Whether this node is a member under its current incarnation.
    pub(super) fn is_member(&self) -> bool {
        *self.inner.membership.borrow() == Membership::Member
    }
}
