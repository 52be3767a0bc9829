//! The job config: its TOML sections, how it is read, and the one validation that every
//! build trusts.
pub(crate) mod checks;
pub(crate) mod modes;
pub(crate) mod parse;
pub(crate) mod placement;
pub(crate) mod reference;
pub(crate) mod reward_code;
pub(crate) mod sections;
pub(crate) mod shards;
pub(crate) mod user_roles;
pub(crate) mod validate;
