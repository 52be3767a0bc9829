//! The stages of a step after generation: reward, reference, values, update.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

use yatt_roles::{
    dynamic_sampling_filter, group_indices, overlong_penalty, CriticReport, CriticRequest,
    CriticResponse, PolicyRequest, PolicyResponse, Prompt, RoleRequest, RoleResponse, RolloutStats,
    Sample, SampleId, TrainReport,
};

use crate::controller::config::{ControllerConfig, DynamicSamplingConfig, OverlongConfig};
use crate::controller::core::Controller;
use crate::controller::core::{GenBatch, Prepared};
use crate::controller::error::ControllerError;
use crate::controller::extra_stages::StageAt;
use crate::controller::refs::variant;
use crate::controller::report::{StepMetrics, StepReport};
use crate::controller::time_share::prepare_time_shared;
use crate::controller::update_log::LoggedUpdates;
use crate::controller::weights::Pushed;
use crate::ledger::{SampleLedger, Stage};
use yatt_metrics::names;

/// A weight sync that already ran (beside generation, with partial rollouts).
pub(crate) struct Synced {
    pub(crate) pushed: Pushed,
    pub(crate) seconds: f64,
}

/// What the rounds of one step's generation add up to.
#[derive(Debug, Default)]
pub(crate) struct RoundTotals {
    pub(crate) rounds: usize,
    pub(crate) gen_s: f64,
    pub(crate) reward_s: f64,
    pub(crate) gen: RolloutStats,
    pub(crate) streamed_early: usize,
    pub(crate) groups_seen: usize,
    pub(crate) groups_dropped: usize,
    pub(crate) kept_groups: usize,
    /// No group had signal in any round, and the last round's flat groups were kept.
    pub(crate) without_signal: bool,
}

impl Controller {
    /// Stages up to the update: generation and reward (repeated by dynamic sampling),
    /// reference, critic values, old log-probs, advantages.
    pub(crate) async fn prepare(&mut self) -> Result<Prepared, ControllerError> {
        if self.config.time_share.is_some() {
            let mut one = prepare_time_shared(std::slice::from_mut(self)).await?;
            return one
                .pop()
                .ok_or_else(|| ControllerError::Config("no batch".into()));
        }
        let t_step = Instant::now();
        let mut batch = self.gen_batch(self.step).await?;
        self.lost_rollouts.extend(batch.lost.drain(..));
        self.prepare_batch(batch, t_step).await
    }

    /// Generation and reward of the batch that step `step` trains: its samples, in a
    /// ledger of their own (the batch may train in a later step than it generates in).
    pub(crate) async fn gen_batch(&self, step: u64) -> Result<GenBatch, ControllerError> {
        let cfg = &self.config;
        self.check_forced_route().await?;
        let mut metrics = StepMetrics {
            step,
            values: BTreeMap::new(),
        };
        let mut ledger = SampleLedger::new(step, &self.stages());
        let mut lost = Vec::new();
        let (samples, gen) = self
            .generate_and_reward(step, cfg, &mut ledger, &mut metrics, &mut lost)
            .await?;
        Ok(GenBatch {
            step,
            generated_at: self.step,
            ledger,
            samples,
            gen,
            metrics,
            lost,
        })
    }

