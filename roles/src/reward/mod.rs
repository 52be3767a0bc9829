//! Reward functions.
