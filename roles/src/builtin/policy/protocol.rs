//! What the policy role is asked and answers: a leaf of `policy`, so the whole and the
//! sharded policy share it without importing each other.

use std::path::PathBuf;

use yatt_runtime::ActorId;
use yatt_runtime::RingSpec;

use super::report::TrainReport;
use super::state::TrainerState;
use crate::role::WeightsUpdate;
use crate::sample::Sample;

/// What the policy role is asked.
#[derive(Debug)]
pub enum PolicyRequest {
    /// Fill in `old_logprobs`.
    OldLogProbs(Vec<Sample>),
    /// Train on the samples.
    Train(Vec<Sample>),
    /// Data parallelism: the gradients of the loss on this controller's samples (one
    /// optimizer step's worth), without updating; the role's gradients are zeroed after.
    Gradients(Vec<Sample>),
    /// Data parallelism: average the controllers' gradients and take one optimizer step.
    ApplyGradients(Vec<GradShard>),
    /// Export the weights for weight sync, as byte buckets.
    ExportWeights,
    /// Export the weights for roles in this process: a snapshot of the tensors they take
    /// over without copying (one copy here instead of encoding to bytes and decoding).
    /// A policy in another process answers it as [`PolicyRequest::ExportWeights`].
    ExportLocalWeights,
    /// Export the weights for roles in other processes of this host: one device buffer
    /// they map through CUDA IPC. Answered with [`PolicyResponse::DeviceWeightsUnavailable`]
    /// where that cannot be (weights on the CPU, no CUDA driver).
    ExportDeviceWeights,
    /// Pack the weights for an NCCL broadcast to other hosts' rollouts. `group`: the
    /// group the asking controller broadcast to last, reused unless `fresh` (its
    /// members changed: the policy drops it and makes another). Answered with the
    /// packed table and the group (this policy rank 0), or
    /// [`PolicyResponse::NcclUnavailable`].
    StageBroadcast {
        /// The group the asking controller broadcast to last, if any.
        group: Option<yatt_collective::UniqueId>,
        /// The group's members changed: make a new one.
        fresh: bool,
    },
    /// Broadcast the staged weights as rank 0 of the group, while its members receive.
    Broadcast(crate::role::NcclGroup),
    /// Save a checkpoint to this directory.
    SaveCheckpoint(PathBuf),
    /// Data parallelism over replicas: this replica's ring inbox, for the ring's spec.
    RingInbox,
    /// Data parallelism over replicas: join the ring of every replica's inbox.
    JoinRing(RingSpec),
    /// Data parallelism over replicas of a sharded policy (HSDP): rank `r` of this
    /// replica joins `specs[r]`, the ring of rank `r` of every replica (the inboxes a
    /// sharded replica answers [`PolicyRequest::RingInbox`] with, in
    /// [`PolicyResponse::ShardRingInboxes`]).
    JoinShardRings(Vec<RingSpec>),
    /// Data parallelism over replicas with NCCL: whether this replica can average
    /// gradients through NCCL (its weights on a GPU, libnccl loaded), and with
    /// `make_id` (the first replica) the group's id. Answered with
    /// [`PolicyResponse::GradientGroup`] or [`PolicyResponse::NcclUnavailable`].
    GradientGroup {
        /// This is the first replica: make the group's id.
        make_id: bool,
    },
    /// Data parallelism over replicas: average gradients in this NCCL group from now
    /// on (the ring stays the fallback), or, with `None`, over the ring alone.
    JoinGradientGroup(Option<crate::role::NcclGroup>),
    /// Data parallelism over replicas: the gradients of the loss on this head's samples,
    /// averaged with every other replica's in the ring, then one optimizer step. Every
    /// replica of the ring must be asked at the same time, at the same version.
    TrainAllReduce(Vec<Sample>),
    /// The whole trainer state (weights, optimizer moments, step), as bytes.
    ExportState,
    /// Replace the trainer with this state (another replica's [`PolicyRequest::ExportState`]).
    ImportState(TrainerState),
    /// Weight sync in one hop: export the weights as buckets and load them into these
    /// roles straight from the policy's process, each load with `timeout`. Answered
    /// by the actor that hosts the policy on a node ([`crate::PushingPolicy`]) with
    /// [`PolicyResponse::Pushed`]; the role itself answers
    /// [`PolicyResponse::PushUnavailable`], and the asker sends the buckets itself.
    PushWeights {
        /// The roles to load the weights into.
        to: Vec<PushTarget>,
        /// The deadline of each load.
        timeout: std::time::Duration,
    },
    /// A sharded policy: reshard this replica in place over `shards` ranks, between two
    /// steps, keeping its weights, moments and step (the live placement's move of a
    /// rank's device). Answered with [`PolicyResponse::Resharded`]; refused by a whole
    /// policy and by a replica with ranks on other nodes.
    Reshard {
        /// Ranks of the replica from now on.
        shards: u32,
    },
}

