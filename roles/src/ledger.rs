//! The sample ledger: every prompt of a step accounted for exactly once.
