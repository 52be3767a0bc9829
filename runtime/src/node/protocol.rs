//! The system messages nodes exchange: joins, heartbeats, directory changes, remote
//! spawns.

use serde::{Deserialize, Serialize};

use crate::addr::ActorId;
use crate::directory::{Change, Directory, Update};
use crate::membership::NodeInfo;

/// System requests between nodes.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum SysRequest {
    Join(NodeInfo),
    Heartbeat {
        node: String,
        incarnation: u64,
    },
    Update(Update),
    Propose(Change),
    Snapshot,
    Spawn {
        role: String,
        replica: Option<u32>,
        args: Vec<u8>,
        /// Release the actor when the asking node leaves or dies.
        linked: bool,
    },
    Leave {
        node: String,
    },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub(super) enum SysResponse {
    Directory(Directory),
    Ack,
    Spawned(ActorId),
    Error(String),
}
