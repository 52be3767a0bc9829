//! Which rollout replicas are generating right now (live placement reads it).

use std::collections::BTreeMap;
use yatt_runtime::ActorId;

/// The rollout replicas that generation calls are in flight to, shared by the heads
/// that report to it (`Controller::set_probe`): a step's progress seen from outside,
/// e.g. by a test that must act while a step generates on a given replica.
#[derive(Clone, Default, Debug)]
pub struct GenProbe(std::sync::Arc<std::sync::Mutex<BTreeMap<ActorId, usize>>>);

impl GenProbe {
    /// Whether a generation call to `replica` is in flight now.
    pub fn in_flight(&self, replica: &ActorId) -> bool {
        self.lock().get(replica).is_some_and(|n| *n > 0)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<ActorId, usize>> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn enter(&self, replica: &ActorId) -> GenProbeGuard<'_> {
        *self.lock().entry(replica.clone()).or_insert(0) += 1;
        GenProbeGuard {
            probe: self,
            replica: replica.clone(),
        }
    }
}

/// Counts one call out of the probe when dropped (answered, failed or cancelled).
pub(crate) struct GenProbeGuard<'a> {
    pub(crate) probe: &'a GenProbe,
    pub(crate) replica: ActorId,
}

impl Drop for GenProbeGuard<'_> {
    fn drop(&mut self) {
        let mut m = self.probe.lock();
        if let Some(n) = m.get_mut(&self.replica) {
            *n = n.saturating_sub(1);
        }
    }
}
