//! The models and roles of a job: the base model, and each role built from the config.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use yatt_engine::tch::{Device, Kind};
use yatt_engine::tiny_config;
use yatt_engine::{
    tch, Generator, GeneratorConfig, Llama, LrSchedule, Tokenizer, TrainConfig, Trainer,
};
use yatt_roles::{
    CriticConfig, CriticRole, KlEstimator, KlLossConfig, PolicyConfig, PolicyLossConfig,
    PolicyRole, ReferenceRole, RolloutRole, ShardedCriticRole, ShardedPolicyRole,
    ShardedReferenceRole, ShardedStart, TextCodec, TokenizerCodec, ValueLossConfig,
};
use yatt_runtime::Node;
use yatt_runtime::RingMember;

use crate::config::checks::invalid;
use crate::config::modes::{CallPrefix, KlMode, LoraSyncMode, ModelSource, OldLogprobs, Schedule};
use crate::config::sections::{EnvSection, JobConfig, Packing};
use crate::controller::error::ControllerError;
use crate::error::JobError;
use yatt_roles::{
    builtin_env_factory, EnvFactory, EnvSettings, EpisodeLimits, LoraSync, OffPolicyConfig,
    PrefixUse, PythonToolConfig, TINY_CODEC,
};

/// The job's model (every role starts from a copy of it), the codec of its text and its
/// padding id.
pub fn base_model(job: &JobConfig) -> Result<(Llama, Arc<dyn TextCodec>, i64), JobError> {
    tch::set_num_threads(job.model.threads as i32);
    let dir = match &job.model.source {
        ModelSource::Dir(dir) => dir,
        ModelSource::Tiny => return tiny_model(job),
    };
    let me = |e: yatt_engine::EngineError| JobError::Model {
        source_desc: dir.display().to_string(),
        reason: e.to_string(),
    };
    let mut m = Llama::load(dir, Device::Cpu, Kind::Float).map_err(me)?;
    m.memory = memory_options(job);
    let tok = Tokenizer::from_dir(dir).map_err(me)?;
    Ok((
        m,
        Arc::new(TokenizerCodec {
            tokenizer: Arc::new(tok),
            chat: job.model.chat,
        }),
        0,
    ))
}

/// The random tiny Llama of `model.source = "tiny"`, with its character codec.
pub(crate) fn tiny_model(job: &JobConfig) -> Result<(Llama, Arc<dyn TextCodec>, i64), JobError> {
    let seed = job.job.seed;
    // Llama::random seeds libtorch's global RNG: builds in parallel must not
    // interleave their draws.
    static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _g = RNG.lock().unwrap_or_else(|e| e.into_inner());
    let mut config = tiny_config();
    if job.model.tiny_layers > 0 {
        // Through the JSON, so a checkpoint's config.json (written from it) says
        // the same depth and loads back as this model.
        let mut raw = config.raw.clone();
        raw["num_hidden_layers"] = serde_json::json!(job.model.tiny_layers);
        config = yatt_engine::ModelConfig::from_json(&raw).map_err(|e| JobError::Model {
            source_desc: "tiny".into(),
            reason: e,
        })?;
    }
    let mut m = Llama::random(config, Device::Cpu, Kind::Float, seed as i64).map_err(|e| {
        JobError::Model {
            source_desc: "tiny".into(),
            reason: e.to_string(),
        }
    })?;
    m.memory = memory_options(job);
    Ok((m, Arc::new(TINY_CODEC), 1))
}

/// `[model]`'s memory settings for long sequences, as the engine takes them.
pub(crate) fn memory_options(job: &JobConfig) -> yatt_engine::MemoryOptions {
    yatt_engine::MemoryOptions {
        logprob_chunk_tokens: job.model.logprob_chunk_tokens.max(1),
        activation_checkpointing: job.model.activation_checkpointing,
        recompute_chunk_tokens: job.model.recompute_chunk_tokens.max(1),
        layout: match job.model.packing {
            Packing::Padded => yatt_engine::RowLayout::Padded,
            Packing::Packed => yatt_engine::RowLayout::Packed,
        },
        ..Default::default()
    }
}

/// A rollout replica of the job over `model`.
pub fn rollout_role(job: &JobConfig, model: Llama, codec: Arc<dyn TextCodec>) -> RolloutRole {
    rollout_role_with_envs(job, model, codec, None)
}

