//! The built-in roles: rollout, reference, policy, reward.
