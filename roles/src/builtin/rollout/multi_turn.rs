//! Multi-turn rollouts: the thin shell around [`Episode`] that generates each model turn,
//! calls the environments (side by side, each under the deadline) and inserts their
//! observations through the chat template.
//!
//! The KV cache is kept across turns: each episode's turn is kept by the generator when
//! it finishes (under the episode's index) and the next turn continues it, so only what
//! was appended since (the environment's observation, the turn prefix) is prefilled.
//! The engine's prefix sharing prefills a prompt shared by a group's samples once in
//! the first turn. `RolloutStats::prompt_tokens` counts the positions prefilled, all
//! turns; `prefill_reused_tokens` those whose KV was kept instead.

use std::time::Instant;

use yatt_engine::{Request, SamplingParams};

use super::{encode_prompt, sample_seed, GenerateRequest, RolloutRole, RolloutStats};
use crate::builtin::scoring::score_samples;
use crate::data::prompt::Prompt;
use crate::env::{call_all, EnvSettings, EnvSlot, Episode, TurnOutcome, TOOL_CALL_CLOSE};
use crate::role::RoleError;
use crate::sample::{Finish, Sample, SampleId};

/// One episode of a generation request: its sample id, prompt, encoded first turn,
/// environment and state.
struct Running {
    id: SampleId,
    prompt: usize,
    prompt_tokens: Vec<i64>,
    slot: EnvSlot,
    episode: Episode,
    finish: Finish,
    /// What the environment writes at the start of the model's next turn.
    prefix: Option<String>,
    /// Whether this episode takes that prefix (`Some`), and if so whether its tokens are
    /// trained (`Some(true)`, guidance) or masked (see [`crate::env::PrefixUse`]).
    takes_prefix: Option<bool>,
}

impl RolloutRole {
    /// The samples of `req`, each a multi-turn episode with its environment.
    pub(super) fn generate_episodes(
        &mut self,
        req: &GenerateRequest,
        env: &EnvSettings,
    ) -> Result<(Vec<Sample>, RolloutStats), RoleError> {
        if req.n == 0 {
            return Err(RoleError::BadRequest(
                "n (samples per prompt) must be >= 1".into(),
            ));
        }
        let t0 = Instant::now();
        let mut stats = RolloutStats {
            weights_version: self.version,
            ..Default::default()
        };
        let mut runs = self.start_episodes(req, env)?;
        self.generator.forget_kept();
        let stop_at_tool_call = self.codec.tokenizer().is_some();
        for turn in 0..env.limits.max_turns {
            self.push_turn_prefixes(&mut runs, req.params.temperature)?;
            let active: Vec<usize> = (0..runs.len())
                .filter(|&i| !runs[i].episode.is_done())
                .collect();
            if active.is_empty() {
                break;
            }
            // 1. The model's turn of every active episode, in one batch.
            let mut requests = Vec::with_capacity(active.len());
            let mut keys = Vec::with_capacity(active.len());
            for &i in &active {
                let r = &runs[i];
                let mut prompt = r.prompt_tokens.clone();
                prompt.extend_from_slice(r.episode.tokens());
                keys.push(env.keep_kv.then_some(i as u64));
                let mut params = SamplingParams {
                    seed: sample_seed(req.seed, &r.id) ^ u64::from(turn).rotate_left(40),
                    max_new_tokens: r.episode.turn_budget(),
                    ..req.params.clone()
                };
                if stop_at_tool_call {
                    params.stop_strings.push(TOOL_CALL_CLOSE.to_string());
                }
                requests.push(Request {
                    id: i as u64,
                    prompt,
                    params,
                });
            }
            // The last turn has no next one to continue it.
            let keep = env.keep_kv && turn + 1 < env.limits.max_turns;
            let mut completions = Vec::with_capacity(requests.len());
            let generated = self
                .generator
                .generate_continuing(&requests, &keys, keep, |c| completions.push(c))
                .map_err(|e| {
                    RoleError::Failed(format!("generation of step {} turn {turn}: {e}", req.step))
                })?;
            stats.prompt_tokens += generated.prefill_positions;
            stats.prefill_reused_tokens += generated.reused_positions;
            stats.add_engine(&generated);
            // In request order (ids are the episodes' indices, as `active` ascending).
            completions.sort_by_key(|c| c.id);
            let mut actions = Vec::with_capacity(completions.len());
            for c in completions {
                let r = &mut runs[c.id as usize];
                stats.response_tokens += c.tokens.len();
                r.episode.push_model_turn(&c.tokens, &c.logprobs);
                r.finish = Finish::from(c.finish);
                let text = self.codec.decode(r.episode.last_turn()).map_err(|e| {
                    RoleError::Failed(format!("{}: cannot decode turn {turn}: {e}", r.id))
                })?;
                actions.push((c.id as usize, text));
            }
            // 2. The environments' answers, side by side under the deadline.
            // `generate` answers in request order, which is `active`'s (ascending) order.
            let calls = runs
                .iter_mut()
                .enumerate()
                .filter(|(i, _)| active.binary_search(i).is_ok())
                .zip(actions.into_iter().map(|(_, text)| text))
                .map(|((_, r), text)| (&mut r.slot, text))
                .collect();
            let answers = call_all("step", calls, env.timeout, |e, action: String| {
                let step = e.step(&action)?;
                Ok((step, e.turn_prefix()))
            });
            // 3. Observations into the responses.
            for (&i, (answer, seconds)) in active.iter().zip(answers) {
                let r = &mut runs[i];
                let step = match answer {
                    Ok((step, prefix)) => {
                        r.prefix = prefix;
                        step
                    }
                    Err(e) => {
                        tracing::warn!(sample = %r.id, turn, "episode failed: {e}");
                        r.episode.fail(seconds, e.to_string());
                        continue;
                    }
                };
                if let TurnOutcome::Observe(obs) = r.episode.apply_env_step(step, seconds) {
                    let closed_by = match r.finish {
                        Finish::StopToken(t) => Some(t),
                        _ => None,
                    };
                    let tokens = self.observation_tokens(&obs, closed_by, env)?;
                    r.episode.push_observation(&tokens);
                }
            }
        }
        // The keys are this call's episode indices: nothing kept outlives it.
        self.generator.forget_kept();
        let samples = runs
            .into_iter()
            .map(|r| self.episode_sample(req, r))
            .collect::<Result<Vec<_>, _>>()?;
        stats.seconds = t0.elapsed().as_secs_f64();
        Ok((samples, stats))
    }

