//! Every check of a job config that its types cannot make, in one place.

use std::path::Path;

use yatt_roles::{Algorithm, JudgeTemplate};

use crate::config::checks::non_negative;
use crate::config::checks::{invalid, only_with_kind, positive};
use crate::config::modes::{
    CallPrefix, Driver, KlMode, OldLogprobs, PlacementMode, RewardKind, Task, TimeShare,
    VerdictMode,
};
use crate::config::placement::{NodeNames, PlacementSection};
use crate::config::sections::JobConfig;
use crate::error::JobError;

impl JobConfig {
    /// Checks every value the types cannot.
    pub fn validate(&self) -> Result<(), JobError> {
        let j = &self.job;
        if j.placement != "colocate" {
            return Err(JobError::NotImplemented {
                key: "job.placement".into(),
                found: j.placement.clone(),
                fix: "set job.placement = \"colocate\"; to put roles on other nodes, set [placement] mode = \"disaggregated\" with a node per role and run `yatt train CONFIG --cluster SEED_ADDR`".into()});
        }
        // Before the placement's own checks: a pool refused here needs none of them.
        self.validate_policy_pool()?;
        self.placement.validate(
            j.policy_replicas * j.policy_shards,
            self.algorithm.name.needs_critic(),
        )?;
        self.validate_time_share()?;
        self.roles.validate()?;
        if self.placement.live {
            self.validate_live()?;
        }
        if self.rollout.stream && self.placement.mode == PlacementMode::Disaggregated {
            return Err(invalid(
                "rollout.stream",
                "false with placement.mode = \"disaggregated\"",
                "true",
                "streaming works with in-process rollouts only (samples go through a channel, not QUIC): set rollout.stream = false, or placement.mode = \"colocate\"",
            ));
        }
        self.validate_staleness()?;
        self.validate_env()?;
        positive("job.steps", j.steps as f64, "the number of training steps")?;
        positive(
            "job.controllers",
            j.controllers as f64,
            "controllers = 1 for one head",
        )?;
        if j.policy_replicas != 1
            && (j.policy_replicas != j.controllers || j.driver != Driver::Parallel)
        {
            return Err(invalid(
                "job.policy_replicas",
                &format!(
                    "1, or job.controllers = {} with driver = \"parallel\"",
                    j.controllers
                ),
                &j.policy_replicas.to_string(),
                "use one policy replica per controller, or a shared one",
            ));
        }
        self.validate_shards()?;
        self.validate_reference_shards()?;
        self.validate_critic_shards()?;
        positive(
            "model.threads",
            self.model.threads as f64,
            "threads = 1 or more",
        )?;
        for (key, v) in [
            (
                "model.logprob_chunk_tokens",
                self.model.logprob_chunk_tokens,
            ),
            (
                "model.recompute_chunk_tokens",
                self.model.recompute_chunk_tokens,
            ),
        ] {
            positive(
                key,
                v as f64,
                "tokens per chunk, 1 or more (1024 by default)",
            )?;
        }
        let t = &self.timeouts;
        for (key, v) in [
            ("timeouts.generate_s", t.generate_s),
            ("timeouts.score_s", t.score_s),
            ("timeouts.train_s", t.train_s),
            ("timeouts.sync_s", t.sync_s),
            ("timeouts.collective_s", t.collective_s),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(invalid(
                    key,
                    "a positive number of seconds",
                    &v.to_string(),
                    "e.g. 600; a call past it fails the step instead of hanging",
                ));
            }
        }
        if t.collective_s > t.sync_s {
            return Err(invalid(
                "timeouts.collective_s",
                "at most timeouts.sync_s (a weight sync's NCCL operations run inside its sync call)",
                &t.collective_s.to_string(),
                &format!("e.g. collective_s = {}", t.sync_s.min(120.0)),
            ));
        }
        positive(
            "model.max_seq_len",
            self.model.max_seq_len as f64,
            "e.g. max_seq_len = 256",
        )?;
        if let Some(lora) = &self.model.lora {
            lora.engine_config().check().map_err(|why| {
                invalid(
                    "model.lora",
                    "rank >= 1, alpha > 0, dropout in [0, 1) and at least one target module",
                    &why,
                    "e.g. [model.lora] rank = 16, alpha = 32, dropout = 0.0, target_modules = [\"q_proj\", \"v_proj\"]",
                )
            })?;
        }
        if let Some(dir) = self.model.source.dir().filter(|d| !d.is_dir()) {
            return Err(invalid(
                "model.source",
                "\"tiny\" or an existing HF model directory",
                &dir.display().to_string(),
                "point it at a directory with config.json, *.safetensors and tokenizer.json",
            ));
        }
        self.validate_data()?;
        if self.data.dataset().is_none() {
            positive(
                "data.num_prompts",
                self.data.num_prompts as f64,
                "e.g. num_prompts = 256",
            )?;
            if self.data.task != Task::Letters {
                positive("data.length", self.data.length as f64, "e.g. length = 2")?;
            }
        }
        positive(
            "data.prompts_per_step",
            self.data.prompts_per_step as f64,
            "e.g. prompts_per_step = 8",
        )?;
        positive(
            "data.samples_per_prompt",
            self.data.samples_per_prompt as f64,
            "e.g. samples_per_prompt = 8",
        )?;
        positive(
            "rollout.max_new_tokens",
            self.rollout.max_new_tokens as f64,
            "e.g. max_new_tokens = 64",
        )?;
        // Prompt lengths in tokens need the tokenizer, so the exact bound (longest prompt +
        // max_new_tokens) is the generator's; here: room for a one-token prompt at least.
        if self.model.max_seq_len <= self.rollout.max_new_tokens {
            return Err(invalid(
                "model.max_seq_len",
                &format!(
                    "more than rollout.max_new_tokens = {} (the longest prompt + max_new_tokens must fit)",
                    self.rollout.max_new_tokens
                ),
                &self.model.max_seq_len.to_string(),
                &format!(
                    "raise model.max_seq_len to the longest prompt in tokens + {}{}, or lower rollout.max_new_tokens",
                    self.rollout.max_new_tokens,
                    self.rollout
                        .max_new_tokens
                        .checked_add(64)
                        .and_then(usize::checked_next_power_of_two)
                        .map_or(String::new(), |e| format!(" (e.g. {e})"))
                ),
            ));
        }
        positive(
            "rollout.temperature",
            self.rollout.temperature,
            "e.g. temperature = 1.0",
        )?;
        if !(self.rollout.top_p > 0.0 && self.rollout.top_p <= 1.0) {
            return Err(invalid(
                "rollout.top_p",
                "a number in (0, 1]",
                &self.rollout.top_p.to_string(),
                "top_p = 1.0 turns it off",
            ));
        }
        let a = &self.algorithm;
        if a.name.needs_critic() && self.job.controllers > 1 && self.job.driver == Driver::Parallel
        {
            return Err(invalid(
                "job.controllers",
                "1 with algorithm.name = \"ppo\"",
                &self.job.controllers.to_string(),
                "the critic trains with one controller for now: set controllers = 1, or use grpo",
            ));
        }
        for (key, v) in [("algorithm.gamma", a.gamma), ("algorithm.lam", a.lam)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(invalid(
                    key,
                    "a number in [0, 1]",
                    &v.to_string(),
                    "e.g. 1.0 for gamma, 0.95 for lam",
                ));
            }
        }
        non_negative("algorithm.value_clip", a.value_clip)?;
        positive(
            "algorithm.max_sampling_rounds",
            a.max_sampling_rounds as f64,
            "e.g. max_sampling_rounds = 4",
        )?;
        if a.overlong_buffer > self.rollout.max_new_tokens {
            return Err(invalid(
                "algorithm.overlong_buffer",
                &format!(
                    "at most rollout.max_new_tokens = {}",
                    self.rollout.max_new_tokens
                ),
                &a.overlong_buffer.to_string(),
                "use a buffer of a quarter of max_new_tokens, or 0 to turn the penalty off",
            ));
        }
        non_negative("algorithm.overlong_coef", a.overlong_coef)?;
        if let Some(c) = &a.step_credit {
            positive(
                "algorithm.step_credit.penalty",
                c.penalty,
                "e.g. penalty = 0.5 (below a typical outcome advantage of 1)",
            )?;
            if !(0.0..=1.0).contains(&c.threshold) {
                return Err(invalid(
                    "algorithm.step_credit.threshold",
                    "a number in [0, 1] (step verdicts are normalised)",
                    &c.threshold.to_string(),
                    "e.g. threshold = 0.5",
                ));
            }
            if c.delimiter.is_empty() {
                return Err(invalid(
                    "algorithm.step_credit.delimiter",
                    "the text that ends a step",
                    "\"\"",
                    "e.g. delimiter = \"\\n\" (one step per line)",
                ));
            }
        }
        if a.old_logprobs == OldLogprobs::OnPolicy && self.optim.mini_batches != 1 {
            return Err(invalid(
                "algorithm.old_logprobs",
                "\"recompute\" when optim.mini_batches > 1",
                "\"on-policy\"",
                "set optim.mini_batches = 1, or old_logprobs = \"recompute\"",
            ));
        }
        let (clip_low, clip_high) = a.clip();
        let low_max = if a.name == Algorithm::Cispo {
            1.0
        } else {
            0.999_999
        };
        if !(0.0..=low_max).contains(&clip_low) {
            return Err(invalid(
                "algorithm.clip_low",
                if a.name == Algorithm::Cispo {
                    "a number in [0, 1] with algorithm.name = \"cispo\""
                } else {
                    "a number in [0, 1)"
                },
                &clip_low.to_string(),
                "e.g. 0.2 (GSPO: 3e-4; CISPO: 1 = no lower bound on the weight), or leave it out for the algorithm's default",
            ));
        }
        non_negative("algorithm.clip_high", clip_high)?;
        if a.name == Algorithm::Gspo && clip_low.max(clip_high) > 0.05 {
            let (key, v) = if clip_high > 0.05 {
                ("algorithm.clip_high", clip_high)
            } else {
                ("algorithm.clip_low", clip_low)
            };
            return Err(invalid(
                key,
                "at most 0.05 with algorithm.name = \"gspo\" (the paper: 3e-4 / 4e-4)",
                &v.to_string(),
                "leave clip_low and clip_high out for the paper's 3e-4 / 4e-4: a sequence \
                 ratio is a mean over the response's tokens and moves far less than a token's, \
                 so PPO's 0.2 never clips",
            ));
        }
        non_negative("algorithm.kl_coef", a.kl_coef)?;
        let o = &self.optim;
        positive(
            "optim.lr",
            o.lr,
            "e.g. lr = 1e-6 for a real model, 3e-3 for the tiny one",
        )?;
        non_negative("optim.weight_decay", o.weight_decay)?;
        non_negative("optim.max_grad_norm", o.max_grad_norm)?;
        positive("optim.critic_lr", o.critic_lr, "e.g. critic_lr = 1e-5")?;
        positive(
            "optim.micro_batch",
            o.micro_batch as f64,
            "e.g. micro_batch = 8",
        )?;
        positive(
            "optim.mini_batches",
            o.mini_batches as f64,
            "mini_batches = 1 for one optimizer step per step",
        )?;
        let Some(batch) = self
            .data
            .prompts_per_step
            .checked_mul(self.data.samples_per_prompt as usize)
        else {
            return Err(invalid(
                "data.prompts_per_step",
                "a batch (prompts_per_step × samples_per_prompt) that fits in 64 bits",
                &format!(
                    "{} × {}",
                    self.data.prompts_per_step, self.data.samples_per_prompt
                ),
                "e.g. prompts_per_step = 8, samples_per_prompt = 8",
            ));
        };
        if batch % o.mini_batches != 0 {
            return Err(invalid(
                "optim.mini_batches",
                &format!("a divisor of prompts_per_step × samples_per_prompt = {batch}"),
                &o.mini_batches.to_string(),
                "pick a divisor of the batch",
            ));
        }
        let kinds = self.reward_kinds();
        self.validate_reward_models(&kinds)?;
        self.validate_reward_code(&kinds)?;
        if !self.reward.weights.is_empty() && self.reward.weights.len() != kinds.len() {
            return Err(invalid(
                "reward.weights",
                &format!("{} weight(s), one per reward.kind", kinds.len()),
                &format!("{} weight(s)", self.reward.weights.len()),
                "give one weight per kind, or leave weights out for all 1",
            ));
        }
        if kinds.contains(&RewardKind::Letters) && self.reward.letters.is_empty() {
            return Err(invalid(
                "reward.letters",
                "a non-empty set of characters",
                "\"\"",
                "e.g. letters = \"abcdefghij\"",
            ));
        }
        Ok(())
    }

    /// Time sharing (`placement.time_share = "offload"`): the roles must share one
    /// device, and generation must not overlap training.
    fn validate_time_share(&self) -> Result<(), JobError> {
        let p = &self.placement;
        non_negative("placement.device_memory_gb", p.device_memory_gb)?;
        if p.time_share == TimeShare::Off {
            return Ok(());
        }
        let found = "\"offload\"";
        if p.mode != PlacementMode::Colocate {
            return Err(invalid(
                "placement.time_share",
                "\"off\" with placement.mode = \"disaggregated\" (each role on its own node: nothing to share)",
                found,
                "set placement.time_share = \"off\", or placement.mode = \"colocate\" to put every role on one device",
            ));
        }
        if p.live {
            return Err(invalid(
                "placement.time_share",
                "\"off\" with placement.live = true (the rollout and the policy sit on device groups of their own)",
                found,
                "set placement.time_share = \"off\", or placement.live = false",
            ));
        }
        if self.rollout.staleness > 0 {
            return Err(invalid(
                "placement.time_share",
                "\"off\" with rollout.staleness >= 1 (generation overlaps training, so both need the device at once)",
                &format!("{found} with rollout.staleness = {}", self.rollout.staleness),
                "set rollout.staleness = 0 to take turns with the device, or placement.time_share = \"off\" to overlap generation and training",
            ));
        }
        Ok(())
    }

    /// The live placement's own checks (`placement.live = true`).
    /// Asynchronous RL: what a staleness bound needs.
    fn validate_staleness(&self) -> Result<(), JobError> {
        let k = self.rollout.staleness;
        if k > 8 {
            return Err(invalid(
                "rollout.staleness",
                "0 to 8 (batches generated ahead are held in memory and in checkpoints)",
                &k.to_string(),
                "set rollout.staleness = 1 or 2",
            ));
        }
        if self.algorithm.behaviour_cap.partial_cmp(&1.0) != Some(std::cmp::Ordering::Greater)
            || !self.algorithm.behaviour_cap.is_finite()
        {
            return Err(invalid(
                "algorithm.behaviour_cap",
                "a finite number > 1",
                &self.algorithm.behaviour_cap.to_string(),
                "set algorithm.behaviour_cap = 2.0",
            ));
        }
        if let Some(p) = &self.rollout.partial_rollout {
            if k == 0 {
                return Err(invalid(
                    "rollout.partial_rollout",
                    "rollout.staleness >= 1",
                    "rollout.staleness = 0",
                    "partial rollouts let weights reach a batch while it generates, which needs a staleness bound: set rollout.staleness = 1, or remove rollout.partial_rollout",
                ));
            }
            if p.resume == yatt_placement::Resume::Kv {
                return Err(JobError::NotImplemented {
                    key: "rollout.partial_rollout.resume".into(),
                    found: "\"kv\"".into(),
                    fix: "the live trainer prefills an interrupted response again on the new weights: set resume = \"reprefill\" (\"kv\" is modelled by the simulator only)".into(),
                });
            }
            positive(
                "rollout.partial_rollout.chunk_tokens",
                p.chunk_tokens as f64,
                "e.g. chunk_tokens = 8: tokens a response decodes before newer weights may take over",
            )?;
        }
        if k == 0 {
            return Ok(());
        }
        if self.algorithm.old_logprobs == OldLogprobs::OnPolicy {
            return Err(invalid(
                "algorithm.old_logprobs",
                "\"recompute\" or \"rollout\" with rollout.staleness >= 1",
                "\"on-policy\"",
                "samples of older weights are not on-policy: set algorithm.old_logprobs = \"recompute\" (the old log-probs of the weights being trained, with the off-policy correction) or \"rollout\" (the rollout's own, no forward pass), or rollout.staleness = 0",
            ));
        }
        Ok(())
    }

    /// Multi-turn episodes: limits in range, and no feature that cannot carry them.
    fn validate_env(&self) -> Result<(), JobError> {
        let placed = &self.placement.env;
        let Some(e) = &self.rollout.env else {
            if !placed.is_empty() {
                return Err(invalid(
                    "placement.env",
                    "empty without rollout.env",
                    &format!("{placed:?}"),
                    "there is no environment to place: add rollout.env = { kind = ... } or remove placement.env",
                ));
            }
            return Ok(());
        };
        if !placed.is_empty() && self.placement.mode != PlacementMode::Disaggregated {
            return Err(invalid(
                "placement.env",
                "a node with placement.mode = \"disaggregated\"",
                &format!("{placed:?} with mode = \"{}\"", self.placement.mode),
                "set placement.mode = \"disaggregated\" (a cluster job), or remove placement.env to run the environments in the rollout's process",
            ));
        }
        if !(1..=64).contains(&e.pool) {
            return Err(invalid(
                "rollout.env.pool",
                "1 to 64",
                &e.pool.to_string(),
                "set rollout.env.pool = 2 (environment actors per rollout)",
            ));
        }
        if !(1..=64).contains(&e.max_turns) {
            return Err(invalid(
                "rollout.env.max_turns",
                "1 to 64",
                &e.max_turns.to_string(),
                "set rollout.env.max_turns = 3 (model turns per episode)",
            ));
        }
        positive(
            "rollout.env.max_env_tokens",
            e.max_env_tokens as f64,
            "e.g. max_env_tokens = 64: tokens of one observation's content",
        )?;
        positive(
            "rollout.env.timeout_s",
            e.timeout_s,
            "e.g. timeout_s = 10: the deadline of every environment call",
        )?;
        if e.kind == yatt_roles::EnvKind::Python {
            positive(
                "rollout.env.python_timeout_s",
                e.python_timeout_s,
                "e.g. python_timeout_s = 5",
            )?;
            positive(
                "rollout.env.python_memory_mb",
                e.python_memory_mb as f64,
                "e.g. python_memory_mb = 512",
            )?;
            positive(
                "rollout.env.python_output_bytes",
                e.python_output_bytes as f64,
                "e.g. python_output_bytes = 4096",
            )?;
            if e.python_timeout_s > e.timeout_s {
                return Err(invalid(
                    "rollout.env.python_timeout_s",
                    "at most rollout.env.timeout_s",
                    &format!("{} > timeout_s = {}", e.python_timeout_s, e.timeout_s),
                    "the tool's own limit must end a call before the environment's deadline does: lower python_timeout_s or raise timeout_s",
                ));
            }
        }
        if e.call_prefix != CallPrefix::Off && e.kind == yatt_roles::EnvKind::GuessNumber {
            return Err(invalid(
                "rollout.env.call_prefix",
                "\"off\" with kind = \"guess-number\"",
                e.call_prefix.name(),
                "the game has no tools to call: remove call_prefix, or use kind = \"calculator\" or \"python\"",
            ));
        }
        if e.call_prefix == CallPrefix::Guide && !(e.guide_fraction > 0.0 && e.guide_fraction < 1.0)
        {
            return Err(invalid(
                "rollout.env.guide_fraction",
                "a share in (0, 1) with call_prefix = \"guide\"",
                &e.guide_fraction.to_string(),
                "guidance compares guided episodes with the model's own in each group: use e.g. 0.5 (0 is call_prefix = \"off\", 1 is \"always\")",
            ));
        }
        if self.rollout.partial_rollout.is_some() {
            return Err(invalid(
                "rollout.partial_rollout",
                "unset with rollout.env",
                "both set",
                "a partial rollout cannot continue a multi-turn episode: remove rollout.partial_rollout or rollout.env",
            ));
        }
        Ok(())
    }

    fn validate_live(&self) -> Result<(), JobError> {
        let p = &self.placement;
        let heads = self.job.controllers;
        if heads < 2 || self.job.driver != Driver::Parallel {
            return Err(invalid(
                "job.controllers",
                "at least 2 parallel heads under placement.live",
                &heads.to_string(),
                "set job.controllers = 2 and job.driver = \"parallel\"",
            ));
        }
        if p.rollout_groups != 1 && p.rollout_groups != heads {
            return Err(invalid(
                "placement.rollout_groups",
                &format!("1 or job.controllers ({heads})"),
                &p.rollout_groups.to_string(),
                "set rollout_groups = 1",
            ));
        }
        if self.model.threads != 1 {
            return Err(invalid(
                "model.threads",
                "1 under placement.live (a group is one libtorch thread)",
                &self.model.threads.to_string(),
                "set model.threads = 1; add groups for more threads",
            ));
        }
        if self.algorithm.name.needs_critic() {
            return Err(JobError::NotImplemented {
                key: "algorithm.name".into(),
                found: "ppo with placement.live".into(),
                fix:
                    "live placement moves rollout and policy groups; use grpo, rloo or reinforce++"
                        .into(),
            });
        }
        let with_reference = self.algorithm.kl_mode != KlMode::None;
        let cluster = p.mode == PlacementMode::Disaggregated;
        if cluster && with_reference && p.reference.is_empty() {
            return Err(invalid(
                "placement.reference",
                &format!(
                    "the node of the reference, as algorithm.kl_mode = \"{}\"",
                    self.algorithm.kl_mode
                ),
                "nothing",
                "add reference = \"NODE\" under [placement], or set algorithm.kl_mode = \"none\"",
            ));
        }
        if p.mode == PlacementMode::Colocate && p.groups != heads + 1 {
            return Err(invalid(
                "placement.groups",
                &format!("job.controllers + 1 = {}", heads + 1),
                &p.groups.to_string(),
                "the rollout and the policy each take 1 or job.controllers groups",
            ));
        }
        Ok(())
    }

    /// The `model` and `judge` reward keys.
    pub(crate) fn validate_reward_models(&self, kinds: &[RewardKind]) -> Result<(), JobError> {
        let r = &self.reward;
        for (kind, key, dir) in [
            (RewardKind::Model, "reward.model", &r.model),
            (RewardKind::Judge, "reward.judge_model", &r.judge_model),
        ] {
            let used = kinds.contains(&kind);
            only_with_kind(used, kind, key, dir)?;
            if used && !Path::new(dir).join("config.json").is_file() {
                let how = if kind == RewardKind::Model {
                    "train one with `yatt reward-model --out DIR` (or yatt_roles::train_reward_model and save_pretrained) and set reward.model = \"DIR\""
                } else {
                    "set reward.judge_model to an HF model directory (config.json, model.safetensors, tokenizer.json)"
                };
                return Err(invalid(
                    key,
                    "an existing HF model directory with config.json",
                    &format!("{dir:?}"),
                    how,
                ));
            }
        }
        if kinds.contains(&RewardKind::Judge) {
            positive(
                "reward.judge_max_tokens",
                r.judge_max_tokens as f64,
                "e.g. judge_max_tokens = 128",
            )?;
            positive(
                "reward.judge_max_seq_len",
                r.judge_max_seq_len as f64,
                "e.g. judge_max_seq_len = 1024 (judge prompt + verdict)",
            )?;
            positive(
                "reward.judge_critiques",
                r.judge_critiques as f64,
                "e.g. judge_critiques = 1 (one greedy verdict) or 4 (voted)",
            )?;
            if r.judge_critiques > 1 && !(r.judge_temperature > 0.0) {
                return Err(invalid(
                    "reward.judge_temperature",
                    "> 0 with judge_critiques > 1 (greedy critiques would all agree)",
                    &r.judge_temperature.to_string(),
                    "e.g. judge_temperature = 1.0",
                ));
            }
            if r.judge_critiques > 1 && r.judge_mode == VerdictMode::Logits {
                return Err(invalid(
                    "reward.judge_critiques",
                    "1 with judge_mode = \"logits\" (no critique is written to vote on)",
                    &r.judge_critiques.to_string(),
                    "set judge_mode = \"generate\", or judge_critiques = 1",
                ));
            }
            if !(0.0..=1.0).contains(&r.judge_fallback_score) {
                return Err(invalid(
                    "reward.judge_fallback_score",
                    "a number in [0, 1] (scores are normalised)",
                    &r.judge_fallback_score.to_string(),
                    "e.g. judge_fallback_score = 0.0",
                ));
            }
            if !r.judge_template.is_empty() {
                JudgeTemplate::new(r.judge_template.clone()).map_err(|e| {
                    invalid(
                        "reward.judge_template",
                        "a template with a {response} placeholder",
                        &format!("{:?}", yatt_roles::excerpt(&r.judge_template, 60)),
                        &e.to_string(),
                    )
                })?;
            }
        }
        Ok(())
    }

    /// `[data]`'s dataset keys: one of `path` / `jsonl`, a format only with a path,
    /// non-empty column names.
    fn validate_data(&self) -> Result<(), JobError> {
        let d = &self.data;
        if !d.path.is_empty() && !d.jsonl.is_empty() {
            return Err(invalid(
                "data.jsonl",
                "either data.path or data.jsonl",
                &format!("both (path = {:?}, jsonl = {:?})", d.path, d.jsonl),
                "keep data.path (with data.format = \"jsonl\" if needed) and remove data.jsonl",
            ));
        }
        if let (Some(f), None) = (d.format, d.dataset()) {
            return Err(invalid(
                "data.format",
                "a format only with data.path",
                &format!("\"{f}\" with no data.path"),
                "set data.path to the dataset file or directory, or remove data.format",
            ));
        }
        for (key, v) in [
            ("data.prompt_key", &d.prompt_key),
            ("data.ground_truth_key", &d.ground_truth_key),
            ("data.data_source_key", &d.data_source_key),
            ("data.extra_info_key", &d.extra_info_key),
        ] {
            if v.trim().is_empty() {
                return Err(invalid(
                    key,
                    "a column name (a dotted path for a struct field)",
                    "an empty string",
                    &format!("remove {key} for the default, or name the column"),
                ));
            }
        }
        Ok(())
    }

    /// The reward kinds, with the task's default when none is given.
    pub fn reward_kinds(&self) -> Vec<RewardKind> {
        if !self.reward.kind.0.is_empty() {
            return self.reward.kind.0.clone();
        }
        let default = match (self.data.dataset().is_none(), self.data.task) {
            (false, _) | (true, Task::Addition | Task::Multiplication) => RewardKind::Numeric,
            (true, Task::Letters) => RewardKind::Letters,
            _ => RewardKind::Exact,
        };
        vec![default]
    }
}

