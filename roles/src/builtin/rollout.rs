//! The rollout role: a generation engine replica that turns prompts into samples.
//!
//! It owns a [`Generator`] and a [`TextCodec`] (prompt text → token ids, response ids →
//! text). A [`GenerateRequest`] carries the step's prompts, `n` samples per prompt,
//! sampling parameters and a seed; each sample gets its own sampling seed derived from
//! `(seed, step, prompt id, k)`, so a step's samples repeat whatever the batching.
//! Weight sync replaces the generator's weights in place from the policy's buckets and
//! bumps the weights version stamped on every sample.

use std::sync::Arc;
use std::time::Instant;

use serde::{Deserialize, Serialize};
use tch::Kind;
use yatt_engine::{Generator, Request, SamplingParams, Tokenizer};

mod multi_turn;

use crate::algo::step_token_ends;
use crate::builtin::nccl_member::{can_join, GroupMember};
use crate::builtin::scoring::{bucket_tensors, check_device, model_bytes, weights_error};
use crate::builtin::slices::{write_slices, SliceAssembly};
use crate::data::prompt::Prompt;
use crate::env::EnvSettings;
use crate::role::{DeviceGroup, DeviceRoute, ResourceProfile, Role, RoleError, WeightsUpdate};
use crate::sample::{Finish, Sample, SampleId};

/// Turns prompt text into token ids and response ids into text.
pub trait TextCodec: Send + Sync {
    /// Token ids of a prompt as the policy sees it (chat template, BOS included).
    fn encode_prompt(&self, text: &str) -> Result<Vec<i64>, String>;
    /// Token ids of response text as it follows an encoded prompt (no BOS, no template):
    /// what a reward model or judge reads after the prompt.
    fn encode_response(&self, text: &str) -> Result<Vec<i64>, String>;
    /// Text of response tokens (special tokens dropped).
    fn decode(&self, ids: &[i64]) -> Result<String, String>;
    /// Token ids of a chat prompt (a dataset row with a list of messages), with the
    /// generation prompt. The default encodes the plain `role: content` transcript, for
    /// codecs without a chat template (the tiny test models).
    fn encode_chat(&self, messages: &[yatt_engine::ChatMessage]) -> Result<Vec<i64>, String> {
        self.encode_prompt(&crate::data::prompt::transcript(messages))
    }
    /// Token ids of an environment's observation inserted after a model turn, with the
    /// template around it: the model's turn closed (unless `closed_by` says the model
    /// already closed it with that stop token), the observation as the next user turn,
    /// and the next assistant turn opened. The default, for codecs without a template,
    /// puts the observation on lines of its own.
    fn encode_observation(
        &self,
        observation: &str,
        closed_by: Option<i64>,
    ) -> Result<Vec<i64>, String> {
        let _ = closed_by;
        self.encode_response(&format!("\n{observation}\n"))
    }
    /// The tokenizer, when the codec has one: the rollout gives it to its generator so a
    /// model turn can stop at a tool call's closing tag.
    fn tokenizer(&self) -> Option<Arc<Tokenizer>> {
        None
    }
}

/// Token ids of a prompt as the rollout encodes it: its chat through the codec's chat
/// template, else its text.
pub fn encode_prompt(codec: &dyn TextCodec, p: &Prompt) -> Result<Vec<i64>, String> {
    if p.messages.is_empty() {
        codec.encode_prompt(&p.text)
    } else {
        codec.encode_chat(&p.messages)
    }
}

/// A Hugging Face tokenizer, optionally with its chat template (prompt = one user turn).
pub struct TokenizerCodec {
    /// The tokenizer.
    pub tokenizer: Arc<Tokenizer>,
    /// Wrap prompts in the chat template (with the generation prompt).
    pub chat: bool,
}

impl TextCodec for TokenizerCodec {
    fn encode_prompt(&self, text: &str) -> Result<Vec<i64>, String> {
        let r = if self.chat {
            self.tokenizer
                .encode_chat(&[yatt_engine::ChatMessage::new("user", text)], true)
        } else {
            self.tokenizer.encode(text, true)
        };
        r.map_err(|e| e.to_string())
    }

    fn encode_response(&self, text: &str) -> Result<Vec<i64>, String> {
        self.tokenizer
            .encode(text, false)
            .map_err(|e| e.to_string())
    }

    fn decode(&self, ids: &[i64]) -> Result<String, String> {
        self.tokenizer.decode(ids, true).map_err(|e| e.to_string())
    }

    /// A chat prompt always goes through the chat template (whatever `chat` says): the
    /// dataset gave messages, not text.
    fn encode_chat(&self, messages: &[yatt_engine::ChatMessage]) -> Result<Vec<i64>, String> {
        if self.tokenizer.chat_template().is_none() {
            return Err("the dataset gives this prompt as chat messages, and the model has no chat template (tokenizer_config.json `chat_template` or chat_template.jinja); use a chat model or give prompts as strings".into());
        }
        self.tokenizer
            .encode_chat(messages, true)
            .map_err(|e| e.to_string())
    }

