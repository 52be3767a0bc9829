//! Streaming rollouts with the tiny tch model: samples leave the rollout in finishing
//! order while the rest are still being generated, the stream carries exactly what a
//! whole-request answer carries, and a streamed job (rewards scored while generation
//! goes on) trains exactly like the non-streamed one for the same seed.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use yatt_engine::SamplingParams;
use yatt_roles::Prompt;
use yatt_roles::Role;
use yatt_roles::Sample;
use yatt_roles::{GenerateRequest, RolloutRequest, RolloutResponse, SampleSink};
use yatt_runtime::Node;
use yatt_trainer::{base_model, rollout_role, train, JobConfig};

fn demo_config(out: &Path, sets: &[&str]) -> JobConfig {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/demo-letters.toml");
    let mut all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    all.push(format!("job.output_dir={:?}", out.display().to_string()));
    JobConfig::load(path, &all).unwrap()
}

/// Long-tail lengths: EOS ends some responses after a token or two, others run to the
/// limit.
const LONG_TAIL: [&str; 3] = [
    "rollout.ignore_eos=false",
    "rollout.max_new_tokens=24",
    "rollout.temperature=1.5",
];

fn request(job: &JobConfig) -> GenerateRequest {
    GenerateRequest {
        step: 0,
        prompts: (0..8)
            .map(|i| Prompt {
                id: 1000 + i,
                text: format!("q{i}:"),
                messages: Vec::new(),
                reference: None,
                metadata: serde_json::Value::Null,
            })
            .collect(),
        n: 4,
        params: SamplingParams {
            temperature: 1.5,
            max_new_tokens: job.rollout.max_new_tokens,
            ..Default::default()
        },
        seed: 9,
    }
}

#[test]
fn samples_leave_the_rollout_as_they_finish() {
    let out = tempfile::tempdir().unwrap();
    let job = demo_config(out.path(), &LONG_TAIL);
    let (model, codec, _) = base_model(&job).unwrap();
    let mut whole = rollout_role(
        &job,
        model
            .deep_copy(yatt_engine::tch::Device::Cpu, model.kind())
            .unwrap(),
        codec.clone(),
    );
    let RolloutResponse::Generated { samples: want, .. } = whole
        .serve(RolloutRequest::Generate(request(&job)))
        .unwrap()
    else {
        panic!("not Generated")
    };

    // Capacity 1: the rollout waits for this reader after every sample.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Sample>(1);
    let done = Arc::new(AtomicBool::new(false));
    let mut role = rollout_role(&job, model, codec);
    let req = request(&job);
    let flag = done.clone();
    let gen = std::thread::spawn(move || {
        let r = role.serve(RolloutRequest::GenerateStream(req, SampleSink(tx)));
        flag.store(true, Ordering::SeqCst);
        r
    });
    let mut got = Vec::new();
    let mut done_at_first = None;
    while let Some(s) = rx.blocking_recv() {
        done_at_first.get_or_insert(done.load(Ordering::SeqCst));
        got.push(s);
    }
    let answer = gen.join().unwrap().unwrap();
    assert!(
        matches!(answer, RolloutResponse::Streamed { samples: 32, .. }),
        "{answer:?}"
    );
    assert_eq!(
        done_at_first,
        Some(false),
        "the first sample came after the request"
    );

    // Finishing order: shortest first (every request is admitted at once), which is not
    // the request order of a long-tail mix; the first sample was out while the longest
    // was still being decoded.
    let lens: Vec<usize> = got.iter().map(Sample::response_len).collect();
    assert!(lens.windows(2).all(|w| w[0] <= w[1]), "{lens:?}");
    let request_order: Vec<usize> = want.iter().map(Sample::response_len).collect();
    assert!(
        request_order.windows(2).any(|w| w[0] > w[1]),
        "{request_order:?}"
    );
    assert!(lens[0] < lens[lens.len() - 1], "no long tail: {lens:?}");

    // The same samples as the whole-request answer.
    got.sort_by_key(|s| (s.id.prompt, s.id.k));
    assert_eq!(got, want);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streamed_job_trains_exactly_like_a_whole_request_one() {
    // Everything but wall-clock figures must be equal.
    let timing = |k: &str| {
        let k = yatt_metrics::names::without_head(k);
        k.starts_with("timing_s/") || k.starts_with("perf/") || k.starts_with("stream/")
    };
    let mut runs = Vec::new();
    for stream in ["false", "true"] {
        let out = tempfile::tempdir().unwrap();
        let set = format!("rollout.stream={stream}");
        let mut sets = LONG_TAIL.to_vec();
        sets.extend([set.as_str(), "job.steps=4"]);
        let job = demo_config(out.path(), &sets);
        let certs = tempfile::tempdir().unwrap();
        let node = Node::builder("stream-0")
            .dev_certs(certs.path())
            .start()
            .await
            .unwrap();
        // `train` closes every step's ledger (it refuses to close with a sample
        // missing, doubled or unexpected).
        let mut rows = Vec::new();
        train(&job, &node, |p| rows.push(p.metrics.clone()))
            .await
            .unwrap();
        node.shutdown().await;
        runs.push(rows);
    }
    let (whole, streamed) = (&runs[0], &runs[1]);
    assert_eq!(whole.len(), 4);
    for (step, (a, b)) in whole.iter().zip(streamed).enumerate() {
        for (k, v) in a.values.iter().filter(|(k, _)| !timing(k)) {
            assert_eq!(Some(*v), b.get(k), "step {}: {k}", step + 1);
        }
        // 64 samples through a channel of 8: the reward role saw samples before the
        // rollout finished.
        let early = b.get("stream/rewarded_during_gen").unwrap();
        assert!(
            early > 0.0,
            "step {}: nothing was rewarded during generation",
            step + 1
        );
        assert_eq!(b.get("training/dropped_samples"), Some(0.0));
    }
}
