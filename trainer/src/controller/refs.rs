//! References to the roles a controller drives, and spawning a role on a node.
use yatt_roles::{
    CriticRequest, CriticResponse, DeviceGroup, PolicyRequest, PolicyResponse, Role, RoleActor,
    RoleError, RoleRequest, RoleResponse, RolloutRequest, RolloutResponse, Sample,
};
use yatt_runtime::ActorRef;
use yatt_runtime::Node;

use crate::controller::error::ControllerError;

/// A reference to a rollout role's actor.
pub type RolloutRef = ActorRef<RoleRequest<RolloutRequest>, RoleResponse<RolloutResponse>>;

/// A reference to a role that takes samples and gives them back with a field filled in
/// (reward, reference).
pub type SamplesRef = ActorRef<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>>;

/// A reference to the policy role's actor.
pub type PolicyRef = ActorRef<RoleRequest<PolicyRequest>, RoleResponse<PolicyResponse>>;

/// A reference to the critic role's actor.
pub type CriticRef = ActorRef<RoleRequest<CriticRequest>, RoleResponse<CriticResponse>>;

/// The roles one controller drives.
#[derive(Debug, Clone)]
pub struct RoleRefs {
    /// Generation.
    pub rollout: RolloutRef,
    /// Further rollout replicas the controller spreads each generation round over,
    /// with `rollout` (single-driver mode: one controller, many replicas). Empty for a
    /// parallel-controller head, which owns one replica.
    pub extra_rollouts: Vec<RolloutRef>,
    /// Rewards.
    pub reward: SamplesRef,
    /// Reference log-probs (needed for a KL penalty, a KL loss and the `actor/kl` metric).
    pub reference: Option<SamplesRef>,
    /// The trainer.
    pub policy: PolicyRef,
    /// The value model (PPO with GAE needs one; the other estimators ignore it).
    pub critic: Option<CriticRef>,
}

/// Starts `role` on its own thread on `group` and spawns its actor on `node` as
/// `node/name/replica`, reachable from this process only (its messages are moved, never
/// encoded). Roles on other nodes are spawned through their factories
/// (`crate::remote`).
pub async fn spawn_role<R: Role>(
    node: &Node,
    role: R,
    replica: u32,
    group: DeviceGroup,
) -> Result<ActorRef<RoleRequest<R::Request>, RoleResponse<R::Response>>, ControllerError> {
    let name = role.name().to_string();
    let actor = RoleActor::start(role, group, 4)
        .await
        .map_err(|e: RoleError| ControllerError::Spawn {
            role: name.clone(),
            reason: e.to_string(),
        })?;
    node.spawn_local(&name, replica, actor)
        .map_err(|e| ControllerError::Spawn {
            role: name,
            reason: e.to_string(),
        })
}

pub(crate) fn variant<T>(r: &RoleResponse<T>) -> String {
    match r {
        RoleResponse::Served(_) => "a served answer".into(),
        RoleResponse::Done => "Done".into(),
        RoleResponse::Drained(_) => "Drained".into(),
        RoleResponse::Profile(_) => "Profile".into(),
    }
}
