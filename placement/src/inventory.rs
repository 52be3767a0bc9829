//! What the cluster has: nodes, their devices, and the GPU groups placement hands out.
//!
//! A group is a set of devices on one node (tensor parallelism stays inside NVLink);
//! it is the unit a plan assigns to roles. The inventory is built from the
//! [`NodeDesc`] of each node that joins, or made up for the simulator.

use std::collections::BTreeMap;
use std::fmt;

use serde::{Deserialize, Serialize};

use crate::node::NodeDesc;

/// Identifies a group for the life of an inventory (ids of removed groups are not
/// reused, so a stale decision cannot name a new group by accident).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct GroupId(pub u32);

impl fmt::Display for GroupId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// Devices on one node, allocated together.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Group {
    /// Its id.
    pub id: GroupId,
    /// The node hosting the devices.
    pub node: String,
    /// Device indices on that node.
    pub devices: Vec<u32>,
    /// Memory of the smallest device in the group, bytes (sharded state is split
    /// evenly, so the smallest device decides what fits).
    pub device_memory_bytes: f64,
    /// Host memory per device on the node, bytes (where offloaded state goes).
    pub host_memory_per_device: f64,
    /// Whether the devices are GPUs (false: virtual devices on CPU).
    pub cuda: bool,
}

impl Group {
    /// Devices in the group.
    pub fn size(&self) -> u32 {
        self.devices.len() as u32
    }
}

/// Why an inventory could not be built or changed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum InventoryError {
    /// A group must have at least one device.
    #[error("group size must be at least 1 device; set the group size to the tensor-parallel degree the models need (1 to the devices per node)")]
    ZeroGroupSize,
    /// A node's device count is not a multiple of the group size.
    #[error("node {node} has {devices} device(s), not a multiple of the group size {group_size}; use a group size that divides every node's device count")]
    Indivisible {
        /// The node.
        node: String,
        /// Its device count.
        devices: usize,
        /// The group size asked for.
        group_size: u32,
    },
    /// A node joined twice without leaving.
    #[error(
        "node {0} is already in the inventory; a restarted node must leave before it joins again"
    )]
    DuplicateNode(String),
}

/// Nodes and their groups.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Inventory {
    group_size: u32,
    groups: BTreeMap<GroupId, Group>,
    next_id: u32,
}

impl Inventory {
    /// An empty inventory cutting nodes into groups of `group_size` devices.
    pub fn new(group_size: u32) -> Result<Self, InventoryError> {
        if group_size == 0 {
            return Err(InventoryError::ZeroGroupSize);
        }
        Ok(Inventory {
            group_size,
            groups: BTreeMap::new(),
            next_id: 0,
        })
    }

    /// From the nodes of a cluster. A node with GPUs offers those; a node without
    /// offers its virtual devices.
    pub fn from_nodes(nodes: &[NodeDesc], group_size: u32) -> Result<Self, InventoryError> {
        let mut inv = Inventory::new(group_size)?;
        for n in nodes {
            inv.add_node(n)?;
        }
        Ok(inv)
    }

    /// A uniform cluster of `nodes` nodes with `per_node` devices of `memory_bytes`
    /// each (and `host_per_device` host memory per device), for the simulator.
    pub fn uniform(
        nodes: u32,
        per_node: u32,
        group_size: u32,
        memory_bytes: f64,
        host_per_device: f64,
    ) -> Result<Self, InventoryError> {
        let mut inv = Inventory::new(group_size)?;
        if per_node % group_size != 0 {
            return Err(InventoryError::Indivisible {
                node: "node-0".into(),
                devices: per_node as usize,
                group_size,
            });
        }
        for n in 0..nodes {
            for first in (0..per_node).step_by(group_size as usize) {
                inv.push_group(Group {
                    id: GroupId(0),
                    node: format!("node-{n}"),
                    devices: (first..first + group_size).collect(),
                    device_memory_bytes: memory_bytes,
                    host_memory_per_device: host_per_device,
                    cuda: true,
                });
            }
        }
        Ok(inv)
    }

    fn push_group(&mut self, mut g: Group) -> GroupId {
        let id = GroupId(self.next_id);
        self.next_id += 1;
        g.id = id;
        self.groups.insert(id, g);
        id
    }

