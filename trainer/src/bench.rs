//! `yatt bench controller`: per-step controller overhead of parallel controllers
//! against a single driver, as the number of rollout replicas grows.
//!
//! Benchmark only: the roles here fake their compute (a fixed sleep standing for the
//! device's work, and made-up tokens), so what is measured is everything else: the
//! controllers' bookkeeping, the ledger, advantages, sample routing and the actor
//! messaging. Nothing outside this module uses them.
//!
//! - **parallel**: `k` controllers, each with its own prompt shard and rollout replica,
//!   meeting only at the policy update ([`step_data_parallel`]);
//! - **single driver**: one controller holding the global batch (`k` × the prompts)
//!   and spreading generation over the same `k` replicas.
//!
//! Overhead per step = wall time − the fake compute on the critical path (one
//! generation round, since replicas run side by side, plus the policy's update).

use std::sync::Arc;
use std::time::{Duration, Instant};

use yatt_engine::SamplingParams;
use yatt_roles::{
    Dataloader, DeviceGroup, GradShard, PolicyRequest, PolicyResponse, Prompt, ResourceProfile,
    RewardError, RewardFn, RewardInput, RewardOutput, RewardRole, Role, RoleError, RolloutRequest,
    RolloutResponse, RolloutStats, Sample, SampleId, TrainReport, WeightsUpdate,
};
use yatt_runtime::Node;

use crate::controller::config::ControllerConfig;
use crate::controller::core::Controller;
use crate::controller::data_parallel::step_data_parallel;
use crate::controller::error::ControllerError;
use crate::controller::refs::{spawn_role, RoleRefs};

/// What to measure.
#[derive(Debug, Clone)]
pub struct ControllerBenchOptions {
    /// Replica counts to measure.
    pub replicas: Vec<usize>,
    /// Prompts per replica and step.
    pub prompts_per_replica: usize,
    /// Samples per prompt.
    pub n: u32,
    /// Response tokens per sample.
    pub response_len: usize,
    /// Fake generation time per request.
    pub gen_time: Duration,
    /// Fake update time per optimizer step.
    pub train_time: Duration,
    /// Measured steps per case (after one warm-up step).
    pub steps: usize,
}

impl Default for ControllerBenchOptions {
    fn default() -> Self {
        ControllerBenchOptions {
            replicas: vec![1, 2, 4, 8, 16, 32],
            prompts_per_replica: 8,
            n: 8,
            response_len: 64,
            gen_time: Duration::from_millis(20),
            train_time: Duration::from_millis(20),
            steps: 5,
        }
    }
}

/// One measured case.
#[derive(Debug, Clone)]
pub struct ControllerBenchRow {
    /// Rollout replicas.
    pub replicas: usize,
    /// Samples per step (the global batch).
    pub samples: usize,
    /// Median overhead per step, parallel controllers.
    pub parallel_overhead: Duration,
    /// Median overhead per step, single driver.
    pub single_overhead: Duration,
}

/// Fake rollout: made-up tokens after a fixed sleep.
struct FakeRollout {
    response_len: usize,
    gen_time: Duration,
    version: u64,
}

impl Role for FakeRollout {
    type Request = RolloutRequest;
    type Response = RolloutResponse;
    fn name(&self) -> &str {
        "rollout"
    }
    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }
    fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }
    fn serve(&mut self, r: RolloutRequest) -> Result<RolloutResponse, RoleError> {
        let RolloutRequest::Generate(g) = r else {
            return Err(RoleError::BadRequest("fake rollout only generates".into()));
        };
        let t = Instant::now();
        std::thread::sleep(self.gen_time);
        let mut samples = Vec::with_capacity(g.prompts.len() * g.n as usize);
        for p in &g.prompts {
            for k in 0..g.n {
                let id = SampleId {
                    step: g.step,
                    prompt: p.id,
                    k,
                };
                samples.push(Sample {
                    prompt_tokens: vec![1; 16],
                    response_tokens: (0..self.response_len as i64).collect(),
                    rollout_logprobs: vec![-1.0; self.response_len],
                    prompt_text: p.text.clone(),
                    response_text: format!("{}", (p.id * 31 + k as u64) % 7),
                    reference: p.reference.clone(),
                    weights_version: self.version,
                    ..Sample::new(id, p.id)
                });
            }
        }
        let stats = RolloutStats {
            seconds: t.elapsed().as_secs_f64(),
            response_tokens: samples.len() * self.response_len,
            weights_version: self.version,
            ..Default::default()
        };
        Ok(RolloutResponse::Generated { samples, stats })
    }
    fn load_weights(&mut self, u: WeightsUpdate) -> Result<(), RoleError> {
        self.version = u.version;
        Ok(())
    }
}