/// A role that [`PolicyRequest::PushWeights`] loads, with its kind: the kind names the
/// actor's message types, which an actor on the policy's own node must be asked in.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum PushTarget {
    /// A rollout (`RoleRequest<RolloutRequest>`).
    Rollout(ActorId),
    /// A reference, or another role that serves sample batches
    /// (`RoleRequest<Vec<Sample>>`).
    Reference(ActorId),
    /// Another policy replica (`RoleRequest<PolicyRequest>`).
    Policy(ActorId),
}

impl PushTarget {
    /// The actor to load.
    pub fn id(&self) -> &ActorId {
        match self {
            PushTarget::Rollout(id) | PushTarget::Reference(id) | PushTarget::Policy(id) => id,
        }
    }
}

/// What the policy role answers.
#[derive(Debug)]
pub enum PolicyResponse {
    /// Samples with `old_logprobs` set.
    Scored(Vec<Sample>),
    /// The update's report.
    Trained(TrainReport),
    /// One controller's gradients.
    Gradients(GradShard),
    /// The weights.
    Weights(WeightsUpdate),
    /// The checkpoint was written.
    Saved,
    /// This replica's ring inbox.
    RingInbox(ActorId),
    /// A sharded replica's ring inboxes, one per rank, in rank order
    /// ([`PolicyRequest::RingInbox`]): its ranks each join their own ring
    /// ([`PolicyRequest::JoinShardRings`]).
    ShardRingInboxes(Vec<ActorId>),
    /// The replica joined the ring.
    Joined,
    /// The trainer state ([`PolicyRequest::ExportState`]).
    State(TrainerState),
    /// The trainer state was taken ([`PolicyRequest::ImportState`]).
    Imported,
    /// [`PolicyRequest::ExportDeviceWeights`] cannot be served here, and why: send the
    /// weights as buckets instead.
    DeviceWeightsUnavailable(String),
    /// [`PolicyRequest::Broadcast`] reached every member.
    Sent,
    /// [`PolicyRequest::GradientGroup`]: NCCL can be used here (and the group's id, if
    /// asked to make one).
    GradientGroup(Option<yatt_collective::UniqueId>),
    /// NCCL cannot be used here ([`PolicyRequest::StageBroadcast`],
    /// [`PolicyRequest::GradientGroup`]), and why.
    NcclUnavailable(String),
    /// What [`PolicyRequest::PushWeights`] did.
    Pushed(PushReport),
    /// [`PolicyRequest::PushWeights`] cannot be served here, and why: export the weights
    /// and send them instead.
    PushUnavailable(String),
    /// [`PolicyRequest::Reshard`]: the replica's ranks before and now.
    Resharded {
        /// Ranks before.
        from: u32,
        /// Ranks now.
        to: u32,
    },
}

/// What one [`PolicyRequest::PushWeights`] did.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct PushReport {
    /// The version the rollouts that loaded now hold.
    pub version: u64,
    /// Bytes of weights sent to each rollout.
    pub bytes: u64,
    /// The rollouts that did not load them, and why; every other one did.
    pub failed: Vec<(ActorId, yatt_runtime::CallError)>,
}

/// One controller's gradients for a data-parallel step.
#[derive(Debug, Clone)]
pub struct GradShard {
    /// Gradients (canonical parameter names, f32).
    pub buckets: Vec<yatt_engine::WeightBucket>,
    /// Loss statistics of the shard (no optimizer fields yet).
    pub report: TrainReport,
}
