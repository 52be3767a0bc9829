//! Role messages on the wire, so a controller can drive roles in other processes.
//!
//! What belongs here: [`Message`] for [`RoleRequest`] / [`RoleResponse`] (for any
//! request and response that are messages themselves) and for the policy's
//! [`PolicyRequest`] / [`PolicyResponse`], plus the serde helper for JSON metadata.
//!
//! - **Weights and gradients** never go through serde: each [`WeightBucket`]'s bytes are
//!   one tensor of the message's [`Bulk`] payload, and only the bucket's small header
//!   (names, dtypes, shapes, byte ranges) is in the body. A single bucket is handed to
//!   the transport without a copy.
//! - **Large bodies** (a big sample batch) spill into the bulk payload as well, so they
//!   travel on a bulk stream (or the same-host shared-memory path) instead of running
//!   into the control-frame limit.
//! - **In-process** asks never come here: the runtime moves the value through the
//!   mailbox as it is.
//!
//! Layout of an encoded role message: the body is a postcard head followed by the
//! inner message's body (when it is inline); the bulk payload holds the inner
//! message's tensors, the spilled body (tensor [`BODY_TENSOR`]) or the weight buckets
//! (tensors `g.b`: group `g`, bucket `b`).

use std::path::PathBuf;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use yatt_collective::UniqueId;
use yatt_engine::WeightBucket;
use yatt_runtime::ActorId;
use yatt_runtime::RingSpec;
use yatt_runtime::{Bulk, DType};
use yatt_runtime::{Message, Wire, WireError};

use crate::builtin::policy::{
    GradShard, PolicyRequest, PolicyResponse, PushReport, PushTarget, TrainReport, TrainerState,
};
use crate::role::{
    DeviceRoute, NcclGroup, ResourceProfile, RoleRequest, RoleResponse, WeightsUpdate,
};
use crate::sample::Sample;

/// Bodies longer than this move into the bulk payload (well under the 8 MiB default
/// control-frame limit).
pub const SPILL_BYTES: usize = 1 << 20;

/// Name of the bulk tensor that holds a spilled body.
pub const BODY_TENSOR: &str = "yatt.body";

/// Where a served message's inner body went.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
struct Inner {
    /// The body is the bulk tensor [`BODY_TENSOR`], not the bytes after the head.
    spilled: bool,
    /// The inner message had a bulk payload of its own.
    bulk: bool,
}

#[derive(Serialize, Deserialize)]
enum RequestHead {
    Serve(Inner),
    Offload,
    Reload,
    LoadWeights {
        version: u64,
        buckets: Vec<Vec<u8>>,
    },
    Drain,
    Profile,
    Stop,
    /// Weights in a device buffer of the policy's process ([`crate::role::DeviceWeights`]).
    LoadDeviceWeights {
        version: u64,
        entries: Vec<u8>,
        route: DeviceRoute,
    },
    /// One rank's slice of a sharded policy's weights ([`crate::role::WeightSlice`]).
    LoadWeightSlice {
        version: u64,
        slice: crate::role::WeightSlice,
        buckets: Vec<Vec<u8>>,
    },
}

#[derive(Serialize, Deserialize)]
enum ResponseHead {
    Served(Inner),
    Done,
    Drained(Vec<u64>),
    Profile(ResourceProfile),
}

#[derive(Serialize, Deserialize)]
enum PolicyRequestHead {
    OldLogProbs(Vec<Sample>),
    Train(Vec<Sample>),
    Gradients(Vec<Sample>),
    ApplyGradients {
        reports: Vec<TrainReport>,
        buckets: Vec<Vec<Vec<u8>>>,
    },
    ExportWeights,
    SaveCheckpoint(PathBuf),
    RingInbox,
    JoinRing(RingSpec),
    TrainAllReduce(Vec<Sample>),
    ExportState,
    /// File names; the contents are bulk tensors `state.i`.
    ImportState(Vec<String>),
    ExportDeviceWeights,
    StageBroadcast {
        group: Option<UniqueId>,
        fresh: bool,
    },
    Broadcast(NcclGroup),
    GradientGroup {
        make_id: bool,
    },
    JoinGradientGroup(Option<NcclGroup>),
    PushWeights {
        to: Vec<PushTarget>,
        timeout_ms: u64,
    },
    JoinShardRings(Vec<RingSpec>),
    Reshard {
        shards: u32,
    },
}

