//! `yatt placement show RUN_DIR` on a real run's log (the fixture the live placement
//! integration test wrote): the plan, per-group utilisation and the decision with its
//! reason and outcome; and a clear error for a run without live placement.

use std::process::Command;

#[test]
fn placement_show_renders_a_live_run() {
    let run = tempfile::tempdir().unwrap();
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/placement/tests/fixtures/live-placement.jsonl"
    );
    std::fs::copy(fixture, run.path().join("placement.jsonl")).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_yatt"))
        .args(["placement", "show"])
        .arg(run.path())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for want in [
        "plan: rollout:2 policy:1",
        "routing v2",
        "utilisation over the last 5 step(s)",
        "g1   policy",
        "#1 after step 27 (rebalance",
        "g2 policy -> rollout",
        "done in",
        "predicted without the last migration",
        "last search: step 49",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }

    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_yatt"))
        .args(["placement", "show"])
        .arg(empty.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("placement.jsonl") && err.contains("live = true"),
        "{err}"
    );
}