    /// Rendered by the chat template itself: a conversation with a marker as the
    /// assistant's turn and the observation as the next user turn; what follows the
    /// marker is what goes between the model's turn and its next one.
    fn encode_observation(
        &self,
        observation: &str,
        closed_by: Option<i64>,
    ) -> Result<Vec<i64>, String> {
        if !self.chat || self.tokenizer.chat_template().is_none() {
            return self.encode_response(&format!("\n{observation}\n"));
        }
        const MARKER: &str = "\u{1}yatt-model-turn\u{1}";
        let chat = [
            yatt_engine::ChatMessage::new("user", "?"),
            yatt_engine::ChatMessage::new("assistant", MARKER),
            yatt_engine::ChatMessage::new("user", observation),
        ];
        let text = self
            .tokenizer
            .apply_chat_template(&chat, true)
            .map_err(|e| e.to_string())?;
        let at = text.find(MARKER).ok_or(
            "the chat template drops the assistant's turn; multi-turn rollouts need a template that renders it",
        )?;
        let mut rest = &text[at + MARKER.len()..];
        if let Some(t) = closed_by {
            let closer = self
                .tokenizer
                .decode(&[t], false)
                .map_err(|e| e.to_string())?;
            if !closer.is_empty() {
                rest = rest.strip_prefix(closer.as_str()).unwrap_or(rest);
            }
        }
        self.tokenizer
            .encode(rest, false)
            .map_err(|e| e.to_string())
    }

    fn tokenizer(&self) -> Option<Arc<Tokenizer>> {
        Some(self.tokenizer.clone())
    }
}

/// A character-level codec over printable ASCII for tiny test models: `' '..='~'` (95
/// characters) map to ids `first_id..first_id + 95`; other characters become `'?'`;
/// other ids decode to nothing. With `bos`, prompts start with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AsciiCodec {
    /// Id of `' '`.
    pub first_id: i64,
    /// BOS id prepended to prompts.
    pub bos: Option<i64>,
}

impl AsciiCodec {
    /// Printable ASCII characters the codec knows.
    pub const CHARS: i64 = 95;

    /// The id of a printable ASCII character.
    pub fn id_of(&self, c: char) -> Option<i64> {
        (' '..='~')
            .contains(&c)
            .then(|| self.first_id + (c as i64 - ' ' as i64))
    }
}

impl TextCodec for AsciiCodec {
    fn encode_prompt(&self, text: &str) -> Result<Vec<i64>, String> {
        let q = self.id_of('?').ok_or("unreachable")?;
        Ok(self
            .bos
            .into_iter()
            .chain(text.chars().map(|c| self.id_of(c).unwrap_or(q)))
            .collect())
    }

    fn encode_response(&self, text: &str) -> Result<Vec<i64>, String> {
        let q = self.id_of('?').ok_or("unreachable")?;
        Ok(text.chars().map(|c| self.id_of(c).unwrap_or(q)).collect())
    }

    fn decode(&self, ids: &[i64]) -> Result<String, String> {
        Ok(ids
            .iter()
            .filter_map(|&i| {
                let off = i - self.first_id;
                (0..Self::CHARS)
                    .contains(&off)
                    .then(|| (b' ' + off as u8) as char)
            })
            .collect())
    }
}

/// Generate `n` samples for each prompt.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerateRequest {
    /// The training step (part of every sample id).
    pub step: u64,
    /// The prompts.
    pub prompts: Vec<Prompt>,
    /// Samples per prompt (≥ 1).
    pub n: u32,
    /// Sampling parameters; `seed` is replaced by a per-sample seed.
    pub params: SamplingParams,
    /// Seed the per-sample seeds derive from.
    pub seed: u64,
}

/// A partial rollout's next chunk: each unfinished sample decodes up to
/// `params.max_new_tokens` more tokens (never past `budget` in all) on the weights the
/// rollout holds now, after its prompt and the tokens so far are prefilled again.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContinueRequest {
    /// The samples so far (prompt and response tokens, log-probs, versions).
    pub samples: Vec<Sample>,
    /// Sampling parameters of the chunk; `seed` is replaced per sample and chunk.
    pub params: SamplingParams,
    /// Seed the per-sample seeds derive from (the generation request's).
    pub seed: u64,
    /// The response length limit (`rollout.max_new_tokens`).
    pub budget: usize,
}

/// Where a streaming generation sends each sample as it finishes: a bounded channel,
/// so a slow consumer holds generation back (backpressure) instead of piling samples
/// up. It lives in this process only: a streaming request cannot be encoded for a
/// remote rollout.
#[derive(Debug, Clone)]
pub struct SampleSink(pub tokio::sync::mpsc::Sender<Sample>);

/// What a rollout role is asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RolloutRequest {
    /// Generate samples.
    Generate(GenerateRequest),
    /// The next-token logits after `tokens` (a probe: e.g. to check weight sync).
    NextTokenLogits(Vec<i64>),
    /// Continue unfinished samples of a partial rollout by one chunk; the answer is
    /// [`RolloutResponse::Generated`] with the samples in request order.
    Continue(ContinueRequest),
    /// Whether it can receive weights by NCCL broadcast (its weights on a GPU, libnccl
    /// loaded); the answer is [`RolloutResponse::BroadcastReadiness`]. Asked once per
    /// replica before it joins a weight-sync group, so that one that cannot gets byte
    /// buckets at once instead of leaving the others to wait out the NCCL deadline.
    CanReceiveBroadcast,
    /// Generate samples and send each to the sink the moment it finishes (finishing
    /// order); the answer is [`RolloutResponse::Streamed`]. In-process only.
    ///
    /// Last, because postcard numbers variants by position and serde skips this one
    /// only when decoding: a skipped variant before others shifted their numbers, and
    /// `NextTokenLogits` and `Continue` sent to a remote rollout failed to decode.
    #[serde(skip)]
    GenerateStream(GenerateRequest, SampleSink),
}