    /// The stages of a generated batch up to the update: reference, critic values, old
    /// log-probs, advantages. Refuses a sample beyond the staleness bound.
    pub(crate) async fn prepare_batch(
        &self,
        batch: GenBatch,
        t_step: Instant,
    ) -> Result<Prepared, ControllerError> {
        let cfg = &self.config;
        let GenBatch {
            mut ledger,
            samples,
            gen,
            metrics: mut m,
            generated_at,
            ..
        } = batch;
        m.step = self.step;
        self.check_staleness(&samples, generated_at, &mut m)?;
        // 3. Reference.
        let samples = match &self.roles.reference {
            Some(r) => {
                let t = Instant::now();
                let s = self
                    .serve(r, samples, "ref", "reference", cfg.timeouts.score)
                    .await?;
                m.set(names::REF_S, t.elapsed().as_secs_f64());
                self.stage_done(&mut ledger, &s, Stage::Referenced)?;
                s
            }
            None => samples,
        };
        let samples = self
            .extra_stages(StageAt::Reference, samples, &mut ledger, &mut m)
            .await?;
        // 4. Critic values.
        let samples = self.values(samples, cfg, &mut ledger, &mut m).await?;
        // 5. Old log-probs.
        let samples = self.old_logprobs(samples, cfg, &mut ledger, &mut m).await?;
        let mut samples = self
            .extra_stages(StageAt::OldLogProbs, samples, &mut ledger, &mut m)
            .await?;
        self.off_policy_metrics(&samples, &mut m);
        // 6. Advantages.
        let t = Instant::now();
        self.advantages(&mut samples, &mut m)?;
        m.set(names::ADV_S, t.elapsed().as_secs_f64());
        self.stage_done(&mut ledger, &samples, Stage::Advantaged)?;
        Ok(Prepared {
            t_step,
            metrics: m,
            ledger,
            samples,
            gen,
        })
    }

    /// The stages every sample of this controller's steps must pass.
    pub(crate) fn stages(&self) -> Vec<Stage> {
        let mut stages = vec![
            Stage::Generated,
            Stage::Rewarded,
            Stage::OldLogProbs,
            Stage::Advantaged,
            Stage::Trained,
        ];
        if self.roles.reference.is_some() {
            stages.push(Stage::Referenced);
        }
        if self.roles.critic.is_some() {
            stages.extend([Stage::Valued, Stage::CriticTrained]);
        }
        stages
    }

    /// Generation and reward, in rounds when dynamic sampling drops prompt groups whose
    /// rewards are all equal: the step's samples and the generation statistics.
    async fn generate_and_reward(
        &self,
        step: u64,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
        m: &mut StepMetrics,
        lost: &mut Vec<yatt_runtime::ActorId>,
    ) -> Result<(Vec<Sample>, RolloutStats), ControllerError> {
        let target = cfg.prompts_per_step;
        let rounds = cfg.dynamic_sampling.map_or(1, |d| d.max_rounds);
        let mut kept: Vec<Sample> = Vec::new();
        let mut seen = std::collections::BTreeSet::new();
        let mut t = RoundTotals::default();
        let mut want = target;
        while t.rounds < rounds {
            t.rounds += 1;
            // A step never takes a prompt twice: its sample ids would collide.
            let drawn = {
                let mut loader = self.loader.lock().unwrap_or_else(|e| e.into_inner());
                let take = want.min(loader.shard_len());
                loader.next_batch(take)
            };
            let prompts: Vec<_> = drawn.into_iter().filter(|p| seen.insert(p.id)).collect();
            if prompts.is_empty() {
                break;
            }
            let ids = prompts.iter().flat_map(|p| {
                (0..cfg.n).map(move |k| SampleId {
                    step,
                    prompt: p.id,
                    k,
                })
            });
            ledger.expect(ids).map_err(self.ledger_err())?;
            let samples = self
                .generate_round(step, prompts, cfg, ledger, &mut t, lost)
                .await?;
            self.stage_done(ledger, &samples, Stage::Rewarded)?;
            let mut samples = self
                .extra_stages(StageAt::Reward, samples, ledger, m)
                .await?;
            if let Some(o) = cfg.overlong {
                self.apply_overlong(&mut samples, o)?;
            }
            let Some(ds) = cfg.dynamic_sampling else {
                kept = samples;
                break;
            };
            // The last round of a step after the first keeps flat groups rather than
            // none: a model that answers every drawn prompt alike (saturated) then
            // takes a step without signal, as without dynamic sampling, instead of
            // ending a long run. At the first step nothing has varied yet, which points
            // to the reward or the task, so that step stays an error.
            let settle = step > 0 && t.rounds == rounds;
            let Some(more) = self
                .keep_groups_with_signal(samples, ds, target, settle, ledger, &mut kept, &mut t)?
            else {
                break;
            };
            want = more;
        }
        if kept.is_empty() {
            // Like verl's DAPO: a first step with no signal at all is an error, not a
            // silent no-op update.
            return Err(ControllerError::NoSignal {
                step: step + 1,
                rounds: t.rounds,
                groups: t.groups_dropped,
            });
        }
        if t.without_signal {
            tracing::warn!(
                step = step + 1,
                rounds = t.rounds,
                groups_dropped = t.groups_dropped,
                "dynamic sampling found no prompt group with differing rewards; this step \
                 trains on flat groups (no policy-gradient signal), as without dynamic \
                 sampling. Many such steps mean the model is saturated on the task"
            );
        }
        m.set(names::GEN_S, t.gen_s);
        m.set(names::REWARD_S, t.reward_s);
        if cfg.stream {
            m.set(names::REWARDED_DURING_GEN, t.streamed_early as f64);
        }
        if cfg.dynamic_sampling.is_some() {
            m.set(names::DAPO_GEN_ROUNDS, t.rounds as f64);
            m.set(names::DAPO_GROUPS_DROPPED, t.groups_dropped as f64);
            m.set(
                names::DAPO_KEEP_RATE,
                t.kept_groups as f64 / t.groups_seen.max(1) as f64,
            );
            m.set(
                names::DAPO_WITHOUT_SIGNAL,
                f64::from(u8::from(t.without_signal)),
            );
        }
        Ok((kept, t.gen))
    }

