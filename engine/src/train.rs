//! Training steps for caller-defined losses: micro-batches with gradient accumulation,
//! AdamW with weight-decay groups, gradient clipping, warm-up + constant/cosine LR,
//! f32 master weights when the model runs in bf16/f16 (bf16 on CUDA), gradient buckets
//! for all-reduce, offload/reload, and exact-resume checkpoints.

use crate::error::{EngineError, Result};
use crate::model::Llama;
use crate::weights::{to_buckets, WeightBucket};
use serde::{Deserialize, Serialize};
use tch::{Device, Kind, Tensor};

/// Learning-rate schedule (a multiplier of the base LR per optimizer step).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub enum LrSchedule {
    /// Linear warm-up from 0, then constant.
    Constant {
        /// Warm-up steps.
        warmup_steps: u64,
    },
    /// Linear warm-up, then cosine decay to `min_ratio · lr` at `total_steps`.
    Cosine {
        /// Warm-up steps.
        warmup_steps: u64,
        /// Step at which the decay ends.
        total_steps: u64,
        /// Final LR as a fraction of the base LR.
        min_ratio: f64,
    },
}

impl LrSchedule {
    /// The multiplier for optimizer step `step` (0-based).
    pub fn factor(&self, step: u64) -> f64 {
        let warm = |w: u64| {
            if w > 0 && step < w {
                (step + 1) as f64 / w as f64
            } else {
                1.0
            }
        };
        match *self {
            LrSchedule::Constant { warmup_steps } => warm(warmup_steps),
            LrSchedule::Cosine {
                warmup_steps,
                total_steps,
                min_ratio,
            } => {
                if warmup_steps > 0 && step < warmup_steps {
                    return warm(warmup_steps);
                }
                let span = total_steps.saturating_sub(warmup_steps).max(1) as f64;
                let t = ((step - warmup_steps) as f64 / span).min(1.0);
                min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + (std::f64::consts::PI * t).cos())
            }
        }
    }
}

/// Optimizer and step settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainConfig {
    /// Base learning rate.
    pub lr: f64,
    /// Adam betas.
    pub betas: (f64, f64),
    /// Adam epsilon.
    pub eps: f64,
    /// Decoupled weight decay for the decay group.
    pub weight_decay: f64,
    /// Parameters whose (canonical) name contains one of these get no weight decay.
    pub no_decay: Vec<String>,
    /// Clip the global gradient norm to this (None = no clipping).
    pub max_grad_norm: Option<f64>,
    /// LR schedule.
    pub schedule: LrSchedule,
    /// Seeds libtorch's RNG at every step (`seed + step`), so runs and resumes repeat.
    pub seed: u64,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            lr: 1e-5,
            betas: (0.9, 0.999),
            eps: 1e-8,
            weight_decay: 0.01,
            no_decay: vec![
                "ln1".into(),
                "ln2".into(),
                "norm".into(),
                "bias".into(),
                "bqkv".into(),
            ],
            max_grad_norm: Some(1.0),
            schedule: LrSchedule::Constant { warmup_steps: 0 },
            seed: 0,
        }
    }
}

/// One AdamW step's moment hyper-parameters (bias corrections `bc1`, `bc2` of this
/// step), shared by the whole and the sharded trainer.
pub(crate) struct Moments {
    pub(crate) b1: f64,
    pub(crate) b2: f64,
    pub(crate) bc1: f64,
    pub(crate) bc2: f64,
    pub(crate) eps: f64,
    pub(crate) lr: f64,
}

impl Moments {
    /// Step `step`'s settings (0-based: the step about to be taken): the scheduled LR
    /// and both bias corrections.
    pub(crate) fn for_step(c: &TrainConfig, step: u64) -> Self {
        let t = (step + 1) as f64;
        let (b1, b2) = c.betas;
        Moments {
            b1,
            b2,
            bc1: 1.0 - b1.powf(t),
            bc2: 1.0 - b2.powf(t),
            eps: c.eps,
            lr: c.lr * c.schedule.factor(step),
        }
    }