/// Counters of one generation call.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RolloutStats {
    /// Seconds spent generating.
    pub seconds: f64,
    /// Prompt tokens over all samples.
    pub prompt_tokens: usize,
    /// Response tokens over all samples.
    pub response_tokens: usize,
    /// Multi-turn rollouts: prompt positions whose KV was kept from the episode's
    /// previous turn instead of prefilled again.
    #[serde(default)]
    pub prefill_reused_tokens: usize,
    /// Sequences the KV cache preempted when its blocks ran out (each resumed later by
    /// recomputing its prefix).
    #[serde(default)]
    pub kv_preemptions: usize,
    /// Most bytes of KV blocks the live sequences held at once (a replica's peak; the
    /// largest over replicas when merged).
    #[serde(default)]
    pub kv_bytes_held_peak: usize,
    /// Weights version the samples were generated with.
    pub weights_version: u64,
}

impl RolloutStats {
    /// Adds the engine's KV counters of one generation call.
    pub fn add_engine(&mut self, g: &yatt_engine::GenerateStats) {
        self.kv_preemptions += g.kv_preemptions;
        self.kv_bytes_held_peak = self.kv_bytes_held_peak.max(g.kv_bytes_held_peak);
    }

    /// Adds another call's or replica's token and KV counters (seconds and the weights
    /// version are the caller's to merge).
    pub fn absorb(&mut self, o: &RolloutStats) {
        self.response_tokens += o.response_tokens;
        self.prefill_reused_tokens += o.prefill_reused_tokens;
        self.kv_preemptions += o.kv_preemptions;
        self.kv_bytes_held_peak = self.kv_bytes_held_peak.max(o.kv_bytes_held_peak);
    }
}

/// What a rollout role answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RolloutResponse {
    /// The samples, in (prompt, k) order, and counters.
    Generated {
        /// The samples.
        samples: Vec<Sample>,
        /// Counters.
        stats: RolloutStats,
    },
    /// A streaming generation finished: every sample went to the sink.
    Streamed {
        /// Samples sent.
        samples: usize,
        /// Counters.
        stats: RolloutStats,
    },
    /// Next-token logits (f32, one per vocabulary entry).
    Logits(Vec<f32>),
    /// `Ok` when it can receive weights by NCCL broadcast, else why not.
    BroadcastReadiness(Result<(), String>),
}

/// A generation engine replica.
pub struct RolloutRole {
    generator: Generator,
    codec: Arc<dyn TextCodec>,
    version: u64,
    offloaded_from: Option<tch::Device>,
    /// Weight syncs that arrived while offloaded, in order: applied on reload (so
    /// the weights do not come back to the device while another role has it).
    deferred: Vec<WeightsUpdate>,
    /// With an environment, every sample is a multi-turn episode.
    env: Option<EnvSettings>,
    /// With step credit on: what ends a reasoning step, so each sample says where its
    /// steps end in tokens.
    step_delimiter: Option<String>,
    /// Its place in the policy's NCCL weight-sync group, once joined.
    broadcast: GroupMember,
    /// A sharded policy's slices of the version being synced, until the last comes.
    slices: SliceAssembly,
    /// Free the KV cache after each generation request.
    free_kv: bool,
}

impl RolloutRole {
    /// A rollout replica over `generator` (its model on the device the role will be
    /// started on), with `codec` for prompts and responses.
    pub fn new(generator: Generator, codec: Arc<dyn TextCodec>) -> Self {
        RolloutRole {
            generator,
            codec,
            version: 0,
            offloaded_from: None,
            deferred: Vec::new(),
            env: None,
            step_delimiter: None,
            broadcast: GroupMember::default(),
            slices: SliceAssembly::default(),
            free_kv: false,
        }
    }

    /// Frees the KV cache (and the KV kept for continuing sequences) after each
    /// generation request, and hands freed host memory back to the OS: what a rollout
    /// sharing its process or device with a trainer gives back for the update (verl's
    /// `free_cache_engine`). The next request allocates the cache again.
    pub fn freeing_kv_after_each_request(mut self) -> Self {
        self.free_kv = true;
        self
    }

    /// Marks where each reasoning step of every response ends (`Sample::step_ends`), a
    /// step ending after each `delimiter` (see [`crate::step_spans`]): step credit
    /// needs the tokens each step verdict is about.
    pub fn with_step_delimiter(mut self, delimiter: impl Into<String>) -> Self {
        self.step_delimiter = Some(delimiter.into());
        self
    }

    /// Makes every sample a multi-turn episode with an environment of `env` (see
    /// [`crate::Env`]). A codec with a tokenizer gives it to the generator, so a model
    /// turn stops at a tool call's closing tag.
    pub fn with_env(mut self, env: EnvSettings) -> Self {
        if let Some(tok) = self.codec.tokenizer() {
            self.generator = self.generator.with_tokenizer(tok);
        }
        self.env = Some(env);
        self
    }

