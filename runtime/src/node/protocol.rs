//! The system messages nodes exchange: joins, heartbeats, directory changes, remote
//! spawns.

use std::any::Any;
use std::collections::HashMap;
use std::future::Future;
use std::marker::PhantomData;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::actor::{
    spawn_with_id, Actor, ActorError, ActorRef, BoxFuture, CallError, ExitReason, RemoteRoute,
    TellError,
};
use crate::addr::{next_incarnation, validate_segment, ActorId, ActorName, AddrError};
use crate::directory::{Change, Directory, DirectoryError, DirectoryHandle, Liveness, Update};
use crate::membership::{local_inventory, FailureDetector, NodeInfo};
use crate::message::{Message, Wire};
use crate::supervisor::{supervise, Lifecycle, RestartPolicy, Supervised};
use crate::tls::{ClusterCa, NodeIdentity, TlsError};
use crate::transport::{Dispatch, PeerBook, Target, Transport, TransportConfig, TransportError};
use super::builder::NodeBuilder;
use super::config::{NodeConfig, NodeError};
use super::dispatch::{NodeBook, NodeDispatch, NodeHooks, RemoteActor};
use super::state::{FactoryFn, Hosted, Inbox, Node, NodeInner, TypedInbox, WeakNode};

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
