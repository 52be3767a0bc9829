//! Starting a job's roles on cluster nodes: what a node's factory takes, the spawn
//! itself, and waiting for the nodes a placement names.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_roles::{Role, RoleActor, RoleError, RoleRequest, RoleResponse};
use yatt_runtime::{ActorRef, Directory, Message, Node, NodeError};

use crate::build::devices::role_group;
use crate::config::checks::invalid;
use crate::config::sections::JobConfig;
use crate::controller::error::ControllerError;
use crate::error::JobError;

/// Requests a role's thread queues before its actor's mailbox takes the backpressure.
const ROLE_QUEUE: usize = 4;

/// How long a cluster build waits for the nodes its placement names to join.
const NODES_WAIT: Duration = Duration::from_secs(10);

/// What a node needs to build one of a job's roles.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoleArgs {
    /// The job config as TOML (postcard cannot carry its untagged values).
    pub job: String,
    /// The node the role runs on.
    pub node: String,
    /// A resumed run's checkpoint (absolute): the policy and the critic load their
    /// trainer state (weights, AdamW moments, step) from it instead of starting fresh.
    pub checkpoint: Option<PathBuf>,
}

/// Spawns `role` of the job (`text`: its config as TOML) on the node `target`, linked
/// to `node`, with the `placement.spawn_timeout_s` deadline.
pub(crate) async fn spawn<Req: Message, Resp: Message>(
    job: &JobConfig,
    text: &str,
    node: &Node,
    role: &'static str,
    target: &str,
    checkpoint: Option<&Path>,
) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, ControllerError> {
    let args = RoleArgs {
        job: text.to_string(),
        node: target.to_string(),
        checkpoint: checkpoint.map(Path::to_path_buf),
    };
    spawn_with(job, node, role, target, &args).await
}

/// [`spawn`] with a factory's own arguments `args`.
pub(crate) async fn spawn_with<Req: Message, Resp: Message, A: Serialize>(
    job: &JobConfig,
    node: &Node,
    role: &'static str,
    target: &str,
    args: &A,
) -> Result<ActorRef<RoleRequest<Req>, RoleResponse<Resp>>, ControllerError> {
    let timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    node.spawn_remote_linked(target, role, args, timeout)
        .await
        .map_err(|e| ControllerError::Spawn {
            role: format!("{role} on node {target}"),
            reason: match e {
                NodeError::NoFactory { known, .. } => format!(
                    "that node cannot spawn it (it registers {known:?}); run a yatt-node of this yatt build there"
                ),
                other => other.to_string(),
            },
        })
}

/// Waits (briefly: nodes started just before the run may still be joining) until every
/// `(key, node)` of `named` is alive in the cluster `node` belongs to; otherwise names
/// the key, the missing node and the nodes there are.
pub(crate) async fn wait_for_nodes(
    node: &Node,
    named: &[(String, String)],
) -> Result<(), JobError> {
    let all_alive = |d: &Directory| {
        named
            .iter()
            .all(|(_, want)| d.alive_nodes().any(|n| n.name == *want))
    };
    if !node.directory().read(all_alive) {
        tracing::info!(wait = ?NODES_WAIT, "waiting for the placement's nodes to join");
        node.directory().wait_until(NODES_WAIT, all_alive).await;
    }
    let mut alive: Vec<String> = node
        .directory()
        .read(|d| d.alive_nodes().map(|n| n.name.clone()).collect());
    alive.sort();
    for (key, want) in named {
        if !alive.iter().any(|n| n == want) {
            return Err(invalid(
                key,
                &format!("a node of the cluster: {}", alive.join(", ")),
                &format!("{want:?}"),
                &format!("start it (`yatt-node run --name {want} --seed ...`) or name one of the nodes above"),
            ));
        }
    }
    Ok(())
}

/// The job config as the nodes' factories take it: postcard cannot carry the config's
/// untagged values; TOML can, and the node validates what it gets.
pub(crate) fn job_text(job: &JobConfig) -> Result<String, JobError> {
    toml::to_string(job).map_err(|e| JobError::Parse {
        origin: "the job config".into(),
        message: format!("cannot encode it for the nodes: {e}"),
    })
}

/// Builds a role from the job in `args` on the role's own thread and starts it there.
pub(crate) async fn start_role<R: Role>(
    args: RoleArgs,
    name: &'static str,
    make: impl FnOnce(&JobConfig) -> Result<R, JobError> + Send + 'static,
) -> Result<RoleActor<R>, String> {
    let job = JobConfig::parse(&args.job, "the job config sent by the controller", &[])
        .map_err(|e| e.to_string())?;
    let group = role_group(&job, &args.node).map_err(|e| e.to_string())?;
    let build = move || make(&job).map_err(|e| RoleError::Failed(e.to_string()));
    RoleActor::build(name, build, group, ROLE_QUEUE)
        .await
        .map_err(|e| e.to_string())
}