    /// How this replica turns response tokens into text (and step ends).
    pub(crate) fn text_of(&self) -> ResponseText<'_> {
        ResponseText {
            codec: &*self.codec,
            step_delimiter: self.step_delimiter.as_deref(),
        }
    }

    /// The engine requests of `req`, with each one's sample id and prompt index, and
    /// the encoded prompts.
    fn requests(&self, req: &GenerateRequest) -> Result<Planned, RoleError> {
        if req.n == 0 {
            return Err(RoleError::BadRequest(
                "n (samples per prompt) must be >= 1".into(),
            ));
        }
        let mut requests = Vec::with_capacity(req.prompts.len() * req.n as usize);
        let mut ids = Vec::with_capacity(requests.capacity());
        let mut encoded = Vec::with_capacity(req.prompts.len());
        for (pi, p) in req.prompts.iter().enumerate() {
            let tokens = encode_prompt(self.codec.as_ref(), p).map_err(|e| {
                RoleError::BadRequest(format!("prompt {:#x}: cannot encode: {e}", p.id))
            })?;
            if tokens.is_empty() {
                return Err(RoleError::BadRequest(format!(
                    "prompt {:#x} encodes to no tokens",
                    p.id
                )));
            }
            for k in 0..req.n {
                let id = SampleId {
                    step: req.step,
                    prompt: p.id,
                    k,
                };
                let params = SamplingParams {
                    seed: sample_seed(req.seed, &id),
                    ..req.params.clone()
                };
                requests.push(Request {
                    id: requests.len() as u64,
                    prompt: tokens.clone(),
                    params,
                });
                ids.push((id, pi));
            }
            encoded.push(tokens);
        }
        Ok(Planned {
            requests,
            ids,
            encoded,
        })
    }

    /// With [`RolloutRole::freeing_kv_after_each_request`], frees the KV cache.
    fn after_generation(&mut self) {
        if self.free_kv {
            self.generator.free_cache();
            yatt_engine::release_host_memory();
        }
    }

    fn generate(&mut self, req: GenerateRequest) -> Result<RolloutResponse, RoleError> {
        if let Some(env) = self.env.clone() {
            let (samples, stats) = self.generate_episodes(&req, &env)?;
            return Ok(RolloutResponse::Generated { samples, stats });
        }
        let plan = self.requests(&req)?;
        let t0 = Instant::now();
        let (completions, engine) = self
            .generator
            .generate(&plan.requests)
            .map_err(|e| RoleError::Failed(format!("generation of step {}: {e}", req.step)))?;
        let mut stats = RolloutStats {
            seconds: t0.elapsed().as_secs_f64(),
            weights_version: self.version,
            ..Default::default()
        };
        stats.add_engine(&engine);
        // `generate` answers in request order: (prompt, k).
        let samples = completions
            .into_iter()
            .map(|c| sample_of(self.text_of(), self.version, &req, &plan, c, &mut stats))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(RolloutResponse::Generated { samples, stats })
    }

    /// Like [`Self::generate`], but each sample goes to `sink` as soon as it finishes.
    fn generate_stream(
        &mut self,
        req: GenerateRequest,
        sink: SampleSink,
    ) -> Result<RolloutResponse, RoleError> {
        if let Some(env) = self.env.clone() {
            // Episodes finish together (turn by turn), so they go out at the end.
            let (samples, stats) = self.generate_episodes(&req, &env)?;
            let n = samples.len();
            for s in samples {
                sink.0.blocking_send(s).map_err(|_| {
                    RoleError::Failed(format!(
                        "step {}: the stream's receiver went away",
                        req.step
                    ))
                })?;
            }
            return Ok(RolloutResponse::Streamed { samples: n, stats });
        }
        let plan = self.requests(&req)?;
        let t0 = Instant::now();
        let mut stats = RolloutStats {
            weights_version: self.version,
            ..Default::default()
        };
        let (mut sent, mut failed) = (0usize, None);
        let (codec, delimiter, version) = (
            self.codec.clone(),
            self.step_delimiter.clone(),
            self.version,
        );
        let text_of = ResponseText {
            codec: &*codec,
            step_delimiter: delimiter.as_deref(),
        };
        let r = self.generator.generate_with(&plan.requests, |c| {
            if failed.is_some() {
                return;
            }
            match sample_of(text_of, version, &req, &plan, c, &mut stats) {
                // Blocks while the channel is full: the consumer sets the pace.
                Ok(s) => match sink.0.blocking_send(s) {
                    Ok(()) => sent += 1,
                    Err(_) => {
                        failed = Some(RoleError::Failed(format!(
                            "step {}: the stream's receiver went away after {sent} samples",
                            req.step
                        )))
                    }
                },
                Err(e) => failed = Some(e),
            }
        });
        let engine =
            r.map_err(|e| RoleError::Failed(format!("generation of step {}: {e}", req.step)))?;
        stats.add_engine(&engine);
        if let Some(e) = failed {
            return Err(e);
        }
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok(RolloutResponse::Streamed {
            samples: sent,
            stats,
        })
    }

    /// One chunk more of each sample of `req` (see [`ContinueRequest`]).
    fn continue_samples(&mut self, req: ContinueRequest) -> Result<RolloutResponse, RoleError> {
        if self.env.is_some() {
            return Err(RoleError::BadRequest(
                "partial rollouts cannot continue multi-turn episodes; unset rollout.partial_rollout or rollout.env".into(),
            ));
        }
        let t0 = Instant::now();
        let mut requests = Vec::with_capacity(req.samples.len());
        for (i, s) in req.samples.iter().enumerate() {
            let left = req.budget.saturating_sub(s.response_len());
            if left == 0 || s.prompt_tokens.is_empty() {
                return Err(RoleError::BadRequest(format!(
                    "{}: nothing to continue ({} of {} response tokens, {} prompt tokens)",
                    s.id,
                    s.response_len(),
                    req.budget,
                    s.prompt_tokens.len()
                )));
            }
            let mut prompt = s.prompt_tokens.clone();
            prompt.extend_from_slice(&s.response_tokens);
            let params = SamplingParams {
                // A chunk's own seed: the same sample continued at the same length draws
                // the same tokens, whoever continues it.
                seed: sample_seed(req.seed, &s.id) ^ (s.response_len() as u64).rotate_left(32),
                max_new_tokens: req.params.max_new_tokens.min(left),
                ..req.params.clone()
            };
            requests.push(Request {
                id: i as u64,
                prompt,
                params,
            });
        }
        let (completions, engine) = self.generator.generate(&requests).map_err(|e| {
            RoleError::Failed(format!("continuing {} samples: {e}", req.samples.len()))
        })?;
        let mut stats = RolloutStats {
            weights_version: self.version,
            ..Default::default()
        };
        stats.add_engine(&engine);
        let mut samples = req.samples;
        for c in completions {
            let s = samples.get_mut(c.id as usize).ok_or_else(|| {
                RoleError::Failed(format!("the generator answered unknown request {}", c.id))
            })?;
            stats.prompt_tokens += s.prompt_tokens.len() + s.response_len();
            stats.response_tokens += c.tokens.len();
            s.response_tokens.extend(c.tokens);
            s.rollout_logprobs.extend(c.logprobs);
            s.finish = Finish::from(c.finish);
            (s.response_text, s.step_ends) =
                self.text_of().of(&s.response_tokens).map_err(|e| {
                    RoleError::Failed(format!("{}: cannot decode the response: {e}", s.id))
                })?;
            if self.version != s.weights_version {
                s.weights_version_last = Some(self.version);
            }
        }
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok(RolloutResponse::Generated { samples, stats })
    }

    fn logits(&self, tokens: Vec<i64>) -> Result<RolloutResponse, RoleError> {
        if tokens.is_empty() {
            return Err(RoleError::BadRequest(
                "NextTokenLogits needs at least one token".into(),
            ));
        }
        let model = self.generator.model();
        let ids = tch::Tensor::from_slice(&tokens)
            .view([1, -1])
            .to_device(model.device());
        let logits = tch::no_grad(|| model.forward(&ids, None));
        let last = logits
            .get(0)
            .get(tokens.len() as i64 - 1)
            .to_kind(Kind::Float)
            .to_device(tch::Device::Cpu);
        let v = Vec::<f32>::try_from(last)
            .map_err(|e| RoleError::Failed(format!("reading logits: {e}")))?;
        Ok(RolloutResponse::Logits(v))
    }
}