/// Fake policy: zero log-probs, a sleep per optimizer step.
struct FakePolicy {
    train_time: Duration,
    version: u64,
}

impl FakePolicy {
    fn report(&self, trained: Vec<SampleId>) -> TrainReport {
        TrainReport {
            trained,
            optimizer_steps: 1,
            version: self.version,
            ..Default::default()
        }
    }
}

impl Role for FakePolicy {
    type Request = PolicyRequest;
    type Response = PolicyResponse;
    fn name(&self) -> &str {
        "policy"
    }
    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }
    fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }
    fn serve(&mut self, r: PolicyRequest) -> Result<PolicyResponse, RoleError> {
        Ok(match r {
            PolicyRequest::OldLogProbs(mut samples) => {
                for s in &mut samples {
                    s.old_logprobs = Some(s.rollout_logprobs.clone());
                }
                PolicyResponse::Scored(samples)
            }
            PolicyRequest::Train(samples) => {
                std::thread::sleep(self.train_time);
                self.version += 1;
                PolicyResponse::Trained(self.report(samples.iter().map(|s| s.id).collect()))
            }
            PolicyRequest::Gradients(samples) => PolicyResponse::Gradients(GradShard {
                buckets: Vec::new(),
                report: self.report(samples.iter().map(|s| s.id).collect()),
            }),
            PolicyRequest::ApplyGradients(shards) => {
                std::thread::sleep(self.train_time);
                self.version += 1;
                let ids = shards.into_iter().flat_map(|s| s.report.trained).collect();
                PolicyResponse::Trained(self.report(ids))
            }
            PolicyRequest::ExportWeights | PolicyRequest::ExportLocalWeights => {
                PolicyResponse::Weights(WeightsUpdate::from_buckets(self.version, Vec::new()))
            }
            PolicyRequest::StageBroadcast { .. } => PolicyResponse::NcclUnavailable(
                "a runtime bench's stand-in policy has no device".into(),
            ),
            PolicyRequest::ExportDeviceWeights => PolicyResponse::DeviceWeightsUnavailable(
                "a runtime bench's stand-in policy has no device".into(),
            ),
            PolicyRequest::PushWeights { .. } => PolicyResponse::PushUnavailable(
                "a runtime bench's stand-in policy sends no weights itself".into(),
            ),
            PolicyRequest::SaveCheckpoint(_) => PolicyResponse::Saved,
            PolicyRequest::RingInbox
            | PolicyRequest::JoinRing(_)
            | PolicyRequest::JoinShardRings(_)
            | PolicyRequest::TrainAllReduce(_)
            | PolicyRequest::ExportState
            | PolicyRequest::ImportState(_)
            | PolicyRequest::GradientGroup { .. }
            | PolicyRequest::JoinGradientGroup(_)
            | PolicyRequest::Reshard { .. } => {
                return Err(RoleError::Unsupported {
                    role: "policy".into(),
                    operation: "policy replicas",
                })
            }
            PolicyRequest::Broadcast(_) => {
                return Err(RoleError::Unsupported {
                    role: "policy".into(),
                    operation: "NCCL weight broadcast",
                })
            }
        })
    }
}

/// A reward that varies within a group, so advantages are not all zero.
struct DigitReward;

impl RewardFn for DigitReward {
    fn name(&self) -> &str {
        "digit"
    }
    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let d = s.response.parse::<f64>().unwrap_or(0.0);
        Ok(RewardOutput {
            score: d / 7.0,
            ..Default::default()
        })
    }
}

pub(crate) fn prompts(count: usize) -> Arc<[Prompt]> {
    (0..count as u64)
        .map(|id| Prompt {
            id,
            text: format!("p{id}"),
            messages: Vec::new(),
            reference: None,
            metadata: serde_json::Value::Null,
        })
        .collect()
}