#[derive(Serialize, Deserialize)]
enum PolicyResponseHead {
    Scored(Vec<Sample>),
    Trained(TrainReport),
    Gradients {
        report: TrainReport,
        buckets: Vec<Vec<u8>>,
    },
    Weights {
        version: u64,
        buckets: Vec<Vec<u8>>,
    },
    Saved,
    RingInbox(ActorId),
    Joined,
    /// File names; the contents are bulk tensors `state.i`.
    State(Vec<String>),
    Imported,
    DeviceWeights {
        version: u64,
        entries: Vec<u8>,
        route: DeviceRoute,
    },
    DeviceWeightsUnavailable(String),
    Sent,
    GradientGroup(Option<UniqueId>),
    NcclUnavailable(String),
    Pushed(PushReport),
    PushUnavailable(String),
    ShardRingInboxes(Vec<ActorId>),
    Resharded {
        from: u32,
        to: u32,
    },
}

fn encode_err<T>(reason: impl ToString) -> WireError {
    WireError::Encode {
        type_name: std::any::type_name::<T>(),
        reason: reason.to_string(),
    }
}

fn decode_err<T>(reason: impl ToString) -> WireError {
    WireError::Decode {
        type_name: std::any::type_name::<T>(),
        reason: reason.to_string(),
    }
}

/// A wire whose body is `head` (postcard) followed by `rest`.
fn to_wire<T, H: Serialize>(head: &H, rest: &[u8], bulk: Option<Bulk>) -> Result<Wire, WireError> {
    let mut body = postcard::to_stdvec(head).map_err(encode_err::<T>)?;
    body.extend_from_slice(rest);
    Ok(Wire {
        body: Bytes::from(body),
        bulk,
    })
}

/// The head and a zero-copy slice of what follows it.
fn unframe<T, H: serde::de::DeserializeOwned>(body: &Bytes) -> Result<(H, Bytes), WireError> {
    let (head, rest) = postcard::take_from_bytes::<H>(body).map_err(decode_err::<T>)?;
    let at = body.len() - rest.len();
    Ok((head, body.slice(at..)))
}

/// A bulk payload of raw byte tensors. Their bytes are not copied: each one is sent
/// from where it is, however many peers it goes to.
fn bulk_of<T>(items: Vec<(String, Bytes)>) -> Result<Bulk, WireError> {
    Bulk::from_tensors(
        items
            .into_iter()
            .map(|(n, b)| (n, DType::U8, vec![b.len() as u64], b)),
    )
    .map_err(encode_err::<T>)
}

/// The bytes of tensor `name` of `bulk`.
fn tensor_bytes<T>(bulk: &Bulk, name: &str) -> Result<Bytes, WireError> {
    bulk.tensor(name)
        .map(|(_, b)| b)
        .ok_or_else(|| decode_err::<T>(format!("the bulk payload has no tensor {name:?}")))
}

/// Wraps an inner message: its body follows the head, or spills into the bulk payload.
fn put_inner<T>(inner: Wire) -> Result<(Inner, Bytes, Option<Bulk>), WireError> {
    let had_bulk = inner.bulk.is_some();
    if inner.body.len() <= SPILL_BYTES {
        let head = Inner {
            spilled: false,
            bulk: had_bulk,
        };
        return Ok((head, inner.body, inner.bulk));
    }
    let mut items = vec![(BODY_TENSOR.to_string(), inner.body)];
    if let Some(b) = &inner.bulk {
        for t in &b.header().tensors {
            items.push((t.name.clone(), tensor_bytes::<T>(b, &t.name)?));
        }
    }
    let head = Inner {
        spilled: true,
        bulk: had_bulk,
    };
    Ok((head, Bytes::new(), Some(bulk_of::<T>(items)?)))
}