    /// Starts each active episode's turn with its environment's prefix, as the episode
    /// takes it: masked, dropped, or trained with the rollout model's log-probs of the
    /// prefix tokens under the sampling `temperature` (what the trainer recomputes).
    fn push_turn_prefixes(&self, runs: &mut [Running], temperature: f32) -> Result<(), RoleError> {
        let mut trained: Vec<(usize, Vec<i64>)> = Vec::new();
        for (i, r) in runs.iter_mut().enumerate() {
            let Some(p) = r.prefix.take() else { continue };
            let (Some(train), false) = (r.takes_prefix, r.episode.is_done()) else {
                continue;
            };
            let tokens = self.codec.encode_response(&p).map_err(|e| {
                RoleError::Failed(format!("{}: encoding the turn prefix: {e}", r.id))
            })?;
            if train {
                trained.push((i, tokens));
            } else {
                r.episode.push_turn_prefix(&tokens, None);
            }
        }
        if trained.is_empty() {
            return Ok(());
        }
        // Scored as the trainer scores responses: each opening is the response of a
        // sample whose prompt is the context so far (a group's shared context is
        // prefilled once).
        let forced: Vec<Sample> = trained
            .iter()
            .map(|(i, tokens)| {
                let r = &runs[*i];
                Sample {
                    prompt_tokens: [&r.prompt_tokens[..], r.episode.tokens()].concat(),
                    response_tokens: tokens.clone(),
                    ..Sample::new(r.id, r.id.prompt)
                }
            })
            .collect();
        let t = if temperature > 0.0 { temperature } else { 1.0 };
        let logprobs = score_samples(
            self.generator.model(),
            &forced,
            0,
            f64::from(t),
            forced.len(),
        )?;
        for ((i, tokens), lp) in trained.iter().zip(logprobs) {
            runs[*i].episode.push_turn_prefix(tokens, Some(&lp));
        }
        Ok(())
    }

