//! A new RLHF role in a few dozen lines: a length-and-format reward, written by
//! implementing [`Role`], started as an actor on a node, and used by a training job
//! in place of the built-in reward. See README.md.

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use yatt::roles::controller::spawn_role;
use yatt::roles::job::{train_with, CustomRoles, JobConfig, TrainOptions};
use yatt::roles::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use yatt::roles::sample::Sample;
use yatt::runtime::Node;

/// Rewards responses that have the right shape: half the score for a length within
/// `min_len..=max_len` characters, half for the fraction of characters in `alphabet`.
pub struct LengthFormatReward {
    /// Shortest acceptable response, characters.
    pub min_len: usize,
    /// Longest acceptable response, characters.
    pub max_len: usize,
    /// Characters the format allows.
    pub alphabet: String,
}

impl LengthFormatReward {
    /// The score of one response, in `[0, 1]`.
    pub fn score(&self, response: &str) -> f64 {
        let n = response.chars().count();
        let length_ok = (self.min_len..=self.max_len).contains(&n);
        let in_format = response
            .chars()
            .filter(|c| self.alphabet.contains(*c))
            .count();
        0.5 * f64::from(u8::from(length_ok)) + 0.5 * in_format as f64 / n.max(1) as f64
    }
}

impl Role for LengthFormatReward {
    // A reward role takes the step's samples and gives them back with `reward` set:
    // that is the contract the controller expects of `reward`.
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "length-format-reward"
    }

    fn profile(&self) -> ResourceProfile {
        // Rule-based: no device memory, so placement can put it anywhere.
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        if self.min_len > self.max_len || self.alphabet.is_empty() {
            return Err(RoleError::BadRequest(format!(
                "length-format-reward: need min_len <= max_len and a non-empty alphabet (got {}..={}, {:?})",
                self.min_len, self.max_len, self.alphabet
            )));
        }
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        for s in &mut samples {
            s.reward = Some(self.score(&s.response_text));
        }
        Ok(samples)
    }
}

#[derive(Parser)]
struct Args {
    /// The job config; the reward section is ignored, this role replaces it.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../config/demo-letters.toml"))]
    config: PathBuf,
    /// Config overrides, e.g. `--set job.steps=10`.
    #[arg(long = "set")]
    sets: Vec<String>,
}

/// Trains the job with the custom reward; returns the mean reward of each step.
pub async fn run(job: &JobConfig) -> anyhow::Result<Vec<f64>> {
    let certs = tempfile::tempdir()?;
    let node = Node::builder("custom-0")
        .dev_certs(certs.path())
        .start()
        .await
        .context("starting the node")?;
    let role = LengthFormatReward {
        min_len: 4,
        max_len: 6,
        alphabet: "aeiou".into(),
    };
    let reward = spawn_role(&node, role, 0, DeviceGroup::cpu(node.name())).await?;
    let options = TrainOptions {
        roles: CustomRoles {
            reward: Some(reward),
        },
        ..Default::default()
    };
    let summary = train_with(job, &node, options, |p| {
        let r = p.metrics.get("critic/rewards/mean").unwrap_or(f64::NAN);
        println!("step {:>3}/{} reward {r:.3}", p.step, p.total);
    })
    .await?;
    node.shutdown().await;
    Ok(summary.rewards)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let mut sets = vec!["job.output_dir=\"runs/custom-role\"".to_string()];
    sets.extend(args.sets);
    let job = JobConfig::load(&args.config, &sets)?;
    let rewards = run(&job).await?;
    let k = rewards.len().min(5);
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    println!(
        "reward: first {k} steps {:.3}, last {k} steps {:.3}",
        mean(&rewards[..k]),
        mean(&rewards[rewards.len() - k..])
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_length_and_format() {
        let r = LengthFormatReward {
            min_len: 2,
            max_len: 3,
            alphabet: "ab".into(),
        };
        assert_eq!(r.score("ab"), 1.0);
        assert_eq!(r.score("abzz"), 0.25);
        assert_eq!(r.score("zz"), 0.5);
        assert_eq!(r.score(""), 0.0);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_learns_the_custom_reward() {
        let out = tempfile::tempdir().unwrap();
        let config = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../config/demo-letters.toml"
        );
        let sets = [format!(
            "job.output_dir={:?}",
            out.path().display().to_string()
        )];
        let job = JobConfig::load(config, &sets).unwrap();
        let rewards = run(&job).await.unwrap();
        let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len() as f64;
        let (first, last) = (mean(&rewards[..5]), mean(&rewards[rewards.len() - 5..]));
        assert!(last > first + 0.2, "reward {first:.3} → {last:.3}");
    }
}