/// Undoes [`put_inner`].
fn take_inner<T>(inner: Inner, rest: Bytes, bulk: Option<Bulk>) -> Result<Wire, WireError> {
    if !inner.spilled {
        if inner.bulk != bulk.is_some() {
            return Err(WireError::BulkMismatch {
                type_name: std::any::type_name::<T>(),
                reason: "the bulk payload does not match what the head announced",
            });
        }
        return Ok(Wire { body: rest, bulk });
    }
    let bulk = bulk.ok_or(WireError::BulkMismatch {
        type_name: std::any::type_name::<T>(),
        reason: "a spilled body needs a bulk payload and none arrived",
    })?;
    let body = tensor_bytes::<T>(&bulk, BODY_TENSOR)?;
    // Dropping the body's entry leaves the other tensors where they are: no copy.
    let bulk = inner.bulk.then(|| bulk.without(BODY_TENSOR));
    Ok(Wire { body, bulk })
}

/// Bucket headers (for the body) and the buckets' bytes as bulk tensors `g.b`.
fn pack_buckets<T>(
    groups: Vec<Vec<WeightBucket>>,
) -> Result<(Vec<Vec<Vec<u8>>>, Option<Bulk>), WireError> {
    let mut headers = Vec::with_capacity(groups.len());
    let mut items = Vec::new();
    for (g, buckets) in groups.into_iter().enumerate() {
        let mut hs = Vec::with_capacity(buckets.len());
        for (b, bucket) in buckets.into_iter().enumerate() {
            hs.push(bucket.encode_header());
            items.push((format!("{g}.{b}"), bucket.data));
        }
        headers.push(hs);
    }
    let bulk = if items.is_empty() {
        None
    } else {
        Some(bulk_of::<T>(items)?)
    };
    Ok((headers, bulk))
}

/// Undoes [`pack_buckets`].
fn unpack_buckets<T>(
    headers: Vec<Vec<Vec<u8>>>,
    bulk: Option<&Bulk>,
) -> Result<Vec<Vec<WeightBucket>>, WireError> {
    let mut groups = Vec::with_capacity(headers.len());
    for (g, hs) in headers.into_iter().enumerate() {
        let mut buckets = Vec::with_capacity(hs.len());
        for (b, h) in hs.into_iter().enumerate() {
            let bulk = bulk.ok_or(WireError::BulkMismatch {
                type_name: std::any::type_name::<T>(),
                reason: "weight buckets need a bulk payload and none arrived",
            })?;
            let entries = WeightBucket::decode_header(&h).map_err(decode_err::<T>)?;
            // A slice of the received payload: no copy.
            let data = tensor_bytes::<T>(bulk, &format!("{g}.{b}"))?;
            buckets.push(WeightBucket { entries, data });
        }
        groups.push(buckets);
    }
    Ok(groups)
}

/// An update's byte buckets, for another process: an in-process snapshot cannot go.
fn remote_buckets<T>(u: WeightsUpdate) -> Result<Vec<yatt_engine::WeightBucket>, WireError> {
    match u.local {
        Some(_) => Err(encode_err::<T>(format!(
            "weights v{} are an in-process snapshot of tensors, which cannot be sent to another process; ask the policy for ExportWeights (byte buckets)",
            u.version
        ))),
        None => Ok(u.buckets),
    }
}

/// Device weights' table of tensors (a bucket header) and route to the buffer.
fn device_head(d: crate::role::DeviceWeights) -> (Vec<u8>, DeviceRoute) {
    let header = WeightBucket {
        entries: d.entries,
        data: Bytes::new(),
    }
    .encode_header();
    (header, d.route)
}

/// Undoes [`device_head`].
fn device_update<T>(
    version: u64,
    entries: &[u8],
    route: DeviceRoute,
) -> Result<WeightsUpdate, WireError> {
    let entries = WeightBucket::decode_header(entries).map_err(decode_err::<T>)?;
    Ok(WeightsUpdate {
        device: Some(crate::role::DeviceWeights { entries, route }),
        ..WeightsUpdate::from_buckets(version, Vec::new())
    })
}

/// A trainer state's file names (for the body) and its files as bulk tensors `state.i`.
fn pack_state<T>(state: TrainerState) -> Result<(Vec<String>, Option<Bulk>), WireError> {
    let (names, data): (Vec<String>, Vec<Bytes>) = state.files.into_iter().unzip();
    let items: Vec<(String, Bytes)> = data
        .into_iter()
        .enumerate()
        .map(|(i, d)| (format!("state.{i}"), d))
        .collect();
    let bulk = match items.is_empty() {
        true => None,
        false => Some(bulk_of::<T>(items)?),
    };
    Ok((names, bulk))
}