    /// Adds a node's devices as groups; returns the new groups.
    pub fn add_node(&mut self, node: &NodeDesc) -> Result<Vec<GroupId>, InventoryError> {
        if self.groups.values().any(|g| g.node == node.name) {
            return Err(InventoryError::DuplicateNode(node.name.clone()));
        }
        let cuda: Vec<_> = node.devices.iter().filter(|d| d.gpu).collect();
        let (devices, is_cuda) = if cuda.is_empty() {
            (node.devices.iter().collect::<Vec<_>>(), false)
        } else {
            (cuda, true)
        };
        if devices.len() % self.group_size as usize != 0 {
            return Err(InventoryError::Indivisible {
                node: node.name.clone(),
                devices: devices.len(),
                group_size: self.group_size,
            });
        }
        let host_per_device = node.memory_bytes as f64 / devices.len().max(1) as f64;
        let mut added = Vec::new();
        for chunk in devices.chunks(self.group_size as usize) {
            let mem = chunk.iter().map(|d| d.memory_bytes).min().unwrap_or(0) as f64;
            added.push(self.push_group(Group {
                id: GroupId(0),
                node: node.name.clone(),
                devices: chunk.iter().map(|d| d.index).collect(),
                device_memory_bytes: mem,
                host_memory_per_device: host_per_device,
                cuda: is_cuda,
            }));
        }
        Ok(added)
    }

    /// Removes a node's groups (it left or died); returns the groups lost.
    pub fn remove_node(&mut self, node: &str) -> Vec<GroupId> {
        let lost: Vec<GroupId> = self
            .groups
            .values()
            .filter(|g| g.node == node)
            .map(|g| g.id)
            .collect();
        for id in &lost {
            self.groups.remove(id);
        }
        lost
    }

    /// Devices per group.
    pub fn group_size(&self) -> u32 {
        self.group_size
    }

    /// The groups, in id order.
    pub fn groups(&self) -> impl Iterator<Item = &Group> {
        self.groups.values()
    }

    /// One group.
    pub fn group(&self, id: GroupId) -> Option<&Group> {
        self.groups.get(&id)
    }

    /// Number of groups.
    pub fn len(&self) -> usize {
        self.groups.len()
    }

    /// Whether there are no groups.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// Devices in all groups.
    pub fn devices(&self) -> u32 {
        self.groups.values().map(Group::size).sum()
    }

    /// The smallest device memory of any group, bytes (the search treats groups as
    /// interchangeable and plans for the smallest).
    pub fn min_device_memory(&self) -> f64 {
        self.groups
            .values()
            .map(|g| g.device_memory_bytes)
            .fold(f64::INFINITY, f64::min)
    }

    /// The smallest host memory per device of any group, bytes.
    pub fn min_host_memory(&self) -> f64 {
        self.groups
            .values()
            .map(|g| g.host_memory_per_device)
            .fold(f64::INFINITY, f64::min)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::DeviceDesc;

    fn node(name: &str, gpus: u32) -> NodeDesc {
        NodeDesc {
            name: name.into(),
            memory_bytes: 1 << 40,
            devices: (0..gpus)
                .map(|index| DeviceDesc {
                    index,
                    gpu: true,
                    memory_bytes: 80 << 30,
                })
                .collect(),
        }
    }

    #[test]
    fn nodes_cut_into_groups_and_leave() {
        let mut inv = Inventory::from_nodes(&[node("a", 8), node("b", 8)], 4).unwrap();
        assert_eq!(inv.len(), 4);
        assert_eq!(inv.devices(), 16);
        let g = inv.groups().nth(1).unwrap();
        assert_eq!(
            (g.node.as_str(), g.devices.clone()),
            ("a", vec![4, 5, 6, 7])
        );
        assert_eq!(g.host_memory_per_device, (1u64 << 40) as f64 / 8.0);
        let lost = inv.remove_node("a");
        assert_eq!(lost, vec![GroupId(0), GroupId(1)]);
        // Ids are not reused after a node leaves.
        let added = inv.add_node(&node("c", 4)).unwrap();
        assert_eq!(added, vec![GroupId(4)]);
    }

    #[test]
    fn refuses_indivisible_nodes_and_duplicates() {
        let err = Inventory::from_nodes(&[node("a", 6)], 4).unwrap_err();
        assert!(err
            .to_string()
            .contains("not a multiple of the group size 4"));
        let mut inv = Inventory::from_nodes(&[node("a", 4)], 4).unwrap();
        assert!(matches!(
            inv.add_node(&node("a", 4)),
            Err(InventoryError::DuplicateNode(_))
        ));
        assert_eq!(
            Inventory::new(0).unwrap_err(),
            InventoryError::ZeroGroupSize
        );
    }

    #[test]
    fn cpu_nodes_offer_virtual_devices() {
        let n = NodeDesc {
            name: "cpu".into(),
            memory_bytes: 1 << 30,
            devices: vec![DeviceDesc {
                index: 0,
                gpu: false,
                memory_bytes: 1 << 30,
            }],
        };
        let inv = Inventory::from_nodes(&[n], 1).unwrap();
        assert!(!inv.groups().next().unwrap().cuda);
    }
}
