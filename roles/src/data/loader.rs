//! The sharded dataloader of one data-parallel controller, with a checkpointable
//! position.
//!
//! Each epoch has one global permutation of the dataset, a pure function of
//! `(seed, epoch)`; shard `s` of `n` takes the permutation's positions `s, s+n, s+2n, …`.
//! So within an epoch the shards are disjoint and together cover the dataset, and every
//! shard sees its prompts in a fresh order each epoch. Shard sizes differ by at most one
//! when `n` does not divide the dataset.
//!
//! Batches are always full: a batch that reaches the end of the shard's epoch continues
//! with the next epoch's order. [`Dataloader::state`] / [`Dataloader::restore`] save and
//! resume the exact position.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::data::prompt::{fnv1a, DataError, Prompt, SplitMix64};

/// A dataloader's position, to checkpoint with the controller.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    /// Current epoch (0-based).
    pub epoch: u64,
    /// Prompts of this shard already handed out in `epoch`.
    pub position: usize,
    /// The shuffle seed.
    pub seed: u64,
    /// This shard's index (checked on restore).
    pub shard_index: usize,
    /// Number of shards (checked on restore).
    pub num_shards: usize,
    /// Dataset size (checked on restore: a changed dataset would silently reorder).
    pub dataset_len: usize,
}

/// Sharded, per-epoch shuffled, resumable prompt loader.
#[derive(Debug, Clone)]
pub struct Dataloader {
    prompts: Arc<[Prompt]>,
    shard_index: usize,
    num_shards: usize,
    seed: u64,
    epoch: u64,
    position: usize,
    /// Dataset indices of this shard in the current epoch's order.
    order: Vec<usize>,
}

impl Dataloader {
    /// A loader for shard `shard_index` of `num_shards`, starting at epoch 0.
    /// All shards must be built from the same prompts (same order) and seed.
    pub fn new(
        prompts: impl Into<Arc<[Prompt]>>,
        shard_index: usize,
        num_shards: usize,
        seed: u64,
    ) -> Result<Self, DataError> {
        let prompts = prompts.into();
        if num_shards == 0 {
            return Err(DataError::Config("num_shards must be >= 1".into()));
        }
        if shard_index >= num_shards {
            return Err(DataError::Config(format!("shard_index {shard_index} out of range: there are {num_shards} shards (0..{num_shards})")));
        }
        if prompts.len() < num_shards {
            return Err(DataError::Config(format!(
                "dataset has {} prompts for {num_shards} shards: every shard needs at least one; use fewer shards or more prompts",
                prompts.len()
            )));
        }
        let mut me = Self {
            prompts,
            shard_index,
            num_shards,
            seed,
            epoch: 0,
            position: 0,
            order: Vec::new(),
        };
        me.order = me.shard_order(0);
        Ok(me)
    }

