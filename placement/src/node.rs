//! What placement needs to know of a node: its name, host memory and devices. The
//! consumer fills it in from whatever its cluster reports (the runtime's membership,
//! a test, a simulated cluster), so placement depends on no runtime.

use serde::{Deserialize, Serialize};

/// One node of the cluster, as placement sees it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeDesc {
    /// The node's name (unique in the cluster).
    pub name: String,
    /// Host memory in bytes (where offloaded state goes, shared by its devices).
    pub memory_bytes: u64,
    /// Its devices.
    pub devices: Vec<DeviceDesc>,
}

/// One device a node offers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceDesc {
    /// Index on the node (the CUDA ordinal for GPUs).
    pub index: u32,
    /// Whether it is a GPU (false: a virtual device on CPU).
    pub gpu: bool,
    /// Device memory in bytes.
    pub memory_bytes: u64,
}
