//! The controller's first half: issuing each step's prompt groups, the life of their
//! responses (queued, decoding, paused, carried), and filtering and accepting groups
//! in issue order (dynamic sampling, partial rollouts).

use super::*;

impl<'w> Sim<'w> {
    pub(super) fn target(&self) -> u32 {
        self.w.workload.prompts_per_step
    }

    pub(super) fn open_steps(&mut self) {
        let last = (self.version + self.lookahead).min(self.w.workload.steps - 1);
        for k in 0..=last {
            if !self.steps[k as usize].opened {
                self.steps[k as usize].opened = true;
                let want = (f64::from(self.target()) / (1.0 - self.drop_est)).ceil() as u32;
                self.issue(k, want);
            }
        }
    }

    pub(super) fn issue(&mut self, step: u32, count: u32) {
        let n = self.w.workload.samples_per_prompt;
        for _ in 0..count {
            let st = &mut self.steps[step as usize];
            let i = st.issued;
            st.issued += 1;
            let pg = self.w.workload.group(step, i);
            let tokens = pg
                .lengths
                .iter()
                .map(|l| f64::from(pg.prompt_len + l))
                .sum();
            self.steps[step as usize].pgs.insert(
                i,
                PgState {
                    gen_left: n,
                    remaining: n,
                    keep: pg.keep,
                    tokens,
                    lengths: pg.lengths.clone(),
                    born_min: None,
                    gen_tokens: 0.0,
                },
            );
            self.push_responses(step, i, &pg);
        }
    }

    /// Queues a prompt group's responses; returns their slots.
    pub(super) fn push_responses(
        &mut self,
        step: u32,
        index: u32,
        pg: &crate::workload::PromptGroup,
    ) -> Vec<usize> {
        pg.lengths
            .iter()
            .enumerate()
            .map(|(s, &len)| {
                let judge_len = pg.judge.get(s).copied().unwrap_or(0);
                self.push_seq(Seq::new(
                    step,
                    index,
                    Kind::Gen,
                    pg.prompt_len,
                    len,
                    judge_len,
                ))
            })
            .collect()
    }

    /// Queues a sequence; returns its slot.
    pub(super) fn push_seq(&mut self, mut s: Seq) -> usize {
        self.counter += 1;
        s.order = self.counter;
        let q = s.kind as usize;
        let key = (s.step, s.order);
        let idx = match self.free.pop() {
            Some(i) => {
                s.gen = self.seqs[i].gen.wrapping_add(1);
                self.seqs[i] = s;
                i
            }
            None => {
                self.seqs.push(s);
                self.seqs.len() - 1
            }
        };
        self.queues[q].insert(key, idx);
        idx
    }

    /// Returns a finished sequence's slot to the slab; its generation changes, so heap
    /// entries that still name it are recognised as stale.
    pub(super) fn release(&mut self, idx: usize) {
        let s = &mut self.seqs[idx];
        s.alive = false;
        s.on = None;
        s.paused = false;
        s.gen = s.gen.wrapping_add(1);
        self.free.push(idx);
    }

    pub(super) fn requeue(&mut self, idx: usize) {
        let s = &mut self.seqs[idx];
        s.on = None;
        s.paused = false;
        let key = (s.step, s.order);
        self.queues[s.kind as usize].insert(key, idx);
    }

    /// Takes an in-flight sequence off group `g` (advanced to now) keeping what it
    /// generated, as a partial rollout pauses it. It resumes from its KV cache copied
    /// to host memory and back (`keep_kv`), or by prefilling its prompt and tokens
    /// again. The caller queues it again or parks it in `paused`.
    pub(super) fn suspend(&mut self, g: usize, idx: usize, keep_kv: bool) {
        let carry = if keep_kv {
            Carry::HostKv
        } else {
            Carry::Reprefill
        };
        self.take_off(g, idx, carry, 0.0);
    }

    /// Takes an in-flight sequence off group `g` (advanced to now) keeping what it
    /// generated; `carry` says what its next admission costs. `slack` (iterations)
    /// keeps a response stopped exactly at a token boundary (a lane threshold) from
    /// losing that token to rounding.
    pub(super) fn take_off(&mut self, g: usize, idx: usize, carry: Carry, slack: f64) {
        let progress = (self.groups[g].iter - self.seqs[idx].start_iter + slack).max(0.0);
        self.remove_from_group(g, idx);
        let model = match self.seqs[idx].kind {
            Kind::Gen => &self.w.job.policy,
            Kind::Judge => self.w.job.model(Role::Reward).unwrap_or(&self.w.job.policy),
        };
        let kv_bytes = model.kv_bytes_per_token();
        let devices = f64::from(self.w.group_devices);
        let s = &mut self.seqs[idx];
        // A response that is paused has at least one token left, or it would have
        // finished.
        let tokens = (progress.floor() as u32).min(s.len.saturating_sub(1));
        s.done += tokens;
        s.ctx0 += tokens;
        s.len -= tokens;
        // Its heap entry names the old generation and is skipped when it surfaces.
        s.gen = s.gen.wrapping_add(1);
        s.checkpoint = false;
        match carry {
            Carry::HostKv => {
                s.prefill = 0;
                // Out to host memory and back in.
                s.restore_s =
                    2.0 * kv_bytes * f64::from(s.ctx0) / (devices * self.w.gpu.pcie_bytes_per_s);
            }
            Carry::NetKv => {
                // Each device sends its shard of the cache to its peer in the lane.
                s.prefill = 0;
                s.restore_s = kv_bytes * f64::from(s.ctx0) / (devices * self.w.gpu.net_bytes_per_s);
            }
            Carry::Reprefill => {
                s.prefill = s.ctx0;
                s.restore_s = 0.0;
            }
        }
    }

