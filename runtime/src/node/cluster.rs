//! Cluster membership from a node's side: joining, heartbeats, failure detection,
//! following the leader's directory, leaving.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::state::{Hosted, Node};
use crate::actor::ExitReason;
use crate::addr::ActorName;
use crate::directory::{Change, Directory, Update};
use crate::membership::{FailureDetector, NodeInfo};

impl Node {
    pub(super) fn lock_detector(&self) -> std::sync::MutexGuard<'_, FailureDetector> {
        self.inner
            .detector
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Side effects of a directory change on this node: forget dead peers and release
    /// the actors they owned.
    pub(super) fn follow_update(&self, update: &Update) {
        if let Change::NodeDown { node, .. } = &update.change {
            if node != self.name() {
                self.inner.transport.forget(node);
                self.release_owned_by(node);
            }
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

    /// Leader: sends an update to every alive member, in order.
    pub(super) async fn broadcast(&self, update: Update) {
        self.follow_update(&update);
        let members: Vec<String> = self.inner.directory.read(|d| {
            d.alive_nodes()
                .filter(|n| n.name != self.name())
                .map(|n| n.name.clone())
                .collect()
        });
        let sends = members.into_iter().map(|m| {
            let node = self.clone();
            let update = update.clone();
            async move { node.system_tell(&m, SysRequest::Update(update)).await }
        });
        futures::future::join_all(sends).await;
    }

    pub(super) async fn join(&self, seed: SocketAddr) -> Result<(), NodeError> {
        let join_err = |reason: String| NodeError::Join { seed, reason };
        let leader = self
            .inner
            .transport
            .connect_seed(seed)
            .await
            .map_err(|e| join_err(e.to_string()))?;
        *self.inner.leader.lock().unwrap_or_else(|p| p.into_inner()) = leader.clone();
        // The seed is the leader; it is reachable by name once we know its address.
        self.inner.directory.reset(seed_directory(&leader, seed));
        let reply = self
            .system_call(&leader, SysRequest::Join(self.inner.info.clone()))
            .await
            .map_err(|e| join_err(e.to_string()))?;
        match reply {
            SysResponse::Directory(d) => {
                self.inner.directory.reset(d);
                self.lock_detector()
                    .heard(&leader, tokio::time::Instant::now());
                Ok(())
            }
            SysResponse::Error(e) => Err(join_err(e)),
            other => Err(join_err(format!("unexpected answer {other:?}"))),
        }
    }

    pub(super) async fn resync(&self) {
        let leader = self.leader();
        if let Ok(SysResponse::Directory(d)) = self.system_call(&leader, SysRequest::Snapshot).await
        {
            self.inner.directory.reset(d);
        }
    }

    pub(super) async fn heartbeat_loop(self) {
        let mut shutdown = self.inner.shutdown.subscribe();
        let mut tick = tokio::time::interval(self.inner.config.heartbeat_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Silence is checked more often than heartbeats are sent, so detection takes
        // at most failure_timeout plus this, not plus a whole heartbeat period.
        let mut check = tokio::time::interval(
            self.inner
                .config
                .heartbeat_interval
                .min(Duration::from_millis(100)),
        );
        check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => self.send_heartbeats(),
                _ = check.tick() => self.declare_silent_peers_dead().await,
                _ = shutdown.changed() => return,
            }
        }
    }

    pub(super) fn send_heartbeats(&self) {
        let me = SysRequest::Heartbeat {
            node: self.name().to_string(),
            incarnation: self.inner.info.incarnation,
        };
        let targets: Vec<String> = if self.is_leader() {
            self.inner.directory.read(|d| {
                d.alive_nodes()
                    .filter(|n| n.name != self.name())
                    .map(|n| n.name.clone())
                    .collect()
            })
        } else {
            vec![self.leader()]
        };
        for t in targets {
            let (node, me) = (self.clone(), me.clone());
            tokio::spawn(async move { node.system_tell(&t, me).await });
        }
    }

    pub(super) async fn declare_silent_peers_dead(&self) {
        let dead = self.lock_detector().expired(tokio::time::Instant::now());
        for node in dead {
            tracing::warn!(%node, timeout = ?self.inner.config.failure_timeout, "peer silent: declaring it dead");
            let change = Change::NodeDown {
                node: node.clone(),
                reason: ExitReason::NodeDown(format!(
                    "no heartbeat for {:?}",
                    self.inner.config.failure_timeout
                )),
            };
            if self.is_leader() {
                if let Ok(Some(update)) = self.inner.directory.apply(change) {
                    self.broadcast(update).await;
                }
            } else {
                // The leader itself went silent. There is no fail-over yet: mark it
                // dead locally so callers fail fast instead of hanging.
                let _ = self.inner.directory.apply(change);
                self.inner.transport.forget(&node);
            }
        }
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
        if !self.is_leader() {
            let leader = self.leader();
            let _ = tokio::time::timeout(
                self.inner.config.system_timeout,
                self.system_call(
                    &leader,
                    SysRequest::Leave {
                        node: self.name().to_string(),
                    },
                ),
            )
            .await;
        } else if let Ok(Some(update)) = self.inner.directory.apply(Change::NodeDown {
            node: self.name().to_string(),
            reason: ExitReason::Normal,
        }) {
            self.broadcast(update).await;
        }
        self.inner.transport.close().await;
        tracing::info!(node = %self.name(), "left the cluster");
    }
}

/// A directory that knows only the seed, so the first call can reach it by name.
fn seed_directory(leader: &str, addr: SocketAddr) -> Directory {
    let mut d = Directory::default();
    let mut info = NodeInfo::for_tests(leader, 0);
    info.addr = addr;
    info.host_id = String::new();
    let _ = d.apply(Change::NodeUp(info));
    d
}
