//! The roles' messages are pinned to the ALPN, as the runtime pins its own: one value
//! of every message a controller and a role exchange across processes, each kind's
//! variants by an exhaustive match, so that a new variant cannot be left out. A change
//! to how one encodes (a field added, a variant moved) fails the test until the ALPN in
//! `runtime/src/tls.rs` is bumped, so that a node of another build is refused at the
//! handshake instead of misreading these messages.

use yatt_engine::SamplingParams;
use yatt_runtime::{wire_fingerprint, ActorId, CallError, RingSpec, ALPN};

use super::tests::{buckets, sample};
use super::*;
use crate::builtin::rollout::{
    ContinueRequest, GenerateRequest, RolloutRequest, RolloutResponse, RolloutStats,
};
use crate::builtin::{
    CriticReport, CriticRequest, CriticResponse, RankRequest, RankResponse, RankStep,
};
use crate::data::prompt::Prompt;
use crate::env::{EnvRequest, EnvResponse, EnvStep};

/// A message's body, then its bulk header and bytes.
fn encoded<M: Message>(m: M) -> Vec<u8> {
    let wire = m.into_wire().expect("encodes");
    let mut out = wire.body.to_vec();
    if let Some(b) = wire.bulk {
        out.extend(postcard::to_stdvec(b.header()).expect("bulk header"));
        out.extend_from_slice(&b.contiguous());
    }
    out
}

fn id(text: &str) -> ActorId {
    text.parse().expect("an actor id")
}

fn group() -> NcclGroup {
    NcclGroup {
        id: UniqueId::from_bytes([3; yatt_collective::UNIQUE_ID_BYTES]),
        rank: 1,
        nranks: 2,
        deadline_ms: 1500,
        bucket_bytes: 1 << 20,
    }
}

fn prompt() -> Prompt {
    Prompt {
        id: 7,
        text: "q".into(),
        messages: Vec::new(),
        reference: Some("a".into()),
        metadata: serde_json::json!({"task": "t"}),
    }
}

fn state() -> TrainerState {
    TrainerState {
        files: vec![("model.safetensors".into(), Bytes::from_static(b"w"))],
    }
}

fn device_update() -> WeightsUpdate {
    WeightsUpdate {
        device: Some(crate::role::DeviceWeights {
            entries: buckets(1 << 20).remove(0).entries,
            route: DeviceRoute::Broadcast(group()),
        }),
        ..WeightsUpdate::from_buckets(6, Vec::new())
    }
}

/// Every lifecycle request and answer, and one served request and answer of the
/// reward's kind (samples): their heads are the same whatever a role serves.
fn lifecycle() -> Vec<Vec<u8>> {
    let requests = [
        RoleRequest::Serve(vec![sample(0, 2)]),
        RoleRequest::Offload,
        RoleRequest::Reload,
        RoleRequest::LoadWeights(WeightsUpdate::from_buckets(5, buckets(64))),
        RoleRequest::LoadWeights(device_update()),
        RoleRequest::LoadWeights(WeightsUpdate {
            slice: Some(crate::role::WeightSlice { rank: 1, world: 4 }),
            ..WeightsUpdate::from_buckets(5, buckets(64))
        }),
        RoleRequest::Drain,
        RoleRequest::Profile,
        RoleRequest::Stop,
    ];
    let responses = [
        RoleResponse::Served(vec![sample(0, 2)]),
        RoleResponse::Done,
        RoleResponse::Drained(vec![1, 2]),
        RoleResponse::Profile(ResourceProfile::cpu_only()),
    ];
    for r in &requests {
        match r {
            RoleRequest::Serve(_)
            | RoleRequest::Offload
            | RoleRequest::Reload
            | RoleRequest::LoadWeights(_)
            | RoleRequest::Drain
            | RoleRequest::Profile
            | RoleRequest::Stop => {}
        }
    }
    for r in &responses {
        match r {
            RoleResponse::Served(_)
            | RoleResponse::Done
            | RoleResponse::Drained(_)
            | RoleResponse::Profile(_) => {}
        }
    }
    let mut out: Vec<Vec<u8>> = requests.into_iter().map(encoded).collect();
    out.extend(responses.into_iter().map(encoded));
    out
}

/// Each request as a controller sends it, and each answer as it comes back.
fn served<Req: Message, Resp: Message>(requests: Vec<Req>, responses: Vec<Resp>) -> Vec<Vec<u8>> {
    let mut out: Vec<Vec<u8>> = requests
        .into_iter()
        .map(|r| encoded(RoleRequest::Serve(r)))
        .collect();
    out.extend(
        responses
            .into_iter()
            .map(|r| encoded(RoleResponse::Served(r))),
    );
    out
}

