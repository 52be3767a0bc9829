//! Decoding groups: continuous batching, each group's next finishing sequence on a
//! heap, admitting queued sequences as slots free up.

use super::*;

impl<'w> Sim<'w> {
    pub(super) fn enqueue(&mut self, t: Task) {
        self.tasks[t.stage as usize].push_back(t);
        self.kick_role(t.stage.role());
    }

    pub(super) fn advance(&mut self, g: usize) {
        let now = self.now;
        let grp = &mut self.groups[g];
        let start = grp.last.max(grp.paused_until);
        if now > start && (grp.b > 0 || grp.debt > 0.0) {
            let mut dt = now - start;
            grp.compute_s += dt;
            let stage = match grp.kind {
                Some(Kind::Judge) => Stage::Judge,
                _ => Stage::Gen,
            };
            let win = self.windows.entry(stage).or_default();
            win.group_s += dt;
            let pay = grp.debt.min(dt);
            grp.debt -= pay;
            dt -= pay;
            if grp.b > 0 && dt > 0.0 {
                let b = f64::from(grp.b);
                let ctx = grp.p_sum + b * grp.iter - grp.s_sum;
                let t_it = grp.coeffs.iteration(b, ctx);
                let iters = dt / t_it;
                win.iterations += iters;
                win.tokens += iters * b;
                win.context += iters * ctx;
                self.generated_tokens += iters * b;
                grp.iter += iters;
            }
        }
        if now > grp.last {
            grp.last = now;
        }
    }

    pub(super) fn reschedule(&mut self, g: usize) {
        let grp = &mut self.groups[g];
        grp.stamp += 1;
        let Some(Reverse((OrdF64(fin), _, _))) = grp.heap.peek().copied() else {
            return;
        };
        let b = f64::from(grp.b);
        let ctx = grp.p_sum + b * grp.iter - grp.s_sum;
        let t_it = grp.coeffs.iteration(b, ctx);
        let start = self.now.max(grp.paused_until).max(grp.last);
        let t = start + grp.debt + (fin - grp.iter).max(0.0) * t_it;
        let stamp = grp.stamp;
        self.at(t, Ev::GroupWake { g, stamp });
    }

    pub(super) fn remove_from_group(&mut self, g: usize, idx: usize) {
        let s = &mut self.seqs[idx];
        s.on = None;
        let grp = &mut self.groups[g];
        grp.b -= 1;
        grp.p_sum -= f64::from(s.ctx0);
        grp.s_sum -= s.start_iter;
        // The heap entry stays; it is skipped when it surfaces (lazy deletion).
    }

    pub(super) fn group_wake(&mut self, g: usize) {
        self.advance(g);
        while let Some(Reverse((OrdF64(fin), idx, gen))) = self.groups[g].heap.peek().copied() {
            let s = &self.seqs[idx];
            if !s.alive || s.gen != gen || s.on != Some(g) {
                self.groups[g].heap.pop();
                continue;
            }
            if fin > self.groups[g].iter + 1e-6 {
                break;
            }
            self.groups[g].heap.pop();
            if self.seqs[idx].checkpoint {
                self.crossed(g, idx);
                continue;
            }
            self.remove_from_group(g, idx);
            self.seq_done(idx);
        }
        self.refill(g);
        self.reschedule(g);
        if self.groups[g].b == 0 {
            if let Some(p) = self.groups[g].pool {
                self.pool_kick(p);
            }
        }
    }

    pub(super) fn refill(&mut self, g: usize) {
        let Some(kind) = self.groups[g].kind else {
            return;
        };
        if self.groups[g].lane {
            self.refill_lane(g);
            return;
        }
        if self.groups[g]
            .pool
            .is_some_and(|p| self.pools[p].roles.len() > 1 && self.should_yield(p))
        {
            return;
        }
        loop {
            let Some(idx) = self.admissible(kind) else {
                // Out of work with free slots: wake this group when work arrives.
                if !self.groups[g].hungry[kind as usize] {
                    self.groups[g].hungry[kind as usize] = true;
                    self.hungry[kind as usize].push(g);
                }
                break;
            };
            let step = self.seqs[idx].step as usize;
            let mut slots =
                self.slots[kind as usize][step.min(self.slots[kind as usize].len() - 1)];
            if let (Kind::Gen, Some(cap)) = (kind, self.rollout_cap) {
                slots = slots.min(cap.max(1));
            }
            if self.groups[g].b >= slots {
                break;
            }
            let key = (self.seqs[idx].step, self.seqs[idx].order);
            self.queues[kind as usize].remove(&key);
            // A response resuming past the lane threshold goes straight to a lane.
            if let (Some(l), Some(lane)) = (self.lanes, self.lane_with_room()) {
                if kind == Kind::Gen && self.seqs[idx].done >= l.threshold {
                    self.advance(lane);
                    self.admit(lane, idx, kind);
                    self.reschedule(lane);
                    continue;
                }
            }
            self.admit(g, idx, kind);
        }
    }

    /// Starts sequence `idx` (off the queues) on group `g`, paying its prefill or
    /// cache restore. On an ordinary rollout group a response that will pass the lane
    /// threshold gets a checkpoint there instead of its end.
    pub(super) fn admit(&mut self, g: usize, idx: usize, kind: Kind) {
        {
            let threshold = match self.lanes {
                Some(l) if kind == Kind::Gen && !self.groups[g].lane => Some(l.threshold),
                _ => None,
            };
            let version = self.version;
            let grp = &mut self.groups[g];
            let s = &mut self.seqs[idx];
            s.on = Some(g);
            s.start_iter = grp.iter;
            grp.b += 1;
            grp.p_sum += f64::from(s.ctx0);
            grp.s_sum += s.start_iter;
            grp.debt += f64::from(s.prefill) * grp.coeffs.prefill + s.restore_s;
            let mut run = s.len;
            s.checkpoint = false;
            if let Some(t) = threshold {
                let to_lane = t.saturating_sub(s.done).max(1);
                if to_lane < s.len {
                    run = to_lane;
                    s.checkpoint = true;
                }
            }
            grp.heap
                .push(Reverse((OrdF64(grp.iter + f64::from(run)), idx, s.gen)));
            let prefill = f64::from(s.prefill);
            if s.done > 0 {
                self.partial_stats.reprefill_tokens += prefill;
            }
            let first_start = kind == Kind::Gen && s.born.is_none();
            if first_start {
                s.born = Some(version);
            }
            let (step, pg) = (s.step, s.pg);
            if first_start {
                if let Some(p) = self.steps[step as usize].pgs.get_mut(&pg) {
                    p.born_min = Some(p.born_min.map_or(version, |b| b.min(version)));
                }
            }
            let stage = if kind == Kind::Gen {
                Stage::Gen
            } else {
                Stage::Judge
            };
            self.windows.entry(stage).or_default().prefill += prefill;
        }
    }
}
