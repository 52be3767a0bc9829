//! CAPO-style step credit end to end, on a synthetic task where the wrong step is known:
//! the tiny model's rollouts mark where each step (a space-separated word) ends in
//! tokens, a real Python reward fails every word holding one of "klmnopqrstuvwxyz",
//! and the advantages the policy trains on are `penalty` lower on exactly the tokens of
//! those words, and unchanged elsewhere; centred, every judged token of a prompt group
//! gets the group's mean penalty per token back.

use crate::common;

use std::path::Path;

use common::demo_config;
use yatt_metrics::names;
use yatt_roles::{TextCodec, TINY_CODEC};
use yatt_runtime::Node;
use yatt_trainer::build_embedded;

const STEPS_PY: &str = "\
LETTERS = set('abcdefghij')
WRONG = set('klmnopqrstuvwxyz')

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    steps = [s for s in solution_str.split(' ') if s.strip()]
    n = max(len(solution_str), 1)
    return {'score': sum(c in LETTERS for c in solution_str) / n,
            'step_scores': [0.0 if WRONG & set(s) else 1.0 for s in steps]}
";

const PENALTY: f32 = 0.5;

fn sets(file: &Path) -> Vec<String> {
    vec![
        "reward.kind=\"python\"".to_string(),
        format!(
            "reward.function={:?}",
            format!("{}:compute_score", file.display())
        ),
        format!(
            "reward.python={:?}",
            concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python")
        ),
        "reward.python_workers=1".into(),
        "model.max_seq_len=64".into(),
        "rollout.max_new_tokens=40".into(),
        "algorithm.step_credit.delimiter=\" \"".into(),
        format!("algorithm.step_credit.penalty={PENALTY}"),
        "job.steps=2".into(),
    ]
}

async fn first_steps(file: &Path, centre: bool, steps: usize) -> Vec<yatt_trainer::StepReport> {
    let out = tempfile::tempdir().unwrap();
    let mut sets = sets(file);
    sets.push(format!("algorithm.step_credit.centre={centre}"));
    let job = demo_config(out.path(), &sets);
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("capo-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let mut controllers = build_embedded(&job, &node).await.unwrap();
    let mut reports = Vec::new();
    for _ in 0..steps {
        reports.push(controllers[0].step().await.unwrap());
    }
    drop(controllers);
    node.shutdown().await;
    reports
}

fn wrong(step: &str) -> bool {
    step.chars().any(|c| ('k'..='z').contains(&c))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_steps_lower_the_advantage_of_exactly_their_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("steps.py");
    std::fs::write(&file, STEPS_PY).unwrap();
    let codec = TINY_CODEC;
    let plain = first_steps(&file, false, 2).await;
    let (mut mixed, mut failed_tokens) = (0, 0);
    for rep in &plain {
        assert_eq!(rep.metrics.get(names::STEP_CREDIT_MISMATCHED), Some(0.0));
        assert_eq!(rep.metrics.get(names::STEP_CREDIT_UNJUDGED), Some(0.0));
        for s in &rep.samples {
            let ends = s.step_ends.as_ref().expect("the rollout marks the steps");
            let verdicts = s
                .step_rewards
                .as_ref()
                .expect("the reward judged the steps");
            let adv = s.advantages.as_ref().unwrap();
            // The rollout's token steps are the Python reward's words, in order.
            let words: Vec<&str> = s
                .response_text
                .split(' ')
                .filter(|w| !w.trim().is_empty())
                .collect();
            assert_eq!(ends.len(), words.len(), "{:?}", s.response_text);
            assert_eq!(verdicts.len(), words.len());
            let mut start = 0;
            let mut by_token = vec![false; adv.len()];
            for (k, &end) in ends.iter().enumerate() {
                let end = end as usize;
                let text = codec.decode(&s.response_tokens[start..end]).unwrap();
                assert_eq!(text.trim(), words[k], "{:?}", s.response_text);
                assert_eq!(verdicts[k] == 0.0, wrong(words[k]));
                by_token[start..end].fill(wrong(words[k]));
                start = end;
            }
            assert_eq!(start, adv.len());
            // The outcome advantage is the same on every token (GRPO); a failed step's
            // tokens carry it minus the penalty.
            if let Some(t) = by_token.iter().position(|&w| !w) {
                let outcome = adv[t];
                for (t, &w) in by_token.iter().enumerate() {
                    let want = if w { outcome - PENALTY } else { outcome };
                    assert!((adv[t] - want).abs() < 1e-5, "token {t}: {adv:?}");
                }
                if by_token.iter().any(|&w| w) {
                    mixed += 1;
                    failed_tokens += by_token.iter().filter(|&&w| w).count();
                }
            }
        }
    }
    assert!(
        mixed >= 5 && failed_tokens >= 20,
        "too few responses with a failed and a passed step to show anything: {mixed} ({failed_tokens} tokens)"
    );
    // Centred, the same first step (same weights, same samples): every token of a
    // group gets back the group's penalty per token.
    let centred = first_steps(&file, true, 1).await;
    let (a, b) = (&plain[0].samples, &centred[0].samples);
    assert_eq!(a.len(), b.len());
    let mut back_seen = 0;
    for (x, y) in a.iter().zip(b) {
        assert_eq!((x.id, &x.response_tokens), (y.id, &y.response_tokens));
        let group: Vec<_> = a.iter().filter(|s| s.group == x.group).collect();
        let tokens: usize = group.iter().map(|s| s.response_tokens.len()).sum();
        let penalised: usize = group
            .iter()
            .map(|s| {
                let mut start = 0;
                let ends = s.step_ends.as_ref().unwrap();
                let v = s.step_rewards.as_ref().unwrap();
                ends.iter()
                    .zip(v)
                    .map(|(&e, &v)| {
                        let n = e as usize - start;
                        start = e as usize;
                        if v < 0.5 {
                            n
                        } else {
                            0
                        }
                    })
                    .sum::<usize>()
            })
            .sum();
        let back = PENALTY * penalised as f32 / tokens as f32;
        if back > 0.0 {
            back_seen += 1;
        }
        for (p, c) in x
            .advantages
            .as_ref()
            .unwrap()
            .iter()
            .zip(y.advantages.as_ref().unwrap())
        {
            assert!(
                (c - p - back).abs() < 1e-5,
                "{} {p} -> {c}, back {back}",
                x.id
            );
        }
    }
    assert!(back_seen > 0);
}

#[test]
fn bad_step_credit_settings_are_refused_by_key() {
    let out = tempfile::tempdir().unwrap();
    for (set, key) in [
        (
            "algorithm.step_credit.penalty=0",
            "algorithm.step_credit.penalty",
        ),
        (
            "algorithm.step_credit.threshold=2",
            "algorithm.step_credit.threshold",
        ),
        (
            "algorithm.step_credit.delimiter=\"\"",
            "algorithm.step_credit.delimiter",
        ),
    ] {
        let e = common::load_demo(out.path(), &[set.to_string()])
            .unwrap_err()
            .to_string();
        assert!(e.contains(key), "{set}: {e}");
    }
}