/// A generation request planned for the engine.
struct Planned {
    requests: Vec<Request>,
    /// Per engine request: the sample id and the prompt's index.
    ids: Vec<(SampleId, usize)>,
    /// Per prompt: its tokens.
    encoded: Vec<Vec<i64>>,
}

/// Turns response tokens into the response's text and, with a step delimiter, where
/// each of its steps ends in tokens.
#[derive(Clone, Copy)]
pub(crate) struct ResponseText<'a> {
    pub(crate) codec: &'a dyn TextCodec,
    pub(crate) step_delimiter: Option<&'a str>,
}

impl ResponseText<'_> {
    pub(crate) fn of(&self, tokens: &[i64]) -> Result<(String, Option<Vec<u32>>), String> {
        let text = self.codec.decode(tokens)?;
        let ends = match self.step_delimiter {
            None => None,
            Some(d) => {
                // Each token's own text: where the steps end in tokens.
                let pieces = tokens
                    .iter()
                    .map(|t| self.codec.decode(std::slice::from_ref(t)))
                    .collect::<Result<Vec<_>, _>>()?;
                Some(step_token_ends(&pieces, d))
            }
        };
        Ok((text, ends))
    }
}

/// The sample of one completion (and its counters into `stats`).
fn sample_of(
    text_of: ResponseText,
    version: u64,
    req: &GenerateRequest,
    plan: &Planned,
    c: yatt_engine::Completion,
    stats: &mut RolloutStats,
) -> Result<Sample, RoleError> {
    let &(id, pi) = plan.ids.get(c.id as usize).ok_or_else(|| {
        RoleError::Failed(format!("the generator answered unknown request {}", c.id))
    })?;
    let prompt = &req.prompts[pi];
    let (response_text, step_ends) = text_of
        .of(&c.tokens)
        .map_err(|e| RoleError::Failed(format!("{id}: cannot decode the response: {e}")))?;
    stats.prompt_tokens += plan.encoded[pi].len();
    stats.response_tokens += c.tokens.len();
    Ok(Sample {
        prompt_tokens: plan.encoded[pi].clone(),
        response_tokens: c.tokens,
        rollout_logprobs: c.logprobs,
        finish: Finish::from(c.finish),
        prompt_text: prompt.text.clone(),
        response_text,
        step_ends,
        reference: prompt.reference.clone(),
        metadata: prompt.metadata.clone(),
        weights_version: version,
        ..Sample::new(id, prompt.id)
    })
}

