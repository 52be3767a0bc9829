//! Round trips of every message through its wire form.

use super::*;
use crate::builtin::rollout::{
    ContinueRequest, GenerateRequest, RolloutRequest, RolloutResponse, RolloutStats,
};
use crate::data::prompt::Prompt;
use crate::sample::{Finish, SampleId};
use tch::{Device, Kind, Tensor};
use yatt_engine::{to_buckets, SamplingParams};

pub(super) fn sample(k: u32, tokens: usize) -> Sample {
    Sample {
        id: SampleId {
            step: 3,
            prompt: 0x1000,
            k,
        },
        group: 0x1000,
        prompt_tokens: vec![0, 5, 6],
        response_tokens: (0..tokens as i64).collect(),
        rollout_logprobs: vec![-0.5; tokens],
        finish: Finish::Length,
        prompt_text: "q0:".into(),
        response_text: "abc".into(),
        reference: Some("42".into()),
        metadata: serde_json::json!({"task": "letters", "difficulty": [1, 2]}),
        weights_version: 7,
        weights_version_last: Some(8),
        reward: Some(0.25),
        ref_logprobs: Some(vec![-0.75; tokens]),
        old_logprobs: None,
        values: None,
        advantages: None,
        returns: None,
        step_rewards: None,
        step_ends: None,
        loss_mask: None,
        episode: None,
    }
}

pub(super) fn buckets(max_bytes: usize) -> Vec<WeightBucket> {
    let named = vec![
        (
            "a".to_string(),
            Tensor::arange(12, (Kind::Float, Device::Cpu)).view([3, 4]),
        ),
        (
            "b".to_string(),
            Tensor::from_slice(&[1.5f32, -2.0]).to_kind(Kind::BFloat16),
        ),
    ];
    to_buckets(&named, max_bytes).unwrap()
}

fn round_trip<M: Message>(m: M) -> (M, Wire) {
    let wire = m.into_wire().unwrap();
    let back = M::from_wire(wire.clone()).unwrap();
    (back, wire)
}

