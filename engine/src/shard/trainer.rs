//! The sharded trainer (ZeRO-3 / FSDP): each rank of a replica holds only its shard of
//! every unit's f32 master weights, gradients and AdamW moments, and gathers a unit's
//! weights just before it runs and frees them after.
//!
//! Per micro-batch, forward: gather each unit, run it without gradients, keep only the
//! layers' inputs (activation checkpoints), free it. Then the head runs forward and
//! backward at once (the chunked LM head), and in reverse each layer is gathered again,
//! recomputed from its input with gradients, backpropagated, and its gradient
//! reduce-scattered into the ranks' gradient shards. With tied embeddings the embedding
//! weights gathered first stay until the head has used them; the embedding lookup's
//! gradient needs no weights, and the head runs forward and backward at once, so the
//! embeddings and the head are gathered once and every layer twice, and each unit's
//! gradient is reduce-scattered once ([`moved_bytes_per_micro_batch`]): a little under
//! 3·(N−1)/N·Ψ·b per rank per micro-batch.
//!
//! With [`ShardedTrainer::prefetch`] the collectives run on the rank's communication
//! thread ([`CommThread`]) while it computes: the next unit's gather is submitted
//! before the current unit runs ([`PREFETCH_DEPTH`] units ahead), and a unit's
//! gradient reduce-scatter runs while the next unit backpropagates. The collectives
//! keep one order on every rank, so the results are the same bits either way.

use super::comm::{CommThread, Pending, WaitingSince};
use super::group::{ReduceOp, ShardGroup};
use super::layout::{layout_of, model_layout, shard_of, UnitLayout};
use crate::config::ModelConfig;
use crate::error::{EngineError, Result};
use crate::model::{backward_with, positions_from_mask, Attn, Llama, UnitPass};
use crate::score::{
    chunked_backward, predicting_rows, token_layout, HeadInput, SeqBatch, TokenScores,
};
use crate::train::{Moments, StepStats, TrainConfig};
use std::collections::VecDeque;
use std::time::Instant;

use tch::{Kind, Tensor};

/// Units whose gathers are in flight ahead of the one running, with
/// [`ShardedTrainer::prefetch`]: each is one more unit's weights held at once, so one
/// (the next unit) is enough to hide a gather no longer than a unit's compute.
pub const PREFETCH_DEPTH: usize = 1;

/// A unit's gathered weights: the flat buffer, and with gradients one leaf per
/// parameter (views of the buffer's memory).
pub(super) struct Gathered {
    unit: usize,
    flat: Tensor,
    leaves: Vec<Tensor>,
}

/// One rank's part of one unit's training state, all f32 `[shard_len]`.
pub(crate) struct UnitState {
    pub(crate) master: Tensor,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    pub(crate) grad: Tensor,
    /// The ranges of this shard (start, len) whose parameters take weight decay.
    pub(crate) decay: Vec<(i64, i64)>,
}

/// What crossed the wire for one rank, summed over a step (or the trainer's life).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct CommStats {
    /// Bytes this rank received in all-gathers: (N−1)/N of each gathered unit.
    pub gathered_bytes: u64,
    /// Bytes this rank sent in reduce-scatters: (N−1)/N of each unit's gradient.
    pub reduced_bytes: u64,
    /// Seconds the rank's communication thread spent in all-gathers, waiting for the
    /// other ranks to come included (with prefetch they are submitted a unit early, so
    /// this grows by the time the peers take to reach the same point).
    pub gather_s: f64,
    /// The part of `gather_s` the compute thread spent waiting: the gather time
    /// prefetch left exposed (all of it without prefetch).
    pub gather_exposed_s: f64,
    /// Seconds the rank's communication thread spent in reduce-scatters.
    pub reduce_s: f64,
    /// The part of `reduce_s` the compute thread spent waiting.
    pub reduce_exposed_s: f64,
    /// All-gathers run.
    pub gathers: u64,
    /// Bytes this rank sent averaging its gradient shards with the other replicas'
    /// (HSDP): 2·(R−1)/R of its shards for R replicas, 0 with one.
    pub replica_bytes: u64,
    /// Seconds spent averaging gradient shards with the other replicas.
    pub replica_s: f64,
}

impl CommStats {
    /// What was added since `before`.
    fn since(&self, before: &CommStats) -> CommStats {
        CommStats {
            gathered_bytes: self.gathered_bytes - before.gathered_bytes,
            reduced_bytes: self.reduced_bytes - before.reduced_bytes,
            gather_s: self.gather_s - before.gather_s,
            gather_exposed_s: self.gather_exposed_s - before.gather_exposed_s,
            reduce_s: self.reduce_s - before.reduce_s,
            reduce_exposed_s: self.reduce_exposed_s - before.reduce_exposed_s,
            gathers: self.gathers - before.gathers,
            replica_bytes: self.replica_bytes - before.replica_bytes,
            replica_s: self.replica_s - before.replica_s,
        }
    }
}

