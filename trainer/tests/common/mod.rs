//! Helpers shared by the reward-model and judge tests.
#![allow(dead_code)] // each test binary uses its own subset

use std::path::{Path, PathBuf};

use yatt_roles::LETTERS;
use yatt_roles::{Sample, SampleId};
use yatt_runtime::Node;
use yatt_trainer::{train_with, JobConfig, JobError, TrainOptions, TrainSummary};

/// `config/demo-letters.toml` with `sets`, writing to `out`.
pub fn load_demo(out: &Path, sets: &[String]) -> Result<JobConfig, JobError> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../config/demo-letters.toml");
    let mut all = sets.to_vec();
    all.push(format!("job.output_dir={:?}", out.display().to_string()));
    JobConfig::load(path, &all)
}

/// [`load_demo`] for a config that must be valid.
pub fn demo_config(out: &Path, sets: &[String]) -> JobConfig {
    load_demo(out, sets).unwrap()
}

/// Runs `job` through [`train_with`] on a fresh in-process node, continuing the run in
/// its output directory when `resume`.
pub async fn train_job(job: &JobConfig, resume: bool) -> Result<TrainSummary, JobError> {
    let certs = tempfile::tempdir().unwrap();
    let node = Node::builder("train-0")
        .dev_certs(certs.path())
        .start()
        .await
        .unwrap();
    let options = TrainOptions {
        resume,
        ..Default::default()
    };
    let result = train_with(job, &node, options, |_| {}).await;
    node.shutdown().await;
    result
}

/// A sample with text only (what the reward role reads).
pub fn text_sample(k: u32, prompt: &str, response: &str) -> Sample {
    Sample {
        prompt_text: prompt.into(),
        response_text: response.into(),
        ..Sample::new(
            SampleId {
                step: 0,
                prompt: 7,
                k,
            },
            7,
        )
    }
}

/// The letters reward: the fraction of characters in [`LETTERS`].
pub fn letters_fraction(s: &str) -> f64 {
    let n = s.chars().count().max(1) as f64;
    s.chars().filter(|c| LETTERS.contains(*c)).count() as f64 / n
}

/// Deterministic SplitMix64 draws in `[0, 1)`.
pub struct Draws(pub u64);

impl Draws {
    pub fn next(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// (prompt, response) pairs like the demo's (prompts `q0:`..`q15:`, 1–6 characters)
/// with letter fractions spread over [0, 1].
pub fn letter_responses(n: usize, seed: u64) -> Vec<(String, String)> {
    let mut d = Draws(seed);
    let other: Vec<char> = (' '..='~').filter(|c| !LETTERS.contains(*c)).collect();
    let letters: Vec<char> = LETTERS.chars().collect();
    (0..n)
        .map(|i| {
            let p = d.next();
            let len = 1 + (d.next() * 6.0) as usize;
            let r = (0..len)
                .map(|_| {
                    if d.next() < p {
                        letters[(d.next() * letters.len() as f64) as usize]
                    } else {
                        other[(d.next() * other.len() as f64) as usize]
                    }
                })
                .collect();
            (format!("q{}:", i % 16), r)
        })
        .collect()
}

/// What must match between an interrupted run and an uninterrupted one: every metric
/// but the clocks.
pub fn deterministic_metrics(line: &str) -> Vec<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(line).unwrap();
    let mut out: Vec<(String, String)> = v
        .as_object()
        .unwrap()
        .iter()
        .filter(|(k, _)| {
            use yatt_metrics::names;
            // A head's own value (`head/1/timing_s/gen`) is timed as its mean is.
            let k = names::without_head(k);
            !k.starts_with(names::TIMING_PREFIX)
                && !k.starts_with("perf/")
                && k != names::OVERLAP_S
                && k != names::GEN_AHEAD_S
                && k != "time"
        })
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    out.sort();
    out
}

/// Every line of `metrics.jsonl` in the run directory `dir`.
pub fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// One metric over the steps of `ms`; every step must have it.
pub fn column(ms: &[serde_json::Value], name: &str) -> Vec<f64> {
    ms.iter()
        .map(|m| {
            m[name]
                .as_f64()
                .unwrap_or_else(|| panic!("{name} missing: {m}"))
        })
        .collect()
}