/// Undoes [`pack_state`].
fn unpack_state<T>(names: Vec<String>, bulk: Option<&Bulk>) -> Result<TrainerState, WireError> {
    let mut files = Vec::with_capacity(names.len());
    for (i, name) in names.into_iter().enumerate() {
        let bulk = bulk.ok_or(WireError::BulkMismatch {
            type_name: std::any::type_name::<T>(),
            reason: "a trainer state needs a bulk payload and none arrived",
        })?;
        files.push((name, tensor_bytes::<T>(bulk, &format!("state.{i}"))?));
    }
    Ok(TrainerState { files })
}

fn no_bulk<T>(bulk: &Option<Bulk>) -> Result<(), WireError> {
    match bulk {
        Some(_) => Err(WireError::BulkMismatch {
            type_name: std::any::type_name::<T>(),
            reason: "a bulk payload arrived for a message that takes none",
        }),
        None => Ok(()),
    }
}

fn one_group<T>(mut groups: Vec<Vec<WeightBucket>>) -> Result<Vec<WeightBucket>, WireError> {
    match groups.len() {
        1 => Ok(groups.pop().expect("one group")),
        n => Err(decode_err::<T>(format!(
            "expected one group of buckets, found {n}"
        ))),
    }
}

impl<Req: Message> Message for RoleRequest<Req> {
    fn into_wire(self) -> Result<Wire, WireError> {
        let (head, rest, bulk) = match self {
            RoleRequest::Serve(r) => {
                let (inner, rest, bulk) = put_inner::<Self>(r.into_wire()?)?;
                (RequestHead::Serve(inner), rest, bulk)
            }
            RoleRequest::Offload => (RequestHead::Offload, Bytes::new(), None),
            RoleRequest::Reload => (RequestHead::Reload, Bytes::new(), None),
            RoleRequest::Drain => (RequestHead::Drain, Bytes::new(), None),
            RoleRequest::Profile => (RequestHead::Profile, Bytes::new(), None),
            RoleRequest::Stop => (RequestHead::Stop, Bytes::new(), None),
            RoleRequest::LoadWeights(WeightsUpdate {
                version,
                device: Some(d),
                ..
            }) => {
                let (entries, route) = device_head(d);
                let head = RequestHead::LoadDeviceWeights {
                    version,
                    entries,
                    route,
                };
                (head, Bytes::new(), None)
            }
            RoleRequest::LoadWeights(u) => {
                let (version, slice) = (u.version, u.slice);
                let (mut headers, bulk) = pack_buckets::<Self>(vec![remote_buckets::<Self>(u)?])?;
                let buckets = headers.pop().unwrap_or_default();
                let head = match slice {
                    Some(slice) => RequestHead::LoadWeightSlice {
                        version,
                        slice,
                        buckets,
                    },
                    None => RequestHead::LoadWeights { version, buckets },
                };
                (head, Bytes::new(), bulk)
            }
        };
        to_wire::<Self, _>(&head, &rest, bulk)
    }

    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        let (head, rest) = unframe::<Self, RequestHead>(&wire.body)?;
        let simple = |r: RoleRequest<Req>| no_bulk::<Self>(&wire.bulk).map(|_| r);
        match head {
            RequestHead::Serve(inner) => Ok(RoleRequest::Serve(Req::from_wire(
                take_inner::<Self>(inner, rest, wire.bulk)?,
            )?)),
            RequestHead::Offload => simple(RoleRequest::Offload),
            RequestHead::Reload => simple(RoleRequest::Reload),
            RequestHead::Drain => simple(RoleRequest::Drain),
            RequestHead::Profile => simple(RoleRequest::Profile),
            RequestHead::Stop => simple(RoleRequest::Stop),
            RequestHead::LoadDeviceWeights {
                version,
                entries,
                route,
            } => {
                no_bulk::<Self>(&wire.bulk)?;
                Ok(RoleRequest::LoadWeights(device_update::<Self>(
                    version, &entries, route,
                )?))
            }
            RequestHead::LoadWeights { version, buckets } => {
                let groups = unpack_buckets::<Self>(vec![buckets], wire.bulk.as_ref())?;
                Ok(RoleRequest::LoadWeights(WeightsUpdate::from_buckets(
                    version,
                    one_group::<Self>(groups)?,
                )))
            }
            RequestHead::LoadWeightSlice {
                version,
                slice,
                buckets,
            } => {
                let groups = unpack_buckets::<Self>(vec![buckets], wire.bulk.as_ref())?;
                Ok(RoleRequest::LoadWeights(WeightsUpdate {
                    slice: Some(slice),
                    ..WeightsUpdate::from_buckets(version, one_group::<Self>(groups)?)
                }))
            }
        }
    }
}

