//! What the policy sends: for weight sync byte buckets, an in-process snapshot of its
//! tensors, or one packed device buffer (by CUDA IPC handle or NCCL broadcast); and its
//! whole trainer state, for a replica that takes over.

use tch::{Kind, Tensor};
use yatt_collective::{IpcError, UniqueId};
use yatt_engine::{to_buckets, Trainer};

use super::state::TrainerState;
use super::{LoraSync, PolicyResponse, PolicyRole};
use crate::builtin::nccl_member::GroupMember;
use crate::role::{
    packed_end, DeviceRoute, DeviceWeights, LocalWeights, NcclGroup, RoleError, WeightsUpdate,
};

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
            slice: None,
        }
    }

    /// Packs the weights for an NCCL broadcast, reusing `group` (a controller's last)
    /// unless `fresh` or unknown here (this replica is new), else making a new group;
    /// the answer's route carries the id with this policy as rank 0. Answers why not
    /// where NCCL cannot be used.
    pub(super) fn stage_broadcast(
        &mut self,
        group: Option<UniqueId>,
        fresh: bool,
    ) -> PolicyResponse {
        let version = self.trainer.step_count();
        let named = tch::no_grad(|| self.sync_tensors());
        let unavailable = PolicyResponse::NcclUnavailable;
        let entries = match self.staging.pack(version, &named) {
            Ok(staged) => staged.entries.clone(),
            Err(IpcError::Unavailable(why)) => {
                return unavailable(format!("NCCL unavailable: {why}"))
            }
            Err(e) => return unavailable(e.to_string()),
        };
        if let Err(e) = yatt_collective::availability() {
            // Nothing will read the packed copy.
            self.staging = Default::default();
            return unavailable(e.to_string());
        }
        if let (Some(old), true) = (group, fresh) {
            // Its communicator goes with it.
            self.groups.remove(&old);
        }
        let id = match group {
            Some(id) if !fresh && self.groups.contains_key(&id) => id,
            _ => match UniqueId::new() {
                Ok(id) => {
                    self.groups.insert(id, GroupMember::default());
                    id
                }
                Err(e) => return unavailable(e.to_string()),
            },
        };
        let group = NcclGroup {
            id,
            rank: 0,
            nranks: 0,
            deadline_ms: 0,
            bucket_bytes: self.config.bucket_bytes as u64,
        };
        PolicyResponse::Weights(WeightsUpdate {
            device: Some(DeviceWeights {
                entries,
                route: DeviceRoute::Broadcast(group),
            }),
            ..WeightsUpdate::from_buckets(version, Vec::new())
        })
    }

    /// Rank 0 of `group`: broadcasts the weights staged for the current version.
    pub(super) fn send_broadcast(&mut self, group: NcclGroup) -> Result<PolicyResponse, RoleError> {
        let version = self.trainer.step_count();
        let member = self.groups.get_mut(&group.id).ok_or_else(|| {
            RoleError::BadRequest(
                "a broadcast for a group this policy did not make: ask StageBroadcast first".into(),
            )
        })?;
        let staged = self.staging.staged(version).ok_or_else(|| {
            RoleError::BadRequest(format!(
                "no weights staged for v{version}: ask StageBroadcast first"
            ))
        })?;
        let bytes = packed_end(&staged.entries);
        member.send(&group, &staged.buffer, bytes)?;
        Ok(PolicyResponse::Sent)
    }
}

impl PolicyRole {
    /// Writes a checkpoint to a scratch directory and reads it back as bytes: the
    /// checkpoint format is already exact for resume, so the hand-off reuses it.
    pub(super) fn export_state(&mut self) -> Result<TrainerState, RoleError> {
        let failed = state_error("exporting");
        let dir = scratch_dir(&failed)?;
        self.trainer
            .save_checkpoint(dir.path(), None)
            .map_err(|e| failed("the checkpoint", &e))?;
        let mut files = Vec::new();
        let entries = std::fs::read_dir(dir.path()).map_err(|e| failed("listing it", &e))?;
        for entry in entries {
            let entry = entry.map_err(|e| failed("listing it", &e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            if !path.is_file() {
                return Err(failed(&name, &"not a plain file"));
            }
            let data = std::fs::read(&path).map_err(|e| failed(&name, &e))?;
            files.push((name, bytes::Bytes::from(data)));
        }
        files.sort_by(|a, b| a.0.cmp(&b.0));
        Ok(TrainerState { files })
    }

    /// Takes another replica's state: the weights, the optimizer and the step (the ring
    /// membership and the role's settings stay this replica's).
    pub(super) fn import_state(&mut self, state: TrainerState) -> Result<(), RoleError> {
        state.check()?;
        let failed = state_error("importing");
        let dir = scratch_dir(&failed)?;
        for (name, data) in &state.files {
            std::fs::write(dir.path().join(name), data).map_err(|e| failed(name, &e))?;
        }
        let device = self.trainer.model.device();
        let mut trainer = Trainer::load_checkpoint(dir.path(), device, Kind::Float)
            .map_err(|e| RoleError::BadRequest(format!("importing the trainer state: {e}")))?;
        // The replicas of a job train one model: a state of another shape would only
        // fail later, in the middle of a gradient all-reduce.
        let shapes = |t: &mut Trainer| -> Vec<(String, Vec<i64>)> {
            t.model
                .parameters_mut()
                .into_iter()
                .map(|(n, p)| (n, p.size()))
                .collect()
        };
        let (mine, theirs) = (shapes(&mut self.trainer), shapes(&mut trainer));
        if mine != theirs {
            return Err(RoleError::BadRequest(format!(
                "importing the trainer state: it holds a model of {} parameter tensors, this replica's has {}; export it from a replica of the same job",
                theirs.len(),
                mine.len()
            )));
        }
        self.trainer = trainer;
        Ok(())
    }
}

/// How the state hand-off reports a failed step of `doing` (exporting, importing).
fn state_error(doing: &'static str) -> impl Fn(&str, &dyn std::fmt::Display) -> RoleError {
    move |what, e| RoleError::Failed(format!("{doing} the trainer state: {what}: {e}"))
}

/// A scratch directory for a checkpoint in transit (removed when dropped).
fn scratch_dir(
    failed: &impl Fn(&str, &dyn std::fmt::Display) -> RoleError,
) -> Result<tempfile::TempDir, RoleError> {
    tempfile::Builder::new()
        .prefix("yatt-policy-state-")
        .tempdir()
        .map_err(|e| failed("a scratch directory", &e))
}
