//! Which roles of this process hold which devices now: each [`crate::RoleActor`]
//! registers its role and device group once its role has started, and leaves when its
//! thread ends (the role stopped and its memory freed). The live view reads it to show
//! each device's holders in runs whose placement draws no plan (an embedded run, a
//! daemon's roles).

use std::sync::Mutex;

use crate::role::DeviceGroup;

/// A role holding a device group, as [`device_holders`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHolder {
    /// The role's name (`policy`, `rollout`, ...).
    pub role: String,
    /// Where it runs.
    pub group: DeviceGroup,
}

static HOLDERS: Mutex<Vec<(u64, DeviceHolder)>> = Mutex::new(Vec::new());
static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

fn lock() -> std::sync::MutexGuard<'static, Vec<(u64, DeviceHolder)>> {
    HOLDERS.lock().unwrap_or_else(|p| p.into_inner())
}

/// `role` holds `group` until the guard is dropped.
pub(crate) struct Holding(u64);

impl Drop for Holding {
    fn drop(&mut self) {
        lock().retain(|(id, _)| *id != self.0);
    }
}

/// Registers `role` on `group` for as long as the returned guard lives.
pub(crate) fn hold(role: &str, group: &DeviceGroup) -> Holding {
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    lock().push((
        id,
        DeviceHolder {
            role: role.to_string(),
            group: group.clone(),
        },
    ));
    Holding(id)
}

/// The roles of this process that hold devices of node `node` now, in the order they
/// started.
pub fn device_holders(node: &str) -> Vec<DeviceHolder> {
    lock()
        .iter()
        .filter(|(_, h)| h.group.node == node)
        .map(|(_, h)| h.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_holder_is_listed_while_its_guard_lives() {
        let g = DeviceGroup {
            node: "holders-test-node".into(),
            devices: vec![1],
            cuda: true,
        };
        let a = hold("policy", &g);
        let b = hold("rollout", &DeviceGroup::cpu("holders-test-node"));
        let listed = device_holders("holders-test-node");
        assert_eq!(listed.len(), 2);
        assert_eq!(
            (listed[0].role.as_str(), listed[0].group.devices.as_slice()),
            ("policy", &[1][..])
        );
        assert!(device_holders("another-node").is_empty());
        drop(a);
        let listed = device_holders("holders-test-node");
        assert_eq!(listed.len(), 1);
        assert_eq!(listed[0].role, "rollout");
        drop(b);
        assert!(device_holders("holders-test-node").is_empty());
    }
}
