//! The whole RLHF pipeline in one process: a tiny random Llama learns a trivially
//! learnable reward with GRPO through rollout, reward, reference and policy roles
//! driven by a controller, with the sample ledger closing every step.

use std::sync::Arc;
use std::time::{Duration, Instant};

use yatt_engine::tch::{self, Device, Kind};
use yatt_engine::tiny_config;
use yatt_engine::{Generator, GeneratorConfig, Llama, SamplingParams, TrainConfig, Trainer};
use yatt_roles::Sample;
use yatt_roles::{
    AsciiCodec, PolicyConfig, PolicyRole, ReferenceRole, RewardRole, RolloutRequest,
    RolloutResponse, RolloutRole,
};
use yatt_roles::{Dataloader, Prompt};
use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError, RoleRequest, RoleResponse};
use yatt_roles::{RewardError, RewardFn, RewardInput, RewardOutput};
use yatt_runtime::Node;
use yatt_trainer::{
    spawn_role, Controller, ControllerConfig, ControllerError, RoleRefs, RolloutRef, StepReport,
};
use yatt_trainer::{LedgerError, Stage};

const CODEC: AsciiCodec = AsciiCodec {
    first_id: 2,
    bos: Some(0),
};
/// Characters the reward likes: 10 of the 95 printable ones (≈ 10 % at random).
const LIKED: &str = "abcdefghij";

/// Fraction of response characters in `LIKED`.
struct LikedChars;

impl RewardFn for LikedChars {
    fn name(&self) -> &str {
        "liked-chars"
    }
    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let n = s.response.chars().count().max(1) as f64;
        let hits = s.response.chars().filter(|c| LIKED.contains(*c)).count() as f64;
        Ok(RewardOutput {
            score: hits / n,
            ..Default::default()
        })
    }
}

fn prompts() -> Vec<Prompt> {
    (0..16u64)
        .map(|i| Prompt {
            id: 1000 + i,
            text: format!("q{i}:"),
            messages: Vec::new(),
            reference: None,
            metadata: serde_json::Value::Null,
        })
        .collect()
}

fn controller_config() -> ControllerConfig {
    ControllerConfig {
        prompts_per_step: 8,
        n: 8,
        sampling: SamplingParams {
            temperature: 1.0,
            max_new_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        },
        seed: 7,
        ..Default::default()
    }
}

struct Cluster {
    _node: Node,
    _certs: tempfile::TempDir,
    controller: Controller,
    rollout: RolloutRef,
}

/// A node with rollout, reward (from `reward`), reference and policy roles, all built
/// from one random model (seed 1).
async fn cluster<R: Role<Request = Vec<Sample>, Response = Vec<Sample>>>(reward: R) -> Cluster {
    tch::set_num_threads(1);
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("n0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let model = {
        // Llama::random seeds libtorch's global RNG: tests running in parallel must not
        // interleave their draws, or "the same seed" gives different models.
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
        Llama::random(tiny_config(), Device::Cpu, Kind::Float, 1).unwrap()
    };
    let gen = Generator::new(
        model.deep_copy(Device::Cpu, Kind::Float).unwrap(),
        GeneratorConfig {
            max_batch: 64,
            max_seq_len: 32,
            ..Default::default()
        },
    );
    let reference = ReferenceRole::new(
        model.deep_copy(Device::Cpu, Kind::Float).unwrap(),
        1,
        1.0,
        64,
    );
    let trainer = Trainer::new(
        model,
        TrainConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    );
    let policy = PolicyRole::new(
        trainer,
        PolicyConfig {
            micro_batch_size: 32,
            mini_batches: 2,
            pad_id: 1,
            ..Default::default()
        },
    )
    .unwrap();
    let g = || DeviceGroup::cpu("n0");
    let rollout = spawn_role(&node, RolloutRole::new(gen, Arc::new(CODEC)), 0, g())
        .await
        .unwrap();
    let roles = RoleRefs {
        rollout: rollout.clone(),
        reward: spawn_role(&node, reward, 0, g()).await.unwrap(),
        reference: Some(spawn_role(&node, reference, 0, g()).await.unwrap()),
        policy: spawn_role(&node, policy, 0, g()).await.unwrap(),
        critic: None,
        extra_rollouts: Vec::new(),
    };
    let loader = Dataloader::new(prompts(), 0, 1, 3).unwrap();
    let controller = Controller::new(controller_config(), loader, roles).unwrap();
    Cluster {
        _node: node,
        _certs: certs,
        controller,
        rollout,
    }
}

fn reward_role() -> RewardRole {
    RewardRole::new(vec![(1.0, Box::new(LikedChars) as Box<dyn RewardFn>)]).unwrap()
}

