//! What a controller knows of the device bytes its colocated roles hold, for the
//! budget check of time sharing (`placement.time_share = "offload"`): plain data, no
//! I/O.

use std::collections::BTreeMap;

/// What a controller knows of the device bytes its roles hold.
#[derive(Debug, Default, Clone, PartialEq)]
pub(crate) struct Residency {
    /// Bytes each role held before its last offload (what its reload needs).
    loaded: BTreeMap<String, u64>,
    /// Bytes each role holds now (as last measured, or as reloaded).
    now: BTreeMap<String, u64>,
}

impl Residency {
    /// Records a role's offload: it held `before`, it holds `after`.
    pub(crate) fn offloaded(&mut self, role: &str, before: u64, after: u64) {
        self.loaded.insert(role.to_string(), before);
        self.now.insert(role.to_string(), after);
    }

    /// Records what a role that is not time-shared holds (the reward).
    pub(crate) fn holds(&mut self, role: &str, bytes: u64) {
        self.now.insert(role.to_string(), bytes);
    }

    /// Whether the role was measured at all.
    pub(crate) fn knows(&self, role: &str) -> bool {
        self.now.contains_key(role)
    }

    /// The bytes a reload of `role` needs and the bytes the other roles hold now.
    pub(crate) fn reload_need(&self, role: &str) -> (u64, u64) {
        let need = self.loaded.get(role).copied().unwrap_or(0);
        let others = self
            .now
            .iter()
            .filter(|(r, _)| r.as_str() != role)
            .map(|(_, b)| *b)
            .sum();
        (need, others)
    }

    /// Checks a reload of `role` against `budget` (0: unchecked): `Err((need,
    /// in_use))` when it does not fit.
    pub(crate) fn check_room(&self, role: &str, budget: u64) -> Result<(), (u64, u64)> {
        let (need, in_use) = self.reload_need(role);
        if budget > 0 && need.saturating_add(in_use) > budget {
            return Err((need, in_use));
        }
        Ok(())
    }

    /// Records a role's reload: it holds again what it held before its offload.
    pub(crate) fn reloaded(&mut self, role: &str) {
        let need = self.loaded.get(role).copied().unwrap_or(0);
        self.now.insert(role.to_string(), need);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_counts_what_the_other_roles_hold_against_the_budget() {
        let mut r = Residency::default();
        r.holds("reward", 10);
        r.holds("rollout", 100);
        r.offloaded("policy", 400, 0);
        // 400 + 110 fits 600 but not 500.
        assert_eq!(r.check_room("policy", 600), Ok(()));
        assert_eq!(r.check_room("policy", 500), Err((400, 110)));
        assert_eq!(r.check_room("policy", 0), Ok(()), "0 is unchecked");
        r.offloaded("rollout", 100, 20);
        assert_eq!(r.reload_need("policy"), (400, 30));
        r.reloaded("policy");
        assert_eq!(r.reload_need("rollout"), (100, 410));
        assert_eq!(r.check_room("rollout", 500), Err((100, 410)));
    }
}
