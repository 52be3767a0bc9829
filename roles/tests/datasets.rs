//! Datasets from real files written by the project's `.venv` Python: verl-layout parquet
//! (pandas), a `datasets` `save_to_disk` directory, chat JSONL, bad rows; and the
//! parquet fields reaching a Python `compute_score`. Without the `.venv`'s pandas,
//! pyarrow and datasets these tests fail (`scripts/bootstrap.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use yatt_roles::{
    load_dataset, ChatMessage, DataError, DataFields, DataFormat, ModelScorer, PythonReward,
    PythonRewardConfig, RewardInput,
};

fn python() -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python"))
}

/// Runs a Python script in `dir`; panics with its stderr when it fails.
fn run_python(dir: &Path, script: &str) {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .current_dir(dir)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "cannot run {}: {e}; run scripts/bootstrap.sh",
                python().display()
            )
        });
    assert!(
        out.status.success(),
        "python failed (scripts/bootstrap.sh installs pandas, pyarrow and datasets):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

const VERL_ROWS: &str = r#"
rows = [
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "system", "content": "Answer with a number."},
                {"role": "user", "content": "What is 2+3?"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"},
     "extra_info": {"split": "train", "index": 0}},
    {"data_source": "openai/gsm8k",
     "prompt": [{"role": "user", "content": "What is 4*4?"}],
     "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "16"},
     "extra_info": {"split": "train", "index": 1}},
]
"#;

#[test]
fn verl_parquet_written_by_pandas() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        &format!(
            "import pandas as pd\n{VERL_ROWS}\npd.DataFrame(rows).to_parquet('train.parquet')"
        ),
    );
    let path = dir.path().join("train.parquet");
    let ps = load_dataset(&path, None, &DataFields::default()).unwrap();
    assert_eq!(ps.len(), 2);
    assert_eq!(
        ps[0].messages,
        vec![
            ChatMessage::new("system", "Answer with a number."),
            ChatMessage::new("user", "What is 2+3?")
        ]
    );
    assert_eq!(ps[0].reference.as_deref(), Some("5"));
    assert_eq!(ps[1].reference.as_deref(), Some("16"));
    assert_eq!(ps[1].metadata["data_source"], "openai/gsm8k");
    assert_eq!(ps[1].metadata["ability"], "math");
    assert_eq!(
        ps[1].metadata["extra_info"],
        serde_json::json!({"split": "train", "index": 1})
    );
    // same file, same ids
    let again = load_dataset(&path, Some(DataFormat::Parquet), &DataFields::default()).unwrap();
    assert_eq!(ps, again);
    // the wrong format for the path is refused, naming it
    let e = load_dataset(&path, Some(DataFormat::HfDisk), &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("train.parquet") && e.contains("hf-disk"), "{e}");
}

#[test]
fn parquet_fields_reach_a_python_compute_score() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        &format!(
            "import pandas as pd\n{VERL_ROWS}\npd.DataFrame(rows).to_parquet('train.parquet')"
        ),
    );
    let ps = load_dataset(
        dir.path().join("train.parquet"),
        None,
        &DataFields::default(),
    )
    .unwrap();
    // The score encodes what arrived: 1 if every field is the dataset's, else which failed.
    let reward = dir.path().join("reward.py");
    std::fs::write(
        &reward,
        r#"
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if data_source != "openai/gsm8k":
        return -1.0
    if extra_info.get("split") != "train" or not isinstance(extra_info.get("index"), int):
        return -2.0
    return 1.0 if solution_str.strip() == ground_truth else 0.0
"#,
    )
    .unwrap();
    let mut scorer = PythonReward::new(PythonRewardConfig {
        python: python(),
        timeout: Duration::from_secs(20),
        start_timeout: Duration::from_secs(60),
        ..PythonRewardConfig::new(format!("{}:compute_score", reward.display()))
    })
    .unwrap();
    let inputs: Vec<RewardInput> = ps
        .iter()
        .zip(["5", "17"])
        .map(|(p, response)| RewardInput {
            prompt: p.text.clone(),
            response: response.into(),
            reference: p.reference.clone(),
            metadata: p.metadata.clone(),
        })
        .collect();
    let scores: Vec<f64> = scorer
        .score_batch(&inputs)
        .unwrap()
        .iter()
        .map(|o| o.score)
        .collect();
    assert_eq!(scores, vec![1.0, 0.0]);
}