pub(crate) async fn spawn_rollouts(
    node: &Node,
    o: &ControllerBenchOptions,
    k: usize,
    first_replica: u32,
) -> Result<Vec<crate::controller::refs::RolloutRef>, ControllerError> {
    let mut out = Vec::with_capacity(k);
    for i in 0..k {
        let role = FakeRollout {
            response_len: o.response_len,
            gen_time: o.gen_time,
            version: 0,
        };
        out.push(
            spawn_role(
                node,
                role,
                first_replica + i as u32,
                DeviceGroup::cpu(node.name()),
            )
            .await?,
        );
    }
    Ok(out)
}

pub(crate) fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs[xs.len() / 2]
}

/// Runs every case on `node` and returns a row per replica count.
pub async fn run_controller_bench(
    node: &Node,
    o: &ControllerBenchOptions,
) -> Result<Vec<ControllerBenchRow>, ControllerError> {
    let mut rows = Vec::new();
    let critical = o.gen_time + o.train_time;
    let overhead = |d: Duration| d.saturating_sub(critical);
    let mut next_replica = 0u32;
    for &k in &o.replicas {
        let g = || DeviceGroup::cpu(node.name());
        let reward = spawn_role(
            node,
            RewardRole::new(vec![(1.0, Box::new(DigitReward))]).map_err(|e| {
                ControllerError::Spawn {
                    role: "reward".into(),
                    reason: e.to_string(),
                }
            })?,
            next_replica,
            g(),
        )
        .await?;
        let policy = spawn_role(
            node,
            FakePolicy {
                train_time: o.train_time,
                version: 0,
            },
            next_replica,
            g(),
        )
        .await?;
        let rollouts = spawn_rollouts(node, o, k, next_replica).await?;
        next_replica += k as u32 + 1;
        let config = ControllerConfig {
            prompts_per_step: o.prompts_per_replica,
            n: o.n,
            sampling: SamplingParams::default(),
            ..Default::default()
        };
        let data = prompts(o.prompts_per_replica * k * 2);
        let base = RoleRefs {
            rollout: rollouts[0].clone(),
            extra_rollouts: Vec::new(),
            reward,
            reference: None,
            policy,
            critic: None,
        };

        // Parallel controllers: one per replica, each with its own shard.
        let mut heads = Vec::with_capacity(k);
        for (i, r) in rollouts.iter().enumerate() {
            let loader =
                Dataloader::new(data.clone(), i, k, 1).map_err(ControllerError::Restore)?;
            let roles = RoleRefs {
                rollout: r.clone(),
                ..base.clone()
            };
            heads.push(Controller::new(config.clone(), loader, roles)?);
        }
        let mut parallel = Vec::with_capacity(o.steps);
        for i in 0..=o.steps {
            let t = Instant::now();
            step_data_parallel(&mut heads).await?;
            if i > 0 {
                parallel.push(overhead(t.elapsed()));
            }
        }
        drop(heads);

        // Single driver: the global batch in one controller, over the same replicas.
        let loader = Dataloader::new(data.clone(), 0, 1, 1).map_err(ControllerError::Restore)?;
        let roles = RoleRefs {
            extra_rollouts: rollouts[1..].to_vec(),
            ..base.clone()
        };
        let mut driver = Controller::new(
            ControllerConfig {
                prompts_per_step: o.prompts_per_replica * k,
                ..config.clone()
            },
            loader,
            roles,
        )?;
        // The heads above already moved the replicas' weights on.
        driver.sync_weights().await?;
        let mut single = Vec::with_capacity(o.steps);
        for i in 0..=o.steps {
            let t = Instant::now();
            driver.step().await?;
            if i > 0 {
                single.push(overhead(t.elapsed()));
            }
        }
        rows.push(ControllerBenchRow {
            replicas: k,
            samples: o.prompts_per_replica * k * o.n as usize,
            parallel_overhead: median(parallel),
            single_overhead: median(single),
        });
    }
    Ok(rows)
}

/// The rows as a markdown table.
pub fn markdown_table(rows: &[ControllerBenchRow]) -> String {
    let mut s = String::from(
        "| replicas | samples/step | parallel controllers, overhead/step | single driver, overhead/step | single ÷ parallel |\n|---:|---:|---:|---:|---:|\n",
    );
    for r in rows {
        let (p, d) = (
            r.parallel_overhead.as_secs_f64() * 1e3,
            r.single_overhead.as_secs_f64() * 1e3,
        );
        s.push_str(&format!(
            "| {} | {} | {p:.2} ms | {d:.2} ms | {:.2}× |\n",
            r.replicas,
            r.samples,
            d / p.max(1e-9)
        ));
    }
    s
}