    /// One round of generation and reward over `prompts` (streamed or not).
    async fn generate_round(
        &self,
        step: u64,
        prompts: Vec<Prompt>,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
        t: &mut RoundTotals,
        lost: &mut Vec<yatt_runtime::ActorId>,
    ) -> Result<Vec<Sample>, ControllerError> {
        if cfg.stream {
            let r = self.generate_streamed(step, prompts, cfg, ledger).await?;
            t.gen_s += r.gen_s;
            t.reward_s += r.reward_tail_s;
            t.gen.absorb(&r.stats);
            t.gen.seconds += r.stats.seconds;
            t.streamed_early += r.early;
            ledger
                .verify_stage(Stage::Generated)
                .map_err(self.ledger_err())?;
            return Ok(r.samples);
        }
        let g = self.generate(step, prompts, cfg).await?;
        // Samples a lost replica had in flight were generated again elsewhere.
        for id in &g.requeued {
            ledger.requeue(*id).map_err(self.ledger_err())?;
        }
        lost.extend(g.lost);
        let samples = g.samples;
        t.gen_s += g.seconds;
        t.gen.absorb(&g.stats);
        t.gen.seconds += g.stats.seconds;
        self.stage_done(ledger, &samples, Stage::Generated)?;
        self.check_fresh(&samples)?;
        let started = Instant::now();
        let samples = self
            .serve(
                &self.roles.reward,
                samples,
                "reward",
                "reward",
                cfg.timeouts.score,
            )
            .await?;
        t.reward_s += started.elapsed().as_secs_f64();
        Ok(samples)
    }