impl PlacementSection {
    /// Checks the section on its own, for a job with `policy_replicas` policy processes
    /// (replicas, or the ranks of a sharded replica) and, with `critic` (PPO), a critic (which nodes exist is checked against the
    /// cluster by `build_cluster`).
    pub fn validate(&self, policy_replicas: usize, critic: bool) -> Result<(), JobError> {
        positive(
            "placement.spawn_timeout_s",
            self.spawn_timeout_s as f64,
            "e.g. spawn_timeout_s = 300",
        )?;
        let live_cluster = self.live && self.mode == PlacementMode::Disaggregated;
        if !self.nodes.is_empty() && !live_cluster {
            return Err(invalid(
                "placement.nodes",
                "nothing unless live = true and mode = \"disaggregated\"",
                &format!("{:?}", self.nodes),
                "remove placement.nodes, or set live = true and mode = \"disaggregated\" to run the live placement over those nodes' devices",
            ));
        }
        if self.mode == PlacementMode::Colocate {
            return Ok(());
        }
        if self.live {
            return self.validate_live_cluster();
        }
        if let NodeNames::Each(ns) = &self.policy {
            if ns.len() != policy_replicas {
                // At most 4 names: policy_replicas is not yet checked against anything.
                let mut example: Vec<String> = (0..policy_replicas.clamp(1, 4))
                    .map(|i| format!("\"node-{i}\""))
                    .collect();
                if policy_replicas > 4 {
                    example.push("...".into());
                }
                return Err(invalid(
                    "placement.policy",
                    &format!(
                        "one node per policy replica, or per rank of a sharded one: {policy_replicas} name(s), as job.policy_replicas × job.policy_shards = {policy_replicas}"
                    ),
                    &format!("{} name(s): {}", ns.len(), self.policy),
                    &format!(
                        "list one node per replica, e.g. policy = [{}] (a node may be listed twice), or give one name to put every replica on that node",
                        example.join(", ")
                    ),
                ));
            }
        }
        for (key, node) in self.named_nodes(critic) {
            if node.is_empty() {
                let role = key.trim_start_matches("placement.");
                let fix = if role.contains('[') {
                    "put a node name at that position of policy = [...] (a `yatt-node run --name NODE`)".to_string()
                } else {
                    format!(
                        "add {role} = \"NODE\" under [placement] (a `yatt-node run --name NODE`)"
                    )
                };
                return Err(invalid(
                    &key,
                    "the name of the cluster node that runs this role",
                    "nothing",
                    &fix,
                ));
            }
        }
        Ok(())
    }

