//! The live placement actor: it watches each step's stage times, feeds the placement
//! policy of `yatt-placement`, and moves device groups between the rollout and the
//! policy while the job runs, embedded or on a cluster.
pub(crate) mod build;
pub(crate) mod errors;
pub(crate) mod lost_replica;
pub(crate) mod lost_shared;
pub(crate) mod membership;
pub(crate) mod migrate;
pub(crate) mod observe;
pub(crate) mod replicas;
pub(crate) mod routing;
pub(crate) mod sharded_pool;
pub(crate) mod state;
pub(crate) mod step;