/// Weights in the policy's device buffer cross the wire as their table and route
/// (a CUDA IPC handle, or an NCCL group), never as bulk; and the policy's requests
/// and answers for them too.
#[test]
fn device_weights_cross_as_a_table_and_a_route() {
    let handle: yatt_collective::IpcHandle = serde_json::from_value(serde_json::json!({
        "handle": vec![9u8; 64], "offset": 512, "bytes": 4096,
        "host": "boot", "pid": 77, "ptr": 0x7f00_0000u64,
    }))
    .unwrap();
    let group = NcclGroup {
        id: yatt_collective::UniqueId::from_bytes([3; yatt_collective::UNIQUE_ID_BYTES]),
        rank: 2,
        nranks: 3,
        deadline_ms: 1500,
        bucket_bytes: 1 << 26,
    };
    let entries = buckets(1 << 20).remove(0).entries;
    for route in [DeviceRoute::Ipc(handle), DeviceRoute::Broadcast(group)] {
        let update = WeightsUpdate {
            device: Some(crate::role::DeviceWeights {
                entries: entries.clone(),
                route: route.clone(),
            }),
            ..WeightsUpdate::from_buckets(6, Vec::new())
        };
        let (back, wire) = round_trip(RoleRequest::<()>::LoadWeights(update.clone()));
        assert!(wire.bulk.is_none());
        let RoleRequest::LoadWeights(u) = back else {
            panic!("{back:?}")
        };
        assert_eq!((u.version, u.buckets.len()), (6, 0));
        assert_eq!(
            u.device.as_ref().map(|d| (&d.entries, &d.route)),
            Some((&entries, &route))
        );
        assert_eq!(u.bytes(), entries.iter().map(|e| e.len).sum::<u64>());

        let (back, _) = round_trip(PolicyResponse::Weights(update));
        assert!(
            matches!(&back, PolicyResponse::Weights(u) if u.device.as_ref().is_some_and(|d| d.route == route)),
            "{back:?}"
        );
    }
    let (back, _) = round_trip(PolicyRequest::ExportDeviceWeights);
    assert!(matches!(back, PolicyRequest::ExportDeviceWeights));
    for (g, fresh) in [
        (None, true),
        (Some(group.id), false),
        (Some(group.id), true),
    ] {
        let (back, _) = round_trip(PolicyRequest::StageBroadcast { group: g, fresh });
        assert!(
            matches!(back, PolicyRequest::StageBroadcast { group: b, fresh: f } if (b, f) == (g, fresh))
        );
    }
    let (back, _) = round_trip(PolicyRequest::Broadcast(group));
    assert!(matches!(back, PolicyRequest::Broadcast(g) if g == group));
    let (back, _) = round_trip(PolicyResponse::Sent);
    assert!(matches!(back, PolicyResponse::Sent));
    // The gradient group's set-up.
    for make_id in [false, true] {
        let (back, _) = round_trip(PolicyRequest::GradientGroup { make_id });
        assert!(matches!(back, PolicyRequest::GradientGroup { make_id: m } if m == make_id));
    }
    for g in [None, Some(group)] {
        let (back, _) = round_trip(PolicyRequest::JoinGradientGroup(g));
        assert!(matches!(back, PolicyRequest::JoinGradientGroup(b) if b == g));
    }
    for id in [None, Some(group.id)] {
        let (back, _) = round_trip(PolicyResponse::GradientGroup(id));
        assert!(matches!(back, PolicyResponse::GradientGroup(b) if b == id));
    }
    let why = "NCCL unavailable: the policy's weights are on the CPU".to_string();
    let (back, _) = round_trip(PolicyResponse::NcclUnavailable(why.clone()));
    assert!(matches!(back, PolicyResponse::NcclUnavailable(w) if w == why));
    let why = "CUDA IPC unavailable: the policy's weights are on the CPU".to_string();
    let (back, _) = round_trip(PolicyResponse::DeviceWeightsUnavailable(why.clone()));
    assert!(matches!(back, PolicyResponse::DeviceWeightsUnavailable(w) if w == why));
}

/// An in-process snapshot of tensors is refused at the wire with the fix, and a
/// request for one reaches a policy in another process as a request for buckets.
#[test]
fn in_process_weights_do_not_cross_processes() {
    let t = tch::Tensor::zeros([2], (tch::Kind::Float, tch::Device::Cpu));
    let update = WeightsUpdate {
        version: 4,
        buckets: vec![],
        local: Some(crate::role::LocalWeights::new(vec![("embed".into(), t)])),
        device: None,
        slice: None,
    };
    for e in [
        RoleRequest::<()>::LoadWeights(update.clone())
            .into_wire()
            .unwrap_err(),
        PolicyResponse::Weights(update).into_wire().unwrap_err(),
    ] {
        let e = e.to_string();
        assert!(
            e.contains("weights v4") && e.contains("ExportWeights"),
            "{e}"
        );
    }
    let (back, _) = round_trip(PolicyRequest::ExportLocalWeights);
    assert!(matches!(back, PolicyRequest::ExportWeights), "{back:?}");
}

#[test]
fn weights_travel_as_bulk_and_the_buckets_are_not_copied() {
    for (max_bytes, count) in [(1 << 20, 1), (4, 2)] {
        let bs = buckets(max_bytes);
        assert_eq!(bs.len(), count);
        let update = WeightsUpdate::from_buckets(9, bs.clone());
        let ptrs: Vec<_> = update.buckets.iter().map(|b| b.data.as_ptr()).collect();
        let wire = RoleRequest::<()>::LoadWeights(update).into_wire().unwrap();
        let bulk = wire.bulk.clone().expect("bulk payload");
        for (b, ptr) in ptrs.iter().enumerate() {
            let (_, bytes) = bulk.tensor(&format!("0.{b}")).expect("bucket tensor");
            assert_eq!(bytes.as_ptr(), *ptr, "bucket {b}'s bytes were copied");
        }
        assert!(wire.body.len() < 200, "{} body bytes", wire.body.len());
        match RoleRequest::<()>::from_wire(wire).unwrap() {
            RoleRequest::LoadWeights(u) => {
                assert_eq!((u.version, u.buckets), (9, bs));
            }
            other => panic!("{other:?}"),
        }
    }
    // Several buckets: one bulk payload, one tensor each.
    let bs = buckets(4);
    assert_eq!(bs.len(), 2);
    let (back, wire) = round_trip(RoleResponse::Served(PolicyResponse::Weights(
        WeightsUpdate::from_buckets(2, bs.clone()),
    )));
    assert_eq!(wire.bulk.unwrap().header().tensors.len(), 2);
    match back {
        RoleResponse::Served(PolicyResponse::Weights(u)) => assert_eq!(u.buckets, bs),
        other => panic!("{other:?}"),
    }
}