fn policy_requests() -> Vec<PolicyRequest> {
    let spec = RingSpec {
        rank: 0,
        members: vec![id("a/policy-ring/0#1")],
        timeout: std::time::Duration::from_millis(10),
        chunk_bytes: 64,
    };
    let shard = GradShard {
        buckets: buckets(64),
        report: TrainReport::default(),
    };
    let all = vec![
        PolicyRequest::OldLogProbs(vec![sample(0, 2)]),
        PolicyRequest::Train(vec![sample(1, 2)]),
        PolicyRequest::Gradients(vec![sample(2, 2)]),
        PolicyRequest::ApplyGradients(vec![shard]),
        PolicyRequest::ExportWeights,
        PolicyRequest::ExportLocalWeights,
        PolicyRequest::ExportDeviceWeights,
        PolicyRequest::StageBroadcast {
            group: Some(group().id),
            fresh: true,
        },
        PolicyRequest::Broadcast(group()),
        PolicyRequest::SaveCheckpoint("/c".into()),
        PolicyRequest::RingInbox,
        PolicyRequest::JoinRing(spec.clone()),
        PolicyRequest::JoinShardRings(vec![spec.clone(), spec]),
        PolicyRequest::GradientGroup { make_id: true },
        PolicyRequest::JoinGradientGroup(Some(group())),
        PolicyRequest::TrainAllReduce(vec![sample(3, 2)]),
        PolicyRequest::ExportState,
        PolicyRequest::ImportState(state()),
        PolicyRequest::PushWeights {
            to: vec![
                PushTarget::Rollout(id("b/rollout/0#2")),
                PushTarget::Reference(id("c/reference/0#1")),
                PushTarget::Policy(id("d/policy/1#1")),
            ],
            timeout: std::time::Duration::from_millis(20),
        },
        PolicyRequest::Reshard { shards: 3 },
    ];
    for r in &all {
        match r {
            PolicyRequest::OldLogProbs(_)
            | PolicyRequest::Train(_)
            | PolicyRequest::Gradients(_)
            | PolicyRequest::ApplyGradients(_)
            | PolicyRequest::ExportWeights
            | PolicyRequest::ExportLocalWeights
            | PolicyRequest::ExportDeviceWeights
            | PolicyRequest::StageBroadcast { .. }
            | PolicyRequest::Broadcast(_)
            | PolicyRequest::SaveCheckpoint(_)
            | PolicyRequest::RingInbox
            | PolicyRequest::JoinRing(_)
            | PolicyRequest::JoinShardRings(_)
            | PolicyRequest::GradientGroup { .. }
            | PolicyRequest::JoinGradientGroup(_)
            | PolicyRequest::TrainAllReduce(_)
            | PolicyRequest::ExportState
            | PolicyRequest::ImportState(_)
            | PolicyRequest::PushWeights { .. }
            | PolicyRequest::Reshard { .. } => {}
        }
    }
    all
}

fn policy_responses() -> Vec<PolicyResponse> {
    let shard = GradShard {
        buckets: buckets(64),
        report: TrainReport::default(),
    };
    let failed = CallError::Closed {
        target: id("b/rollout/0#2"),
    };
    let all = vec![
        PolicyResponse::Scored(vec![sample(0, 2)]),
        PolicyResponse::Trained(TrainReport {
            sharded: Some(crate::builtin::ShardReport {
                shards: 4,
                train_state_bytes: 5,
                gathered_bytes: 6,
                reduced_bytes: 7,
                gather_s: 0.5,
                gather_exposed_s: 0.125,
                replica_bytes: 8,
            }),
            ..Default::default()
        }),
        PolicyResponse::Gradients(shard),
        PolicyResponse::Weights(WeightsUpdate::from_buckets(4, buckets(64))),
        PolicyResponse::Weights(device_update()),
        PolicyResponse::Saved,
        PolicyResponse::RingInbox(id("a/policy-ring/0#1")),
        PolicyResponse::ShardRingInboxes(vec![id("a/policy-hsdp/0#1"), id("b/policy-hsdp/1#1")]),
        PolicyResponse::Joined,
        PolicyResponse::State(state()),
        PolicyResponse::Imported,
        PolicyResponse::DeviceWeightsUnavailable("no".into()),
        PolicyResponse::Sent,
        PolicyResponse::GradientGroup(Some(group().id)),
        PolicyResponse::NcclUnavailable("no".into()),
        PolicyResponse::Pushed(PushReport {
            version: 3,
            bytes: 64,
            failed: vec![(id("b/rollout/0#2"), failed)],
        }),
        PolicyResponse::PushUnavailable("no".into()),
        PolicyResponse::Resharded { from: 4, to: 3 },
    ];
    for r in &all {
        match r {
            PolicyResponse::Scored(_)
            | PolicyResponse::Trained(_)
            | PolicyResponse::Gradients(_)
            | PolicyResponse::Weights(_)
            | PolicyResponse::Saved
            | PolicyResponse::RingInbox(_)
            | PolicyResponse::ShardRingInboxes(_)
            | PolicyResponse::Joined
            | PolicyResponse::State(_)
            | PolicyResponse::Imported
            | PolicyResponse::DeviceWeightsUnavailable(_)
            | PolicyResponse::Sent
            | PolicyResponse::GradientGroup(_)
            | PolicyResponse::NcclUnavailable(_)
            | PolicyResponse::Pushed(_)
            | PolicyResponse::PushUnavailable(_)
            | PolicyResponse::Resharded { .. } => {}
        }
    }
    all
}