#[test]
fn string_prompts_and_custom_columns_written_by_pyarrow() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        r#"
import pyarrow as pa, pyarrow.parquet as pq
t = pa.table({"question": ["1+1=", "2+2="], "sol": [{"value": 2}, {"value": 4}], "src": ["toy", "toy"]})
pq.write_table(t, "toy.parquet")
"#,
    );
    let fields = DataFields {
        prompt_key: "question".into(),
        ground_truth_key: "sol.value".into(),
        data_source_key: "src".into(),
        ..DataFields::default()
    };
    let ps = load_dataset(dir.path().join("toy.parquet"), None, &fields).unwrap();
    assert_eq!(ps[1].text, "2+2=");
    assert!(ps[1].messages.is_empty());
    assert_eq!(ps[1].reference.as_deref(), Some("4"));
    assert_eq!(ps[1].metadata, serde_json::json!({"data_source": "toy"}));
}

#[test]
fn hf_datasets_saved_to_disk() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        r#"
from datasets import Dataset, DatasetDict
rows = [{"messages": [{"role": "user", "content": f"What is {i}+{i}?"}],
         "ground_truth": str(2 * i), "data_source": "toy-add"} for i in range(5)]
ds = Dataset.from_list(rows)
ds.save_to_disk("ds")
DatasetDict({"train": ds, "test": ds}).save_to_disk("dd")
"#,
    );
    let ps = load_dataset(dir.path().join("ds"), None, &DataFields::default()).unwrap();
    assert_eq!(ps.len(), 5);
    assert_eq!(
        ps[3].messages,
        vec![ChatMessage::new("user", "What is 3+3?")]
    );
    assert_eq!(ps[3].reference.as_deref(), Some("6"));
    assert_eq!(ps[3].metadata["data_source"], "toy-add");
    // a DatasetDict: point at a split
    let e = load_dataset(dir.path().join("dd"), None, &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("DatasetDict") && e.contains("train"), "{e}");
    let split = load_dataset(
        dir.path().join("dd/train"),
        Some(DataFormat::HfDisk),
        &DataFields::default(),
    )
    .unwrap();
    assert_eq!(split, ps);
}

