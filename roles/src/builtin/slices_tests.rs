//! Weight sync from a sharded policy, end to end on the receiving roles: a rollout
//! and a reference given every rank's slice hold the replica's weights.

use tch::{Device, Kind};

use crate::builtin::reference::ReferenceRole;
use crate::builtin::rollout::RolloutRole;
use crate::builtin::rollout::{GenerateRequest, RolloutRequest, RolloutResponse, TINY_CODEC};
use crate::data::prompt::Prompt;
use crate::role::Role;
use crate::role::{WeightSlice, WeightsUpdate};
use std::sync::Arc;
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
                ..WeightsUpdate::from_buckets(version, to_buckets(&t.weight_slice(), 256).unwrap())
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
