//! Fault injection for recovery tests: a role's process that dies at one exact point
//! of a step, which a `kill -9` from outside can only hit by chance.
//!
//! - `YATT_FAULT_EXIT_AFTER_UPDATE=N` makes the process exit (code 137, as after
//!   `kill -9`) right after a policy replica of its ring took update `N` and before it
//!   answers: its peers have its gradients and took the same update.
//! - `YATT_FAULT_EXIT_IN_CRITIC_UPDATE=N` makes the process exit when a critic in it
//!   is asked for the process's `N`th critic update, before it trains: the critic is
//!   lost while the policy takes the same step's update.
//!
//! Unset, each costs one environment lookup per process.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that arms the policy's fault.
pub(crate) const EXIT_AFTER_UPDATE: &str = "YATT_FAULT_EXIT_AFTER_UPDATE";
/// The environment variable that arms the critic's fault.
pub(crate) const EXIT_IN_CRITIC_UPDATE: &str = "YATT_FAULT_EXIT_IN_CRITIC_UPDATE";

/// The number `var` holds, read once per process.
fn armed(var: &'static str, cell: &'static OnceLock<Option<u64>>) -> Option<u64> {
    *cell.get_or_init(|| std::env::var(var).ok().and_then(|v| v.trim().parse().ok()))
}

/// Exits the process if it was armed for `version`. The ring's last messages are still
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
    let update = UPDATES.fetch_add(1, Ordering::Relaxed) + 1;
    if armed(EXIT_IN_CRITIC_UPDATE, &ARMED) == Some(update) {
        eprintln!("{EXIT_IN_CRITIC_UPDATE}={update}: exiting in the critic's update");
        std::process::exit(137);
    }
}
