//! The policy role: the trainer.
//!
//! It owns a [`Trainer`] (model + AdamW state) and serves:
//! - [`PolicyRequest::OldLogProbs`]: each sample's `old_logprobs` under the current
//!   weights (before the update), without gradients (copied from the rollout's
//!   log-probs when [`PolicyConfig::on_policy`]);
//! - [`PolicyRequest::Train`]: one PPO-style update on samples with `old_logprobs` and
//!   `advantages` (and `ref_logprobs` when a KL loss is configured): the batch is split
//!   into `mini_batches` optimizer steps, each over micro-batches of
//!   `micro_batch_size` with gradient accumulation. The loss is
//!   [`policy_loss`] (PPO, GSPO or CISPO; clip range and aggregation from the config), plus
//!   [`kl_loss`] against the reference (k1/k2/k3) and minus an entropy bonus;
//! - [`PolicyRequest::ExportWeights`]: the weights as buckets for weight sync;
//!   [`PolicyRequest::ExportLocalWeights`]: a snapshot of the tensors, for roles in
//!   this process; [`PolicyRequest::ExportDeviceWeights`]: one packed device buffer by
//!   CUDA IPC handle; [`PolicyRequest::StageBroadcast`] then
//!   [`PolicyRequest::Broadcast`]: the same buffer by NCCL broadcast;
//! - [`PolicyRequest::SaveCheckpoint`]: an exact-resume checkpoint;
//! - [`PolicyRequest::ExportState`] / [`PolicyRequest::ImportState`]: the whole trainer
//!   state (weights, optimizer, step) as bytes, so a new replica in another process
//!   continues from a surviving one (the live placement's hand-off);
//! - data parallelism over one shared policy: [`PolicyRequest::Gradients`] per head,
//!   then [`PolicyRequest::ApplyGradients`] with every head's shard;
//! - data parallelism over replicas: [`PolicyRequest::TrainAllReduce`], where each
//!   replica computes its head's gradients and averages them with its peers' in a ring
//!   all-reduce ([`yatt_runtime::RingMember`]) straight between the replicas, before
//!   one optimizer step. The ring is set up with [`PolicyRequest::RingInbox`] and
//!   [`PolicyRequest::JoinRing`]; with NCCL ([`PolicyRequest::GradientGroup`],
//!   [`PolicyRequest::JoinGradientGroup`]) one all-reduce on the GPU averages them
//!   instead, and the ring is the fallback.
//!
//! With micro-batching each micro-batch's loss is aggregated on its own and weighted by
//! its share of the step's normaliser (tokens for `token-mean`, sequences for the
//! sequence means), so a step's gradient does not depend on how it is split.

use std::path::PathBuf;
use std::time::Instant;

use tch::Tensor;
use yatt_engine::{to_buckets, EngineError, Trainer};
use yatt_runtime::RingMember;

use crate::builtin::device_weights::Staging;
use crate::builtin::scoring::check_device;
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, WeightsUpdate};
use crate::sample::Sample;

mod config;
mod export;
mod grad_group;
mod hsdp;
pub(crate) mod micro;
mod protocol;
mod rank;
pub(crate) mod ranks;
mod reference_sharded;
mod report;
mod sharded;
#[cfg(test)]
mod sharded_tests;
mod slice_push;
#[cfg(test)]
mod split_tests;
mod state;

pub use config::{KlLossConfig, LoraSync, PolicyConfig};
pub use protocol::{GradShard, PolicyRequest, PolicyResponse, PushReport, PushTarget};
pub use rank::{PolicyRankRole, RankRequest, RankResponse, RankSource, RankStep};
pub use ranks::{RankRef, RemoteRanks};
pub use reference_sharded::ShardedReferenceRole;
pub use report::{ShardReport, TrainReport};
pub use sharded::{ShardedPolicyRole, ShardedStart};
pub(crate) use slice_push::load_all;
pub use slice_push::SlicePusher;
pub use state::TrainerState;

