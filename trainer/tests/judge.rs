//! The generative reward model (LLM judge) with real tch models: the engine's tiny
//! Llama, fine-tuned here to write `Score: d/10` verdicts that grade the letters
//! property. Greedy verdicts parse to the digit the judge's own distribution ranks
//! first, the digit-logits score is `Σ p(d)·d / 9` of that distribution, unparseable
//! output fails loudly or takes the configured fallback, and a GRPO job with the judge
//! in the loop runs with a clean ledger and learns the property the judge grades.

use crate::common;

use std::path::{Path, PathBuf};

use common::{demo_config, letter_responses, letters_fraction, text_sample};

use yatt_engine::save_pretrained;
use yatt_engine::score::{token_logprobs, SeqBatch};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::tiny_config;
use yatt_engine::{Llama, TrainConfig, Trainer};
use yatt_roles::Role;
use yatt_roles::Sample;
use yatt_roles::TextCodec;
use yatt_roles::TINY_CODEC;
use yatt_runtime::Node;
use yatt_trainer::{build_embedded, reward_role, JobConfig};

const TEMPLATE: &str = "{question}|{response}=";

fn judge_sets(dir: &Path, mode: &str, extra: &[&str]) -> Vec<String> {
    let mut v = vec![
        "reward.kind=\"judge\"".to_string(),
        format!("reward.judge_model={:?}", dir.display().to_string()),
        format!("reward.judge_template={TEMPLATE:?}"),
        format!("reward.judge_mode={mode:?}"),
        "reward.judge_max_tokens=12".into(),
        "reward.judge_max_seq_len=64".into(),
    ];
    v.extend(extra.iter().map(|s| s.to_string()));
    v
}

/// The digit the judge is taught to write for `response`.
fn grade(response: &str) -> i64 {
    (9.0 * letters_fraction(response)).round() as i64
}

/// Fine-tunes the tiny model to answer the judge prompt with `Score: d/10` and EOS,
/// `d` grading the letters fraction; saves it to `dir`.
fn teach_judge(dir: &Path) {
    let data = letter_responses(1024, 17);
    let seqs: Vec<(Vec<i64>, Vec<i64>)> = data
        .iter()
        .map(|(q, r)| {
            let prompt = TINY_CODEC
                .encode_prompt(&TEMPLATE.replace("{question}", q).replace("{response}", r))
                .unwrap();
            let mut verdict = TINY_CODEC
                .encode_response(&format!("Score: {}/10", grade(r)))
                .unwrap();
            verdict.push(1); // EOS
            (prompt, verdict)
        })
        .collect();
    let model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 31).unwrap();
    let mut t = Trainer::new(
        model,
        TrainConfig {
            lr: 3e-3,
            max_grad_norm: Some(1.0),
            ..Default::default()
        },
    );
    let batch = 32;
    let mut losses = Vec::new();
    for step in 0..150 {
        let chunk: Vec<&(Vec<i64>, Vec<i64>)> = (0..batch)
            .map(|i| &seqs[(step * batch + i) % seqs.len()])
            .collect();
        let s = t
            .step(&[chunk], |m, chunk| {
                let pairs: Vec<(&[i64], &[i64])> = chunk
                    .iter()
                    .map(|(p, v)| (p.as_slice(), v.as_slice()))
                    .collect();
                let b = SeqBatch::from_pairs(&pairs, 0, Device::Cpu)?;
                let lp = token_logprobs(m, &b, 1.0, false).logprobs;
                let mask = b.response_mask.to_kind(Kind::Float);
                Ok(-(lp * &mask).sum(Kind::Float) / mask.sum(Kind::Float))
            })
            .unwrap();
        losses.push(s.loss);
    }
    let m = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    assert!(
        m(&losses[140..]) < m(&losses[..10]) / 4.0,
        "the judge did not learn its verdicts: {losses:?}"
    );
    save_pretrained(&t.model, dir, None).unwrap();
}

