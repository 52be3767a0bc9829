//! Collectives over actor messages: a ring all-reduce (mean) of `f32` buffers, and its
//! two halves on their own (a reduce-scatter that sums, an all-gather), which sharded
//! training runs per unit of the model.
//!
//! What belongs here: [`RingMember`], one member of a group that averages equal-length
//! buffers, its inbox actor and message ([`RingMsg`]), and the group's description
//! ([`RingSpec`]). It is the fallback for machines without NCCL: the members talk
//! through their nodes, over QUIC between processes and through the mailbox within one.
//!
//! The algorithm is the classic ring: the buffer is cut into one segment per member;
//! `n - 1` reduce-scatter steps leave each member with the sum of one segment, which
//! that member alone divides by `n`; `n - 1` all-gather steps then copy every averaged
//! segment round the ring. Each member sends `2 (n - 1) / n` of the buffer and receives
//! as much, whatever `n` is. Segments travel in chunks of at most
//! [`RingSpec::chunk_bytes`] (raw little-endian `f32` in a bulk payload), each ask
//! acknowledged once the receiver has queued it.
//!
//! **Determinism.** Segment `k` is summed along the ring starting at member `k`
//! (`((g_k + g_{k+1}) + g_{k+2}) + …`) and divided once, by its owner; everyone else
//! receives a copy of those bits. So every member ends with bit-identical values, and
//! the same inputs give the same bits on every run.
//!
//! **Bounds.** Every send is an ask with the spec's deadline, every wait for a chunk
//! has the same deadline and ends early when the directory marks the sender dead, and
//! an inbox queues at most [`INBOX_QUEUE`] chunks before its sender waits. A member
//! that gives up on a round tells every other member ([`RingMsg::Abandon`]), so that a
//! member waiting on a live neighbour that gave up (in a ring of four or more, the
//! member two places after a dead one) fails at once instead of at its deadline.
//! Chunks name their round and their ring, so that what an abandoned attempt left in
//! flight is dropped by the rebuilt ring's retry of the same round.

use std::ops::Range;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::actor::{Actor, ActorError, ActorRef, CallError, Context};
use crate::addr::ActorId;
use crate::codec::{Bulk, BulkHeader, DType, TensorMeta};
use crate::message::{decode_body, encode_body, Ack, Message, Wire, WireError};
use crate::node::{Node, NodeError, WeakNode};

/// Default largest chunk on the wire: a few MiB keeps every message well inside the
/// transport's limits while amortising its per-message cost.
pub const RING_CHUNK_BYTES: u64 = 4 << 20;

/// Chunks an inbox holds before its sender waits (backpressure).
pub const INBOX_QUEUE: usize = 8;

/// Name of the bulk tensor that carries a chunk's values.
const CHUNK_TENSOR: &str = "ring";

/// A ring: who is in it, in ring order, and this member's place.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RingSpec {
    /// This member's position in `members`.
    pub rank: u32,
    /// Every member's inbox ([`RingMember::inbox_id`]), in ring order: member `i`
    /// sends to member `i + 1` (mod n).
    pub members: Vec<ActorId>,
    /// Deadline of each send and of each wait for a chunk. The first wait also covers
    /// the slowest member's work before the all-reduce (e.g. its backward pass).
    pub timeout: Duration,
    /// Largest chunk, bytes (rounded down to whole `f32`s, at least one).
    pub chunk_bytes: u64,
}

/// One piece of a segment on its way to the next member.
#[derive(Debug, Clone, PartialEq)]
pub struct RingChunk {
    /// Which ring ([`ring_fingerprint`] of its members): a chunk that an abandoned
    /// attempt left in flight reaches the rebuilt ring's retry of the same round, and
    /// must be dropped, not taken for the retry's.
    pub ring: u64,
    /// Which all-reduce (the caller's sequence number): chunks of an abandoned earlier
    /// round are recognised and dropped.
    pub round: u64,
    /// Step of the round: `0 .. n-1` reduce-scatter, `n-1 .. 2(n-1)` all-gather.
    pub step: u32,
    /// Index of the first value in the buffer.
    pub offset: u64,
    /// Length of the whole buffer, in values (the members must agree).
    pub total: u64,
    /// The values, little-endian `f32`.
    pub data: Bytes,
}

