//! The registry builder [`main_with`](crate::node::main_with) hands a user: their roles,
//! each under a name peers spawn it by.

use serde::de::DeserializeOwned;
use yatt_roles::{DeviceGroup, Role, RoleActor, RoleError};
use yatt_runtime::{Message, NodeBuilder};

use crate::node::error::DaemonError;

/// Requests a user role's thread queues before its actor's mailbox takes the
/// backpressure (as the built-in roles).
const ROLE_QUEUE: usize = 4;

/// The names the stock node registers: the built-in RLHF roles and the runtime's
/// diagnostic actors. A user role may not take one.
const BUILTIN_NAMES: [&str; 9] = [
    "rollout",
    "policy",
    "reference",
    "reward",
    "critic",
    "policy-ring",
    "preflight",
    "echo",
    "bulk-sink",
];

type Registration = Box<dyn FnOnce(NodeBuilder) -> NodeBuilder>;

/// A user's roles for a `yatt-node`: chain [`Roles::role`] / [`Roles::role_with`].
pub struct Roles {
    names: Vec<String>,
    registrations: Vec<Registration>,
}

impl Roles {
    /// No roles yet.
    pub fn new() -> Self {
        Roles {
            names: Vec::new(),
            registrations: Vec::new(),
        }
    }

    /// Registers role `R` under `name`. A peer spawns it with the role's own value as
    /// the arguments (`node.spawn_remote_linked::<RoleRequest<R::Request>,
    /// RoleResponse<R::Response>, _>(host, name, &my_role, timeout)`, or a job's
    /// `[roles.*]` section naming the role); the node deserializes it, runs
    /// [`Role::start`] on the role's own thread and answers with the spawn's outcome
    /// (a refusal carries the role's reason).
    pub fn role<R>(self, name: &str) -> Self
    where
        R: Role + DeserializeOwned,
        R::Request: Message,
        R::Response: Message,
    {
        self.role_with(name, |r: R| Ok(r))
    }

    /// Registers a role built by `make` from spawn arguments `A` (a config struct, a
    /// tuple): for a role that is not itself deserializable (it holds a model, a
    /// connection). An `Err` from `make` refuses the spawn with that reason.
    pub fn role_with<A, R, F>(mut self, name: &str, make: F) -> Self
    where
        A: DeserializeOwned + Send + 'static,
        R: Role,
        R::Request: Message,
        R::Response: Message,
        F: Fn(A) -> Result<R, RoleError> + Clone + Send + Sync + 'static,
    {
        let role_name = name.to_string();
        self.names.push(role_name.clone());
        self.registrations
            .push(Box::new(move |builder: NodeBuilder| {
                let factory_name = role_name.clone();
                builder.factory_async(&factory_name, move |args: A| {
                    let make = make.clone();
                    let name = role_name.clone();
                    async move {
                        RoleActor::<R>::build(
                            &name,
                            move || make(args),
                            DeviceGroup::cpu(&name),
                            ROLE_QUEUE,
                        )
                        .await
                        .map_err(|e| e.to_string())
                    }
                })
            }));
        self
    }

    /// The names registered so far.
    pub fn names(&self) -> Vec<String> {
        self.names.clone()
    }

    /// Refuses names that clash with a built-in role or with each other, and names a
    /// runtime actor name could not hold.
    pub(crate) fn check(&self) -> Result<(), DaemonError> {
        for (i, name) in self.names.iter().enumerate() {
            if BUILTIN_NAMES.contains(&name.as_str()) {
                return Err(DaemonError::Refused(format!(
                    "role name {name:?} is taken by yatt-node's built-in {name} role; register yours under another name (e.g. \"my-{name}\") and name it in the job's [roles] section"
                )));
            }
            if self.names[..i].contains(name) {
                return Err(DaemonError::Refused(format!(
                    "role name {name:?} is registered twice; give each role its own name"
                )));
            }
            yatt_runtime::validate_segment("role name", name).map_err(|e| {
                DaemonError::Refused(format!("role name {name:?} cannot name an actor: {e}"))
            })?;
        }
        Ok(())
    }

    /// Adds every registration to `builder`.
    pub(crate) fn register(self, builder: NodeBuilder) -> NodeBuilder {
        self.registrations
            .into_iter()
            .fold(builder, |b, register| register(b))
    }

    /// `builder` with these roles registered, for a node started in-process (tests, a
    /// service embedding a node) rather than by the daemon; refuses clashing names.
    pub fn into_builder(self, builder: NodeBuilder) -> Result<NodeBuilder, DaemonError> {
        self.check()?;
        Ok(self.register(builder))
    }
}

impl Default for Roles {
    fn default() -> Self {
        Roles::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use yatt_roles::{ResourceProfile, Sample};

    #[derive(serde::Deserialize)]
    struct Noop;

    impl Role for Noop {
        type Request = Vec<Sample>;
        type Response = Vec<Sample>;
        fn name(&self) -> &str {
            "noop"
        }
        fn profile(&self) -> ResourceProfile {
            ResourceProfile::cpu_only()
        }
        fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
            Ok(())
        }
        fn serve(&mut self, s: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
            Ok(s)
        }
    }

    fn refusal(roles: Roles) -> String {
        match roles.check() {
            Ok(()) => panic!("accepted {:?}", roles.names()),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn names_are_checked() {
        let ok = Roles::new().role::<Noop>("a").role::<Noop>("b");
        assert!(ok.check().is_ok());
        assert_eq!(ok.names(), vec!["a", "b"]);
        let e = refusal(Roles::new().role::<Noop>("reward"));
        assert!(
            e.contains("built-in reward role") && e.contains("my-reward"),
            "{e}"
        );
        let e = refusal(Roles::new().role::<Noop>("x").role::<Noop>("x"));
        assert!(e.contains("twice"), "{e}");
        let e = refusal(Roles::new().role::<Noop>("has/slash"));
        assert!(e.contains("cannot name an actor"), "{e}");
    }
}