/// A rollout replica whose episodes' environments come from `envs` (e.g. a pool of
/// environment actors on another node) instead of the built-in ones in this process.
pub(crate) fn rollout_role_with_envs(
    job: &JobConfig,
    model: Llama,
    codec: Arc<dyn TextCodec>,
    envs: Option<Arc<dyn EnvFactory>>,
) -> RolloutRole {
    let mut batch = job.data.prompts_per_step * job.data.samples_per_prompt as usize;
    if job.rollout.max_batch > 0 {
        batch = batch.min(job.rollout.max_batch);
    }
    let gen_config = GeneratorConfig {
        max_batch: batch.max(1),
        max_seq_len: job.model.max_seq_len,
        kv_cache_bytes: (job.rollout.kv_cache_bytes > 0)
            .then_some(job.rollout.kv_cache_bytes as usize),
        ..Default::default()
    };
    let mut generator = Generator::new(model, gen_config);
    generator.set_cuda_graphs(job.rollout.cuda_graphs);
    if !job.rollout.stop.is_empty() {
        // The engine reads stop strings through the tokenizer.
        if let Some(tok) = codec.tokenizer() {
            generator = generator.with_tokenizer(tok);
        }
    }
    let mut role = RolloutRole::new(generator, codec);
    if job.rollout.free_kv_cache {
        role = role.freeing_kv_after_each_request();
    }
    if let Some(c) = &job.algorithm.step_credit {
        role = role.with_step_delimiter(c.delimiter.clone());
    }
    match &job.rollout.env {
        Some(e) => {
            let mut settings = env_settings(job, e);
            if let Some(f) = envs {
                settings.factory = f;
            }
            role.with_env(settings)
        }
        None => role,
    }
}

/// The rollout's environment settings from `[rollout.env]`: the built-in environment
/// of `kind`, made in this process.
pub(crate) fn env_settings(job: &JobConfig, e: &EnvSection) -> EnvSettings {
    let secs = |s: f64| Duration::from_secs_f64(s.max(0.001));
    let python = PythonToolConfig {
        python: match e.python.as_os_str().is_empty() {
            true => yatt_roles::default_python(),
            false => e.python.clone(),
        },
        timeout: secs(e.python_timeout_s),
        memory_bytes: e.python_memory_mb << 20,
        output_bytes: e.python_output_bytes,
    };
    EnvSettings {
        factory: builtin_env_factory(e.kind, python, e.call_prefix != CallPrefix::Off),
        limits: EpisodeLimits {
            max_turns: e.max_turns,
            max_env_tokens: e.max_env_tokens,
            max_turn_tokens: e.max_turn_tokens,
            budget: job.rollout.max_new_tokens,
        },
        timeout: secs(e.timeout_s),
        keep_kv: e.keep_kv,
        prefix: match e.call_prefix {
            CallPrefix::Guide => PrefixUse::Guide {
                fraction: e.guide_fraction,
            },
            CallPrefix::Off | CallPrefix::Always => PrefixUse::Masked,
        },
    }
}

/// The job's reference role over `model`.
pub fn reference_role(job: &JobConfig, model: Llama, pad_id: i64) -> ReferenceRole {
    ReferenceRole::new(
        model,
        pad_id,
        job.rollout.temperature,
        job.optim.micro_batch,
    )
}

/// The reference over `model` sharded over `job.reference_shards` rank threads of
/// this process, scoring as the policy does (its micro-batching and temperature).
pub(crate) fn sharded_reference_role(
    job: &JobConfig,
    mut model: Llama,
    pad_id: i64,
) -> Result<ShardedReferenceRole, JobError> {
    model.memory = memory_options(job);
    let start = ShardedStart {
        shards: job.job.reference_shards,
        ..sharded_start(job)
    };
    ShardedReferenceRole::new(model, policy_config(job, pad_id), &start).map_err(|e| {
        JobError::Model {
            source_desc: job.model.source.to_string(),
            reason: format!("sharded reference: {e}"),
        }
    })
}

/// The policy's optimizer settings.
pub(crate) fn train_config(job: &JobConfig) -> TrainConfig {
    let o = &job.optim;
    let warmup_steps = o.warmup_steps;
    let schedule = match o.schedule {
        Schedule::Cosine => LrSchedule::Cosine {
            warmup_steps,
            total_steps: job.job.steps * o.mini_batches as u64,
            min_ratio: 0.1,
        },
        Schedule::Constant => LrSchedule::Constant { warmup_steps },
    };
    TrainConfig {
        lr: o.lr,
        weight_decay: o.weight_decay,
        max_grad_norm: (o.max_grad_norm > 0.0).then_some(o.max_grad_norm),
        schedule,
        seed: job.job.seed,
        ..Default::default()
    }
}

/// The job's policy role: a fresh trainer over `model` with the job's optimizer and loss.
/// The job's policy role over a fresh trainer of `model`.
pub fn policy_role(job: &JobConfig, model: Llama, pad_id: i64) -> Result<PolicyRole, JobError> {
    policy_role_from(job, policy_trainer(job, model)?, pad_id)
}

