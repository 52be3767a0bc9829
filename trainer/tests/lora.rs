//! LoRA policies (`[model.lora]`) on the demo job: a weight sync of the adapters alone
//! moves far fewer bytes than the model and gives the rollouts the same weights as a
//! merged sync, checkpoints are PEFT adapter directories, and a resumed run continues
//! as if it had not stopped. (That a LoRA run learns is shown on SmolLM2 in
//! docs/benchmarks.md: the tiny random model's tied LM head, which LoRA leaves frozen,
//! keeps its logits near uniform.)

use yatt_metrics::names;

use crate::common;

const LORA: &str = "model.lora={rank=8, alpha=16}";

use common::{column, metrics};

/// Runs the demo for 4 steps with `sets`; its metrics, and whether its checkpoint is a
/// PEFT adapter directory.
async fn demo(sets: &[String]) -> (Vec<serde_json::Value>, bool) {
    let out = tempfile::tempdir().unwrap();
    let mut all = vec!["job.steps=4".to_string()];
    all.extend_from_slice(sets);
    common::train_job(&common::demo_config(out.path(), &all), false)
        .await
        .unwrap();
    let peft = out.path().join("checkpoint/adapter_config.json").is_file();
    (metrics(out.path()), peft)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adapter_and_merged_syncs_give_the_rollouts_the_trained_weights() {
    let lr = |x: &str| format!("optim.lr={x}");
    let (adapters, peft) = demo(&[LORA.into(), lr("1e-1")]).await;
    let merged_lora = "model.lora={rank=8, alpha=16, sync=\"merged\"}".to_string();
    let (merged, _) = demo(&[merged_lora, lr("1e-1")]).await;
    // Adapters that barely move: the rollouts must then sample what the base samples.
    let (frozen, _) = demo(&[LORA.into(), lr("1e-9")]).await;
    let (full, full_peft) = demo(&[lr("3e-3")]).await;
    assert!(peft, "a LoRA run's checkpoint is a PEFT adapter directory");
    assert!(!full_peft);
    // Same weights on the rollouts (to float rounding), whichever way they travel: the same
    // samples, so the same rewards; and the trained adapters did reach them.
    let rewards = |ms: &[serde_json::Value]| column(ms, names::REWARDS_MEAN);
    assert_eq!(rewards(&adapters), rewards(&merged));
    assert_eq!(rewards(&adapters)[0], rewards(&frozen)[0]);
    assert_ne!(rewards(&adapters)[1..], rewards(&frozen)[1..]);
    // The policy recomputes the log-probs the rollout sampled with: they agree.
    for m in column(&adapters, names::LOGPROB_DIFF_MAX) {
        assert!(m < 1e-4, "rollout and policy log-probs differ by {m}");
    }
    let bytes = |ms: &[serde_json::Value]| column(ms, names::WEIGHT_SYNC_BYTES)[0];
    assert_eq!(bytes(&merged), bytes(&full));
    assert!(
        bytes(&adapters) * 2.0 < bytes(&full),
        "adapters {} bytes, model {} bytes",
        bytes(&adapters),
        bytes(&full)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lora_run_resumes_as_if_it_had_not_stopped() {
    let sets = |steps: u64| {
        vec![
            format!("job.steps={steps}"),
            LORA.to_string(),
            "optim.lr=3e-3".to_string(),
        ]
    };
    let whole = tempfile::tempdir().unwrap();
    common::train_job(&common::demo_config(whole.path(), &sets(4)), false)
        .await
        .unwrap();
    let parts = tempfile::tempdir().unwrap();
    common::train_job(&common::demo_config(parts.path(), &sets(2)), false)
        .await
        .unwrap();
    common::train_job(&common::demo_config(parts.path(), &sets(4)), true)
        .await
        .unwrap();
    let (a, b) = (metrics(whole.path()), metrics(parts.path()));
    assert_eq!(a.len(), 4);
    assert_eq!(b.len(), 4);
    for name in [names::REWARDS_MEAN, names::PG_LOSS, names::GRAD_NORM] {
        assert_eq!(column(&a, name), column(&b, name), "{name}");
    }
}

#[test]
fn lora_settings_that_cannot_train_are_refused_naming_the_key() {
    let out = tempfile::tempdir().unwrap();
    for (set, says) in [
        ("model.lora={rank=0}", "rank 0"),
        ("model.lora={target_modules=[]}", "target_modules"),
        ("model.lora={dropout=1.5}", "dropout"),
        ("model.lora={target_modules=[\"lm_head\"]}", "lm_head"),
        ("model.lora={sync=\"deltas\"}", "deltas"),
    ] {
        let e = common::load_demo(out.path(), &[set.to_string()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(says) && e.contains("lora"), "{set}: {e}");
    }
}
