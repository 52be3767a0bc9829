//! Batched generation: sampling (temperature, top-k, top-p, greedy), stop conditions,
//! per-request seeds, per-token log-probs, and continuous batching over a paged KV
//! cache.
//!
//! The slot bookkeeping is a deterministic core ([`Scheduler`]) with no model in it.
//! Active sequences always occupy cache slots `0..n`: when one finishes its slot is
//! refilled from the waiting queue at once (continuous batching) or, when the queue is
//! empty, the last active sequence's block table is moved into it, so every decode step
//! runs on a dense prefix of the slots.
//!
//! Memory follows the tokens: a sequence takes a block of [`KV_BLOCK`] positions as it
//! reaches it, the samples of one prompt share its blocks, and a budget
//! ([`GeneratorConfig::kv_cache_bytes`]) bounds the blocks. Requests are admitted while
//! blocks remain for their prompts; when a decode step finds too few blocks, the newest
//! sequences are preempted (their blocks freed) and resume later by recomputing their
//! prefix, with their tokens and random stream, so a full cache slows a batch down but
//! never fails it.
//!
//! Reported log-probs are those of the sampled token under the temperature-scaled
//! distribution `log_softmax(logits / T)` (T = 1 for greedy), before top-k/top-p
//! filtering — the quantity a policy-gradient loss recomputes at training time.

use crate::error::{EngineError, Result};
use crate::kept::{KeptSequences, DEFAULT_KEPT_KV_BYTES};
use crate::model::{blocks_for, Attn, DecodeGraphs, KvCache, Llama, KV_BLOCK};
use crate::sampling::upload;
pub use crate::sampling::{sample, RowParams};
use crate::schedule::{plan_prefill, BatchingMode, PrefillPlan, Scheduler};
use crate::tokenizer::Tokenizer;
use std::sync::Arc;
use std::time::Instant;
use tch::{Kind, Tensor};

/// How one request is sampled and when it stops (serde: it travels to remote rollouts).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; `0` means greedy.
    pub temperature: f32,
    /// Keep the `top_k` most likely tokens (`0` = no limit).
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches `top_p` (`1` = all).
    pub top_p: f32,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Extra token ids that end the sequence (the model's EOS ids are added unless
    /// `ignore_eos`).
    pub stop_token_ids: Vec<i64>,
    /// Strings that end the sequence once the decoded response contains them (needs a
    /// tokenizer on the generator).
    pub stop_strings: Vec<String>,
    /// Do not stop at the model's EOS tokens.
    pub ignore_eos: bool,
    /// Seed of this request's sampling stream: the same seed, prompt and weights give the
    /// same tokens whatever else is in the batch (up to batched-GEMM rounding).
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            max_new_tokens: 64,
            stop_token_ids: vec![],
            stop_strings: vec![],
            ignore_eos: false,
            seed: 0,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding for `max_new_tokens`.
    pub fn greedy(max_new_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_new_tokens,
            ..Default::default()
        }
    }
}

/// A generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct Request {
    /// Caller's id, returned in the [`Completion`].
    pub id: u64,
    /// Prompt token ids (non-empty).
    pub prompt: Vec<i64>,
    /// Sampling parameters.
    pub params: SamplingParams,
}

/// Why a sequence stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// It produced a stop token (EOS or one of `stop_token_ids`); the token is included.
    StopToken(i64),
    /// Its decoded text contains this stop string (tokens up to and including the one
    /// completing it are included).
    StopString(String),
    /// It reached `max_new_tokens` (or the cache capacity).
    Length,
}

/// A finished sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    /// The request id.
    pub id: u64,
    /// Prompt length in tokens.
    pub prompt_len: usize,
    /// Generated tokens.
    pub tokens: Vec<i64>,
    /// Log-prob of each generated token (see the module docs).
    pub logprobs: Vec<f32>,
    /// Why it stopped.
    pub finish: FinishReason,
}

/// Generator settings.
#[derive(Debug, Clone)]
pub struct GeneratorConfig {
    /// Most sequences decoded together (cache slots): a bound on compute; memory is
    /// bounded by `kv_cache_bytes`.
    pub max_batch: usize,
    /// Cache positions per slot (prompt + response).
    pub max_seq_len: usize,
    /// Batching policy.
    pub mode: BatchingMode,
    /// Most prompts prefilled in one forward call.
    pub max_prefill_batch: usize,
    /// Prefill each distinct prompt of an admitted group once (GRPO samples every prompt
    /// several times) and the prefix common to all of them (e.g. a chat template's system
    /// prompt) once; the other slots share their KV blocks (held once, the last partial
    /// block copied at the first write). The tokens are the same as without it, up to
    /// GEMM rounding.
    pub share_prefixes: bool,
    /// The KV cache's memory budget in bytes (`rollout.kv_cache_bytes` in a job):
    /// requests are admitted while its blocks hold their prompts, and the newest
    /// sequences are preempted when decoding runs out of blocks. `None`: blocks for
    /// `max_batch × max_seq_len` positions, which never preempts.
    pub kv_cache_bytes: Option<usize>,
}

