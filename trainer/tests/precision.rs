//! `model.dtype` and `model.device` on the demo job: in bf16 the run learns, with f32
//! master weights in the trainer, and reports how far the rollout's log-probs are from
//! the trainer's; f16 runs; a device the machine lacks is refused naming the key. One
//! body on every device: the CPU always, CUDA 0 when libtorch sees a GPU.

use yatt_metrics::names;
use yatt_runtime::Node;
use yatt_trainer::{build, step_data_parallel, JobError};

use crate::common;

/// Rewards and the mean rollout/trainer log-prob difference per step of the demo job.
async fn run(sets: &[String], steps: u64) -> (Vec<f64>, Vec<f64>) {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let job = common::demo_config(out.path(), sets);
    let node = Node::builder("precision-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build(&job, &node).await.unwrap();
    let (mut rewards, mut diffs) = (Vec::new(), Vec::new());
    for step in 0..steps {
        let reports = step_data_parallel(&mut controllers)
            .await
            .unwrap_or_else(|e| panic!("{sets:?}, step {step}: {e}"));
        let m = &reports[0].metrics;
        rewards.push(m.get(names::REWARDS_MEAN).expect("reward"));
        diffs.push(
            m.get(names::LOGPROB_DIFF_MEAN)
                .expect("log-prob difference"),
        );
    }
    node.shutdown().await;
    (rewards, diffs)
}

fn device_name(dev: yatt_engine::tch::Device) -> String {
    match dev {
        yatt_engine::tch::Device::Cuda(n) => format!("cuda:{n}"),
        _ => "cpu".into(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_demo_learns_in_bf16_and_reports_the_rollout_trainer_logprob_gap() {
    for dev in yatt_engine::test_devices() {
        let sets = vec![
            "job.steps=30".to_string(),
            "model.dtype=\"bf16\"".into(),
            format!("model.device={:?}", device_name(dev)),
        ];
        let (rewards, diffs) = run(&sets, 30).await;
        let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
        let last: f64 = rewards[25..].iter().sum::<f64>() / 5.0;
        eprintln!(
            "bf16 on {dev:?}: reward first 5 steps {first:.3}, last 5 {last:.3}; rollout-trainer log-prob gap per token {diffs:.4?}"
        );
        assert!(
            last > first + 0.3 && last > 0.7,
            "bf16 on {dev:?}: reward first 5 steps {first:.3}, last 5 {last:.3}"
        );
        // Rollout and trainer run the same bf16 weights through different kernels
        // (cached decode against a full forward): the gap is rounding, not drift.
        assert!(
            diffs.iter().all(|d| d.is_finite() && *d < 0.1),
            "bf16 on {dev:?}: log-prob gap {diffs:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f16_runs_the_demo() {
    let sets = vec!["job.steps=3".to_string(), "model.dtype=\"f16\"".into()];
    let (rewards, diffs) = run(&sets, 3).await;
    assert!(
        rewards.iter().chain(&diffs).all(|x| x.is_finite()),
        "{rewards:?} {diffs:?}"
    );
}

#[test]
fn a_device_the_machine_lacks_is_refused_naming_the_key() {
    let out = tempfile::tempdir().unwrap();
    let bad = common::load_demo(out.path(), &["model.device=\"tpu\"".into()]).unwrap_err();
    assert!(bad.to_string().contains("model.device"), "{bad}");
    let n = yatt_engine::cuda_device_count();
    let job = common::demo_config(out.path(), &[format!("model.device=\"cuda:{n}\"")]);
    let rt = tokio::runtime::Runtime::new().unwrap();
    let err = rt.block_on(async {
        let certs = tempfile::tempdir().unwrap();
        let node = Node::builder("precision-1")
            .dev_certs(certs.path())
            .start()
            .await
            .unwrap();
        let r = build(&job, &node).await.err();
        node.shutdown().await;
        r
    });
    match err {
        Some(JobError::Invalid { key, found, .. }) => {
            assert_eq!(key, "model.device");
            assert_eq!(found, format!("cuda:{n}"));
        }
        other => panic!("expected model.device to be refused, got {other:?}"),
    }
}
