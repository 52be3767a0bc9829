//! Pools: groups sharing a set of roles, switching between decoding and the forward
//! and training passes, offloading the role not in use.

use super::*;

impl<'w> Sim<'w> {
    pub(super) fn kick_all(&mut self) {
        for p in 0..self.pools.len() {
            self.pool_kick(p);
        }
    }

    pub(super) fn kick_role(&mut self, role: Role) {
        if let Some(&p) = self.role_pool.get(&role) {
            self.pool_kick(p);
        }
    }

    pub(super) fn decode_kind(&self, role: Role) -> Option<Kind> {
        match role {
            Role::Rollout => Some(Kind::Gen),
            Role::Reward if matches!(self.w.job.reward, RewardKind::Generative { .. }) => {
                Some(Kind::Judge)
            }
            _ => None,
        }
    }

    pub(super) fn pool_busy(&mut self, p: usize, secs: f64, what: Busy) {
        let start = match self.pools[p].phase {
            PoolPhase::Busy { until, .. } if until > self.now => until,
            _ => self.now,
        };
        let until = start + secs;
        let pool = &mut self.pools[p];
        pool.phase = PoolPhase::Busy { until, what };
        pool.stamp += 1;
        let stamp = pool.stamp;
        for &g in &pool.members {
            let grp = &mut self.groups[g];
            match what {
                Busy::Task(_) => grp.compute_s += secs,
                Busy::Switch | Busy::Sync => grp.overhead_s += secs,
            }
        }
        self.at(until, Ev::PoolWake { p, stamp });
    }

    pub(super) fn pool_done(&mut self, p: usize) {
        let running = std::mem::take(&mut self.pools[p].running);
        self.pools[p].phase = PoolPhase::Idle;
        for t in running {
            self.task_done(t);
        }
        self.pool_kick(p);
    }

    /// Whether a pool that decodes should stop admitting and drain, so that passes it
    /// also hosts can run: when the oldest untrained step has its whole batch and
    /// waits on those passes.
    pub(super) fn should_yield(&self, p: usize) -> bool {
        let roles = self.pools[p].roles;
        let Some(oldest) = self.steps.get(self.trained as usize) else {
            return false;
        };
        let batch_cut = if self.partial.is_some() {
            oldest.closed
        } else {
            oldest.full
        };
        batch_cut
            && Stage::ALL.iter().any(|s| {
                !matches!(s, Stage::Gen | Stage::Judge)
                    && roles.contains(s.role())
                    && !self.tasks[*s as usize].is_empty()
            })
    }

    pub(super) fn has_decode_work(&self, p: usize, kind: Kind) -> bool {
        (self.admissible(kind).is_some() && !self.should_yield(p))
            || self.pools[p]
                .members
                .iter()
                .any(|&g| self.groups[g].b > 0 && self.groups[g].kind == Some(kind))
    }

    pub(super) fn pool_kick(&mut self, p: usize) {
        match self.pools[p].phase {
            PoolPhase::Busy { until, .. } if until > self.now => return,
            PoolPhase::Busy { .. } => self.pools[p].phase = PoolPhase::Idle,
            PoolPhase::Decode(kind) => {
                if self.has_decode_work(p, kind) {
                    self.feed_hungry(kind);
                    return;
                }
                for g in self.pools[p].members.clone() {
                    self.groups[g].kind = None;
                }
                self.pools[p].phase = PoolPhase::Idle;
            }
            PoolPhase::Idle => {}
        }
        if self.pools[p].members.is_empty() {
            return;
        }
        // Pick the next role with work, latest pipeline stage first (it unblocks the
        // step soonest); decoding comes last.
        let roles = self.pools[p].roles;
        let mut choice: Option<(Role, Option<Stage>)> = None;
        // Stay with the loaded role while it has passes queued: switching costs copies.
        if let Some(loaded) = self.pools[p].loaded {
            for stage in Stage::ALL {
                if stage.role() == loaded
                    && !matches!(stage, Stage::Gen | Stage::Judge)
                    && roles.contains(loaded)
                    && !self.tasks[stage as usize].is_empty()
                {
                    choice = Some((loaded, Some(stage)));
                    break;
                }
            }
        }
        for stage in [
            Stage::TrainActor,
            Stage::TrainCritic,
            Stage::OldLogProb,
            Stage::Values,
            Stage::Ref,
            Stage::Score,
        ] {
            if choice.is_some() {
                break;
            }
            if roles.contains(stage.role()) && !self.tasks[stage as usize].is_empty() {
                choice = Some((stage.role(), Some(stage)));
                break;
            }
        }
        if choice.is_none() {
            for role in [Role::Reward, Role::Rollout] {
                if let Some(kind) = self.decode_kind(role) {
                    if roles.contains(role) && self.admissible(kind).is_some() {
                        choice = Some((role, None));
                        break;
                    }
                }
            }
        }
        let Some((role, stage)) = choice else { return };
        let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
        let offload = crate::plan::needs_offload(
            &self.w.job,
            roles,
            self.w.group_devices,
            devices,
            self.w.gpu.memory_bytes,
        );
        if !offload {
            self.pools[p].loaded = Some(role);
        }
        if self.pools[p].loaded != Some(role) {
            let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
            let out = self.pools[p]
                .loaded
                .and_then(|r| self.w.job.memory(r))
                .map(|m| m.resident_per_device(self.w.group_devices, devices))
                .unwrap_or(0.0);
            let inn = self
                .w
                .job
                .memory(role)
                .map(|m| m.resident_per_device(self.w.group_devices, devices))
                .unwrap_or(0.0);
            let t = match &self.w.rates {
                Some(r) => r.switch_s,
                None => (out + inn) / self.w.gpu.pcie_bytes_per_s + TRUE_SWITCH_FIXED_S,
            };
            self.pools[p].loaded = Some(role);
            self.switches_window.0 += 1;
            self.switches_window.1 += t;
            self.pool_busy(p, t, Busy::Switch);
            return;
        }
        match stage {
            Some(stage) => self.run_tasks(p, stage),
            None => {
                let kind = self.decode_kind(role).expect("decoding role");
                self.pools[p].phase = PoolPhase::Decode(kind);
                for g in self.pools[p].members.clone() {
                    self.start_decoding(g, kind);
                    self.refill(g);
                    self.reschedule(g);
                }
            }
        }
    }