use micro::{begin_update, micro_backward, step_micros, with_old_logprobs, Micro, MicroStats};

/// The trainer role.
pub struct PolicyRole {
    trainer: Trainer,
    config: PolicyConfig,
    /// This replica's place in the gradient all-reduce (replicated policies only).
    ring: Option<RingMember>,
    /// With NCCL: the replicas' gradient group (tried before the ring).
    grad_group: Option<(
        crate::role::NcclGroup,
        crate::builtin::nccl_member::GroupMember,
    )>,
    /// Checkpoints go only under this directory (a node's data directory).
    write_root: Option<PathBuf>,
    /// The weights packed for CUDA IPC or NCCL weight sync.
    staging: Staging,
    /// Rank 0 of each NCCL weight-sync group it made (one per controller that syncs).
    groups: std::collections::HashMap<
        yatt_collective::UniqueId,
        crate::builtin::nccl_member::GroupMember,
    >,
}

fn grad_fail(e: EngineError) -> RoleError {
    RoleError::Failed(format!("policy gradients: {e}"))
}

impl PolicyRole {
    /// A policy over `trainer`. Fails on an unusable config.
    pub fn new(trainer: Trainer, config: PolicyConfig) -> Result<Self, RoleError> {
        config.check()?;
        Ok(PolicyRole {
            trainer,
            config,
            ring: None,
            grad_group: None,
            write_root: None,
            staging: Staging::default(),
            groups: Default::default(),
        })
    }

    /// The same role as one replica of a data-parallel policy, averaging its gradients
    /// with its peers through `ring` (see [`PolicyRequest::TrainAllReduce`]).
    pub fn with_ring(mut self, ring: RingMember) -> Self {
        self.ring = Some(ring);
        self
    }

    /// Saves checkpoints only under `root`: a node passes its data directory, so a
    /// peer cannot make it write elsewhere.
    pub fn with_write_root(mut self, root: PathBuf) -> Self {
        self.write_root = Some(root);
        self
    }