impl<Resp: Message> Message for RoleResponse<Resp> {
    fn into_wire(self) -> Result<Wire, WireError> {
        let (head, rest, bulk) = match self {
            RoleResponse::Served(r) => {
                let (inner, rest, bulk) = put_inner::<Self>(r.into_wire()?)?;
                (ResponseHead::Served(inner), rest, bulk)
            }
            RoleResponse::Done => (ResponseHead::Done, Bytes::new(), None),
            RoleResponse::Drained(ids) => (ResponseHead::Drained(ids), Bytes::new(), None),
            RoleResponse::Profile(p) => (ResponseHead::Profile(p), Bytes::new(), None),
        };
        to_wire::<Self, _>(&head, &rest, bulk)
    }

    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        let (head, rest) = unframe::<Self, ResponseHead>(&wire.body)?;
        let simple = |r: RoleResponse<Resp>| no_bulk::<Self>(&wire.bulk).map(|_| r);
        match head {
            ResponseHead::Served(inner) => Ok(RoleResponse::Served(Resp::from_wire(
                take_inner::<Self>(inner, rest, wire.bulk)?,
            )?)),
            ResponseHead::Done => simple(RoleResponse::Done),
            ResponseHead::Drained(ids) => simple(RoleResponse::Drained(ids)),
            ResponseHead::Profile(p) => simple(RoleResponse::Profile(p)),
        }
    }
}

