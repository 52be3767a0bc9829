//! `placement.time_share = "offload"` on the demo job: the controller offloads the
//! policy (and reference, critic) for generation and the rollout for the rest of the
//! step. Offload and reload are lossless, so a run is bit-identical to one without
//! time sharing; the policy holds no device bytes while the rollout generates; a reload
//! that would go beyond `placement.device_memory_gb` fails the step naming the role;
//! the combinations that cannot share a device are refused naming their keys.

use yatt_metrics::names;
use yatt_runtime::Node;
use yatt_trainer::{build, step_data_parallel, ControllerError, StepMetrics};

use crate::common;

/// The metrics of each step of the demo job with `sets`, or the first step's error.
async fn run(sets: &[&str], steps: u64) -> Result<Vec<StepMetrics>, ControllerError> {
    let out = tempfile::tempdir().unwrap();
    let certs = tempfile::tempdir().unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    let job = common::demo_config(out.path(), &sets);
    let node = Node::builder("time-share-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build(&job, &node).await.unwrap();
    let mut metrics = Vec::new();
    let mut failed = None;
    for _ in 0..steps {
        // As `yatt train` steps them: one head alone (PPO's critic trains there only).
        let step = match controllers.len() {
            1 => controllers[0].step().await.map(|r| vec![r]),
            _ => step_data_parallel(&mut controllers).await,
        };
        match step {
            Ok(reports) => metrics.push(reports[0].metrics.clone()),
            Err(e) => {
                failed = Some(e);
                break;
            }
        }
    }
    drop(controllers);
    node.shutdown().await;
    match failed {
        Some(e) => Err(e),
        None => Ok(metrics),
    }
}

const ON: &str = "placement.time_share=\"offload\"";

/// The metrics that depend on the clock or on time sharing itself.
fn timing(name: &str) -> bool {
    let name = names::without_head(name);
    name.starts_with(names::TIMING_PREFIX)
        || name.starts_with("perf/resident_bytes")
        || name == names::THROUGHPUT
        || name == names::GEN_TOKENS_PER_S
}

/// Every metric but the timings and the resident bytes, bit for bit on the CPU.
///
/// On a GPU (`model.device = "auto"` puts the demo there) two runs differ in the last
/// bits even without time sharing: libtorch's CUDA attention backward accumulates with
/// atomics. The GPU checks saw step 1's `actor/pg_loss` differ by about 1e-9 relative
/// and `actor/ppo_kl` (a mean of small differences of log-probs) by 4.5e-6 (H100).
/// There the first step is compared within 1e-4 relative, as later steps may sample
/// other tokens from weights that differ in their last bits. A weight or optimizer state
/// lost in an offload moves these by far more.
fn assert_same(off: &[StepMetrics], on: &[StepMetrics], what: &str) {
    assert_eq!(off.len(), on.len());
    if yatt_engine::cuda_device_count() > 0 {
        for (k, x) in off[0].values.iter().filter(|(k, _)| !timing(k)) {
            // Time sharing adds metrics (its switch costs); every other one is in both.
            let y = on[0]
                .values
                .get(k)
                .unwrap_or_else(|| panic!("{what}: step 1 lacks {k}"));
            // An absolute floor for metrics near zero (the log-prob gap is ~1e-7 there).
            let close =
                x.to_bits() == y.to_bits() || (x - y).abs() <= 1e-4 * x.abs().max(y.abs()) + 1e-6;
            assert!(
                timing(k) || close,
                "{what}: step 1's {k} differs: {x} vs {y}"
            );
        }
        return;
    }
    for (i, (a, b)) in off.iter().zip(on).enumerate() {
        // Bit for bit (a step without a trained token has a NaN entropy in both).
        let bits = |m: &StepMetrics| -> Vec<(String, u64)> {
            let kept = m.values.iter().filter(|(k, _)| !timing(k));
            kept.map(|(k, v)| (k.clone(), v.to_bits())).collect()
        };
        let (a, b) = (bits(a), bits(b));
        assert_eq!(a, b, "{what}: step {} differs", i + 1);
    }
}

fn metric(m: &StepMetrics, name: &str) -> f64 {
    m.get(name)
        .unwrap_or_else(|| panic!("{name} missing in step {}", m.step))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn time_sharing_learns_bit_identically_and_frees_the_policy_during_generation() {
    let off = run(&["job.steps=30"], 30).await.unwrap();
    let on = run(&["job.steps=30", ON], 30).await.unwrap();
    let rewards: Vec<f64> = on.iter().map(|m| metric(m, names::REWARDS_MEAN)).collect();
    let first: f64 = rewards[..5].iter().sum::<f64>() / 5.0;
    let last: f64 = rewards[25..].iter().sum::<f64>() / 5.0;
    assert!(
        last > first + 0.3,
        "first 5 steps {first:.3}, last 5 {last:.3}"
    );
    assert_same(&off, &on, "time_share = offload");
    let mean = |name: &str| on.iter().map(|m| metric(m, name)).sum::<f64>() / on.len() as f64;
    let policy = format!("{}policy", names::RESIDENT_BYTES_PREFIX);
    let policy_loaded = format!("{}policy", names::RESIDENT_BYTES_LOADED_PREFIX);
    let rollout = format!("{}rollout", names::RESIDENT_BYTES_PREFIX);
    let rollout_loaded = format!("{}rollout", names::RESIDENT_BYTES_LOADED_PREFIX);
    eprintln!(
        "demo, time_share = offload: offload {:.2} ms/step, reload {:.2} ms/step, step {:.1} ms (off: {:.1} ms); policy {} -> {} bytes during generation; rollout {} -> {} bytes during training",
        1e3 * mean(names::OFFLOAD_S),
        1e3 * mean(names::RELOAD_S),
        1e3 * mean(names::STEP_S),
        1e3 * off.iter().map(|m| metric(m, names::STEP_S)).sum::<f64>() / off.len() as f64,
        mean(&policy_loaded),
        mean(&policy),
        mean(&rollout_loaded),
        mean(&rollout),
    );
    for m in &on {
        // Without time sharing the policy holds its loaded bytes all along.
        assert!(metric(m, &policy_loaded) > 0.0);
        assert_eq!(metric(m, &policy), 0.0, "step {}", m.step);
        // The rollout's KV cache goes (on a CPU device its weights stay in RAM).
        assert!(metric(m, &rollout) < metric(m, &rollout_loaded));
    }
    assert!(off.iter().all(|m| m.get(names::OFFLOAD_S).is_none()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reference_the_critic_and_two_heads_take_turns_losslessly() {
    for extra in [
        &["algorithm.kl_coef=0.05"][..],
        &["algorithm.name=\"ppo\""],
        &["job.controllers=2"],
        &["job.controllers=2", "job.driver=\"single\""],
    ] {
        let mut sets = vec!["job.steps=4"];
        sets.extend_from_slice(extra);
        let off = run(&sets, 4).await.unwrap();
        sets.push(ON);
        let on = run(&sets, 4).await.unwrap();
        assert_same(&off, &on, &format!("{extra:?}"));
        assert!(on.iter().all(|m| m.get(names::RELOAD_S).is_some()));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_beyond_the_budget_fails_the_step_naming_the_role() {
    // About 1 KiB: the policy cannot come back next to the reward and the rollout.
    let e = run(&["job.steps=2", ON, "placement.device_memory_gb=1e-6"], 2)
        .await
        .unwrap_err();
    match &e {
        ControllerError::DeviceBudget {
            step,
            role,
            need,
            in_use,
            budget,
        } => {
            assert_eq!((*step, role.as_str()), (1, "policy"));
            assert!(*need > 0 && need + in_use > *budget, "{e}");
        }
        other => panic!("expected DeviceBudget, got {other}"),
    }
    let text = e.to_string();
    assert!(
        text.contains("placement.device_memory_gb") && text.contains("policy"),
        "{text}"
    );
    // A budget the roles fit runs.
    run(&["job.steps=2", ON, "placement.device_memory_gb=1"], 2)
        .await
        .unwrap();
}

#[test]
fn roles_that_do_not_share_a_device_or_overlap_are_refused_naming_the_keys() {
    let out = tempfile::tempdir().unwrap();
    let refused = |sets: &[&str], keys: &[&str]| {
        let mut all: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        all.push(ON.into());
        let e = common::load_demo(out.path(), &all).unwrap_err().to_string();
        for k in keys {
            assert!(e.contains(k), "{sets:?}: {e} does not name {k}");
        }
    };
    refused(
        &["placement.mode=\"disaggregated\""],
        &["placement.time_share", "placement.mode"],
    );
    refused(
        &["rollout.staleness=1"],
        &["placement.time_share", "rollout.staleness"],
    );
    refused(
        &["placement.live=true", "job.controllers=2"],
        &["placement.time_share", "placement.live"],
    );
    let e = common::load_demo(out.path(), &["placement.time_share=\"sleep\"".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("placement.time_share") && e.contains("offload"),
        "{e}"
    );
    let e = common::load_demo(out.path(), &["placement.device_memory_gb=-1".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("placement.device_memory_gb"), "{e}");
}