/// What a ring inbox is sent.
#[derive(Debug, Clone, PartialEq)]
pub enum RingMsg {
    /// A chunk from the previous member.
    Chunk(RingChunk),
    /// A member gave up on `round` of the ring `members`: whoever waits in that round
    /// of that ring fails now. (A rebuilt ring has other members, so a late abandon of
    /// the attempt before it does not fail its retry of the same round.)
    Abandon(Abandon),
    /// The member is gone: stop the inbox.
    Close,
}

/// A member gave up on a round.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Abandon {
    /// The all-reduce.
    pub round: u64,
    /// The ring, as [`RingSpec::members`] lists it.
    pub members: Vec<ActorId>,
    /// The member that gave up (its inbox).
    pub by: ActorId,
    /// Why.
    pub reason: String,
}

/// What waits in a member's queue.
#[derive(Debug)]
enum Inbound {
    Chunk(RingChunk),
    Abandon(Abandon),
}

#[derive(Serialize, Deserialize)]
enum RingHead {
    Chunk {
        ring: u64,
        round: u64,
        step: u32,
        offset: u64,
        total: u64,
    },
    Abandon(Abandon),
    Close,
}

impl Message for RingMsg {
    fn into_wire(self) -> Result<Wire, WireError> {
        match self {
            RingMsg::Close => Ok(Wire {
                body: encode_body(&RingHead::Close)?,
                bulk: None,
            }),
            RingMsg::Abandon(a) => Ok(Wire {
                body: encode_body(&RingHead::Abandon(a))?,
                bulk: None,
            }),
            RingMsg::Chunk(c) => {
                let len = c.data.len() as u64;
                let header = BulkHeader {
                    tensors: vec![TensorMeta {
                        name: CHUNK_TENSOR.into(),
                        dtype: DType::F32,
                        shape: vec![len / 4],
                        offset: 0,
                        len,
                    }],
                    total_len: len,
                };
                let bulk = Bulk::new(header, c.data).map_err(|e| WireError::Encode {
                    type_name: "RingMsg",
                    reason: e.to_string(),
                })?;
                let head = RingHead::Chunk {
                    ring: c.ring,
                    round: c.round,
                    step: c.step,
                    offset: c.offset,
                    total: c.total,
                };
                Ok(Wire {
                    body: encode_body(&head)?,
                    bulk: Some(bulk),
                })
            }
        }
    }

    fn from_wire(wire: Wire) -> Result<Self, WireError> {
        match decode_body::<RingHead>(&wire.body)? {
            RingHead::Close => Ok(RingMsg::Close),
            RingHead::Abandon(a) => Ok(RingMsg::Abandon(a)),
            RingHead::Chunk {
                ring,
                round,
                step,
                offset,
                total,
            } => {
                let data = wire
                    .bulk
                    .as_ref()
                    .and_then(|b| b.tensor(CHUNK_TENSOR))
                    .map(|(_, d)| d)
                    .ok_or(WireError::BulkMismatch {
                        type_name: "RingMsg",
                        reason: "a chunk needs its values as bulk tensor \"ring\"",
                    })?;
                Ok(RingMsg::Chunk(RingChunk {
                    ring,
                    round,
                    step,
                    offset,
                    total,
                    data,
                }))
            }
        }
    }
}

/// Why an all-reduce (or setting up a ring) failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    /// The member was asked to reduce before it joined a ring.
    #[error("this ring member has not joined a ring yet: send it its RingSpec first")]
    NotJoined,
    /// The ring description does not fit this member.
    #[error("bad ring spec: {0}")]
    BadSpec(String),
    /// The inbox could not be spawned.
    #[error("starting the ring inbox: {0}")]
    Spawn(#[source] NodeError),
    /// Sending a chunk to the next member failed (timeout, peer gone, ...).
    #[error("round {round}, step {step}: sending to {to}: {source}")]
    Send {
        /// The all-reduce.
        round: u64,
        /// Its step.
        step: u32,
        /// The next member's inbox.
        to: ActorId,
        /// The runtime's error.
        #[source]
        source: CallError,
    },
    /// No chunk came from the previous member in time.
    #[error("round {round}, step {step}: nothing from {from} within {after:?}")]
    Timeout {
        /// The all-reduce.
        round: u64,
        /// Its step.
        step: u32,
        /// The previous member's inbox.
        from: ActorId,
        /// The deadline.
        after: Duration,
    },
    /// The directory marked the previous member dead while this one waited for it.
    #[error("round {round}: the previous member {peer} is gone: {reason}")]
    PeerDown {
        /// The all-reduce.
        round: u64,
        /// The dead member's inbox.
        peer: ActorId,
        /// Why, as the directory recorded it.
        reason: String,
    },
    /// A chunk arrived that does not fit what this member expects: the members disagree
    /// on the buffer length or are not in the same round.
    #[error("round {round}, step {step}: {reason}")]
    OutOfStep {
        /// The all-reduce this member is in.
        round: u64,
        /// Its step.
        step: u32,
        /// What arrived instead.
        reason: String,
    },
    /// Another member gave up on this round (the first cause is in `reason`).
    #[error("round {round}: member {by} gave up: {reason}")]
    Abandoned {
        /// The all-reduce.
        round: u64,
        /// The member that gave up.
        by: ActorId,
        /// Its error.
        reason: String,
    },
    /// The node or the runtime stopped under the all-reduce.
    #[error("the ring member's node or runtime stopped")]
    Stopped,
}

