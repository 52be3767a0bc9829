//! Which roles of this process hold which devices now: each [`crate::RoleActor`]
//! registers its role and device group once its role has started, and leaves when its
//! thread ends (the role stopped and its memory freed). The live view reads it to show
//! each device's holders in runs whose placement draws no plan (an embedded run, a
//! daemon's roles).

use std::sync::Mutex;

/// A role holding a device group (a [`crate::DeviceGroup`]'s fields), as
/// [`device_holders`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceHolder {
    /// The role's name (`policy`, `rollout`, ...).
    pub role: String,
    /// The node hosting the devices.
    pub node: String,
    /// Device indices on that node (CUDA ordinals, or virtual device numbers).
    pub devices: Vec<u32>,
    /// Whether the devices are CUDA GPUs (false: the CPU, with virtual devices).
    pub cuda: bool,
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

/// Registers `holder` for as long as the returned guard lives.
pub(crate) fn hold(holder: DeviceHolder) -> Holding {
    let id = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    lock().push((id, holder));
    Holding(id)
}

/// The roles of this process that hold devices of node `node` now, in the order they
/// started.
pub fn device_holders(node: &str) -> Vec<DeviceHolder> {
    lock()
        .iter()
        .filter(|(_, h)| h.node == node)
        .map(|(_, h)| h.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn holder(role: &str, devices: &[u32], cuda: bool) -> DeviceHolder {
        DeviceHolder {
            role: role.into(),
            node: "holders-test-node".into(),
            devices: devices.to_vec(),
            cuda,
        }
    }

    #[test]
    fn a_holder_is_listed_while_its_guard_lives() {
        let a = hold(holder("policy", &[1], true));
        let b = hold(holder("rollout", &[0], false));
        let listed = device_holders("holders-test-node");
        assert_eq!(
            listed,
            [holder("policy", &[1], true), holder("rollout", &[0], false)]
        );
        assert!(device_holders("another-node").is_empty());
        drop(a);
        assert_eq!(
            device_holders("holders-test-node"),
            [holder("rollout", &[0], false)]
        );
        drop(b);
        assert!(device_holders("holders-test-node").is_empty());
    }
}
