//! Scalar reward models with real tch models (the engine's tiny Llama and its character
//! codec): the reward role scores exactly what the engine's reward head scores, config
//! errors name the key and the fix, and a reward model trained on the letters property
//! steers a GRPO job (its score and the true property both rise).

use crate::common;

use std::path::Path;

use common::{demo_config, letter_responses, letters_fraction, load_demo, text_sample};

use yatt_engine::save_pretrained;
use yatt_engine::score::{rewards, SeqBatch};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::tiny_config;
use yatt_engine::{Llama, TrainConfig};
use yatt_roles::Role;
use yatt_roles::Sample;
use yatt_roles::TINY_CODEC;
use yatt_roles::{train_reward_model, RmExample, RmTrainConfig, TextCodec};
use yatt_runtime::Node;
use yatt_trainer::{build_embedded, reward_role};

/// A tiny model with a random (non-zero) reward head, saved as an HF directory.
fn random_reward_model(dir: &Path) {
    let mut m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 11).unwrap();
    m.attach_head("score");
    tch::no_grad(|| {
        let h = m.head.as_mut().unwrap();
        let _ = h
            .weight
            .copy_(&(Tensor::randn([1, 64], (Kind::Float, Device::Cpu)) * 0.5));
    });
    save_pretrained(&m, dir, None).unwrap();
}

#[test]
fn the_reward_role_scores_what_the_engine_reward_head_scores() {
    let rm = tempfile::tempdir().unwrap();
    random_reward_model(rm.path());
    let out = tempfile::tempdir().unwrap();
    let dir = format!("reward.model={:?}", rm.path().display().to_string());
    let job = demo_config(
        out.path(),
        &[
            "reward.kind=[\"model\", \"letters\"]".into(),
            "reward.weights=[2.0, 0.5]".into(),
            dir,
        ],
    );
    let mut role = reward_role(&job).unwrap();
    let texts = [
        ("q1:", "abc"),
        ("q22:", "zz top!"),
        ("q3:", ""),
        ("q4:", "a much longer answer"),
    ];
    let samples: Vec<Sample> = texts
        .iter()
        .enumerate()
        .map(|(k, (p, r))| text_sample(k as u32, p, r))
        .collect();
    let scored = role.serve(samples).unwrap();

    // The engine directly, one sequence at a time (no padding), the prompt as the
    // rollout encodes it and the response text after it.
    let model = Llama::load(rm.path(), Device::Cpu, Kind::Float).unwrap();
    let mut distinct = Vec::new();
    for ((p, r), s) in texts.iter().zip(&scored) {
        let prompt = TINY_CODEC.encode_prompt(p).unwrap();
        let response = TINY_CODEC.encode_response(r).unwrap();
        let b = SeqBatch::from_pairs(&[(&prompt, &response)], 0, Device::Cpu).unwrap();
        let direct = tch::no_grad(|| rewards(&model, &b))
            .unwrap()
            .double_value(&[0]);
        let want = 2.0 * direct + 0.5 * letters_fraction(r);
        let got = s.reward.unwrap();
        assert!(
            (got - want).abs() < 1e-5,
            "{p:?} {r:?}: role {got}, engine {want}"
        );
        assert_eq!(s.step_rewards, None);
        distinct.push(direct);
    }
    // A zero head would pass the comparison trivially.
    assert!(
        distinct.windows(2).any(|w| (w[0] - w[1]).abs() > 1e-3),
        "{distinct:?}"
    );
}

#[test]
fn reward_model_config_errors_name_the_key_and_the_fix() {
    let out = tempfile::tempdir().unwrap();
    let load = |sets: &[String]| load_demo(out.path(), sets);
    // kind = "model" without a directory.
    let e = load(&["reward.kind=\"model\"".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("reward.model") && e.contains("yatt reward-model"),
        "{e}"
    );
    // A directory that does not exist.
    let e = load(&[
        "reward.kind=\"model\"".into(),
        "reward.model=\"/no/such/rm\"".into(),
    ])
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("reward.model") && e.contains("/no/such/rm"),
        "{e}"
    );
    // A model directory set while the kind does not use it.
    let plain = tempfile::tempdir().unwrap();
    let m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 1).unwrap();
    save_pretrained(&m, plain.path(), None).unwrap();
    let dir = format!("reward.model={:?}", plain.path().display().to_string());
    let e = load(std::slice::from_ref(&dir)).unwrap_err().to_string();
    assert!(
        e.contains("reward.model") && e.contains("add \"model\" to reward.kind"),
        "{e}"
    );
    // A model without a reward head: the role refuses it and says how to make one.
    let job = load(&["reward.kind=\"model\"".into(), dir]).unwrap();
    let e = reward_role(&job).err().unwrap().to_string();
    assert!(
        e.contains("reward.model")
            && e.contains("no reward head")
            && e.contains("yatt reward-model"),
        "{e}"
    );
}

