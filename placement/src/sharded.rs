//! One rank's step of ZeRO-3 sharded training, as the live trainer runs it
//! (`yatt_engine::ShardedTrainer`), for the simulator and for `yatt bench sharded`.
//!
//! Per micro-batch a rank all-gathers every unit's weights for the forward pass, each
//! decoder layer again for its recompute in backward, and reduce-scatters every unit's
//! gradient. The embeddings and the head are gathered once: the lookup's gradient needs
//! no weights, and the head runs forward and backward at once. Over a ring each
//! collective moves (N−1)/N of the unit's padded buffer through every rank's link, so a
//! rank moves about 3·(N−1)/N·Ψ·b per micro-batch whatever N is, and the time is those
//! bytes over one link's bandwidth: adding ranks does not divide it.

use crate::profile::ModelSpec;

/// How much of the communication hides behind compute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Overlap {
    /// Every collective waits, as in the live trainer today (it has no prefetch).
    Exposed,
    /// The next unit's gather runs under the current unit's compute: only the
    /// communication beyond the compute shows.
    Prefetch,
}

/// A model sharded over a ring of ranks: what a rank moves and how fast.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedStep {
    /// Elements of each unit in forward order: the embeddings, each decoder layer, the
    /// head (the first and the last are gathered once per micro-batch, the rest twice).
    pub units: Vec<f64>,
    /// Ranks the state is sharded over.
    pub ranks: u32,
    /// Bytes per element on the wire (the model's dtype: gathers and gradients alike).
    pub elt_bytes: f64,
    /// What one rank's link carries in ring collectives, bytes/s (measured, or the
    /// hardware's network bandwidth per device).
    pub link_bytes_per_s: f64,
    /// Whether gathers overlap compute.
    pub overlap: Overlap,
}

/// What a rank does in one optimizer step. Its compute is
/// `tokens · s_per_token + micro_batches · s_per_micro_batch + update_s`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct RankWork {
    /// Tokens this rank trains on (its share of the step's batch, epochs included).
    pub tokens: f64,
    /// Micro-batches it cuts them into: each gathers and reduces the whole model.
    pub micro_batches: f64,
    /// Seconds per token of forward and backward with layer recompute on this rank,
    /// collectives excluded (measured, or a roofline).
    pub s_per_token: f64,
    /// Seconds per micro-batch whatever its tokens and N: every rank materialises the
    /// whole model's weights and gradients, unit by unit (memory-bound; it shows on a
    /// CPU with small batches, next to nothing on a GPU).
    pub s_per_micro_batch: f64,
    /// Seconds of the optimizer step on this rank's shard (1/N of the model's).
    pub update_s: f64,
}

/// One rank's predicted step, in parts.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCost {
    /// Forward, recompute and backward.
    pub compute_s: f64,
    /// All the collectives, end to end.
    pub comm_s: f64,
    /// The part of `comm_s` the step waits for.
    pub exposed_comm_s: f64,
    /// `compute_s + exposed_comm_s`.
    pub step_s: f64,
    /// Bytes through this rank's link.
    pub moved_bytes: f64,
}

impl ShardedStep {
    /// A preset model in bf16 over `ranks` ranks, without prefetch. A [`ModelSpec`] does
    /// not split out the embeddings, so every parameter counts as a layer's: 3·(N−1)/N
    /// of the weights per micro-batch, some 7% above the live schedule for a 7B model.
    pub fn of_model(model: &ModelSpec, ranks: u32, link_bytes_per_s: f64) -> Self {
        let layers = model.layers.max(1);
        let mut units = vec![0.0];
        units.extend(std::iter::repeat_n(
            model.params / f64::from(layers),
            layers as usize,
        ));
        units.push(0.0);
        ShardedStep {
            units,
            ranks,
            elt_bytes: model.weight_bytes() / model.params.max(1.0),
            link_bytes_per_s,
            overlap: Overlap::Exposed,
        }
    }

    /// Bytes one rank moves per micro-batch: each unit padded to a multiple of the
    /// ranks, (N−1)/N of it per collective, twice for the embeddings and the head and
    /// three times for a layer (the engine's `moved_bytes_per_micro_batch`).
    pub fn moved_bytes_per_micro_batch(&self) -> f64 {
        let n = f64::from(self.ranks.max(1));
        let last = self.units.len().saturating_sub(1);
        self.units
            .iter()
            .enumerate()
            .map(|(i, &numel)| {
                let moves = if i == 0 || i == last { 2.0 } else { 3.0 };
                let padded = (numel / n).ceil() * n;
                moves * padded * self.elt_bytes * (n - 1.0) / n
            })
            .sum()
    }