#[test]
fn trainer_states_round_trip_as_bulk() {
    let state = TrainerState {
        files: vec![
            ("model.safetensors".into(), Bytes::from(vec![7u8; 3 << 20])),
            ("trainer_state.json".into(), Bytes::from_static(b"{}")),
        ],
    };
    let (back, _) = round_trip(RoleRequest::Serve(PolicyRequest::ImportState(
        state.clone(),
    )));
    assert!(matches!(back, RoleRequest::Serve(PolicyRequest::ImportState(s)) if s == state));
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::State(state.clone())));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::State(s)) if s == state));
    let (back, _) = round_trip(RoleRequest::Serve(PolicyRequest::ExportState));
    assert!(matches!(
        back,
        RoleRequest::Serve(PolicyRequest::ExportState)
    ));
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::Imported));
    assert!(matches!(
        back,
        RoleResponse::Served(PolicyResponse::Imported)
    ));
}

#[test]
fn gradient_shards_round_trip() {
    let shards = vec![
        GradShard {
            buckets: buckets(4),
            report: TrainReport {
                trained: vec![sample(0, 1).id],
                loss: 0.5,
                ..Default::default()
            },
        },
        GradShard {
            buckets: buckets(1 << 20),
            report: TrainReport {
                loss: 1.5,
                ..Default::default()
            },
        },
    ];
    let want: Vec<(Vec<WeightBucket>, TrainReport)> = shards
        .iter()
        .map(|s| (s.buckets.clone(), s.report.clone()))
        .collect();
    let (back, _) = round_trip(RoleRequest::Serve(PolicyRequest::ApplyGradients(shards)));
    match back {
        RoleRequest::Serve(PolicyRequest::ApplyGradients(got)) => {
            let got: Vec<_> = got.into_iter().map(|s| (s.buckets, s.report)).collect();
            assert_eq!(got, want);
        }
        other => panic!("{other:?}"),
    }
    let (back, _) = round_trip(PolicyResponse::Gradients(GradShard {
        buckets: buckets(4),
        report: TrainReport::default(),
    }));
    assert!(matches!(back, PolicyResponse::Gradients(g) if g.buckets == buckets(4)));
}

#[test]
fn ring_messages_round_trip() {
    use yatt_runtime::RingSpec;
    use yatt_runtime::{ActorId, ActorName};
    let id = |node: &str| ActorId {
        name: ActorName::new(node, "policy-ring", 0).unwrap(),
        incarnation: 5,
    };
    let spec = RingSpec {
        rank: 1,
        members: vec![id("a"), id("b")],
        timeout: std::time::Duration::from_millis(1500),
        chunk_bytes: 4 << 20,
    };
    let (back, _) = round_trip(RoleRequest::Serve(PolicyRequest::JoinRing(spec.clone())));
    assert!(matches!(back, RoleRequest::Serve(PolicyRequest::JoinRing(s)) if s == spec));
    let specs = vec![spec.clone(), spec.clone()];
    let ask = RoleRequest::Serve(PolicyRequest::JoinShardRings(specs.clone()));
    let (back, _) = round_trip(ask);
    assert!(matches!(back, RoleRequest::Serve(PolicyRequest::JoinShardRings(s)) if s == specs));
    let ids = vec![id("a"), id("c")];
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::ShardRingInboxes(
        ids.clone(),
    )));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::ShardRingInboxes(i)) if i == ids));
    let samples = vec![sample(0, 4)];
    let (back, _) = round_trip(RoleRequest::Serve(PolicyRequest::TrainAllReduce(
        samples.clone(),
    )));
    assert!(matches!(back, RoleRequest::Serve(PolicyRequest::TrainAllReduce(s)) if s == samples));
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::RingInbox(id("b"))));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::RingInbox(i)) if i == id("b")));
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::Joined));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::Joined)));
}