    pub(super) fn start_decoding(&mut self, g: usize, kind: Kind) {
        self.advance(g);
        let grp = &mut self.groups[g];
        grp.kind = Some(kind);
        grp.coeffs = self.coeffs[kind as usize];
    }

    /// Gives queued work to the groups that ran out of it (nobody else has free slots:
    /// refilling drains the queue into every free slot it meets).
    pub(super) fn feed_hungry(&mut self, kind: Kind) {
        if self.admissible(kind).is_none() {
            return;
        }
        let hungry = std::mem::take(&mut self.hungry[kind as usize]);
        for g in hungry {
            self.groups[g].hungry[kind as usize] = false;
            if self.groups[g].kind != Some(kind) {
                continue;
            }
            self.advance(g);
            self.refill(g);
            self.reschedule(g);
        }
    }

    pub(super) fn run_tasks(&mut self, p: usize, stage: Stage) {
        // Train one step at a time; scoring passes take everything queued as one batch.
        let q = &mut self.tasks[stage as usize];
        let tasks: Vec<Task> = if matches!(stage, Stage::TrainActor | Stage::TrainCritic) {
            q.pop_front().into_iter().collect()
        } else {
            q.drain(..).collect()
        };
        let tokens: f64 = tasks.iter().map(|t| t.tokens).sum();
        let devices = self.pools[p].members.len() as u32 * self.w.group_devices;
        let mut secs = tokens * self.s_per_token[&stage] / f64::from(devices);
        if matches!(stage, Stage::TrainActor | Stage::TrainCritic) {
            // ZeRO-3 over the pool, as the live trainer runs it (exposed: no prefetch).
            // Each micro-batch gathers the weights twice and reduce-scatters the
            // gradient; the simulator has no micro-batch size, so it charges the fewest
            // the trainer can run, one per rank per epoch.
            let model = self
                .w
                .job
                .model(stage.role())
                .expect("trained role has a model");
            secs = ShardedStep::of_model(model, devices, self.w.gpu.net_bytes_per_s)
                .predict(RankWork {
                    tokens: tokens / f64::from(devices),
                    micro_batches: f64::from(self.w.job.train_epochs.max(1)),
                    s_per_token: self.s_per_token[&stage],
                    // FLOP-bound on a GPU: the stage's rate is all of it.
                    ..RankWork::default()
                })
                .step_s;
            if std::mem::take(&mut self.pools[p].reshard) {
                let state = self.w.job.memory(stage.role()).expect("memory profile");
                secs += state.resident_per_device(self.w.group_devices, devices)
                    / self.w.gpu.net_bytes_per_s;
            }
        }
        let w = self.windows.entry(stage).or_default();
        w.group_s += secs * self.pools[p].members.len() as f64;
        w.tokens += tokens;
        self.pools[p].running = tasks;
        self.pool_busy(p, secs, Busy::Task(stage));
    }
}
