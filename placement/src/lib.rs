//! # yatt-placement
//!
//! Decides which GPU groups serve which roles. What belongs here: the device inventory
//! built from cluster membership, placement plans (full colocation, partial colocation,
//! disaggregated), the cost model, the deterministic placement policy (events in,
//! decisions out, no I/O), the plan search, and the discrete-event cluster simulator
//! that drives the same policy. It never links tch.
//!
//! The core has no I/O and no clocks: time arrives in events, so the live placement
//! actor and the simulator drive the same [`policy::PlacementPolicy`].

pub mod calibrate;
pub mod cost;
pub mod inventory;
pub mod plan;
pub mod policy;
pub mod profile;
pub mod record;
pub mod search;
pub mod sim;
pub mod workload;

pub use cost::{CostModel, CostSetup, Prediction, Shape, Stage, StageObs, StepMetrics};
pub use inventory::{Group, GroupId, Inventory, InventoryError};
pub use plan::{Mode, Move, Plan, PlanError, Pool};
pub use policy::{Decision, Event, Limits, Migration, PlacementPolicy, PolicyConfig, Reason};
pub use profile::{GpuSpec, JobShape, ModelSpec, RewardKind, Role, RoleSet};
