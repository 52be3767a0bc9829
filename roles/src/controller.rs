//! Parallel controllers: one per data-parallel head.