impl Default for GeneratorConfig {
    fn default() -> Self {
        GeneratorConfig {
            max_batch: 16,
            max_seq_len: 1024,
            mode: BatchingMode::Continuous,
            max_prefill_batch: 16,
            share_prefixes: true,
            kv_cache_bytes: None,
        }
    }
}

/// Counters for one `generate` call.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GenerateStats {
    /// Decode steps run.
    pub decode_steps: usize,
    /// Prefill forward calls.
    pub prefill_calls: usize,
    /// Prompt positions run through the model by prefill calls (padding excluded): with
    /// prefix sharing, fewer than the prompts' total length.
    pub prefill_positions: usize,
    /// Prompt positions whose KV came back from a kept sequence instead of a prefill
    /// ([`Generator::generate_continuing`]).
    pub reused_positions: usize,
    /// Tokens generated.
    pub generated_tokens: usize,
    /// Sum over decode steps of the active batch size (utilisation = this / steps / max_batch).
    pub slot_steps: usize,
    /// Sequences preempted because the KV cache ran out of blocks (each resumed later by
    /// recomputing its prefix).
    pub kv_preemptions: usize,
    /// Positions recomputed to resume preempted sequences.
    pub recomputed_positions: usize,
    /// Most sequences decoded together in one step.
    pub max_in_flight: usize,
    /// Most bytes of KV blocks held at once by live sequences (a shared block counts
    /// once).
    pub kv_bytes_held_peak: usize,
    /// Bytes of the KV cache's blocks (its budget, rounded down to blocks).
    pub kv_cache_bytes: usize,
    /// Wall time in seconds.
    pub seconds: f64,
}

/// A request's private random stream (SplitMix64), one uniform per sampled token.
#[derive(Debug, Clone)]
pub struct RequestRng(u64);

impl RequestRng {
    /// A stream for `seed`.
    pub fn new(seed: u64) -> Self {
        RequestRng(seed ^ 0x9E37_79B9_7F4A_7C15)
    }
    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// A uniform in `[0, 1)` (24 bits, exact in f32).
    pub fn uniform(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32
    }
}

struct SlotState {
    req: usize,
    /// Unique within one `generate` call, in admission order: the newest sequence has
    /// the largest (preemption takes it first).
    uid: usize,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    /// Positions written to the cache (prompt + tokens fed back so far).
    len: i64,
    rng: RequestRng,
    stops: Vec<i64>,
}

impl SlotState {
    /// A sequence of request `rq` (index `req`) entering a slot after its prefill.
    fn new(rq: &Request, req: usize, uid: usize, eos: &[i64]) -> Self {
        let mut stops = rq.params.stop_token_ids.clone();
        if !rq.params.ignore_eos {
            stops.extend(eos);
        }
        SlotState {
            req,
            uid,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            len: rq.prompt.len() as i64,
            rng: RequestRng::new(rq.params.seed),
            stops,
        }
    }
}

/// The generation engine: a model, its KV cache and the batching loop.
pub struct Generator {
    model: Llama,
    cache: Option<KvCache>,
    config: GeneratorConfig,
    tokenizer: Option<Arc<Tokenizer>>,
    repack: bool,
    graphs: DecodeGraphs,
    kept: KeptSequences,
}

impl Generator {
    /// A generator over `model` (the cache is allocated on first use and then reused).
    pub fn new(mut model: Llama, config: GeneratorConfig) -> Self {
        crate::device::tune_host_allocator();
        model.pack_for_inference(config.max_batch as i64);
        Generator {
            model,
            cache: None,
            config,
            tokenizer: None,
            repack: false,
            graphs: DecodeGraphs::default(),
            kept: KeptSequences::new(DEFAULT_KEPT_KV_BYTES),
        }
    }

    /// Attaches a tokenizer (needed for stop strings).
    pub fn with_tokenizer(mut self, tok: Arc<Tokenizer>) -> Self {
        self.tokenizer = Some(tok);
        self
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The model, mutably (e.g. to offload it). Inference packing is redone before the
    /// next generation.
    pub fn model_mut(&mut self) -> &mut Llama {
        self.repack = true;
        // The caller may move the weights: recorded graphs would read the old ones. It
        // may change them too: kept KV was computed with the old ones.
        self.graphs.clear();
        self.kept.clear();
        &mut self.model
    }

    /// Turns CUDA graphs for the decode step on or off (on by default; they apply on
    /// CUDA devices only, see `DecodeGraphs`).
    pub fn set_cuda_graphs(&mut self, on: bool) {
        self.graphs.set_enabled(on);
    }

    /// Decode-step graphs: `(recorded, replayed)` so far, and why they were turned off
    /// if recording or a replay failed.
    pub fn cuda_graph_stats(&self) -> (u64, u64, Option<&str>) {
        (
            self.graphs.recorded,
            self.graphs.replays,
            self.graphs.failure(),
        )
    }

    /// The settings.
    pub fn config(&self) -> &GeneratorConfig {
        &self.config
    }

    /// The settings, mutably. Changing `max_batch`, `max_seq_len` or `kv_cache_bytes`
    /// reallocates the cache on the next call; the other fields take effect at once.
    pub fn config_mut(&mut self) -> &mut GeneratorConfig {
        &mut self.config
    }

    /// Changes the batching mode (the cache is kept).
    pub fn set_mode(&mut self, mode: BatchingMode) {
        self.config.mode = mode;
    }

    /// Replaces weights in place from HF-named tensors (weight sync between batches);
    /// neither the weights nor the KV cache are reallocated. Returns how many were copied.
    pub fn update_weights<'a>(
        &mut self,
        named: impl IntoIterator<Item = (&'a str, &'a Tensor)>,
    ) -> Result<usize> {
        self.kept.clear();
        self.model.copy_weights_from(named)
    }

