//! Staleness: one definition for the simulator and the live trainer.
//!
//! A response's lag is counted from the policy version its generation *started* with
//! (a partial rollout that continues on newer weights keeps its first version) to the
//! version of the weights it trains, i.e. the number of updates in between. A
//! staleness bound k admits lags 0..=k; k = 0 is on-policy.

/// Versions between the weights a response started generating with and the weights
/// it trains (0 when it trains the weights it started with).
pub fn lag(trained_version: u64, started_version: u64) -> u64 {
    trained_version.saturating_sub(started_version)
}

/// Whether a response started on `started_version` may train on `trained_version`
/// under the staleness bound `bound`.
pub fn within_bound(trained_version: u64, started_version: u64, bound: u32) -> bool {
    lag(trained_version, started_version) <= u64::from(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_counts_updates_from_the_first_version() {
        assert_eq!(lag(5, 5), 0);
        assert_eq!(lag(5, 3), 2);
        // A sample can never be ahead of the weights it trains: no underflow.
        assert_eq!(lag(3, 5), 0);
        assert!(within_bound(4, 3, 1));
        assert!(!within_bound(5, 3, 1));
        assert!(within_bound(7, 7, 0));
        assert!(!within_bound(8, 7, 0));
    }
}
