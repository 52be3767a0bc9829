//! Prompt datasets.
