//! The system messages nodes exchange: joins, heartbeats, directory changes, fail-over,
//! remote spawns.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::addr::ActorId;
use crate::directory::{Change, Directory, Update};
use crate::leadership::{Beat, BeatReply, Lead};
use crate::membership::{DeviceClaim, NodeInfo};

/// A remote spawn's arguments: postcard of the factory's argument type (a program
/// that links it), or a JSON document of it (a job config naming a role it cannot link).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) enum SpawnArgs {
    Postcard(Vec<u8>),
    Json(String),
}

/// System requests between nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum SysRequest {
    /// Join, or (same incarnation) report to a new leader what this node hosts.
    Join {
        info: NodeInfo,
        /// The actors the node hosts, with the devices each holds (empty for a first
        /// join).
        hosted: Vec<(ActorId, Option<DeviceClaim>)>,
    },
    Heartbeat(Beat),
    Update(Update),
    Propose(Change),
    Snapshot,
    /// A candidate asks whether the asked node still hears `leader`.
    LeaderCheck {
        leader: String,
    },
    Spawn {
        role: String,
        replica: Option<u32>,
        args: SpawnArgs,
        /// Release the actor when the asking node leaves or dies.
        linked: bool,
        /// The caller's number for this spawn, to cancel it by.
        ticket: u64,
    },
    /// The caller gave up on its spawn `ticket` (timed out, or dropped the call): undo
    /// it, now if it is done, else when it finishes.
    CancelSpawn {
        ticket: u64,
    },
    Leave {
        node: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum SysResponse {
    Directory(Directory),
    /// A join was accepted: the leader and its directory.
    Joined {
        lead: Lead,
        directory: Directory,
    },
    /// Not the leader: ask this one (`addr: None` when its address is unknown here).
    Redirect {
        lead: Lead,
        addr: Option<SocketAddr>,
    },
    /// The joining name belongs to a live member.
    NameInUse {
        incarnation: u64,
        addr: SocketAddr,
        silent_for_ms: u64,
        bound_ms: u64,
    },
    /// The asking incarnation was declared dead.
    Expelled {
        reason: String,
    },
    Beat(BeatReply),
    /// The answer to `LeaderCheck`: whom the asked node follows, whether it heard that
    /// leader within the failure bound, and how new its replica is.
    LeaderSeen {
        lead: Lead,
        hears: bool,
        version: (u64, u64),
    },
    Ack,
    Spawned(ActorId),
    Error(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::ExitReason;
    use crate::tls::test_support::assert_pinned_to_alpn;

    /// One value of every system message, each variant by an exhaustive match so that a
    /// new variant cannot be left out.
    fn every_message() -> Vec<Vec<u8>> {
        let info = NodeInfo::for_tests("n", 7);
        let lead = Lead {
            term: 2,
            leader: "n".into(),
        };
        let id: ActorId = "n/role/0#5".parse().unwrap();
        let claim = DeviceClaim {
            devices: vec![0, 3],
            cuda: true,
        };
        let change = Change::ActorDown {
            id: id.clone(),
            reason: ExitReason::StartFailed("x".into()),
        };
        let update = Update {
            term: 2,
            epoch: 3,
            change: change.clone(),
        };
        let requests = vec![
            SysRequest::Join {
                info: info.clone(),
                hosted: vec![(id.clone(), Some(claim.clone())), (id.clone(), None)],
            },
            SysRequest::Heartbeat(Beat {
                node: "n".into(),
                incarnation: 7,
                lead: lead.clone(),
            }),
            SysRequest::Update(update),
            SysRequest::Propose(change),
            SysRequest::Propose(Change::ActorUp {
                id: id.clone(),
                claim: Some(claim.clone()),
            }),
            SysRequest::Propose(Change::ActorClaim {
                id: id.clone(),
                claim: Some(claim.clone()),
            }),
            SysRequest::Snapshot,
            SysRequest::LeaderCheck { leader: "n".into() },
            SysRequest::Spawn {
                role: "r".into(),
                replica: Some(1),
                args: SpawnArgs::Json("{}".into()),
                linked: true,
                ticket: 9,
            },
            SysRequest::CancelSpawn { ticket: 9 },
            SysRequest::Leave { node: "n".into() },
        ];
        // A directory with a node and an actor's record (its device claim too).
        let mut directory = Directory::default();
        directory.apply(Change::NodeUp(info.clone())).unwrap();
        directory
            .apply(Change::ActorUp {
                id: id.clone(),
                claim: Some(claim.clone()),
            })
            .unwrap();
        let responses = vec![
            SysResponse::Directory(directory),
            SysResponse::Joined {
                lead: lead.clone(),
                directory: Directory::default(),
            },
            SysResponse::Redirect {
                lead: lead.clone(),
                addr: Some("127.0.0.1:1".parse().unwrap()),
            },
            SysResponse::NameInUse {
                incarnation: 1,
                addr: "127.0.0.1:1".parse().unwrap(),
                silent_for_ms: 2,
                bound_ms: 3,
            },
            SysResponse::Expelled { reason: "x".into() },
            SysResponse::Beat(BeatReply::Follow(lead.clone())),
            SysResponse::LeaderSeen {
                lead,
                hears: true,
                version: (1, 2),
            },
            SysResponse::Ack,
            SysResponse::Spawned(id),
            SysResponse::Error("x".into()),
        ];
        for r in &requests {
            match r {
                SysRequest::Join { .. }
                | SysRequest::Heartbeat(_)
                | SysRequest::Update(_)
                | SysRequest::Propose(_)
                | SysRequest::Snapshot
                | SysRequest::LeaderCheck { .. }
                | SysRequest::Spawn { .. }
                | SysRequest::CancelSpawn { .. }
                | SysRequest::Leave { .. } => {}
            }
        }
        for r in &responses {
            match r {
                SysResponse::Directory(_)
                | SysResponse::Joined { .. }
                | SysResponse::Redirect { .. }
                | SysResponse::NameInUse { .. }
                | SysResponse::Expelled { .. }
                | SysResponse::Beat(_)
                | SysResponse::LeaderSeen { .. }
                | SysResponse::Ack
                | SysResponse::Spawned(_)
                | SysResponse::Error(_) => {}
            }
        }
        let mut out: Vec<Vec<u8>> = requests
            .iter()
            .map(|r| postcard::to_stdvec(r).unwrap())
            .collect();
        out.extend(responses.iter().map(|r| postcard::to_stdvec(r).unwrap()));
        out
    }

    /// The system messages' encoding, pinned to the ALPN that names it. A change that
    /// alters how they encode (a field added, a variant moved) fails this test until the
    /// ALPN in `tls.rs` is bumped, so a node of another build is refused at the handshake
    /// instead of misreading these messages. Bump it, then put the new fingerprint here.
    #[test]
    fn the_system_messages_encoding_is_pinned_to_the_alpn() {
        assert_pinned_to_alpn("system messages", every_message(), 2_048_287_145);
    }
}
