//! Fault injection for recovery tests: a replica that dies at one exact point of a
//! step, which a `kill -9` from outside can only hit by chance.
//!
//! `YATT_FAULT_EXIT_AFTER_UPDATE=N` makes the process exit (code 137, as after
//! `kill -9`) right after a policy replica of its ring took update `N` and before it
//! answers: its peers have its gradients and took the same update. Unset, it costs one
//! environment lookup per process.

use std::sync::OnceLock;
use std::time::Duration;

/// The environment variable that arms it.
pub(crate) const EXIT_AFTER_UPDATE: &str = "YATT_FAULT_EXIT_AFTER_UPDATE";

/// Exits the process if it was armed for `version`. The ring's last messages are still
/// on their way to the peers when the update ends: a pause lets them arrive, so that
/// the peers finish the same update.
pub(crate) fn after_update(version: u64) {
    static ARMED: OnceLock<Option<u64>> = OnceLock::new();
    let armed = ARMED.get_or_init(|| {
        std::env::var(EXIT_AFTER_UPDATE)
            .ok()
            .and_then(|v| v.trim().parse().ok())
    });
    if *armed == Some(version) {
        eprintln!("{EXIT_AFTER_UPDATE}={version}: exiting after the update, before answering");
        std::thread::sleep(Duration::from_secs(2));
        std::process::exit(137);
    }
}
