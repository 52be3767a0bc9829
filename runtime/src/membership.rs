//! Cluster membership: what a node reports about itself, the failure detector, and
//! the pause detector that keeps a node's own stall from being read as its peers'.
//!
//! [`FailureDetector`] and [`PauseDetector`] are pure (time is passed in), so their
//! bounds are unit-tested; the node feeds them heartbeats and timer ticks.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use crate::cert_kind::CertKind;

/// The kind of a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceKind {
    /// An NVIDIA GPU, as the driver lists it.
    Cuda,
    /// A slot on a machine without GPUs, for running and testing placement on CPU.
    Virtual,
}

/// One device a node offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceInfo {
    /// Index on the node (the CUDA ordinal for GPUs).
    pub index: u32,
    /// GPU or virtual.
    pub kind: DeviceKind,
    /// A human-readable name, e.g. "NVIDIA H100 80GB HBM3".
    pub name: String,
    /// Device memory in bytes (for virtual devices, a share of host memory).
    pub memory_bytes: u64,
}

/// The devices of its node an actor holds while it runs (an accelerator's model and
/// caches), as it reports them when it registers: the directory records them with the
/// actor, so every node sees which actor holds which device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceClaim {
    /// Device indices on the actor's node (CUDA ordinals, or virtual device numbers).
    pub devices: Vec<u32>,
    /// Whether the devices are CUDA GPUs (false: the host CPU, or virtual devices).
    pub cuda: bool,
}

impl DeviceClaim {
    /// Whether the claim covers `device`: the same kind (CUDA or not) and a claimed index.
    pub fn covers(&self, device: &DeviceInfo) -> bool {
        self.cuda == (device.kind == DeviceKind::Cuda) && self.devices.contains(&device.index)
    }
}

/// What a node reports when it joins.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeInfo {
    /// The node's name (also the CN of its certificate).
    pub name: String,
    /// Which life of the node; a restarted node has a larger one.
    pub incarnation: u64,
    /// Where peers reach it.
    pub addr: SocketAddr,
    /// The host's name.
    pub hostname: String,
    /// Identifies the host (and its boot), so peers on the same host can use the
    /// shared-memory fast path.
    pub host_id: String,
    /// CPU cores available to the process.
    pub cpu_cores: u32,
    /// Host memory in bytes.
    pub memory_bytes: u64,
    /// Its devices.
    pub devices: Vec<DeviceInfo>,
    /// What its certificate lets it do (set by the leader from the certificate, not
    /// from what the node says).
    pub kind: CertKind,
}

impl NodeInfo {
    /// A minimal value for unit tests.
    pub fn for_tests(name: &str, incarnation: u64) -> Self {
        NodeInfo {
            name: name.to_string(),
            incarnation,
            addr: "127.0.0.1:1".parse().expect("literal address"),
            hostname: "test".into(),
            host_id: "test".into(),
            cpu_cores: 1,
            memory_bytes: 1 << 30,
            devices: Vec::new(),
            kind: CertKind::Node,
        }
    }
}

/// Reads this machine's inventory. CUDA devices come from `nvidia-smi` when it is
/// there; otherwise the node offers `virtual_devices` virtual devices that share host
/// memory equally.
pub fn local_inventory(virtual_devices: u32) -> (String, String, u32, u64, Vec<DeviceInfo>) {
    let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|_| "unknown".into());
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default();
    let host_id = format!("{hostname}/{boot_id}");
    let cpu_cores = std::thread::available_parallelism()
        .map(|n| n.get() as u32)
        .unwrap_or(1);
    let memory_bytes = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("MemTotal:"))
                .and_then(|l| {
                    l.split_whitespace()
                        .nth(1)
                        .and_then(|kb| kb.parse::<u64>().ok())
                })
        })
        .map(|kb| kb * 1024)
        .unwrap_or(0);
    let mut devices = cuda_devices();
    if devices.is_empty() {
        let share = memory_bytes / u64::from(virtual_devices.max(1));
        devices = (0..virtual_devices)
            .map(|index| DeviceInfo {
                index,
                kind: DeviceKind::Virtual,
                name: format!("virtual-{index}"),
                memory_bytes: share,
            })
            .collect();
    }
    (hostname, host_id, cpu_cores, memory_bytes, devices)
}

fn cuda_devices() -> Vec<DeviceInfo> {
    let Ok(out) = std::process::Command::new("nvidia-smi")
        .args([
            "--query-gpu=index,name,memory.total",
            "--format=csv,noheader,nounits",
        ])
        .output()
    else {
        return Vec::new();
    };
    if !out.status.success() {
        return Vec::new();
    }
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            let mut f = line.split(',').map(str::trim);
            let index = f.next()?.parse().ok()?;
            let name = f.next()?.to_string();
            let mib: u64 = f.next()?.parse().ok()?;
            Some(DeviceInfo {
                index,
                kind: DeviceKind::Cuda,
                name,
                memory_bytes: mib << 20,
            })
        })
        .collect()
}

/// Declares a peer dead when nothing was heard from it for `timeout`.
#[derive(Debug, Clone)]
pub struct FailureDetector {
    timeout: Duration,
    last_heard: HashMap<String, Instant>,
}

impl FailureDetector {
    /// A detector with the given silence bound.
    pub fn new(timeout: Duration) -> Self {
        FailureDetector {
            timeout,
            last_heard: HashMap::new(),
        }
    }

    /// Records that `node` was heard from at `now` (starts watching it if new).
    pub fn heard(&mut self, node: &str, now: Instant) {
        self.last_heard.insert(node.to_string(), now);
    }

    /// Stops watching `node` (it left, or was already declared dead).
    pub fn forget(&mut self, node: &str) {
        self.last_heard.remove(node);
    }