    /// One rank's step for `work`.
    pub fn predict(&self, work: RankWork) -> StepCost {
        let compute_s = work.tokens * work.s_per_token
            + work.micro_batches * work.s_per_micro_batch
            + work.update_s;
        let moved_bytes = self.moved_bytes_per_micro_batch() * work.micro_batches.max(1.0);
        let comm_s = match moved_bytes > 0.0 {
            true => moved_bytes / self.link_bytes_per_s,
            false => 0.0,
        };
        let exposed_comm_s = match self.overlap {
            Overlap::Exposed => comm_s,
            Overlap::Prefetch => (comm_s - compute_s).max(0.0),
        };
        StepCost {
            compute_s,
            comm_s,
            exposed_comm_s,
            step_s: compute_s + exposed_comm_s,
            moved_bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SmolLM2-135M's units (tied embeddings: the head is the final norm alone).
    fn smollm2_135m() -> Vec<f64> {
        let (h, f, kv_dim, vocab) = (576.0, 1536.0, 192.0, 49152.0);
        let layer = h * (h + 2.0 * kv_dim) + h * h + 3.0 * h * f + 2.0 * h;
        let mut u = vec![vocab * h];
        u.extend(std::iter::repeat_n(layer, 30));
        u.push(h);
        u
    }

    fn step(ranks: u32) -> ShardedStep {
        ShardedStep {
            units: smollm2_135m(),
            ranks,
            elt_bytes: 4.0,
            link_bytes_per_s: 500e6,
            overlap: Overlap::Exposed,
        }
    }

    #[test]
    fn moves_what_the_live_schedule_moves() {
        // `yatt bench sharded --model smollm2-135m` measured 750.5 MB at N = 2 and
        // 1,125.7 MB at N = 4 per rank per step (one micro-batch each).
        assert!((step(2).moved_bytes_per_micro_batch() / 1e6 - 750.5).abs() < 0.1);
        assert!((step(4).moved_bytes_per_micro_batch() / 1e6 - 1125.7).abs() < 0.1);
        assert_eq!(step(1).moved_bytes_per_micro_batch(), 0.0);
    }

    #[test]
    fn a_rank_moves_three_times_the_weights_whatever_the_ranks() {
        let m = ModelSpec::preset("7b").unwrap();
        for n in [2, 8, 64] {
            let s = ShardedStep::of_model(&m, n, 25e9);
            let want = 3.0 * f64::from(n - 1) / f64::from(n) * m.weight_bytes();
            let got = s.moved_bytes_per_micro_batch();
            // Padding each layer to a multiple of the ranks adds under 1e-6.
            assert!(
                got >= want && got - want < 1e-6 * want,
                "{n}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn exposed_communication_adds_to_compute_and_scales_with_micro_batches() {
        let s = step(4);
        let w = RankWork {
            tokens: 64.0,
            micro_batches: 2.0,
            s_per_token: 0.01,
            s_per_micro_batch: 0.1,
            update_s: 0.05,
        };
        let c = s.predict(w);
        assert!((c.compute_s - (0.64 + 0.2 + 0.05)).abs() < 1e-12);
        let moved = 2.0 * s.moved_bytes_per_micro_batch();
        assert!((c.moved_bytes - moved).abs() < 1e-6);
        assert!((c.comm_s - moved / 500e6).abs() < 1e-12);
        assert_eq!(c.exposed_comm_s, c.comm_s);
        assert!((c.step_s - (c.compute_s + c.comm_s)).abs() < 1e-12);
    }

    #[test]
    fn prefetch_hides_communication_up_to_the_compute() {
        let mut s = step(4);
        s.overlap = Overlap::Prefetch;
        let w = |s_per_token| RankWork {
            tokens: 100.0,
            micro_batches: 1.0,
            s_per_token,
            ..RankWork::default()
        };
        let slow = s.predict(w(1.0));
        assert_eq!(slow.exposed_comm_s, 0.0);
        assert_eq!(slow.step_s, slow.compute_s);
        let fast = s.predict(w(1e-4));
        assert!((fast.step_s - fast.comm_s).abs() < 1e-12);
    }

    #[test]
    fn one_rank_moves_nothing_and_costs_its_compute() {
        let c = step(1).predict(RankWork {
            tokens: 10.0,
            micro_batches: 1.0,
            s_per_token: 0.5,
            ..RankWork::default()
        });
        assert_eq!(c.comm_s, 0.0);
        assert_eq!(c.step_s, 5.0);
    }
}