/// A unit's gather in flight.
struct GatherAhead {
    unit: usize,
    pending: Pending,
}

/// A unit's gradient reduce-scatter in flight, and the bytes it holds until done.
struct ReduceInFlight {
    unit: usize,
    pending: Pending,
    bytes: u64,
}

/// What one sharded step did: the step's statistics (the same for every rank) and this
/// rank's memory and traffic.
#[derive(Debug, Clone, PartialEq)]
pub struct ShardedStepStats {
    /// Loss (summed over the ranks), gradient norm (over all shards), LR.
    pub step: StepStats,
    /// This rank's traffic during the step.
    pub comm: CommStats,
    /// Bytes of this rank's training state: its shards of the master weights, gradients
    /// and both moments (16Ψ/N in f32), plus the most gathered weights and gradients
    /// held at once during the step.
    pub train_state_bytes: u64,
    /// The most gathered weights and unit gradients held at once during the step, a
    /// prefetched unit and a gradient being reduce-scattered included.
    pub peak_gathered_bytes: u64,
    /// Micro-batches every rank ran (the most any rank had).
    pub micro_batches: usize,
    /// Seconds of the optimizer step on this rank's shards (the gradient norm's
    /// all-reduce included): it shrinks with N, unlike the forward and backward.
    pub update_s: f64,
}

/// What [`ShardedTrainer::forward_layers`] leaves for the head.
pub(super) struct LayersOut {
    /// The micro-batch's positions and masks, unless this rank has none.
    pub(super) pass: Option<UnitPass>,
    /// The last layer's output.
    pub(super) x: Option<Tensor>,
    /// The tied embeddings, held until the head has run.
    pub(super) embed: Option<Gathered>,
    /// Each layer's input, when kept for the recompute.
    pub(super) inputs: Vec<Option<Tensor>>,
}

/// A sharded step's head and the loss of its output: each micro-batch's (by index)
/// loss, scaled as the caller wants it.
pub(super) enum HeadLoss<'a> {
    /// The LM head's log-probs and entropies (chunked), at `temperature`.
    Tokens {
        temperature: f64,
        loss: &'a mut dyn FnMut(usize, &TokenScores) -> Result<Tensor>,
    },
    /// The scalar head's values `[B, T]`.
    Values(&'a mut dyn FnMut(usize, &Tensor) -> Result<Tensor>),
}

/// A model whose training state is sharded over the ranks of a [`ShardGroup`].
pub struct ShardedTrainer {
    /// The model: a skeleton whose units hold weights only while they run.
    pub model: Llama,
    /// Optimizer settings.
    pub config: TrainConfig,
    /// Overlap the collectives with compute ([`PREFETCH_DEPTH`] units gathered ahead,
    /// one reduce-scatter in flight); on by default. Off, every collective is waited on
    /// as it is submitted. Every rank of a replica must use the same setting (the
    /// collectives run in another order).
    pub prefetch: bool,
    pub(crate) layout: Vec<UnitLayout>,
    pub(crate) state: Vec<UnitState>,
    /// The rank's group, on its communication thread.
    pub(crate) group: CommThread,
    /// With replicas of the sharded model (HSDP): this rank and the ranks holding the
    /// same shards in the other replicas, which average their gradient shards before
    /// every optimizer step.
    replicas: Option<CommThread>,
    pub(crate) step: u64,
    comm: CommStats,
    held: u64,
    peak_held: u64,
    /// The units this micro-batch gathers, in order, and how many are submitted.
    pub(super) gather_order: Vec<usize>,
    pub(super) submitted: usize,
    ahead: VecDeque<GatherAhead>,
    reducing: Option<ReduceInFlight>,
}

fn f32_zeros(n: i64, device: tch::Device) -> Tensor {
    Tensor::zeros([n], (Kind::Float, device))
}

fn grad_or_zeros(flat: &Tensor) -> Tensor {
    let g = flat.grad();
    if g.defined() {
        g
    } else {
        flat.detach().zeros_like()
    }
}

impl ShardedTrainer {
    /// Shards `model` (the same weights on every rank) over `group`: this rank keeps its
    /// shard of each unit and frees the model's weights unit by unit, so the peak is the
    /// model in its dtype, never the unsharded training state.
    pub fn new(model: Llama, config: TrainConfig, group: Box<dyn ShardGroup>) -> Result<Self> {
        Self::shard(model, config, group, false)
    }