fn rollout_messages() -> (Vec<RolloutRequest>, Vec<RolloutResponse>) {
    let params = SamplingParams::greedy(4);
    let requests = vec![
        RolloutRequest::Generate(GenerateRequest {
            step: 1,
            prompts: vec![prompt()],
            n: 2,
            params: params.clone(),
            seed: 9,
        }),
        RolloutRequest::NextTokenLogits(vec![1, 2]),
        RolloutRequest::Continue(ContinueRequest {
            samples: vec![sample(0, 2)],
            params,
            seed: 9,
            budget: 8,
        }),
        RolloutRequest::CanReceiveBroadcast,
    ];
    for r in &requests {
        match r {
            RolloutRequest::Generate(_)
            | RolloutRequest::NextTokenLogits(_)
            | RolloutRequest::Continue(_)
            | RolloutRequest::CanReceiveBroadcast => {}
            // In-process only: it never crosses the wire.
            RolloutRequest::GenerateStream(..) => unreachable!(),
        }
    }
    let responses = vec![
        RolloutResponse::Generated {
            samples: vec![sample(0, 2)],
            stats: RolloutStats::default(),
        },
        RolloutResponse::Streamed {
            samples: 1,
            stats: RolloutStats::default(),
        },
        RolloutResponse::Logits(vec![0.5]),
        RolloutResponse::BroadcastReadiness(Err("no".into())),
    ];
    for r in &responses {
        match r {
            RolloutResponse::Generated { .. }
            | RolloutResponse::Streamed { .. }
            | RolloutResponse::Logits(_)
            | RolloutResponse::BroadcastReadiness(_) => {}
        }
    }
    (requests, responses)
}

fn critic_messages() -> (Vec<CriticRequest>, Vec<CriticResponse>) {
    let requests = vec![
        CriticRequest::Values(vec![sample(0, 2)]),
        CriticRequest::Train(vec![sample(1, 2)]),
        CriticRequest::SaveCheckpoint("/c".into()),
    ];
    for r in &requests {
        match r {
            CriticRequest::Values(_)
            | CriticRequest::Train(_)
            | CriticRequest::SaveCheckpoint(_) => {}
        }
    }
    let responses = vec![
        CriticResponse::Valued(vec![sample(0, 2)]),
        CriticResponse::Trained(CriticReport::default()),
        CriticResponse::Saved,
    ];
    for r in &responses {
        match r {
            CriticResponse::Valued(_) | CriticResponse::Trained(_) | CriticResponse::Saved => {}
        }
    }
    (requests, responses)
}

fn env_messages() -> (Vec<EnvRequest>, Vec<EnvResponse>) {
    let requests = vec![
        EnvRequest::Reset {
            episode: 1,
            prompt: prompt(),
        },
        EnvRequest::Step {
            episode: 1,
            action: "x".into(),
        },
        EnvRequest::End { episode: 1 },
    ];
    for r in &requests {
        match r {
            EnvRequest::Reset { .. } | EnvRequest::Step { .. } | EnvRequest::End { .. } => {}
        }
    }
    let responses = vec![
        EnvResponse::Reset("o".into(), Some("p".into())),
        EnvResponse::Stepped(EnvStep::done(1.0), None),
        EnvResponse::Ended,
    ];
    for r in &responses {
        match r {
            EnvResponse::Reset(..) | EnvResponse::Stepped(..) | EnvResponse::Ended => {}
        }
    }
    (requests, responses)
}

