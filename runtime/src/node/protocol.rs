//! The system messages nodes exchange: joins, heartbeats, directory changes, fail-over,
//! remote spawns.

use std::net::SocketAddr;

use serde::{Deserialize, Serialize};

use crate::addr::ActorId;
use crate::directory::{Change, Directory, Update};
use crate::leadership::{Beat, BeatReply, Lead};
use crate::membership::NodeInfo;

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
        /// The actors the node hosts (empty for a first join).
        hosted: Vec<ActorId>,
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
