//! `[data]` datasets end to end: the demo job trains on a verl-layout parquet file
//! written by the `.venv`'s pandas (chat prompts), its `data_source`, ground truth and
//! `extra_info` reaching a Python `compute_score`; a `save_to_disk` directory through
//! `data.format = "hf-disk"`; and the `[data]` keys' checks. Without the `.venv`'s
//! pandas and datasets these tests fail (`scripts/bootstrap.sh` installs them).

use crate::common;

use std::path::{Path, PathBuf};

use common::{demo_config, letters_fraction, load_demo};
use yatt_runtime::Node;
use yatt_trainer::{build_embedded, eval_prompts, EvalOptions, Split};

fn python() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))
}

fn run_python(dir: &Path, script: &str) {
    let out = std::process::Command::new(python())
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", python().display()));
    assert!(
        out.status.success(),
        "python failed (scripts/bootstrap.sh installs pandas, pyarrow and datasets):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// 16 verl rows: a system turn and a user turn, ground truth `"g{i}"`, data source
/// `toy`, extra_info `{split: train, index: i}`.
const WRITE_VERL: &str = r#"
import pandas as pd
rows = [{"data_source": "toy",
         "prompt": [{"role": "system", "content": "letters"}, {"role": "user", "content": f"q{i}:"}],
         "reward_model": {"style": "rule", "ground_truth": f"g{i}"},
         "extra_info": {"split": "train", "index": i}} for i in range(16)]
pd.DataFrame(rows).to_parquet("train.parquet")
"#;

/// The letters reward when every dataset field arrived as written, else -1.
const CHECKING_PY: &str = "\
LETTERS = set('abcdefghij')

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    i = extra_info['index']
    if data_source != 'toy' or ground_truth != f'g{i}' or extra_info['split'] != 'train':
        return -1.0
    if f'user: q{i}:' not in extra_info['prompt']:
        return -1.0
    return sum(c in LETTERS for c in solution_str) / max(len(solution_str), 1)
";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_trains_on_a_verl_parquet_with_a_python_reward() {
    let dir = tempfile::tempdir().unwrap();
    run_python(dir.path(), WRITE_VERL);
    let reward = dir.path().join("check.py");
    std::fs::write(&reward, CHECKING_PY).unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(
        out.path(),
        &[
            format!(
                "data.path={:?}",
                dir.path().join("train.parquet").display().to_string()
            ),
            "reward.kind=\"python\"".into(),
            format!(
                "reward.function={:?}",
                format!("{}:compute_score", reward.display())
            ),
            format!("reward.python={:?}", python().display().to_string()),
            "reward.timeout_s=30".into(),
            "job.steps=2".into(),
            // the transcript "system: letters\n\nuser: q15:" is 28 characters
            "model.max_seq_len=64".into(),
        ],
    );
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("data-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    for step in 1..=2 {
        let rep = controllers[0].step().await.unwrap();
        assert_eq!(rep.samples.len(), 64, "step {step}");
        for s in &rep.samples {
            // the chat went through the codec as a transcript (the tiny model has no template)
            assert!(
                s.prompt_text.starts_with("system: letters\n\nuser: q"),
                "{:?}",
                s.prompt_text
            );
            assert_eq!(
                s.reward,
                Some(letters_fraction(&s.response_text)),
                "step {step}, {}: {:?}",
                s.id,
                s.response_text
            );
        }
    }
    drop(controllers);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hf_disk_dataset_and_a_bad_row_through_the_config() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        r#"
from datasets import Dataset
Dataset.from_list([{"question": f"q{i}:", "answer": str(i)} for i in range(8)]).save_to_disk("ds")
Dataset.from_list([{"question": "q:", "answer": "1"}, {"question": "", "answer": "2"}]).save_to_disk("bad")
"#,
    );
    let out = tempfile::tempdir().unwrap();
    let sets = |path: &str| {
        vec![
            format!(
                "data.path={:?}",
                dir.path().join(path).display().to_string()
            ),
            "data.format=\"hf-disk\"".into(),
            "data.prompt_key=\"question\"".into(),
            "data.ground_truth_key=\"answer\"".into(),
            "job.steps=1".into(),
            "reward.kind=\"letters\"".into(),
        ]
    };
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("data-1")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&demo_config(out.path(), &sets("ds")), &node)
        .await
        .unwrap();
    let rep = controllers[0].step().await.unwrap();
    for s in &rep.samples {
        let i: usize = s.prompt_text[1..s.prompt_text.len() - 1].parse().unwrap();
        assert_eq!(s.reference.as_deref(), Some(i.to_string().as_str()));
    }
    drop(controllers);
    node.shutdown().await;
    let node = Node::builder("data-2")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let e = match build_embedded(&demo_config(out.path(), &sets("bad")), &node).await {
        Ok(_) => panic!("a dataset with an empty prompt was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("data-00000-of-00001.arrow: row 1: column `question`") && e.contains("empty"),
        "{e}"
    );
    node.shutdown().await;
}