/// A fresh policy trainer over `model`; with `[model.lora]` it trains adapters on the
/// frozen `model`.
pub fn policy_trainer(job: &JobConfig, mut model: Llama) -> Result<Trainer, JobError> {
    if let Some(lora) = &job.model.lora {
        model
            .add_lora(lora.engine_config(), job.job.seed as i64)
            .map_err(|e| JobError::Model {
                source_desc: job.model.source.to_string(),
                reason: format!("model.lora: {e}"),
            })?;
        // Checkpoints name the base (PEFT's base_model_name_or_path) by absolute path.
        let base = job
            .model
            .source
            .dir()
            .map(|d| std::fs::canonicalize(d).unwrap_or_else(|_| PathBuf::from(d)));
        if let Some(adapters) = model.lora_mut() {
            adapters.base_path = base;
        }
    }
    Ok(Trainer::new(model, train_config(job)))
}

/// The job's policy role over `trainer` (fresh, or loaded from a checkpoint).
pub fn policy_role_from(
    job: &JobConfig,
    trainer: Trainer,
    pad_id: i64,
) -> Result<PolicyRole, JobError> {
    PolicyRole::new(trainer, policy_config(job, pad_id)).map_err(|e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: format!("policy role: {e}"),
    })
}

/// The job's policy sharded over `job.policy_shards` ranks in this process, on `device`
/// in `kind`: fresh over a copy of `model`, or from the sharded checkpoint `from` (written at any rank count). Refuses a
/// shard count the model's units cannot be split over before it builds anything.
pub(crate) fn sharded_policy_role(
    job: &JobConfig,
    model: &Llama,
    from: Option<&Path>,
    pad_id: i64,
    (device, kind): (Device, Kind),
) -> Result<ShardedPolicyRole, JobError> {
    job.check_policy_shards_fit(&model.config)?;
    let start = sharded_start(job);
    let config = policy_config(job, pad_id);
    let built = match from {
        Some(dir) => {
            ShardedPolicyRole::load(dir, device, kind, memory_options(job), config, &start)
        }
        None => {
            let m = model.deep_copy(device, kind).map_err(|e| JobError::Model {
                source_desc: job.model.source.to_string(),
                reason: e.to_string(),
            })?;
            ShardedPolicyRole::new(m, train_config(job), config, &start)
        }
    };
    built.map_err(|e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: format!("sharded policy role: {e}"),
    })
}

/// How the job's sharded policy replica starts: its ranks and deadlines.
pub(crate) fn sharded_start(job: &JobConfig) -> ShardedStart {
    let t = &job.timeouts;
    let secs = |s: f64| Duration::from_secs_f64(s.max(0.001));
    ShardedStart {
        shards: job.job.policy_shards,
        collective: secs(t.collective_s),
        // A request runs on every rank at once: an update, a sync's gather, a save.
        deadline: secs(t.train_s.max(t.sync_s)),
    }
}

/// The policy's loss, micro-batching and sync settings from `job`.
pub(crate) fn policy_config(job: &JobConfig, pad_id: i64) -> PolicyConfig {
    let a = &job.algorithm;
    let o = &job.optim;
    PolicyConfig {
        loss: PolicyLossConfig {
            kind: a.name.policy_loss(),
            clip_low: a.clip().0,
            clip_high: a.clip().1,
            agg: a.loss_agg(job.rollout.max_new_tokens),
            ..Default::default()
        },
        kl_loss: kl_term(job)
            .filter(|_| a.kl_mode == KlMode::Loss)
            .map(|(estimator, coef)| KlLossConfig { estimator, coef }),
        entropy_coef: a.entropy_coef,
        micro_batch_size: o.micro_batch,
        max_tokens_per_micro_batch: o.max_tokens_per_micro_batch,
        mini_batches: o.mini_batches,
        temperature: job.rollout.temperature,
        pad_id,
        on_policy: a.old_logprobs == OldLogprobs::OnPolicy,
        rollout_as_old: a.old_logprobs == OldLogprobs::Rollout,
        tokenizer_dir: job.model.source.dir().map(PathBuf::from),
        skip_zero_advantage: o.skip_zero_advantage,
        off_policy: OffPolicyConfig {
            correction: a.off_policy(job.rollout.staleness),
            cap: a.behaviour_cap,
        },
        lora_sync: match job.model.lora.as_ref().map(|l| l.sync) {
            Some(LoraSyncMode::Merged) => LoraSync::Merged,
            Some(LoraSyncMode::Adapters) | None => LoraSync::Adapters,
        },
        ..Default::default()
    }
}

/// The job's critic (PPO) over `trainer`; `None` gives a fresh one over `model`.
pub fn critic_role(
    job: &JobConfig,
    model: Llama,
    trainer: Option<Trainer>,
    pad_id: i64,
) -> Result<CriticRole, JobError> {
    let trainer = trainer.unwrap_or_else(|| Trainer::new(model, critic_train_config(job)));
    CriticRole::new(trainer, critic_config(job, pad_id)).map_err(|e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: format!("critic role: {e}"),
    })
}

