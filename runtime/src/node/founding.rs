//! A seedless node with peers: ask them whom they follow, then found a cluster or
//! rejoin theirs (the decision is `crate::founding`'s; this file asks and waits).

use std::net::SocketAddr;

use tokio::time::Instant;

use super::config::NodeError;
use super::protocol::{SysRequest, SysResponse};
use super::state::Node;
use crate::directory::Change;
use crate::founding::{decide, Founding, PeerAnswer};
use crate::leadership::Lead;

impl Node {
    /// Leads a new cluster: term 1, this node its first member.
    pub(super) fn found(&self) -> Result<(), NodeError> {
        *self.lock_lead() = Lead {
            term: 1,
            leader: self.name().to_string(),
        };
        self.inner.directory.begin_term(1);
        self.inner.directory.apply(Change::NodeUp(self.info()))?;
        Ok(())
    }

    /// Asks `peers` whom they follow, again every heartbeat period while they still
    /// follow this node's name; leads when none belongs to a cluster, joins theirs when
    /// one does. Bounded: the members' fail-over (a failure bound and the succession's
    /// patience) plus the join's own deadline.
    pub(super) async fn found_or_rejoin(&self, peers: &[SocketAddr]) -> Result<(), NodeError> {
        let started = Instant::now();
        let config = &self.inner.config;
        let deadline = started + config.system_timeout + self.succession_patience();
        loop {
            let answers = self.ask_peers(peers).await;
            match decide(self.name(), &answers) {
                Founding::Lead => {
                    tracing::info!(node = %self.name(), peers = ?peers, asked_for = ?started.elapsed(), "no peer belongs to a cluster: leading a new one");
                    return self.found();
                }
                Founding::Join(through) => {
                    let seeds: Vec<SocketAddr> = through.iter().map(|&i| peers[i]).collect();
                    tracing::info!(node = %self.name(), through = ?seeds, asked_for = ?started.elapsed(), "a live cluster answers: rejoining it as a new incarnation");
                    return self
                        .join_through(&seeds, Instant::now() + config.system_timeout)
                        .await;
                }
                Founding::Wait { term } => {
                    if Instant::now() + config.heartbeat_interval >= deadline {
                        let members = answers
                            .iter()
                            .zip(peers)
                            .filter(|(a, _)| matches!(a, PeerAnswer::Member(_)))
                            .map(|(_, p)| *p)
                            .collect();
                        return Err(NodeError::StillFollowed {
                            name: self.name().to_string(),
                            term,
                            members,
                            waited: started.elapsed(),
                        });
                    }
                    tracing::info!(node = %self.name(), term, "the peers still follow an earlier life of this node: waiting for them to elect another leader");
                }
            }
            tokio::time::sleep(config.heartbeat_interval).await;
        }
    }

    /// One round: every peer asked at once, each within a failure bound (a peer silent
    /// that long counts as down, as the failure detector would count it).
    async fn ask_peers(&self, peers: &[SocketAddr]) -> Vec<PeerAnswer> {
        let within = self.inner.config.failure_timeout;
        let asks = peers.iter().map(|&addr| async move {
            let ask = async {
                let peer = self.inner.transport.connect_seed(addr).await.ok()?;
                if peer == self.name() {
                    return None; // itself, or another process under its name
                }
                let request = SysRequest::LeaderCheck {
                    leader: self.name().to_string(),
                };
                match self.system_call_within(&peer, request, within).await {
                    Ok(SysResponse::LeaderSeen { lead, .. }) => Some(PeerAnswer::following(lead)),
                    _ => None,
                }
            };
            let answer = tokio::time::timeout(within, ask).await.ok().flatten();
            answer.unwrap_or(PeerAnswer::Silent)
        });
        futures::future::join_all(asks).await
    }
}