    fn train(&mut self, samples: Vec<Sample>) -> Result<TrainReport, RoleError> {
        let t0 = Instant::now();
        let cfg = self.config.clone();
        let (per_mini, mut report) = begin_update(&cfg, &samples)?;
        let (mut grad_norm, mut loss) = (0.0, 0.0);
        let mut stats = MicroStats::default();
        for mini_start in (0..samples.len()).step_by(per_mini) {
            let mini_end = (mini_start + per_mini).min(samples.len());
            let micros = self.micros(&samples, mini_start..mini_end)?;
            let step = self.trainer.step_manual(&micros, |model, mb| {
                micro_backward(model, &samples, mb, &cfg, &mut stats)
            });
            let step = step.map_err(|e| RoleError::Failed(format!("policy update: {e}")))?;
            grad_norm += step.grad_norm;
            loss += step.loss;
            report.lr = step.lr;
            report.optimizer_steps += 1;
        }
        let steps = report.optimizer_steps.max(1) as f64;
        report.grad_norm = grad_norm / steps;
        report.loss = loss / steps;
        stats.report_into(&mut report);
        report.version = self.trainer.step_count();
        super::fault::after_update(report.version);
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    fn micros(
        &self,
        samples: &[Sample],
        range: std::ops::Range<usize>,
    ) -> Result<Vec<Micro>, RoleError> {
        let groups = micro::groups(&self.config, samples, range);
        step_micros(&self.config, self.trainer.model.device(), samples, groups)
    }

    /// Accumulates the gradients of the loss on `samples` (one optimizer step's worth)
    /// without updating; returns the loss statistics (no optimizer fields yet).
    fn backward(&mut self, samples: &[Sample]) -> Result<TrainReport, RoleError> {
        let t0 = Instant::now();
        if samples.is_empty() {
            return Err(RoleError::BadRequest(
                "gradients need at least one sample".into(),
            ));
        }
        let cfg = self.config.clone();
        let micros = self.micros(samples, 0..samples.len())?;
        let mut stats = MicroStats::default();
        let mut loss = 0.0;
        for mb in &micros {
            // A micro-batch with no gradient adds a zero loss.
            loss += micro_backward(&self.trainer.model, samples, mb, &cfg, &mut stats)
                .map_err(grad_fail)?
                .unwrap_or(0.0);
        }
        let mut report = TrainReport {
            trained: samples.iter().map(|s| s.id).collect(),
            loss,
            version: self.trainer.step_count(),
            seconds: t0.elapsed().as_secs_f64(),
            ..Default::default()
        };
        stats.report_into(&mut report);
        Ok(report)
    }

    fn gradients(&mut self, samples: Vec<Sample>) -> Result<GradShard, RoleError> {
        let t0 = Instant::now();
        let mut report = self.backward(&samples)?;
        let buckets = self
            .trainer
            .grad_buckets(self.config.bucket_bytes)
            .map_err(grad_fail)?;
        // The next shard's gradients must not accumulate onto these.
        self.zero_grads();
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(GradShard { buckets, report })
    }

    fn zero_grads(&mut self) {
        tch::no_grad(|| {
            for (_, p) in self.trainer.model.parameters_mut() {
                let mut g = p.grad();
                if g.defined() {
                    let _ = g.zero_();
                }
            }
        });
    }

    /// This replica's gradients, averaged with its peers' in the ring, then one
    /// optimizer step: every replica applies the same bits and stays identical.
    fn train_all_reduce(&mut self, samples: Vec<Sample>) -> Result<TrainReport, RoleError> {
        let t0 = Instant::now();
        let Some(ring) = self.ring.as_mut() else {
            return Err(RoleError::BadRequest(
                "this policy is not a replica of a data-parallel policy (it has no ring); use Train, or Gradients and ApplyGradients".into(),
            ));
        };
        if ring.spec().is_none() {
            return Err(RoleError::NotReady(
                "this policy replica has not joined its ring yet (JoinRing)".into(),
            ));
        }
        let reduced = self
            .backward(&samples)
            .and_then(|report| Ok((report, self.average_gradients()?)));
        let (mut report, (mean, through_nccl)) = match reduced {
            Ok(r) => r,
            Err(e) => {
                // A retried step must not accumulate onto this one's gradients.
                self.zero_grads();
                return Err(e);
            }
        };
        let fail = |e: EngineError| RoleError::Failed(format!("averaging gradients: {e}"));
        self.trainer.set_flat_grads_from(&mean).map_err(fail)?;
        let step = self.trainer.apply_gradients().map_err(fail)?;
        report.nccl_all_reduce = through_nccl;
        super::fault::after_update(self.trainer.step_count());
        report.optimizer_steps = 1;
        report.version = self.trainer.step_count();
        report.grad_norm = step.grad_norm;
        report.lr = step.lr;
        report.seconds = t0.elapsed().as_secs_f64();
        Ok(report)
    }

    fn apply(&mut self, shards: Vec<GradShard>) -> Result<TrainReport, RoleError> {
        let t0 = Instant::now();
        let n = shards.len();
        if n == 0 {
            return Err(RoleError::BadRequest(
                "apply_gradients needs at least one shard".into(),
            ));
        }
        let fail = |e: EngineError| RoleError::Failed(format!("averaging gradients: {e}"));
        let mut sum: Vec<(String, Tensor)> = Vec::new();
        let mut index = std::collections::HashMap::new();
        for shard in &shards {
            for b in &shard.buckets {
                for (name, t) in b.tensors(tch::Device::Cpu).map_err(fail)? {
                    match index.get(&name) {
                        Some(&i) => {
                            let (_, acc): &mut (String, Tensor) = &mut sum[i];
                            *acc = &*acc + t;
                        }
                        None => {
                            index.insert(name.clone(), sum.len());
                            sum.push((name, t));
                        }
                    }
                }
            }
        }
        let avg: Vec<(String, Tensor)> =
            sum.into_iter().map(|(n_, t)| (n_, t / n as f64)).collect();
        let buckets = to_buckets(&avg, self.config.bucket_bytes).map_err(fail)?;
        self.trainer.set_grads(&buckets).map_err(fail)?;
        let step = self.trainer.apply_gradients().map_err(fail)?;
        let reports: Vec<&TrainReport> = shards.iter().map(|s| &s.report).collect();
        Ok(TrainReport {
            optimizer_steps: 1,
            version: self.trainer.step_count(),
            grad_norm: step.grad_norm,
            lr: step.lr,
            seconds: t0.elapsed().as_secs_f64() + reports.iter().map(|r| r.seconds).sum::<f64>(),
            ..TrainReport::merge_heads(&reports)
        })
    }
}

fn no_ring() -> RoleError {
    RoleError::BadRequest(
        "this policy was started without a ring member: only replicas of a data-parallel policy (job.policy_replicas > 1) have one".into(),
    )
}

impl Role for PolicyRole {
    type Request = PolicyRequest;
    type Response = PolicyResponse;