/// The job's critic sharded over `job.critic_shards` ranks: fresh over `model`, or
/// from the sharded critic checkpoint `checkpoint` (written at any rank count).
pub(crate) fn sharded_critic_role(
    job: &JobConfig,
    mut model: Llama,
    checkpoint: Option<&Path>,
    pad_id: i64,
) -> Result<ShardedCriticRole, JobError> {
    let n = job.job.critic_shards;
    yatt_engine::check_shards(&model.config, n).map_err(|e| {
        invalid(
            "job.critic_shards",
            "a shard count every unit of the model (a decoder layer, the embeddings, the head) can be split over",
            &n.to_string(),
            &e.to_string(),
        )
    })?;
    let start = ShardedStart {
        shards: n,
        ..sharded_start(job)
    };
    let config = critic_config(job, pad_id);
    let role = match checkpoint {
        Some(dir) => ShardedCriticRole::load(dir, model.device(), model.kind(), config, &start),
        None => {
            model.memory = memory_options(job);
            ShardedCriticRole::new(model, critic_train_config(job), config, &start)
        }
    };
    role.map_err(|e| JobError::Model {
        source_desc: job.model.source.to_string(),
        reason: format!("sharded critic: {e}"),
    })
}

/// The refusal to resume a whole (unsharded) `role`'s checkpoint in `dir` with `key`
/// (its shard count) at `shards`.
pub(crate) fn whole_checkpoint_refused(
    dir: &Path,
    role: &str,
    key: &str,
    shards: usize,
) -> JobError {
    JobError::Resume {
        dir: dir.to_path_buf(),
        reason: format!(
            "the checkpoint holds a whole (unsharded) {role}, and {key} = {shards}: resume it with {key} = 1"
        ),
    }
}

/// The critic's optimizer settings: the policy's with `optim.critic_lr`.
pub(crate) fn critic_train_config(job: &JobConfig) -> TrainConfig {
    TrainConfig {
        lr: job.optim.critic_lr,
        ..train_config(job)
    }
}

/// The critic's value loss and micro-batching.
pub(crate) fn critic_config(job: &JobConfig, pad_id: i64) -> CriticConfig {
    let a = &job.algorithm;
    let o = &job.optim;
    CriticConfig {
        loss: ValueLossConfig {
            clip: (a.value_clip > 0.0).then_some(a.value_clip),
            agg: a.loss_agg(job.rollout.max_new_tokens),
        },
        micro_batch_size: o.micro_batch,
        mini_batches: o.mini_batches,
        pad_id,
    }
}

/// The KL term's estimator and coefficient, when the job has one.
pub(crate) fn kl_term(job: &JobConfig) -> Option<(KlEstimator, f64)> {
    let a = &job.algorithm;
    (a.kl_coef > 0.0).then_some((a.kl_estimator, a.kl_coef))
}

/// Role name of a policy replica's ring inbox (its end of the gradient all-reduce).
pub const POLICY_RING: &str = "policy-ring";

/// A policy replica's ring member: its inbox on `node`, as `node/policy-ring/replica`.
/// The ring members of the ranks of a sharded policy's replicas (HSDP), one ring per
/// rank index across the replicas: `node/policy-hsdp/INDEX`.
pub const HSDP_RING: &str = "policy-hsdp";

/// Replica `replica`'s members, one per rank of its `shards`, of the rings with the
/// other replicas' ranks (each named by its global rank `replica·shards + rank`, so
/// every replica's fit on one node).
pub(crate) fn replica_rings(
    node: &Node,
    replica: usize,
    shards: usize,
) -> Result<Vec<RingMember>, JobError> {
    (0..shards)
        .map(|r| hsdp_ring(node, (replica * shards + r) as u32))
        .collect()
}

/// One rank's member of the ring with the other replicas' ranks, named by `index`
/// (unique on its node).
pub(crate) fn hsdp_ring(node: &Node, index: u32) -> Result<RingMember, JobError> {
    RingMember::start(node, HSDP_RING, index).map_err(|e| {
        JobError::Controller(Box::new(ControllerError::Spawn {
            role: format!("{HSDP_RING} {index}"),
            reason: e.to_string(),
        }))
    })
}

pub(crate) fn policy_ring(node: &Node, replica: u32) -> Result<RingMember, JobError> {
    RingMember::start(node, POLICY_RING, replica).map_err(|e| {
        JobError::Controller(Box::new(ControllerError::Spawn {
            role: format!("{POLICY_RING} {replica}"),
            reason: e.to_string(),
        }))
    })
}
