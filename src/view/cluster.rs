//! The cluster half of the live view: what this node's directory replica says about
//! the nodes, their devices and actors, the leader and its term, and a bounded ring of
//! the recent membership events (joins, deaths, rejoins, fail-overs, actors started and
//! lost) that [`ClusterEvents`] records from the directory's change feed.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use yatt_roles::DeviceHolder;
use yatt_runtime::{
    DeviceInfo, DeviceKind, Directory, DirectoryChange, DirectoryEvent, ExitReason, Liveness,
    Membership, Node, NodeInfo, WeakNode,
};

/// Events the ring keeps; the oldest go first.
pub const EVENT_CAPACITY: usize = 256;

/// What happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// A node joined for the first time (as this node saw it).
    Join,
    /// A node came back as a new incarnation.
    Rejoin,
    /// A node died (missed heartbeats) or left.
    Death,
    /// The directory's leadership moved: a new term.
    FailOver,
    /// An actor incarnation started.
    ActorUp,
    /// An actor incarnation exited or was lost with its node.
    ActorDown,
}

/// One membership event.
#[derive(Debug, Clone, Serialize)]
pub struct ClusterEvent {
    /// Its number in this node's ring (1, 2, ...): a viewer asks for those after the
    /// last it has.
    pub seq: u64,
    /// Wall clock, milliseconds since the Unix epoch, when this node saw it.
    pub unix_ms: u64,
    /// What happened.
    pub kind: EventKind,
    /// The node it concerns.
    pub node: String,
    /// In words.
    pub text: String,
}

#[derive(Default)]
struct Ring {
    next: u64,
    events: VecDeque<ClusterEvent>,
    /// Each node's last incarnation and whether it was alive, to tell a join from a
    /// rejoin and to diff a snapshot.
    nodes: BTreeMap<String, (u64, bool)>,
    term: u64,
}

impl Ring {
    fn push(&mut self, kind: EventKind, node: &str, text: String) {
        self.next += 1;
        if self.events.len() == EVENT_CAPACITY {
            self.events.pop_front();
        }
        self.events.push_back(ClusterEvent {
            seq: self.next,
            unix_ms: unix_ms(),
            kind,
            node: node.to_string(),
            text,
        });
    }

    fn node_up(&mut self, name: &str, incarnation: u64) {
        match self.nodes.insert(name.to_string(), (incarnation, true)) {
            None => self.push(
                EventKind::Join,
                name,
                format!("{name} joined (incarnation {incarnation})"),
            ),
            Some((old, alive)) if old != incarnation || !alive => self.push(
                EventKind::Rejoin,
                name,
                format!("{name} rejoined as incarnation {incarnation} (was {old})"),
            ),
            Some(_) => {}
        }
    }

    fn node_down(&mut self, name: &str, why: &str) {
        let inc = self.nodes.get(name).map_or(0, |n| n.0);
        if self.nodes.insert(name.to_string(), (inc, false)) != Some((inc, false)) {
            self.push(EventKind::Death, name, format!("{name} is dead: {why}"));
        }
    }

    fn term(&mut self, term: u64, leader: &str) {
        if term > self.term {
            if self.term != 0 {
                self.push(
                    EventKind::FailOver,
                    leader,
                    format!(
                        "fail-over: {leader} leads term {term} (was term {})",
                        self.term
                    ),
                );
            }
            self.term = term;
        }
    }

    /// Records what differs between the ring's idea of the nodes and `dir` (the first
    /// snapshot, a reset, or after lagging behind the feed).
    fn diff(&mut self, dir: &Directory) {
        for n in dir.nodes() {
            match &n.liveness {
                Liveness::Alive => self.node_up(&n.info.name, n.info.incarnation),
                Liveness::Dead(r) => {
                    if !self.nodes.contains_key(&n.info.name) {
                        self.nodes
                            .insert(n.info.name.clone(), (n.info.incarnation, true));
                    }
                    self.node_down(&n.info.name, &describe(r));
                }
            }
        }
    }
}

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Why something is dead, in words.
fn describe(reason: &ExitReason) -> String {
    match reason {
        ExitReason::Normal => "it left or stopped".into(),
        ExitReason::NodeDown(why) => why.clone(),
        ExitReason::StartFailed(e) => format!("its start failed: {e}"),
        ExitReason::Panicked(e) => format!("it panicked: {e}"),
    }
}

/// The recent membership events of one node, recorded by a task that follows its
/// directory until the node stops. Cloning shares the ring.
#[derive(Clone)]
pub struct ClusterEvents {
    ring: Arc<Mutex<Ring>>,
}