/// The judge's distribution over the digits after `Score: `, straight from the engine.
fn digit_probs(model: &Llama, q: &str, r: &str) -> Vec<f64> {
    let mut ids = TINY_CODEC
        .encode_prompt(&TEMPLATE.replace("{question}", q).replace("{response}", r))
        .unwrap();
    ids.extend(TINY_CODEC.encode_response("Score: ").unwrap());
    let n = ids.len() as i64;
    let logits = tch::no_grad(|| model.forward(&Tensor::from_slice(&ids).view([1, -1]), None));
    let last = logits.get(0).get(n - 1).to_kind(Kind::Float);
    let digits: Vec<i64> = (0..10)
        .map(|d| TINY_CODEC.encode_response(&d.to_string()).unwrap()[0])
        .collect();
    let p = last
        .index_select(0, &Tensor::from_slice(&digits))
        .softmax(-1, Kind::Float);
    Vec::<f32>::try_from(p)
        .unwrap()
        .into_iter()
        .map(f64::from)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taught_judge_scores_through_the_role_and_steers_grpo() {
    let judge_dir = tempfile::tempdir().unwrap();
    teach_judge(judge_dir.path());
    let model = Llama::load(judge_dir.path(), Device::Cpu, Kind::Float).unwrap();
    let held = letter_responses(24, 1234);
    let samples = || -> Vec<Sample> {
        held.iter()
            .enumerate()
            .map(|(k, (q, r))| text_sample(k as u32, q, r))
            .collect()
    };
    let out = tempfile::tempdir().unwrap();

    // Greedy verdicts: each parses to the digit the judge's distribution ranks first
    // (the role generated them; the engine's forward pass checks them).
    let job = demo_config(out.path(), &judge_sets(judge_dir.path(), "generate", &[]));
    let mut role = reward_role(&job).unwrap();
    let first = role.serve(samples()).unwrap();
    let again = role.serve(samples()).unwrap();
    let mut right = 0;
    for ((s, a), (q, r)) in first.iter().zip(&again).zip(&held) {
        assert_eq!(s.reward, a.reward, "greedy judging is deterministic");
        let p = digit_probs(&model, q, r);
        let top = (0..10).max_by(|&a, &b| p[a].total_cmp(&p[b])).unwrap() as f64;
        assert!(
            (s.reward.unwrap() - top / 10.0).abs() < 1e-9,
            "{q}{r}: verdict {:?}, top digit {top}",
            s.reward
        );
        right += usize::from(top as i64 == grade(r));
    }
    assert!(
        right * 2 > held.len(),
        "the judge grades {right}/{} right",
        held.len()
    );

    // Digit logits: Σ p(d)·d / 9 of the same distribution.
    let job = demo_config(out.path(), &judge_sets(judge_dir.path(), "logits", &[]));
    let mut role = reward_role(&job).unwrap();
    for (s, (q, r)) in role.serve(samples()).unwrap().iter().zip(&held) {
        let p = digit_probs(&model, q, r);
        let want: f64 = p.iter().enumerate().map(|(d, p)| p * d as f64).sum::<f64>() / 9.0;
        assert!(
            (s.reward.unwrap() - want).abs() < 1e-4,
            "{q}{r}: role {:?}, engine {want}",
            s.reward
        );
    }

    // The judge in the loop: GRPO on the letters task, rewarded by the judge's expected
    // digit only. The ledger balances every step and the graded property rises.
    let mut sets = judge_sets(judge_dir.path(), "logits", &[]);
    sets.push("job.steps=30".into());
    let job = demo_config(out.path(), &sets);
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("judge-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    let mut property = Vec::new();
    for _ in 0..30 {
        let rep = controllers[0].step().await.unwrap();
        assert_eq!(rep.ledger.dropped, 0);
        assert!(rep.metrics.get("critic/score/mean").unwrap().is_finite());
        property.push(
            rep.samples
                .iter()
                .map(|s| letters_fraction(&s.response_text))
                .sum::<f64>()
                / rep.samples.len() as f64,
        );
    }
    node.shutdown().await;
    let m = |x: &[f64]| x.iter().sum::<f64>() / x.len() as f64;
    let (p0, p1) = (m(&property[..5]), m(&property[25..]));
    assert!(
        p1 > p0 + 0.2,
        "letters fraction under the judge {p0:.3} → {p1:.3}"
    );
}

#[test]
fn unparseable_verdicts_fail_loudly_or_take_the_configured_fallback() {
    // An untrained judge writes no score.
    let dir = tempfile::tempdir().unwrap();
    let m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap();
    save_pretrained(&m, dir.path(), None).unwrap();
    let out = tempfile::tempdir().unwrap();
    let batch = || vec![text_sample(0, "q1:", "abc"), text_sample(1, "q2:", "xyz")];

    let job = demo_config(out.path(), &judge_sets(dir.path(), "generate", &[]));
    let e = reward_role(&job)
        .unwrap()
        .serve(batch())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("no final score") && e.contains("judge_on_unparsed"),
        "{e}"
    );

    let job = demo_config(
        out.path(),
        &judge_sets(
            dir.path(),
            "generate",
            &[
                "reward.judge_on_unparsed=\"fallback\"",
                "reward.judge_fallback_score=0.25",
            ],
        ),
    );
    let got = reward_role(&job).unwrap().serve(batch()).unwrap();
    assert!(got
        .iter()
        .all(|s| s.reward == Some(0.25) && s.step_rewards.is_none()));

    // Bad judge keys name the key and the fix.
    for (set, key) in [
        ("reward.judge_mode=\"vibes\"", "reward.judge_mode"),
        (
            "reward.judge_fallback_score=2.0",
            "reward.judge_fallback_score",
        ),
        (
            "reward.judge_template=\"no placeholder\"",
            "reward.judge_template",
        ),
    ] {
        let mut sets = judge_sets(dir.path(), "generate", &[]);
        sets.push(set.into());
        let mut all = sets.clone();
        all.push(format!(
            "job.output_dir={:?}",
            out.path().display().to_string()
        ));
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/demo-letters.toml");
        let e = JobConfig::load(path, &all).unwrap_err().to_string();
        assert!(e.contains(key) && e.contains("fix"), "{set}: {e}");
    }
}
