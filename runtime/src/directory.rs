//! The directory: which nodes and actors exist, which are alive, under an epoch.
//!
//! One node (the directory's leader) orders every change and gives it the next epoch;
//! the others hold replicas that apply the leader's updates in epoch order and ask for a
//! snapshot when they see a gap. Leadership is counted in terms: the first leader (the
//! seed) leads term 1, and each fail-over starts the next one (see `crate::leadership`).
//! Every update carries its term; a replica ignores updates of an older term (a deposed
//! leader's) and takes a snapshot when it sees a newer one, since the new leader's epochs
//! continue from its own replica, not necessarily from this one's. [`Directory`] is the
//! pure state machine; [`DirectoryHandle`] shares it inside a process and lets anyone
//! subscribe.

use std::collections::BTreeMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::actor::ExitReason;
use crate::addr::{ActorId, ActorName};
use crate::membership::{DeviceClaim, NodeInfo};

/// Whether a node or actor is alive.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Liveness {
    /// Serving.
    Alive,
    /// Gone, and why.
    Dead(ExitReason),
}

/// A node as the directory knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodeEntry {
    /// What the node reported when it joined.
    pub info: NodeInfo,
    /// Alive or dead.
    pub liveness: Liveness,
    /// The epoch at which this incarnation joined: the order of succession (the oldest
    /// live member leads after the leader).
    pub joined: u64,
}

/// An actor as the directory knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActorEntry {
    /// Its current (or last) incarnation.
    pub id: ActorId,
    /// Alive or dead.
    pub liveness: Liveness,
    /// The devices of its node it holds, as it reported when it registered.
    pub claim: Option<DeviceClaim>,
}

/// One change to the directory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Change {
    /// A node joined (or rejoined with a new incarnation).
    NodeUp(NodeInfo),
    /// A node died or left; all its actors are marked dead with it.
    NodeDown {
        /// The node's name.
        node: String,
        /// Why (missed heartbeats, graceful leave).
        reason: ExitReason,
    },
    /// An actor incarnation started.
    ActorUp {
        /// Which incarnation.
        id: ActorId,
        /// The devices of its node it holds (see [`crate::Actor::device_claim`]).
        claim: Option<DeviceClaim>,
    },
    /// An alive actor incarnation now holds other devices of its node (a policy
    /// resharded over another set of device groups).
    ActorClaim {
        /// Which incarnation.
        id: ActorId,
        /// The devices it holds from now on.
        claim: Option<DeviceClaim>,
    },
    /// An actor incarnation exited.
    ActorDown {
        /// Which incarnation.
        id: ActorId,
        /// Why.
        reason: ExitReason,
    },
}

/// A change with the epoch it produced.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Update {
    /// The term of the leader that ordered it.
    pub term: u64,
    /// The epoch after this change.
    pub epoch: u64,
    /// The change.
    pub change: Change,
}

/// Errors applying changes or updates.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirectoryError {
    /// An update skipped epochs: this replica must fetch a snapshot.
    #[error("directory update for epoch {got} but this replica is at {have}: snapshot needed")]
    Gap {
        /// The replica's epoch.
        have: u64,
        /// The update's epoch.
        got: u64,
    },
    /// An update came from another term than the replica's: a snapshot of the new
    /// leader's directory is needed.
    #[error("directory update of term {got} but this replica is at term {have}: snapshot needed")]
    Term {
        /// The replica's term.
        have: u64,
        /// The update's term.
        got: u64,
    },
    /// An actor was registered on a node the directory does not know or holds dead.
    #[error("actor {actor} registered on node {node:?}, which is not alive in the directory")]
    UnknownNode {
        /// The actor.
        actor: ActorId,
        /// Its node.
        node: String,
    },
}

/// The directory state. Pure: no I/O, no clocks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Directory {
    term: u64,
    epoch: u64,
    nodes: BTreeMap<String, NodeEntry>,
    actors: BTreeMap<ActorName, ActorEntry>,
}

impl Directory {
    /// The current epoch: the number of effective changes applied so far.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The term of the leader whose changes this state holds (0: none yet).
    pub fn term(&self) -> u64 {
        self.term
    }

    /// `(term, epoch)`: which of two states is newer.
    pub fn version(&self) -> (u64, u64) {
        (self.term, self.epoch)
    }