    /// Shards `model` over `group` to score with, never to train (a reference model):
    /// each rank keeps only its shard of the f32 weights, 4Ψ/N, with no gradients or
    /// moments. [`ShardedTrainer::score_tokens`] and the gathers serve it; a step or a
    /// save is refused.
    pub fn frozen(model: Llama, group: Box<dyn ShardGroup>) -> Result<Self> {
        Self::shard(model, TrainConfig::default(), group, true)
    }

    fn shard(
        mut model: Llama,
        config: TrainConfig,
        group: Box<dyn ShardGroup>,
        frozen: bool,
    ) -> Result<Self> {
        model.check_unit_trainable()?;
        let layout = layout_of(&model);
        check_world(&layout, group.world())?;
        let (rank, world) = (group.rank(), group.world());
        let device = model.device();
        let kind = model.kind();
        let mut state = Vec::with_capacity(layout.len());
        for ul in &layout {
            let params = model.unit_parameters_mut(ul.unit);
            let mut parts = Vec::with_capacity(params.len());
            for ((name, p), slot) in params.into_iter().zip(&ul.slots) {
                if *name != slot.name || p.size() != slot.shape {
                    return Err(EngineError::InvalidArgument(format!(
                        "parameter `{name}` has shape {:?}, the model's config says `{}` {:?}",
                        p.size(),
                        slot.name,
                        slot.shape
                    )));
                }
                parts.push(p.detach().to_kind(Kind::Float).reshape([-1]));
                *p = Tensor::empty([0], (kind, device));
            }
            let flat = Tensor::cat(&parts, 0);
            drop(parts);
            let master = shard_of(&flat, ul.numel, rank, world);
            drop(flat);
            state.push(match frozen {
                true => UnitState::frozen(master),
                false => UnitState::new(master, decay_ranges(ul, &config, rank, world)),
            });
        }
        Self::assemble(model, config, layout, state, group)
    }

    /// Whether this rank only scores ([`ShardedTrainer::frozen`]).
    pub fn is_frozen(&self) -> bool {
        self.state
            .first()
            .is_some_and(|s| s.grad.numel() == 0 && s.master.numel() > 0)
    }

    fn refuse_if_frozen(&self, what: &str) -> Result<()> {
        match self.is_frozen() {
            true => Err(EngineError::InvalidArgument(format!(
                "a frozen sharded model (a reference) does not {what}"
            ))),
            false => Ok(()),
        }
    }

    pub(crate) fn assemble(
        model: Llama,
        config: TrainConfig,
        layout: Vec<UnitLayout>,
        state: Vec<UnitState>,
        group: Box<dyn ShardGroup>,
    ) -> Result<Self> {
        Ok(ShardedTrainer {
            model,
            config,
            prefetch: true,
            layout,
            state,
            group: CommThread::start(group)?,
            replicas: None,
            step: 0,
            comm: CommStats::default(),
            held: 0,
            peak_held: 0,
            gather_order: Vec::new(),
            submitted: 0,
            ahead: VecDeque::new(),
            reducing: None,
        })
    }