/// The actor that receives a member's chunks and queues them for it.
struct RingInbox {
    queue: mpsc::Sender<Inbound>,
}

impl Actor for RingInbox {
    type Request = RingMsg;
    type Response = Ack;

    async fn handle(&mut self, msg: RingMsg, ctx: &mut Context) -> Result<Ack, ActorError> {
        match msg {
            RingMsg::Chunk(c) => self.queue(Inbound::Chunk(c), ctx).await,
            RingMsg::Abandon(a) => self.queue(Inbound::Abandon(a), ctx).await,
            RingMsg::Close => {
                ctx.stop();
                Ok(Ack)
            }
        }
    }
}

impl RingInbox {
    async fn queue(&mut self, item: Inbound, ctx: &mut Context) -> Result<Ack, ActorError> {
        match self.queue.send(item).await {
            Ok(()) => Ok(Ack),
            Err(_) => {
                ctx.stop();
                Err(ActorError::Unavailable("the ring member is gone".into()))
            }
        }
    }
}

/// One member of a ring all-reduce: its inbox actor (reachable from other nodes) and
/// the queue behind it. Use it from async code ([`RingMember::all_reduce_mean`]) or
/// from a compute thread ([`RingMember::all_reduce_mean_blocking`]).
pub struct RingMember {
    inbox: ActorRef<RingMsg, Ack>,
    queue: Option<mpsc::Receiver<Inbound>>,
    node: WeakNode,
    runtime: tokio::runtime::Handle,
    spec: Option<RingSpec>,
}

impl std::fmt::Debug for RingMember {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RingMember")
            .field("inbox", self.inbox.id())
            .field("spec", &self.spec)
            .finish()
    }
}

impl RingMember {
    /// Spawns this member's inbox on `node` as `node/role/replica`. Call it from within
    /// the node's tokio runtime.
    pub fn start(node: &Node, role: &str, replica: u32) -> Result<Self, CollectiveError> {
        let (tx, rx) = mpsc::channel(INBOX_QUEUE);
        let inbox = node
            .spawn(role, replica, RingInbox { queue: tx })
            .map_err(CollectiveError::Spawn)?;
        Ok(RingMember {
            inbox,
            queue: Some(rx),
            node: node.downgrade(),
            runtime: tokio::runtime::Handle::current(),
            spec: None,
        })
    }

    /// This member's inbox: what the other members send to (its entry in
    /// [`RingSpec::members`]).
    pub fn inbox_id(&self) -> &ActorId {
        self.inbox.id()
    }

    /// The ring this member is in, once joined.
    pub fn spec(&self) -> Option<&RingSpec> {
        self.spec.as_ref()
    }