    /// DAPO's dynamic sampling on one round's `samples`: keeps the groups with signal
    /// (at most those still needed) in `kept`, drops the rest through the ledger, and
    /// gives the number of prompts to ask for next, or `None` when the step is full.
    /// With `settle`, a round that leaves the step with no group at all keeps up to
    /// `target` flat groups instead (and ends the step).
    fn keep_groups_with_signal(
        &self,
        samples: Vec<Sample>,
        ds: DynamicSamplingConfig,
        target: usize,
        settle: bool,
        ledger: &mut SampleLedger,
        kept: &mut Vec<Sample>,
        t: &mut RoundTotals,
    ) -> Result<Option<usize>, ControllerError> {
        let step = self.step_no();
        let rewards: Vec<f64> = samples
            .iter()
            .map(|s| s.require_reward())
            .collect::<Result<_, _>>()
            .map_err(|source| ControllerError::Sample { step, source })?;
        let groups = group_indices(&samples);
        let f = dynamic_sampling_filter(&rewards, &groups, target - t.kept_groups, ds.tolerance)
            .map_err(|source| ControllerError::Algo { step, source })?;
        t.groups_seen += f.keep_groups.len() + f.dropped_groups.len();
        // Keep at most the groups still needed; the surplus is dropped like the groups
        // without signal (DAPO trims to the batch size).
        let settling = settle && t.kept_groups == 0 && f.keep_groups.is_empty();
        let candidates = if settling {
            t.without_signal = true;
            &f.dropped_groups
        } else {
            &f.keep_groups
        };
        let keep: Vec<usize> = candidates
            .iter()
            .copied()
            .take(target - t.kept_groups)
            .collect();
        if !settling {
            t.kept_groups += keep.len();
        }
        let mut dropped = Vec::new();
        for (s, g) in samples.into_iter().zip(&groups) {
            if keep.contains(g) {
                kept.push(s);
            } else {
                dropped.push(s);
            }
        }
        t.groups_dropped += f.dropped_groups.len() + f.keep_groups.len() - keep.len();
        for s in &dropped {
            ledger
                .drop_after(s.id, Stage::Rewarded)
                .map_err(self.ledger_err())?;
        }
        if settling || t.kept_groups >= target {
            return Ok(None);
        }
        Ok(Some(
            f.suggested_prompts
                .unwrap_or(2 * (target - t.kept_groups))
                .max(target - t.kept_groups),
        ))
    }

    /// The critic's values of `samples`, when the job has a critic.
    async fn values(
        &self,
        samples: Vec<Sample>,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
        m: &mut StepMetrics,
    ) -> Result<Vec<Sample>, ControllerError> {
        let Some(c) = self.critic() else {
            return Ok(samples);
        };
        let t = Instant::now();
        let request = || CriticRequest::Values(samples.clone());
        let s = match self
            .serve_critic(&c, request, "values", cfg.timeouts.score)
            .await?
        {
            CriticResponse::Valued(s) => s,
            other => return Err(self.protocol("critic", "Values", format!("{other:?}"))),
        };
        m.set(names::VALUES_S, t.elapsed().as_secs_f64());
        self.stage_done(ledger, &s, Stage::Valued)?;
        Ok(s)
    }

    /// The policy's log-probs of `samples` before the update (the PPO ratio's "old").
    async fn old_logprobs(
        &self,
        samples: Vec<Sample>,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
        m: &mut StepMetrics,
    ) -> Result<Vec<Sample>, ControllerError> {
        let t = Instant::now();
        let request = PolicyRequest::OldLogProbs(samples);
        let samples = match self
            .serve_policy(request, "old_log_prob", cfg.timeouts.score)
            .await?
        {
            PolicyResponse::Scored(s) => s,
            other => return Err(self.protocol("policy", "OldLogProbs", format!("{other:?}"))),
        };
        m.set(names::OLD_LOG_PROB_S, t.elapsed().as_secs_f64());
        self.stage_done(ledger, &samples, Stage::OldLogProbs)?;
        Ok(samples)
    }

    /// Adds DAPO's overlong penalty to each sample's reward.
    pub(crate) fn apply_overlong(
        &self,
        samples: &mut [Sample],
        o: OverlongConfig,
    ) -> Result<(), ControllerError> {
        let step = self.step_no();
        for s in samples {
            let r = s
                .require_reward()
                .map_err(|source| ControllerError::Sample { step, source })?;
            let p = overlong_penalty(s.response_len(), o.max_len, o.buffer)
                .map_err(|source| ControllerError::Algo { step, source })?;
            s.reward = Some(r + o.coef * p);
        }
        Ok(())
    }