    /// The live placement on a cluster: the nodes offering groups, once each, and the
    /// reward's node (the reference's is checked against `algorithm.kl_mode` when the
    /// job is built).
    pub(crate) fn validate_live_cluster(&self) -> Result<(), JobError> {
        if self.nodes.is_empty() {
            return Err(invalid(
                "placement.nodes",
                "the nodes whose devices the rollout and the policy share, with placement.live = true on a cluster",
                "nothing",
                "add nodes = [\"gpu-0\", \"gpu-1\"] under [placement] (`yatt-node run --name NODE`; each offers its GPUs, or --virtual-devices N without GPUs)",
            ));
        }
        for (i, n) in self.nodes.iter().enumerate() {
            if n.is_empty() || self.nodes[..i].contains(n) {
                return Err(invalid(
                    &format!("placement.nodes[{i}]"),
                    "a node name, each node once",
                    &format!("{n:?} in {:?}", self.nodes),
                    "list each node once; a node offers all its devices",
                ));
            }
        }
        if self.reward.is_empty() {
            return Err(invalid(
                "placement.reward",
                "the name of the cluster node that runs this role",
                "nothing",
                "add reward = \"NODE\" under [placement] (a `yatt-node run --name NODE`)",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::modes::PlacementMode;

    const DEMO: &str = include_str!("../../../config/demo-letters.toml");

    fn disaggregated() -> Vec<String> {
        vec![
            "placement.mode=\"disaggregated\"".into(),
            "placement.rollout=\"node-a\"".into(),
            "placement.policy=\"node-b\"".into(),
            "placement.reference=\"node-b\"".into(),
            "placement.reward=\"node-c\"".into(),
        ]
    }

    #[test]
    fn a_disaggregated_placement_parses_and_travels_as_toml() {
        let job = JobConfig::parse(DEMO, "d", &disaggregated()).unwrap();
        assert_eq!(job.placement.node_of("reward"), "node-c");
        // The shipped demo names its nodes and runs colocated unless told otherwise.
        let demo = JobConfig::parse(DEMO, "d", &[]).unwrap();
        assert_eq!(demo.placement.mode, PlacementMode::Colocate);
        assert_eq!(demo.placement.node_of("policy"), "node-b");
        let text = toml::to_string(&job).unwrap();
        assert_eq!(JobConfig::parse(&text, "t", &[]).unwrap(), job);
    }

    fn two_replicas(policy: &str) -> Vec<String> {
        let mut sets = disaggregated();
        sets.retain(|s| !s.starts_with("placement.policy"));
        sets.extend([
            format!("placement.policy={policy}"),
            "job.controllers=2".into(),
            "job.policy_replicas=2".into(),
        ]);
        sets
    }

    #[test]
    fn policy_replicas_are_placed_one_node_each_or_all_on_one() {
        let job = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\", \"node-d\"]")).unwrap();
        assert_eq!(job.placement.policy_nodes(2), ["node-b", "node-d"]);
        assert_eq!(job.placement.node_of("policy"), "node-b");
        assert_eq!(job.placement.policy.to_string(), "[node-b, node-d]");
        // The list travels to the nodes as TOML.
        let text = toml::to_string(&job).unwrap();
        assert_eq!(JobConfig::parse(&text, "t", &[]).unwrap(), job);
        // One name puts every replica on that node.
        let job = JobConfig::parse(DEMO, "d", &two_replicas("\"node-b\"")).unwrap();
        assert_eq!(job.placement.policy_nodes(2), ["node-b", "node-b"]);
        assert_eq!(job.placement.policy.to_string(), "node-b");
    }

    #[test]
    fn a_policy_placement_that_does_not_fit_the_replicas_says_how_to_fix_it() {
        let e = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy")
                && e.contains("job.policy_replicas × job.policy_shards = 2")
                && e.contains("1 name(s): [node-b]")
                && e.contains("policy = [\"node-0\", \"node-1\"]"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &two_replicas("[\"node-b\", \"\"]"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy[1]") && e.contains("put a node name at that position"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &two_replicas("3"))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.policy") && e.contains("a list of node names"),
            "{e}"
        );
    }

    /// Regression: max_seq_len = 1 passed validation and failed later naming the
    /// generator's internal field.
    #[test]
    fn max_seq_len_must_leave_room_for_prompt_and_response() {
        let e = JobConfig::parse(
            DEMO,
            "d",
            &[
                "model.max_seq_len=1".into(),
                "rollout.max_new_tokens=8".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.starts_with("model.max_seq_len: expected more than rollout.max_new_tokens = 8")
                && e.contains("found 1")
                && e.contains("raise model.max_seq_len"),
            "{e}"
        );
        let e = JobConfig::parse(
            DEMO,
            "d",
            &[
                "model.max_seq_len=8".into(),
                "rollout.max_new_tokens=8".into(),
            ],
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("model.max_seq_len"), "{e}");
        JobConfig::parse(
            DEMO,
            "d",
            &[
                "model.max_seq_len=9".into(),
                "rollout.max_new_tokens=8".into(),
            ],
        )
        .unwrap();
    }

    /// Regression: values near the top of the integer range aborted or panicked in
    /// validation (ASan: allocation-size-too-big; debug builds: arithmetic overflow).
    /// Found while writing the `job_toml` fuzz target (`trainer/fuzz`) and reproduced
    /// with it; its 240 s run had not reached them.
    #[test]
    fn huge_counts_are_errors_not_aborts() {
        let err = |sets: Vec<String>| JobConfig::parse(DEMO, "d", &sets).unwrap_err().to_string();
        // One policy node for 4e12 replicas: validating the placement listed the node once
        // per replica.
        let mut sets = disaggregated();
        sets.push("job.policy_replicas=4000000000000".into());
        let e = err(sets);
        assert!(
            e.starts_with("job.policy_replicas:") && e.contains("found 4000000000000"),
            "{e}"
        );
        // A list that does not fit them: the fix's example named every replica.
        let e = err(two_replicas("[\"node-b\"]")
            .into_iter()
            .map(|s| s.replace("policy_replicas=2", "policy_replicas=4000000000000"))
            .collect());
        assert!(
            e.contains("placement.policy")
                && e.contains("policy = [\"node-0\", \"node-1\", \"node-2\", \"node-3\", ...]"),
            "{e}"
        );
        // The fix's example max_seq_len overflowed (next_power_of_two).
        let e = err(vec!["rollout.max_new_tokens=9223372036854775807".into()]);
        assert!(
            e.starts_with("model.max_seq_len:")
                && e.contains("+ 9223372036854775807, or lower rollout.max_new_tokens"),
            "{e}"
        );
        // prompts_per_step × samples_per_prompt overflowed.
        let e = err(vec![
            "data.prompts_per_step=9223372036854775807".into(),
            "data.samples_per_prompt=4".into(),
        ]);
        assert!(
            e.starts_with("data.prompts_per_step:") && e.contains("9223372036854775807 × 4"),
            "{e}"
        );
    }

    #[test]
    fn placement_errors_name_the_key_and_the_fix() {
        let sets = [
            "placement.mode=\"disaggregated\"".into(),
            "placement.reward=\"\"".into(),
        ];
        let e = JobConfig::parse(DEMO, "d", &sets).unwrap_err().to_string();
        assert!(
            e.contains("placement.reward") && e.contains("add reward = \"NODE\""),
            "{e}"
        );
        // PPO on a cluster needs a node for its critic.
        let mut sets = disaggregated();
        sets.push("algorithm.name=\"ppo\"".into());
        let e = JobConfig::parse(DEMO, "d", &sets).unwrap_err().to_string();
        assert!(
            e.contains("placement.critic") && e.contains("add critic = \"NODE\""),
            "{e}"
        );
        sets.push("placement.critic=\"node-c\"".into());
        let job = JobConfig::parse(DEMO, "d", &sets).unwrap();
        assert_eq!(job.placement.node_of("critic"), "node-c");
        let e = JobConfig::parse(DEMO, "d", &["placement.mode=\"spread\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("placement.mode") && e.contains("\"colocate\", \"disaggregated\""),
            "{e}"
        );
    }
}