    fn name(&self) -> &str {
        "policy"
    }

    fn profile(&self) -> ResourceProfile {
        // Offloaded, its parameters are empty placeholders (which `model_bytes`, splitting
        // the fused matrices, cannot read): it holds nothing on the device.
        let w = match self.trainer.is_offloaded() {
            true => 0,
            false => crate::builtin::scoring::model_bytes(&self.trainer.model),
        };
        // Weights + gradients + two f32 Adam moments (+ f32 master weights when the
        // model is not f32, ignored here).
        ResourceProfile {
            resident_bytes: w * 4,
            peak_extra_bytes: w,
            offloadable: true,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("policy", self.trainer.model.device(), group)
    }

    fn serve(&mut self, request: PolicyRequest) -> Result<PolicyResponse, RoleError> {
        if self.trainer.is_offloaded() {
            return Err(RoleError::NotReady(
                "policy is offloaded; reload it first".into(),
            ));
        }
        match request {
            PolicyRequest::OldLogProbs(samples) => {
                with_old_logprobs(&self.trainer.model, &self.config, samples)
                    .map(PolicyResponse::Scored)
            }
            PolicyRequest::Train(samples) => self.train(samples).map(PolicyResponse::Trained),
            PolicyRequest::Gradients(samples) => {
                self.gradients(samples).map(PolicyResponse::Gradients)
            }
            PolicyRequest::ApplyGradients(shards) => {
                self.apply(shards).map(PolicyResponse::Trained)
            }
            PolicyRequest::ExportWeights => self.export().map(PolicyResponse::Weights),
            // `sync = adapters` sends adapters wherever the rollouts are.
            PolicyRequest::ExportLocalWeights
                if self.trainer.model.lora().is_some()
                    && self.config.lora_sync == LoraSync::Adapters =>
            {
                self.export().map(PolicyResponse::Weights)
            }
            PolicyRequest::ExportLocalWeights => Ok(PolicyResponse::Weights(self.export_local())),
            PolicyRequest::ExportDeviceWeights => Ok(self.export_device()),
            PolicyRequest::StageBroadcast { group, fresh } => {
                Ok(self.stage_broadcast(group, fresh))
            }
            PolicyRequest::Broadcast(group) => self.send_broadcast(group),
            PolicyRequest::TrainAllReduce(samples) => {
                self.train_all_reduce(samples).map(PolicyResponse::Trained)
            }
            PolicyRequest::RingInbox => match &self.ring {
                Some(r) => Ok(PolicyResponse::RingInbox(r.inbox_id().clone())),
                None => Err(no_ring()),
            },
            PolicyRequest::JoinRing(spec) => {
                let ring = self.ring.as_mut().ok_or_else(no_ring)?;
                ring.join(spec)
                    .map_err(|e| RoleError::BadRequest(format!("joining the ring: {e}")))?;
                Ok(PolicyResponse::Joined)
            }
            PolicyRequest::JoinShardRings(_) => Err(RoleError::BadRequest(
                "a replica of the whole policy joins one ring (JoinRing); JoinShardRings is for a sharded one".into(),
            )),
            PolicyRequest::GradientGroup { make_id } => Ok(self.gradient_group(make_id)),
            PolicyRequest::JoinGradientGroup(group) => self.join_gradient_group(group),
            PolicyRequest::ExportState => self.export_state().map(PolicyResponse::State),
            PolicyRequest::ImportState(state) => {
                self.import_state(state).map(|_| PolicyResponse::Imported)
            }
            PolicyRequest::Reshard { .. } => Err(RoleError::BadRequest(
                "the whole policy (job.policy_shards = 1) has no ranks to reshard".into(),
            )),
            PolicyRequest::PushWeights { .. } => Ok(PolicyResponse::PushUnavailable(
                "the policy role was asked directly, not through the actor that pushes weights on a node".into(),
            )),
            PolicyRequest::SaveCheckpoint(dir) => {
                super::fault::in_policy_save();
                super::write_root::check_under(
                    self.write_root.as_deref(),
                    &dir,
                    "the policy's checkpoint",
                )?;
                let tokenizer = self.config.tokenizer_dir.as_deref();
                self.trainer.save_checkpoint(&dir, tokenizer).map_err(|e| {
                    RoleError::Failed(format!("saving a checkpoint to {}: {e}", dir.display()))
                })?;
                Ok(PolicyResponse::Saved)
            }
        }
    }

    /// Takes a peer replica's weights at the same version (so every replica of a
    /// data-parallel policy starts from the same weights, whichever node built it).
    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        let at = self.trainer.step_count();
        if update.version != at {
            return Err(RoleError::BadRequest(format!(
                "the policy is at version {at} and takes weights of that version only (got {}): its optimizer state belongs to its own weights",
                update.version
            )));
        }
        crate::builtin::scoring::load_buckets(&mut self.trainer.model, &update)
    }