    /// Starts a term: this state is now the new leader's, and its changes carry `term`.
    /// Epochs go on from here. An older or equal term changes nothing.
    pub fn begin_term(&mut self, term: u64) {
        self.term = self.term.max(term);
    }

    /// The nodes alive in `before` that are not alive under the same incarnation here:
    /// what a replica that jumped from `before` to this state missed as `NodeDown`s.
    pub fn departed_since(&self, before: &Directory) -> Vec<String> {
        before
            .alive_nodes()
            .filter(|old| {
                !self.node(&old.name).is_some_and(|now| {
                    now.liveness == Liveness::Alive && now.info.incarnation == old.incarnation
                })
            })
            .map(|n| n.name.clone())
            .collect()
    }

    /// The entry for a node.
    pub fn node(&self, name: &str) -> Option<&NodeEntry> {
        self.nodes.get(name)
    }

    /// All nodes, alive and dead.
    pub fn nodes(&self) -> impl Iterator<Item = &NodeEntry> {
        self.nodes.values()
    }

    /// The alive nodes.
    pub fn alive_nodes(&self) -> impl Iterator<Item = &NodeInfo> {
        self.nodes
            .values()
            .filter(|n| n.liveness == Liveness::Alive)
            .map(|n| &n.info)
    }

    /// The entry for an actor name.
    pub fn actor(&self, name: &ActorName) -> Option<&ActorEntry> {
        self.actors.get(name)
    }

    /// All actor entries.
    pub fn actors(&self) -> impl Iterator<Item = &ActorEntry> {
        self.actors.values()
    }

    /// The alive incarnation registered under `name`.
    pub fn resolve(&self, name: &ActorName) -> Option<&ActorId> {
        self.actors
            .get(name)
            .filter(|e| e.liveness == Liveness::Alive)
            .map(|e| &e.id)
    }

    /// The alive actors that hold devices, with what they hold, in name order.
    pub fn claims(&self) -> impl Iterator<Item = (&ActorId, &DeviceClaim)> {
        self.actors
            .values()
            .filter(|e| e.liveness == Liveness::Alive)
            .filter_map(|e| Some((&e.id, e.claim.as_ref()?)))
    }

    /// The alive actors of a role, in name order.
    pub fn group(&self, role: &str) -> Vec<ActorId> {
        self.actors
            .values()
            .filter(|e| e.id.name.role == role && e.liveness == Liveness::Alive)
            .map(|e| e.id.clone())
            .collect()
    }

    /// Applies a change as the leader. Returns the update to broadcast, or `None` when
    /// the change altered nothing (duplicates and stale reports are absorbed).
    pub fn apply(&mut self, change: Change) -> Result<Option<Update>, DirectoryError> {
        let changed = match &change {
            Change::NodeUp(info) => {
                let entry = NodeEntry {
                    info: info.clone(),
                    liveness: Liveness::Alive,
                    joined: self.epoch + 1,
                };
                match self.nodes.get(&info.name) {
                    Some(old) if old.info == *info && old.liveness == Liveness::Alive => false,
                    // An incarnation never comes back: once dead, a node rejoins only
                    // under a newer one.
                    Some(old) if old.info.incarnation >= info.incarnation => false,
                    _ => {
                        // A rejoin with a new incarnation: the old life's actors are gone.
                        self.mark_node_actors_dead(
                            &info.name,
                            &ExitReason::NodeDown("node restarted".into()),
                        );
                        self.nodes.insert(info.name.clone(), entry);
                        true
                    }
                }
            }
            Change::NodeDown { node, reason } => match self.nodes.get_mut(node) {
                Some(entry) if entry.liveness == Liveness::Alive => {
                    entry.liveness = Liveness::Dead(reason.clone());
                    let reason = ExitReason::NodeDown(format!("node {node} is down"));
                    self.mark_node_actors_dead(node, &reason);
                    true
                }
                _ => false,
            },
            Change::ActorUp { id, claim } => {
                let node_alive = self
                    .nodes
                    .get(&id.name.node)
                    .is_some_and(|n| n.liveness == Liveness::Alive);
                if !node_alive {
                    return Err(DirectoryError::UnknownNode {
                        actor: id.clone(),
                        node: id.name.node.clone(),
                    });
                }
                match self.actors.get(&id.name) {
                    Some(old) if old.id.incarnation >= id.incarnation => false,
                    _ => {
                        self.actors.insert(
                            id.name.clone(),
                            ActorEntry {
                                id: id.clone(),
                                liveness: Liveness::Alive,
                                claim: claim.clone(),
                            },
                        );
                        true
                    }
                }
            }
            Change::ActorClaim { id, claim } => match self.actors.get_mut(&id.name) {
                Some(entry)
                    if entry.id == *id
                        && entry.liveness == Liveness::Alive
                        && entry.claim != *claim =>
                {
                    entry.claim = claim.clone();
                    true
                }
                // Another incarnation, a dead one, or nothing new: no change.
                _ => false,
            },
            Change::ActorDown { id, reason } => match self.actors.get_mut(&id.name) {
                Some(entry) if entry.id == *id && entry.liveness == Liveness::Alive => {
                    entry.liveness = Liveness::Dead(reason.clone());
                    true
                }
                Some(entry) if entry.id.incarnation >= id.incarnation => false,
                // Its exit overtook its registration (a node proposes each change on its
                // own, so an actor that stops at once may): record it dead, so the
                // late `ActorUp` of the same incarnation is absorbed.
                _ => {
                    self.actors.insert(
                        id.name.clone(),
                        ActorEntry {
                            id: id.clone(),
                            liveness: Liveness::Dead(reason.clone()),
                            claim: None,
                        },
                    );
                    true
                }
            },
        };
        if !changed {
            return Ok(None);
        }
        self.epoch += 1;
        Ok(Some(Update {
            term: self.term,
            epoch: self.epoch,
            change,
        }))
    }