    /// Writes every rank's slices of a sharded policy's weights in place (weight sync
    /// from a sharded replica; see [`crate::write_unit_slices`]). The KV cache is kept.
    pub fn write_unit_slices<'a>(
        &mut self,
        world: usize,
        slices: impl IntoIterator<Item = (usize, &'a str, &'a Tensor)>,
    ) -> Result<usize> {
        self.kept.clear();
        crate::shard::write_unit_slices(&mut self.model, world, slices)
    }

    /// Takes over a snapshot of another model's weights without copying them (weight
    /// sync within a process; see [`Llama::adopt_weights`]). The KV cache is kept.
    pub fn adopt_weights(&mut self, snapshot: &[(String, Tensor)]) -> Result<usize> {
        // Other tensors than those the graphs recorded.
        self.graphs.clear();
        self.kept.clear();
        self.model.adopt_weights(snapshot)
    }

    /// Data pointer of the first cache tensor (to check the cache is not reallocated).
    pub fn cache_ptr(&self) -> Option<usize> {
        self.cache.as_ref().map(|c| c.k_ptr())
    }

    /// Blocks of the cache the settings ask for (the scratch block included).
    fn cache_blocks(&self) -> usize {
        match self.config.kv_cache_bytes {
            Some(bytes) => bytes / KvCache::block_bytes(&self.model).max(1),
            None => {
                let per_slot = blocks_for(self.config.max_seq_len as i64) as usize;
                self.config.max_batch.max(1) * per_slot + 1
            }
        }
    }

    fn ensure_cache(&mut self) {
        let total = self.cache_blocks().max(2);
        let ok = self.cache.as_ref().is_some_and(|c| {
            c.slots == self.config.max_batch as i64
                && c.max_len == self.config.max_seq_len as i64
                && c.usable_blocks() + 1 == total
                && c.device() == self.model.device()
        });
        if !ok {
            self.graphs.clear();
            self.cache = None; // free first
            self.cache = Some(KvCache::with_blocks(
                &self.model,
                self.config.max_batch as i64,
                self.config.max_seq_len as i64,
                total,
            ));
        }
    }

    /// Bytes of the KV blocks live sequences hold now (0 without a cache).
    pub fn kv_bytes_held(&self) -> usize {
        self.cache.as_ref().map_or(0, |c| c.held_bytes())
    }

    /// Frees the KV cache (e.g. before offloading).
    pub fn free_cache(&mut self) {
        self.graphs.clear();
        self.cache = None;
        self.kept.clear();
    }

    /// Bounds the bytes of the pool of KV kept for sequences to be continued (1 GiB by
    /// default; the oldest go first when it is full). Less than one slot keeps none.
    pub fn set_kept_kv_bytes(&mut self, bytes: usize) {
        self.kept.set_budget(bytes);
    }

    /// Drops every kept sequence (e.g. once the episodes that would continue them are
    /// over).
    pub fn forget_kept(&mut self) {
        self.kept.clear();
    }

    /// Sequences kept for a later request to continue.
    pub fn kept_len(&self) -> usize {
        self.kept.len()
    }

    /// Generates for all `requests`, calling `on_done` with each sample as soon as it
    /// finishes (in finishing order).
    pub fn generate_with(
        &mut self,
        requests: &[Request],
        on_done: impl FnMut(Completion),
    ) -> Result<GenerateStats> {
        self.generate_continuing(requests, &[], false, on_done)
    }

    /// Like [`Generator::generate_with`], continuing kept sequences: a request `i` with
    /// a key `keys[i]` continues the sequence kept under that key, if any (its KV goes
    /// back into the cache for the leading tokens its prompt shares with it, and only
    /// the rest is prefilled), and, with `keep`, is kept under that key when it finishes
    /// (its prompt and the tokens fed back) for a later call to continue. `keys` is
    /// empty or has one entry per request. The tokens are those of a full prefill up to
    /// GEMM rounding (decode and prefill sum in another order).
    pub fn generate_continuing(
        &mut self,
        requests: &[Request],
        keys: &[Option<u64>],
        keep: bool,
        mut on_done: impl FnMut(Completion),
    ) -> Result<GenerateStats> {
        let t0 = Instant::now();
        if !keys.is_empty() && keys.len() != requests.len() {
            return Err(EngineError::InvalidArgument(format!(
                "{} keys for {} requests: give one per request, or none",
                keys.len(),
                requests.len()
            )));
        }
        let cap = self.config.max_seq_len;
        for r in requests {
            if r.prompt.is_empty() {
                return Err(EngineError::InvalidArgument(format!(
                    "request {} has an empty prompt",
                    r.id
                )));
            }
            if r.prompt.len() + r.params.max_new_tokens > cap {
                return Err(EngineError::InvalidArgument(format!(
                    "request {}: prompt ({}) + max_new_tokens ({}) exceeds the generator's max_seq_len {cap}; raise GeneratorConfig::max_seq_len",
                    r.id,
                    r.prompt.len(),
                    r.params.max_new_tokens
                )));
            }
            if !r.params.stop_strings.is_empty() && self.tokenizer.is_none() {
                return Err(EngineError::InvalidArgument(format!("request {} has stop strings but the generator has no tokenizer (use with_tokenizer)", r.id)));
            }
            let v = self.model.config.vocab_size;
            if let Some(bad) = r.prompt.iter().find(|&&t| t < 0 || t >= v) {
                return Err(EngineError::InvalidArgument(format!(
                    "request {}: token id {bad} is outside the vocabulary (0..{v})",
                    r.id
                )));
            }
        }
        // Each request alone must fit the cache's blocks: with every other sequence
        // preempted, it then always finishes.
        let block_bytes = KvCache::block_bytes(&self.model);
        let usable = self.cache_blocks().max(2) - 1;
        for r in requests {
            let need = blocks_for((r.prompt.len() + r.params.max_new_tokens) as i64) as usize;
            if need > usable {
                return Err(EngineError::InvalidArgument(format!(
                    "request {}: prompt ({}) + max_new_tokens ({}) need {need} KV blocks of {KV_BLOCK} positions ({} bytes), but the KV cache budget holds {usable} ({} bytes); raise rollout.kv_cache_bytes (GeneratorConfig::kv_cache_bytes) or lower max_new_tokens",
                    r.id,
                    r.prompt.len(),
                    r.params.max_new_tokens,
                    need * block_bytes,
                    usable * block_bytes
                )));
            }
        }
        // The keys finished sequences are kept under (none without `keep`).
        let keep_keys: &[Option<u64>] = if keep { keys } else { &[] };
        self.ensure_cache();
        if self.repack {
            self.model.pack_for_inference(self.config.max_batch as i64);
            self.repack = false;
        }
        let mut stats = GenerateStats {
            kv_cache_bytes: usable * block_bytes,
            ..Default::default()
        };
        let mut sched = Scheduler::new(requests.len(), self.config.max_batch, self.config.mode);
        let mut slots: Vec<SlotState> = Vec::new();
        // Preempted sequences, the oldest last (resumed first).
        let mut preempted: Vec<SlotState> = Vec::new();
        let mut next_uid = 0usize;
        let eos = self.model.config.eos_token_ids.clone();
        let device = self.model.device();
        tch::no_grad(|| -> Result<()> {
            loop {
                // 1. Resume preempted sequences (older than any waiting request), then
                // admit and prefill new ones while blocks remain.
                self.resume(requests, &mut preempted, &mut slots, &mut sched, &mut stats)?;
                let admitted = if preempted.is_empty() {
                    self.admit(requests, keys, slots.len(), &mut sched)
                } else {
                    Vec::new()
                };
                // Requests continuing a kept sequence take the last slots of the batch,
                // each prefilled on its own from where its kept KV ends.
                let mut continued = Vec::new();
                let mut fresh = Vec::with_capacity(admitted.len());
                for &r in &admitted {
                    let key = keys.get(r).copied().flatten();
                    match key.and_then(|k| self.kept.take(k, &requests[r].prompt)) {
                        Some(c) => continued.push((r, c)),
                        None => fresh.push(r),
                    }
                }
                // Continued requests in order of their kept lengths, so that each chunk
                // of them holds similar ones (see below).
                continued.sort_by_key(|(_, c)| c.positions);
                if !continued.is_empty() {
                    let order: Vec<usize> = fresh
                        .iter()
                        .copied()
                        .chain(continued.iter().map(|c| c.0))
                        .collect();
                    sched.reorder_slots(slots.len(), &order);
                }
                for chunk in fresh.chunks(self.config.max_prefill_batch.max(1)) {
                    let plan =
                        plan_prefill(chunk, |r| &requests[r].prompt, self.config.share_prefixes);
                    // The chunk's requests sit in the scheduler's slots from slots.len().
                    sched.reorder_slots(slots.len(), &plan.order);
                    let start = slots.len() as i64;
                    let logits = self.prefill(requests, &plan, start, false, &mut stats);
                    for &r in &plan.order {
                        next_uid += 1;
                        slots.push(SlotState::new(&requests[r], r, next_uid, &eos));
                    }
                    let range = start as usize..slots.len();
                    self.sample_into(&logits, requests, &mut slots, range, &mut stats);
                }
                // Each chunk of continued requests is prefilled in one call from its
                // shortest kept length (the others run their few extra kept positions
                // again): one batched call instead of one per request.
                for chunk in continued.chunks(self.config.max_prefill_batch.max(1)) {
                    let start = slots.len() as i64;
                    let offset = chunk[0].1.positions;
                    let cache = self.cache.as_mut().expect("cache allocated");
                    for (i, (_, c)) in chunk.iter().enumerate() {
                        if !self.kept.restore(c, cache, start + i as i64, offset as i64) {
                            return Err(EngineError::InvalidArgument(
                                "the KV cache had no blocks left for a kept sequence its admission counted; this is a bug".into(),
                            ));
                        }
                    }
                    // Whole blocks of the prefix every prompt of the chunk shares (a
                    // system prompt, a group's question) are held once, the first one's.
                    let first = &requests[chunk[0].0].prompt[..offset];
                    let common = chunk[1..].iter().fold(offset, |acc, (r, _)| {
                        let p = &requests[*r].prompt;
                        acc.min(first.iter().zip(p).take_while(|(a, b)| a == b).count())
                    }) as i64
                        / KV_BLOCK
                        * KV_BLOCK;
                    if chunk.len() > 1 && common > 0 {
                        let others: Vec<i64> = (1..chunk.len() as i64).map(|i| start + i).collect();
                        cache.copy_slots(&vec![start; others.len()], &others, common);
                    }
                    stats.reused_positions += offset * chunk.len();
                    let plan = PrefillPlan {
                        order: chunk.iter().map(|c| c.0).collect(),
                        leaders: chunk.len(),
                        source: (0..chunk.len()).collect(),
                        shared: offset,
                    };
                    let logits = self.prefill(requests, &plan, start, true, &mut stats);
                    for &r in &plan.order {
                        next_uid += 1;
                        slots.push(SlotState::new(&requests[r], r, next_uid, &eos));
                    }
                    let range = start as usize..slots.len();
                    self.sample_into(&logits, requests, &mut slots, range, &mut stats);
                }
                // Retire only once every admitted request has a slot state: retiring moves
                // the last active request into the freed slot, and that must be one whose
                // state exists.
                if !admitted.is_empty() {
                    self.retire(requests, keep_keys, &mut slots, &mut sched, &mut on_done);
                }
                if sched.is_done() && preempted.is_empty() {
                    break;
                }
                if sched.active_len() == 0 {
                    continue;
                }
                // 2. One decode step over the dense active prefix, its positions'
                // blocks taken first (preempting the newest sequences while too few).
                crate::profile::start(device);
                self.make_room(&mut slots, &mut preempted, &mut sched, &mut stats)?;
                let n = slots.len() as i64;
                let last: Vec<i64> = slots
                    .iter()
                    .map(|s| *s.tokens.last().expect("every active slot has a token"))
                    .collect();
                let pos: Vec<i64> = slots.iter().map(|s| s.len).collect();
                let span = pos.iter().copied().max().unwrap_or(0) + 1;
                let cache = self.cache.as_mut().expect("cache allocated");
                let nb = blocks_for(span);
                let tables = Vec::<i64>::try_from(cache.tables(0, n, nb).reshape([-1]))
                    .expect("int64 tables");
                // Ids, positions and block tables in one host-to-device copy (one
                // transfer per step on a GPU instead of three).
                let inputs = upload(
                    Tensor::from_slice(&[last, pos.clone(), tables].concat()),
                    device,
                );
                let both = inputs.narrow(0, 0, 2 * n).view([2, n]);
                let table = inputs.narrow(0, 2 * n, n * nb).view([n, nb]);
                let ids = both.get(0).view([n, 1]);
                let post = both.get(1).view([n, 1]);
                crate::profile::mark(device, "decode: inputs");
                let logits = match self
                    .graphs
                    .decode(&self.model, cache, &both, &table, n, span)
                {
                    Some(logits) => {
                        crate::profile::mark(device, "decode: graph (layers, lm head)");
                        logits
                    }
                    None => {
                        let h = self.model.hidden(
                            &ids,
                            &post,
                            Attn::Decode {
                                cache,
                                span,
                                table: Some(&table),
                            },
                        );
                        crate::profile::mark(device, "decode: layers");
                        let logits = self.model.logits(&h.squeeze_dim(1));
                        crate::profile::mark(device, "decode: lm head");
                        logits
                    }
                };
                for s in slots.iter_mut() {
                    s.len += 1;
                }
                stats.decode_steps += 1;
                stats.slot_steps += n as usize;
                stats.max_in_flight = stats.max_in_flight.max(n as usize);
                stats.kv_bytes_held_peak = stats.kv_bytes_held_peak.max(self.kv_bytes_held());
                self.sample_into(&logits, requests, &mut slots, 0..n as usize, &mut stats);
                crate::profile::mark(device, "decode: sample");
                self.retire(requests, keep_keys, &mut slots, &mut sched, &mut on_done);
                crate::profile::mark(device, "decode: retire");
            }
            Ok(())
        })?;
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok(stats)
    }

    /// Blocks kept free beyond an admission's own while sequences run, so that they can
    /// grow a while before the first preemption.
    fn watermark(&self, running: usize) -> usize {
        let usable = self.cache.as_ref().map_or(0, |c| c.usable_blocks());
        if running == 0 {
            0
        } else {
            (usable / 100).max(1)
        }
    }

    /// Admits waiting requests while the cache's free blocks hold their prompts and
    /// first new token. A request whose prompt an earlier one of the same prefill chunk
    /// has (a GRPO group) shares its blocks and takes one (its copy of the last, partial
    /// block); requests that may continue kept sequences are counted whole.
    fn admit(
        &self,
        requests: &[Request],
        keys: &[Option<u64>],
        running: usize,
        sched: &mut Scheduler,
    ) -> Vec<usize> {
        let cache = self.cache.as_ref().expect("cache allocated");
        let mut free = cache.free_blocks() as i64 - self.watermark(running) as i64;
        let chunk = self.config.max_prefill_batch.max(1);
        let share = self.config.share_prefixes && keys.is_empty();
        let mut seen: std::collections::HashMap<&[i64], usize> = Default::default();
        let mut n = 0usize;
        sched.admit_while(|r| {
            let p = requests[r].prompt.as_slice();
            let cost = if share && seen.get(p) == Some(&(n / chunk)) {
                1
            } else {
                blocks_for(p.len() as i64 + 1)
            };
            // With nothing running, the first always fits (checked up front).
            if cost > free && (running > 0 || n > 0) {
                return false;
            }
            free -= cost;
            seen.insert(p, n / chunk);
            n += 1;
            true
        })
    }

    /// Resumes preempted sequences, the oldest first, while slots and blocks allow: each
    /// recomputes its prompt and the tokens it had fed back (one ragged prefill per
    /// chunk) and goes on from its last sampled token with its random stream.
    fn resume(
        &mut self,
        requests: &[Request],
        preempted: &mut Vec<SlotState>,
        slots: &mut Vec<SlotState>,
        sched: &mut Scheduler,
        stats: &mut GenerateStats,
    ) -> Result<()> {
        let cache = self.cache.as_ref().expect("cache allocated");
        let mut free = cache.free_blocks() as i64 - self.watermark(slots.len()) as i64;
        let mut back = Vec::new();
        while let Some(s) = preempted.last() {
            let cost = blocks_for(s.len + 1);
            let alone = slots.is_empty() && back.is_empty();
            if sched.room() == 0 || (cost > free && !alone) {
                break;
            }
            free -= cost;
            let s = preempted.pop().expect("looked at");
            sched.resume(s.req);
            back.push(s);
        }
        let chunk = self.config.max_prefill_batch.max(1);
        let mut back = back.into_iter().peekable();
        while back.peek().is_some() {
            let part: Vec<SlotState> = back.by_ref().take(chunk).collect();
            let start = slots.len() as i64;
            let seqs: Vec<Vec<i64>> = part
                .iter()
                .map(|s| {
                    let prompt = &requests[s.req].prompt;
                    let fed = s.len as usize - prompt.len();
                    [&prompt[..], &s.tokens[..fed]].concat()
                })
                .collect();
            let rows: Vec<&[i64]> = seqs.iter().map(Vec::as_slice).collect();
            let (_, lens) = self.prefill_rows(&rows, start, 0);
            let recomputed = lens.iter().sum::<i64>() as usize;
            stats.prefill_calls += 1;
            stats.prefill_positions += recomputed;
            stats.recomputed_positions += recomputed;
            slots.extend(part);
        }
        Ok(())
    }

    /// Takes the blocks this decode step writes into (a new block, or a copy of a shared
    /// one), preempting the newest sequences while too few are free: their blocks go
    /// back, and they wait in `preempted` to resume.
    fn make_room(
        &mut self,
        slots: &mut Vec<SlotState>,
        preempted: &mut Vec<SlotState>,
        sched: &mut Scheduler,
        stats: &mut GenerateStats,
    ) -> Result<()> {
        let cache = self.cache.as_mut().expect("cache allocated");
        loop {
            let need: usize = (0..slots.len())
                .map(|i| cache.needed(i as i64, slots[i].len, slots[i].len + 1))
                .sum();
            if need <= cache.free_blocks() {
                break;
            }
            if slots.len() <= 1 {
                return Err(EngineError::InvalidArgument(
                    "one sequence alone does not fit the KV cache its admission checked; this is a bug".into(),
                ));
            }
            let newest = (0..slots.len())
                .max_by_key(|&i| slots[i].uid)
                .expect("slots");
            cache.release(newest as i64);
            let moved_from = sched.finish(newest);
            let s = slots.swap_remove(newest);
            if let Some(from) = moved_from {
                cache.move_slot(from as i64, newest as i64);
            }
            // The oldest last: it resumes first.
            let at = preempted.partition_point(|p| p.uid > s.uid);
            preempted.insert(at, s);
            stats.kv_preemptions += 1;
        }
        for (i, s) in slots.iter().enumerate() {
            if !cache.reserve(i as i64, s.len, s.len + 1) {
                return Err(EngineError::InvalidArgument(
                    "the KV cache had fewer free blocks than counted for a decode step; this is a bug".into(),
                ));
            }
        }
        Ok(())
    }

    /// Prefills the chunk laid out by `plan` into slots `start..`: the shared prefix once
    /// (its blocks shared by the other distinct prompts' slots), each distinct prompt's
    /// rest in one batch, then each copy shares its prompt's blocks. Returns the logits at every
    /// slot's last prompt position, in slot order. With `prefix_cached`, the shared
    /// prefix is in the cache already (a kept sequence's KV) and is not run.
    fn prefill(
        &mut self,
        requests: &[Request],
        plan: &PrefillPlan,
        start: i64,
        prefix_cached: bool,
        stats: &mut GenerateStats,
    ) -> Tensor {
        let device = self.model.device();
        let lead = &plan.order[..plan.leaders];
        let shared = plan.shared as i64;
        let cache = self.cache.as_mut().expect("cache allocated");
        if shared > 0 && !prefix_cached {
            let p = &requests[lead[0]].prompt[..plan.shared];
            let ids = Tensor::from_slice(p).view([1, shared]).to_device(device);
            let pos = Tensor::arange(shared, (Kind::Int64, device)).unsqueeze(0);
            let _ = self.model.hidden(
                &ids,
                &pos,
                Attn::Prefill {
                    cache,
                    start,
                    offset: 0,
                    lens: None,
                },
            );
            stats.prefill_calls += 1;
            stats.prefill_positions += plan.shared;
            let others: Vec<i64> = (1..lead.len() as i64).map(|i| start + i).collect();
            cache.copy_slots(&vec![start; others.len()], &others, shared);
        }
        let n = lead.len() as i64;
        let rows: Vec<&[i64]> = lead
            .iter()
            .map(|&r| &requests[r].prompt[plan.shared..])
            .collect();
        let (h, lens) = self.prefill_rows(&rows, start, shared);
        stats.prefill_calls += 1;
        stats.prefill_positions += lens.iter().sum::<i64>() as usize;
        let last: Vec<i64> = lens.iter().map(|l| l - 1).collect();
        let last = Tensor::from_slice(&last).to_device(device);
        let hl = h.index(&[Some(Tensor::arange(n, (Kind::Int64, device))), Some(last)]);
        let logits = self.model.logits(&hl);
        if plan.order.len() == plan.leaders {
            return logits;
        }
        // Copies: their prompt's blocks, shared (up to the longest copied prompt;
        // positions past a slot's own length are never attended to), logits by row.
        let copies = &plan.order[plan.leaders..];
        let len = copies
            .iter()
            .map(|&r| requests[r].prompt.len())
            .max()
            .unwrap_or(0) as i64;
        let src: Vec<i64> = plan.source[plan.leaders..]
            .iter()
            .map(|&i| start + i as i64)
            .collect();
        let dst: Vec<i64> = (plan.leaders..plan.order.len())
            .map(|i| start + i as i64)
            .collect();
        self.cache
            .as_mut()
            .expect("cache allocated")
            .copy_slots(&src, &dst, len);
        let rows: Vec<i64> = plan.source.iter().map(|&i| i as i64).collect();
        logits.index_select(0, &Tensor::from_slice(&rows).to_device(device))
    }

    /// Prefills `rows` (right-padded into one batch, each from cache position `offset`)
    /// into slots `start..`; returns the hidden states `[rows, longest, hidden]` and the
    /// rows' lengths.
    fn prefill_rows(&mut self, rows: &[&[i64]], start: i64, offset: i64) -> (Tensor, Vec<i64>) {
        let device = self.model.device();
        let t = rows.iter().map(|r| r.len()).max().unwrap_or(1);
        let mut ids = vec![0i64; rows.len() * t];
        for (i, r) in rows.iter().enumerate() {
            ids[i * t..i * t + r.len()].copy_from_slice(r);
        }
        let lens: Vec<i64> = rows.iter().map(|r| r.len() as i64).collect();
        let (b, t) = (rows.len() as i64, t as i64);
        let ids = Tensor::from_slice(&ids).view([b, t]).to_device(device);
        let pos = (Tensor::arange(t, (Kind::Int64, device)) + offset)
            .unsqueeze(0)
            .expand([b, t], true);
        let cache = self.cache.as_mut().expect("cache allocated");
        let h = self.model.hidden(
            &ids,
            &pos,
            Attn::Prefill {
                cache,
                start,
                offset,
                lens: Some(&lens),
            },
        );
        (h, lens)
    }

    fn sample_into(
        &self,
        logits: &Tensor,
        requests: &[Request],
        slots: &mut [SlotState],
        range: std::ops::Range<usize>,
        stats: &mut GenerateStats,
    ) {
        let mut rp = RowParams::default();
        for s in &mut slots[range.clone()] {
            let p = &requests[s.req].params;
            rp.temperature.push(p.temperature);
            rp.top_k.push(p.top_k);
            rp.top_p.push(p.top_p);
            rp.uniform.push(s.rng.uniform());
        }
        let (toks, lps) = sample(logits, &rp);
        for (s, (t, lp)) in slots[range].iter_mut().zip(toks.into_iter().zip(lps)) {
            s.tokens.push(t);
            s.logprobs.push(lp);
            stats.generated_tokens += 1;
        }
    }

    fn finish_reason(&self, requests: &[Request], s: &SlotState) -> Option<FinishReason> {
        let p = &requests[s.req].params;
        let t = *s.tokens.last()?;
        if s.stops.contains(&t) {
            return Some(FinishReason::StopToken(t));
        }
        if !p.stop_strings.is_empty() {
            if let Some(tok) = &self.tokenizer {
                let longest = p.stop_strings.iter().map(|x| x.len()).max().unwrap_or(0);
                let w = (longest + 4).min(s.tokens.len());
                if let Ok(text) = tok.decode(&s.tokens[s.tokens.len() - w..], false) {
                    if let Some(hit) = p.stop_strings.iter().find(|x| text.contains(x.as_str())) {
                        return Some(FinishReason::StopString(hit.clone()));
                    }
                }
            }
        }
        if s.tokens.len() >= p.max_new_tokens || s.len + 1 >= self.config.max_seq_len as i64 {
            return Some(FinishReason::Length);
        }
        None
    }

    fn retire(
        &mut self,
        requests: &[Request],
        keys: &[Option<u64>],
        slots: &mut Vec<SlotState>,
        sched: &mut Scheduler,
        on_done: &mut impl FnMut(Completion),
    ) {
        let mut done: Vec<(usize, FinishReason)> = slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| self.finish_reason(requests, s).map(|f| (i, f)))
            .collect();
        done.sort_by_key(|d| std::cmp::Reverse(d.0));
        for (slot, finish) in done {
            let moved_from = sched.finish(slot);
            let s = slots.swap_remove(slot);
            // Kept before another sequence moves into its slot.
            if let Some(key) = keys.get(s.req).copied().flatten() {
                let prompt = &requests[s.req].prompt;
                let fed = (s.len as usize).saturating_sub(prompt.len());
                let mut tokens = prompt.clone();
                tokens.extend_from_slice(&s.tokens[..fed.min(s.tokens.len())]);
                let cache = self.cache.as_ref().expect("cache");
                self.kept.keep(key, tokens, cache, slot as i64, s.len);
            }
            let cache = self.cache.as_mut().expect("cache");
            cache.release(slot as i64);
            if let Some(from) = moved_from {
                cache.move_slot(from as i64, slot as i64);
            }
            let rq = &requests[s.req];
            on_done(Completion {
                id: rq.id,
                prompt_len: rq.prompt.len(),
                tokens: s.tokens,
                logprobs: s.logprobs,
                finish,
            });
        }
    }

    /// Generates for all requests and returns the completions in request order.
    pub fn generate(&mut self, requests: &[Request]) -> Result<(Vec<Completion>, GenerateStats)> {
        let mut out: Vec<Option<Completion>> = vec![None; requests.len()];
        let index: std::collections::HashMap<u64, Vec<usize>> =
            requests
                .iter()
                .enumerate()
                .fold(Default::default(), |mut m, (i, r)| {
                    m.entry(r.id).or_insert_with(Vec::new).push(i);
                    m
                });
        let mut taken: std::collections::HashMap<u64, usize> = Default::default();
        let stats = self.generate_with(requests, |c| {
            let k = taken.entry(c.id).or_insert(0);
            let i = index[&c.id][*k];
            *k += 1;
            out[i] = Some(c);
        })?;
        Ok((
            out.into_iter()
                .map(|c| c.expect("every request completes"))
                .collect(),
            stats,
        ))
    }

    /// Generates, sending each completion on `tx` as it finishes (stops early without
    /// error if the receiver is dropped).
    pub fn generate_to_channel(
        &mut self,
        requests: &[Request],
        tx: &std::sync::mpsc::Sender<Completion>,
    ) -> Result<GenerateStats> {
        self.generate_with(requests, |c| {
            let _ = tx.send(c);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rng_is_deterministic_and_in_range() {
        let mut a = RequestRng::new(7);
        let mut b = RequestRng::new(7);
        let mut c = RequestRng::new(8);
        let xs: Vec<f32> = (0..1000).map(|_| a.uniform()).collect();
        let ys: Vec<f32> = (0..1000).map(|_| b.uniform()).collect();
        assert_eq!(xs, ys);
        assert_ne!(xs[0], c.uniform());
        assert!(xs.iter().all(|&x| (0.0..1.0).contains(&x)));
        let mean = xs.iter().sum::<f32>() / 1000.0;
        assert!((mean - 0.5).abs() < 0.05);
    }
}