    fn offload(&mut self) -> Result<(), RoleError> {
        self.trainer
            .offload()
            .map_err(|e| RoleError::Failed(format!("offloading the policy: {e}")))
    }

    fn reload(&mut self) -> Result<(), RoleError> {
        self.trainer
            .reload()
            .map_err(|e| RoleError::Failed(format!("reloading the policy: {e}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::algo::loss::LossAgg;
    use crate::builtin::scoring::score_samples;
    use crate::sample::tests::sample;
    use tch::{Device, Kind};
    use yatt_engine::tiny_config;
    use yatt_engine::{Llama, TrainConfig};

    fn policy(model: Llama, on_policy: bool) -> PolicyRole {
        let train = TrainConfig {
            lr: 1e-2,
            ..Default::default()
        };
        let config = PolicyConfig {
            micro_batch_size: 3,
            on_policy,
            ..Default::default()
        };
        PolicyRole::new(Trainer::new(model, train), config).unwrap()
    }

    /// Samples of two groups with advantages of both signs and the rollout log-probs of
    /// `model`'s weights (as a rollout with the same weights would give them).
    fn samples(model: &Llama) -> Vec<Sample> {
        let mut out: Vec<Sample> = (0..6)
            .map(|i| {
                let mut s = sample(i / 3, i as u32 % 3, 2 + i as usize % 3);
                s.response_tokens = (0..s.response_len() as i64)
                    .map(|t| 2 + (t * 11 + i as i64 * 5) % 90)
                    .collect();
                s.advantages = Some(vec![if i % 2 == 0 { 1.0 } else { -0.5 }; s.response_len()]);
                s
            })
            .collect();
        let rows = score_samples(model, &out, 0, 1.0, 8).unwrap();
        for (s, r) in out.iter_mut().zip(rows) {
            s.rollout_logprobs = r;
        }
        out
    }

    fn scored(p: &mut PolicyRole, samples: Vec<Sample>) -> Vec<Sample> {
        match p.serve(PolicyRequest::OldLogProbs(samples)).unwrap() {
            PolicyResponse::Scored(s) => s,
            other => panic!("{other:?}"),
        }
    }

    fn trained(p: &mut PolicyRole, samples: Vec<Sample>) -> TrainReport {
        match p.serve(PolicyRequest::Train(samples)).unwrap() {
            PolicyResponse::Trained(r) => r,
            other => panic!("{other:?}"),
        }
    }

    /// With one update per batch, taking the update's own log-probs as the old ones
    /// gives the update that recomputing them first gives, without that forward pass.
    #[test]
    fn on_policy_updates_like_recomputing_old_logprobs() {
        let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 11).unwrap();
        let batch = samples(&base);
        let mut recompute = policy(base.deep_copy(Device::Cpu, Kind::Float).unwrap(), false);
        let mut on_policy = policy(base, true);

        let a = scored(&mut recompute, batch.clone());
        let b = scored(&mut on_policy, batch.clone());
        for (s, b) in batch.iter().zip(&b) {
            assert_eq!(b.old_logprobs.as_ref(), Some(&s.rollout_logprobs));
        }
        let ra = trained(&mut recompute, a);
        let rb = trained(&mut on_policy, b);
        assert_eq!((rb.pg_clipfrac, rb.approx_kl), (0.0, 0.0));
        assert!(
            (ra.loss - rb.loss).abs() < 1e-5,
            "{} vs {}",
            ra.loss,
            rb.loss
        );
        assert!(ra.grad_norm > 0.0);
        let wa = recompute.trainer.model.hf_named_tensors();
        let wb = on_policy.trainer.model.hf_named_tensors();
        for ((name, x), (_, y)) in wa.iter().zip(&wb) {
            let d = (x - y).abs().max().double_value(&[]);
            assert!(d < 1e-5, "{name} differs by {d}");
        }
    }

    fn gradients(p: &mut PolicyRole, samples: Vec<Sample>) -> GradShard {
        match p.serve(PolicyRequest::Gradients(samples)).unwrap() {
            PolicyResponse::Gradients(g) => g,
            other => panic!("{other:?}"),
        }
    }

    /// Leaving out the samples whose advantages are all zero gives the loss and the
    /// gradients of the whole batch, under every loss aggregation, whether a
    /// micro-batch keeps some of its samples or none.
    #[test]
    fn skipping_zero_advantage_samples_keeps_loss_and_gradients() {
        let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 13).unwrap();
        let aggs = [
            LossAgg::TokenMean,
            LossAgg::SeqMeanTokenMean,
            LossAgg::SeqMeanTokenSumNorm { max_len: 4.0 },
        ];
        // Micro-batches of 3: {0, 1, 2} and {3, 4, 5}.
        for zeroed in [&[1usize, 2, 5][..], &[0, 1, 2], &[4]] {
            for agg in aggs {
                let mut batch = samples(&base);
                for &i in zeroed {
                    let n = batch[i].response_len();
                    batch[i].advantages = Some(vec![0.0; n]);
                }
                let run = |skip: bool| {
                    let mut p = policy(base.deep_copy(Device::Cpu, Kind::Float).unwrap(), false);
                    p.config.skip_zero_advantage = skip;
                    p.config.loss.agg = agg;
                    let scored = scored(&mut p, batch.clone());
                    gradients(&mut p, scored)
                };
                let (full, skipped) = (run(false), run(true));
                let what = format!("{agg:?}, advantages zero in {zeroed:?}");
                // The entropy is a mean over the samples that ran: fewer ran.
                assert_ne!(
                    full.report.entropy, skipped.report.entropy,
                    "{what}: nothing skipped"
                );
                assert!(
                    (full.report.loss - skipped.report.loss).abs() < 1e-6,
                    "{what}: loss {} vs {}",
                    full.report.loss,
                    skipped.report.loss
                );
                let grads = |g: &GradShard| -> Vec<(String, Tensor)> {
                    g.buckets
                        .iter()
                        .flat_map(|b| b.tensors(Device::Cpu).unwrap())
                        .collect()
                };
                let (gf, gs) = (grads(&full), grads(&skipped));
                assert_eq!(gf.len(), gs.len());
                let mut norm = 0.0;
                for ((name, x), (_, y)) in gf.iter().zip(&gs) {
                    let d = (x - y).abs().max().double_value(&[]);
                    norm += x.square().sum(Kind::Double).double_value(&[]);
                    assert!(d < 1e-6, "{what}: gradient of {name} differs by {d}");
                }
                assert!(norm > 0.0, "{what}: the batch has no gradient to compare");
            }
        }
    }

    /// A batch in which every advantage is zero runs no pass: zero loss, no gradient,
    /// the weights unchanged, and an unknown entropy rather than a made-up one.
    #[test]
    fn an_all_zero_advantage_batch_trains_nothing() {
        let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 17).unwrap();
        let mut batch = samples(&base);
        for s in &mut batch {
            s.advantages = Some(vec![0.0; s.response_len()]);
        }
        let mut p = policy(base.deep_copy(Device::Cpu, Kind::Float).unwrap(), true);
        let batch = scored(&mut p, batch);
        let r = trained(&mut p, batch);
        assert_eq!((r.loss, r.grad_norm, r.optimizer_steps), (0.0, 0.0, 1));
        assert!(r.entropy.is_nan(), "entropy {}", r.entropy);
        for ((name, x), (_, y)) in p
            .trainer
            .model
            .hf_named_tensors()
            .iter()
            .zip(&base.hf_named_tensors())
        {
            assert!(x.equal(y), "{name} changed");
        }
    }

    #[test]
    fn on_policy_needs_one_mini_batch() {
        let model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 1).unwrap();
        let config = PolicyConfig {
            on_policy: true,
            mini_batches: 2,
            ..Default::default()
        };
        let e = PolicyRole::new(Trainer::new(model, TrainConfig::default()), config)
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("mini_batches = 1"), "{e}");
    }