#[test]
fn bad_rows_name_file_row_column_and_fix() {
    let dir = tempfile::tempdir().unwrap();
    run_python(
        dir.path(),
        r#"
import pandas as pd
pd.DataFrame({"prompt": ["ok", None, "x"], "data_source": ["a", "b", "c"]}).to_parquet("null.parquet")
pd.DataFrame({"prompt": [[{"role": "user", "content": "hi"}], [{"role": "robot", "content": "hi"}]]}).to_parquet("role.parquet")
pd.DataFrame({"prompt": ["a", "b"], "data_source": [1, 2]}).to_parquet("source.parquet")
pd.DataFrame({"text": ["a"]}).to_parquet("nokey.parquet")
pd.DataFrame({"prompt": ["a", "b"], "id": [3, 3]}).to_parquet("dup.parquet")
open("not.parquet", "w").write("hello")
"#,
    );
    let load =
        |name: &str| load_dataset(dir.path().join(name), None, &DataFields::default()).unwrap_err();
    let e = load("null.parquet");
    assert!(
        matches!(&e, DataError::Row { row: 1, column, .. } if column == "prompt"),
        "{e}"
    );
    let e = e.to_string();
    assert!(
        e.contains("null.parquet: row 1: column `prompt`") && e.contains("got null"),
        "{e}"
    );
    let e = load("role.parquet").to_string();
    assert!(
        e.contains("row 1") && e.contains("\"robot\"") && e.contains("use one of"),
        "{e}"
    );
    let e = load("source.parquet").to_string();
    assert!(
        e.contains("row 0: column `data_source`") && e.contains("must be a string"),
        "{e}"
    );
    let e = load("nokey.parquet").to_string();
    assert!(
        e.contains("row 0") && e.contains("\"text\"") && e.contains("data.prompt_key"),
        "{e}"
    );
    let e = load("dup.parquet").to_string();
    assert!(
        e.contains("row 1: column `id`") && e.contains("already used by row 0"),
        "{e}"
    );
    let e = load("not.parquet").to_string();
    assert!(
        e.contains("not.parquet") && e.contains("not a readable parquet file"),
        "{e}"
    );
    let e = load_dataset(dir.path().join("data.csv"), None, &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.csv") && e.contains("cannot read"), "{e}");
    std::fs::write(dir.path().join("data.csv"), "a,b\n").unwrap();
    let e = load_dataset(dir.path().join("data.csv"), None, &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.format"), "{e}");
    // a directory that is not a save_to_disk dataset
    let e = load_dataset(dir.path(), None, &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("state.json") && e.contains("save_to_disk"),
        "{e}"
    );
}

#[test]
fn chat_jsonl() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("chat.jsonl");
    std::fs::write(
        &path,
        concat!(
            r#"{"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}], "ground_truth": 7}"#,
            "\n",
            r#"{"prompt": [{"role": "user", "content": "v"}], "reward_model": {"ground_truth": "8"}, "extra_info": {"k": 1}}"#,
            "\n",
            r#"{"prompt": "plain", "answer": "9"}"#,
            "\n",
        ),
    )
    .unwrap();
    let ps = load_dataset(&path, None, &DataFields::default()).unwrap();
    assert_eq!(ps[0].messages.len(), 2);
    assert_eq!(ps[0].reference.as_deref(), Some("7"));
    assert_eq!(ps[1].messages, vec![ChatMessage::new("user", "v")]);
    assert_eq!(ps[1].reference.as_deref(), Some("8"));
    assert_eq!(ps[1].metadata["extra_info"], serde_json::json!({"k": 1}));
    assert!(ps[2].messages.is_empty());
    assert_eq!(ps[2].reference.as_deref(), Some("9"));
    std::fs::write(&path, "{\"prompt\": []}\n").unwrap();
    let e = load_dataset(&path, None, &DataFields::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chat.jsonl:1:") && e.contains("no messages"),
        "{e}"
    );
}

/// A word-level tokenizer directory, with `template` as its chat template when given.
fn word_tokenizer(dir: &Path, template: Option<&str>) -> yatt_engine::Tokenizer {
    let vocab: serde_json::Map<String, serde_json::Value> = [
        "<unk>",
        "[system]",
        "[user]",
        "[assistant]",
        "be",
        "brief",
        "2+3?",
    ]
    .iter()
    .enumerate()
    .map(|(i, w)| (w.to_string(), serde_json::json!(i)))
    .collect();
    let tokenizer = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null, "decoder": null,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<unk>"}
    });
    std::fs::write(dir.join("tokenizer.json"), tokenizer.to_string()).unwrap();
    if let Some(t) = template {
        std::fs::write(
            dir.join("tokenizer_config.json"),
            serde_json::json!({ "chat_template": t }).to_string(),
        )
        .unwrap();
    }
    yatt_engine::Tokenizer::from_dir(dir).unwrap()
}

#[test]
fn chat_prompts_go_through_the_chat_template() {
    use std::sync::Arc;
    use yatt_roles::{TextCodec, TokenizerCodec};
    let dir = tempfile::tempdir().unwrap();
    let template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}";
    let tok = Arc::new(word_tokenizer(dir.path(), Some(template)));
    let messages = vec![
        ChatMessage::new("system", "be brief"),
        ChatMessage::new("user", "2+3?"),
    ];
    // `chat = false` too: a chat prompt is a chat whatever model.chat says
    let codec = TokenizerCodec {
        tokenizer: tok.clone(),
        chat: false,
    };
    let ids = codec.encode_chat(&messages).unwrap();
    assert_eq!(ids, vec![1, 4, 5, 2, 6, 3]);
    assert_eq!(
        ids,
        tok.encode("[system] be brief [user] 2+3? [assistant]", false)
            .unwrap()
    );
    let plain = tempfile::tempdir().unwrap();
    let codec = TokenizerCodec {
        tokenizer: Arc::new(word_tokenizer(plain.path(), None)),
        chat: false,
    };
    let e = codec.encode_chat(&messages).unwrap_err();
    assert!(
        e.contains("no chat template") && e.contains("strings"),
        "{e}"
    );
}
