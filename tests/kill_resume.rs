//! `kill -9` of a `yatt train` process, then `yatt train --resume`: the run ends with
//! the metrics of a run that was never killed, step for step (the clocks aside), with
//! the asynchronous pipeline on (its checkpoint holds the batch generated ahead).

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const STEPS: u64 = 24;

fn yatt() -> Command {
    Command::new(env!("CARGO_BIN_EXE_yatt"))
}

fn config() -> String {
    format!("{}/config/demo-letters.toml", env!("CARGO_MANIFEST_DIR"))
}

fn train_args(out: &Path) -> Vec<String> {
    [
        format!("job.steps={STEPS}"),
        "checkpoint.every=3".into(),
        "rollout.staleness=1".into(),
        format!("job.output_dir={:?}", out.display().to_string()),
    ]
    .into_iter()
    .flat_map(|s| ["--set".to_string(), s])
    .collect()
}

fn lines(dir: &Path) -> Vec<String> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(String::from)
        .collect()
}

/// Every metric but the clocks, sorted.
fn deterministic(line: &str) -> Vec<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let mut out: Vec<(String, String)> = v
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| {
            // A head's own value (`head/1/timing_s/gen`) is timed as its mean is.
            let k = k
                .strip_prefix("head/")
                .and_then(|r| r.split_once('/'))
                .map_or(k.as_str(), |(_, m)| m);
            !k.starts_with("timing_s/")
                && !k.starts_with("perf/")
                && k != "async/overlap_s"
                && k != "async/gen_ahead_s"
                && k != "time"
        })
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    out.sort();
    out
}

fn run_ok(c: &mut Command) {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn a_killed_run_resumes_to_the_metrics_of_an_unkilled_one() {
    let whole = tempfile::tempdir().unwrap();
    run_ok(
        yatt()
            .arg("train")
            .arg(config())
            .args(train_args(whole.path())),
    );

    let killed = tempfile::tempdir().unwrap();
    let mut child = yatt()
        .arg("train")
        .arg(config())
        .args(train_args(killed.path()))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Past the second checkpoint (step 6), well before the end.
    let deadline = Instant::now() + Duration::from_secs(120);
    while lines(killed.path()).len() < 8 {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the run ended before it could be killed"
        );
        assert!(Instant::now() < deadline, "no 8 steps in 120 s");
        std::thread::sleep(Duration::from_millis(10));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
    let at_kill = lines(killed.path()).len() as u64;
    assert!(at_kill < STEPS, "killed after the last step ({at_kill})");

    run_ok(
        yatt()
            .arg("train")
            .arg("--resume")
            .arg(killed.path())
            .args(["--set", &format!("job.steps={STEPS}")]),
    );
    let (a, b) = (lines(whole.path()), lines(killed.path()));
    assert_eq!(a.len() as u64, STEPS);
    assert_eq!(b.len() as u64, STEPS, "killed at step {at_kill}");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert_eq!(
            deterministic(x),
            deterministic(y),
            "step {} (killed at {at_kill})",
            i + 1
        );
    }
}