/// The sampling seed of one sample: a SplitMix64 mix of the request seed and the id.
fn sample_seed(seed: u64, id: &SampleId) -> u64 {
    let mut x = seed;
    for v in [id.step, id.prompt, id.k as u64] {
        x = x.wrapping_add(v).wrapping_add(0x9E37_79B9_7F4A_7C15);
        x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        x ^= x >> 31;
    }
    x
}

impl Role for RolloutRole {
    type Request = RolloutRequest;
    type Response = RolloutResponse;

    fn name(&self) -> &str {
        "rollout"
    }

    fn profile(&self) -> ResourceProfile {
        let cfg = self.generator.config();
        let m = self.generator.model();
        let c = &m.config;
        // KV cache: 2 (K, V) × layers × slots × positions × kv heads × head dim.
        let kv = 2
            * c.num_hidden_layers
            * cfg.max_batch as i64
            * cfg.max_seq_len as i64
            * c.num_key_value_heads
            * c.head_dim;
        let kv = kv.max(0) as u64 * m.kind().elt_size_in_bytes() as u64;
        // A paged cache with a budget allocates the budget instead.
        let kv = cfg.kv_cache_bytes.map_or(kv, |b| b as u64);
        // What it holds now on its device: the weights unless offloaded to the host
        // (on a CPU device they stay where they are), and the KV cache once allocated.
        let weights = match self.offloaded_from {
            Some(dev) if dev != m.device() => 0,
            _ => model_bytes(m),
        };
        let cache = if self.generator.cache_ptr().is_some() {
            kv
        } else {
            0
        };
        ResourceProfile {
            resident_bytes: weights + cache,
            peak_extra_bytes: kv,
            offloadable: true,
            needs_gpu: false,
        }
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        check_device("rollout", self.generator.model().device(), group)
    }

    fn serve(&mut self, request: RolloutRequest) -> Result<RolloutResponse, RoleError> {
        match request {
            // Offloaded or not: where its weights live when they are loaded.
            RolloutRequest::CanReceiveBroadcast => {
                let device = self
                    .offloaded_from
                    .unwrap_or_else(|| self.generator.model().device());
                let ready = can_join(device, "the rollout's");
                Ok(RolloutResponse::BroadcastReadiness(ready))
            }
            _ if self.offloaded_from.is_some() => Err(RoleError::NotReady(
                "rollout is offloaded; reload it first".into(),
            )),
            RolloutRequest::NextTokenLogits(t) => self.logits(t),
            RolloutRequest::Generate(r) => {
                let out = self.generate(r);
                self.after_generation();
                out
            }
            RolloutRequest::GenerateStream(r, sink) => {
                let out = self.generate_stream(r, sink);
                self.after_generation();
                out
            }
            RolloutRequest::Continue(r) => {
                let out = self.continue_samples(r);
                self.after_generation();
                out
            }
        }
    }

    fn offload(&mut self) -> Result<(), RoleError> {
        if self.offloaded_from.is_none() {
            let dev = self.generator.model().device();
            self.generator.free_cache();
            self.generator.model_mut().to_device(tch::Device::Cpu);
            self.offloaded_from = Some(dev);
        }
        Ok(())
    }

    fn reload(&mut self) -> Result<(), RoleError> {
        if let Some(dev) = self.offloaded_from.take() {
            self.generator.model_mut().to_device(dev);
        }
        // The weight syncs that arrived while offloaded, in their order, now that the
        // weights are back on the device (an in-process snapshot is adopted there).
        for update in std::mem::take(&mut self.deferred) {
            self.apply_weights(update)?;
        }
        Ok(())
    }

    fn load_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        if self.offloaded_from.is_some() {
            if update.device.is_some() {
                // The policy frees its buffer after the next sync or two, and a reload
                // may come later than that; a broadcast needs the device now.
                return Err(RoleError::BadRequest(format!(
                    "weights v{} arrived in the policy's device buffer (CUDA IPC or NCCL) while the rollout is offloaded; send them as buckets (ExportWeights)",
                    update.version
                )));
            }
            // A whole in-process snapshot replaces every weight: the earlier deferred
            // updates are moot. Buckets may carry part of the weights (adapters): keep
            // them all, in order.
            if update.local.is_some() {
                self.deferred.clear();
            }
            self.deferred.push(update);
            return Ok(());
        }
        self.apply_weights(update)
    }
}

impl RolloutRole {
    /// The policy version of the weights it generates with (a weight sync deferred
    /// while offloaded counts once applied, on reload).
    pub fn weights_version(&self) -> u64 {
        self.version
    }