/// Responses of the demo's length with letter fractions spread over [0, 1], scored by
/// the letters property.
fn letters_examples(n: usize, seed: u64) -> Vec<RmExample> {
    letter_responses(n, seed)
        .into_iter()
        .map(|(prompt, response)| RmExample::Scored {
            prompt,
            target: letters_fraction(&response),
            response,
        })
        .collect()
}

fn pearson(a: &[f64], b: &[f64]) -> f64 {
    let n = a.len() as f64;
    let (ma, mb) = (a.iter().sum::<f64>() / n, b.iter().sum::<f64>() / n);
    let cov: f64 = a.iter().zip(b).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = a.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = b.iter().map(|y| (y - mb).powi(2)).sum();
    cov / (va * vb).sqrt()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpo_on_a_trained_reward_model_raises_its_score_and_the_property() {
    // 1. A reward model learns the letters fraction from scored examples.
    let train = letters_examples(1024, 5);
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 21).unwrap();
    let config = RmTrainConfig {
        steps: 100,
        batch: 32,
        optim: TrainConfig {
            lr: 3e-3,
            max_grad_norm: Some(1.0),
            ..Default::default()
        },
        pad_id: 0,
    };
    let (rm, stats) = train_reward_model(base, &TINY_CODEC, &train, &config).unwrap();
    let head =
        |s: &[yatt_engine::StepStats]| s.iter().map(|s| s.loss).sum::<f64>() / s.len() as f64;
    assert!(
        head(&stats[90..]) < head(&stats[..10]) / 2.0,
        "reward model loss did not fall: {:.4} → {:.4}",
        head(&stats[..10]),
        head(&stats[90..])
    );
    let dir = tempfile::tempdir().unwrap();
    save_pretrained(&rm, dir.path(), None).unwrap();

    // 2. It ranks held-out responses by the property (else step 3 proves nothing).
    let out = tempfile::tempdir().unwrap();
    let sets = vec![
        "reward.kind=\"model\"".to_string(),
        format!("reward.model={:?}", dir.path().display().to_string()),
        "job.steps=30".into(),
    ];
    let job = demo_config(out.path(), &sets);
    let held = letters_examples(256, 99);
    let samples: Vec<Sample> = held
        .iter()
        .enumerate()
        .map(|(k, e)| match e {
            RmExample::Scored {
                prompt, response, ..
            } => text_sample(k as u32, prompt, response),
            RmExample::Pair { .. } => unreachable!(),
        })
        .collect();
    let truth: Vec<f64> = samples
        .iter()
        .map(|s| letters_fraction(&s.response_text))
        .collect();
    let scores: Vec<f64> = reward_role(&job)
        .unwrap()
        .serve(samples)
        .unwrap()
        .iter()
        .map(|s| s.reward.unwrap())
        .collect();
    let r = pearson(&scores, &truth);
    assert!(
        r > 0.8,
        "the reward model does not track the property: r = {r:.3}"
    );

    // 3. GRPO against the reward model: its score rises, and so does the property it
    // learnt (a real signal, not the policy gaming a random head).
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("rm-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    let (mut score, mut property) = (Vec::new(), Vec::new());
    for _ in 0..30 {
        let rep = controllers[0].step().await.unwrap();
        assert_eq!(rep.ledger.dropped, 0);
        score.push(rep.metrics.get("critic/score/mean").unwrap());
        let p: f64 = rep
            .samples
            .iter()
            .map(|s| letters_fraction(&s.response_text))
            .sum::<f64>()
            / rep.samples.len() as f64;
        property.push(p);
    }
    node.shutdown().await;
    let mean = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let (s0, s1) = (mean(&score[..5]), mean(&score[25..]));
    let (p0, p1) = (mean(&property[..5]), mean(&property[25..]));
    assert!(s1 > s0 + 0.2, "reward model score {s0:.3} → {s1:.3}");
    assert!(
        p1 > p0 + 0.2,
        "letters fraction {p0:.3} → {p1:.3} (score {s0:.3} → {s1:.3})"
    );
}
