//! `yatt-node`, the daemon that hosts actors for a yatt cluster, as a library: the
//! stock binary is [`main`], and a daemon of your own with extra roles is
//! [`main_with`]:
//!
//! ```no_run
//! # use yatt::roles::{DeviceGroup, ResourceProfile, Role, RoleError, Sample};
//! # #[derive(serde::Deserialize)] struct MyReward;
//! # impl Role for MyReward {
//! #     type Request = Vec<Sample>; type Response = Vec<Sample>;
//! #     fn name(&self) -> &str { "my-reward" }
//! #     fn profile(&self) -> ResourceProfile { ResourceProfile::cpu_only() }
//! #     fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> { Ok(()) }
//! #     fn serve(&mut self, s: Vec<Sample>) -> Result<Vec<Sample>, RoleError> { Ok(s) }
//! # }
//! fn main() -> std::process::ExitCode {
//!     yatt::node::main_with(|r| r.role::<MyReward>("my-reward"))
//! }
//! ```
//!
//! It is the same daemon (`init`, `cert`, `run`, the same flags and config file,
//! `/health` and `/metrics`, graceful shutdown) with the built-in roles and yours in
//! its factory registry: a peer spawns `my-reward` by name with the role's value as the
//! spawn arguments (see [`Roles::role`]).

mod daemon;
mod error;
mod roles;

pub use daemon::cli_command;
pub use error::DaemonError;
pub use roles::Roles;

/// The stock `yatt-node`: the built-in roles only.
pub fn main() -> std::process::ExitCode {
    main_with(|r| r)
}

/// A `yatt-node` with the roles `roles` adds, e.g.
/// `yatt::node::main_with(|r| r.role::<MyReward>("my-reward"))`. A name that clashes
/// with a built-in role or with another of yours stops the daemon before it starts,
/// naming the clash.
pub fn main_with(roles: impl FnOnce(Roles) -> Roles) -> std::process::ExitCode {
    crate::exit_code(run_with(roles))
}

/// [`main_with`], returning the error instead of printing it.
pub fn run_with(roles: impl FnOnce(Roles) -> Roles) -> Result<(), DaemonError> {
    let roles = roles(Roles::new());
    roles.check()?;
    daemon::main_with_roles(roles)
}
