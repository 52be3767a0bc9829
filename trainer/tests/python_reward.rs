//! `reward.kind = "python"` end to end: the demo job trains 3 steps with a Python
//! letters reward run by the project's `.venv` Python, each sample's reward being the
//! Rust letters fraction of its response; `reward.kind = "http"` built from the config
//! against a one-shot HTTP server on 127.0.0.1; and the config checks of both kinds'
//! keys.

use crate::common;

use std::path::Path;

use common::{demo_config, letters_fraction, load_demo, text_sample};
use yatt_roles::Role;
use yatt_runtime::Node;
use yatt_trainer::{build_embedded, reward_role};

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

/// A node on 127.0.0.1 with a dev certificate from `certs`.
async fn dev_node(name: &str, certs: &Path) -> Node {
    Node::builder(name).dev_certs(certs).start().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_trains_three_steps_with_a_python_letters_reward() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("letters.py");
    std::fs::write(&file, LETTERS_PY).unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &python_sets(&file));
    let certs = tempfile::tempdir().unwrap();
    let node = dev_node("py-0", certs.path()).await;
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
        e.contains("reward.function")
            && e.contains("existing .py file")
            && e.contains("nowhere.py is not a file (looked in /"),
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

/// Answers one HTTP request on 127.0.0.1 with `body`; returns the URL and the request.
fn one_shot_server(body: &'static str) -> (String, std::thread::JoinHandle<String>) {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    let handle = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        sock.set_read_timeout(Some(std::time::Duration::from_secs(20)))
            .unwrap();
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let (head_end, len) = loop {
            let n = sock.read(&mut chunk).unwrap();
            assert!(n > 0, "the client closed before a full request");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..p]).to_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .map_or(0, |v| v.trim().parse().unwrap());
                break (p + 4, len);
            }
        };
        while buf.len() < head_end + len {
            let n = sock.read(&mut chunk).unwrap();
            assert!(n > 0, "the client closed before the whole body");
            buf.extend_from_slice(&chunk[..n]);
        }
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        sock.write_all(resp.as_bytes()).unwrap();
        String::from_utf8_lossy(&buf[head_end..]).into_owned()
    });
    (url, handle)
}

#[test]
fn an_http_reward_from_the_config_scores_through_the_endpoint() {
    let (url, server) = one_shot_server(r#"{"scores": [0.5, 1.0]}"#);
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(
        out.path(),
        &[
            "reward.kind=\"http\"".into(),
            format!("reward.url={url:?}"),
            "reward.timeout_s=10".into(),
            "reward.max_retries=0".into(),
        ],
    );
    let mut role = reward_role(&job).unwrap();
    let scored = role
        .serve(vec![
            text_sample(0, "q0:", "abc"),
            text_sample(1, "q1:", "xyz"),
        ])
        .unwrap();
    assert_eq!(
        scored.iter().map(|s| s.reward.unwrap()).collect::<Vec<_>>(),
        vec![0.5, 1.0]
    );
    let sent: serde_json::Value = serde_json::from_str(&server.join().unwrap()).unwrap();
    assert_eq!(sent[1]["response"], "xyz");
    assert_eq!(sent[0]["prompt"], "q0:");
}

/// A saturated model under dynamic sampling: a step after the first whose groups are all
/// flat (every reward equal in every round) trains on its last round's groups and says
/// so in `dapo/without_signal`, as it would without dynamic sampling, instead of failing
/// the run (a 240-step SmolLM2 run failed at step 238 that way). A first step without
/// signal still fails, naming the step: nothing has varied yet, so the reward is suspect.
/// The reward turns flat while the file `flat` exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dynamic_sampling_without_signal_fails_the_first_step_and_trains_a_later_one() {
    let dir = tempfile::tempdir().unwrap();
    let flat = dir.path().join("flat");
    let file = dir.path().join("letters_or_flat.py");
    std::fs::write(
        &file,
        format!(
            "import os\n{LETTERS_PY}\nletters = compute_score\n\n\
             def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    \
                 if os.path.exists({flat:?}):\n        return {{'score': 1.0}}\n    \
                 return letters(data_source, solution_str, ground_truth, extra_info)\n"
        ),
    )
    .unwrap();
    let mut sets = python_sets(&file);
    sets.extend([
        "algorithm.dynamic_sampling=true".to_string(),
        "algorithm.max_sampling_rounds=2".to_string(),
        // Enough prompts that the last round draws more groups than the step trains:
        // the surplus must be dropped through the ledger (a regression: it was not).
        "data.num_prompts=64".to_string(),
    ]);
    let certs = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &sets);
    let node = dev_node("py-flat", certs.path()).await;
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    let first = controllers[0].step().await.unwrap();
    assert_eq!(first.metrics.get("dapo/without_signal"), Some(0.0));
    std::fs::write(&flat, "").unwrap();
    let rep = controllers[0].step().await.unwrap();
    assert_eq!(rep.metrics.get("dapo/without_signal"), Some(1.0));
    assert_eq!(rep.metrics.get("dapo/gen_rounds"), Some(2.0));
    assert_eq!(rep.metrics.get("dapo/keep_rate"), Some(0.0));
    assert_eq!(rep.samples.len(), first.samples.len());
    assert!(rep.samples.iter().all(|s| s.reward == Some(1.0)));
    assert_eq!(rep.ledger.samples - rep.ledger.dropped, rep.samples.len());
    assert!(rep.metrics.get("dapo/groups_dropped").unwrap() > 8.0);
    drop(controllers);
    node.shutdown().await;

    // A fresh run (its roles on a fresh node) whose first step is flat.
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &sets);
    let node = dev_node("py-flat-2", certs.path()).await;
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    let e = controllers[0].step().await.unwrap_err().to_string();
    assert!(
        e.contains("step 1:") && e.contains("no prompt group with differing rewards in 2"),
        "{e}"
    );
    drop(controllers);
    node.shutdown().await;
}