    /// Joins the ring `spec` describes (replacing any earlier one).
    pub fn join(&mut self, spec: RingSpec) -> Result<(), CollectiveError> {
        let n = spec.members.len();
        let rank = spec.rank as usize;
        if rank >= n {
            return Err(CollectiveError::BadSpec(format!(
                "rank {rank} in a ring of {n} members"
            )));
        }
        if spec.members[rank] != *self.inbox_id() {
            return Err(CollectiveError::BadSpec(format!(
                "member {rank} is {}, but this member's inbox is {}",
                spec.members[rank],
                self.inbox_id()
            )));
        }
        let mut ids: Vec<&ActorId> = spec.members.iter().collect();
        ids.sort();
        ids.dedup();
        if ids.len() != n {
            return Err(CollectiveError::BadSpec(
                "a member is listed twice".to_string(),
            ));
        }
        if spec.timeout.is_zero() {
            return Err(CollectiveError::BadSpec("the timeout must be > 0".into()));
        }
        // A ring rebuilt after a member died retries the same round: chunks that an
        // abandoned attempt left queued would be taken for the retry's.
        if let Some(queue) = self.queue.as_mut() {
            let mut dropped = 0;
            while queue.try_recv().is_ok() {
                dropped += 1;
            }
            if dropped > 0 {
                tracing::debug!(
                    dropped,
                    "joining a ring: dropped chunks of an abandoned round"
                );
            }
        }
        self.spec = Some(spec);
        Ok(())
    }

    /// Replaces `buf` with the mean of every member's `buf` (bit-identical on every
    /// member). `round` numbers the all-reduce; every member must pass the same one.
    pub async fn all_reduce_mean(
        &mut self,
        buf: &mut [f32],
        round: u64,
    ) -> Result<(), CollectiveError> {
        self.run(buf, round, RingOp::AllReduceMean).await
    }

    /// Sums every member's `buf` segment by segment, leaving in this member's own
    /// segment (`ring_segments(buf.len(), n)[rank]`) the sum over the ring; the rest
    /// of `buf` is scratch. Sharded training's gradient step.
    pub async fn reduce_scatter_sum(
        &mut self,
        buf: &mut [f32],
        round: u64,
    ) -> Result<(), CollectiveError> {
        self.run(buf, round, RingOp::ReduceScatterSum).await
    }

    /// Fills `buf` with every member's own segment (`ring_segments(buf.len(),
    /// n)[rank]`, which each member fills before the call). Sharded training's
    /// weight gather.
    pub async fn all_gather(&mut self, buf: &mut [f32], round: u64) -> Result<(), CollectiveError> {
        self.run(buf, round, RingOp::AllGather).await
    }

    async fn run(
        &mut self,
        buf: &mut [f32],
        round: u64,
        op: RingOp,
    ) -> Result<(), CollectiveError> {
        let spec = self.spec.clone().ok_or(CollectiveError::NotJoined)?;
        let node = self.node.upgrade().ok_or(CollectiveError::Stopped)?;
        let queue = self.queue.as_mut().ok_or(CollectiveError::Stopped)?;
        ring_round(queue, &spec, &node, buf, round, op).await
    }

    /// [`RingMember::all_reduce_mean`] for a thread outside the runtime (a role's
    /// compute thread): the exchange runs as a task on the runtime that started this
    /// member while the thread waits. Must not be called from within the runtime.
    pub fn all_reduce_mean_blocking(
        &mut self,
        buf: Vec<f32>,
        round: u64,
    ) -> Result<Vec<f32>, CollectiveError> {
        self.run_blocking(buf, round, RingOp::AllReduceMean)
    }

    /// [`RingMember::reduce_scatter_sum`] for a thread outside the runtime. `buf` is
    /// any owned `f32` storage (a `Vec`, or a wrapper over a tensor's memory, so that
    /// nothing is copied in or out); it comes back with the result.
    pub fn reduce_scatter_sum_blocking<B: AsMut<[f32]> + Send + 'static>(
        &mut self,
        buf: B,
        round: u64,
    ) -> Result<B, CollectiveError> {
        self.run_blocking(buf, round, RingOp::ReduceScatterSum)
    }

    /// [`RingMember::all_gather`] for a thread outside the runtime (`buf` as in
    /// [`RingMember::reduce_scatter_sum_blocking`]).
    pub fn all_gather_blocking<B: AsMut<[f32]> + Send + 'static>(
        &mut self,
        buf: B,
        round: u64,
    ) -> Result<B, CollectiveError> {
        self.run_blocking(buf, round, RingOp::AllGather)
    }

    fn run_blocking<B: AsMut<[f32]> + Send + 'static>(
        &mut self,
        buf: B,
        round: u64,
        op: RingOp,
    ) -> Result<B, CollectiveError> {
        let spec = self.spec.clone().ok_or(CollectiveError::NotJoined)?;
        let node = self.node.upgrade().ok_or(CollectiveError::Stopped)?;
        let mut queue = self.queue.take().ok_or(CollectiveError::Stopped)?;
        let (tx, rx) = oneshot::channel();
        self.runtime.spawn(async move {
            let mut buf = buf;
            let result = ring_round(&mut queue, &spec, &node, buf.as_mut(), round, op).await;
            let _ = tx.send((queue, buf, result));
        });
        // Every wait inside the task has a deadline, so this returns; it fails only
        // when the runtime drops the task (shutting down).
        let (queue, buf, result) = rx.blocking_recv().map_err(|_| CollectiveError::Stopped)?;
        self.queue = Some(queue);
        result.map(|()| buf)
    }
}