    fn shard_order(&self, epoch: u64) -> Vec<usize> {
        let n = self.prompts.len();
        let mut perm: Vec<usize> = (0..n).collect();
        let mut rng = SplitMix64::new(fnv1a(&[
            b"loader",
            &self.seed.to_le_bytes(),
            &epoch.to_le_bytes(),
        ]));
        for i in (1..n).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            perm.swap(i, j);
        }
        perm.into_iter()
            .skip(self.shard_index)
            .step_by(self.num_shards)
            .collect()
    }

    /// The next `batch_size` prompts of this shard (continuing into the next epoch when
    /// this one runs out).
    pub fn next_batch(&mut self, batch_size: usize) -> Vec<Prompt> {
        let mut out = Vec::with_capacity(batch_size);
        while out.len() < batch_size {
            if self.position == self.order.len() {
                self.epoch += 1;
                self.position = 0;
                self.order = self.shard_order(self.epoch);
            }
            out.push(self.prompts[self.order[self.position]].clone());
            self.position += 1;
        }
        out
    }

    /// The position to checkpoint.
    pub fn state(&self) -> LoaderState {
        LoaderState {
            epoch: self.epoch,
            position: self.position,
            seed: self.seed,
            shard_index: self.shard_index,
            num_shards: self.num_shards,
            dataset_len: self.prompts.len(),
        }
    }

    /// Resumes from a checkpointed state. The loader must have been built with the same
    /// dataset size, shard and seed; otherwise an error says which differs.
    pub fn restore(&mut self, state: LoaderState) -> Result<(), DataError> {
        let mismatch = |what: &str, here: String, there: String| {
            DataError::State(format!("{what} is {here} here but {there} in the checkpoint; build the loader with the checkpoint's {what}"))
        };
        if state.seed != self.seed {
            return Err(mismatch(
                "seed",
                self.seed.to_string(),
                state.seed.to_string(),
            ));
        }
        if state.num_shards != self.num_shards || state.shard_index != self.shard_index {
            return Err(mismatch(
                "shard",
                format!("{}/{}", self.shard_index, self.num_shards),
                format!("{}/{}", state.shard_index, state.num_shards),
            ));
        }
        if state.dataset_len != self.prompts.len() {
            return Err(mismatch(
                "dataset size",
                self.prompts.len().to_string(),
                state.dataset_len.to_string(),
            ));
        }
        let order = self.shard_order(state.epoch);
        if state.position > order.len() {
            return Err(DataError::State(format!(
                "position {} is past the end of this shard's epoch ({} prompts)",
                state.position,
                order.len()
            )));
        }
        self.epoch = state.epoch;
        self.position = state.position;
        self.order = order;
        Ok(())
    }

    /// Current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Prompts in this shard per epoch.
    pub fn shard_len(&self) -> usize {
        self.order.len()
    }

    /// Prompts in the whole dataset.
    pub fn dataset_len(&self) -> usize {
        self.prompts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synthetic::{LengthSchedule, SyntheticTask, SyntheticTaskKind};
    use std::collections::HashSet;

    fn prompts(n: usize) -> Vec<Prompt> {
        SyntheticTask::new(SyntheticTaskKind::Addition, LengthSchedule::Constant(3), 5)
            .unwrap()
            .prompts(0, n)
    }

    fn ids(b: &[Prompt]) -> Vec<u64> {
        b.iter().map(|p| p.id).collect()
    }

    #[test]
    fn resume_continues_exactly() {
        let data = prompts(23);
        for shard in 0..3 {
            let mut straight = Dataloader::new(data.clone(), shard, 3, 42).unwrap();
            let want: Vec<Vec<u64>> = (0..12).map(|_| ids(&straight.next_batch(5))).collect();

            let mut first = Dataloader::new(data.clone(), shard, 3, 42).unwrap();
            let mut got: Vec<Vec<u64>> = (0..5).map(|_| ids(&first.next_batch(5))).collect();
            let saved = serde_json::to_string(&first.state()).unwrap();
            drop(first);
            let mut resumed = Dataloader::new(data.clone(), shard, 3, 42).unwrap();
            resumed
                .restore(serde_json::from_str(&saved).unwrap())
                .unwrap();
            got.extend((5..12).map(|_| ids(&resumed.next_batch(5))));
            assert_eq!(got, want, "shard {shard}");
            assert!(resumed.epoch() > 0);
        }
    }

    #[test]
    fn shards_are_disjoint_and_cover_each_epoch() {
        let data = prompts(23);
        let all: HashSet<u64> = ids(&data).into_iter().collect();
        let mut loaders: Vec<Dataloader> = (0..4)
            .map(|s| Dataloader::new(data.clone(), s, 4, 9).unwrap())
            .collect();
        assert_eq!(
            loaders.iter().map(|l| l.shard_len()).collect::<Vec<_>>(),
            vec![6, 6, 6, 5]
        );
        let mut orders = Vec::new();
        for _epoch in 0..2 {
            let mut seen = HashSet::new();
            let mut total = 0;
            let mut order = Vec::new();
            for l in loaders.iter_mut() {
                let n = l.shard_len();
                let b = ids(&l.next_batch(n));
                total += b.len();
                order.extend(b.iter().copied());
                seen.extend(b);
            }
            assert_eq!(total, 23, "disjoint");
            assert_eq!(seen, all, "cover");
            orders.push(order);
        }
        assert_ne!(orders[0], orders[1], "reshuffled each epoch");
    }

    #[test]
    fn restore_rejects_mismatches() {
        let data = prompts(10);
        let l = Dataloader::new(data.clone(), 0, 2, 1).unwrap();
        let st = l.state();
        let mut other_seed = Dataloader::new(data.clone(), 0, 2, 2).unwrap();
        assert!(other_seed
            .restore(st)
            .unwrap_err()
            .to_string()
            .contains("seed"));
        let mut other_shard = Dataloader::new(data.clone(), 1, 2, 1).unwrap();
        assert!(other_shard
            .restore(st)
            .unwrap_err()
            .to_string()
            .contains("shard"));
        let mut smaller = Dataloader::new(prompts(9), 0, 2, 1).unwrap();
        assert!(smaller
            .restore(st)
            .unwrap_err()
            .to_string()
            .contains("dataset size"));
        let mut same = Dataloader::new(data.clone(), 0, 2, 1).unwrap();
        assert!(same.restore(LoaderState { position: 99, ..st }).is_err());
        assert!(Dataloader::new(data.clone(), 2, 2, 1).is_err());
        assert!(Dataloader::new(data.clone(), 0, 0, 1).is_err());
        assert!(Dataloader::new(prompts(1), 0, 2, 1).is_err());
    }
}