/// A direct push names its targets, each with its kind, and the deadline; its
/// report names each target that missed the weights and why, so the controller can
/// settle it.
#[test]
fn push_messages_round_trip() {
    use yatt_runtime::{ActorId, CallError};
    let a: ActorId = "n0/rollout/0#3".parse().unwrap();
    let b: ActorId = "n1/rollout/1#4".parse().unwrap();
    let targets = vec![
        PushTarget::Rollout(a.clone()),
        PushTarget::Rollout(b.clone()),
        PushTarget::Reference("n2/reference/0#1".parse().unwrap()),
        PushTarget::Policy("n3/policy/1#1".parse().unwrap()),
    ];
    let timeout = std::time::Duration::from_millis(2500);
    let (back, wire) = round_trip(RoleRequest::Serve(PolicyRequest::PushWeights {
        to: targets.clone(),
        timeout,
    }));
    assert!(wire.bulk.is_none());
    assert!(matches!(
        back,
        RoleRequest::Serve(PolicyRequest::PushWeights { to, timeout: t })
            if to == targets && t == timeout
    ));
    let report = PushReport {
        version: 9,
        bytes: 1 << 20,
        failed: vec![(
            b.clone(),
            CallError::Timeout {
                target: b.clone(),
                after: timeout,
            },
        )],
    };
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::Pushed(report.clone())));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::Pushed(r)) if r == report));
    let why = "not here".to_string();
    let (back, _) = round_trip(RoleResponse::Served(PolicyResponse::PushUnavailable(
        why.clone(),
    )));
    assert!(matches!(back, RoleResponse::Served(PolicyResponse::PushUnavailable(w)) if w == why));
}

#[test]
fn samples_and_rollout_messages_round_trip() {
    let samples = vec![sample(0, 4), sample(1, 0)];
    let (back, wire) = round_trip(RoleResponse::Served(samples.clone()));
    assert!(wire.bulk.is_none());
    assert!(matches!(back, RoleResponse::Served(s) if s == samples));
    let req = RolloutRequest::Generate(GenerateRequest {
        step: 1,
        prompts: vec![Prompt {
            id: 4,
            text: "q4:".into(),
            messages: Vec::new(),
            reference: None,
            metadata: serde_json::json!({"k": "v"}),
        }],
        n: 8,
        params: SamplingParams::default(),
        seed: 3,
    });
    let (back, _) = round_trip(RoleRequest::Serve(req));
    match back {
        RoleRequest::Serve(RolloutRequest::Generate(g)) => {
            assert_eq!(g.prompts[0].metadata["k"], "v");
            assert_eq!(g.params, SamplingParams::default());
        }
        other => panic!("{other:?}"),
    }
    let (back, _) = round_trip(RoleResponse::Served(RolloutResponse::Generated {
        samples: samples.clone(),
        stats: RolloutStats {
            weights_version: 4,
            ..Default::default()
        },
    }));
    assert!(matches!(
        back,
        RoleResponse::Served(RolloutResponse::Generated { stats, .. }) if stats.weights_version == 4
    ));
    let (back, _) = round_trip(RoleRequest::Serve(RolloutRequest::NextTokenLogits(vec![
        5, 6,
    ])));
    assert!(
        matches!(back, RoleRequest::Serve(RolloutRequest::NextTokenLogits(ref t)) if t == &[5, 6]),
        "{back:?}"
    );
    // Regression: these two decoded as their neighbours' numbers while the skipped,
    // in-process `GenerateStream` came before them.
    let cont = RolloutRequest::Continue(ContinueRequest {
        samples: samples.clone(),
        params: SamplingParams::default(),
        seed: 9,
        budget: 12,
    });
    let (back, _) = round_trip(RoleRequest::Serve(cont));
    assert!(
        matches!(back, RoleRequest::Serve(RolloutRequest::Continue(ref c)) if c.budget == 12 && c.samples == samples),
        "{back:?}"
    );
    let (back, _) = round_trip(RoleRequest::Serve(RolloutRequest::CanReceiveBroadcast));
    assert!(matches!(
        back,
        RoleRequest::Serve(RolloutRequest::CanReceiveBroadcast)
    ));
    for ready in [Ok(()), Err("no libnccl".to_string())] {
        let (back, _) = round_trip(RoleResponse::Served(RolloutResponse::BroadcastReadiness(
            ready.clone(),
        )));
        assert!(matches!(
            back,
            RoleResponse::Served(RolloutResponse::BroadcastReadiness(r)) if r == ready
        ));
    }
    // JSON keeps metadata an object (the human-readable form is unchanged).
    let json = serde_json::to_value(&samples[0]).unwrap();
    assert_eq!(json["metadata"]["task"], "letters");
}

