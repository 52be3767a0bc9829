//! Advantage estimators, policy and value losses, KL estimators.
