//! A node: one process's share of the cluster.
//!
//! A node owns the QUIC transport, a replica of the directory, the actors it hosts and
//! the factories it can spawn remotely. The first node of a cluster (no seed) leads the
//! directory: it orders every change and watches every member's heartbeats. Others join
//! through any member's address (a member that does not lead redirects to the leader),
//! heartbeat the leader, and follow its directory updates. When the leader falls
//! silent, the member that joined first after it leads the next term
//! (`crate::leadership`); a member that stalled past the failure bound learns it was
//! declared dead from its leader's answer, stops what it hosted, and rejoins under a new
//! incarnation (`failover.rs`). A seedless node given its launcher's other nodes as
//! peers rejoins a live cluster instead of founding a second one (`founding.rs`).
//!
//! ```no_run
//! use std::time::Duration;
//! use yatt_runtime::{Actor, ActorError, Context, Node};
//!
//! struct Greeter;
//! impl Actor for Greeter {
//!     type Request = String;
//!     type Response = String;
//!     async fn handle(&mut self, who: String, _: &mut Context) -> Result<String, ActorError> {
//!         Ok(format!("hello, {who}"))
//!     }
//! }
//!
//! # async fn demo() -> Result<(), Box<dyn std::error::Error>> {
//! let seed = Node::builder("alpha").dev_certs("/tmp/yatt-dev-ca").start().await?;
//! let member = Node::builder("beta")
//!     .dev_certs("/tmp/yatt-dev-ca")
//!     .seed(seed.addr())
//!     .factory("greeter", |_: ()| Ok(Greeter))
//!     .start()
//!     .await?;
//! let greeter = seed
//!     .spawn_remote::<String, String, _>("beta", "greeter", &(), Duration::from_secs(5))
//!     .await?;
//! let answer = greeter.ask("world".to_string(), Duration::from_secs(1)).await?;
//! assert_eq!(answer, "hello, world");
//! # Ok(()) }
//! ```
//!
//! This file only declares and re-exports; each concern is a leaf file.

mod builder;
mod cluster;
mod config;
mod dispatch;
mod failover;
mod founding;
mod local;
mod protocol;
mod remote;
mod spawn_tickets;
mod state;
mod system;

pub use builder::NodeBuilder;
pub use config::{NodeConfig, NodeError};
pub use state::{Node, WeakNode};
