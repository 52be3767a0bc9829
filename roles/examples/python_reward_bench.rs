//! Calls/s of the Python numeric reward (`examples/python_reward/numeric_reward.py` on a
//! pool of worker processes) against the Rust `NumericVerifier`, on the same 1,000
//! samples, as the reward role calls them (one batch per step).
//!
//!     cargo run --release -p yatt-roles --example python_reward_bench -- [WORKERS] [PYTHON]
//!
//! WORKERS defaults to 2; PYTHON to the project's `.venv/bin/python`.

use std::time::{Duration, Instant};

use yatt_roles::{
    ModelScorer, NumericVerifier, PythonReward, PythonRewardConfig, RewardFn, RewardInput,
};

const N: usize = 1000;
const ROUNDS: usize = 5;

fn samples() -> Vec<RewardInput> {
    let shapes = [
        "Let me think. 12 + 30 = 42. The answer is {a}.",
        "so the total is \\boxed{{{a}}}",
        "step one, step two #### {a}",
        "I get {a} apples and 3 pears",
        "no idea",
    ];
    (0..N)
        .map(|i| {
            let a = (i * 37) % 1000;
            let response = shapes[i % shapes.len()].replace("{a}", &a.to_string());
            RewardInput {
                prompt: format!("q{i}"),
                response,
                reference: Some(((i * 37 + (i % 3)) % 1000).to_string()),
                metadata: serde_json::Value::Null,
            }
        })
        .collect()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let workers: usize = args.next().map(|w| w.parse()).transpose()?.unwrap_or(2);
    let python = args
        .next()
        .unwrap_or_else(|| concat!(env!("CARGO_MANIFEST_DIR"), "/../.venv/bin/python").to_string());
    let inputs = samples();
    let rust = NumericVerifier::default();
    let start = Instant::now();
    let mut want = Vec::new();
    for _ in 0..ROUNDS {
        want = inputs
            .iter()
            .map(|i| rust.score(i).map(|o| o.score))
            .collect::<Result<Vec<_>, _>>()?;
    }
    let rust_s = start.elapsed().as_secs_f64() / ROUNDS as f64;

    let function = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../examples/python_reward/numeric_reward.py:compute_score"
    );
    let mut py = PythonReward::new(PythonRewardConfig {
        python: python.into(),
        workers,
        timeout: Duration::from_secs(60),
        ..PythonRewardConfig::new(function)
    })?;
    py.score_batch(&inputs[..10])?; // warm-up: first calls compile the regexes
    let start = Instant::now();
    let mut got = Vec::new();
    for _ in 0..ROUNDS {
        got = py.score_batch(&inputs)?;
    }
    let py_s = start.elapsed().as_secs_f64() / ROUNDS as f64;
    let same = got.iter().zip(&want).all(|(g, w)| g.score == *w);
    println!(
        "{N} samples, mean of {ROUNDS} batches: rust NumericVerifier {:.0} calls/s ({:.2} ms/batch); \
         python numeric_reward.py, {workers} workers {:.0} calls/s ({:.2} ms/batch); ratio {:.1}x; same rewards: {same}",
        N as f64 / rust_s,
        rust_s * 1e3,
        N as f64 / py_s,
        py_s * 1e3,
        py_s / rust_s
    );
    Ok(())
}