    /// The update's accounting, weight sync, the ledger's close and the metrics.
    pub(crate) async fn finish(
        &mut self,
        p: Prepared,
        train: TrainReport,
        critic: Option<CriticReport>,
        update_s: f64,
        synced: Option<Synced>,
    ) -> Result<StepReport, ControllerError> {
        let Prepared {
            t_step,
            metrics: mut m,
            mut ledger,
            samples: kept,
            gen,
        } = p;
        let cfg = self.config.clone();
        m.set(names::UPDATE_ACTOR_S, update_s);
        ledger.record_all(&train.trained, Stage::Trained);
        ledger
            .verify_stage(Stage::Trained)
            .map_err(self.ledger_err())?;
        if let Some(c) = &critic {
            ledger.record_all(&c.trained, Stage::CriticTrained);
            ledger
                .verify_stage(Stage::CriticTrained)
                .map_err(self.ledger_err())?;
            m.set(names::VF_LOSS, c.vf_loss);
            m.set(names::VF_CLIPFRAC, c.vf_clipfrac);
            m.set(names::VPRED_MEAN, c.vpred_mean);
            m.set(names::CRITIC_GRAD_NORM, c.grad_norm);
        }

        // 7. Weight sync (done already when it ran beside generation).
        let version = match synced {
            Some(Synced { pushed, seconds }) => {
                self.lost_rollouts.extend(pushed.lost);
                self.weights_version = pushed.version;
                self.last_sync = pushed.routes;
                m.set(names::WEIGHT_SYNC_S, seconds);
                pushed.version
            }
            None => {
                let t = Instant::now();
                let version = self.sync_weights().await?;
                m.set(names::WEIGHT_SYNC_S, t.elapsed().as_secs_f64());
                version
            }
        };
        let routes = self.last_sync;
        m.set(names::WEIGHT_SYNC_BYTES, routes.bytes as f64);
        m.set(names::WEIGHT_SYNC_CUDA_IPC, routes.via_ipc as f64);
        m.set(names::WEIGHT_SYNC_NCCL, routes.via_nccl as f64);
        m.set(names::WEIGHT_SYNC_DIRECT, routes.via_direct as f64);

        let ledger = ledger.close().map_err(self.ledger_err())?;
        let wall = t_step.elapsed().as_secs_f64();
        m.set(names::STEP_S, wall);
        let b = kept.len().max(1) as f64;
        let resp: usize = kept.iter().map(Sample::response_len).sum();
        let prompt: usize = kept.iter().map(|s| s.prompt_tokens.len()).sum();
        m.set(names::RESPONSE_LENGTH_MEAN, resp as f64 / b);
        m.set(names::PROMPT_LENGTH_MEAN, prompt as f64 / b);
        m.set(names::TOTAL_NUM_TOKENS, (resp + prompt) as f64);
        m.set(
            names::THROUGHPUT,
            (resp + prompt) as f64 / wall.max(1e-9) / cfg.devices as f64,
        );
        m.set(
            names::GEN_TOKENS_PER_S,
            gen.response_tokens as f64 / gen.seconds.max(1e-9),
        );
        m.set(names::KV_PREEMPTIONS, gen.kv_preemptions as f64);
        if gen.kv_bytes_held_peak > 0 {
            m.set(names::KV_BYTES_HELD, gen.kv_bytes_held_peak as f64);
        }
        if gen.prefill_reused_tokens > 0 {
            m.set(
                names::PREFILL_REUSED_TOKENS,
                gen.prefill_reused_tokens as f64,
            );
        }
        m.set(names::ENTROPY, train.entropy);
        m.set(names::PG_CLIPFRAC, train.pg_clipfrac);
        m.set(names::GRAD_NORM, train.grad_norm);
        if self.in_policy_ring {
            m.set(
                names::GRAD_ALLREDUCE_NCCL,
                train.nccl_all_reduce as u8 as f64,
            );
        }
        if let Some(s) = &train.sharded {
            m.set(names::POLICY_SHARDS, s.shards as f64);
            m.set(names::TRAIN_STATE_BYTES, s.train_state_bytes as f64);
            m.set(names::SHARD_GATHERED_BYTES, s.gathered_bytes as f64);
            m.set(names::SHARD_REDUCED_BYTES, s.reduced_bytes as f64);
            if s.replica_bytes > 0 {
                m.set(names::SHARD_REPLICA_BYTES, s.replica_bytes as f64);
            }
            m.set(names::SHARD_GATHER_S, s.gather_s);
            m.set(names::SHARD_GATHER_EXPOSED_S, s.gather_exposed_s);
        }
        m.set(names::PG_LOSS, train.loss);
        m.set(names::PPO_KL, train.approx_kl);
        m.set(names::LR, train.lr);
        if self.config.kl_in_reward.is_none() && train.kl_loss != 0.0 {
            m.set(names::KL_LOSS, train.kl_loss);
        }
        m.set(names::WEIGHTS_VERSION, version as f64);
        self.adopt_replaced_critic();
        let replayed = |u: Option<&LoggedUpdates>| u.map_or(0, LoggedUpdates::take_replayed);
        let critic_updates = replayed(self.critic_recovery.as_ref().map(|r| &r.updates));
        if critic_updates > 0 {
            m.set(names::RECOVERY_CRITIC_REPLAYED, critic_updates as f64);
        }
        let policy_updates = replayed(self.policy_recovery.as_ref());
        if policy_updates > 0 {
            m.set(names::RECOVERY_POLICY_REPLAYED, policy_updates as f64);
        }
        self.step += 1;
        m.set(names::DROPPED_SAMPLES, ledger.dropped as f64);
        Ok(StepReport {
            metrics: m,
            ledger,
            samples: kept,
            train,
            critic,
        })
    }
}