    /// This rank and the replica's rank count.
    pub fn rank(&self) -> (usize, usize) {
        (self.group.rank(), self.group.world())
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// Bytes of this rank's sharded state (master weights, gradients, moments).
    pub fn shard_state_bytes(&self) -> u64 {
        self.state
            .iter()
            .map(|s| 4 * (s.master.numel() + s.grad.numel() + s.m.numel() + s.v.numel()) as u64)
            .sum()
    }

    /// Traffic since the trainer was made.
    pub fn comm_stats(&self) -> &CommStats {
        &self.comm
    }

    /// Makes this rank one of `replicas.world()` replicas of the sharded model (HSDP:
    /// shard within a replica, replicate across): `replicas` holds this rank and the
    /// rank of the same shards in every other replica. Before each optimizer step the
    /// members average their gradient shards, so every replica takes the same step
    /// (the same bits: the sum runs in one order for all). Each replica still runs
    /// its own micro-batches and normalises its own loss, as replicas of the whole
    /// policy do. Every member must call it before its next step.
    pub fn join_replicas(&mut self, replicas: Box<dyn ShardGroup>) -> Result<()> {
        self.replicas = match replicas.world() {
            1 => None,
            _ => Some(CommThread::start(replicas)?),
        };
        Ok(())
    }

    /// Replicas of the sharded model this rank averages its gradients with (1: none).
    pub fn replicas(&self) -> usize {
        self.replicas.as_ref().map_or(1, CommThread::world)
    }

    /// One optimizer step. This rank's `micro_batches` (each rank brings its own part of
    /// the global batch; the counts may differ: the ranks agree on the largest and a
    /// rank short of micro-batches takes part in the collectives with none) each run
    /// forward and backward, `loss` mapping its token scores to a loss already scaled as
    /// the caller wants it (say, divided by the global token count). The step's loss is
    /// the sum of those over micro-batches and ranks. With no micro-batch on any rank
    /// the step is taken with zero gradients.
    pub fn step_tokens(
        &mut self,
        micro_batches: &[SeqBatch],
        temperature: f64,
        mut loss: impl FnMut(usize, &TokenScores) -> Result<Tensor>,
    ) -> Result<ShardedStepStats> {
        self.step_with(
            micro_batches,
            HeadLoss::Tokens {
                temperature,
                loss: &mut loss,
            },
        )
    }

    /// [`ShardedTrainer::step_tokens`] for a model with a scalar head (a critic):
    /// `loss` maps micro-batch `i`'s values `[B, T]` (the head at every position,
    /// padding zeroed, as [`crate::score::values`] gives them) to its scaled loss.
    pub fn step_values(
        &mut self,
        micro_batches: &[SeqBatch],
        mut loss: impl FnMut(usize, &Tensor) -> Result<Tensor>,
    ) -> Result<ShardedStepStats> {
        self.scalar_head("train on values")?;
        self.step_with(micro_batches, HeadLoss::Values(&mut loss))
    }

    /// Refuses what needs a scalar head on a model without one.
    pub(super) fn scalar_head(&self, what: &str) -> Result<()> {
        match self.model.head {
            Some(_) => Ok(()),
            None => Err(EngineError::InvalidArgument(format!(
                "a sharded language model has no scalar head to {what}: attach one (Llama::attach_head) before sharding"
            ))),
        }
    }

    fn step_with(
        &mut self,
        micro_batches: &[SeqBatch],
        mut head: HeadLoss<'_>,
    ) -> Result<ShardedStepStats> {
        self.refuse_if_frozen("train")?;
        tch::manual_seed(self.config.seed.wrapping_add(self.step) as i64);
        let before = self.comm.clone();
        self.reset_in_flight();
        let mut count = [micro_batches.len() as f64];
        self.group.all_reduce(&mut count, ReduceOp::Max)?;
        // With no micro-batch on any rank (none of the step's samples carries a
        // gradient) the step still counts, with zero gradients, as the unsharded
        // trainer's does: the step count and the LR schedule stay in line.
        let n = count[0] as usize;
        let mut total = 0.0;
        for i in 0..n {
            let mb = micro_batches.get(i);
            total += self.micro(mb, i, &mut head)?;
        }
        let mut sum = [total];
        self.group.all_reduce(&mut sum, ReduceOp::Sum)?;
        let t0 = Instant::now();
        let (grad_norm, lr) = self.apply()?;
        let update_s = t0.elapsed().as_secs_f64();
        let comm = self.comm.since(&before);
        Ok(ShardedStepStats {
            step: StepStats {
                step: self.step,
                loss: sum[0],
                grad_norm,
                lr,
            },
            comm,
            train_state_bytes: self.shard_state_bytes() + self.peak_held,
            peak_gathered_bytes: self.peak_held,
            micro_batches: n,
            update_s,
        })
    }

    /// Drops whatever a failed collective pass left in flight: between passes nothing
    /// is held.
    pub(super) fn reset_in_flight(&mut self) {
        self.ahead.clear();
        self.reducing = None;
        self.held = 0;
        self.peak_held = 0;
    }

    /// Submits the gather of the micro-batch's next unit in order, counting its
    /// weights as held from now on.
    pub(super) fn submit_next_gather(&mut self) -> Result<()> {
        let unit = self.gather_order[self.submitted];
        self.submitted += 1;
        let kind = self.model.kind();
        let shard = self.state[unit].master.to_kind(kind);
        let bytes = shard.numel() * self.group.world() * kind.elt_size_in_bytes();
        self.hold(bytes as i64);
        let pending = self.group.submit_gather(shard)?;
        self.ahead.push_back(GatherAhead { unit, pending });
        Ok(())
    }

    /// Unit `u`'s weights (the next in the micro-batch's gather order) in the model's
    /// dtype, installed as views of the gathered buffer; with `grad` each parameter is
    /// a leaf of its own (a view of the buffer's memory) that collects its gradient in
    /// its own shape, so that no backward pass builds a zero-filled buffer-sized
    /// gradient per parameter. With prefetch the units after it are submitted first.
    pub(super) fn gather(&mut self, u: usize, grad: bool) -> Result<Gathered> {
        let since = match self.ahead.is_empty() {
            true => {
                self.submit_next_gather()?;
                WaitingSince::Submission
            }
            false => WaitingSince::Now,
        };
        let next = self.ahead.pop_front().expect("a gather was submitted");
        assert_eq!(next.unit, u, "units gathered out of their order");
        let depth = if self.prefetch { PREFETCH_DEPTH } else { 0 };
        while self.ahead.len() < depth && self.submitted < self.gather_order.len() {
            self.submit_next_gather()?;
        }
        let done = next.pending.wait(since)?;
        let flat = done.tensor;
        let kind = self.model.kind();
        let world = self.group.world() as u64;
        let bytes = flat.numel() as u64 * kind.elt_size_in_bytes() as u64;
        self.comm.gather_s += done.busy_s;
        self.comm.gather_exposed_s += done.exposed_s;
        self.comm.gathered_bytes += bytes / world * (world - 1);
        self.comm.gathers += 1;
        let ul = &self.layout[u];
        let mut leaves = Vec::new();
        for ((_, p), slot) in self
            .model
            .unit_parameters_mut(ul.unit)
            .into_iter()
            .zip(&ul.slots)
        {
            let view = flat
                .narrow(0, slot.offset, slot.numel)
                .view(slot.shape.as_slice());
            *p = match grad {
                true => {
                    let leaf = view.detach().set_requires_grad(true);
                    leaves.push(leaf.shallow_clone());
                    leaf
                }
                false => view,
            };
        }
        Ok(Gathered {
            unit: u,
            flat,
            leaves,
        })
    }

    /// Frees what a gathered unit holds (its gradients live on in whoever took them).
    pub(super) fn release(&mut self, g: Gathered) {
        let (kind, device) = (self.model.kind(), self.model.device());
        for (_, p) in self.model.unit_parameters_mut(self.layout[g.unit].unit) {
            *p = Tensor::empty([0], (kind, device));
        }
        self.hold(-((g.flat.numel() * kind.elt_size_in_bytes()) as i64));
    }

    /// A gathered unit's flat gradient, padding zero, counted as held until reduced.
    /// The reduce-scatter in flight is finished first: at most one unit's gradient is
    /// held beside the one being made.
    fn flat_grad(&mut self, g: &Gathered) -> Result<Tensor> {
        self.settle_reduce(WaitingSince::Now)?;
        let ul = &self.layout[g.unit];
        let padded = g.flat.numel() as i64;
        let grad = |l: &Tensor| {
            let gr = l.grad();
            match gr.defined() {
                true => gr.reshape([-1]),
                false => l.detach().zeros_like().reshape([-1]),
            }
        };
        let out = if g.leaves.len() == 1 && ul.numel == padded {
            // One parameter and no padding: its gradient is the flat gradient.
            grad(&g.leaves[0])
        } else {
            let mut parts: Vec<Tensor> = g.leaves.iter().map(grad).collect();
            if padded > ul.numel {
                let kind = self.model.kind();
                parts.push(Tensor::zeros([padded - ul.numel], (kind, g.flat.device())));
            }
            Tensor::cat(&parts, 0)
        };
        self.hold((out.numel() * out.kind().elt_size_in_bytes()) as i64);
        Ok(out)
    }

    fn hold(&mut self, bytes: i64) {
        self.held = (self.held as i64 + bytes).max(0) as u64;
        self.peak_held = self.peak_held.max(self.held);
    }

    /// Reduce-scatters a unit's flat gradient (from [`ShardedTrainer::flat_grad`];
    /// consumed: the group may use its memory) into this rank's gradient shard. With
    /// prefetch it stays in flight until [`ShardedTrainer::settle_reduce`].
    fn reduce_into(&mut self, u: usize, g: Tensor) -> Result<()> {
        self.settle_reduce(WaitingSince::Now)?;
        let bytes = g.numel() as u64 * g.kind().elt_size_in_bytes() as u64;
        let pending = self.group.submit_reduce_scatter(g.detach())?;
        self.reducing = Some(ReduceInFlight {
            unit: u,
            pending,
            bytes,
        });
        if !self.prefetch {
            self.settle_reduce(WaitingSince::Submission)?;
        }
        Ok(())
    }

    /// Waits for the reduce-scatter in flight, if any, and adds this rank's part to
    /// its gradient shard.
    fn settle_reduce(&mut self, since: WaitingSince) -> Result<()> {
        let Some(r) = self.reducing.take() else {
            return Ok(());
        };
        let done = r.pending.wait(since)?;
        let world = self.group.world() as u64;
        self.comm.reduce_s += done.busy_s;
        self.comm.reduce_exposed_s += done.exposed_s;
        self.comm.reduced_bytes += r.bytes / world * (world - 1);
        self.hold(-(r.bytes as i64));
        self.state[r.unit].grad += done.tensor.to_kind(Kind::Float);
        Ok(())
    }

    /// Starts a micro-batch whose units are gathered in `order`, and runs it (or, with
    /// `None`, this rank's part in the gathers of one it does not have) through the
    /// embeddings and every layer, unit by unit, each without gradients. `train`: the
    /// tied embeddings are gathered as a leaf that collects the head's gradient, and
    /// each layer's input is kept for its recompute.
    pub(super) fn forward_layers(
        &mut self,
        batch: Option<&SeqBatch>,
        order: Vec<usize>,
        train: bool,
    ) -> Result<LayersOut> {
        let head = self.layout.len() - 1;
        // Tied, the embeddings are the LM head's matrix too; a scalar head (a critic's)
        // does not read them.
        let tied = self.model.tied_embeddings() && self.model.head.is_none();
        self.gather_order = order;
        self.submitted = 0;
        if self.prefetch {
            // The embeddings' gather runs while the positions are made.
            self.submit_next_gather()?;
        }
        let pass: Option<UnitPass> = batch.map(|b| {
            let positions = positions_from_mask(&b.ids, Some(&b.attention_mask));
            self.model
                .unit_pass(&b.ids, &positions, Attn::Full { mask: None })
        });
        let embed = self.gather(0, tied && train)?;
        let mut x = pass
            .as_ref()
            .map(|p| tch::no_grad(|| self.model.run_embed(p)));
        // Tied, the embeddings are the head's matrix too: held until it has run.
        let embed = match tied {
            true => Some(embed),
            false => {
                self.release(embed);
                None
            }
        };
        let mut inputs = Vec::with_capacity(if train { head - 1 } else { 0 });
        for u in 1..head {
            let unit = self.gather(u, false)?;
            if let (Some(p), Some(xi)) = (&pass, x.as_ref()) {
                let y = tch::no_grad(|| self.model.run_layer(p, u - 1, xi));
                let input = x.replace(y);
                if train {
                    inputs.push(input);
                }
            }
            self.release(unit);
        }
        Ok(LayersOut {
            pass,
            x,
            embed,
            inputs,
        })
    }

    /// One micro-batch (or, with `None`, this rank's part in the collectives of a
    /// micro-batch it does not have). Returns the loss added.
    fn micro(
        &mut self,
        batch: Option<&SeqBatch>,
        index: usize,
        head_loss: &mut HeadLoss<'_>,
    ) -> Result<f64> {
        let head = self.layout.len() - 1;
        // Every unit forward, then the layers again in reverse; not the next
        // micro-batch's embeddings: gathering them early would hold a second
        // embedding-sized buffer beside the embedding gradient.
        let order = (0..=head).chain((1..head).rev()).collect();
        let LayersOut {
            pass,
            x,
            embed,
            mut inputs,
        } = self.forward_layers(batch, order, true)?;
        // The head, forward and backward at once.
        let head_unit = self.gather(head, true)?;
        let mut value = 0.0;
        let mut g = None;
        if let (Some(b), Some(p), Some(xl)) = (batch, &pass, x) {
            let last = xl.set_requires_grad(true);
            let h = self.model.run_final_norm(p, &last);
            value = match head_loss {
                HeadLoss::Tokens { temperature, loss } => {
                    let (rows, targets) = predicting_rows(&h, b);
                    let input = HeadInput {
                        rows,
                        targets,
                        tapes: vec![],
                    };
                    let chunk = self.model.memory.logprob_chunk_tokens;
                    let (bt, tt) = b.ids.size2().expect("[B, T]");
                    let scored = |lp: &Tensor, ent: &Tensor| {
                        let scores = TokenScores {
                            logprobs: token_layout(lp, b, bt, tt),
                            entropy: token_layout(ent, b, bt, tt),
                        };
                        loss(index, &scores)
                    };
                    chunked_backward(&self.model, input, *temperature, chunk, scored)?.0
                }
                HeadLoss::Values(loss) => {
                    let l = loss(index, &self.head_values(&h, b)?)?;
                    let v = l.double_value(&[]);
                    l.backward();
                    v
                }
            };
            g = Some(grad_or_zeros(&last));
        }
        let head_grad = self.flat_grad(&head_unit)?;
        self.release(head_unit);
        self.reduce_into(head, head_grad)?;
        // With tied embeddings the head's part of the embedding gradient waits for the
        // embedding's own: one reduce-scatter of the sum.
        let pending = match embed {
            Some(e) => {
                let g = self.flat_grad(&e)?;
                self.release(e);
                Some(g)
            }
            None => None,
        };
        // Backward through the layers, last first, each recomputed from its input.
        for u in (1..head).rev() {
            let unit = self.gather(u, true)?;
            if let (Some(p), Some(gy)) = (&pass, g.as_ref()) {
                let xin = inputs.pop().flatten().expect("one input per layer");
                let xg = xin.detach().set_requires_grad(true);
                let y = self.model.run_layer(p, u - 1, &xg);
                backward_with(&y, gy);
                g = Some(grad_or_zeros(&xg));
            }
            let unit_grad = self.flat_grad(&unit)?;
            self.release(unit);
            self.reduce_into(u, unit_grad)?;
        }
        // The embedding lookup's gradient needs no weights: each token's upstream row
        // is added to its id's column (the table is stored `[hidden, vocab]`). So the
        // embeddings are not gathered again, and no dense `[vocab, hidden]` gradient is
        // built and re-laid: the rows go straight into the head's part (tied) or zeros.
        let eg = match pending {
            Some(p) => p,
            None => {
                let padded =
                    self.layout[0].shard_len(self.group.world()) * self.group.world() as i64;
                let (kind, device) = (self.model.kind(), self.model.device());
                let z = Tensor::zeros([padded], (kind, device));
                self.hold((z.numel() * kind.elt_size_in_bytes()) as i64);
                z
            }
        };
        if let (Some(b), Some(gy)) = (batch, g.as_ref()) {
            let c = &self.model.config;
            let (hidden, vocab) = (c.hidden_size, c.vocab_size);
            let mut table = eg.narrow(0, 0, hidden * vocab).view([hidden, vocab]);
            let rows = gy.reshape([-1, hidden]).to_kind(table.kind());
            let _ = tch::no_grad(|| table.index_add_(1, &b.ids.reshape([-1]), &rows.tr()));
        }
        self.reduce_into(0, eg)?;
        // The embedding gradient is the largest: not held into the next micro-batch.
        self.settle_reduce(WaitingSince::Now)?;
        Ok(value)
    }

    /// The scalar head on the final hidden states `h` of `b`: `[B, T]` in f32, padding
    /// zeroed (what [`crate::score::values`] gives for the whole model).
    pub(super) fn head_values(&self, h: &Tensor, b: &SeqBatch) -> Result<Tensor> {
        let hd = self.model.head.as_ref().ok_or_else(|| {
            EngineError::InvalidArgument("values need a scalar head on the sharded model".into())
        })?;
        Ok(hd.forward(h).to_kind(Kind::Float) * b.attention_mask.to_kind(Kind::Float))
    }

    /// Clips the gradient over all shards and steps AdamW on this rank's shards.
    /// Returns the norm before clipping and the LR.
    fn apply(&mut self) -> Result<(f64, f64)> {
        self.average_over_replicas()?;
        let c = self.config.clone();
        let mut sq = [tch::no_grad(|| {
            self.state
                .iter()
                .map(|s| s.grad.square().sum(Kind::Double).double_value(&[]))
                .sum::<f64>()
        })];
        self.group.all_reduce(&mut sq, ReduceOp::Sum)?;
        let norm = sq[0].sqrt();
        let moments = Moments::for_step(&c, self.step);
        let lr = moments.lr;
        let coef = match c.max_grad_norm {
            Some(maxn) if maxn / (norm + 1e-6) < 1.0 => maxn / (norm + 1e-6),
            _ => 1.0,
        };
        tch::no_grad(|| {
            for s in &mut self.state {
                if coef != 1.0 {
                    let _ = s.grad.g_mul_scalar_(coef);
                }
                // The trainer's unsharded update, element for element.
                let upd = moments.update(&mut s.m, &mut s.v, &s.grad);
                if c.weight_decay > 0.0 {
                    for &(at, len) in &s.decay {
                        let _ = s
                            .master
                            .narrow(0, at, len)
                            .g_mul_scalar_(1.0 - lr * c.weight_decay);
                    }
                }
                let _ = s.master.g_add_(&upd);
                let _ = s.grad.zero_();
            }
        });
        self.step += 1;
        Ok((norm, lr))
    }

    /// With replicas: every unit's gradient shard becomes the mean of the replicas'
    /// (a reduce-scatter and an all-gather among them, the shard padded to split evenly).
    fn average_over_replicas(&mut self) -> Result<()> {
        let Some(replicas) = &self.replicas else {
            return Ok(());
        };
        let t0 = Instant::now();
        let r = replicas.world() as i64;
        for s in &mut self.state {
            let n = s.grad.numel() as i64;
            let per = (n + r - 1) / r;
            let full = match per * r - n {
                0 => s.grad.copy(),
                pad => Tensor::cat(&[&s.grad, &f32_zeros(pad, s.grad.device())], 0),
            };
            let mine = replicas
                .submit_reduce_scatter(full)?
                .wait(WaitingSince::Submission)?
                .tensor;
            let sum = replicas.all_gather(&mine)?;
            s.grad = tch::no_grad(|| sum.narrow(0, 0, n).to_kind(Kind::Float) / r as f64);
            self.comm.replica_bytes += 2 * (per * (r - 1)) as u64 * 4;
        }
        self.comm.replica_s += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// The whole model with the current weights in the compute dtype, without
    /// gradients: a collective (every rank must call it, and every rank gets the model).
    /// For weight sync and scoring by a caller that can hold the whole model.
    pub fn gathered_model(&mut self) -> Result<Llama> {
        self.gather_model(self.model.kind())
    }

    /// Ranks the state is sharded over.
    pub fn world(&self) -> usize {
        self.group.world()
    }

    /// Takes part in a [`ShardedTrainer::gathered_model`] another rank keeps: the same
    /// collectives, each gathered unit dropped at once, so this rank never holds more
    /// than one unit of the model.
    pub fn gather_for_peer(&mut self) -> Result<()> {
        let kind = self.model.kind();
        for u in 0..self.layout.len() {
            drop(self.group.all_gather(&self.state[u].master.to_kind(kind))?);
        }
        Ok(())
    }

    /// Every unit gathered into a whole model in `kind`, its parameters views of the
    /// gathered buffers.
    fn gather_model(&mut self, kind: Kind) -> Result<Llama> {
        let device = self.model.device();
        let head = self.model.head_shape();
        let mut model =
            Llama::skeleton_with_head(self.model.config.clone(), head.as_ref(), device, kind);
        model.memory = self.model.memory;
        for u in 0..self.layout.len() {
            let full = self.group.all_gather(&self.state[u].master.to_kind(kind))?;
            self.layout[u].install(&mut model, &full);
        }
        Ok(model)
    }

    /// Every unit's full f32 weights under their canonical names: a collective (every
    /// rank must call it), for checks, exports and merges. Holds the whole model.
    pub fn full_weights(&mut self) -> Result<Vec<(String, Tensor)>> {
        Ok(self.gather_model(Kind::Float)?.parameters())
    }
}

impl UnitState {
    pub(crate) fn new(master: Tensor, decay: Vec<(i64, i64)>) -> Self {
        let (n, dev) = (master.numel() as i64, master.device());
        UnitState {
            m: f32_zeros(n, dev),
            v: f32_zeros(n, dev),
            grad: f32_zeros(n, dev),
            master,
            decay,
        }
    }

    /// A shard that only scores: no gradient and no moments.
    pub(crate) fn frozen(master: Tensor) -> Self {
        let dev = master.device();
        UnitState {
            m: f32_zeros(0, dev),
            v: f32_zeros(0, dev),
            grad: f32_zeros(0, dev),
            master,
            decay: Vec::new(),
        }
    }
}

/// The parts of rank `rank`'s shard of `ul` (start, len within the shard) whose
/// parameters take weight decay (their names contain none of `no_decay`).
pub(crate) fn decay_ranges(
    ul: &UnitLayout,
    config: &TrainConfig,
    rank: usize,
    world: usize,
) -> Vec<(i64, i64)> {
    let (a, b) = ul.shard_range(rank, world);
    let mut out: Vec<(i64, i64)> = Vec::new();
    for s in &ul.slots {
        if config.no_decay.iter().any(|n| s.name.contains(n.as_str())) {
            continue;
        }
        let (lo, hi) = (s.offset.max(a), (s.offset + s.numel).min(b));
        if lo >= hi {
            continue;
        }
        match out.last_mut() {
            Some(last) if last.0 + last.1 == lo - a => last.1 += hi - lo,
            _ => out.push((lo - a, hi - lo)),
        }
    }
    out
}

/// Refuses a rank count the units of a model with `config` cannot be split over, with
/// the largest count that can: a check to run before any model is built.
pub fn check_shards(config: &ModelConfig, world: usize) -> Result<()> {
    check_world(&model_layout(config), world)
}

/// Refuses a rank count some unit cannot be split over: a rank whose shard of a unit
/// would be padding alone.
pub(crate) fn check_world(layout: &[UnitLayout], world: usize) -> Result<()> {
    if world == 0 {
        return Err(EngineError::InvalidArgument(
            "shards must be at least 1".into(),
        ));
    }
    if let Some(small) = layout.iter().min_by_key(|u| u.numel) {
        if (world as i64) > small.numel {
            return Err(EngineError::InvalidArgument(format!(
                "{world} shards cannot split unit `{}` of {} parameters: use at most {} shards",
                small.unit, small.numel, small.numel
            )));
        }
    }
    Ok(())
}
