//! What a placer is told and what it decides: the vocabulary shared by the placement
//! policy and whatever drives it (the live placement actor, the discrete-event
//! engine). Keeping it apart from the policy lets the engine drive any [`Placer`]
//! while the policy uses the engine to judge its candidates.

use serde::{Deserialize, Serialize};

use crate::cost::StepMetrics;
use crate::node::NodeDesc;
use crate::plan::{Move, Plan};

/// What a placer is told.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    /// A node joined the cluster with these devices.
    NodeJoined(NodeDesc),
    /// A node left or was declared dead.
    NodeLeft {
        /// The node's name.
        node: String,
    },
    /// A step finished with these metrics.
    Metrics(StepMetrics),
    /// The migration with this id completed.
    MigrationDone {
        /// The migration's id.
        id: u64,
    },
    /// The migration with this id failed and was rolled back; the plan is unchanged.
    MigrationFailed {
        /// The migration's id.
        id: u64,
        /// What went wrong.
        reason: String,
    },
    /// A plan asked for from outside the policy (an operator, the embedding program):
    /// migrate to it now, unless a migration is in flight or it does not fit.
    PlanRequested(Plan),
}

/// Why a migration was decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Reason {
    /// The load shifted and another plan is predicted to be faster.
    Rebalance,
    /// Groups of the current plan were lost with their node.
    NodeLost,
    /// Asked for ([`Event::PlanRequested`]).
    Requested,
}

/// A decided migration: the actor carries it out group by group (out of routing, drain
/// or abort and requeue, free, start the gaining role, sync weights, publish) and
/// answers with [`Event::MigrationDone`] or [`Event::MigrationFailed`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Migration {
    /// Its id, echoed in the answer.
    pub id: u64,
    /// Why.
    pub reason: Reason,
    /// The plan after it.
    pub target: Plan,
    /// The groups that change roles.
    pub moves: Vec<Move>,
    /// Predicted seconds per step before and after.
    pub predicted_s: (f64, f64),
    /// Predicted job-seconds the migration itself costs.
    pub cost_s: f64,
}

/// What a placer decides.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Decision {
    /// Move groups between roles.
    Migrate(Migration),
}

/// Something that places roles on groups: told events, it answers with decisions.
/// [`crate::PlacementPolicy`] is the one yatt has; the engine drives any.
pub trait Placer {
    /// Handles one event.
    fn on_event(&mut self, event: Event) -> Vec<Decision>;

    /// What it considered and why since the last call, one line per search (for
    /// reports); none by default.
    fn take_log(&mut self) -> Vec<String> {
        Vec::new()
    }
}
