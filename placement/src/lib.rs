//! # yatt-placement
//!
//! Decides which GPU groups serve which roles. What belongs here: the device inventory
//! built from cluster membership, placement plans (full colocation, partial colocation,
//! disaggregated), the cost model, the deterministic placement policy (events in,
//! decisions out, no I/O), the live placement actor around it, and the discrete-event
//! cluster simulator that drives the same policy. It never links tch.
