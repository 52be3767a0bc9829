//! Gradients of policy replicas averaged through NCCL: one all-reduce of the flat f32
//! gradients on the GPU, in place of the QUIC ring's trip through host memory. The ring
//! stays joined as the fallback: a failed all-reduce (a deadline, a peer gone) drops the
//! group with a warning, and this update and the later ones go over the ring.

use super::{PolicyResponse, PolicyRole};
use crate::builtin::nccl_member::{can_join, GroupMember};
use crate::role::{NcclGroup, RoleError};

impl PolicyRole {
    /// Whether this replica can average gradients through NCCL; with `make_id` (the
    /// first replica, rank 0) the group's id too.
    pub(super) fn gradient_group(&mut self, make_id: bool) -> PolicyResponse {
        if let Err(why) = can_join(self.trainer.model.device(), "the policy's") {
            return PolicyResponse::NcclUnavailable(why);
        }
        match make_id {
            false => PolicyResponse::GradientGroup(None),
            true => match yatt_collective::UniqueId::new() {
                Ok(id) => PolicyResponse::GradientGroup(Some(id)),
                Err(e) => PolicyResponse::NcclUnavailable(e.to_string()),
            },
        }
    }

    /// Averages gradients in `group` from now on (`None`: over the ring alone). The
    /// communicator is made at the first all-reduce, which every replica runs at once.
    pub(super) fn join_gradient_group(
        &mut self,
        group: Option<NcclGroup>,
    ) -> Result<PolicyResponse, RoleError> {
        if let Some(g) = &group {
            if g.nranks == 0 || g.rank >= g.nranks {
                return Err(RoleError::BadRequest(format!(
                    "gradient group rank {} is not in 0..{}",
                    g.rank, g.nranks
                )));
            }
        }
        self.grad_group = group.map(|g| (g, GroupMember::default()));
        Ok(PolicyResponse::Joined)
    }

    /// This replica's gradients averaged with its peers' (the round is the version
    /// before the update: the replicas are in step), as one flat f32 tensor, and
    /// whether NCCL averaged them.
    pub(super) fn average_gradients(&mut self) -> Result<(tch::Tensor, bool), RoleError> {
        let grad_fail =
            |e: yatt_engine::EngineError| RoleError::Failed(format!("reading the gradients: {e}"));
        if let Some((group, member)) = self.grad_group.as_mut() {
            let device = self.trainer.model.device();
            let flat = self.trainer.flat_grads_on(device).map_err(grad_fail)?;
            match member.all_reduce_mean(group, &flat) {
                Ok(()) => return Ok((flat, true)),
                Err(e) => {
                    // Every replica's all-reduce failed with this one's (none can finish
                    // without all), so every replica falls back to the ring together.
                    tracing::warn!(error = %e, "gradient all-reduce: NCCL failed; this update and the later ones average over the QUIC ring");
                    self.grad_group = None;
                }
            }
        }
        let local = self.trainer.flat_grads().map_err(grad_fail)?;
        let round = self.trainer.step_count();
        let ring = self.ring.as_mut().ok_or_else(|| {
            RoleError::BadRequest("this policy replica has no ring to average over".into())
        })?;
        let mean = ring
            .all_reduce_mean_blocking(local, round)
            .map_err(|e| RoleError::Failed(format!("gradient all-reduce: {e}")))?;
        Ok((tch::Tensor::from_slice(&mean), false))
    }
}
