//! `config/demo-letters.toml` runs through the library entry point ([`train`]): a few
//! steps, one metrics line per step with the expected keys, a TensorBoard event file
//! with a record per step, and a saved checkpoint.

use yatt_runtime::Node;
use yatt_trainer::{train, JobConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_letters_writes_one_metrics_line_per_step() {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let config = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
    let sets = [
        "job.steps=3".to_string(),
        format!("job.output_dir=\"{}\"", out.path().display()),
    ];
    let job = JobConfig::load(config, &sets).unwrap();
    let node = Node::builder("n0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut seen = Vec::new();
    let summary = train(&job, &node, |p| seen.push((p.step, p.total)))
        .await
        .unwrap();
    assert_eq!(seen, vec![(1, 3), (2, 3), (3, 3)]);
    assert_eq!(summary.steps, 3);
    let text = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 3, "{text}");
    for (i, line) in lines.iter().enumerate() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        assert_eq!(v["step"], (i + 1) as u64, "{line}");
        for key in [
            "critic/rewards/mean",
            "actor/kl",
            "actor/grad_norm",
            "perf/gen_tokens_per_s",
            "timing_s/step",
            "response_length/mean",
        ] {
            assert!(
                v[key].as_f64().is_some_and(f64::is_finite),
                "{key} missing or not finite in {line}"
            );
        }
    }
    let events: Vec<_> = std::fs::read_dir(out.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("events.out.tfevents.")
        })
        .collect();
    assert_eq!(events.len(), 1, "{events:?}");
    let records = yatt_metrics::read_event_records(&std::fs::read(&events[0]).unwrap()).unwrap();
    assert_eq!(
        records.len(),
        1 + 3,
        "the file_version record and one per step"
    );
    let ckpt: Vec<_> = std::fs::read_dir(out.path().join("checkpoint"))
        .unwrap()
        .collect();
    assert!(!ckpt.is_empty(), "the checkpoint directory is empty");
}
