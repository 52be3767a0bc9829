//! A new RLHF role in a few dozen lines: a length-and-format reward, written by
//! implementing [`Role`] (`src/lib.rs`), registered by name in a node's factory
//! registry, spawned there over QUIC by the training process, and used by a training
//! job in place of the built-in reward. See README.md.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser;
use custom_role::{LengthFormatReward, ROLE_NAME};
use yatt::node::Roles;
use yatt_roles::{RoleRequest, RoleResponse, Sample};
use yatt_runtime::{Node, NodeBuilder};
use yatt_trainer::{train_with, CustomRoles, JobConfig, TrainOptions};

/// Registers [`LengthFormatReward`] in a node's factory registry under [`ROLE_NAME`],
/// as `src/bin/custom-yatt-node.rs` does for a daemon (`yatt::node::main_with`). A peer
/// spawns it with a `LengthFormatReward` value as the arguments; a bad combination is
/// refused by [`Role::start`] and the spawn fails with that message.
pub fn register(builder: NodeBuilder) -> anyhow::Result<NodeBuilder> {
    Ok(Roles::new()
        .role::<LengthFormatReward>(ROLE_NAME)
        .into_builder(builder)?)
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
///
/// Two nodes on loopback, as a cluster would have them: `custom-host` registers the role
/// (as a `yatt-node` built with [`register`] would), and the training process spawns it
/// there by name and sends it every step's samples over QUIC.
pub async fn run(job: &JobConfig) -> anyhow::Result<Vec<f64>> {
    let certs = tempfile::tempdir()?;
    let host = register(Node::builder("custom-host"))?
        .dev_certs(certs.path())
        .start()
        .await
        .context("starting the node that hosts the role")?;
    let trainer = Node::builder("custom-trainer")
        .dev_certs(certs.path())
        .seed(host.addr())
        .start()
        .await
        .context("starting the training node")?;
    let joined = trainer
        .directory()
        .wait_until(Duration::from_secs(10), |d| d.alive_nodes().count() == 2)
        .await;
    anyhow::ensure!(joined, "the two nodes did not see each other within 10 s");
    let reward = trainer
        .spawn_remote_linked::<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>, _>(
            host.name(),
            ROLE_NAME,
            &LengthFormatReward {
                min_len: 4,
                max_len: 6,
                alphabet: "aeiou".into(),
            },
            Duration::from_secs(10),
        )
        .await
        .with_context(|| format!("spawning {ROLE_NAME} on {}", host.name()))?;
    let options = TrainOptions {
        roles: CustomRoles {
            reward: Some(reward),
            ..Default::default()
        },
        ..Default::default()
    };
    let summary = train_with(job, &trainer, options, |p| {
        let r = p.metrics.get("critic/rewards/mean").unwrap_or(f64::NAN);
        println!("step {:>3}/{} reward {r:.3}", p.step, p.total);
    })
    .await?;
    trainer.shutdown().await;
    host.shutdown().await;
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

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bad_spawn_is_refused_with_the_reason() {
        let certs = tempfile::tempdir().unwrap();
        let host = register(Node::builder("bad-host"))
            .unwrap()
            .dev_certs(certs.path())
            .start()
            .await
            .unwrap();
        let caller = Node::builder("bad-caller")
            .dev_certs(certs.path())
            .seed(host.addr())
            .start()
            .await
            .unwrap();
        assert!(
            caller
                .directory()
                .wait_until(Duration::from_secs(10), |d| d.alive_nodes().count() == 2)
                .await
        );
        let err = caller
            .spawn_remote::<RoleRequest<Vec<Sample>>, RoleResponse<Vec<Sample>>, _>(
                host.name(),
                ROLE_NAME,
                &LengthFormatReward {
                    min_len: 6,
                    max_len: 4,
                    alphabet: "ab".into(),
                },
                Duration::from_secs(10),
            )
            .await
            .unwrap_err()
            .to_string();
        assert!(err.contains("min_len <= max_len"), "{err}");
        caller.shutdown().await;
        host.shutdown().await;
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
