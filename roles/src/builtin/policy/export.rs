//! What the policy sends for weight sync: byte buckets, an in-process snapshot of its
//! tensors, or one device buffer by CUDA IPC handle.

use tch::Tensor;
use yatt_engine::to_buckets;

use super::{LoraSync, PolicyResponse, PolicyRole};
use crate::role::{LocalWeights, RoleError, WeightsUpdate};

impl PolicyRole {
    /// The tensors a weight sync sends (HF names; adapters only with `sync = adapters`).
    fn sync_tensors(&self) -> Vec<(String, Tensor)> {
        let m = &self.trainer.model;
        match (m.lora().is_some(), self.config.lora_sync) {
            (false, _) => m.hf_named_tensors(),
            (true, LoraSync::Adapters) => m.adapter_sync_tensors(),
            (true, LoraSync::Merged) => m.merged_hf_named_tensors(),
        }
    }

    pub(super) fn export_device(&mut self) -> PolicyResponse {
        let version = self.trainer.step_count();
        let named = tch::no_grad(|| self.sync_tensors());
        match self.staging.export(version, &named) {
            Ok(w) => PolicyResponse::Weights(WeightsUpdate {
                device: Some(w),
                ..WeightsUpdate::from_buckets(version, Vec::new())
            }),
            Err(e) => PolicyResponse::DeviceWeightsUnavailable(e.to_string()),
        }
    }

    pub(super) fn export(&mut self) -> Result<WeightsUpdate, RoleError> {
        let named = self.sync_tensors();
        let buckets = tch::no_grad(|| to_buckets(&named, self.config.bucket_bytes))
            .map_err(|e| RoleError::Failed(format!("exporting weights: {e}")))?;
        Ok(WeightsUpdate::from_buckets(
            self.trainer.step_count(),
            buckets,
        ))
    }

    pub(super) fn export_local(&mut self) -> WeightsUpdate {
        WeightsUpdate {
            version: self.trainer.step_count(),
            buckets: Vec::new(),
            local: Some(LocalWeights::new(self.trainer.model.weights_snapshot())),
            device: None,
        }
    }
}