impl Message for PolicyRequest {
    fn into_wire(self) -> Result<Wire, WireError> {
        let (head, bulk) = match self {
            PolicyRequest::OldLogProbs(s) => (PolicyRequestHead::OldLogProbs(s), None),
            PolicyRequest::Train(s) => (PolicyRequestHead::Train(s), None),
            PolicyRequest::Gradients(s) => (PolicyRequestHead::Gradients(s), None),
            // A policy in another process answers with buckets either way.
            PolicyRequest::ExportWeights | PolicyRequest::ExportLocalWeights => {
                (PolicyRequestHead::ExportWeights, None)
            }
            PolicyRequest::SaveCheckpoint(p) => (PolicyRequestHead::SaveCheckpoint(p), None),
            PolicyRequest::RingInbox => (PolicyRequestHead::RingInbox, None),
            PolicyRequest::JoinRing(spec) => (PolicyRequestHead::JoinRing(spec), None),
            PolicyRequest::JoinShardRings(specs) => {
                (PolicyRequestHead::JoinShardRings(specs), None)
            }
            PolicyRequest::TrainAllReduce(s) => (PolicyRequestHead::TrainAllReduce(s), None),
            PolicyRequest::Reshard { shards } => (PolicyRequestHead::Reshard { shards }, None),
            PolicyRequest::ExportState => (PolicyRequestHead::ExportState, None),
            PolicyRequest::ExportDeviceWeights => (PolicyRequestHead::ExportDeviceWeights, None),
            PolicyRequest::StageBroadcast { group, fresh } => {
                (PolicyRequestHead::StageBroadcast { group, fresh }, None)
            }
            PolicyRequest::Broadcast(g) => (PolicyRequestHead::Broadcast(g), None),
            PolicyRequest::GradientGroup { make_id } => {
                (PolicyRequestHead::GradientGroup { make_id }, None)
            }
            PolicyRequest::JoinGradientGroup(g) => (PolicyRequestHead::JoinGradientGroup(g), None),
            PolicyRequest::PushWeights { to, timeout } => {
                let timeout_ms = timeout.as_millis().try_into().unwrap_or(u64::MAX);
                (PolicyRequestHead::PushWeights { to, timeout_ms }, None)
            }
            PolicyRequest::ImportState(state) => {
                let (names, bulk) = pack_state::<Self>(state)?;
                (PolicyRequestHead::ImportState(names), bulk)
            }
            PolicyRequest::ApplyGradients(shards) => {
                let (reports, groups): (Vec<_>, Vec<_>) =
                    shards.into_iter().map(|s| (s.report, s.buckets)).unzip();
                let (buckets, bulk) = pack_buckets::<Self>(groups)?;
                (PolicyRequestHead::ApplyGradients { reports, buckets }, bulk)
            }
        };
        to_wire::<Self, _>(&head, &[], bulk)
    }

    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        let (head, _) = unframe::<Self, PolicyRequestHead>(&wire.body)?;
        if !matches!(
            head,
            PolicyRequestHead::ApplyGradients { .. } | PolicyRequestHead::ImportState(_)
        ) {
            no_bulk::<Self>(&wire.bulk)?;
        }
        Ok(match head {
            PolicyRequestHead::OldLogProbs(s) => PolicyRequest::OldLogProbs(s),
            PolicyRequestHead::Train(s) => PolicyRequest::Train(s),
            PolicyRequestHead::Gradients(s) => PolicyRequest::Gradients(s),
            PolicyRequestHead::ExportWeights => PolicyRequest::ExportWeights,
            PolicyRequestHead::SaveCheckpoint(p) => PolicyRequest::SaveCheckpoint(p),
            PolicyRequestHead::RingInbox => PolicyRequest::RingInbox,
            PolicyRequestHead::JoinRing(spec) => PolicyRequest::JoinRing(spec),
            PolicyRequestHead::JoinShardRings(specs) => PolicyRequest::JoinShardRings(specs),
            PolicyRequestHead::TrainAllReduce(s) => PolicyRequest::TrainAllReduce(s),
            PolicyRequestHead::Reshard { shards } => PolicyRequest::Reshard { shards },
            PolicyRequestHead::ExportState => PolicyRequest::ExportState,
            PolicyRequestHead::ExportDeviceWeights => PolicyRequest::ExportDeviceWeights,
            PolicyRequestHead::StageBroadcast { group, fresh } => {
                PolicyRequest::StageBroadcast { group, fresh }
            }
            PolicyRequestHead::Broadcast(g) => PolicyRequest::Broadcast(g),
            PolicyRequestHead::GradientGroup { make_id } => {
                PolicyRequest::GradientGroup { make_id }
            }
            PolicyRequestHead::JoinGradientGroup(g) => PolicyRequest::JoinGradientGroup(g),
            PolicyRequestHead::PushWeights { to, timeout_ms } => PolicyRequest::PushWeights {
                to,
                timeout: std::time::Duration::from_millis(timeout_ms),
            },
            PolicyRequestHead::ImportState(names) => {
                PolicyRequest::ImportState(unpack_state::<Self>(names, wire.bulk.as_ref())?)
            }
            PolicyRequestHead::ApplyGradients { reports, buckets } => {
                if reports.len() != buckets.len() {
                    return Err(decode_err::<Self>(format!(
                        "{} reports for {} gradient shards",
                        reports.len(),
                        buckets.len()
                    )));
                }
                let groups = unpack_buckets::<Self>(buckets, wire.bulk.as_ref())?;
                PolicyRequest::ApplyGradients(
                    reports
                        .into_iter()
                        .zip(groups)
                        .map(|(report, buckets)| GradShard { buckets, report })
                        .collect(),
                )
            }
        })
    }
}

