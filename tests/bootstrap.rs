//! `scripts/bootstrap.sh` is sourced by the README's commands and by users' shells: it
//! must leave the caller's shell options as they were.
//!
//! Regression: it saved them with `$(set +o)`, which runs without errexit, and restoring
//! that turned `set -e` off in every script that sourced it, so `scripts/test.sh` went
//! on past failing tests and exited 0 (CI would have passed a failing run).

use std::process::Command;

fn sourced_then_false(preamble: &str) -> (bool, String) {
    let script =
        format!("{preamble} source scripts/bootstrap.sh >/dev/null 2>&1; false; echo survived");
    let out = Command::new("bash")
        .arg("-c")
        .arg(script)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("bash runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn sourcing_the_bootstrap_keeps_the_callers_shell_options() {
    let (ok, stdout) = sourced_then_false("set -euo pipefail;");
    assert!(
        !ok && !stdout.contains("survived"),
        "set -e was lost: {stdout:?}"
    );
    let (ok, stdout) = sourced_then_false("");
    assert!(
        ok && stdout.contains("survived"),
        "set -e was left behind: {stdout:?}"
    );
}
