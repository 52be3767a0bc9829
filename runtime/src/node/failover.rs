//! Fail-over and rejoining, from a node's side: when the leader falls silent the next
//! member in join order checks that no one still hears it and leads the next term;
//! members follow whoever leads the newest term and report what they host to it; a node
//! that learns its own incarnation was declared dead stops what it hosted and rejoins
//! under a new incarnation. The decisions are `crate::leadership`'s; this file does the
//! I/O.

use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio::time::Instant;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::state::{Hosted, Node};
use crate::actor::ExitReason;
use crate::addr::{next_incarnation, ActorId};
use crate::directory::Change;
use crate::leadership::{Lead, Step, Succession};
use crate::membership::{DeviceClaim, Membership};

/// Changes kept for the next leader at most; older ones are dropped first.
const MAX_PENDING: usize = 4096;

/// What the members said when a candidate asked whether they still hear the leader.
enum Vote {
    /// Nobody reachable hears it; `ahead` holds a replica newer than the candidate's.
    Clear { ahead: Option<String> },
    /// This member still hears the leader: no fail-over.
    Vetoed(String),
    /// Someone already leads a newer term.
    Follow(Lead),
}

impl Node {
    pub(super) fn lock_lead(&self) -> std::sync::MutexGuard<'_, Lead> {
        self.inner.lead.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(super) fn lock_succession(&self) -> std::sync::MutexGuard<'_, Succession> {
        self.inner
            .succession
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// The leader this node follows, and its term.
    pub fn lead(&self) -> Lead {
        self.lock_lead().clone()
    }

    /// How long a member waits for the next in line to announce itself: the successor
    /// needs up to a failure bound (plus a check period) to notice the silence itself,
    /// and half a bound to ask the others.
    pub(super) fn succession_patience(&self) -> Duration {
        let bound = self.inner.config.failure_timeout;
        bound * 2 + self.check_interval() * 4
    }

    /// The leader fell silent (or `announced` its leave): start or go on with its
    /// succession.
    pub(super) fn leader_lost(&self, leader: &str, announced: bool) {
        if !self.is_member() || self.is_stopping() {
            return;
        }
        let step = {
            let dir = self.inner.directory.snapshot();
            let patience = self.succession_patience();
            self.lock_succession().leader_lost(
                &dir,
                self.name(),
                leader,
                announced,
                Instant::now(),
                patience,
            )
        };
        self.run_step(step);
    }

    pub(super) fn run_step(&self, step: Step) {
        match step {
            Step::Wait => {}
            Step::Await(next) => {
                let lead = self.lead();
                tracing::info!(node = %self.name(), silent = %lead.leader, %next, term = lead.term + 1, "waiting for the next member in join order to lead the directory");
                // Fail calls to the silent leader now rather than at their deadlines.
                self.inner.transport.forget(&lead.leader);
            }
            Step::TakeOver { depose, announced } => {
                if self.inner.electing.swap(true, Ordering::AcqRel) {
                    return;
                }
                let node = self.clone();
                tokio::spawn(async move {
                    node.elect(&depose, announced).await;
                    node.inner.electing.store(false, Ordering::Release);
                });
            }
        }
    }

    /// This node is next in line after `depose`: check with the others, then lead.
    async fn elect(&self, depose: &str, announced: bool) {
        if !announced {
            match self.ask_members(depose).await {
                Vote::Vetoed(by) => {
                    tracing::warn!(node = %self.name(), leader = %depose, %by, "another member still hears the leader: not taking over (this node may be cut off from it)");
                    self.lock_succession().settle();
                    self.lock_detector().heard(depose, Instant::now());
                    return;
                }
                Vote::Follow(lead) => {
                    self.follow(lead);
                    return;
                }
                Vote::Clear {
                    ahead: Some(member),
                } => {
                    // A member got updates the old leader sent before dying that this
                    // replica missed: start from its directory.
                    if let Ok(SysResponse::Directory(d)) =
                        self.system_call(&member, SysRequest::Snapshot).await
                    {
                        self.install_directory(d, false);
                    }
                }
                Vote::Clear { ahead: None } => {}
            }
        }
        if self.lead().leader != depose || !self.is_member() || self.is_stopping() {
            return; // someone else's term came first, or this node was expelled
        }
        if !announced && self.lock_detector().hears(depose, Instant::now()) {
            // It spoke again while the others were asked (it had stalled, not died).
            tracing::info!(node = %self.name(), leader = %depose, "the leader is heard again: not taking over");
            self.lock_succession().settle();
            return;
        }
        self.take_over(depose).await;
    }