    fn apply_weights(&mut self, update: WeightsUpdate) -> Result<(), RoleError> {
        // Through the generator, not `model_mut`: that would pack the weights a second
        // time before the next generation (adopting or copying already repacks them).
        if let Some(local) = &update.local {
            self.generator
                .adopt_weights(&local.tensors())
                .map_err(|e| weights_error(&update, e))?;
            self.version = update.version;
            return Ok(());
        }
        let device = self.generator.model().device();
        if let Some(slice) = update.slice {
            let Some(all) = self.slices.offer(update, slice)? else {
                return Ok(());
            };
            let generator = &mut self.generator;
            write_slices(&all, device, |world, named| {
                generator.write_unit_slices(world, named)
            })?;
            self.version = all[0].version;
            return Ok(());
        }
        if let Some(w) = &update.device {
            if let DeviceRoute::Broadcast(group) = &w.route {
                let got = self.broadcast.receive(update.version, w, group, device)?;
                let named = got.views.iter().map(|(n, t)| (n.as_str(), t));
                self.generator
                    .update_weights(named)
                    .map_err(|e| weights_error(&update, e))?;
                self.version = update.version;
                return Ok(());
            }
        }
        let named = bucket_tensors(&update, device)?;
        self.generator
            .update_weights(named.iter())
            .map_err(|e| weights_error(&update, e))?;
        self.version = update.version;
        Ok(())
    }
}

