//! Building a job: its models and roles, where they run (this process or cluster
//! nodes), and the controllers over them.
pub(crate) mod cluster;
pub(crate) mod critic;
pub(crate) mod custom;
pub(crate) mod data;
pub(crate) mod devices;
pub(crate) mod embedded;
pub(crate) mod first_sync;
pub(crate) mod heads;
pub(crate) mod parts;
pub(crate) mod policy_rebuild;
pub(crate) mod remote;
pub(crate) mod replica;
pub(crate) mod respawn;
pub(crate) mod reward;
pub(crate) mod sharded_cluster;
pub(crate) mod user_roles;
