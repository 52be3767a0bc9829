//! A receiver's side of weight sync from a sharded policy: each rank sends its own
//! slice ([`WeightSlice`]), and the weights are written only once every rank's slice of
//! a version has come, so a sync that fails part-way leaves the model on the version it
//! had, never a mix of two. At most one version's slices are held: a newer version's
//! first slice drops an older version's incomplete set (its sync failed).

use tch::{Device, Tensor};

use super::scoring::{bucket_tensors, weights_error};
use crate::role::{RoleError, WeightSlice, WeightsUpdate};

/// The slices of one version received so far.
#[derive(Default)]
pub(crate) struct SliceAssembly {
    pending: Option<Pending>,
}

struct Pending {
    version: u64,
    world: u32,
    got: Vec<Option<WeightsUpdate>>,
}

impl SliceAssembly {
    /// Takes `update`, one rank's slice; answers every rank's slice of its version, in
    /// rank order, once the last has come.
    pub(crate) fn offer(
        &mut self,
        update: WeightsUpdate,
        slice: WeightSlice,
    ) -> Result<Option<Vec<WeightsUpdate>>, RoleError> {
        let WeightSlice { rank, world } = slice;
        if world == 0 || rank >= world {
            return Err(RoleError::BadRequest(format!(
                "weights v{}: a slice of rank {rank} of {world} ranks; the rank must be below the rank count",
                update.version
            )));
        }
        let p = match &mut self.pending {
            Some(p) if p.version == update.version && p.world == world => p,
            Some(p) if p.version > update.version => {
                return Err(RoleError::BadRequest(format!(
                    "weights v{}: a slice older than the v{} being assembled",
                    update.version, p.version
                )))
            }
            // A newer version, or the same one over another rank count (a replica
            // resharded after a failed sync): what was held is moot.
            _ => self.pending.insert(Pending {
                version: update.version,
                world,
                got: (0..world).map(|_| None).collect(),
            }),
        };
        // A rank's slice sent again (a retried push) replaces the first.
        p.got[rank as usize] = Some(update);
        if p.got.iter().any(Option::is_none) {
            return Ok(None);
        }
        let done = self.pending.take().expect("pending");
        Ok(Some(done.got.into_iter().flatten().collect()))
    }
}

