//! The event file [`RunWriter`] writes is read back by TensorBoard itself: the Python
//! `tensorboard` package in the project's `.venv` (scripts/bootstrap.sh installs it).

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use yatt_metrics::RunWriter;

/// Loads the event files in a directory with TensorBoard's `EventAccumulator` and
/// prints one JSON object: the first event's raw `file_version` (through TensorBoard's
/// record reader), and per tag its `[step, value]` pairs (NaN as null, which JSON can
/// hold).
const READER: &str = r#"
import glob, json, math, os, sys
from tensorboard.backend.event_processing import event_accumulator as ea
from tensorboard.backend.event_processing import event_file_loader
[path] = glob.glob(os.path.join(sys.argv[1], "events.out.tfevents.*"))
first = next(iter(event_file_loader.EventFileLoader(path).Load()))
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0})
acc.Reload()
print(json.dumps({
    "file_version": first.file_version,
    "scalars": {
        t: [[e.step, None if math.isnan(e.value) else e.value] for e in acc.Scalars(t)]
        for t in acc.Tags()["scalars"]
    },
}))
"#;

#[test]
fn tensorboard_reads_every_step_of_every_metric() {
    let python = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if !python.exists() {
        eprintln!(
            "SKIPPED: {} not found; run `source scripts/bootstrap.sh` to create the venv \
             with tensorboard",
            python.display()
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut w = RunWriter::create(dir.path()).unwrap();
    let steps = 5u64;
    for step in 1..=steps {
        let mut m = BTreeMap::new();
        m.insert("critic/rewards/mean".to_string(), step as f64 / 8.0);
        m.insert("timing_s/gen".to_string(), 0.25 * step as f64);
        if step == 3 {
            // JSONL writes null; TensorBoard keeps the NaN.
            m.insert("actor/kl".to_string(), f64::NAN);
        } else {
            m.insert("actor/kl".to_string(), -(step as f64));
        }
        w.write_step(step, &m).unwrap();
    }
    let name = w.events_path().file_name().unwrap().to_str().unwrap();
    assert!(name.starts_with("events.out.tfevents."), "{name}");

    let out = Command::new(&python)
        .args(["-c", READER])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{} could not read the event file (is tensorboard installed? run scripts/bootstrap.sh):\n{}",
        python.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got["file_version"], "brain.Event:2", "{got}");
    let scalars = got["scalars"].as_object().unwrap();
    let mut tags: Vec<&str> = scalars.keys().map(String::as_str).collect();
    tags.sort_unstable();
    assert_eq!(tags, ["actor/kl", "critic/rewards/mean", "timing_s/gen"]);
    let series = |tag: &str| -> Vec<(u64, Option<f64>)> {
        scalars[tag]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64()))
            .collect()
    };
    let want = |f: fn(f64) -> f64| -> Vec<(u64, Option<f64>)> {
        (1..=steps).map(|s| (s, Some(f(s as f64)))).collect()
    };
    // The values chosen are exact in f32, so they come back unchanged.
    assert_eq!(series("critic/rewards/mean"), want(|s| s / 8.0));
    assert_eq!(series("timing_s/gen"), want(|s| 0.25 * s));
    let kl = series("actor/kl");
    assert_eq!(kl.len(), steps as usize);
    for (s, v) in kl {
        if s == 3 {
            assert_eq!(v, None, "step 3 should come back as NaN");
        } else {
            assert_eq!(v, Some(-(s as f64)), "step {s}");
        }
    }
}