    /// Updates the moments `m`, `v` with the f32 gradient `g` and returns the step to
    /// add to the weights (before weight decay): `−lr/bc1 · m / (√(v/bc2) + eps)`.
    pub(crate) fn update(&self, m: &mut Tensor, v: &mut Tensor, g: &Tensor) -> Tensor {
        // Few passes over memory: m ← lerp(m, g, 1-β1); v ← β2·v + (1-β2)·g².
        let _ = m.lerp_(g, 1.0 - self.b1);
        let gs = g * (1.0 - self.b2).sqrt();
        let _ = v.g_mul_scalar_(self.b2);
        let _ = v.addcmul_(&gs, &gs);
        drop(gs);
        // Built in one temporary.
        let mut upd = v.sqrt();
        let _ = upd.g_mul_scalar_(1.0 / self.bc2.sqrt());
        let _ = upd.g_add_scalar_(self.eps);
        let _ = upd.reciprocal_();
        let _ = upd.g_mul_(m);
        let _ = upd.g_mul_scalar_(-self.lr / self.bc1);
        upd
    }
}

/// What one optimizer step did.
#[derive(Debug, Clone, PartialEq)]
pub struct StepStats {
    /// Optimizer steps taken so far (after this one).
    pub step: u64,
    /// Mean of the micro-batch losses.
    pub loss: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// LR used.
    pub lr: f64,
}

pub(crate) struct ParamState {
    pub(crate) name: String,
    pub(crate) decay: bool,
    pub(crate) m: Tensor,
    pub(crate) v: Tensor,
    /// f32 master copy when the parameter is not f32.
    pub(crate) master: Option<Tensor>,
}

/// A model plus its AdamW state.
pub struct Trainer {
    /// The model being trained (its parameters require grad).
    pub model: Llama,
    /// Settings.
    pub config: TrainConfig,
    pub(crate) state: Vec<ParamState>,
    pub(crate) step: u64,
    offloaded: Option<Offloaded>,
    pending_losses: Vec<f64>,
}

/// What [`Trainer::offload`] moved to the host.
struct Offloaded {
    device: Device,
    buckets: Vec<WeightBucket>,
    /// The trainable parameters that had a gradient tensor (zero between steps): they
    /// get a zero one back on reload, so that AdamW's step on a parameter no backward
    /// of the next step reaches (its moments still move it) is the same as without
    /// the offload.
    had_grad: Vec<String>,
}

