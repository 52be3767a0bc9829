//! `reward.kind = "python"` end to end: the demo job trains 3 steps with a Python
//! letters reward run by the project's `.venv` Python, each sample's reward being the
//! Rust letters fraction of its response; and the config checks of the python and http
//! keys.

mod common;

use std::path::Path;

use common::{demo_config, letters_fraction, load_demo};
use yatt_runtime::Node;
use yatt_trainer::build_embedded;

const LETTERS_PY: &str = "\
LETTERS = set('abcdefghij')

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    n = max(len(solution_str), 1)
    return {'score': sum(c in LETTERS for c in solution_str) / n}
";

fn python() -> String {
    concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python").to_string()
}

fn python_sets(file: &Path) -> Vec<String> {
    vec![
        "reward.kind=\"python\"".to_string(),
        format!(
            "reward.function={:?}",
            format!("{}:compute_score", file.display())
        ),
        format!("reward.python={:?}", python()),
        "reward.python_workers=2".into(),
        "reward.timeout_s=30".into(),
        "job.steps=3".into(),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_trains_three_steps_with_a_python_letters_reward() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("letters.py");
    std::fs::write(&file, LETTERS_PY).unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &python_sets(&file));
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("py-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    for step in 1..=3 {
        let rep = controllers[0].step().await.unwrap();
        assert_eq!(rep.samples.len(), 64, "step {step}");
        for s in &rep.samples {
            assert_eq!(
                s.reward,
                Some(letters_fraction(&s.response_text)),
                "step {step}, {}: {:?}",
                s.id,
                s.response_text
            );
        }
        let mean = rep.metrics.get("critic/rewards/mean").unwrap();
        assert!(mean.is_finite() && (0.0..=1.0).contains(&mean), "{mean}");
    }
    drop(controllers);
    node.shutdown().await;
}

#[test]
fn python_and_http_keys_are_checked() {
    let out = tempfile::tempdir().unwrap();
    let err = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        load_demo(out.path(), &sets).unwrap_err().to_string()
    };
    let e = err(&[
        "reward.kind=\"python\"",
        "reward.function=\"nowhere.py:compute_score\"",
    ]);
    assert!(
        e.contains("reward.function") && e.contains("existing .py file"),
        "{e}"
    );
    let e = err(&["reward.kind=\"python\"", "reward.function=\"x.py\""]);
    assert!(
        e.contains("reward.function") && e.contains("file.py:compute_score"),
        "{e}"
    );
    let e = err(&["reward.function=\"x.py:f\""]);
    assert!(
        e.contains("reward.function") && e.contains("reward.kind includes \"python\""),
        "{e}"
    );
    let e = err(&[
        "reward.kind=\"http\"",
        "reward.url=\"http://127.0.0.1/score\"",
    ]);
    assert!(e.contains("reward.url") && e.contains(":port"), "{e}");
    let e = err(&[
        "reward.kind=\"http\"",
        "reward.url=\"http://127.0.0.1:8000/s\"",
        "reward.timeout_s=0",
    ]);
    assert!(e.contains("reward.timeout_s"), "{e}");
    assert!(load_demo(
        out.path(),
        &[
            "reward.kind=\"http\"".into(),
            "reward.url=\"http://127.0.0.1:8000/score\"".into()
        ]
    )
    .is_ok());
}