    /// Applies a leader's update on a replica, in epoch order.
    /// Returns whether it was new (old and duplicate updates, and a deposed leader's,
    /// are ignored).
    pub fn apply_update(&mut self, update: &Update) -> Result<bool, DirectoryError> {
        if update.term < self.term {
            return Ok(false);
        }
        if update.term > self.term {
            return Err(DirectoryError::Term {
                have: self.term,
                got: update.term,
            });
        }
        if update.epoch <= self.epoch {
            return Ok(false);
        }
        if update.epoch != self.epoch + 1 {
            return Err(DirectoryError::Gap {
                have: self.epoch,
                got: update.epoch,
            });
        }
        // The leader already accepted it; apply the same rule and take the leader's epoch.
        self.apply(update.change.clone())?;
        self.epoch = update.epoch;
        Ok(true)
    }

    fn mark_node_actors_dead(&mut self, node: &str, reason: &ExitReason) {
        for entry in self.actors.values_mut() {
            if entry.id.name.node == node && entry.liveness == Liveness::Alive {
                entry.liveness = Liveness::Dead(reason.clone());
            }
        }
    }
}

/// What a subscriber receives.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// An update was applied.
    Update(Update),
    /// The replica was replaced by a snapshot at this epoch; re-read the whole directory.
    Reset(u64),
}

/// A process's shared view of the directory, with change notifications.
#[derive(Clone)]
pub struct DirectoryHandle {
    state: Arc<RwLock<Directory>>,
    events: broadcast::Sender<Event>,
}

impl Default for DirectoryHandle {
    fn default() -> Self {
        Self::new()
    }
}

impl DirectoryHandle {
    /// An empty directory at epoch 0.
    pub fn new() -> Self {
        DirectoryHandle {
            state: Arc::new(RwLock::new(Directory::default())),
            events: broadcast::channel(1024).0,
        }
    }

    /// A copy of the current state.
    pub fn snapshot(&self) -> Directory {
        self.read(|d| d.clone())
    }

    /// Reads the state under the lock.
    pub fn read<T>(&self, f: impl FnOnce(&Directory) -> T) -> T {
        f(&self.state.read().unwrap_or_else(|p| p.into_inner()))
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.read(|d| d.epoch())
    }

    /// A snapshot and a receiver for every event after it, taken atomically. A receiver
    /// that lags behind gets `RecvError::Lagged`: take a new snapshot then.
    pub fn subscribe(&self) -> (Directory, broadcast::Receiver<Event>) {
        let guard = self.state.read().unwrap_or_else(|p| p.into_inner());
        (guard.clone(), self.events.subscribe())
    }

    /// Applies a change as the leader and notifies subscribers.
    pub fn apply(&self, change: Change) -> Result<Option<Update>, DirectoryError> {
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        let update = guard.apply(change)?;
        if let Some(u) = &update {
            let _ = self.events.send(Event::Update(u.clone()));
        }
        Ok(update)
    }