#[test]
fn data_keys_are_checked() {
    let out = tempfile::tempdir().unwrap();
    let err = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        load_demo(out.path(), &sets).unwrap_err().to_string()
    };
    let e = err(&["data.format=\"csv\""]);
    assert!(
        e.contains("data.format") && e.contains("\"parquet\"") && e.contains("\"hf-disk\""),
        "{e}"
    );
    let e = err(&["data.format=\"parquet\""]);
    assert!(e.contains("data.format") && e.contains("data.path"), "{e}");
    let e = err(&["data.path=\"a.parquet\"", "data.jsonl=\"b.jsonl\""]);
    assert!(e.contains("data.jsonl") && e.contains("either"), "{e}");
    let e = err(&["data.path=\"a.parquet\"", "data.prompt_key=\"\""]);
    assert!(e.contains("data.prompt_key"), "{e}");
    let job = load_demo(out.path(), &["data.path=\"a.parquet\"".into()]).unwrap();
    assert_eq!(job.data.dataset(), Some("a.parquet"));
    assert_eq!(job.data.dataset_format(), None);
    let job = load_demo(out.path(), &["data.jsonl=\"a.txt\"".into()]).unwrap();
    assert_eq!(
        job.data.dataset_format(),
        Some(yatt_roles::DataFormat::Jsonl)
    );
}

/// A prompt that cannot fit `model.max_seq_len` with `rollout.max_new_tokens` after it
/// is refused when the job is built, naming its row and the fixes, not at the step that
/// draws it; with `data.filter_overlong_prompts` it is dropped and the job trains on the
/// rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_overlong_prompt_is_refused_before_the_first_step_or_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("prompts.jsonl");
    let long = "q".repeat(40);
    let rows: Vec<String> = (0..8)
        .map(|i| match i {
            5 => format!("{{\"prompt\": \"{long}\"}}"),
            _ => format!("{{\"prompt\": \"q{i}:\"}}"),
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let sets = |filter: bool| {
        vec![
            format!("data.path={:?}", data.display().to_string()),
            format!("data.filter_overlong_prompts={filter}"),
            "data.prompts_per_step=7".into(),
            // 26 tokens left for the prompt; the long one has over 40.
            "model.max_seq_len=32".into(),
            "rollout.max_new_tokens=6".into(),
            "job.steps=1".into(),
            "reward.kind=\"letters\"".into(),
        ]
    };
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("data-3")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let e = match build_embedded(&demo_config(out.path(), &sets(false)), &node).await {
        Ok(_) => panic!("a prompt longer than model.max_seq_len was accepted"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains("model.max_seq_len")
            && e.contains("1 prompt(s) longer than the 26 tokens")
            && e.contains("prompts.jsonl: row 5")
            && e.contains("raise model.max_seq_len to at least")
            && e.contains("data.filter_overlong_prompts = true"),
        "{e}"
    );
    let mut controllers = build_embedded(&demo_config(out.path(), &sets(true)), &node)
        .await
        .unwrap();
    let rep = controllers[0].step().await.unwrap();
    // The 7 prompts left, every one drawn once.
    assert_eq!(rep.samples.len(), 7 * 8);
    assert!(rep.samples.iter().all(|s| !s.prompt_text.contains(&long)));
    drop(controllers);
    node.shutdown().await;
}

/// Evaluation draws its own prompts (a held-out file, or the task with another seed), and
/// they get the same `rollout.max_new_tokens`: one without room fails when the prompts are
/// drawn, naming it, or is skipped with `data.filter_overlong_prompts`.
#[test]
fn an_overlong_eval_prompt_is_named_or_dropped() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("test.jsonl");
    let long = "q".repeat(40);
    let rows: Vec<String> = (0..6)
        .map(|i| match i {
            2 => format!("{{\"prompt\": \"{long}\"}}"),
            _ => format!("{{\"prompt\": \"q{i}:\"}}"),
        })
        .collect();
    std::fs::write(&data, rows.join("\n")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let job = |filter: bool, extra: &[&str]| {
        let mut sets = vec![
            format!("data.path={:?}", data.display().to_string()),
            format!("data.filter_overlong_prompts={filter}"),
            "model.max_seq_len=32".into(),
            "rollout.max_new_tokens=6".into(),
            "reward.kind=\"letters\"".into(),
        ];
        sets.extend(extra.iter().map(|s| s.to_string()));
        demo_config(out.path(), &sets)
    };
    let train_split = |n: usize| EvalOptions {
        prompts: n,
        split: Split::Train,
        ..EvalOptions::default()
    };
    let e = eval_prompts(&job(false, &[]), &train_split(4))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("model.max_seq_len") && e.contains("test.jsonl: row 2"),
        "{e}"
    );
    let kept = eval_prompts(&job(true, &[]), &train_split(5)).unwrap();
    assert_eq!(kept.len(), 5);
    assert!(kept.iter().all(|p| !p.text.contains(&long)));
    assert!(eval_prompts(&job(true, &[]), &train_split(6)).is_err());

    // The synthetic task's held-out prompts, in a window too small for any of them.
    let task = |filter: bool| {
        let mut j = job(filter, &["model.max_seq_len=8"]);
        j.data.path = String::new();
        j
    };
    let held_out = EvalOptions {
        prompts: 4,
        ..EvalOptions::default()
    };
    let e = eval_prompts(&task(false), &held_out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("held-out prompt 0 of data.task"), "{e}");
    let e = eval_prompts(&task(true), &held_out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("every prompt dropped"), "{e}");
}