    /// A replica that takes another's exported state continues exactly where that one
    /// is: the same weights, step and optimizer moments, so their next updates agree.
    #[test]
    fn an_imported_state_continues_like_its_source() {
        let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap();
        let batch = samples(&base);
        let mut a = policy(base.deep_copy(Device::Cpu, Kind::Float).unwrap(), false);
        let mut b = policy(base, false);
        let first = scored(&mut a, batch.clone());
        trained(&mut a, first);
        let state = match a.serve(PolicyRequest::ExportState).unwrap() {
            PolicyResponse::State(s) => s,
            other => panic!("{other:?}"),
        };
        assert!(state.len_bytes() > 0);
        assert!(matches!(
            b.serve(PolicyRequest::ImportState(state)).unwrap(),
            PolicyResponse::Imported
        ));
        assert_eq!(b.trainer.step_count(), 1);
        let (sa, sb) = (scored(&mut a, batch.clone()), scored(&mut b, batch));
        let (ra, rb) = (trained(&mut a, sa), trained(&mut b, sb));
        assert_eq!(ra.loss, rb.loss);
        let wa = a.trainer.model.hf_named_tensors();
        let wb = b.trainer.model.hf_named_tensors();
        for ((name, x), (_, y)) in wa.iter().zip(&wb) {
            assert!(x.equal(y), "{name} differs after the same update");
        }
        // A state that names a path is refused before anything is written.
        let bad = TrainerState {
            files: vec![("../x".into(), bytes::Bytes::new())],
        };
        let e = b
            .serve(PolicyRequest::ImportState(bad))
            .unwrap_err()
            .to_string();
        assert!(e.contains("plain file names"), "{e}");
    }
}