impl Controller {
    /// Runs the extra stages placed `at`, in the order they were added.
    pub(crate) async fn extra_stages(
        &self,
        at: StageAt,
        mut samples: Vec<Sample>,
        ledger: &mut SampleLedger,
        m: &mut StepMetrics,
    ) -> Result<Vec<Sample>, ControllerError> {
        for stage in self.extra.iter().filter(|s| s.after == at) {
            let t = Instant::now();
            let sent: BTreeSet<SampleId> = samples.iter().map(|s| s.id).collect();
            let back = match stage
                .role
                .ask(RoleRequest::Serve(samples), stage.timeout)
                .await
                .map_err(self.call(stage.name, stage.name))?
            {
                RoleResponse::Served(x) => x,
                other => return Err(self.protocol(stage.name, "Serve", variant(&other))),
            };
            let mut seen = BTreeSet::new();
            for s in &back {
                if !sent.contains(&s.id) || !seen.insert(s.id) {
                    return Err(self.protocol(
                        stage.name,
                        "Serve",
                        format!(
                            "sample {:?} {}",
                            s.id,
                            if sent.contains(&s.id) {
                                "twice"
                            } else {
                                "that it was not given"
                            }
                        ),
                    ));
                }
            }
            let after = at.ledger_stage(self.roles.reference.is_some());
            for id in sent.difference(&seen) {
                ledger.drop_after(*id, after).map_err(self.ledger_err())?;
            }
            m.add(
                &format!("stage/{}/dropped", stage.name),
                (sent.len() - seen.len()) as f64,
            );
            m.add(
                &format!("timing_s/stage/{}", stage.name),
                t.elapsed().as_secs_f64(),
            );
            samples = back;
        }
        Ok(samples)
    }
}
