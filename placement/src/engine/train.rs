//! The controller's second half: cutting batches, training, publishing weights, and
//! the metrics each step reports to the placer.

use super::*;
use crate::staleness::within_bound;

impl<'w> Sim<'w> {
    pub(super) fn maybe_train(&mut self, step: u32) {
        if self.partial.is_some() {
            self.maybe_close(step);
            return;
        }
        let Some(st) = self.steps.get(step as usize) else {
            return;
        };
        if !st.full || st.scoring_left > 0 || st.train_left > 0 || self.trained != step {
            return;
        }
        let st = &mut self.steps[step as usize];
        st.train_tokens = st.kept_tokens;
        let batch: Vec<(u32, u32, u32)> = st.kept_pgs.iter().map(|&g| (step, g, step)).collect();
        self.trained_groups.extend(batch);
        self.start_training(step);
    }

    pub(super) fn start_training(&mut self, step: u32) {
        let epochs = f64::from(self.w.job.train_epochs.max(1));
        let tokens = self.steps[step as usize].train_tokens * epochs;
        let stages: Vec<Stage> = Stage::of_job(&self.w.job)
            .into_iter()
            .filter(|s| matches!(s, Stage::TrainActor | Stage::TrainCritic))
            .collect();
        self.steps[step as usize].train_left = stages.len() as u32;
        for stage in stages {
            self.enqueue(Task {
                stage,
                step,
                tokens,
                pg: 0,
            });
        }
    }

    /// With partial rollouts: cuts step `step`'s batch off when the trainer is ready for
    /// it and the cutoff's share of a batch is complete, unless a group that would then
    /// go beyond the staleness bound is still generating and the config says to wait
    /// for it. The last step takes every group left.
    pub(super) fn maybe_close(&mut self, step: u32) {
        let Some(pr) = self.partial else { return };
        let Some(st) = self.steps.get(step as usize) else {
            return;
        };
        if self.trained != step || st.closed {
            return;
        }
        let upto = step as usize + 1;
        let all_in = self.steps[..upto].iter().all(|s| s.full);
        if !all_in {
            if upto == self.steps.len() {
                return;
            }
            let open: u32 = self.steps[..upto].iter().map(|s| s.accepted_open).sum();
            let need = (pr.cutoff * f64::from(self.target())).ceil() as u32;
            if open < need {
                return;
            }
            let (wait, regenerate) = self.beyond_bound(step, pr.beyond_bound);
            if wait {
                return;
            }
            for (k, pg) in regenerate {
                self.regenerate(k, pg);
            }
        }
        self.close(step);
    }

    /// The unfinished groups of steps up to `step` that would train beyond the
    /// staleness bound if carried past it: whether the step must wait for one, and
    /// those to generate again.
    pub(super) fn beyond_bound(&self, step: u32, rule: BeyondBound) -> (bool, Vec<(u32, u32)>) {
        let mut regenerate = Vec::new();
        for (k, st) in self.steps[..=step as usize].iter().enumerate() {
            for (&pg, p) in &st.pgs {
                let Some(born) = p.born_min else { continue };
                // Trained at step + 1 or later, it would lag more than allowed.
                if within_bound(u64::from(step) + 1, u64::from(born), self.staleness) {
                    continue;
                }
                // A group whose responses are all generated waits for its verdicts only.
                if rule == BeyondBound::Wait || p.gen_left == 0 {
                    return (true, Vec::new());
                }
                regenerate.push((k as u32, pg));
            }
        }
        regenerate.sort_unstable();
        (false, regenerate)
    }

    /// Throws a group's responses away and generates them again, from the start, with
    /// the next weights.
    pub(super) fn regenerate(&mut self, step: u32, pg: u32) {
        let mut lost = self.discard(step, Some(pg));
        let n = self.w.workload.samples_per_prompt;
        let Some(p) = self.steps[step as usize].pgs.get_mut(&pg) else {
            return;
        };
        lost += p.gen_tokens;
        p.gen_left = n;
        p.remaining = n;
        p.born_min = None;
        p.gen_tokens = 0.0;
        self.partial_stats.stale_tokens += lost;
        self.wasted_tokens += lost;
        let group = self.w.workload.group(step, pg);
        // They wait for the next weights, as paused responses do.
        for idx in self.push_responses(step, pg, &group) {
            let key = (step, self.seqs[idx].order);
            self.queues[Kind::Gen as usize].remove(&key);
            self.park(idx);
        }
    }