/// The character codec of the tiny model.
pub const TINY_CODEC: AsciiCodec = AsciiCodec {
    first_id: 2,
    bos: Some(0),
};

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Device;
    use yatt_engine::{tiny_config, GeneratorConfig, Llama};

    fn role() -> RolloutRole {
        let model = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 7).unwrap();
        let config = GeneratorConfig {
            max_batch: 8,
            max_seq_len: 32,
            ..Default::default()
        };
        RolloutRole::new(Generator::new(model, config), Arc::new(TINY_CODEC))
    }

    fn generated(r: RolloutResponse) -> Vec<Sample> {
        match r {
            RolloutResponse::Generated { samples, .. } => samples,
            other => panic!("{other:?}"),
        }
    }

    /// A partial rollout's chunk continues each response where it stopped, on the
    /// weights the rollout holds now, and records the version of its last token.
    #[test]
    fn continue_appends_a_chunk_and_records_the_newer_version() {
        let mut r = role();
        let params = SamplingParams {
            max_new_tokens: 2,
            ignore_eos: true,
            ..Default::default()
        };
        let prompt = Prompt {
            id: 0x10,
            text: "abc".into(),
            reference: None,
            metadata: serde_json::Value::Null,
            messages: Vec::new(),
        };
        let first = generated(
            r.serve(RolloutRequest::Generate(GenerateRequest {
                step: 0,
                prompts: vec![prompt],
                n: 2,
                params: params.clone(),
                seed: 5,
            }))
            .unwrap(),
        );
        assert!(first.iter().all(|s| s.response_len() == 2));
        // A weight sync between the chunks.
        r.version = 1;
        let cont = |r: &mut RolloutRole, samples: Vec<Sample>| {
            generated(
                r.serve(RolloutRequest::Continue(ContinueRequest {
                    samples,
                    params: params.clone(),
                    seed: 5,
                    budget: 5,
                }))
                .unwrap(),
            )
        };
        let more = cont(&mut r, first.clone());
        for (a, b) in first.iter().zip(&more) {
            assert_eq!(b.id, a.id);
            assert_eq!(b.response_len(), 4);
            assert_eq!(b.response_tokens[..2], a.response_tokens[..]);
            assert_eq!(b.rollout_logprobs.len(), 4);
            assert_eq!(b.rollout_logprobs[..2], a.rollout_logprobs[..]);
            assert_eq!(b.version_span(), (0, 1));
            assert_eq!(
                b.response_text,
                TINY_CODEC.decode(&b.response_tokens).unwrap()
            );
        }
        // The same chunk again draws the same tokens; the last chunk stops at the budget.
        assert_eq!(cont(&mut r, first.clone()), more);
        let last = cont(&mut r, more.clone());
        assert!(last.iter().all(|s| s.response_len() == 5));
        let e = r
            .serve(RolloutRequest::Continue(ContinueRequest {
                samples: last,
                params: params.clone(),
                seed: 5,
                budget: 5,
            }))
            .unwrap_err();
        assert!(e.to_string().contains("nothing to continue"), "{e}");
    }

    /// With the KV cache freed after each request, a rollout holds no cache between
    /// requests and draws the same tokens as one that keeps it.
    #[test]
    fn a_rollout_freeing_its_kv_cache_holds_none_between_requests() {
        let ask = |r: &mut RolloutRole| {
            let prompt = Prompt {
                id: 0x20,
                text: "abcd".into(),
                reference: None,
                metadata: serde_json::Value::Null,
                messages: Vec::new(),
            };
            generated(
                r.serve(RolloutRequest::Generate(GenerateRequest {
                    step: 0,
                    prompts: vec![prompt],
                    n: 3,
                    params: SamplingParams {
                        max_new_tokens: 6,
                        ignore_eos: true,
                        ..Default::default()
                    },
                    seed: 9,
                }))
                .unwrap(),
            )
        };
        let mut keeping = role();
        let kept = ask(&mut keeping);
        assert!(keeping.generator.cache_ptr().is_some());
        let mut freeing = role().freeing_kv_after_each_request();
        for _ in 0..2 {
            assert_eq!(ask(&mut freeing), kept);
            assert!(freeing.generator.cache_ptr().is_none());
        }
    }

    /// Weights by CUDA IPC handle are refused while offloaded (the policy may free its
    /// buffer before the reload) and on the CPU, each saying to send buckets; the
    /// rollout keeps its weights and version.
    #[test]
    fn device_weights_are_refused_where_they_cannot_be_mapped() {
        let handle = serde_json::from_value(serde_json::json!({
            "handle": vec![0u8; 64], "offset": 0, "bytes": 64,
            "host": yatt_collective::boot_id(), "pid": std::process::id() + 1, "ptr": 0,
        }))
        .unwrap();
        let update = || WeightsUpdate {
            device: Some(crate::role::DeviceWeights {
                entries: Vec::new(),
                route: DeviceRoute::Ipc(Clone::clone(&handle)),
            }),
            ..WeightsUpdate::from_buckets(4, Vec::new())
        };
        let mut r = role();
        let e = r.load_weights(update()).unwrap_err().to_string();
        assert!(
            e.contains("weights v4 through CUDA IPC")
                && e.contains("on the CPU")
                && e.contains("buckets"),
            "{e}"
        );
        r.offload().unwrap();
        let e = r.load_weights(update()).unwrap_err().to_string();
        assert!(e.contains("offloaded") && e.contains("buckets"), "{e}");
        r.reload().unwrap();
        assert_eq!(r.weights_version(), 0);
    }

    /// A broadcast to a rollout on the CPU is refused before any NCCL call (which would
    /// wait for the group's deadline), naming the CPU and the setting to use; asked
    /// beforehand, offloaded or not, it says it cannot receive one and why.
    #[test]
    fn broadcast_weights_are_refused_on_the_cpu() {
        let group = |rank| crate::role::NcclGroup {
            id: yatt_collective::UniqueId::from_bytes([7; yatt_collective::UNIQUE_ID_BYTES]),
            rank,
            nranks: 2,
            deadline_ms: 60_000,
            bucket_bytes: 1 << 20,
        };
        let update = |rank| WeightsUpdate {
            device: Some(crate::role::DeviceWeights {
                entries: Vec::new(),
                route: DeviceRoute::Broadcast(group(rank)),
            }),
            ..WeightsUpdate::from_buckets(3, Vec::new())
        };
        let mut r = role();
        let t = std::time::Instant::now();
        let e = r.load_weights(update(1)).unwrap_err().to_string();
        assert!(
            e.contains("weights v3 by NCCL broadcast")
                && e.contains("on the CPU")
                && e.contains("rollout.weight_sync"),
            "{e}"
        );
        assert!(t.elapsed() < std::time::Duration::from_secs(5), "it waited");
        assert_eq!(r.weights_version(), 0);
        let readiness =
            |r: &mut RolloutRole| match r.serve(RolloutRequest::CanReceiveBroadcast).unwrap() {
                RolloutResponse::BroadcastReadiness(ready) => ready,
                other => panic!("{other:?}"),
            };
        let why = readiness(&mut r).unwrap_err();
        assert_eq!(
            why,
            "NCCL unavailable: the rollout's weights are on the CPU"
        );
        r.offload().unwrap();
        assert_eq!(readiness(&mut r), Err(why));
    }

    /// A weight sync into an offloaded rollout waits for the reload, then applies: the
    /// reloaded rollout generates what a rollout that took the weights at once does,
    /// and offloading frees the KV cache.
    #[test]
    fn a_weight_sync_while_offloaded_applies_on_reload() {
        let other = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 8).unwrap();
        let update = |m: &mut Llama| WeightsUpdate {
            version: 3,
            buckets: Vec::new(),
            local: Some(crate::role::LocalWeights::new(m.weights_snapshot())),
            device: None,
            slice: None,
        };
        let mut other = other;
        let request = || {
            RolloutRequest::Generate(GenerateRequest {
                step: 0,
                prompts: vec![Prompt {
                    id: 1,
                    text: "abc".into(),
                    reference: None,
                    metadata: serde_json::Value::Null,
                    messages: Vec::new(),
                }],
                n: 3,
                params: SamplingParams {
                    max_new_tokens: 4,
                    ignore_eos: true,
                    ..Default::default()
                },
                seed: 9,
            })
        };
        let mut direct = role();
        direct.load_weights(update(&mut other)).unwrap();
        let want = generated(direct.serve(request()).unwrap());

        let mut r = role();
        let before = generated(r.serve(request()).unwrap());
        assert_ne!(before, want, "the two models should differ");
        let loaded = r.profile().resident_bytes;
        r.offload().unwrap();
        assert!(r.profile().resident_bytes < loaded, "the KV cache is freed");
        r.load_weights(update(&mut other)).unwrap();
        assert_eq!(r.weights_version(), 0, "deferred until the reload");
        assert!(
            r.serve(request()).is_err(),
            "an offloaded rollout refuses work"
        );
        r.reload().unwrap();
        assert_eq!(r.weights_version(), 3);
        assert_eq!(generated(r.serve(request()).unwrap()), want);
    }
}