impl Message for PolicyResponse {
    fn into_wire(self) -> Result<Wire, WireError> {
        let (head, bulk) = match self {
            PolicyResponse::Scored(s) => (PolicyResponseHead::Scored(s), None),
            PolicyResponse::Trained(r) => (PolicyResponseHead::Trained(r), None),
            PolicyResponse::Saved => (PolicyResponseHead::Saved, None),
            PolicyResponse::RingInbox(id) => (PolicyResponseHead::RingInbox(id), None),
            PolicyResponse::ShardRingInboxes(ids) => {
                (PolicyResponseHead::ShardRingInboxes(ids), None)
            }
            PolicyResponse::Joined => (PolicyResponseHead::Joined, None),
            PolicyResponse::Imported => (PolicyResponseHead::Imported, None),
            PolicyResponse::Sent => (PolicyResponseHead::Sent, None),
            PolicyResponse::GradientGroup(id) => (PolicyResponseHead::GradientGroup(id), None),
            PolicyResponse::NcclUnavailable(why) => {
                (PolicyResponseHead::NcclUnavailable(why), None)
            }
            PolicyResponse::DeviceWeightsUnavailable(why) => {
                (PolicyResponseHead::DeviceWeightsUnavailable(why), None)
            }
            PolicyResponse::Pushed(r) => (PolicyResponseHead::Pushed(r), None),
            PolicyResponse::Resharded { from, to } => {
                (PolicyResponseHead::Resharded { from, to }, None)
            }
            PolicyResponse::PushUnavailable(why) => {
                (PolicyResponseHead::PushUnavailable(why), None)
            }
            PolicyResponse::Weights(WeightsUpdate {
                version,
                device: Some(d),
                ..
            }) => {
                let (entries, route) = device_head(d);
                let head = PolicyResponseHead::DeviceWeights {
                    version,
                    entries,
                    route,
                };
                (head, None)
            }
            PolicyResponse::State(state) => {
                let (names, bulk) = pack_state::<Self>(state)?;
                (PolicyResponseHead::State(names), bulk)
            }
            PolicyResponse::Gradients(shard) => {
                let (mut h, bulk) = pack_buckets::<Self>(vec![shard.buckets])?;
                let head = PolicyResponseHead::Gradients {
                    report: shard.report,
                    buckets: h.pop().unwrap_or_default(),
                };
                (head, bulk)
            }
            PolicyResponse::Weights(u) => {
                let version = u.version;
                let (mut h, bulk) = pack_buckets::<Self>(vec![remote_buckets::<Self>(u)?])?;
                let head = PolicyResponseHead::Weights {
                    version,
                    buckets: h.pop().unwrap_or_default(),
                };
                (head, bulk)
            }
        };
        to_wire::<Self, _>(&head, &[], bulk)
    }

    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        let (head, _) = unframe::<Self, PolicyResponseHead>(&wire.body)?;
        let buckets = |h: Vec<Vec<u8>>| {
            one_group::<Self>(unpack_buckets::<Self>(vec![h], wire.bulk.as_ref())?)
        };
        if !matches!(
            head,
            PolicyResponseHead::Gradients { .. }
                | PolicyResponseHead::Weights { .. }
                | PolicyResponseHead::State(_)
        ) {
            no_bulk::<Self>(&wire.bulk)?;
        }
        Ok(match head {
            PolicyResponseHead::Scored(s) => PolicyResponse::Scored(s),
            PolicyResponseHead::Trained(r) => PolicyResponse::Trained(r),
            PolicyResponseHead::Saved => PolicyResponse::Saved,
            PolicyResponseHead::RingInbox(id) => PolicyResponse::RingInbox(id),
            PolicyResponseHead::ShardRingInboxes(ids) => PolicyResponse::ShardRingInboxes(ids),
            PolicyResponseHead::Joined => PolicyResponse::Joined,
            PolicyResponseHead::Imported => PolicyResponse::Imported,
            PolicyResponseHead::Sent => PolicyResponse::Sent,
            PolicyResponseHead::GradientGroup(id) => PolicyResponse::GradientGroup(id),
            PolicyResponseHead::NcclUnavailable(why) => PolicyResponse::NcclUnavailable(why),
            PolicyResponseHead::DeviceWeightsUnavailable(why) => {
                PolicyResponse::DeviceWeightsUnavailable(why)
            }
            PolicyResponseHead::Pushed(r) => PolicyResponse::Pushed(r),
            PolicyResponseHead::Resharded { from, to } => PolicyResponse::Resharded { from, to },
            PolicyResponseHead::PushUnavailable(why) => PolicyResponse::PushUnavailable(why),
            PolicyResponseHead::DeviceWeights {
                version,
                entries,
                route,
            } => PolicyResponse::Weights(device_update::<Self>(version, &entries, route)?),
            PolicyResponseHead::State(names) => {
                PolicyResponse::State(unpack_state::<Self>(names, wire.bulk.as_ref())?)
            }
            PolicyResponseHead::Gradients { report, buckets: h } => {
                PolicyResponse::Gradients(GradShard {
                    buckets: buckets(h)?,
                    report,
                })
            }
            PolicyResponseHead::Weights {
                version,
                buckets: h,
            } => PolicyResponse::Weights(WeightsUpdate::from_buckets(version, buckets(h)?)),
        })
    }
}

#[cfg(test)]
mod pin;
#[cfg(test)]
mod tests;