    /// Cuts step `step`'s batch off: every accepted group not yet trained joins it.
    /// Groups still generating are carried into later steps. Groups that share their
    /// devices with passes pause their in-flight responses so the passes can start.
    pub(super) fn close(&mut self, step: u32) {
        let keys: Vec<(u32, u32)> = self
            .accepted
            .range(..(step + 1, 0))
            .filter(|(_, a)| a.in_batch.is_none())
            .map(|(k, _)| *k)
            .collect();
        let mut tokens = 0.0;
        let mut left = 0;
        for &(k, pg) in &keys {
            let a = self.accepted.get_mut(&(k, pg)).expect("accepted");
            a.in_batch = Some(step);
            tokens += a.tokens;
            if a.scoring_left > 0 {
                left += 1;
            }
            let lag = a.born_min.map_or(0, |b| step.saturating_sub(b));
            self.partial_stats.max_lag = self.partial_stats.max_lag.max(lag);
            if k < step {
                self.partial_stats.carried_groups += 1;
            }
            self.steps[k as usize].accepted_open -= 1;
        }
        let st = &mut self.steps[step as usize];
        st.closed = true;
        st.batch_left = left;
        st.train_tokens = tokens;
        st.batch = keys;
        self.pause_at_cutoff(step);
        if left == 0 {
            self.train_batch(step);
        }
        self.kick_all();
    }

    /// A group's scoring passes are done.
    pub(super) fn group_scored(&mut self, step: u32, pg: u32) {
        let Some(in_batch) = self.accepted.get(&(step, pg)).map(|a| a.in_batch) else {
            return;
        };
        match in_batch {
            Some(t) => {
                let st = &mut self.steps[t as usize];
                st.batch_left -= 1;
                if st.batch_left == 0 {
                    self.train_batch(t);
                }
            }
            None => self.maybe_train(self.trained),
        }
    }

    /// With partial rollouts: trains a closed batch whose groups are all scored.
    pub(super) fn train_batch(&mut self, step: u32) {
        let batch = std::mem::take(&mut self.steps[step as usize].batch);
        for (k, pg) in batch {
            self.accepted.remove(&(k, pg));
            self.trained_groups.push((k, pg, step));
        }
        self.start_training(step);
    }

    /// At a cutoff, pools that share their devices with passes stop decoding: their
    /// in-flight responses pause (KV cache to host memory, or dropped and prefilled
    /// again on resuming). With `resume = "reprefill"` the carried responses pause in
    /// every pool, to continue with the new weights.
    pub(super) fn pause_at_cutoff(&mut self, step: u32) {
        let Some(pr) = self.partial else { return };
        let keep_kv = pr.resume == Resume::Kv;
        for p in 0..self.pools.len() {
            if !self.hosts_passes(p) || !matches!(self.pools[p].phase, PoolPhase::Decode(_)) {
                continue;
            }
            for g in self.pools[p].members.clone() {
                self.advance(g);
                for idx in self.in_flight(g) {
                    self.suspend(g, idx, keep_kv);
                    self.park(idx);
                }
                self.reschedule(g);
            }
        }
        if !keep_kv {
            for g in 0..self.groups.len() {
                let carried: Vec<usize> = self
                    .in_flight(g)
                    .into_iter()
                    .filter(|&i| self.seqs[i].kind == Kind::Gen && self.seqs[i].step <= step)
                    .collect();
                if carried.is_empty() {
                    continue;
                }
                self.advance(g);
                for idx in carried {
                    self.suspend(g, idx, false);
                    self.park(idx);
                }
                self.refill(g);
                self.reschedule(g);
            }
        }
    }

    /// Whether pool `p` also runs forward or training passes (and so must stop
    /// decoding for them).
    pub(super) fn hosts_passes(&self, p: usize) -> bool {
        let roles = self.pools[p].roles;
        Stage::of_job(&self.w.job)
            .iter()
            .any(|s| !matches!(s, Stage::Gen | Stage::Judge) && roles.contains(s.role()))
    }

    /// The sequences decoding on group `g` now.
    pub(super) fn in_flight(&self, g: usize) -> Vec<usize> {
        let mut v: Vec<usize> = self.groups[g]
            .heap
            .iter()
            .map(|Reverse((_, i, gen))| (*i, *gen))
            .filter(|&(i, gen)| {
                let s = &self.seqs[i];
                s.alive && s.gen == gen && s.on == Some(g)
            })
            .map(|(i, _)| i)
            .collect();
        // The heap's order is arbitrary; keep the simulation deterministic.
        v.sort_unstable();
        v
    }

    pub(super) fn task_done(&mut self, t: Task) {
        match t.stage {
            Stage::Score => {
                let n = self.w.workload.samples_per_prompt;
                self.sample_rewarded(t.step, t.pg, n);
            }
            Stage::Ref | Stage::Values | Stage::OldLogProb if self.partial.is_some() => {
                let Some(a) = self.accepted.get_mut(&(t.step, t.pg)) else {
                    return;
                };
                a.scoring_left -= 1;
                if a.scoring_left == 0 {
                    self.group_scored(t.step, t.pg);
                }
            }
            Stage::Ref | Stage::Values | Stage::OldLogProb => {
                let st = &mut self.steps[t.step as usize];
                st.scoring_left -= 1;
                self.maybe_train(t.step);
            }
            Stage::TrainActor | Stage::TrainCritic => {
                let st = &mut self.steps[t.step as usize];
                st.train_left -= 1;
                if st.train_left == 0 {
                    self.trained_tokens += st.train_tokens;
                    self.start_sync(t.step);
                }
            }
            Stage::Gen | Stage::Judge => {}
        }
    }

