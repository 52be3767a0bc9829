//! The cluster half of the live view: what this node's directory replica says about
//! the nodes, their devices (and which actors hold them, in any process), actors, the
//! leader and its term, and a bounded ring of the recent membership events (joins,
//! deaths, rejoins, fail-overs, actors started and lost) that [`ClusterEvents`] records
//! from the directory's change feed.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Serialize;
use yatt_runtime::{
    ActorId, DeviceClaim, Directory, DirectoryChange, DirectoryEvent, ExitReason, Liveness,
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
                    DirectoryChange::ActorUp { id, .. } => {
                        r.push(EventKind::ActorUp, &id.name.node, format!("{id} started"))
                    }
                    DirectoryChange::ActorClaim { id, claim } => r.push(
                        EventKind::ActorUp,
                        &id.name.node,
                        format!(
                            "{id} now holds device(s) {:?}",
                            claim
                                .as_ref()
                                .map(|c| c.devices.clone())
                                .unwrap_or_default()
                        ),
                    ),
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

/// Which actors hold devices now, in name order: every actor the directory lists alive
/// with a device claim (the roles of every process in the cluster, replicated with
/// their records), and the actors of `node` that only this process reaches (spawned
/// local, so not in the directory), each once.
fn device_claims(node: &Node, dir: &Directory) -> BTreeMap<ActorId, DeviceClaim> {
    let mut all: BTreeMap<ActorId, DeviceClaim> = node.hosted_claims().into_iter().collect();
    for (id, claim) in dir.claims() {
        all.entry(id.clone()).or_insert_with(|| claim.clone());
    }
    all
}

/// A node's devices, each with the roles that hold it now (`held_by`: the role names of
/// `claims`' actors on that node). Roles on the host CPU of a node whose devices do not
/// include it (its devices are GPUs, or it offers none) are listed on a device of kind
/// `cpu`.
fn devices_json(
    info: &NodeInfo,
    claims: &BTreeMap<ActorId, DeviceClaim>,
) -> Vec<serde_json::Value> {
    let held: Vec<(&str, &DeviceClaim)> = claims
        .iter()
        .filter(|(id, _)| id.name.node == info.name)
        .map(|(id, claim)| (id.name.role.as_str(), claim))
        .collect();
    let mut out: Vec<serde_json::Value> = info
        .devices
        .iter()
        .map(|d| {
            let by: Vec<&str> = held
                .iter()
                .filter(|(_, c)| c.covers(d))
                .map(|(role, _)| *role)
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
        .filter(|(_, c)| !c.cuda && !info.devices.iter().any(|d| c.covers(d)))
        .map(|(role, _)| *role)
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
/// (and the roles holding them, in whichever process they run) and actors; the leader
/// and term; the events after `events_since`.
pub fn cluster_json(node: &Node, events: &ClusterEvents, events_since: u64) -> serde_json::Value {
    let dir = node.directory().snapshot();
    let claims = device_claims(node, &dir);
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
            let devices = devices_json(&n.info, &claims);
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
    use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleActor, RoleError, RoleRequest};
    use yatt_runtime::{DeviceInfo, DeviceKind, NodeConfig};

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

    fn claim(devices: &[u32], cuda: bool) -> DeviceClaim {
        DeviceClaim {
            devices: devices.to_vec(),
            cuda,
        }
    }

    #[test]
    fn each_device_lists_the_actors_of_its_node_that_claim_it() {
        let mut info = NodeInfo::for_tests("gpus", 1);
        info.devices = (0..2)
            .map(|index| DeviceInfo {
                index,
                kind: DeviceKind::Cuda,
                name: format!("gpu{index}"),
                memory_bytes: 1,
            })
            .collect();
        let claims: BTreeMap<ActorId, DeviceClaim> = [
            ("gpus/policy/0#1", claim(&[1], true)),
            ("gpus/rollout/0#2", claim(&[1], true)),
            ("gpus/reward/0#3", claim(&[0], false)),
            ("other/rollout/0#4", claim(&[0], true)),
        ]
        .into_iter()
        .map(|(id, c)| (id.parse().unwrap(), c))
        .collect();
        let held = |d: &serde_json::Value| d["held_by"].clone();
        let devices = devices_json(&info, &claims);
        assert_eq!(devices.len(), 3, "{devices:?}");
        assert_eq!(held(&devices[0]), serde_json::json!([]));
        assert_eq!(held(&devices[1]), serde_json::json!(["policy", "rollout"]));
        assert_eq!(devices[2]["kind"], "cpu");
        assert_eq!(held(&devices[2]), serde_json::json!(["reward"]));
        let devices = devices_json(&info, &BTreeMap::new());
        assert_eq!(devices.len(), 2, "no holders, no host CPU: {devices:?}");
    }

    /// The devices of `node` in a `/api/cluster` answer that some role holds:
    /// `kind:index` and the roles.
    fn held_on(json: &serde_json::Value, node: &str) -> Vec<(String, Vec<String>)> {
        let nodes = json["nodes"].as_array().cloned().unwrap_or_default();
        let Some(n) = nodes.iter().find(|n| n["name"] == node) else {
            return Vec::new();
        };
        n["devices"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|d| {
                let by: Vec<String> = serde_json::from_value(d["held_by"].clone()).ok()?;
                let device = format!("{}:{}", d["kind"].as_str()?, d["index"]);
                (!by.is_empty()).then_some((device, by))
            })
            .collect()
    }

    /// `node`'s `/api/cluster` once `ok` holds of it, re-read at each change of its
    /// directory (or every 200 ms) for at most 10 s.
    async fn view_when(
        node: &Node,
        events: &ClusterEvents,
        ok: impl Fn(&serde_json::Value) -> bool,
    ) -> serde_json::Value {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let epoch = node.directory().epoch();
            let json = cluster_json(node, events, 0);
            if ok(&json) {
                return json;
            }
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            assert!(!left.is_zero(), "the view never got there: {json:#}");
            let step = left.min(Duration::from_millis(200));
            node.directory()
                .wait_until(step, |d| d.epoch() != epoch)
                .await;
        }
    }

    /// Two real nodes over QUIC on loopback: a role that node b spawned (reachable,
    /// so in the directory) shows on a's page as the holder of b's device, and goes
    /// when it stops; a role only a's process reaches shows on a's own device.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_nodes_view_shows_the_roles_another_node_runs_on_its_devices() {
        let ca = tempfile::tempdir().unwrap();
        let config = NodeConfig {
            virtual_devices: 2,
            ..NodeConfig::default()
        };
        let a = Node::builder("view-a")
            .dev_certs(ca.path())
            .config(config.clone())
            .start()
            .await
            .unwrap();
        let b = Node::builder("view-b")
            .dev_certs(ca.path())
            .config(config)
            .seed(a.addr())
            .start()
            .await
            .unwrap();
        let events = ClusterEvents::start(&a);
        // b's last device, whatever its kind (CUDA where the machine has GPUs).
        let last = b.info().devices.last().cloned().expect("b has devices");
        let on_b = DeviceGroup {
            node: b.name().into(),
            devices: vec![last.index],
            cuda: last.kind == DeviceKind::Cuda,
        };
        let kind = format!("{:?}", last.kind).to_lowercase();
        let policy = RoleActor::start(Holds("policy"), on_b, 1).await.unwrap();
        let policy = b.spawn("policy", 0, policy).unwrap();
        let reward = RoleActor::start(Holds("reward"), DeviceGroup::cpu(a.name()), 1)
            .await
            .unwrap();
        let reward = a.spawn_local("reward", 0, reward).unwrap();
        let b_device = (format!("{kind}:{}", last.index), vec!["policy".to_string()]);
        let json = view_when(&a, &events, |j| held_on(j, "view-b") == [b_device.clone()]).await;
        let on_a = held_on(&json, "view-a");
        assert!(
            on_a.len() == 1 && on_a[0].1 == ["reward"],
            "a's own local role on its device: {on_a:?}"
        );
        let t = Duration::from_secs(10);
        policy.ask(RoleRequest::Stop, t).await.unwrap();
        let json = view_when(&a, &events, |j| held_on(j, "view-b").is_empty()).await;
        assert_eq!(held_on(&json, "view-a").len(), 1, "a's role still runs");
        reward.ask(RoleRequest::Stop, t).await.unwrap();
        view_when(&a, &events, |j| held_on(j, "view-a").is_empty()).await;
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