async fn probe_logits(rollout: &RolloutRef) -> Vec<f32> {
    let req = RolloutRequest::NextTokenLogits(vec![
        0,
        CODEC.id_of('q').unwrap(),
        CODEC.id_of('1').unwrap(),
    ]);
    match rollout
        .ask(RoleRequest::Serve(req), Duration::from_secs(10))
        .await
        .unwrap()
    {
        RoleResponse::Served(RolloutResponse::Logits(v)) => v,
        other => panic!("unexpected answer {other:?}"),
    }
}

fn mean(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len() as f64
}

fn fingerprint(r: &StepReport) -> Vec<(u64, u32, Vec<i64>)> {
    r.samples
        .iter()
        .map(|s| (s.id.prompt, s.id.k, s.response_tokens.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpo_learns_a_trivial_reward_with_synced_weights() {
    let mut c = cluster(reward_role()).await;
    let before = probe_logits(&c.rollout).await;
    let t0 = Instant::now();
    let mut rewards = Vec::new();
    let mut first_steps = Vec::new();
    let mut last = None;
    for step in 0..30u64 {
        let r = c
            .controller
            .step()
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        // The ledger closed: every one of the 64 samples passed every stage once.
        assert_eq!(r.ledger.samples, 64);
        assert_eq!(r.ledger.stages.len(), 6);
        let m = &r.metrics;
        for name in [
            "timing_s/gen",
            "timing_s/reward",
            "timing_s/ref",
            "timing_s/old_log_prob",
            "timing_s/adv",
            "timing_s/update_actor",
            "timing_s/weight_sync",
            "timing_s/step",
            "critic/rewards/mean",
            "actor/kl",
            "actor/entropy",
            "actor/pg_clipfrac",
            "actor/grad_norm",
            "response_length/mean",
            "perf/throughput",
            "perf/gen_tokens_per_s",
        ] {
            let v = m
                .get(name)
                .unwrap_or_else(|| panic!("metric {name} missing"));
            // With every advantage zero the update runs no pass, so the entropy of the
            // samples it trained is unknown.
            let trained_none = m.get("actor/grad_norm") == Some(0.0);
            if name == "actor/entropy" && trained_none {
                assert!(v.is_nan(), "{name} = {v} with no sample trained");
                continue;
            }
            assert!(v.is_finite(), "{name} = {v}");
        }
        assert_eq!(m.get("response_length/mean"), Some(6.0));
        assert_eq!(
            m.get("training/weights_version"),
            Some(2.0 * (step + 1) as f64)
        );
        rewards.push(m.get("critic/rewards/mean").unwrap());
        if step < 3 {
            first_steps.push(fingerprint(&r));
        }
        last = Some(r);
    }
    let elapsed = t0.elapsed();
    let last = last.unwrap();
    let (early, late) = (mean(&rewards[..5]), mean(&rewards[25..]));
    eprintln!("30 steps in {elapsed:?}; reward first 5 {early:.3}, last 5 {late:.3}; per step {rewards:.2?}");
    eprintln!("last step metrics: {:?}", last.metrics.values);
    assert!(
        late > early + 0.25,
        "reward did not rise: first 5 steps {early:.3}, last 5 {late:.3}"
    );
    // Two mini-batches per step: the second one runs off-policy and clips sometimes.
    assert!(
        last.metrics.get("actor/kl").unwrap() > 0.0,
        "the policy should have moved away from the reference"
    );

    // Weight sync: the rollout's logits changed, and the last step's rollout log-probs
    // (weights v58) equal the policy's old log-probs computed on the same weights.
    let after = probe_logits(&c.rollout).await;
    let moved = before
        .iter()
        .zip(&after)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        moved > 1e-2,
        "rollout logits did not change after sync (max diff {moved})"
    );
    let mut worst = 0f32;
    for s in &last.samples {
        assert_eq!(s.weights_version, 58);
        for (a, b) in s
            .rollout_logprobs
            .iter()
            .zip(s.old_logprobs.as_ref().unwrap())
        {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(
        worst < 1e-3,
        "rollout and policy disagree on log-probs by {worst}: weights not synced"
    );

    // Determinism: a fresh cluster with the same seeds repeats the first steps exactly.
    let mut again = cluster(reward_role()).await;
    for (step, want) in first_steps.iter().enumerate() {
        let r = again.controller.step().await.unwrap();
        let got = fingerprint(&r);
        let diff: Vec<_> = got
            .iter()
            .zip(want)
            .filter(|(a, b)| a != b)
            .take(3)
            .collect();
        assert!(
            diff.is_empty(),
            "step {step} differs between identical runs: {diff:?}"
        );
    }
    let st = again.controller.state();
    assert_eq!((st.step, st.weights_version), (3, 6));
}

/// The reward role with its answer edited by `edit`.
struct EditedReward(
    RewardRole,
    fn(Vec<Sample>) -> Result<Vec<Sample>, RoleError>,
);

impl Role for EditedReward {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;
    fn name(&self) -> &str {
        "reward"
    }
    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }
    fn start(&mut self, g: &DeviceGroup) -> Result<(), RoleError> {
        self.0.start(g)
    }
    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        (self.1)(self.0.serve(samples)?)
    }
}

/// A reward role that loses the last sample of every batch.
fn dropping_reward() -> EditedReward {
    EditedReward(reward_role(), |mut s| {
        s.pop();
        Ok(s)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_sample_fails_the_step_naming_it() {
    let mut c = cluster(dropping_reward()).await;
    let before = probe_logits(&c.rollout).await;
    let err = c.controller.step().await.unwrap_err();
    let ControllerError::Ledger {
        step: 1,
        source:
            LedgerError::Missing {
                id,
                stage: Stage::Rewarded,
                others: 0,
            },
    } = &err
    else {
        panic!("expected a missing-sample ledger error, got {err}");
    };
    assert_eq!(id.k, 7, "the last sample of the last prompt was dropped");
    let msg = err.to_string();
    assert!(
        msg.contains(&id.to_string()) && msg.contains("missing at stage rewarded"),
        "{msg}"
    );
    // The step stopped before the update: the rollout still has the initial weights.
    assert_eq!(probe_logits(&c.rollout).await, before);
}

/// Regression: errors named the last completed step (0-based), not the failing one
/// as the progress line numbers it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_first_step_is_reported_as_step_1() {
    let failing = EditedReward(reward_role(), |_| {
        Err(RoleError::Failed("the reward service is down".into()))
    });
    let mut c = cluster(failing).await;
    let err = c.controller.step().await.unwrap_err();
    assert!(
        matches!(
            err,
            ControllerError::Call {
                step: 1,
                role: "reward",
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.starts_with("step 1, ") && msg.contains("the reward service is down"),
        "{msg}"
    );
    assert_eq!(c.controller.step_count(), 0, "no step completed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_controllers_average_gradients_at_the_update() {
    use yatt_trainer::step_data_parallel;
    let one = cluster(reward_role()).await;
    // A second head on the same node: its own shard and rollout, the same reward,
    // reference and policy.
    let node = &one._node;
    let model = {
        static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
        let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
        Llama::random(tiny_config(), Device::Cpu, Kind::Float, 1).unwrap()
    };
    let gen = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 64,
            max_seq_len: 32,
            ..Default::default()
        },
    );
    let rollout2 = spawn_role(
        node,
        RolloutRole::new(gen, Arc::new(CODEC)),
        1,
        DeviceGroup::cpu("n0"),
    )
    .await
    .unwrap();
    let shared = one.controller.roles().clone();
    let roles2 = RoleRefs {
        rollout: rollout2.clone(),
        ..shared
    };
    let cfg = ControllerConfig {
        prompts_per_step: 4,
        ..controller_config()
    };
    let a = Controller::new(
        cfg.clone(),
        Dataloader::new(prompts(), 0, 2, 3).unwrap(),
        one.controller.roles().clone(),
    )
    .unwrap();
    let b = Controller::new(cfg, Dataloader::new(prompts(), 1, 2, 3).unwrap(), roles2).unwrap();
    let mut heads = [a, b];
    let mut rewards = Vec::new();
    for step in 0..20 {
        let reports = step_data_parallel(&mut heads)
            .await
            .unwrap_or_else(|e| panic!("step {step}: {e}"));
        assert_eq!(reports.len(), 2);
        // Disjoint shards; each ledger holds its own 32 samples; one optimizer step.
        let pa: std::collections::BTreeSet<u64> =
            reports[0].samples.iter().map(|s| s.group).collect();
        assert!(reports[1].samples.iter().all(|s| !pa.contains(&s.group)));
        for r in &reports {
            assert_eq!(r.ledger.samples, 32);
            assert_eq!(
                r.metrics.get("training/weights_version"),
                Some((step + 1) as f64)
            );
            // Both rollouts generated with the policy's weights of the previous step.
            let worst = r
                .samples
                .iter()
                .flat_map(|s| {
                    s.rollout_logprobs
                        .iter()
                        .zip(s.old_logprobs.as_ref().unwrap())
                        .map(|(a, b)| (a - b).abs())
                })
                .fold(0f32, f32::max);
            assert!(
                worst < 1e-3,
                "step {step}: rollout and policy log-probs differ by {worst}"
            );
        }
        rewards.push(
            (reports[0].metrics.get("critic/rewards/mean").unwrap()
                + reports[1].metrics.get("critic/rewards/mean").unwrap())
                / 2.0,
        );
    }
    let (early, late) = (mean(&rewards[..5]), mean(&rewards[15..]));
    eprintln!("data-parallel: reward first 5 {early:.3}, last 5 {late:.3}");
    assert!(late > early + 0.2, "reward did not rise: {rewards:.2?}");
    // The head that was never stepped on its own holds the same synced weights.
    let (x, y) = (
        probe_logits(&rollout2).await,
        probe_logits(&one.rollout).await,
    );
    let d = x
        .iter()
        .zip(&y)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        d < 1e-5,
        "the two rollouts hold different weights (max logit diff {d})"
    );
}
