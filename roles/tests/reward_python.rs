//! Python reward functions on real worker processes of the project's `.venv` Python:
//! the numeric twin against the Rust verifier, batched calls, and what happens when the
//! function raises, hangs or crashes (tiny .py files in a tempdir).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use yatt_roles::{
    ModelScorer, NumericVerifier, PythonReward, PythonRewardConfig, RewardFn, RewardInput,
    RewardRole, Role, Sample, SampleId,
};

fn python() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))
}

fn config(function: String) -> PythonRewardConfig {
    PythonRewardConfig {
        python: python(),
        timeout: Duration::from_secs(20),
        start_timeout: Duration::from_secs(60),
        ..PythonRewardConfig::new(function)
    }
}

/// Writes `body` to `dir/name` and returns `"dir/name:compute_score"`.
fn function(dir: &Path, name: &str, body: &str) -> String {
    let path = dir.join(name);
    std::fs::write(&path, body).unwrap();
    format!("{}:compute_score", path.display())
}

fn input(response: &str, reference: Option<&str>) -> RewardInput {
    RewardInput {
        prompt: "q".into(),
        response: response.into(),
        reference: reference.map(str::to_string),
        metadata: serde_json::Value::Null,
    }
}

fn sample(k: u32, response: &str) -> Sample {
    Sample {
        prompt_text: "q".into(),
        response_text: response.into(),
        reference: Some("1".into()),
        ..Sample::new(
            SampleId {
                step: 0,
                prompt: 7,
                k,
            },
            7,
        )
    }
}

fn labels(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("sample-{i}")).collect()
}

/// About 50 responses and references covering what the verifier parses.
fn numeric_cases() -> Vec<(String, Option<String>)> {
    let responses = [
        "The answer is 42.",
        "42",
        "I think 41, no wait, 42",
        "\\boxed{42}",
        "so \\boxed{\\frac{3}{4}} done",
        "\\boxed{-\\frac{1}{2}}",
        "\\boxed{\\dfrac{10}{4}}",
        "#### 1,234",
        "step 1 ... #### 72 apples",
        "answer: 3/4",
        "Answer = -7 then 9",
        "x-3 gives -5",
        "temperature \u{2212}12 degrees",
        "1,000,000 people",
        "0.5",
        ".5",
        "-0.25",
        "no number here",
        "",
        "2/0 and then 6",
        "12 apples and 13 pears",
        "\\boxed{ 1{,}000 }",
        "\\boxed{$5$}",
        "the answer is\n\n 17",
        "ANSWER IS 8",
        "1e5",
        "3.14159",
        "version 2-3",
        "100.",
        "\\boxed{7",
    ];
    let references = [
        "42",
        "0.75",
        "-0.5",
        "2.5",
        "1234",
        "72",
        "-7",
        "-5",
        "-12",
        "1e5",
        "#### 8",
        "$17$",
        "1,000,000",
    ];
    let mut cases: Vec<(String, Option<String>)> = Vec::new();
    for (i, r) in responses.iter().enumerate() {
        // Each response against a reference it matches or not, deterministically.
        let want = references[(i * 7) % references.len()];
        cases.push((r.to_string(), Some(want.to_string())));
        cases.push((r.to_string(), Some(r.to_string()).filter(|r| !r.is_empty())));
    }
    cases.truncate(52);
    cases
}

