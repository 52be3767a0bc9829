//! Scoring with a sharded replica (the policy's old log-probs, a sharded reference's):
//! each unit is gathered, run without gradients and freed, so no rank holds more than
//! its shards and a unit or two. Every rank scores its own micro-batches; the ranks
//! agree on the count, and a rank short of them takes part in the gathers with none.

use super::group::ReduceOp;
use super::trainer::{LayersOut, ShardedTrainer};
use crate::error::Result;
use crate::score::{head_scores, predicting_rows, token_layout, SeqBatch};
use tch::Tensor;

/// Which head a sharded scoring pass runs.
#[derive(Clone, Copy)]
enum ScoreHead {
    /// The LM head's log-probs at a temperature.
    Tokens(f64),
    /// The scalar head's values.
    Values,
}

impl ShardedTrainer {
    /// Log-probs `[B, T]` of every token of each of `batches` given its prefix (0 at
    /// `t = 0` and at padding), at `temperature`, without gradients: a collective,
    /// which every rank calls with its own batches (any count, none included).
    pub fn score_tokens(&mut self, batches: &[SeqBatch], temperature: f64) -> Result<Vec<Tensor>> {
        self.score_with(batches, ScoreHead::Tokens(temperature))
    }

    /// The scalar head's values `[B, T]` at every position of each of `batches`
    /// (padding zeroed), without gradients: a collective like
    /// [`ShardedTrainer::score_tokens`], for a model with a scalar head (a critic).
    pub fn score_values(&mut self, batches: &[SeqBatch]) -> Result<Vec<Tensor>> {
        self.scalar_head("score values")?;
        self.score_with(batches, ScoreHead::Values)
    }

    fn score_with(&mut self, batches: &[SeqBatch], head: ScoreHead) -> Result<Vec<Tensor>> {
        self.reset_in_flight();
        let mut count = [batches.len() as f64];
        self.group.all_reduce(&mut count, ReduceOp::Max)?;
        let mut out = Vec::with_capacity(batches.len());
        tch::no_grad(|| -> Result<()> {
            for i in 0..count[0] as usize {
                let scored = self.score_micro(batches.get(i), head);
                if let Some(lp) = scored? {
                    out.push(lp);
                }
            }
            Ok(())
        })?;
        Ok(out)
    }

    /// One micro-batch's forward pass, unit by unit (or, with `None`, this rank's part
    /// in the gathers of one it does not have).
    fn score_micro(&mut self, batch: Option<&SeqBatch>, head: ScoreHead) -> Result<Option<Tensor>> {
        let last = self.layout.len() - 1;
        let LayersOut { pass, x, embed, .. } =
            self.forward_layers(batch, (0..=last).collect(), false)?;
        let head_unit = self.gather(last, false)?;
        let scored = match (batch, &pass, x) {
            (Some(b), Some(p), Some(xl)) => {
                let h = self.model.run_final_norm(p, &xl);
                Some(match head {
                    ScoreHead::Tokens(temperature) => {
                        let (rows, targets) = predicting_rows(&h, b);
                        let chunk = self.model.memory.logprob_chunk_tokens;
                        let (lp, _) =
                            head_scores(&self.model, &rows, &targets, temperature, chunk, false);
                        let (bt, tt) = b.ids.size2().expect("[B, T]");
                        token_layout(&lp, b, bt, tt)
                    }
                    ScoreHead::Values => self.head_values(&h, b)?,
                })
            }
            _ => None,
        };
        self.release(head_unit);
        if let Some(e) = embed {
            self.release(e);
        }
        Ok(scored)
    }
}

#[cfg(test)]
mod tests {
    use super::super::group::LocalGroup;
    use super::*;
    use crate::config::tiny_config;
    use crate::model::Llama;
    use crate::score::token_logprobs;
    use crate::train::TrainConfig;
    use tch::{Device, Kind};

    /// Ranks scoring their own batches (one rank none at all) give what the whole
    /// model gives, at 1 to 3 ranks, training ranks and frozen ones (a reference's:
    /// 4 bytes per parameter over the ranks, and no step) alike.
    #[test]
    fn sharded_scores_are_the_whole_models() {
        let mut model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap();
        model.memory.logprob_chunk_tokens = 3;
        let batch = |k: usize| {
            let k = k as i64;
            let a: Vec<i64> = (0..4 + k).map(|t| 2 + (t * 7 + k) % 50).collect();
            let b: Vec<i64> = (0..2 + k).map(|t| 2 + (t * 5 + 3 * k) % 50).collect();
            let pairs = [(&a[..2], &a[2..]), (&b[..1], &b[1..])];
            SeqBatch::from_pairs(&pairs, 0, Device::Cpu).unwrap()
        };
        let batches: Vec<SeqBatch> = (0..3).map(batch).collect();
        let want: Vec<Tensor> = batches
            .iter()
            .map(|b| tch::no_grad(|| token_logprobs(&model, b, 0.7, false).logprobs))
            .collect();
        for (world, frozen) in (1..=3usize).flat_map(|w| [(w, false), (w, true)]) {
            let handles: Vec<_> = LocalGroup::new(world, std::time::Duration::from_secs(30))
                .into_iter()
                .enumerate()
                .map(|(rank, g)| {
                    let m = model.deep_copy(Device::Cpu, Kind::Float).unwrap();
                    let mine: Vec<SeqBatch> = (0..3)
                        .filter(|i| i % world == rank && !(world == 3 && rank == 2))
                        .map(batch)
                        .collect();
                    std::thread::spawn(move || {
                        let mut t = match frozen {
                            true => ShardedTrainer::frozen(m, Box::new(g)).unwrap(),
                            false => {
                                ShardedTrainer::new(m, TrainConfig::default(), Box::new(g)).unwrap()
                            }
                        };
                        assert_eq!(t.is_frozen(), frozen);
                        t.model.memory.logprob_chunk_tokens = 3;
                        let scored = t.score_tokens(&mine, 0.7).unwrap();
                        let shards: u64 = t.state.iter().map(|s| s.master.numel() as u64).sum();
                        let per_param = if frozen { 4 } else { 16 };
                        assert_eq!(t.shard_state_bytes(), per_param * shards);
                        if frozen {
                            let e = t.step_tokens(&[], 1.0, |_, _| unreachable!());
                            assert!(e.unwrap_err().to_string().contains("does not train"));
                        }
                        scored
                    })
                })
                .collect();
            let got: Vec<Vec<Tensor>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            for (rank, scored) in got.iter().enumerate() {
                let mine: Vec<usize> = (0..3)
                    .filter(|i| i % world == rank && !(world == 3 && rank == 2))
                    .collect();
                assert_eq!(scored.len(), mine.len(), "rank {rank} of {world}");
                for (lp, &i) in scored.iter().zip(&mine) {
                    let diff = (lp - &want[i]).abs().max().double_value(&[]);
                    assert!(diff < 1e-5, "batch {i}, rank {rank} of {world}: {diff}");
                }
            }
        }
    }
}