    /// Every episode of `req` with its environment reset. A reset that fails is tried
    /// once more on a fresh environment; a second failure fails the request.
    fn start_episodes(
        &self,
        req: &GenerateRequest,
        env: &EnvSettings,
    ) -> Result<Vec<Running>, RoleError> {
        let make = |p: &Prompt| {
            env.factory.make(p).map(EnvSlot::new).map_err(|e| {
                RoleError::Failed(format!(
                    "prompt {:#x}: cannot make its environment: {e}",
                    p.id
                ))
            })
        };
        let mut slots = Vec::with_capacity(req.prompts.len() * req.n as usize);
        for (pi, p) in req.prompts.iter().enumerate() {
            for k in 0..req.n {
                let id = SampleId {
                    step: req.step,
                    prompt: p.id,
                    k,
                };
                slots.push((id, pi, make(p)?));
            }
        }
        let mut firsts = Vec::with_capacity(slots.len());
        let calls = slots
            .iter_mut()
            .map(|(_, pi, slot)| (slot, req.prompts[*pi].clone()))
            .collect();
        let reset = |e: &mut dyn crate::env::Env, p: Prompt| {
            let first = e.reset(&p)?;
            Ok((first, e.turn_prefix()))
        };
        for (i, (first, _)) in call_all("reset", calls, env.timeout, reset)
            .into_iter()
            .enumerate()
        {
            let first = match first {
                Ok(text) => text,
                Err(e) => {
                    let (id, pi, slot) = &mut slots[i];
                    tracing::warn!(sample = %id, "environment reset failed, retrying on a fresh one: {e}");
                    *slot = make(&req.prompts[*pi])?;
                    let p = req.prompts[*pi].clone();
                    let again = call_all("reset", vec![(slot, p)], env.timeout, reset);
                    let (r, _) = again.into_iter().next().ok_or_else(|| {
                        RoleError::Failed(format!("{id}: no answer from the reset"))
                    })?;
                    r.map_err(|e| {
                        RoleError::Failed(format!("{id}: environment reset failed twice: {e}"))
                    })?
                }
            };
            firsts.push(first);
        }
        slots
            .into_iter()
            .zip(firsts)
            .map(|((id, pi, slot), (first, prefix))| {
                let prompt = first_turn(&req.prompts[pi], first);
                let tokens = encode_prompt(self.codec.as_ref(), &prompt).map_err(|e| {
                    RoleError::BadRequest(format!("{id}: cannot encode the first turn: {e}"))
                })?;
                if tokens.is_empty() {
                    return Err(RoleError::BadRequest(format!(
                        "{id}: the first turn encodes to no tokens"
                    )));
                }
                Ok(Running {
                    id,
                    prompt: pi,
                    prompt_tokens: tokens,
                    slot,
                    episode: Episode::new(env.limits),
                    finish: Finish::Length,
                    prefix,
                    takes_prefix: env.prefix.for_sample(id.k, req.n),
                })
            })
            .collect()
    }

    /// An observation's tokens, its content cut to `max_env_tokens`.
    fn observation_tokens(
        &self,
        obs: &str,
        closed_by: Option<i64>,
        env: &EnvSettings,
    ) -> Result<Vec<i64>, RoleError> {
        let fail = |e: String| RoleError::Failed(format!("encoding an observation: {e}"));
        let content = self.codec.encode_response(obs).map_err(fail)?;
        let max = env.limits.max_env_tokens;
        let text = if content.len() > max {
            let kept = self.codec.decode(&content[..max]).map_err(fail)?;
            format!("{kept} ...[cut at {max} tokens]")
        } else {
            obs.to_string()
        };
        self.codec
            .encode_observation(&text, closed_by)
            .map_err(fail)
    }

    fn episode_sample(&self, req: &GenerateRequest, r: Running) -> Result<Sample, RoleError> {
        let prompt = &req.prompts[r.prompt];
        let (tokens, logprobs, mask, info) = r.episode.into_parts();
        let (response_text, step_ends) = self
            .text_of()
            .of(&tokens)
            .map_err(|e| RoleError::Failed(format!("{}: cannot decode the response: {e}", r.id)))?;
        Ok(Sample {
            prompt_tokens: r.prompt_tokens,
            response_tokens: tokens,
            rollout_logprobs: logprobs,
            finish: r.finish,
            prompt_text: prompt.text.clone(),
            response_text,
            step_ends,
            reference: prompt.reference.clone(),
            metadata: prompt.metadata.clone(),
            weights_version: self.version,
            loss_mask: Some(mask),
            episode: Some(info),
            ..Sample::new(r.id, prompt.id)
        })
    }
}