#[test]
fn numeric_twin_gives_the_rust_verifiers_rewards() {
    let f = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/python_reward/numeric_reward.py:compute_score"
    );
    let mut py = PythonReward::new(config(f.into())).unwrap();
    let rust = NumericVerifier::default();
    let cases = numeric_cases();
    let inputs: Vec<RewardInput> = cases.iter().map(|(r, g)| input(r, g.as_deref())).collect();
    // References with no number fail both: keep the cases the Rust verifier scores.
    let (ok, bad): (Vec<_>, Vec<_>) = inputs.into_iter().partition(|i| rust.score(i).is_ok());
    assert!(ok.len() >= 45, "only {} scorable cases", ok.len());
    let got = py.score_samples(&labels(ok.len()), &ok).unwrap();
    let mut correct = 0;
    for (i, out) in ok.iter().zip(&got) {
        let want = rust.score(i).unwrap().score;
        assert_eq!(out.score, want, "{:?} vs {:?}", i.response, i.reference);
        correct += (want == 1.0) as usize;
    }
    assert!(
        correct >= 10 && correct < ok.len(),
        "{correct} of {} correct",
        ok.len()
    );
    for i in &bad {
        let e = py
            .score_samples(&labels(1), std::slice::from_ref(i))
            .unwrap_err()
            .to_string();
        assert!(e.contains("sample-0") && e.contains("Traceback"), "{e}");
    }
}

#[test]
fn a_raise_fails_the_request_with_the_sample_id_and_the_traceback() {
    let dir = tempfile::tempdir().unwrap();
    let f = function(
        dir.path(),
        "raises.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    print('noise on stdout')\n    if solution_str == 'bad':\n        return 1 / 0\n    return len(solution_str)\n",
    );
    let py = PythonReward::new(config(f)).unwrap();
    let mut role = RewardRole::with_models(
        Vec::new(),
        vec![(1.0, Box::new(py) as Box<dyn ModelScorer>)],
    )
    .unwrap();
    let ok = role.serve(vec![sample(0, "ab"), sample(1, "abc")]).unwrap();
    assert_eq!(
        ok.iter().map(|s| s.reward.unwrap()).collect::<Vec<_>>(),
        vec![2.0, 3.0]
    );
    let e = role
        .serve(vec![sample(0, "ab"), sample(1, "abc"), sample(2, "bad")])
        .unwrap_err()
        .to_string();
    assert!(e.contains("step 0 prompt 0x7 sample 2"), "{e}");
    assert!(
        e.contains("Traceback") && e.contains("ZeroDivisionError") && e.contains("raises.py"),
        "{e}"
    );
    assert!(e.contains("reward.fallback_score"), "{e}");
}

#[test]
fn a_raise_with_a_fallback_score_gets_it_and_is_counted() {
    let dir = tempfile::tempdir().unwrap();
    let f = function(
        dir.path(),
        "raises.py",
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    if solution_str == 'bad':\n        raise ValueError('cannot score')\n    return {'score': 1.0, 'extra': 'ignored'}\n",
    );
    let mut py = PythonReward::new(PythonRewardConfig {
        fallback_score: Some(-0.5),
        ..config(f)
    })
    .unwrap();
    let inputs = vec![
        input("a", None),
        input("bad", None),
        input("b", None),
        input("bad", None),
    ];
    let out = py.score_samples(&labels(4), &inputs).unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        vec![1.0, -0.5, 1.0, -0.5]
    );
    assert_eq!(py.fallbacks(), 2);
}

#[test]
fn a_worker_that_hangs_once_is_replaced_and_its_batch_retried() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("hung");
    let f = function(
        dir.path(),
        "hangs.py",
        &format!("import os, time\nMARK = {:?}\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    if solution_str == 'slow' and not os.path.exists(MARK):\n        open(MARK, 'w').close()\n        time.sleep(3600)\n    return 0.5\n", marker.display().to_string()),
    );
    let mut py = PythonReward::new(PythonRewardConfig {
        timeout: Duration::from_millis(1500),
        ..config(f)
    })
    .unwrap();
    let inputs = vec![input("a", None), input("slow", None), input("b", None)];
    let out = py.score_samples(&labels(3), &inputs).unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        vec![0.5; 3]
    );
    assert!(marker.exists());
}