    /// Asks every other live member whether it still hears `leader`.
    async fn ask_members(&self, leader: &str) -> Vote {
        let others: Vec<String> = self
            .alive_members()
            .into_iter()
            .filter(|m| m != leader)
            .collect();
        let within = self.inner.config.failure_timeout / 2;
        let asks = others.iter().map(|m| {
            let req = SysRequest::LeaderCheck {
                leader: leader.to_string(),
            };
            self.system_call_within(m, req, within)
        });
        let replies = futures::future::join_all(asks).await;
        let mine = self.lead();
        let mut newest = self.inner.directory.read(|d| d.version());
        let mut ahead = None;
        for (member, reply) in others.into_iter().zip(replies) {
            // An unreachable member may have died with the leader: it does not block.
            let Ok(SysResponse::LeaderSeen {
                lead,
                hears,
                version,
            }) = reply
            else {
                continue;
            };
            if lead.supersedes(&mine) && lead.leader != leader {
                return Vote::Follow(lead);
            }
            if lead == mine && hears {
                return Vote::Vetoed(member);
            }
            if version > newest {
                newest = version;
                ahead = Some(member);
            }
        }
        Vote::Clear { ahead }
    }

    /// Leads the next term: declares `depose` dead (its actors go through the normal
    /// node-down path) and announces the term to every member.
    async fn take_over(&self, depose: &str) {
        let term = {
            let mut lead = self.lock_lead();
            let term = lead.term.max(self.inner.directory.read(|d| d.term())) + 1;
            *lead = Lead {
                term,
                leader: self.name().to_string(),
            };
            term
        };
        self.inner.directory.begin_term(term);
        self.lock_succession().settle();
        let members: Vec<String> = self
            .alive_members()
            .into_iter()
            .filter(|m| m != depose)
            .collect();
        self.lock_detector()
            .watch_only(members.iter().map(String::as_str), Instant::now());
        tracing::warn!(node = %self.name(), deposed = %depose, term, "this node leads the directory now");
        let change = Change::NodeDown {
            node: depose.to_string(),
            reason: ExitReason::NodeDown(format!(
                "the directory's leader {depose} was silent for {:?}; {} leads term {term}",
                self.inner.config.failure_timeout,
                self.name()
            )),
        };
        if let Ok(Some(update)) = self.inner.directory.apply(change) {
            self.broadcast(update).await;
        }
        // Members learn of the term from the update above or, when the old leader had
        // already left, from this heartbeat.
        self.send_heartbeats();
        self.flush_pending().await;
    }

    /// Follows `lead` when it is newer than the one followed: watch the new leader only,
    /// and report to it what this node hosts.
    pub(super) fn follow(&self, lead: Lead) {
        let may_lead = self
            .inner
            .directory
            .read(|d| d.node(&lead.leader).is_none_or(|e| e.info.kind.may_lead()));
        if !may_lead {
            tracing::warn!(node = %self.name(), leader = %lead.leader, term = lead.term, "not following: its certificate does not let it lead the directory");
            return;
        }
        let was_leader = {
            let mut cur = self.lock_lead();
            if !lead.supersedes(&cur) {
                return;
            }
            let was = cur.held_by(self.name());
            *cur = lead.clone();
            was
        };
        if was_leader {
            tracing::warn!(node = %self.name(), leader = %lead.leader, term = lead.term, "a newer term leads the directory: stepping down");
        } else {
            tracing::info!(node = %self.name(), leader = %lead.leader, term = lead.term, "following a new leader");
        }
        self.lock_succession().settle();
        self.lock_detector()
            .watch_only([lead.leader.as_str()], Instant::now());
        let node = self.clone();
        tokio::spawn(async move { node.report_to(lead).await });
    }

    /// Reports this node and the actors it hosts to a new leader, which answers with its
    /// directory; sends it the changes the old leader did not take.
    async fn report_to(&self, lead: Lead) {
        for attempt in 0..3u32 {
            if self.lead() != lead || !self.is_member() {
                return;
            }
            let request = SysRequest::Join {
                info: self.info(),
                hosted: self.reachable_actors(),
            };
            match self.system_call(&lead.leader, request).await {
                Ok(SysResponse::Joined { directory, .. }) => {
                    self.install_directory(directory, false);
                    self.flush_pending().await;
                    return;
                }
                Ok(SysResponse::Expelled { reason }) => return self.expel(reason),
                Ok(SysResponse::Redirect { lead: newer, .. }) => return self.follow(newer),
                Ok(other) => {
                    tracing::warn!(node = %self.name(), leader = %lead.leader, answer = ?other, "the new leader refused this node's report");
                    return;
                }
                Err(e) => {
                    tracing::warn!(node = %self.name(), leader = %lead.leader, attempt, error = %e, "could not report to the new leader; trying again");
                }
            }
            tokio::time::sleep(self.inner.config.heartbeat_interval).await;
        }
    }