/// What a round of the ring computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RingOp {
    /// Reduce-scatter, divide, all-gather: every member gets the mean.
    AllReduceMean,
    /// Reduce-scatter alone: member `rank` gets the sum of segment `rank`.
    ReduceScatterSum,
    /// All-gather alone: every member gets every member's own segment.
    AllGather,
}

impl Drop for RingMember {
    fn drop(&mut self) {
        // The inbox is local: the send completes on the first poll, or the inbox is
        // already gone (a full inbox stops by itself once it finds its queue closed).
        use futures::FutureExt;
        let _ = self.inbox.try_tell(RingMsg::Close).now_or_never();
    }
}

/// The ranges of `len` values the `n` members of a ring own, in order: as equal as can
/// be, the first `len % n` one longer.
pub fn ring_segments(len: usize, n: usize) -> Vec<Range<usize>> {
    let n = n.max(1);
    let (base, extra) = (len / n, len % n);
    let mut start = 0;
    (0..n)
        .map(|k| {
            let end = start + base + usize::from(k < extra);
            let r = start..end;
            start = end;
            r
        })
        .collect()
}

/// A ring's identity on the wire: FNV-1a over its members' ids in ring order. Rings
/// that differ in any member or in their order differ here (up to a 64-bit collision).
fn ring_fingerprint(members: &[ActorId]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for id in members {
        for b in id.to_string().bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// [`ring_exchange`], telling the other members when this one gives up.
async fn ring_round(
    queue: &mut mpsc::Receiver<Inbound>,
    spec: &RingSpec,
    node: &Node,
    buf: &mut [f32],
    round: u64,
    op: RingOp,
) -> Result<(), CollectiveError> {
    let result = ring_exchange(queue, spec, node, buf, round, op).await;
    match &result {
        // Whoever gave up first has told everyone.
        Ok(()) | Err(CollectiveError::Abandoned { .. }) => {}
        Err(e) => abandon(spec, node, round, e.to_string()),
    }
    result
}

/// Tells every other member of the ring that this one gave up on `round`: each send is
/// an ask with the spec's deadline (at most 5 s), in a task of its own, so that giving
/// up never waits on a member that is gone too.
fn abandon(spec: &RingSpec, node: &Node, round: u64, reason: String) {
    let me = &spec.members[spec.rank as usize];
    let note = Abandon {
        round,
        members: spec.members.clone(),
        by: me.clone(),
        reason,
    };
    let timeout = spec.timeout.min(Duration::from_secs(5));
    for to in spec.members.iter().filter(|m| *m != me) {
        let Ok(peer) = node.actor_ref::<RingMsg, Ack>(to) else {
            continue;
        };
        let note = note.clone();
        tokio::spawn(async move {
            if let Err(e) = peer.ask(RingMsg::Abandon(note), timeout).await {
                tracing::debug!(to = %peer.id(), error = %e, "telling a ring member this one gave up");
            }
        });
    }
}

async fn ring_exchange(
    queue: &mut mpsc::Receiver<Inbound>,
    spec: &RingSpec,
    node: &Node,
    buf: &mut [f32],
    round: u64,
    op: RingOp,
) -> Result<(), CollectiveError> {
    let n = spec.members.len();
    if n <= 1 {
        return Ok(());
    }
    let rank = spec.rank as usize;
    let next_id = &spec.members[(rank + 1) % n];
    let next = node
        .actor_ref::<RingMsg, Ack>(next_id)
        .map_err(|e| CollectiveError::Send {
            round,
            step: 0,
            to: next_id.clone(),
            source: match e {
                NodeError::Call(c) => c,
                other => CallError::Codec(other.to_string()),
            },
        })?;
    let link = Link {
        members: &spec.members,
        ring: ring_fingerprint(&spec.members),
        next: &next,
        prev: &spec.members[(rank + n - 1) % n],
        node,
        timeout: spec.timeout,
        chunk: ((spec.chunk_bytes / 4).max(1)) as usize,
        round,
        total: buf.len() as u64,
    };
    let segs = ring_segments(buf.len(), n);
    let seg = |k: usize| segs[k % n].clone();
    // The mean's reduce-scatter leaves member `rank` the sum of segment `rank + 1`
    // (the classic ring); the sharded reduce-scatter and all-gather use segment `rank`
    // (a rank owns its own shard). `own` is that offset.
    let own = usize::from(op == RingOp::AllReduceMean);
    if op != RingOp::AllGather {
        // At step s, send segment rank + own - 1 - s and add the one before it.
        for s in 0..n - 1 {
            let send = seg(rank + own + 2 * n - 1 - s);
            let recv = seg(rank + own + 2 * n - 2 - s);
            link.exchange(queue, buf, s as u32, send, recv, |acc, x| *acc = x + *acc)
                .await?;
        }
    }
    if op == RingOp::AllReduceMean {
        // This member holds the full sum of segment rank + 1: it alone divides, so
        // every member gets the same bits.
        let scale = n as f32;
        for x in &mut buf[seg(rank + 1)] {
            *x /= scale;
        }
    }
    if op != RingOp::ReduceScatterSum {
        // All-gather: pass each owned segment on round the ring.
        for s in 0..n - 1 {
            let send = seg(rank + own + n - s);
            let recv = seg(rank + own + 2 * n - 1 - s);
            let step = (n - 1 + s) as u32;
            link.exchange(queue, buf, step, send, recv, |acc, x| *acc = x)
                .await?;
        }
    }
    Ok(())
}

/// One member's view of the ring during a round.
struct Link<'a> {
    members: &'a [ActorId],
    /// [`ring_fingerprint`] of `members`.
    ring: u64,
    next: &'a ActorRef<RingMsg, Ack>,
    prev: &'a ActorId,
    node: &'a Node,
    timeout: Duration,
    chunk: usize,
    round: u64,
    total: u64,
}

impl Link<'_> {
    /// Sends `buf[send]` to the next member while folding the previous member's
    /// `recv` segment into `buf` with `fold(own, received)`. Sending and receiving run
    /// together, so no member waits on a full inbox while its own fills up.
    async fn exchange(
        &self,
        queue: &mut mpsc::Receiver<Inbound>,
        buf: &mut [f32],
        step: u32,
        send: Range<usize>,
        recv: Range<usize>,
        fold: impl Fn(&mut f32, f32),
    ) -> Result<(), CollectiveError> {
        let out = self.chunks(&buf[send.clone()], send.start, step);
        let sending = async {
            for c in out {
                self.next
                    .ask(RingMsg::Chunk(c), self.timeout)
                    .await
                    .map_err(|source| CollectiveError::Send {
                        round: self.round,
                        step,
                        to: self.next.id().clone(),
                        source,
                    })?;
            }
            Ok(())
        };
        let receiving = self.receive(queue, buf, step, recv, fold);
        tokio::try_join!(sending, receiving).map(|_| ())
    }

    fn chunks(&self, values: &[f32], offset: usize, step: u32) -> Vec<RingChunk> {
        values
            .chunks(self.chunk)
            .enumerate()
            .map(|(i, piece)| {
                let mut data = Vec::with_capacity(piece.len() * 4);
                for x in piece {
                    data.extend_from_slice(&x.to_le_bytes());
                }
                RingChunk {
                    ring: self.ring,
                    round: self.round,
                    step,
                    offset: (offset + i * self.chunk) as u64,
                    total: self.total,
                    data: Bytes::from(data),
                }
            })
            .collect()
    }

    async fn receive(
        &self,
        queue: &mut mpsc::Receiver<Inbound>,
        buf: &mut [f32],
        step: u32,
        range: Range<usize>,
        fold: impl Fn(&mut f32, f32),
    ) -> Result<(), CollectiveError> {
        let gone = self.node.monitor(self.prev);
        tokio::pin!(gone);
        let mut at = range.start;
        while at < range.end {
            let c = tokio::select! {
                // Chunks already queued first: a member that sent its last chunk and left
                // (its part of the round done) has not failed this one.
                biased;
                c = queue.recv() => c.ok_or(CollectiveError::Stopped),
                reason = &mut gone => return Err(CollectiveError::PeerDown {
                    round: self.round,
                    peer: self.prev.clone(),
                    reason: format!("{reason:?}"),
                }),
                () = tokio::time::sleep(self.timeout) => return Err(CollectiveError::Timeout {
                    round: self.round,
                    step,
                    from: self.prev.clone(),
                    after: self.timeout,
                }),
            }?;
            let c = match c {
                Inbound::Chunk(c) => c,
                Inbound::Abandon(a) if a.round == self.round && a.members == self.members => {
                    return Err(CollectiveError::Abandoned {
                        round: a.round,
                        by: a.by,
                        reason: a.reason,
                    })
                }
                Inbound::Abandon(a) => {
                    tracing::debug!(round = a.round, by = %a.by, "dropping the abandon of another round or ring");
                    continue;
                }
            };
            if c.round < self.round || c.ring != self.ring {
                // An abandoned round's, or an earlier ring's that was still in flight
                // when this member joined the rebuilt one.
                tracing::debug!(
                    round = c.round,
                    ring = c.ring,
                    "dropping a chunk of an abandoned round or ring"
                );
                continue;
            }
            let len = (range.end - at).min(self.chunk);
            let fits = c.round == self.round
                && c.step == step
                && c.offset == at as u64
                && c.total == self.total
                && c.data.len() == len * 4;
            if !fits {
                return Err(CollectiveError::OutOfStep {
                    round: self.round,
                    step,
                    reason: format!(
                        "expected {len} values at {at} of {} (round {}, step {step}), got {} bytes at {} of {} (round {}, step {})",
                        self.total, self.round, c.data.len(), c.offset, c.total, c.round, c.step
                    ),
                });
            }
            for (acc, x) in buf[at..at + len].iter_mut().zip(c.data.chunks_exact(4)) {
                fold(acc, f32::from_le_bytes([x[0], x[1], x[2], x[3]]));
            }
            at += len;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (CI on c8f847d): a chunk that the ring before a rebuild still had in
    /// flight reached the rebuilt ring's retry of the same round and failed it as out
    /// of step. Chunks now name their ring, and another ring's are dropped.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_chunk_of_an_earlier_ring_is_dropped_by_the_retry_of_its_round() {
        let dir = tempfile::tempdir().unwrap();
        let node = Node::builder("stale-a")
            .dev_certs(dir.path())
            .start()
            .await
            .unwrap();
        let mut members: Vec<RingMember> = (0..2)
            .map(|i| RingMember::start(&node, "ring", i).unwrap())
            .collect();
        let ids: Vec<ActorId> = members.iter().map(|m| m.inbox_id().clone()).collect();
        for (rank, m) in members.iter_mut().enumerate() {
            m.join(RingSpec {
                rank: rank as u32,
                members: ids.clone(),
                timeout: Duration::from_secs(10),
                chunk_bytes: 4,
            })
            .unwrap();
        }
        // Member 0 first expects value 2 of segment 1 (round 5, step 0). What arrives
        // first is a chunk of the same round and step from a ring of other members.
        let earlier = ring_fingerprint(&[ids[1].clone(), ids[0].clone()]);
        let inbox = node.actor_ref::<RingMsg, Ack>(&ids[0]).unwrap();
        let stale = RingChunk {
            ring: earlier,
            round: 5,
            step: 0,
            offset: 3,
            total: 4,
            data: Bytes::copy_from_slice(&100f32.to_le_bytes()),
        };
        inbox
            .ask(RingMsg::Chunk(stale), Duration::from_secs(5))
            .await
            .unwrap();
        let inputs = [vec![1.0f32, 2.0, 3.0, 4.0], vec![3.0, 4.0, 5.0, 6.0]];
        let runs = members.iter_mut().zip(&inputs).map(|(m, x)| async move {
            let mut buf = x.clone();
            m.all_reduce_mean(&mut buf, 5).await.map(|()| buf)
        });
        for got in futures::future::try_join_all(runs).await.unwrap() {
            assert_eq!(got, vec![2.0, 3.0, 4.0, 5.0]);
        }
        drop(members);
        node.shutdown().await;
    }
}
