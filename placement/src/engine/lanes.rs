//! Straggler lanes: rollout groups that decode only responses that outgrew the lane
//! threshold, moved over from the ordinary groups.

use super::*;

impl<'w> Sim<'w> {
    /// Takes the lanes of `plan`: its lane groups decode only moved responses.
    pub(super) fn set_lanes(&mut self, plan: &Plan) {
        self.lanes = plan.lanes;
        for grp in &mut self.groups {
            grp.lane = false;
        }
        for g in plan.lane_groups() {
            self.groups[g.0 as usize].lane = true;
        }
    }

    /// The decoding lane with the most room (the first such in id order), if any.
    pub(super) fn lane_with_room(&self) -> Option<usize> {
        let l = self.lanes?;
        self.groups
            .iter()
            .enumerate()
            .filter(|(_, grp)| {
                grp.lane && grp.kind == Some(Kind::Gen) && grp.pool.is_some() && grp.b < l.batch
            })
            .min_by_key(|(i, grp)| (grp.b, *i))
            .map(|(i, _)| i)
    }

    /// Response `idx` on ordinary group `g` (advanced to now) reached the lane
    /// threshold: it moves to a lane with room, or goes on where it is and waits for
    /// one.
    pub(super) fn crossed(&mut self, g: usize, idx: usize) {
        self.seqs[idx].checkpoint = false;
        if !self.groups[g].lane && self.lanes.is_some() {
            if let Some(lane) = self.lane_with_room() {
                self.move_to_lane(g, idx, lane);
                return;
            }
            let s = &self.seqs[idx];
            self.lane_wait.insert((s.step, s.order), (idx, s.gen));
        }
        let s = &self.seqs[idx];
        let end = s.start_iter + f64::from(s.len);
        self.groups[g].heap.push(Reverse((OrdF64(end), idx, s.gen)));
    }

    /// Moves response `idx` from group `g` (advanced to now) to `lane`: it brings its
    /// KV cache over the interconnect, or prefills it again with `resume =
    /// "reprefill"`. The caller refills and reschedules `g`.
    pub(super) fn move_to_lane(&mut self, g: usize, idx: usize, lane: usize) {
        let carry = match self.partial.map(|p| p.resume) {
            Some(Resume::Reprefill) => Carry::Reprefill,
            _ => Carry::NetKv,
        };
        self.take_off(g, idx, carry, 1e-6);
        self.advance(lane);
        let s = &self.seqs[idx];
        self.lane_transfer_s +=
            f64::from(s.prefill) * self.groups[lane].coeffs.prefill + s.restore_s;
        self.lane_moves += 1;
        self.admit(lane, idx, Kind::Gen);
        self.reschedule(lane);
    }

    /// Fills a lane's free room with the responses waiting for one, oldest step first.
    pub(super) fn refill_lane(&mut self, lane: usize) {
        let Some(l) = self.lanes else { return };
        while self.groups[lane].b < l.batch && self.groups[lane].kind == Some(Kind::Gen) {
            let Some((_, (idx, gen))) = self.lane_wait.pop_first() else {
                break;
            };
            let s = &self.seqs[idx];
            let Some(g) =
                s.on.filter(|&g| s.alive && s.gen == gen && !self.groups[g].lane)
            else {
                continue;
            };
            self.advance(g);
            self.move_to_lane(g, idx, lane);
            self.refill(g);
            self.reschedule(g);
        }
    }
}
