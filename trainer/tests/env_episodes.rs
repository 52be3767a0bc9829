//! Multi-turn episodes work with every algorithm and every pipeline: the guess-number game
//! on the tiny model, embedded, 2 steps under each algorithm (PPO with its critic among
//! them), with streaming rollouts, and asynchronously (staleness 1). Every run completes,
//! every step's samples are episodes of up to three turns (more than two on average), and
//! the observation tokens stay out of the loss (the model's share of the response tokens
//! is below 1).

use crate::common;

use common::{demo_config, train_job};

const EPISODES: &str = "rollout.env={ kind = \"guess-number\", max_turns = 3, max_turn_tokens = 4, max_env_tokens = 40, timeout_s = 5 }";

/// Runs the demo job with episodes and `extra`; returns each step's metrics.
async fn episode_steps(extra: &[&str]) -> Vec<serde_json::Value> {
    let out = tempfile::tempdir().unwrap();
    let mut sets: Vec<String> = [
        "job.steps=2",
        "model.max_seq_len=320",
        "data.prompts_per_step=2",
        "data.samples_per_prompt=4",
        "rollout.max_new_tokens=160",
        EPISODES,
    ]
    .iter()
    .chain(extra)
    .map(|s| s.to_string())
    .collect();
    sets.push("optim.micro_batch=8".into());
    let job = demo_config(out.path(), &sets);
    let summary = train_job(&job, false)
        .await
        .unwrap_or_else(|e| panic!("{extra:?}: {e}"));
    assert_eq!(summary.steps, 2, "{extra:?}");
    std::fs::read_to_string(&summary.metrics_path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn check_episodes(steps: &[serde_json::Value], what: &str) {
    assert_eq!(steps.len(), 2, "{what}");
    for m in steps {
        let get = |k: &str| {
            m[k].as_f64()
                .unwrap_or_else(|| panic!("{what}: no {k} in {m}"))
        };
        // Three turns, unless the game ends an episode early (a right guess).
        let turns = get("env/turns_mean");
        assert!(
            turns > 2.0 && turns <= 3.0,
            "{what}: {turns} turns per episode"
        );
        let share = get("env/model_token_share");
        assert!(
            share > 0.0 && share < 1.0,
            "{what}: model token share {share}"
        );
        assert_eq!(get("env/episodes_failed"), 0.0, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_train_under_every_algorithm() {
    for algo in [
        "grpo",
        "dapo",
        "rloo",
        "reinforce++",
        "ppo",
        "dr-grpo",
        "gspo",
        "cispo",
    ] {
        let name = format!("algorithm.name={algo:?}");
        let steps = episode_steps(&[&name]).await;
        check_episodes(&steps, algo);
        if algo == "ppo" {
            // The critic trained on the episodes: its values saw only the model's tokens.
            assert!(
                steps.iter().any(|m| m["critic/vf_loss"].as_f64().is_some()),
                "ppo: no critic loss in {:?}",
                steps[0]
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn episodes_stream_and_run_asynchronously() {
    let streamed = episode_steps(&["rollout.stream=true"]).await;
    check_episodes(&streamed, "streamed");
    let stale = episode_steps(&["rollout.staleness=1", "algorithm.old_logprobs=\"rollout\""]).await;
    check_episodes(&stale, "staleness 1");
    // The second step trained samples generated on the first step's weights.
    assert!(
        stale
            .iter()
            .any(|m| m["async/staleness_max"].as_f64().unwrap_or(0.0) >= 1.0),
        "staleness 1: no stale sample trained: {stale:?}"
    );
}
