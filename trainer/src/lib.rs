//! # yatt-trainer (temporary layout)
pub mod bench;
pub mod controller;
pub mod eval;
pub mod job;
pub mod ledger;
pub mod placement_live;
pub mod remote;