/// The prompt of an episode's first turn: the environment's first observation as the
/// (last) user message.
fn first_turn(p: &Prompt, first: String) -> Prompt {
    let mut out = p.clone();
    match out.messages.iter_mut().rev().find(|m| m.role == "user") {
        Some(m) => m.content = first,
        None => out.text = first,
    }
    out
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use tch::{Device, Kind, Tensor};
    use yatt_engine::{tiny_config, Generator, GeneratorConfig, Llama};

    use super::*;
    use crate::algo::{
        gae_advantage, kl_loss, policy_loss, AdvantageNorm, GaeConfig, KlEstimator, LossAgg,
        PolicyLossConfig,
    };
    use crate::builtin::rollout::{RolloutRequest, RolloutResponse, TextCodec, TINY_CODEC};
    use crate::builtin::scoring::score_samples;
    use crate::env::{builtin_env_factory, EnvKind, EpisodeLimits, PrefixUse, PythonToolConfig};
    use crate::role::Role;
    use crate::sample::response_mask;

    fn model(seed: i64) -> Llama {
        Llama::random(tiny_config(), Device::Cpu, Kind::Float, seed).unwrap()
    }

    /// A rollout of `model` whose episodes play `kind` (its tools' calls opened when
    /// `prefix` is given), with `max_turns` turns of at most 6 tokens.
    fn env_rollout(
        model: Llama,
        kind: EnvKind,
        prefix: Option<PrefixUse>,
        max_turns: u32,
        budget: usize,
    ) -> RolloutRole {
        let config = GeneratorConfig {
            max_batch: 8,
            max_seq_len: model.config.max_position_embeddings as usize,
            ..Default::default()
        };
        let factory = builtin_env_factory(kind, PythonToolConfig::default(), prefix.is_some());
        let env = EnvSettings {
            factory,
            limits: EpisodeLimits {
                max_turns,
                max_env_tokens: 40,
                max_turn_tokens: 6,
                budget,
            },
            timeout: Duration::from_secs(10),
            keep_kv: true,
            prefix: prefix.unwrap_or_default(),
        };
        RolloutRole::new(Generator::new(model, config), Arc::new(TINY_CODEC)).with_env(env)
    }

    fn guessing_rollout(model: Llama) -> RolloutRole {
        env_rollout(model, EnvKind::GuessNumber, None, 3, 120)
    }

    /// A tiny model with room for the calculator's instructions (~420 characters).
    fn long_model(seed: i64) -> Llama {
        let mut config = tiny_config();
        config.max_position_embeddings = 1024;
        Llama::random(config, Device::Cpu, Kind::Float, seed).unwrap()
    }

    fn calculator_rollout(model: Llama, prefix: PrefixUse) -> RolloutRole {
        env_rollout(model, EnvKind::Calculator, Some(prefix), 2, 160)
    }

    fn episodes(r: &mut RolloutRole) -> Vec<Sample> {
        episodes_of(r, 2)
    }

    fn episodes_of(r: &mut RolloutRole, n: u32) -> Vec<Sample> {
        let prompts = (0..2)
            .map(|i| Prompt {
                id: 0x40 + i,
                text: "guess".into(),
                reference: Some("50".into()),
                metadata: serde_json::Value::Null,
                messages: Vec::new(),
            })
            .collect();
        let req = GenerateRequest {
            step: 0,
            prompts,
            n,
            params: SamplingParams {
                max_new_tokens: 120,
                ignore_eos: true,
                ..Default::default()
            },
            seed: 9,
        };
        match r.serve(RolloutRequest::Generate(req)).unwrap() {
            RolloutResponse::Generated { samples, .. } => samples,
            other => panic!("{other:?}"),
        }
    }

    /// A real (random) model plays guess-the-number for three turns: the environment's
    /// answers sit inside the response, masked 0, the model's turns masked 1, and the
    /// rollout log-probs of the model's tokens are what the trainer's scoring gives.
    #[test]
    fn episodes_interleave_turns_and_observations_under_a_mask() {
        let (m, scorer) = (model(21), model(21));
        let mut r = guessing_rollout(m);
        let samples = episodes(&mut r);
        assert_eq!(samples.len(), 4);
        for s in &samples {
            let info = s.episode.as_ref().unwrap();
            assert_eq!(info.turns, 3, "{}", s.response_text);
            assert_eq!(info.env_failed, None);
            let mask = s.loss_mask.as_ref().unwrap();
            assert_eq!(mask.len(), s.response_len());
            assert_eq!(s.rollout_logprobs.len(), s.response_len());
            // Three model turns of 6 tokens; two observations between them.
            assert_eq!(mask.iter().filter(|&&b| b == 1).count(), 18);
            let observed: Vec<i64> = (0..s.response_len())
                .filter(|&t| !s.is_model_token(t))
                .map(|t| s.response_tokens[t])
                .collect();
            let text = TINY_CODEC.decode(&observed).unwrap();
            assert!(
                text.contains("number") || text.contains("Higher") || text.contains("Lower"),
                "{text}"
            );
            assert!(s.prompt_text == "guess");
            assert!(TINY_CODEC
                .decode(&s.prompt_tokens)
                .unwrap()
                .contains("thinking of a number"));
        }
        // The model's tokens carry the engine's log-probs: the trainer agrees with them.
        let scored = score_samples(&scorer, &samples, 1, 1.0, 8).unwrap();
        for (s, lp) in samples.iter().zip(&scored) {
            for t in (0..s.response_len()).filter(|&t| s.is_model_token(t)) {
                assert!(
                    (lp[t] - s.rollout_logprobs[t]).abs() < 2e-3,
                    "{t}: {} vs {}",
                    lp[t],
                    s.rollout_logprobs[t]
                );
            }
        }
        // Deterministic: the same request gives the same episodes (but for the time the
        // environments took).
        let untimed = |mut v: Vec<Sample>| {
            for s in &mut v {
                s.episode.as_mut().unwrap().env_seconds = 0.0;
            }
            v
        };
        assert_eq!(untimed(episodes(&mut r)), untimed(samples));
    }

    /// Guidance (`call_prefix = "guide"`): the first `ceil(fraction * n)` samples of each
    /// prompt open with the call, as trained tokens whose log-probs are the trainer's
    /// own scoring of them; the other samples carry no prefix at all. A masked prefix
    /// (`always`) opens every episode, out of the loss.
    #[test]
    fn a_guided_prefix_is_trained_on_a_share_of_each_group_and_absent_from_the_rest() {
        let prefix = TINY_CODEC
            .encode_response(r#"<tool_call>{"name": "calculator", "arguments": {"expression": ""#)
            .unwrap();
        let starts_with_prefix = |s: &Sample| s.response_tokens.starts_with(&prefix);
        let (m, scorer) = (long_model(25), long_model(25));
        let mut r = calculator_rollout(m, PrefixUse::Guide { fraction: 0.3 });
        let samples = episodes_of(&mut r, 4);
        assert_eq!(samples.len(), 8);
        let scored = score_samples(&scorer, &samples, 1, 1.0, 8).unwrap();
        for (s, lp) in samples.iter().zip(&scored) {
            let info = s.episode.as_ref().unwrap();
            // ceil(0.3 * 4) = 2 guided samples per prompt.
            let guided = s.id.k < 2;
            assert_eq!(info.prefixed, guided, "{}", s.id);
            assert_eq!(
                starts_with_prefix(s),
                guided,
                "{}: {:?}",
                s.id,
                s.response_text
            );
            if guided {
                let mask = s.loss_mask.as_ref().unwrap();
                assert!(mask[..prefix.len()].iter().all(|&b| b == 1));
                for t in 0..prefix.len() {
                    assert!(s.rollout_logprobs[t] < 0.0, "{t}");
                    assert!(
                        (lp[t] - s.rollout_logprobs[t]).abs() < 2e-3,
                        "{t}: {} vs {}",
                        lp[t],
                        s.rollout_logprobs[t]
                    );
                }
            }
        }
        // Fraction 0 (what evaluation of a guided job amounts to): no sample opens.
        let mut r = calculator_rollout(long_model(25), PrefixUse::Guide { fraction: 0.0 });
        assert!(episodes_of(&mut r, 2)
            .iter()
            .all(|s| !starts_with_prefix(s) && !s.episode.as_ref().unwrap().prefixed));
        // Masked: every sample opens, the prefix out of the loss with log-prob 0.
        let mut r = calculator_rollout(long_model(25), PrefixUse::Masked);
        for s in episodes_of(&mut r, 2) {
            assert!(starts_with_prefix(&s), "{}", s.id);
            let mask = s.loss_mask.as_ref().unwrap();
            assert!(mask[..prefix.len()].iter().all(|&b| b == 0));
            assert!(s.rollout_logprobs[..prefix.len()].iter().all(|&l| l == 0.0));
        }
    }

    /// Observation tokens get no gradient: the loss's gradient with respect to the
    /// model's logits is exactly zero at every masked position (and not at the model's).
    #[test]
    fn observation_tokens_get_no_gradient() {
        let (m, scorer) = (model(23), model(23));
        let samples = episodes(&mut guessing_rollout(m));
        for s in &samples {
            let ids: Vec<i64> = s
                .prompt_tokens
                .iter()
                .chain(&s.response_tokens)
                .copied()
                .collect();
            let (p, t) = (s.prompt_tokens.len() as i64, s.response_len() as i64);
            let logits =
                tch::no_grad(|| scorer.forward(&Tensor::from_slice(&ids).view([1, -1]), None));
            // The logits that predict the response tokens, as a leaf to read gradients at.
            let leaf = logits.narrow(1, p - 1, t).detach().set_requires_grad(true);
            let target = Tensor::from_slice(&s.response_tokens).view([1, t, 1]);
            let lp = leaf
                .log_softmax(-1, Kind::Float)
                .gather(2, &target, false)
                .squeeze_dim(2);
            let one = std::slice::from_ref(s);
            let mask = response_mask(one, Device::Cpu).unwrap();
            let old = lp.detach() - 0.05;
            let adv = Tensor::ones([1, t], (Kind::Float, Device::Cpu)) * 0.7;
            let cfg = PolicyLossConfig {
                agg: LossAgg::TokenMean,
                ..Default::default()
            };
            let (pg, _) = policy_loss(&lp, &old, &adv, &mask, &cfg).unwrap();
            let reference = lp.detach() + 0.1;
            let (kl, _) = kl_loss(
                &lp,
                &reference,
                &mask,
                KlEstimator::K3,
                0.1,
                LossAgg::TokenMean,
            )
            .unwrap();
            (pg + kl).backward();
            let grad = leaf
                .grad()
                .abs()
                .sum_dim_intlist(2, false, Kind::Float)
                .squeeze_dim(0);
            let grad: Vec<f32> = Vec::try_from(grad).unwrap();
            for (i, g) in grad.iter().enumerate() {
                if s.is_model_token(i) {
                    assert!(*g > 0.0, "model token {i} has no gradient");
                } else {
                    assert_eq!(*g, 0.0, "observation token {i} has gradient {g}");
                }
            }
        }
    }

    /// GAE steps over observation tokens: the model's tokens get the advantages they
    /// would get with the observations cut out of the sequence.
    #[test]
    fn gae_over_a_masked_observation_equals_gae_without_it() {
        let row = |v: &[f32]| Tensor::from_slice(v).view([1, v.len() as i64]);
        let cfg = GaeConfig {
            gamma: 0.9,
            lam: 0.8,
            norm: AdvantageNorm::None,
            eps: 1e-8,
        };
        // Tokens: model, model, obs, obs, model, model, padding.
        let mask = row(&[1., 1., 0., 0., 1., 1., 0.]);
        let rewards = row(&[0., 0.3, 5., 5., 0., 1., 0.]);
        let values = row(&[0.2, 0.4, 9., 9., 0.1, 0.6, 0.]);
        let with = gae_advantage(&rewards, &values, &mask, &cfg).unwrap();
        let cut = gae_advantage(
            &row(&[0., 0.3, 0., 1.]),
            &row(&[0.2, 0.4, 0.1, 0.6]),
            &row(&[1., 1., 1., 1.]),
            &cfg,
        )
        .unwrap();
        let a: Vec<f32> = Vec::try_from(with.advantages.view([-1])).unwrap();
        let b: Vec<f32> = Vec::try_from(cut.advantages.view([-1])).unwrap();
        for (x, y) in [a[0], a[1], a[4], a[5]].iter().zip(&b) {
            assert!((x - y).abs() < 1e-6, "{a:?} vs {b:?}");
        }
        assert_eq!((a[2], a[3], a[6]), (0.0, 0.0, 0.0));
    }
}