/// Sets `p`'s gradient to `g` (same shape), creating it when `p` has none yet.
impl Trainer {
    /// Wraps `model` for training (fresh optimizer state).
    pub fn new(mut model: Llama, config: TrainConfig) -> Self {
        model.set_requires_grad(true);
        let state = model
            .parameters_mut()
            .into_iter()
            .map(|(name, p)| {
                let decay = !config.no_decay.iter().any(|s| name.contains(s.as_str()));
                let z = || Tensor::zeros(p.size(), (Kind::Float, p.device()));
                let master = (p.kind() != Kind::Float).then(|| p.detach().to_kind(Kind::Float));
                ParamState {
                    name,
                    decay,
                    m: z(),
                    v: z(),
                    master,
                }
            })
            .collect();
        Trainer {
            model,
            config,
            state,
            step: 0,
            offloaded: None,
            pending_losses: vec![],
        }
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> u64 {
        self.step
    }

    /// The parameter names in the decay group and in the no-decay group.
    pub fn decay_groups(&self) -> (Vec<String>, Vec<String>) {
        let (d, n): (Vec<_>, Vec<_>) = self.state.iter().partition(|s| s.decay);
        (
            d.into_iter().map(|s| s.name.clone()).collect(),
            n.into_iter().map(|s| s.name.clone()).collect(),
        )
    }

    pub(crate) fn check_resident(&self) -> Result<()> {
        if self.offloaded.is_some() {
            return Err(EngineError::InvalidArgument(
                "the trainer is offloaded; call reload() first".into(),
            ));
        }
        Ok(())
    }

    /// Runs forward+backward for one micro-batch, accumulating gradients. The loss is
    /// scaled by `scale` (e.g. `1 / number_of_micro_batches`) before backward.
    pub fn backward_micro(&mut self, loss: Tensor, scale: f64) -> Result<f64> {
        self.check_resident()?;
        if loss.numel() != 1 {
            return Err(EngineError::InvalidArgument(format!(
                "the loss must be a scalar, got shape {:?}",
                loss.size()
            )));
        }
        let v = loss.double_value(&[]);
        if !v.is_finite() {
            return Err(EngineError::InvalidArgument(format!(
                "the loss is {v}; refusing to backpropagate"
            )));
        }
        (loss * scale).f_backward()?;
        self.pending_losses.push(v);
        Ok(v)
    }

    /// One optimizer step over `micro_batches`: for each, `loss_fn` computes a scalar loss
    /// with gradients; gradients accumulate (each loss scaled by 1/n); then clip, AdamW,
    /// zero gradients.
    pub fn step<M>(
        &mut self,
        micro_batches: &[M],
        mut loss_fn: impl FnMut(&Llama, &M) -> Result<Tensor>,
    ) -> Result<StepStats> {
        self.step_sparse(micro_batches, |model, mb| loss_fn(model, mb).map(Some))
    }

    /// What every step does first: the state must be resident, there must be a
    /// micro-batch, and libtorch's RNG is seeded for this step (runs and resumes repeat).
    fn begin_step(&mut self, micro_batches: usize) -> Result<()> {
        self.check_resident()?;
        if micro_batches == 0 {
            return Err(EngineError::InvalidArgument(
                "step needs at least one micro-batch".into(),
            ));
        }
        tch::manual_seed(self.config.seed.wrapping_add(self.step) as i64);
        Ok(())
    }

    /// [`Trainer::step`] where a micro-batch may be known to contribute nothing:
    /// `loss_fn` returns `None` when its loss is exactly zero with zero gradient (say,
    /// every sample's advantage is zero). That micro-batch runs no forward or backward
    /// pass, yet still counts in the `1/n` averaging and as a zero loss, so the step is
    /// the one [`Trainer::step`] would take.
    pub fn step_sparse<M>(
        &mut self,
        micro_batches: &[M],
        mut loss_fn: impl FnMut(&Llama, &M) -> Result<Option<Tensor>>,
    ) -> Result<StepStats> {
        self.begin_step(micro_batches.len())?;
        let scale = 1.0 / micro_batches.len() as f64;
        let device = self.model.device();
        crate::profile::start(device);
        for mb in micro_batches {
            match loss_fn(&self.model, mb)? {
                Some(loss) => {
                    crate::profile::mark(device, "train: forward and loss");
                    self.backward_micro(loss, scale)?;
                    crate::profile::mark(device, "train: backward");
                }
                None => self.pending_losses.push(0.0),
            }
        }
        self.apply_gradients()
    }

    /// [`Trainer::step_sparse`] for losses that run their own backward pass (the
    /// chunked LM head, layer recompute, per-micro-batch weights): `backward_fn` runs
    /// micro-batch `mb`'s forward and backward passes, accumulating gradients already
    /// scaled as it wants them, and returns the loss it added (`None`: nothing ran). The
    /// step's loss is the sum of those returned.
    pub fn step_manual<M>(
        &mut self,
        micro_batches: &[M],
        mut backward_fn: impl FnMut(&Llama, &M) -> Result<Option<f64>>,
    ) -> Result<StepStats> {
        self.begin_step(micro_batches.len())?;
        let device = self.model.device();
        crate::profile::start(device);
        let mut total = 0.0;
        for mb in micro_batches {
            total += backward_fn(&self.model, mb)?.unwrap_or(0.0);
            crate::profile::mark(device, "train: forward, loss and backward");
        }
        self.pending_losses.push(total);
        self.apply_gradients()
    }

    /// Gradients as buckets (canonical names, f32), for all-reduce.
    pub fn grad_buckets(&mut self, max_bytes: usize) -> Result<Vec<WeightBucket>> {
        self.check_resident()?;
        let named: Vec<(String, Tensor)> = self
            .model
            .parameters_mut()
            .into_iter()
            .map(|(n, p)| {
                let g = p.grad();
                (
                    n,
                    if g.defined() {
                        g.to_kind(Kind::Float)
                    } else {
                        Tensor::zeros(p.size(), (Kind::Float, p.device()))
                    },
                )
            })
            .collect();
        to_buckets(&named, max_bytes)
    }

    /// Every parameter's gradient as `f32`, one after the other in parameter order
    /// (zeros where a parameter has none): the buffer a ring all-reduce averages.
    pub fn flat_grads(&mut self) -> Result<Vec<f32>> {
        let flat = self.flat_grads_on(Device::Cpu)?;
        Ok(Vec::<f32>::try_from(&flat)?)
    }

    /// [`Trainer::flat_grads`] as one f32 tensor on `device` (a GPU all-reduce's
    /// buffer: no trip through the host).
    pub fn flat_grads_on(&mut self, device: Device) -> Result<Tensor> {
        self.check_resident()?;
        let parts: Vec<Tensor> = self
            .model
            .parameters_mut()
            .into_iter()
            .map(|(_, p)| {
                let g = p.grad();
                if g.defined() {
                    g.to_kind(Kind::Float).to_device(device).flatten(0, -1)
                } else {
                    Tensor::zeros([p.numel() as i64], (Kind::Float, device))
                }
            })
            .collect();
        Ok(Tensor::cat(&parts, 0))
    }

    /// Replaces every gradient with its part of `flat` (laid out as
    /// [`Trainer::flat_grads`] gives it).
    pub fn set_flat_grads(&mut self, flat: &[f32]) -> Result<()> {
        self.set_flat_grads_from(&Tensor::from_slice(flat))
    }

    /// [`Trainer::set_flat_grads`] from a 1-D tensor on any device.
    pub fn set_flat_grads_from(&mut self, flat: &Tensor) -> Result<()> {
        self.check_resident()?;
        self.materialise_grads()?;
        let params = self.model.parameters_mut();
        let want: usize = params.iter().map(|(_, p)| p.numel()).sum();
        let got = flat.numel();
        if flat.dim() != 1 || got != want {
            return Err(EngineError::InvalidArgument(format!(
                "{got} gradient values for {want} parameters (shape {:?}; one flat tensor expected)",
                flat.size()
            )));
        }
        let mut at = 0;
        tch::no_grad(|| {
            for (_, p) in params {
                let n = p.numel() as i64;
                let g = flat
                    .narrow(0, at, n)
                    .view(p.size().as_slice())
                    .to_device(p.device())
                    .to_kind(p.kind());
                at += n;
                p.grad().copy_(&g);
            }
        });
        Ok(())
    }

    fn materialise_grads(&mut self) -> Result<()> {
        let missing: Vec<Tensor> = self
            .model
            .parameters_mut()
            .into_iter()
            .filter(|(_, p)| !p.grad().defined())
            .map(|(_, p)| p.sum(Kind::Float))
            .collect();
        if !missing.is_empty() {
            (Tensor::stack(&missing, 0).sum(Kind::Float) * 0.0).f_backward()?;
        }
        Ok(())
    }

    /// Replaces gradients with the (e.g. all-reduced) ones in `buckets`.
    pub fn set_grads(&mut self, buckets: &[WeightBucket]) -> Result<()> {
        self.check_resident()?;
        // Views of the payloads: `copy_` below reads them once, onto any device.
        let views = buckets
            .iter()
            .map(WeightBucket::views)
            .collect::<Result<Vec<_>>>()?;
        let mut incoming: std::collections::HashMap<&str, &Tensor> =
            views.iter().flat_map(|v| v.iter()).collect();
        self.materialise_grads()?;
        tch::no_grad(|| -> Result<()> {
            for (n, p) in self.model.parameters_mut() {
                if let Some(g) = incoming.remove(n.as_str()) {
                    if g.size() != p.size() {
                        return Err(EngineError::Bucket(format!(
                            "gradient `{n}` has shape {:?}, parameter has {:?}",
                            g.size(),
                            p.size()
                        )));
                    }
                    p.grad().f_copy_(&g)?;
                }
            }
            Ok(())
        })?;
        if let Some(n) = incoming.keys().next() {
            return Err(EngineError::Bucket(format!(
                "gradient `{n}` matches no parameter"
            )));
        }
        Ok(())
    }

    /// Clips, applies AdamW with the scheduled LR and zeroes gradients.
    pub fn apply_gradients(&mut self) -> Result<StepStats> {
        // libtorch's multi-tensor AdamW kernel when the shim has it (on f32 master copies
        // where the model is bf16/f16); otherwise the same update as separate tensor
        // operations, about five times the memory traffic (a 1B model's step on an H100
        // went from 0.32 to 0.29 s with the fused kernel).
        self.apply_gradients_with(crate::onednn::available())
    }

    fn apply_gradients_with(&mut self, fused: bool) -> Result<StepStats> {
        self.check_resident()?;
        let c = self.config.clone();
        let moments = Moments::for_step(&c, self.step);
        let lr = moments.lr;
        let device = self.model.device();
        let params = self.model.parameters_mut();
        let grad_norm = tch::no_grad(|| {
            let norms: Vec<Tensor> = params
                .iter()
                .map(|(_, p)| p.grad())
                .filter(|g| g.defined())
                // f32 accumulation without an f32 copy of each gradient.
                .map(|g| g.norm_scalaropt_dtype(2, Kind::Float))
                .collect();
            if norms.is_empty() {
                return 0.0;
            }
            let total = Tensor::stack(&norms, 0).norm().double_value(&[]);
            if let Some(maxn) = c.max_grad_norm {
                let coef = maxn / (total + 1e-6);
                if coef < 1.0 {
                    for (_, p) in params.iter() {
                        let mut g = p.grad();
                        if g.defined() {
                            let _ = g.g_mul_scalar_(coef);
                        }
                    }
                }
            }
            total
        });
        crate::profile::mark(device, "train: gradient norm and clipping");
        if fused {
            let mut groups: [(Vec<&Tensor>, Vec<Tensor>, Vec<&Tensor>, Vec<&Tensor>); 2] =
                Default::default();
            for ((_, p), s) in params.iter().zip(self.state.iter()) {
                let g = p.grad();
                if g.defined() {
                    let group = &mut groups[usize::from(s.decay && c.weight_decay > 0.0)];
                    // The update runs on the f32 master where there is one.
                    match &s.master {
                        Some(w) => {
                            group.0.push(w);
                            group.1.push(g.to_kind(Kind::Float));
                        }
                        None => {
                            group.0.push(&**p);
                            group.1.push(g);
                        }
                    }
                    group.2.push(&s.m);
                    group.3.push(&s.v);
                }
            }
            for (decay, (ps, gs, ms, vs)) in groups.iter().enumerate() {
                if ps.is_empty() {
                    continue;
                }
                let gs: Vec<&Tensor> = gs.iter().collect();
                let hp = crate::onednn::AdamWStep {
                    lr,
                    betas: c.betas,
                    weight_decay: if decay == 1 { c.weight_decay } else { 0.0 },
                    eps: c.eps,
                    step: self.step + 1,
                };
                tch::no_grad(|| crate::onednn::fused_adamw(ps, &gs, ms, vs, hp))
                    .map_err(EngineError::InvalidArgument)?;
            }
            drop(groups);
            tch::no_grad(|| {
                for ((_, p), s) in params.iter().zip(self.state.iter()) {
                    let mut g = p.grad();
                    if g.defined() {
                        if let Some(w) = &s.master {
                            let mut p = p.shallow_clone();
                            p.copy_(w);
                        }
                        let _ = g.zero_();
                    }
                }
            });
        } else {
            tch::no_grad(|| {
                for ((_, p), s) in params.into_iter().zip(self.state.iter_mut()) {
                    let mut g = p.grad();
                    if !g.defined() {
                        continue;
                    }
                    let upd = moments.update(&mut s.m, &mut s.v, &g.to_kind(Kind::Float));
                    match s.master.as_mut() {
                        Some(w) => {
                            if s.decay && c.weight_decay > 0.0 {
                                let _ = w.g_mul_scalar_(1.0 - lr * c.weight_decay);
                            }
                            let _ = w.g_add_(&upd);
                            p.copy_(w);
                        }
                        None => {
                            if s.decay && c.weight_decay > 0.0 {
                                let _ = p.g_mul_scalar_(1.0 - lr * c.weight_decay);
                            }
                            let _ = p.g_add_(&upd);
                        }
                    }
                    let _ = g.zero_();
                }
            });
        }
        crate::profile::mark(device, "train: AdamW");
        self.step += 1;
        let loss = if self.pending_losses.is_empty() {
            f64::NAN
        } else {
            self.pending_losses.iter().sum::<f64>() / self.pending_losses.len() as f64
        };
        self.pending_losses.clear();
        Ok(StepStats {
            step: self.step,
            loss,
            grad_norm,
            lr,
        })
    }

    /// Bytes of parameters, gradients and optimizer state currently held in tensors.
    pub fn resident_bytes(&mut self) -> usize {
        let sz = |t: &Tensor| {
            if t.defined() {
                t.numel() * t.kind().elt_size_in_bytes()
            } else {
                0
            }
        };
        let mut n: usize = self
            .model
            .all_parameters_mut()
            .iter()
            .map(|(_, p)| sz(p) + sz(&p.grad()))
            .sum();
        for s in &self.state {
            n += sz(&s.m) + sz(&s.v) + s.master.as_ref().map(sz).unwrap_or(0);
        }
        n
    }

    /// Moves parameters and optimizer state to host byte buffers and drops the tensors
    /// (device memory is released once nothing else holds them). Gradients are dropped
    /// (they are zero between steps); [`Trainer::reload`] gives a zero one back to each
    /// parameter that had one, so training after a reload is bit-identical.
    pub fn offload(&mut self) -> Result<()> {
        if self.offloaded.is_some() {
            return Ok(());
        }
        let device = self.model.device();
        let had_grad = self
            .model
            .parameters_mut()
            .into_iter()
            .filter(|(_, p)| p.grad().defined())
            .map(|(n, _)| n)
            .collect();
        let mut named: Vec<(String, Tensor)> = Vec::new();
        for (n, p) in self.model.all_parameters_mut() {
            named.push((format!("p.{n}"), p.detach()));
        }
        for s in &self.state {
            named.push((format!("m.{}", s.name), s.m.shallow_clone()));
            named.push((format!("v.{}", s.name), s.v.shallow_clone()));
            if let Some(w) = &s.master {
                named.push((format!("w.{}", s.name), w.shallow_clone()));
            }
        }
        let buckets = to_buckets(&named, 256 << 20)?;
        drop(named);
        let empty = |k: Kind| Tensor::empty([0], (k, device));
        for (_, p) in self.model.all_parameters_mut() {
            *p = empty(p.kind());
        }
        for s in &mut self.state {
            s.m = empty(Kind::Float);
            s.v = empty(Kind::Float);
            if s.master.is_some() {
                s.master = Some(empty(Kind::Float));
            }
        }
        self.offloaded = Some(Offloaded {
            device,
            buckets,
            had_grad,
        });
        Ok(())
    }

    /// Restores what [`Trainer::offload`] moved out, on the original device.
    pub fn reload(&mut self) -> Result<()> {
        let Some(Offloaded {
            device,
            buckets,
            had_grad,
        }) = self.offloaded.take()
        else {
            return Ok(());
        };
        let mut map = std::collections::HashMap::new();
        for b in &buckets {
            map.extend(b.tensors(device)?);
        }
        drop(buckets);
        let mut get = |k: &str| {
            map.remove(k)
                .ok_or_else(|| EngineError::Bucket(format!("offloaded state lacks `{k}`")))
        };
        for (n, p) in self.model.all_parameters_mut() {
            *p = get(&format!("p.{n}"))?;
        }
        // Trainable again (with LoRA: the adapters, not the frozen base).
        self.model.set_requires_grad(true);
        for s in &mut self.state {
            s.m = get(&format!("m.{}", s.name))?;
            s.v = get(&format!("v.{}", s.name))?;
            if s.master.is_some() {
                s.master = Some(get(&format!("w.{}", s.name))?);
            }
        }
        // Zero gradients where there were gradients (a zero backward makes them).
        let zero: Vec<Tensor> = self
            .model
            .parameters_mut()
            .into_iter()
            .filter(|(n, _)| had_grad.contains(n))
            .map(|(_, p)| p.sum(Kind::Float))
            .collect();
        if !zero.is_empty() {
            (Tensor::stack(&zero, 0).sum(Kind::Float) * 0.0).f_backward()?;
        }
        Ok(())
    }

    /// Whether the state is offloaded.
    pub fn is_offloaded(&self) -> bool {
        self.offloaded.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedules() {
        let c = LrSchedule::Constant { warmup_steps: 4 };
        assert_eq!(c.factor(0), 0.25);
        assert_eq!(c.factor(3), 1.0);
        assert_eq!(c.factor(100), 1.0);
        let s = LrSchedule::Cosine {
            warmup_steps: 2,
            total_steps: 12,
            min_ratio: 0.1,
        };
        assert_eq!(s.factor(0), 0.5);
        assert!((s.factor(2) - 1.0).abs() < 1e-12);
        assert!((s.factor(7) - (0.1 + 0.9 * 0.5)).abs() < 1e-12);
        assert!((s.factor(12) - 0.1).abs() < 1e-12);
        assert!((s.factor(50) - 0.1).abs() < 1e-12);
    }

    /// The fused AdamW kernel takes the steps the separate tensor operations take
    /// (weight decay on one group, none on the other, clipping active).
    #[test]
    fn fused_adamw_steps_like_the_unfused_update() {
        if !crate::onednn::available() {
            return;
        }
        let config = TrainConfig {
            lr: 1e-2,
            weight_decay: 0.1,
            max_grad_norm: Some(0.5),
            ..Default::default()
        };
        // f32 over three steps; bf16 with f32 master weights (the GPU's training setup)
        // over one, as later gradients differ once the bf16 weights round apart.
        for (kind, steps) in [(Kind::Float, 3), (Kind::BFloat16, 1)] {
            fused_and_unfused_agree(&config, kind, steps);
        }
    }

    fn fused_and_unfused_agree(config: &TrainConfig, kind: Kind, steps: usize) {
        let model = Llama::random(crate::config::tiny_config(), Device::Cpu, kind, 3).unwrap();
        let mut runs = [true, false].map(|fused| {
            let m = model.deep_copy(Device::Cpu, kind).unwrap();
            (fused, Trainer::new(m, config.clone()))
        });
        let ids = Tensor::from_slice(&[3i64, 9, 4, 7, 1, 5, 8, 2]).view([2, 4]);
        for _ in 0..steps {
            for (fused, t) in runs.iter_mut() {
                let loss = t.model.forward(&ids, None).square().mean(Kind::Float);
                t.backward_micro(loss, 1.0).unwrap();
                t.apply_gradients_with(*fused).unwrap();
            }
        }
        let [(_, a), (_, b)] = &mut runs;
        let (da, nd) = a.decay_groups();
        assert!(
            !da.is_empty() && !nd.is_empty(),
            "both decay groups are exercised"
        );
        let diff = |x: &Tensor, y: &Tensor| (x - y).abs().max().double_value(&[]);
        for ((name, x), (_, y)) in a.model.parameters().iter().zip(b.model.parameters()) {
            // One bf16 rounding step apart at most where the masters differ by ~1e-7.
            let tol = if kind == Kind::Float { 1e-6 } else { 1e-2 };
            let d = diff(x, &y);
            assert!(
                d < tol,
                "{kind:?}: {name} differs by {d} after {steps} steps"
            );
        }
        for (sa, sb) in a.state.iter().zip(&b.state) {
            let d = diff(&sa.v, &sb.v);
            assert!(
                d < 1e-9,
                "{kind:?} {}: second moments differ by {d}",
                sa.name
            );
            assert_eq!(sa.master.is_some(), kind != Kind::Float, "{}", sa.name);
            if let (Some(wa), Some(wb)) = (&sa.master, &sb.master) {
                let d = diff(wa, wb);
                assert!(d < 1e-6, "{kind:?} {}: masters differ by {d}", sa.name);
            }
        }
    }
}