    /// Parks a suspended sequence until the next weights are in.
    pub(super) fn park(&mut self, idx: usize) {
        self.seqs[idx].paused = true;
        self.paused.push((idx, self.seqs[idx].gen));
    }

    pub(super) fn admissible(&self, kind: Kind) -> Option<usize> {
        let (&(step, _), &idx) = self.queues[kind as usize].iter().next()?;
        // Gen: the weights must be recent enough for the step; judging has no bound.
        (kind == Kind::Judge || step <= self.version + self.lookahead).then_some(idx)
    }

    pub(super) fn seq_done(&mut self, idx: usize) {
        let s = self.seqs[idx].clone();
        self.release(idx);
        let len = s.total_len();
        if self.steps[s.step as usize].full {
            self.wasted_tokens += f64::from(len);
            return;
        }
        let l = f64::from(len.max(1)).ln();
        let st = &mut self.steps[s.step as usize].lens[s.kind as usize];
        st.0 += 1.0;
        st.1 += l;
        st.2 += l * l;
        match s.kind {
            Kind::Gen => {
                let st = &mut self.steps[s.step as usize];
                let Some(p) = st.pgs.get_mut(&s.pg) else {
                    return;
                };
                p.gen_left -= 1;
                p.gen_tokens += f64::from(len);
                let all_generated = p.gen_left == 0;
                match &self.w.job.reward {
                    RewardKind::Generative { .. } => {
                        // The judge reads the prompt and the whole response.
                        let ctx0 = s.ctx0 + s.len + self.w.workload.judge_prompt;
                        let judge = s.judge_len.max(1);
                        self.push_seq(Seq::new(
                            s.step,
                            s.pg,
                            Kind::Judge,
                            ctx0,
                            judge,
                            s.judge_len,
                        ));
                        self.kick_role(Role::Reward);
                    }
                    RewardKind::Rule => self.sample_rewarded(s.step, s.pg, 1),
                    RewardKind::Scalar { .. } => {
                        // The scalar model scores a prompt group once all of it is
                        // generated.
                        if all_generated {
                            let tokens = self.steps[s.step as usize].pgs[&s.pg].tokens;
                            self.enqueue(Task {
                                stage: Stage::Score,
                                step: s.step,
                                tokens,
                                pg: s.pg,
                            });
                        }
                    }
                }
            }
            Kind::Judge => self.sample_rewarded(s.step, s.pg, 1),
        }
    }

    pub(super) fn sample_rewarded(&mut self, step: u32, pg: u32, n: u32) {
        let st = &mut self.steps[step as usize];
        let Some(p) = st.pgs.get_mut(&pg) else { return };
        p.remaining -= n;
        if p.remaining == 0 {
            let p = st.pgs.remove(&pg).expect("present");
            if self.partial.is_some() {
                self.filter_partial(step, pg, p);
            } else {
                self.filter(step, pg, p);
            }
        }
    }

    /// A prompt group has all its rewards. Groups are accepted in issue order, as a
    /// dataloader hands them out: a group that finishes early waits for the ones
    /// before it. So every placement trains on the same groups, whatever order they
    /// finish in, and no placement favours short responses by keeping whatever
    /// finishes first.
    pub(super) fn filter(&mut self, step: u32, pg: u32, p: PgState) {
        let st = &mut self.steps[step as usize];
        if st.full {
            self.wasted_tokens += p.lengths.iter().map(|l| f64::from(*l)).sum::<f64>();
            return;
        }
        st.done.insert(pg, p);
        loop {
            let st = &mut self.steps[step as usize];
            if st.full {
                break;
            }
            let next = st.next;
            let Some(p) = st.done.remove(&next) else {
                break;
            };
            st.next += 1;
            self.accept(step, next, p);
        }
    }

    /// Counts a group the dynamic-sampling filter has seen.
    pub(super) fn count_filtered(&mut self, step: u32, keep: bool) {
        let st = &mut self.steps[step as usize];
        st.filtered += 1;
        self.filtered_window.0 += 1;
        if keep {
            st.kept += 1;
        } else {
            self.filtered_window.1 += 1;
        }
    }