impl ClusterEvents {
    /// Starts recording `node`'s membership events (the nodes it knows now count as
    /// joins). Needs a Tokio runtime.
    pub fn start(node: &Node) -> Self {
        let ring = Arc::new(Mutex::new(Ring::default()));
        let (snapshot, rx) = node.directory().subscribe();
        {
            let mut r = lock(&ring);
            r.term(snapshot.term(), &node.leader());
            r.diff(&snapshot);
        }
        tokio::spawn(follow(node.downgrade(), rx, ring.clone()));
        ClusterEvents { ring }
    }

    /// The events after `seq`, oldest first, at most `max`.
    pub fn since(&self, seq: u64, max: usize) -> Vec<ClusterEvent> {
        lock(&self.ring)
            .events
            .iter()
            .filter(|e| e.seq > seq)
            .take(max)
            .cloned()
            .collect()
    }
}

fn lock(ring: &Mutex<Ring>) -> std::sync::MutexGuard<'_, Ring> {
    ring.lock().unwrap_or_else(|p| p.into_inner())
}

async fn follow(
    node: WeakNode,
    mut rx: tokio::sync::broadcast::Receiver<DirectoryEvent>,
    ring: Arc<Mutex<Ring>>,
) {
    use tokio::sync::broadcast::error::RecvError;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        let event = tokio::select! {
            e = rx.recv() => e,
            _ = tick.tick() => {
                match node.upgrade() {
                    Some(n) if !n.is_stopping() => continue,
                    _ => return,
                }
            }
        };
        let Some(n) = node.upgrade() else { return };
        let mut r = lock(&ring);
        match event {
            Ok(DirectoryEvent::Update(u)) => {
                r.term(u.term, &n.leader());
                match &u.change {
                    DirectoryChange::NodeUp(info) => r.node_up(&info.name, info.incarnation),
                    DirectoryChange::NodeDown { node, reason } => {
                        r.node_down(node, &describe(reason))
                    }
                    DirectoryChange::ActorUp(id) => {
                        r.push(EventKind::ActorUp, &id.name.node, format!("{id} started"))
                    }
                    DirectoryChange::ActorDown { id, reason } => r.push(
                        EventKind::ActorDown,
                        &id.name.node,
                        format!("{id} stopped: {}", describe(reason)),
                    ),
                }
            }
            Ok(DirectoryEvent::Reset(_)) | Err(RecvError::Lagged(_)) => {
                let dir = n.directory().snapshot();
                r.term(dir.term(), &n.leader());
                r.diff(&dir);
            }
            Err(RecvError::Closed) => return,
        }
    }
}

/// A node's devices, each with the roles of this process that hold it now
/// (`held_by`). Roles on the host CPU of a node whose devices do not include it (its
/// devices are GPUs, or it offers none) are listed on a device of kind `cpu`.
fn devices_json(info: &NodeInfo) -> Vec<serde_json::Value> {
    let held = yatt_roles::device_holders(&info.name);
    let on = |d: &DeviceInfo, h: &DeviceHolder| {
        h.cuda == (d.kind == DeviceKind::Cuda) && h.devices.contains(&d.index)
    };
    let mut out: Vec<serde_json::Value> = info
        .devices
        .iter()
        .map(|d| {
            let by: Vec<&str> = held
                .iter()
                .filter(|h| on(d, h))
                .map(|h| h.role.as_str())
                .collect();
            serde_json::json!({
                "index": d.index,
                "kind": format!("{:?}", d.kind).to_lowercase(),
                "name": d.name,
                "memory_bytes": d.memory_bytes,
                "held_by": by,
            })
        })
        .collect();
    let on_cpu: Vec<&str> = held
        .iter()
        .filter(|h| !h.cuda && !info.devices.iter().any(|d| on(d, h)))
        .map(|h| h.role.as_str())
        .collect();
    if !on_cpu.is_empty() {
        out.push(serde_json::json!({
            "index": 0,
            "kind": "cpu",
            "name": "host CPU",
            "memory_bytes": info.memory_bytes,
            "held_by": on_cpu,
        }));
    }
    out
}