/// Writes a version's every slice ([`SliceAssembly::offer`]'s answer) with `write`
/// (given the rank count and each slice tensor with its rank), read in place from the
/// buckets for a model on `device`.
pub(crate) fn write_slices(
    all: &[WeightsUpdate],
    device: Device,
    write: impl for<'a> FnOnce(
        usize,
        Vec<(usize, &'a str, &'a Tensor)>,
    ) -> Result<usize, yatt_engine::EngineError>,
) -> Result<(), RoleError> {
    let Some(first) = all.first() else {
        return Ok(());
    };
    let world = first.slice.map_or(1, |s| s.world as usize);
    let views = all
        .iter()
        .map(|u| {
            Ok((
                u.slice.map_or(0, |s| s.rank as usize),
                bucket_tensors(u, device)?,
            ))
        })
        .collect::<Result<Vec<_>, RoleError>>()?;
    let named = views
        .iter()
        .flat_map(|(rank, v)| v.iter().map(move |(n, t)| (*rank, n, t)))
        .collect();
    write(world, named).map_err(|e| weights_error(first, e))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::rollout::{GenerateRequest, RolloutRequest, RolloutResponse, TINY_CODEC};
    use crate::builtin::{ReferenceRole, RolloutRole};
    use crate::data::prompt::Prompt;
    use crate::role::Role;
    use std::sync::Arc;
    use tch::Kind;
    use yatt_engine::{
        tiny_config, to_buckets, Generator, GeneratorConfig, Llama, LocalGroup, SamplingParams,
        ShardedTrainer, TrainConfig,
    };

    /// Each rank's slice of a sharded replica of `source`, as the ranks send them.
    fn slices_of(source: &Llama, world: usize, version: u64) -> Vec<WeightsUpdate> {
        LocalGroup::new(world, std::time::Duration::from_secs(30))
            .into_iter()
            .map(|g| {
                let m = source.deep_copy(Device::Cpu, Kind::Float).unwrap();
                let t = ShardedTrainer::new(m, TrainConfig::default(), Box::new(g)).unwrap();
                let (rank, world) = t.rank();
                WeightsUpdate {
                    slice: Some(WeightSlice {
                        rank: rank as u32,
                        world: world as u32,
                    }),
                    ..WeightsUpdate::from_buckets(
                        version,
                        to_buckets(&t.weight_slice(), 256).unwrap(),
                    )
                }
            })
            .collect()
    }

    fn rollout(model: Llama) -> RolloutRole {
        let config = GeneratorConfig {
            max_batch: 4,
            max_seq_len: 32,
            ..Default::default()
        };
        RolloutRole::new(Generator::new(model, config), Arc::new(TINY_CODEC))
    }

    fn greedy(r: &mut RolloutRole) -> Vec<Vec<i64>> {
        let prompt = Prompt {
            id: 1,
            text: "abcab".into(),
            reference: None,
            metadata: serde_json::Value::Null,
            messages: Vec::new(),
        };
        let params = SamplingParams {
            max_new_tokens: 8,
            temperature: 0.0,
            ignore_eos: true,
            ..Default::default()
        };
        let request = RolloutRequest::Generate(GenerateRequest {
            step: 0,
            prompts: vec![prompt],
            n: 2,
            params,
            seed: 5,
        });
        match r.serve(request).unwrap() {
            RolloutResponse::Generated { samples, .. } => {
                samples.into_iter().map(|s| s.response_tokens).collect()
            }
            other => panic!("{other:?}"),
        }
    }

    /// A rollout and a reference of other weights, given every rank's slice, generate
    /// and score as models loaded with the replica's weights do; until the last slice
    /// comes they keep the weights and the version they had.
    #[test]
    fn the_slices_of_every_rank_give_the_rollout_and_reference_the_weights() {
        let source = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 21).unwrap();
        let other = || Llama::random(tiny_config(), Device::Cpu, Kind::Float, 22).unwrap();
        let want = greedy(&mut rollout(
            source.deep_copy(Device::Cpu, Kind::Float).unwrap(),
        ));
        let mut r = rollout(other());
        let before = greedy(&mut r);
        assert_ne!(
            before, want,
            "the two models must differ for the test to mean anything"
        );
        let slices = slices_of(&source, 3, 9);
        for (i, u) in slices.iter().enumerate() {
            r.load_weights(u.clone()).unwrap();
            if i + 1 < slices.len() {
                assert_eq!(r.weights_version(), 0, "after {} of 3 slices", i + 1);
                assert_eq!(greedy(&mut r), before, "after {} of 3 slices", i + 1);
            }
        }
        assert_eq!(r.weights_version(), 9);
        assert_eq!(greedy(&mut r), want);

        let samples = vec![crate::sample::tests::sample(0, 0, 4)];
        let score = |model: Llama, slices: &[WeightsUpdate]| {
            let mut reference = ReferenceRole::new(model, 0, 1.0, 4);
            for u in slices {
                reference.load_weights(u.clone()).unwrap();
            }
            let scored = reference.serve(samples.clone()).unwrap();
            scored[0].ref_logprobs.clone().unwrap()
        };
        let want = score(source.deep_copy(Device::Cpu, Kind::Float).unwrap(), &[]);
        let got = score(other(), &slices_of(&source, 2, 1));
        assert_eq!(got, want);
    }

    fn slice(version: u64, rank: u32, world: u32) -> (WeightsUpdate, WeightSlice) {
        let s = WeightSlice { rank, world };
        let u = WeightsUpdate {
            slice: Some(s),
            ..WeightsUpdate::from_buckets(version, Vec::new())
        };
        (u, s)
    }

    fn offer(a: &mut SliceAssembly, version: u64, rank: u32, world: u32) -> Option<Vec<u32>> {
        let (u, s) = slice(version, rank, world);
        a.offer(u, s)
            .unwrap()
            .map(|v| v.iter().map(|u| u.slice.unwrap().rank).collect())
    }

    #[test]
    fn a_version_is_complete_only_with_every_ranks_slice() {
        let mut a = SliceAssembly::default();
        assert_eq!(offer(&mut a, 3, 2, 3), None);
        assert_eq!(offer(&mut a, 3, 0, 3), None);
        assert_eq!(
            offer(&mut a, 3, 0, 3),
            None,
            "a slice sent twice counts once"
        );
        assert_eq!(offer(&mut a, 3, 1, 3), Some(vec![0, 1, 2]));
        // A newer version drops an incomplete older one.
        assert_eq!(offer(&mut a, 4, 0, 3), None);
        assert_eq!(offer(&mut a, 5, 1, 2), None);
        assert_eq!(offer(&mut a, 5, 0, 2), Some(vec![0, 1]));
        assert_eq!(offer(&mut a, 1, 0, 1), Some(vec![0]));
    }

    #[test]
    fn stale_and_impossible_slices_are_refused() {
        let mut a = SliceAssembly::default();
        assert_eq!(offer(&mut a, 7, 0, 2), None);
        let (u, s) = slice(6, 1, 2);
        let e = a.offer(u, s).unwrap_err().to_string();
        assert!(e.contains("older than the v7"), "{e}");
        let (u, s) = slice(7, 2, 2);
        let e = a.offer(u, s).unwrap_err().to_string();
        assert!(e.contains("below the rank count"), "{e}");
        // v7's held slice is still there.
        assert_eq!(offer(&mut a, 7, 1, 2), Some(vec![0, 1]));
    }
}
