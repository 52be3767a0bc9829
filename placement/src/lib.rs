//! # yatt-placement
//!
//! Decides which GPU groups serve which roles. What belongs here:
//! - the cluster as placement sees it: [`NodeDesc`]s cut into groups ([`Inventory`]);
//! - placement plans ([`Plan`]: full colocation, partial colocation, disaggregated)
//!   and the rooflines and cost model that predict them ([`CostModel`]);
//! - one rank's step of ZeRO-3 sharded training, as the live trainer runs it
//!   ([`ShardedStep`]), which the simulator charges and `yatt bench sharded` checks;
//! - the workload model ([`WorkloadSpec`], [`ForecastParams`]) and the plan search
//!   ([`search`], [`assign`]);
//! - what a placer is told and decides ([`Event`], [`Decision`], [`Placer`]) and the
//!   deterministic placement policy ([`PlacementPolicy`]);
//! - the discrete-event engine ([`Sim`]) that any placer drives, which the policy
//!   also uses to judge its candidates;
//! - the live placement's record of decisions and measured moves ([`Record`]).
//!
//! What does not: scenarios, reports, calibration and plots of the simulator are in
//! `yatt-sim`; turning a runtime's membership into [`NodeDesc`]s is the consumer's
//! business, so this crate links no runtime and no tch.
//!
//! The core has no I/O and no clocks: time arrives in events, so the live placement
//! actor and the simulator drive the same [`PlacementPolicy`].

mod cost;
mod engine;
mod evaluate;
mod events;
mod inventory;
mod node;
mod plan;
mod policy;
mod profile;
mod record;
mod search;
mod sharded;
mod staleness;
mod workload;

pub use cost::{CostModel, CostSetup, Prediction, Shape, Stage, StageObs, StepMetrics};
pub use engine::{Rates, RunResult, Sim, World};
pub use events::{Decision, Event, Migration, Placer, Reason};
pub use inventory::{Group, GroupId, Inventory, InventoryError};
pub use node::{DeviceDesc, NodeDesc};
pub use plan::{Lanes, Mode, Move, Plan, PlanError, Pool};
pub use policy::{Limits, PlacementPolicy, PolicyConfig, PolicyError};
pub use profile::{
    decode_slots, forward_s_per_token, train_s_per_token, DecodeCoeffs, Efficiency, GpuSpec,
    JobShape, ModelSpec, RewardKind, Role, RoleSet,
};
pub use record::{
    after_move, finite, parse_records, render_records, GroupPlace, GroupUse, Record, RecordError,
    RECORD_FILE,
};
pub use search::{assign, search, search_top, search_top_lanes, Found, LaneSearch, Space};
pub use sharded::{Overlap, RankWork, ShardedStep, StepCost};
pub use staleness::{lag, within_bound};
pub use workload::{
    BeyondBound, DynamicSampling, Forecast, ForecastParams, LengthDist, PartialRollout, Resume,
    WorkloadSpec,
};
