//! Samples: what flows between roles, keyed by sample id.