#[test]
fn a_worker_that_hangs_twice_fails_the_request_naming_the_function() {
    let dir = tempfile::tempdir().unwrap();
    let f = function(
        dir.path(),
        "hangs.py",
        "import time\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    if solution_str == 'slow':\n        time.sleep(3600)\n    return 0.5\n",
    );
    let mut py = PythonReward::new(PythonRewardConfig {
        timeout: Duration::from_millis(1000),
        ..config(f.clone())
    })
    .unwrap();
    let start = Instant::now();
    let e = py
        .score_samples(&labels(2), &[input("a", None), input("slow", None)])
        .unwrap_err()
        .to_string();
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
    assert!(
        e.contains(&f) && e.contains("failed twice") && e.contains("deadline"),
        "{e}"
    );
    assert!(e.contains("sample-1"), "{e}");
    // The pool still works after replacing the worker.
    let out = py
        .score_samples(&labels(2), &[input("a", None), input("b", None)])
        .unwrap();
    assert_eq!(out.len(), 2);
}

#[test]
fn a_worker_that_dies_is_replaced_once_then_the_request_fails() {
    let dir = tempfile::tempdir().unwrap();
    let marker = dir.path().join("died");
    let f = function(
        dir.path(),
        "dies.py",
        &format!("import os, sys\nMARK = {:?}\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    if solution_str == 'die':\n        sys.stderr.write('dying now\\n'); sys.stderr.flush(); os._exit(3)\n    if solution_str == 'die-once' and not os.path.exists(MARK):\n        open(MARK, 'w').close()\n        os._exit(4)\n    return 2.0\n", marker.display().to_string()),
    );
    let mut py = PythonReward::new(config(f.clone())).unwrap();
    let out = py
        .score_samples(
            &labels(3),
            &[input("a", None), input("b", None), input("die-once", None)],
        )
        .unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        vec![2.0; 3]
    );
    let e = py
        .score_samples(&labels(2), &[input("a", None), input("die", None)])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(&f) && e.contains("failed twice") && e.contains("died"),
        "{e}"
    );
    assert!(
        e.contains("exit status: 3") && e.contains("dying now"),
        "{e}"
    );
}

#[test]
fn a_batched_function_takes_lists_and_sees_the_mapped_arguments() {
    let dir = tempfile::tempdir().unwrap();
    let f = function(
        dir.path(),
        "batched.py",
        "def compute_score(data_sources, solution_strs, ground_truths, extra_infos):\n    return [\n        {'score': float(len(s)) + (10.0 if g is not None else 0.0), 'step_scores': [1.0] if d == 'math' else None}\n        if e['prompt'] == 'q' else -1.0\n        for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)\n    ]\n",
    );
    let mut py = PythonReward::new(PythonRewardConfig {
        batched: true,
        workers: 3,
        ..config(f)
    })
    .unwrap();
    let mut inputs: Vec<RewardInput> = (0..7).map(|i| input(&"x".repeat(i), None)).collect();
    inputs[2].reference = Some("r".into());
    inputs[3].metadata = serde_json::json!({"data_source": "math"});
    let out = py.score_samples(&labels(7), &inputs).unwrap();
    assert_eq!(
        out.iter().map(|o| o.score).collect::<Vec<_>>(),
        vec![0.0, 1.0, 12.0, 3.0, 4.0, 5.0, 6.0]
    );
    assert_eq!(out[3].step_scores, Some(vec![1.0]));
    assert_eq!(out[4].step_scores, None);
}

#[test]
fn a_function_that_cannot_load_fails_at_start_with_the_traceback() {
    let dir = tempfile::tempdir().unwrap();
    let broken = function(dir.path(), "broken.py", "import not_a_module_anywhere\n");
    let e = PythonReward::new(config(broken)).err().unwrap().to_string();
    assert!(
        e.contains("ModuleNotFoundError") && e.contains("not_a_module_anywhere"),
        "{e}"
    );
    let missing = function(
        dir.path(),
        "other.py",
        "def score(a, b, c, d):\n    return 0\n",
    )
    .replace(":compute_score", ":compute");
    let e = PythonReward::new(config(missing))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("no function 'compute'") && e.contains("['score']"),
        "{e}"
    );
    let e = PythonReward::new(config("nope.py".into()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("file.py:compute_score"), "{e}");
}