/// `/api/cluster?events_since=SEQ`: the nodes with liveness, incarnation, kind, devices
/// (and the roles of this process holding them) and actors; the leader and term; the events after `events_since`.
pub fn cluster_json(node: &Node, events: &ClusterEvents, events_since: u64) -> serde_json::Value {
    let dir = node.directory().snapshot();
    let nodes: Vec<serde_json::Value> = dir
        .nodes()
        .map(|n| {
            let actors: Vec<serde_json::Value> = dir
                .actors()
                .filter(|a| a.id.name.node == n.info.name)
                .map(|a| {
                    serde_json::json!({
                        "id": a.id.to_string(),
                        "role": a.id.name.role,
                        "alive": a.liveness == Liveness::Alive,
                    })
                })
                .collect();
            let devices = devices_json(&n.info);
            serde_json::json!({
                "name": n.info.name,
                "incarnation": n.info.incarnation,
                "kind": n.info.kind.to_string(),
                "addr": n.info.addr.to_string(),
                "hostname": n.info.hostname,
                "cpu_cores": n.info.cpu_cores,
                "alive": n.liveness == Liveness::Alive,
                "dead_because": match &n.liveness {
                    Liveness::Alive => None,
                    Liveness::Dead(r) => Some(describe(r)),
                },
                "devices": devices,
                "actors": actors,
            })
        })
        .collect();
    serde_json::json!({
        "node": node.name(),
        "incarnation": node.incarnation(),
        "member": node.membership() == Membership::Member && !node.is_stopping(),
        "leader": node.leader(),
        "term": node.term(),
        "epoch": dir.epoch(),
        "nodes": nodes,
        "events": events.since(events_since, EVENT_CAPACITY),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleActor, RoleError};

    struct Holds(&'static str);

    impl Role for Holds {
        type Request = ();
        type Response = ();
        fn name(&self) -> &str {
            self.0
        }
        fn profile(&self) -> ResourceProfile {
            ResourceProfile::cpu_only()
        }
        fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
            Ok(())
        }
        fn serve(&mut self, _: ()) -> Result<(), RoleError> {
            Ok(())
        }
    }

    #[tokio::test]
    async fn each_device_lists_the_roles_of_this_process_that_hold_it_while_they_run() {
        let mut info = NodeInfo::for_tests("holders-node", 1);
        info.devices = (0..2)
            .map(|index| DeviceInfo {
                index,
                kind: DeviceKind::Cuda,
                name: format!("gpu{index}"),
                memory_bytes: 1,
            })
            .collect();
        let gpu1 = DeviceGroup {
            node: "holders-node".into(),
            devices: vec![1],
            cuda: true,
        };
        let policy = RoleActor::start(Holds("policy"), gpu1.clone(), 1)
            .await
            .unwrap();
        let rollout = RoleActor::start(Holds("rollout"), gpu1, 1).await.unwrap();
        let reward = RoleActor::start(Holds("reward"), DeviceGroup::cpu("holders-node"), 1)
            .await
            .unwrap();
        let held = |d: &serde_json::Value| d["held_by"].clone();
        let devices = devices_json(&info);
        assert_eq!(devices.len(), 3, "{devices:?}");
        assert_eq!(held(&devices[0]), serde_json::json!([]));
        assert_eq!(held(&devices[1]), serde_json::json!(["policy", "rollout"]));
        assert_eq!(devices[2]["kind"], "cpu");
        assert_eq!(held(&devices[2]), serde_json::json!(["reward"]));
        drop((policy, reward));
        let devices = devices_json(&info);
        assert_eq!(
            devices.len(),
            2,
            "the CPU's only holder stopped: {devices:?}"
        );
        assert_eq!(held(&devices[1]), serde_json::json!(["rollout"]));
        drop(rollout);
    }

    #[test]
    fn joins_deaths_rejoins_and_fail_overs_are_told_apart_and_the_ring_is_bounded() {
        let mut r = Ring::default();
        r.term(1, "a");
        r.node_up("a", 1);
        r.node_up("b", 5);
        r.node_up("b", 5);
        r.node_down("b", "missed heartbeats");
        r.node_down("b", "missed heartbeats");
        r.node_up("b", 9);
        r.term(2, "c");
        let kinds: Vec<EventKind> = r.events.iter().map(|e| e.kind).collect();
        use EventKind::*;
        assert_eq!(kinds, [Join, Join, Death, Rejoin, FailOver]);
        assert!(r.events[3].text.contains("incarnation 9 (was 5)"));
        for i in 0..1000 {
            r.push(ActorUp, "a", format!("{i}"));
        }
        assert_eq!(r.events.len(), EVENT_CAPACITY);
        assert_eq!(r.events.back().map(|e| e.seq), Some(1005));
    }
}