    /// The peers silent for longer than the bound, in name order; they are forgotten.
    pub fn expired(&mut self, now: Instant) -> Vec<String> {
        let mut dead: Vec<String> = self
            .last_heard
            .iter()
            .filter(|(_, t)| now.duration_since(**t) > self.timeout)
            .map(|(n, _)| n.clone())
            .collect();
        dead.sort();
        for n in &dead {
            self.last_heard.remove(n);
        }
        dead
    }

    /// The peers being watched.
    pub fn watched(&self) -> impl Iterator<Item = &str> {
        self.last_heard.keys().map(String::as_str)
    }

    /// How long `node` has been silent at `now`; `None` when it is not watched.
    pub fn silent_for(&self, node: &str, now: Instant) -> Option<Duration> {
        self.last_heard.get(node).map(|t| now.duration_since(*t))
    }

    /// Whether `node` was heard from within the bound at `now`.
    pub fn hears(&self, node: &str, now: Instant) -> bool {
        self.silent_for(node, now)
            .is_some_and(|s| s <= self.timeout)
    }

    /// Watches exactly `nodes`, each as if just heard from: after a leader change, or
    /// after this node itself stalled (its silence says nothing about the peers').
    pub fn watch_only<'a>(&mut self, nodes: impl IntoIterator<Item = &'a str>, now: Instant) {
        self.last_heard = nodes.into_iter().map(|n| (n.to_string(), now)).collect();
    }

    /// Treats every watched peer as just heard from (see [`PauseDetector`]).
    pub fn restart_all(&mut self, now: Instant) {
        for t in self.last_heard.values_mut() {
            *t = now;
        }
    }

    /// The silence bound.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }
}

/// Notices that this process itself stood still (SIGSTOP, a swap storm, a starved
/// runtime): a periodic tick that arrives much later than it was due. After such a
/// stall every peer looks silent, but the silence was ours; the node then gives its
/// peers a fresh bound instead of declaring them dead (as Cassandra's failure detector
/// ignores intervals after a local pause).
#[derive(Debug, Clone)]
pub struct PauseDetector {
    threshold: Duration,
    last: Option<Instant>,
}

impl PauseDetector {
    /// Reports gaps between ticks longer than `threshold`.
    pub fn new(threshold: Duration) -> Self {
        PauseDetector {
            threshold,
            last: None,
        }
    }

    /// Records a tick at `now`; returns the gap since the previous one when it exceeds
    /// the threshold (this node stalled for about that long).
    pub fn tick(&mut self, now: Instant) -> Option<Duration> {
        let gap = self.last.map(|t| now.duration_since(t));
        self.last = Some(now);
        gap.filter(|g| *g > self.threshold)
    }
}

/// Whether a node is a member of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Membership {
    /// Joined under its current incarnation and serving.
    Member,
    /// Its incarnation was declared dead (it stalled past the failure bound, or was cut
    /// off): the actors it hosted were stopped, and it is joining again under a new
    /// incarnation. It serves nothing meanwhile.
    Rejoining {
        /// Why it was declared dead, as the leader said.
        reason: String,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silent_peer_expires_after_bound_only() {
        let t0 = Instant::now();
        let mut fd = FailureDetector::new(Duration::from_secs(2));
        fd.heard("a", t0);
        fd.heard("b", t0);
        fd.heard("a", t0 + Duration::from_millis(1500));
        assert!(fd.expired(t0 + Duration::from_millis(2000)).is_empty());
        assert_eq!(
            fd.expired(t0 + Duration::from_millis(2001)),
            vec!["b".to_string()]
        );
        assert!(
            fd.expired(t0 + Duration::from_millis(2100)).is_empty(),
            "reported once"
        );
        assert_eq!(
            fd.expired(t0 + Duration::from_millis(3600)),
            vec!["a".to_string()]
        );
    }

    #[test]
    fn silence_is_measured_and_restarted() {
        let t0 = Instant::now();
        let mut fd = FailureDetector::new(Duration::from_secs(2));
        fd.watch_only(["a", "b"], t0);
        let t1 = t0 + Duration::from_secs(3);
        assert_eq!(fd.silent_for("a", t1), Some(Duration::from_secs(3)));
        assert!(!fd.hears("a", t1));
        assert_eq!(fd.silent_for("zz", t1), None);
        // This node stalled: its peers get a fresh bound instead of being declared dead.
        fd.restart_all(t1);
        assert!(fd.hears("a", t1) && fd.expired(t1).is_empty());
        assert_eq!(
            fd.expired(t1 + Duration::from_millis(2001)),
            vec!["a".to_string(), "b".to_string()]
        );
    }

    #[test]
    fn pause_detector_reports_only_long_gaps() {
        let t0 = Instant::now();
        let mut p = PauseDetector::new(Duration::from_millis(800));
        assert_eq!(p.tick(t0), None, "the first tick has nothing to compare");
        assert_eq!(p.tick(t0 + Duration::from_millis(100)), None);
        assert_eq!(
            p.tick(t0 + Duration::from_millis(900)),
            None,
            "800 ms is not over"
        );
        assert_eq!(
            p.tick(t0 + Duration::from_millis(3900)),
            Some(Duration::from_secs(3))
        );
        assert_eq!(p.tick(t0 + Duration::from_millis(4000)), None);
    }

    #[test]
    fn inventory_has_virtual_devices_without_gpus() {
        let (_, host_id, cores, mem, devices) = local_inventory(4);
        assert!(cores >= 1 && mem > 0 && !host_id.is_empty());
        if devices.iter().all(|d| d.kind == DeviceKind::Virtual) {
            assert_eq!(devices.len(), 4);
        }
    }
}
