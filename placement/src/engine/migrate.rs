//! Migrations: groups leave their pool (their work evicted and requeued), restart in
//! the gaining role, and join it.

use super::*;

impl<'w> Sim<'w> {
    pub(super) fn migrate(&mut self, target: &Plan, id: u64) {
        self.migrations += 1;
        self.rollout_cap = target.rollout_batch_cap;
        self.set_lanes(target);
        let mut pending = 0;
        // Pools of the target, reusing pools with the same roles.
        let mut pool_of_roles: HashMap<RoleSet, usize> = HashMap::new();
        for (i, p) in self.pools.iter().enumerate() {
            if !p.roles.is_empty() {
                pool_of_roles.insert(p.roles, i);
            }
        }
        let mut keep: Vec<bool> = vec![false; self.pools.len()];
        for pool in &target.pools {
            let idx = match pool_of_roles.get(&pool.roles) {
                Some(&i) => i,
                None => {
                    self.pools.push(PoolState {
                        roles: pool.roles,
                        members: Vec::new(),
                        phase: PoolPhase::Idle,
                        loaded: pool.roles.iter().next(),
                        stamp: 0,
                        reshard: false,
                        running: Vec::new(),
                    });
                    keep.push(false);
                    self.pools.len() - 1
                }
            };
            keep[idx] = true;
            for r in pool.roles.iter() {
                self.role_pool.insert(r, idx);
            }
        }
        for (i, k) in keep.iter().enumerate() {
            if !k {
                self.pools[i].roles = RoleSet::EMPTY;
            }
        }
        for pool in &target.pools {
            let dest = self.role_pool[&pool.roles.iter().next().expect("roles")];
            for gid in &pool.groups {
                let g = gid.0 as usize;
                if self.groups[g].pool == Some(dest) {
                    continue;
                }
                let leave_at = self.evict(g);
                let devices = pool.groups.len() as u32 * self.w.group_devices;
                let load: f64 = pool
                    .roles
                    .iter()
                    .filter_map(|r| {
                        let m = self.w.job.memory(r)?;
                        let start = if self.decode_kind(r).is_some() {
                            TRUE_START_DECODER_S
                        } else {
                            TRUE_START_OTHER_S
                        };
                        let per = m.resident_per_device(self.w.group_devices, devices);
                        Some(per / self.w.gpu.net_bytes_per_s + start)
                    })
                    .sum();
                self.groups[g].overhead_s += load;
                if pool.roles.iter().any(|r| {
                    self.w
                        .job
                        .memory(r)
                        .is_some_and(|m| m.sharding == Sharding::Pool)
                }) {
                    self.pools[dest].reshard = true;
                }
                pending += 1;
                self.at(
                    leave_at + load,
                    Ev::GroupJoin {
                        g,
                        p: dest,
                        migration: id,
                    },
                );
            }
        }
        if pending == 0 {
            self.finish_migration(id);
        } else {
            self.migration = Some((id, pending));
        }
        self.kick_all();
    }

    /// Takes a group out of its pool; returns when it is free. In-flight sequences are
    /// aborted and requeued; a pool pass in progress finishes first.
    pub(super) fn evict(&mut self, g: usize) -> f64 {
        let Some(p) = self.groups[g].pool.take() else {
            return self.now;
        };
        self.advance(g);
        let live: Vec<(usize, u32)> = std::iter::from_fn({
            let heap = &mut self.groups[g].heap;
            move || heap.pop().map(|Reverse((_, i, gen))| (i, gen))
        })
        .collect();
        for (idx, gen) in live {
            if self.seqs[idx].alive && self.seqs[idx].gen == gen && self.seqs[idx].on == Some(g) {
                if self.partial.is_some() {
                    // Partial rollouts keep what it generated; the cache is lost with
                    // the group, so it is prefilled again wherever it resumes.
                    self.suspend(g, idx, false);
                } else {
                    let done = self.groups[g].iter - self.seqs[idx].start_iter;
                    self.wasted_tokens += done;
                    self.remove_from_group(g, idx);
                    // A response a lane took in keeps its earlier tokens, but its
                    // cache is lost with the group.
                    let s = &mut self.seqs[idx];
                    s.gen = s.gen.wrapping_add(1);
                    if s.done > 0 {
                        s.prefill = s.ctx0;
                        s.restore_s = 0.0;
                    }
                }
                self.requeue(idx);
            }
        }
        let grp = &mut self.groups[g];
        grp.kind = None;
        grp.debt = 0.0;
        grp.stamp += 1;
        let pool = &mut self.pools[p];
        pool.members.retain(|&x| x != g);
        if pool.roles.iter().any(|r| {
            self.w
                .job
                .memory(r)
                .is_some_and(|m| m.sharding == Sharding::Pool)
        }) {
            pool.reshard = true;
        }
        match pool.phase {
            PoolPhase::Busy { until, .. } if until > self.now => until,
            _ => self.now,
        }
    }

    pub(super) fn group_join(&mut self, g: usize, p: usize, migration: u64) {
        self.groups[g].pool = Some(p);
        self.groups[g].last = self.now;
        self.pools[p].members.push(g);
        // A pool that is decoding takes the newcomer into its batch at once (a pool in
        // a pass uses it from its next pass).
        if let PoolPhase::Decode(kind) = self.pools[p].phase {
            self.start_decoding(g, kind);
            self.refill(g);
            self.reschedule(g);
        }
        if let Some((id, left)) = self.migration {
            if id == migration {
                if left <= 1 {
                    self.migration = None;
                    self.finish_migration(id);
                } else {
                    self.migration = Some((id, left - 1));
                }
            }
        }
        self.pool_kick(p);
        self.kick_all();
    }

    pub(super) fn finish_migration(&mut self, id: u64) {
        if let Some(placer) = self.placer.as_mut() {
            let _ = placer.on_event(Event::MigrationDone { id });
        }
    }
}