    /// The hosted actors peers can reach (those registered in the directory), with
    /// the devices each holds.
    fn reachable_actors(&self) -> Vec<(ActorId, Option<DeviceClaim>)> {
        let mut v: Vec<(ActorId, Option<DeviceClaim>)> = self
            .lock_hosted()
            .values()
            .filter(|h| h.inbox.is_some())
            .map(|h| (h.id.clone(), h.claim.clone()))
            .collect();
        v.sort_by(|a, b| a.0.cmp(&b.0));
        v
    }

    /// Keeps a change the leader did not take, for the next leader.
    pub(super) fn keep_pending(&self, change: Change) {
        let mut pending = self.inner.pending.lock().unwrap_or_else(|p| p.into_inner());
        if pending.len() >= MAX_PENDING {
            pending.pop_front();
            tracing::warn!(node = %self.name(), "too many directory changes waiting for a leader: dropped the oldest");
        }
        pending.push_back(change);
    }

    /// Sends the kept changes to the leader, in order; stops at the first that fails.
    pub(super) async fn flush_pending(&self) {
        loop {
            let next = self
                .inner
                .pending
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .pop_front();
            let Some(change) = next else { return };
            match self.propose(change.clone()).await {
                Ok(()) => {}
                Err(NodeError::Call(_)) | Err(NodeError::NotLeader { .. }) => {
                    self.inner
                        .pending
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_front(change);
                    return;
                }
                Err(e) => {
                    tracing::debug!(node = %self.name(), error = %e, "a kept directory change no longer applies")
                }
            }
        }
    }

    /// This node's incarnation was declared dead (it stalled past the failure bound, or
    /// was cut off): stop what it hosted (others replaced it), report unhealthy, and
    /// rejoin under a new incarnation.
    pub(super) fn expel(&self, reason: String) {
        if self.is_stopping() {
            return;
        }
        let changed = self.inner.membership.send_if_modified(|m| {
            if *m != Membership::Member {
                return false;
            }
            *m = Membership::Rejoining {
                reason: reason.clone(),
            };
            true
        });
        if !changed {
            return;
        }
        let dropped: Vec<Hosted> = self.lock_hosted().drain().map(|(_, h)| h).collect();
        tracing::warn!(node = %self.name(), incarnation = self.incarnation(), %reason, stopped = dropped.len(), "this node was declared dead: stopped the actors it hosted; rejoining under a new incarnation");
        drop(dropped);
        self.inner
            .pending
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.lock_succession().settle();
        let node = self.clone();
        tokio::spawn(async move { node.rejoin().await });
    }

    /// Joins again under a new incarnation, through the leader or any member this node
    /// knows (or its seed), until it succeeds or the node shuts down.
    async fn rejoin(&self) {
        let incarnation = next_incarnation();
        self.inner
            .info
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .incarnation = incarnation;
        let mut shutdown = self.inner.shutdown.subscribe();
        loop {
            if self.is_stopping() {
                return;
            }
            let deadline = Instant::now() + self.inner.config.system_timeout;
            let seeds = self.rejoin_seeds();
            match self.join_through(&seeds, deadline).await {
                Ok(()) => {
                    self.inner.membership.send_replace(Membership::Member);
                    let lead = self.lead();
                    tracing::warn!(node = %self.name(), incarnation, leader = %lead.leader, term = lead.term, "rejoined the cluster");
                    return;
                }
                Err(e) => {
                    tracing::warn!(node = %self.name(), error = %e, "rejoining failed; trying again");
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(self.inner.config.heartbeat_interval) => {}
                _ = shutdown.changed() => return,
            }
        }
    }

    /// Where to rejoin through: the leader, the other members, then the seed.
    fn rejoin_seeds(&self) -> Vec<std::net::SocketAddr> {
        let leader = self.leader();
        let mut seeds: Vec<_> = self.addr_of(&leader).into_iter().collect();
        for m in self.alive_members() {
            if let Some(a) = self.addr_of(&m) {
                if !seeds.contains(&a) && a != self.addr() {
                    seeds.push(a);
                }
            }
        }
        if let Some(seed) = self.inner.config.seed {
            if !seeds.contains(&seed) {
                seeds.push(seed);
            }
        }
        seeds.retain(|a| *a != self.addr());
        seeds
    }
}
