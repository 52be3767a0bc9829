//! The critic role: a value model (the policy's backbone plus a `v_head`) for PPO.
//!
//! It fills in each sample's per-token `values` before the advantages, and after the
//! advantages it trains on the `returns` (GAE targets) with the clipped value loss. The
//! value of response token `j` is read at the position before it (the state the token
//! was sampled from), like the log-probs. Each micro-batch's loss is weighted by its
//! share of the step's normaliser, so a step's gradient does not depend on how it is
//! split. [`ShardedCriticRole`] shards the same critic over ranks (`job.critic_shards`).

pub(crate) mod protocol;
pub(crate) mod rank;
mod sharded;
mod values;

pub use protocol::{CriticConfig, CriticReport, CriticRequest, CriticResponse};
pub use rank::CriticRankStep;
pub use sharded::ShardedCriticRole;

use std::path::PathBuf;
use std::time::Instant;

use yatt_engine::{EngineError, Trainer};

use crate::algo::loss::value_loss;
use crate::builtin::scoring::{check_device, model_bytes};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use crate::sample::{response_mask, token_matrix, Sample, TokenField};
use rank::update_report;
use values::{check_train_samples, micro_weights, response_values, sample_err};

/// The value model.
pub struct CriticRole {
    trainer: Trainer,
    config: CriticConfig,
    /// Checkpoints go only under this directory (a node's data directory).
    write_root: Option<PathBuf>,
}

impl CriticRole {
    /// Saves checkpoints only under `root` (see [`PolicyRole::with_write_root`](crate::PolicyRole::with_write_root)).
    pub fn with_write_root(mut self, root: PathBuf) -> Self {
        self.write_root = Some(root);
        self
    }

    /// A critic over `trainer`, whose model gets a zero-initialised `v_head` if it has
    /// no scalar head yet (a zero head makes the first advantages plain returns).
    pub fn new(mut trainer: Trainer, config: CriticConfig) -> Result<Self, RoleError> {
        config.check()?;
        if trainer.model.head.is_none() {
            // The trainer's optimizer state must cover the head: rebuild it.
            let mut model = trainer.model;
            model.attach_head("v_head");
            trainer = Trainer::new(model, trainer.config);
        }
        Ok(CriticRole {
            trainer,
            config,
            write_root: None,
        })
    }

    fn train(&mut self, samples: Vec<Sample>) -> Result<CriticReport, RoleError> {
        let t0 = Instant::now();
        let trained = check_train_samples(&samples)?;
        let cfg = self.config.clone();
        let dev = self.trainer.model.device();
        let per_mini = samples.len().div_ceil(cfg.mini_batches);
        let mut steps = Vec::new();
        for mini in samples.chunks(per_mini) {
            let micros: Vec<(usize, &[Sample])> =
                mini.chunks(cfg.micro_batch_size).enumerate().collect();
            let weights = micro_weights(micros.iter().map(|(_, c)| *c), &cfg, dev)?;
            // The trainer scales each micro-batch's loss by 1/n; the weights replace that.
            let n = micros.len() as f64;
            let (mut clip, mut vpred) = (0.0, 0.0);
            let step = self.trainer.step(&micros, |model, &(i, chunk)| {
                let v = response_values(model, chunk, cfg.pad_id)?;
                let field = |f| token_matrix(chunk, f, dev).map_err(sample_err);
                let mask = response_mask(chunk, dev).map_err(sample_err)?;
                let (loss, st) = value_loss(
                    &v,
                    &field(TokenField::Values)?,
                    &field(TokenField::Returns)?,
                    &mask,
                    &cfg.loss,
                )
                .map_err(|e| EngineError::InvalidArgument(e.to_string()))?;
                clip += st.clip_frac;
                vpred += st.value_mean;
                Ok(loss * (weights[i] * n))
            });
            let step = step.map_err(|e| RoleError::Failed(format!("critic update: {e}")))?;
            steps.push(vec![CriticRankStep {
                loss: step.loss,
                grad_norm: step.grad_norm,
                clip,
                vpred,
                micro_batches: micros.len(),
            }]);
        }
        Ok(update_report(trained, &steps, t0.elapsed().as_secs_f64()))
    }
}

impl Role for CriticRole {
    type Request = CriticRequest;
    type Response = CriticResponse;

    fn name(&self) -> &str {
        "critic"
    }

    fn profile(&self) -> ResourceProfile {
        // Offloaded, its parameters are empty placeholders (which `model_bytes`, splitting
        // the fused matrices, cannot read): it holds nothing on the device.
        let w = match self.trainer.is_offloaded() {
            true => 0,
            false => model_bytes(&self.trainer.model),
        };
        ResourceProfile {
            resident_bytes: w * 4,
            peak_extra_bytes: w,
            offloadable: true,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("critic", self.trainer.model.device(), group)
    }

    fn serve(&mut self, request: CriticRequest) -> Result<CriticResponse, RoleError> {
        if self.trainer.is_offloaded() {
            return Err(RoleError::NotReady(
                "critic is offloaded; reload it first".into(),
            ));
        }
        match request {
            CriticRequest::Values(mut samples) => {
                let mut rows = Vec::with_capacity(samples.len());
                for chunk in samples.chunks(self.config.micro_batch_size) {
                    let v = tch::no_grad(|| {
                        response_values(&self.trainer.model, chunk, self.config.pad_id)
                    })
                    .map_err(|e| {
                        RoleError::Failed(format!("critic values of {} samples: {e}", chunk.len()))
                    })?;
                    rows.extend(crate::sample::split_rows(&v, chunk));
                }
                for (s, r) in samples.iter_mut().zip(rows) {
                    s.values = Some(r);
                }
                Ok(CriticResponse::Valued(samples))
            }
            CriticRequest::Train(samples) => {
                super::fault::in_critic_update();
                self.train(samples).map(CriticResponse::Trained)
            }
            CriticRequest::SaveCheckpoint(dir) => {
                super::write_root::check_under(
                    self.write_root.as_deref(),
                    &dir,
                    "the critic's checkpoint",
                )?;
                self.trainer.save_checkpoint(&dir, None).map_err(|e| {
                    RoleError::Failed(format!(
                        "saving the critic checkpoint to {}: {e}",
                        dir.display()
                    ))
                })?;
                Ok(CriticResponse::Saved)
            }
        }
    }

    fn offload(&mut self) -> Result<(), RoleError> {
        self.trainer
            .offload()
            .map_err(|e| RoleError::Failed(format!("offloading the critic: {e}")))
    }

    fn reload(&mut self) -> Result<(), RoleError> {
        self.trainer
            .reload()
            .map_err(|e| RoleError::Failed(format!("reloading the critic: {e}")))
    }
}

#[cfg(test)]
mod tests;
