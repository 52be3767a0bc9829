//! Fault injection for recovery tests: a role's process that dies at one exact point
//! of a step, which a `kill -9` from outside can only hit by chance.
//!
//! - `YATT_FAULT_EXIT_AFTER_UPDATE=N` makes the process exit (code 137, as after
//!   `kill -9`) right after a policy in it took the update that brought it to optimizer
//!   step `N`, before it answers: a replica's peers in the ring have its gradients and
//!   took the same update; a policy without replicas took an update its controller
//!   never heard of.
//! - `YATT_FAULT_EXIT_IN_CRITIC_UPDATE=N` makes the process exit when a critic in it
//!   is asked for the process's `N`th critic update, before it trains: the critic is
//!   lost while the policy takes the same step's update.
//! - `YATT_FAULT_EXIT_IN_POLICY_SAVE=N` makes the process exit when a policy in it is
//!   asked for the process's `N`th checkpoint save, before it writes: the policy is
//!   lost in the middle of the run's checkpoint.
//!
//! Unset, each costs one environment lookup per process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that arms the policy's fault.
pub(crate) const EXIT_AFTER_UPDATE: &str = "YATT_FAULT_EXIT_AFTER_UPDATE";
/// The environment variable that arms the critic's fault.
pub(crate) const EXIT_IN_CRITIC_UPDATE: &str = "YATT_FAULT_EXIT_IN_CRITIC_UPDATE";

/// The environment variable that arms the policy's checkpoint fault.
pub(crate) const EXIT_IN_POLICY_SAVE: &str = "YATT_FAULT_EXIT_IN_POLICY_SAVE";

/// The number `var` holds, read once per process.
fn armed(var: &'static str, cell: &'static OnceLock<Option<u64>>) -> Option<u64> {
    *cell.get_or_init(|| std::env::var(var).ok().and_then(|v| v.trim().parse().ok()))
}

/// Exits the process if it was armed for `version`. A ring's last messages are still
/// on their way to the peers when the update ends: a pause lets them arrive, so that
/// the peers finish the same update.
pub(crate) fn after_update(version: u64) {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    if armed(EXIT_AFTER_UPDATE, &ARMED) == Some(version) {
        eprintln!("{EXIT_AFTER_UPDATE}={version}: exiting after the update, before answering");
        std::thread::sleep(Duration::from_secs(2));
        std::process::exit(137);
    }
}

/// Counts a critic update asked of this process, and exits if it was armed for it.
pub(crate) fn in_critic_update() {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    static UPDATES: AtomicU64 = AtomicU64::new(0);
    exit_at_count(
        EXIT_IN_CRITIC_UPDATE,
        &ARMED,
        &UPDATES,
        "the critic's update",
    );
}

/// Counts a policy checkpoint save asked of this process, and exits if it was armed
/// for it.
pub(crate) fn in_policy_save() {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    static SAVES: AtomicU64 = AtomicU64::new(0);
    exit_at_count(
        EXIT_IN_POLICY_SAVE,
        &ARMED,
        &SAVES,
        "the policy's checkpoint save",
    );
}

/// Counts one more event in `count`, and exits if `var` armed its number.
fn exit_at_count(
    var: &'static str,
    armed_at: &'static OnceLock<Option<u64>>,
    count: &AtomicU64,
    what: &str,
) {
    let n = count.fetch_add(1, Ordering::Relaxed) + 1;
    if armed(var, armed_at) == Some(n) {
        eprintln!("{var}={n}: exiting in {what}");
        std::process::exit(137);
    }
}