    pub(super) fn accept(&mut self, step: u32, pg: u32, p: PgState) {
        let target = self.target();
        self.count_filtered(step, p.keep);
        if p.keep {
            let st = &mut self.steps[step as usize];
            st.kept_tokens += p.tokens;
            st.kept_pgs.push(pg);
            let lag = p.born_min.map_or(0, |b| step.saturating_sub(b));
            self.partial_stats.max_lag = self.partial_stats.max_lag.max(lag);
            let stages = self.scoring_stages();
            let st = &mut self.steps[step as usize];
            st.scoring_left += stages.len() as u32;
            for stage in stages {
                self.enqueue(Task {
                    stage,
                    step,
                    tokens: p.tokens,
                    pg: 0,
                });
            }
        }
        let st = &mut self.steps[step as usize];
        if st.kept >= target {
            st.full = true;
            self.abort_step(step);
            self.maybe_train(step);
            return;
        }
        self.top_up(step);
    }

    /// With partial rollouts a group is accepted as soon as it has its rewards, while
    /// groups before it may still be generating: the step can train without them. Its
    /// batch is still made of its first `prompts_per_step` kept groups in issue order
    /// (`batch_end`), so every placement trains the same groups, only not always in
    /// the same step; the controller learns that a group is kept only from its
    /// rewards.
    pub(super) fn filter_partial(&mut self, step: u32, pg: u32, p: PgState) {
        if self.steps[step as usize].full {
            self.wasted_tokens += p.gen_tokens;
            return;
        }
        self.count_filtered(step, p.keep);
        if p.keep {
            if pg < self.batch_end[step as usize] {
                self.accept_partial(step, pg, p);
            } else {
                // Kept, but the step's batch is made of groups issued before it.
                self.wasted_tokens += p.gen_tokens;
            }
        }
        if !self.steps[step as usize].full {
            self.top_up(step);
        }
    }

    pub(super) fn accept_partial(&mut self, step: u32, pg: u32, p: PgState) {
        let stages = self.scoring_stages();
        let st = &mut self.steps[step as usize];
        st.kept_pgs.push(pg);
        st.accepted_open += 1;
        let full = st.kept_pgs.len() as u32 >= self.w.workload.prompts_per_step;
        self.accepted.insert(
            (step, pg),
            Accepted {
                tokens: p.tokens,
                scoring_left: stages.len() as u32,
                born_min: p.born_min,
                in_batch: None,
            },
        );
        let scored = stages.is_empty();
        for stage in stages {
            self.enqueue(Task {
                stage,
                step,
                tokens: p.tokens,
                pg,
            });
        }
        if full {
            self.steps[step as usize].full = true;
            self.abort_step(step);
        }
        if scored {
            self.group_scored(step, pg);
        } else {
            self.maybe_train(self.trained);
        }
    }

    pub(super) fn scoring_stages(&self) -> Vec<Stage> {
        Stage::of_job(&self.w.job)
            .into_iter()
            .filter(|s| matches!(s, Stage::Ref | Stage::Values | Stage::OldLogProb))
            .collect()
    }

    /// Issues prompts while the expected keepers fall short of the batch.
    pub(super) fn top_up(&mut self, step: u32) {
        let target = self.target();
        let st = &self.steps[step as usize];
        let pending = f64::from(st.issued - st.filtered);
        let observed = f64::from(st.filtered - st.kept) / f64::from(st.filtered.max(1));
        let d = if st.filtered >= 8 {
            observed
        } else {
            self.drop_est
        }
        .clamp(0.0, 0.9);
        let expect = f64::from(st.kept) + pending * (1.0 - d);
        if expect < f64::from(target) {
            let more = ((f64::from(target) - expect) / (1.0 - d)).ceil() as u32;
            self.issue(step, more.max(1));
            self.kick_role(Role::Rollout);
        }
    }

    pub(super) fn abort_step(&mut self, step: u32) {
        let lost = self.discard(step, None);
        self.wasted_tokens += lost;
    }

    /// Throws away the queued, paused and in-flight sequences of `step` (of its prompt
    /// group `pg` only, when given); returns the tokens they had generated.
    pub(super) fn discard(&mut self, step: u32, pg: Option<u32>) -> f64 {
        let mut lost = 0.0;
        for q in 0..2 {
            let keys: Vec<(u32, u64)> = self.queues[q]
                .range((step, 0)..(step + 1, 0))
                .filter(|&(_, &i)| pg.is_none_or(|x| self.seqs[i].pg == x))
                .map(|(k, _)| *k)
                .collect();
            for k in keys {
                let idx = self.queues[q].remove(&k).expect("present");
                lost += f64::from(self.seqs[idx].done);
                self.release(idx);
            }
        }
        // In-flight sequences stop where they are; their tokens are lost.
        let live: Vec<usize> = (0..self.seqs.len())
            .filter(|&i| {
                let s = &self.seqs[i];
                s.alive
                    && s.step == step
                    && pg.is_none_or(|x| s.pg == x)
                    && (s.on.is_some() || s.paused)
            })
            .collect();
        for idx in live {
            lost += f64::from(self.seqs[idx].done);
            let Some(g) = self.seqs[idx].on else {
                self.release(idx);
                continue;
            };
            self.advance(g);
            lost += self.groups[g].iter - self.seqs[idx].start_iter;
            self.remove_from_group(g, idx);
            self.release(idx);
            self.refill(g);
            self.reschedule(g);
        }
        lost
    }
}