    /// Applies a leader's update on a replica and notifies subscribers.
    pub fn apply_update(&self, update: &Update) -> Result<bool, DirectoryError> {
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        let fresh = guard.apply_update(update)?;
        if fresh {
            let _ = self.events.send(Event::Update(update.clone()));
        }
        Ok(fresh)
    }

    /// Replaces the replica with a leader's snapshot when it is at least as new (by
    /// term, then epoch). Returns the nodes the replica held alive that the snapshot
    /// does not (see [`Directory::departed_since`]), or `None` when the snapshot was
    /// older and ignored.
    pub fn reset(&self, snapshot: Directory) -> Option<Vec<String>> {
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        if snapshot.version() < guard.version() {
            return None;
        }
        let departed = snapshot.departed_since(&guard);
        let epoch = snapshot.epoch();
        *guard = snapshot;
        let _ = self.events.send(Event::Reset(epoch));
        Some(departed)
    }

    /// Replaces the replica with a leader's snapshot whatever its version (a node that
    /// joins takes its leader's state). Returns the nodes that departed, as
    /// [`DirectoryHandle::reset`].
    pub fn replace(&self, snapshot: Directory) -> Vec<String> {
        let mut guard = self.state.write().unwrap_or_else(|p| p.into_inner());
        let departed = snapshot.departed_since(&guard);
        let epoch = snapshot.epoch();
        *guard = snapshot;
        let _ = self.events.send(Event::Reset(epoch));
        departed
    }

    /// Starts a term on this (leader's) state; see [`Directory::begin_term`].
    pub fn begin_term(&self, term: u64) {
        self.state
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .begin_term(term);
    }