    pub(super) fn start_sync(&mut self, step: u32) {
        let rp = self.role_pool.get(&Role::Rollout).copied();
        let pp = self.role_pool.get(&Role::Policy).copied();
        let w = self.w.job.policy.weight_bytes() / f64::from(self.w.group_devices);
        let local = rp == pp;
        let t = match &self.w.rates {
            Some(r) => r.sync_s + r.overhead_s,
            None if local => w / self.w.gpu.pcie_bytes_per_s + TRUE_SYNC_FIXED_S,
            None => w / self.w.gpu.net_bytes_per_s + TRUE_SYNC_FIXED_S,
        };
        self.sync_window = Some((t, local));
        if let Some(pp) = pp {
            self.pool_busy(pp, t, Busy::Sync);
        }
        if !local {
            if let Some(rp) = rp {
                for g in self.pools[rp].members.clone() {
                    self.advance(g);
                    let grp = &mut self.groups[g];
                    grp.paused_until = grp.paused_until.max(self.now) + t;
                    grp.overhead_s += t;
                    self.reschedule(g);
                }
            }
        }
        self.at(self.now + t, Ev::SyncDone { step });
    }

    pub(super) fn sync_done(&mut self, step: u32) {
        self.trained = step + 1;
        self.version = step + 1;
        self.step_done = step + 1;
        let st = &self.steps[step as usize];
        let d = f64::from(st.filtered - st.kept) / f64::from(st.filtered.max(1));
        self.drop_est = (0.5 * self.drop_est + 0.5 * d).clamp(0.0, 0.9);
        let dur = self.now - self.last_step_end;
        self.last_step_end = self.now;
        self.step_s.push(dur);
        if self.partial.is_none() {
            // Groups that finished after the batch filled, waiting for groups before
            // them, are surplus: their tokens were generated for nothing.
            let surplus: f64 = std::mem::take(&mut self.steps[step as usize].done)
                .values()
                .map(|p| p.gen_tokens)
                .sum();
            self.wasted_tokens += surplus;
            self.steps[step as usize].pgs.clear();
        }
        // Paused responses continue with the new weights.
        for (idx, gen) in std::mem::take(&mut self.paused) {
            if self.seqs[idx].alive && self.seqs[idx].paused && self.seqs[idx].gen == gen {
                self.requeue(idx);
            }
        }
        let metrics = self.take_metrics(step, dur);
        if let Some(placer) = self.placer.take() {
            let decisions = placer.on_event(Event::Metrics(metrics));
            for d in decisions {
                let Decision::Migrate(m) = d;
                self.plans.push((u64::from(step) + 1, m.target.summary()));
                self.migrate(&m.target, m.id);
            }
            self.placer = Some(placer);
        }
        if self.step_done < self.w.workload.steps {
            self.open_steps();
            // The next step can train as soon as its batch is ready.
            self.maybe_train(self.trained);
            self.kick_all();
        }
    }

    pub(super) fn take_metrics(&mut self, step: u32, dur: f64) -> StepMetrics {
        let g = self.w.group_devices;
        let mut stages = Vec::new();
        let windows = std::mem::take(&mut self.windows);
        let mut keys: Vec<_> = windows.keys().copied().collect();
        keys.sort();
        for s in keys {
            let w = &windows[&s];
            let decode = matches!(s, Stage::Gen | Stage::Judge);
            let t = self.totals.entry(s).or_default();
            t.0 += w.group_s;
            t.1 += w.tokens;
            t.2 += w.iterations;
            stages.push(StageObs {
                stage: s,
                group_s: w.group_s,
                group_devices: g,
                tokens: w.tokens,
                iterations: decode.then_some(w.iterations),
                context_tokens: decode.then_some(w.context),
                prefill_tokens: decode.then_some(w.prefill),
            });
        }
        let stat = |s: (f64, f64, f64)| {
            if s.0 < 1.0 {
                return (0.0, 0.0);
            }
            let m = s.1 / s.0;
            (m, (s.2 / s.0 - m * m).max(0.0).sqrt())
        };
        let lens = self.steps[step as usize].lens;
        let (lm, ls) = stat(lens[0]);
        let (jm, js) = stat(lens[1]);
        let (filtered, dropped) = std::mem::take(&mut self.filtered_window);
        let (switches, switch_s) = std::mem::take(&mut self.switches_window);
        let sync = self.sync_window.take();
        StepMetrics {
            step: u64::from(step),
            step_s: dur,
            stages,
            response_len_mean: if lm > 0.0 {
                (lm + ls * ls / 2.0).exp()
            } else {
                0.0
            },
            response_log_mean: lm,
            response_log_std: ls,
            prompt_len_mean: f64::from(self.w.workload.prompt_len),
            judge_log_mean: jm,
            judge_log_std: js,
            groups_filtered: filtered,
            groups_dropped: dropped,
            weight_sync_s: sync.map(|s| s.0),
            weight_sync_local: sync.is_some_and(|s| s.1),
            switches,
            switch_s,
        }
    }
}