#[test]
fn a_big_batch_spills_into_the_bulk_payload() {
    // ~2.5 MiB of samples: over the spill threshold.
    let samples: Vec<Sample> = (0..40).map(|k| sample(k, 16_000)).collect();
    let (back, wire) = round_trip(RoleRequest::Serve(PolicyRequest::Train(samples.clone())));
    assert!(wire.body.len() < 64, "{} body bytes", wire.body.len());
    let bulk = wire.bulk.expect("spilled");
    assert!(bulk.len() > SPILL_BYTES as u64);
    assert!(matches!(back, RoleRequest::Serve(PolicyRequest::Train(s)) if s == samples));
    // With a bulk payload of its own as well.
    let shards = vec![GradShard {
        buckets: buckets(4),
        report: TrainReport {
            trained: samples.iter().map(|s| s.id).collect(),
            ..Default::default()
        },
    }];
    let mut big = shards[0].report.clone();
    big.trained = (0..400_000)
        .map(|k| SampleId {
            step: 0,
            prompt: 1,
            k,
        })
        .collect();
    let shards = vec![GradShard {
        buckets: shards[0].buckets.clone(),
        report: big.clone(),
    }];
    let (back, wire) = round_trip(RoleRequest::Serve(PolicyRequest::ApplyGradients(shards)));
    assert_eq!(wire.bulk.unwrap().header().tensors.len(), 3);
    match back {
        RoleRequest::Serve(PolicyRequest::ApplyGradients(s)) => {
            assert_eq!((&s[0].report, &s[0].buckets), (&big, &buckets(4)));
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn mismatched_payloads_are_refused() {
    let mut wire = RoleRequest::<Vec<Sample>>::Offload.into_wire().unwrap();
    wire.bulk = Some(bulk_of::<()>(vec![("x".into(), Bytes::from_static(b"1"))]).unwrap());
    let e = RoleRequest::<Vec<Sample>>::from_wire(wire).unwrap_err();
    assert!(e.to_string().contains("takes none"), "{e}");
    let mut wire = PolicyResponse::Weights(WeightsUpdate::from_buckets(1, buckets(4)))
        .into_wire()
        .unwrap();
    wire.bulk = None;
    let e = PolicyResponse::from_wire(wire).unwrap_err();
    assert!(e.to_string().contains("need a bulk payload"), "{e}");
    let e = RoleResponse::<u32>::from_wire(Wire {
        body: Bytes::from_static(&[200, 1, 2]),
        bulk: None,
    })
    .unwrap_err();
    assert!(e.to_string().contains("same yatt version"), "{e}");
}