fn rank_messages() -> (Vec<RankRequest>, Vec<RankResponse>) {
    let spec = RingSpec {
        rank: 1,
        members: vec![id("a/policy-shard/0#1"), id("b/policy-shard/1#1")],
        timeout: std::time::Duration::from_millis(1500),
        chunk_bytes: 1 << 20,
    };
    let requests = vec![
        RankRequest::RingInbox,
        RankRequest::JoinRing(spec),
        RankRequest::Step {
            samples: vec![sample(0, 2)],
            rank: 1,
            shards: 2,
        },
        RankRequest::Gather,
        RankRequest::ReplicaRingInbox,
        RankRequest::JoinReplicaRing(RingSpec {
            rank: 1,
            members: vec![id("a/policy-hsdp/0#1"), id("b/policy-hsdp/1#1")],
            timeout: std::time::Duration::from_millis(1500),
            chunk_bytes: 4 << 20,
        }),
        RankRequest::Score {
            samples: vec![sample(0, 2)],
            rank: 1,
            shards: 2,
        },
        RankRequest::Save {
            dir: "/c".into(),
            tokenizer: Some("/t".into()),
        },
        RankRequest::Values {
            samples: vec![sample(0, 2)],
            rank: 1,
            shards: 3,
        },
        RankRequest::ValueStep {
            samples: vec![sample(1, 2)],
            rank: 2,
            shards: 3,
        },
        RankRequest::PushSlice {
            to: vec![crate::builtin::PushTarget::Rollout(id("c/rollout/0#1"))],
            timeout: std::time::Duration::from_millis(2500),
        },
    ];
    for r in &requests {
        match r {
            RankRequest::RingInbox
            | RankRequest::JoinRing(_)
            | RankRequest::Step { .. }
            | RankRequest::Gather
            | RankRequest::ReplicaRingInbox
            | RankRequest::JoinReplicaRing(_)
            | RankRequest::Score { .. }
            | RankRequest::Save { .. }
            | RankRequest::Values { .. }
            | RankRequest::ValueStep { .. }
            | RankRequest::PushSlice { .. } => {}
        }
    }
    let step: RankStep = serde_json::from_value(serde_json::json!({
        "version": 3, "loss": 0.5, "grad_norm": 1.5, "lr": 0.1, "train_state_bytes": 9,
        "gathered_bytes": 8, "reduced_bytes": 7, "gather_s": 0.25, "gather_exposed_s": 0.0625,
        "replica_bytes": 6,
        "stats": {"ran": 2, "clip": 0.1, "approx_kl": 0.2, "kl": 0.3, "entropy": 0.4}
    }))
    .expect("a rank step");
    let responses = vec![
        RankResponse::RingInbox(id("b/policy-shard/1#1")),
        RankResponse::Joined,
        RankResponse::Stepped(step),
        RankResponse::Done,
        RankResponse::Scored(vec![vec![-0.5, -1.25], vec![]]),
        RankResponse::Valued(vec![vec![0.5, 1.25], vec![]]),
        RankResponse::ValueStepped(crate::builtin::CriticRankStep {
            loss: 0.5,
            grad_norm: 1.5,
            clip: 0.25,
            vpred: -0.75,
            micro_batches: 2,
        }),
        RankResponse::Pushed(crate::builtin::PushReport {
            version: 3,
            bytes: 64,
            failed: vec![(
                id("c/rollout/1#1"),
                CallError::Timeout {
                    target: id("c/rollout/1#1"),
                    after: std::time::Duration::from_millis(2500),
                },
            )],
        }),
    ];
    for r in &responses {
        match r {
            RankResponse::RingInbox(_)
            | RankResponse::Joined
            | RankResponse::Stepped(_)
            | RankResponse::Done
            | RankResponse::Pushed(_)
            | RankResponse::Scored(_)
            | RankResponse::Valued(_)
            | RankResponse::ValueStepped(_) => {}
        }
    }
    (requests, responses)
}

/// Every message, encoded as it crosses the wire.
fn every_message() -> Vec<Vec<u8>> {
    let mut out = lifecycle();
    out.extend(served(policy_requests(), policy_responses()));
    let (requests, responses) = rollout_messages();
    out.extend(served(requests, responses));
    let (requests, responses) = critic_messages();
    out.extend(served(requests, responses));
    let (requests, responses) = env_messages();
    out.extend(served(requests, responses));
    let (requests, responses) = rank_messages();
    out.extend(served(requests, responses));
    out
}

#[test]
fn the_role_messages_encoding_is_pinned_to_the_alpn() {
    assert_eq!(
        (
            String::from_utf8_lossy(ALPN).into_owned(),
            wire_fingerprint(&every_message())
        ),
        ("yatt/11".to_string(), 2_760_840_647),
        "the role messages encode differently: bump ALPN in runtime/src/tls.rs and pin the new fingerprint"
    );
}