    /// Waits until `pred` holds, at most `timeout`. Returns whether it held.
    pub async fn wait_until(
        &self,
        timeout: Duration,
        mut pred: impl FnMut(&Directory) -> bool,
    ) -> bool {
        let (snap, mut rx) = self.subscribe();
        if pred(&snap) {
            return true;
        }
        let wait = async {
            loop {
                match rx.recv().await {
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {
                        if self.read(&mut pred) {
                            return true;
                        }
                    }
                    Err(broadcast::error::RecvError::Closed) => return false,
                }
            }
        };
        tokio::time::timeout(timeout, wait).await.unwrap_or(false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(name: &str, incarnation: u64) -> NodeInfo {
        NodeInfo::for_tests(name, incarnation)
    }

    fn id(s: &str) -> ActorId {
        s.parse().unwrap()
    }

    fn up(s: &str) -> Change {
        Change::ActorUp {
            id: id(s),
            claim: None,
        }
    }

    #[test]
    fn an_actors_device_claim_replicates_and_goes_with_the_actor() {
        let gpu1 = DeviceClaim {
            devices: vec![1],
            cuda: true,
        };
        let mut leader = Directory::default();
        let mut replica = Directory::default();
        let changes = vec![
            Change::NodeUp(node("a", 1)),
            Change::ActorUp {
                id: id("a/policy/0#1"),
                claim: Some(gpu1.clone()),
            },
            up("a/env/0#2"),
            Change::ActorUp {
                id: id("a/rollout/0#3"),
                claim: Some(gpu1),
            },
        ];
        for c in changes {
            let u = leader.apply(c).unwrap().unwrap();
            assert!(replica.apply_update(&u).unwrap());
        }
        let held = |d: &Directory| -> Vec<String> {
            d.claims()
                .map(|(id, c)| format!("{}:{:?}", id.name.role, c.devices))
                .collect()
        };
        assert_eq!(held(&replica), ["policy:[1]", "rollout:[1]"]);
        // The policy resharded over devices 1 and 2: its claim follows, replicated;
        // the same claim again, or one for another incarnation, changes nothing.
        let wider = DeviceClaim {
            devices: vec![1, 2],
            cuda: true,
        };
        let claim = |who: &str| Change::ActorClaim {
            id: id(who),
            claim: Some(wider.clone()),
        };
        let u = leader.apply(claim("a/policy/0#1")).unwrap().unwrap();
        assert!(replica.apply_update(&u).unwrap());
        assert_eq!(held(&replica), ["policy:[1, 2]", "rollout:[1]"]);
        assert_eq!(leader.apply(claim("a/policy/0#1")).unwrap(), None);
        assert_eq!(leader.apply(claim("a/policy/0#9")).unwrap(), None);
        let down = Change::ActorDown {
            id: id("a/policy/0#1"),
            reason: ExitReason::Normal,
        };
        let u = leader.apply(down).unwrap().unwrap();
        replica.apply_update(&u).unwrap();
        assert_eq!(held(&replica), ["rollout:[1]"]);
        let u = leader
            .apply(Change::NodeDown {
                node: "a".into(),
                reason: ExitReason::NodeDown("silent".into()),
            })
            .unwrap()
            .unwrap();
        replica.apply_update(&u).unwrap();
        assert!(held(&replica).is_empty(), "the node's actors hold nothing");
        assert_eq!(replica, leader);
    }

    #[test]
    fn epochs_count_effective_changes_only() {
        let mut d = Directory::default();
        assert_eq!(
            d.apply(Change::NodeUp(node("a", 1)))
                .unwrap()
                .unwrap()
                .epoch,
            1
        );
        assert_eq!(
            d.apply(Change::NodeUp(node("a", 1))).unwrap(),
            None,
            "duplicate join"
        );
        d.apply(up("a/rollout/0#5")).unwrap().unwrap();
        assert_eq!(
            d.apply(up("a/rollout/0#4")).unwrap(),
            None,
            "older incarnation"
        );
        assert_eq!(d.epoch(), 2);
        assert_eq!(
            d.resolve(&"a/rollout/0".parse().unwrap()),
            Some(&id("a/rollout/0#5"))
        );
        // A down report for an old incarnation changes nothing.
        let stale = Change::ActorDown {
            id: id("a/rollout/0#4"),
            reason: ExitReason::Normal,
        };
        assert_eq!(d.apply(stale).unwrap(), None);
        assert_eq!(d.group("rollout").len(), 1);
    }

    /// Regression: a node proposes each change on its own task, so an actor that stopped
    /// at once (a spawn its caller cancelled) could have its exit reach the leader before
    /// its registration, which then left it alive in the directory for ever.
    #[test]
    fn an_exit_that_overtakes_its_registration_stays_an_exit() {
        let mut d = Directory::default();
        d.apply(Change::NodeUp(node("a", 1))).unwrap();
        d.apply(up("a/slow/0#1")).unwrap();
        let down = Change::ActorDown {
            id: id("a/slow/0#2"),
            reason: ExitReason::Normal,
        };
        assert!(d.apply(down.clone()).unwrap().is_some());
        assert_eq!(d.apply(up("a/slow/0#2")).unwrap(), None);
        assert_eq!(d.apply(down).unwrap(), None, "a duplicate exit");
        let entry = d.actor(&"a/slow/0".parse().unwrap()).unwrap();
        assert_eq!(entry.id, id("a/slow/0#2"));
        assert_eq!(entry.liveness, Liveness::Dead(ExitReason::Normal));
        // A name never seen before.
        let unseen = Change::ActorDown {
            id: id("a/fast/0#3"),
            reason: ExitReason::Normal,
        };
        assert!(d.apply(unseen).unwrap().is_some());
        assert_eq!(d.apply(up("a/fast/0#3")).unwrap(), None);
        assert!(d.group("fast").is_empty() && d.group("slow").is_empty());
    }

    #[test]
    fn node_down_kills_its_actors_and_rejects_new_ones() {
        let mut d = Directory::default();
        d.apply(Change::NodeUp(node("a", 1))).unwrap();
        d.apply(Change::NodeUp(node("b", 1))).unwrap();
        d.apply(up("a/policy/0#1")).unwrap();
        d.apply(up("b/policy/0#1")).unwrap();
        d.apply(Change::NodeDown {
            node: "a".into(),
            reason: ExitReason::NodeDown("missed heartbeats".into()),
        })
        .unwrap()
        .unwrap();
        assert_eq!(d.group("policy"), vec![id("b/policy/0#1")]);
        assert!(matches!(
            d.actor(&"a/policy/0".parse().unwrap()).unwrap().liveness,
            Liveness::Dead(ExitReason::NodeDown(_))
        ));
        assert!(matches!(
            d.apply(up("a/policy/1#2")),
            Err(DirectoryError::UnknownNode { .. })
        ));
        // The node comes back with a new incarnation.
        d.apply(Change::NodeUp(node("a", 2))).unwrap().unwrap();
        d.apply(up("a/policy/1#3")).unwrap().unwrap();
        assert_eq!(d.group("policy").len(), 2);
    }

    #[test]
    fn replica_follows_leader_and_detects_gaps() {
        let mut leader = Directory::default();
        let mut replica = Directory::default();
        let u1 = leader.apply(Change::NodeUp(node("a", 1))).unwrap().unwrap();
        let u2 = leader.apply(up("a/r/0#1")).unwrap().unwrap();
        let u3 = leader.apply(up("a/r/1#2")).unwrap().unwrap();
        assert!(replica.apply_update(&u1).unwrap());
        assert!(!replica.apply_update(&u1).unwrap(), "duplicate ignored");
        assert_eq!(
            replica.apply_update(&u3),
            Err(DirectoryError::Gap { have: 1, got: 3 })
        );
        assert!(replica.apply_update(&u2).unwrap());
        assert!(replica.apply_update(&u3).unwrap());
        assert_eq!(replica, leader);
    }

    #[test]
    fn terms_order_updates_and_snapshots() {
        let mut old = Directory::default();
        old.begin_term(1);
        old.apply(Change::NodeUp(node("a", 1))).unwrap();
        old.apply(Change::NodeUp(node("b", 1))).unwrap();
        old.apply(Change::NodeUp(node("c", 1))).unwrap();
        let mut replica = old.clone();
        // b takes over at term 2 from its replica and declares a dead.
        let mut new = old.clone();
        new.begin_term(2);
        new.begin_term(1);
        assert_eq!(new.term(), 2, "terms never go back");
        let down = new
            .apply(Change::NodeDown {
                node: "a".into(),
                reason: ExitReason::NodeDown("silent".into()),
            })
            .unwrap()
            .unwrap();
        assert_eq!((down.term, down.epoch), (2, 4));
        assert_eq!(
            replica.apply_update(&down),
            Err(DirectoryError::Term { have: 1, got: 2 }),
            "a newer term needs a snapshot"
        );
        // The deposed leader's late update is ignored once the replica follows term 2.
        let late = old.apply(up("a/r/0#9")).unwrap().unwrap();
        let h = DirectoryHandle::new();
        h.reset(replica.clone()).unwrap();
        assert_eq!(h.reset(new.clone()), Some(vec!["a".to_string()]));
        replica = h.snapshot();
        assert!(!replica.apply_update(&late).unwrap(), "stale term");
        assert_eq!(replica, new);
        // An older snapshot is refused even with a higher epoch.
        let mut busy_old = old.clone();
        busy_old.apply(up("b/r/0#3")).unwrap();
        assert!(busy_old.epoch() > new.epoch());
        assert_eq!(h.reset(busy_old), None);
        assert_eq!(h.snapshot(), new);
    }

    #[test]
    fn join_order_and_no_resurrection() {
        let mut d = Directory::default();
        d.apply(Change::NodeUp(node("b", 5))).unwrap();
        d.apply(Change::NodeUp(node("a", 5))).unwrap();
        assert_eq!(d.node("b").unwrap().joined, 1);
        assert_eq!(d.node("a").unwrap().joined, 2);
        // A duplicate join keeps the original order.
        assert_eq!(d.apply(Change::NodeUp(node("b", 5))).unwrap(), None);
        assert_eq!(d.node("b").unwrap().joined, 1);
        d.apply(Change::NodeDown {
            node: "b".into(),
            reason: ExitReason::NodeDown("silent".into()),
        })
        .unwrap();
        assert_eq!(
            d.apply(Change::NodeUp(node("b", 5))).unwrap(),
            None,
            "a dead incarnation stays dead"
        );
        d.apply(Change::NodeUp(node("b", 6))).unwrap().unwrap();
        assert_eq!(
            d.node("b").unwrap().joined,
            4,
            "a new life joins at the back"
        );
    }

    #[tokio::test]
    async fn subscribers_see_updates_and_wait_until_works() {
        let h = DirectoryHandle::new();
        let (snap, mut rx) = h.subscribe();
        assert_eq!(snap.epoch(), 0);
        let h2 = h.clone();
        let waiter = tokio::spawn(async move {
            h2.wait_until(Duration::from_secs(5), |d| d.group("r").len() == 1)
                .await
        });
        h.apply(Change::NodeUp(node("a", 1))).unwrap();
        h.apply(up("a/r/0#1")).unwrap();
        assert!(matches!(
            rx.recv().await.unwrap(),
            Event::Update(Update { epoch: 1, .. })
        ));
        assert!(waiter.await.unwrap());
        assert!(
            !h.wait_until(Duration::from_millis(20), |d| d.epoch() == 99)
                .await
        );
    }
}
