//! The reference role: a frozen copy of the initial policy that scores samples.
//!
//! It answers a batch of samples with each sample's `ref_logprobs` filled in (log-probs
//! of the response tokens at the policy's sampling temperature), scored in
//! micro-batches without gradients. Its weights change only by an explicit
//! `load_weights`: on a cluster the policy's initial weights are pushed to it once, so
//! that a reference built in another process is the same model.

use yatt_engine::Llama;

use crate::builtin::scoring::{check_device, load_buckets, model_bytes, score_samples};
use crate::builtin::slices::{write_slices, SliceAssembly};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, WeightsUpdate};
use crate::sample::Sample;

/// A frozen reference policy.
pub struct ReferenceRole {
    model: Llama,
    pad_id: i64,
    temperature: f64,
    micro_batch_size: usize,
    offloaded_from: Option<tch::Device>,
    /// A sharded policy's slices of the version being synced, until the last comes.
    slices: SliceAssembly,
}

impl ReferenceRole {
    /// A reference over `model` (gradients are switched off), scoring at `temperature`
    /// (the rollout's) in micro-batches of `micro_batch_size`, padding with `pad_id`.
    pub fn new(mut model: Llama, pad_id: i64, temperature: f64, micro_batch_size: usize) -> Self {
        model.set_requires_grad(false);
        ReferenceRole {
            model,
            pad_id,
            temperature,
            micro_batch_size: micro_batch_size.max(1),
            offloaded_from: None,
            slices: SliceAssembly::default(),
        }
    }
}

impl Role for ReferenceRole {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reference"
    }

    fn profile(&self) -> ResourceProfile {
        // Offloaded from a GPU, its weights are on the host: it holds nothing there.
        let resident = match self.offloaded_from {
            Some(dev) if dev != self.model.device() => 0,
            _ => model_bytes(&self.model),
        };
        ResourceProfile {
            resident_bytes: resident,
            peak_extra_bytes: 0,
            offloadable: true,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("reference", self.model.device(), group)
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        if self.offloaded_from.is_some() {
            return Err(RoleError::NotReady(
                "reference is offloaded; reload it first".into(),
            ));
        }
        if samples.is_empty() {
            return Ok(samples);
        }
        let rows = score_samples(
            &self.model,
            &samples,
            self.pad_id,
            self.temperature,
            self.micro_batch_size,
        )?;
        for (s, r) in samples.iter_mut().zip(rows) {
            s.ref_logprobs = Some(r);
        }
        Ok(samples)
    }

    fn offload(&mut self) -> Result<(), RoleError> {
        if self.offloaded_from.is_none() {
            self.offloaded_from = Some(self.model.device());
            self.model.to_device(tch::Device::Cpu);
        }
        Ok(())
    }

    fn reload(&mut self) -> Result<(), RoleError> {
        if let Some(dev) = self.offloaded_from.take() {
            self.model.to_device(dev);
        }
        Ok(())
    }

    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        if let Some(slice) = update.slice {
            let Some(all) = self.slices.offer(update, slice)? else {
                return Ok(());
            };
            let device = self.model.device();
            let model = &mut self.model;
            return write_slices(&all, device, |world, named| {
                yatt_engine::write_unit_slices(model, world, named)
            });
        }
        load_buckets(&mut self.model, &update)
    }
}
