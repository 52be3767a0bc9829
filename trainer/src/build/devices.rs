//! Which device each role's models live on: `model.device` resolved against the GPUs
//! libtorch sees on the node that builds the role.

use std::sync::Arc;

use tch::Device;
use yatt_engine::Llama;
use yatt_roles::{DeviceGroup, TextCodec};

use crate::build::parts::base_model;

use crate::config::modes::DeviceSetting;
use crate::config::sections::JobConfig;
use crate::error::JobError;

/// The device group of a role built on `node` by this process.
///
/// `auto` takes CUDA 0 when libtorch sees a GPU here and the CPU otherwise; `cuda:N`
/// must name a GPU this node has. Every role of one process shares the group (full
/// colocation); live placement hands out its own groups.
pub(crate) fn role_group(job: &JobConfig, node: &str) -> Result<DeviceGroup, JobError> {
    let gpus = yatt_engine::cuda_device_count();
    let cuda = |n: u32| DeviceGroup {
        node: node.to_string(),
        devices: vec![n],
        cuda: true,
    };
    match job.model.device {
        DeviceSetting::Cpu => Ok(DeviceGroup::cpu(node)),
        DeviceSetting::Auto if gpus == 0 => Ok(DeviceGroup::cpu(node)),
        DeviceSetting::Auto => Ok(cuda(0)),
        DeviceSetting::Cuda(n) if (n as usize) < gpus => Ok(cuda(n)),
        DeviceSetting::Cuda(n) => Err(JobError::Invalid {
            key: "model.device".into(),
            expected: match gpus {
                0 => format!("a device node {node} has: libtorch sees no GPU there"),
                g => format!("a GPU node {node} has: cuda:0 to cuda:{}", g - 1),
            },
            found: format!("cuda:{n}"),
            fix: "use device = \"auto\", \"cpu\" or an ordinal the node has (LD_LIBRARY_PATH \
                  must reach a CUDA build of libtorch for GPUs to be seen)"
                .into(),
        }),
    }
}

/// The device that `job`'s models use when built by this process on `node`.
pub(crate) fn job_device(job: &JobConfig, node: &str) -> Result<Device, JobError> {
    Ok(role_group(job, node)?.torch_device())
}

/// The job's base model on this process's device and in the job's dtype, with its codec
/// and pad id (what a role built on a cluster node starts from).
pub(crate) fn model_here(job: &JobConfig) -> Result<(Llama, Arc<dyn TextCodec>, i64), JobError> {
    let (model, codec, pad_id) = base_model(job)?;
    let model = on_device(job, model, job_device(job, "this node")?)?;
    Ok((model, codec, pad_id))
}

/// `model` on `dev` in the job's dtype; no copy when it is there already.
pub(crate) fn on_device(job: &JobConfig, model: Llama, dev: Device) -> Result<Llama, JobError> {
    let kind = job.model.dtype.kind();
    if model.device() == dev && model.kind() == kind {
        return Ok(model);
    }
    model.deep_copy(dev, kind).map_err(|e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: format!("moving it to {dev:?} in {kind:?}: {e}"),
    })
}
