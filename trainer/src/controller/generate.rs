//! Generation: spreading prompts over rollout replicas, retrying lost ones, streaming.

use std::time::{Duration, Instant};

use yatt_roles::{
    GenerateRequest, RoleRequest, RoleResponse, RolloutRequest, RolloutResponse, Sample, SampleId,
    SampleSink,
};
use yatt_runtime::ActorId;

use crate::controller::config::ControllerConfig;
use crate::controller::core::Controller;
use crate::controller::error::replica_lost;
use crate::controller::error::ControllerError;
use crate::controller::refs::{variant, RolloutRef};
use crate::ledger::{SampleLedger, Stage};

/// What a streamed generation round produced.
pub(crate) struct Streamed {
    /// The rewarded samples, in `(prompt, k)` order.
    pub(crate) samples: Vec<Sample>,
    /// Generation counters.
    pub(crate) stats: yatt_roles::RolloutStats,
    /// Seconds until the last rollout finished.
    pub(crate) gen_s: f64,
    /// Seconds from then until the last reward came back (the part not overlapped).
    pub(crate) reward_tail_s: f64,
    /// Samples sent to the reward role before generation finished.
    pub(crate) early: usize,
}

/// One generation request's outcome: the rollout's answer, the samples requeued on
/// another replica on the way, and the replicas found lost.
pub(crate) struct GenOutcome {
    pub(crate) answer: RolloutResponse,
    pub(crate) requeued: Vec<SampleId>,
    pub(crate) lost: Vec<ActorId>,
}

/// One generation round: its samples, the rollouts' stats, its wall seconds, the
/// samples requeued on a spare replica and the replicas found lost.
#[derive(Default)]
pub(crate) struct Generated {
    pub(crate) samples: Vec<Sample>,
    pub(crate) stats: yatt_roles::RolloutStats,
    pub(crate) seconds: f64,
    pub(crate) requeued: Vec<SampleId>,
    pub(crate) lost: Vec<ActorId>,
}

impl Controller {
    /// A round's generation requests: contiguous, near-equal slices of the prompts, one
    /// per rollout replica.
    pub(crate) fn split_over_replicas(
        &self,
        step: u64,
        prompts: Vec<yatt_roles::Prompt>,
        cfg: &ControllerConfig,
    ) -> Vec<(&RolloutRef, GenerateRequest)> {
        let replicas: Vec<&RolloutRef> = std::iter::once(&self.roles.rollout)
            .chain(&self.roles.extra_rollouts)
            .collect();
        let per = prompts.len().div_ceil(replicas.len()).max(1);
        let mut rest = prompts;
        let mut out = Vec::with_capacity(replicas.len());
        for r in replicas {
            if rest.is_empty() {
                break;
            }
            let tail = rest.split_off(per.min(rest.len()));
            let req = GenerateRequest {
                step,
                prompts: std::mem::replace(&mut rest, tail),
                n: cfg.n,
                params: cfg.sampling.clone(),
                seed: cfg.seed,
            };
            out.push((r, req));
        }
        out
    }

    /// One generation round: `n` samples of each prompt from the rollout. A request
    /// whose replica is lost goes to a spare ([`Controller::set_spare_rollouts`]); the
    /// samples it had in flight are returned as requeued, with the lost replicas.
    pub(crate) async fn generate(
        &self,
        step: u64,
        prompts: Vec<yatt_roles::Prompt>,
        cfg: &ControllerConfig,
    ) -> Result<Generated, ControllerError> {
        let t = Instant::now();
        let asks: Vec<_> = self
            .split_over_replicas(step, prompts, cfg)
            .into_iter()
            .map(|(r, req)| self.generate_chunked(r, req, cfg))
            .collect();
        let mut out = Generated::default();
        for g in futures::future::try_join_all(asks).await? {
            out.requeued.extend(g.requeued);
            out.lost.extend(g.lost);
            match g.answer {
                RolloutResponse::Generated {
                    samples: s,
                    stats: st,
                } => {
                    out.samples.extend(s);
                    out.stats.absorb(&st);
                    // Replicas run side by side: the round takes the slowest one's time.
                    out.stats.seconds = out.stats.seconds.max(st.seconds);
                }
                _ => return Err(self.protocol("rollout", "Generate", "not Generated".into())),
            }
        }
        out.seconds = t.elapsed().as_secs_f64();
        Ok(out)
    }

    /// One generation request, in chunks with partial rollouts: the first chunk as a
    /// generation request, then the unfinished samples continued chunk by chunk on the
    /// replica that generated them, each chunk on the weights it holds by then.
    async fn generate_chunked(
        &self,
        first: &RolloutRef,
        mut req: GenerateRequest,
        cfg: &ControllerConfig,
    ) -> Result<GenOutcome, ControllerError> {
        let Some(partial) = cfg.partial_rollout else {
            return self.generate_on(first, req, cfg.timeouts.generate).await;
        };
        let budget = req.params.max_new_tokens;
        req.params.max_new_tokens = partial.chunk_tokens.min(budget);
        let mut out = self
            .generate_on(first, req.clone(), cfg.timeouts.generate)
            .await?;
        // The replica that answered (a spare if the first was lost).
        let replica = match out.lost.last() {
            None => first.clone(),
            Some(_) => self
                .spare_rollouts
                .iter()
                .find(|s| !out.lost.contains(s.id()) && s.id() != first.id())
                .cloned()
                .unwrap_or_else(|| first.clone()),
        };
        let RolloutResponse::Generated { samples, stats } = &mut out.answer else {
            return Err(self.protocol("rollout", "Generate", "not Generated".into()));
        };
        loop {
            let open: Vec<usize> = (0..samples.len())
                .filter(|&i| {
                    let s = &samples[i];
                    s.finish == yatt_roles::Finish::Length && s.response_len() < budget
                })
                .collect();
            if open.is_empty() {
                break;
            }
            let cont = yatt_roles::ContinueRequest {
                samples: open.iter().map(|&i| samples[i].clone()).collect(),
                params: req.params.clone(),
                seed: req.seed,
                budget,
            };
            let t = cfg.timeouts.generate;
            match self
                .serve(
                    &replica,
                    RolloutRequest::Continue(cont),
                    "gen",
                    "rollout",
                    t,
                )
                .await?
            {
                RolloutResponse::Generated {
                    samples: more,
                    stats: st,
                } if more.len() == open.len() => {
                    stats.absorb(&st);
                    stats.seconds += st.seconds;
                    for (i, s) in open.into_iter().zip(more) {
                        samples[i] = s;
                    }
                }
                other => {
                    let got = format!("{other:?}");
                    return Err(self.protocol("rollout", "Continue", got));
                }
            }
        }
        Ok(out)
    }

    /// One generation request to `first`, then, while the replica asked is lost, to
    /// each spare in turn (each spare tried once).
    pub(crate) async fn generate_on(
        &self,
        first: &RolloutRef,
        req: GenerateRequest,
        timeout: Duration,
    ) -> Result<GenOutcome, ControllerError> {
        let mut spares = self
            .spare_rollouts
            .iter()
            .filter(|s| s.id() != first.id() && !self.lost_rollouts.contains(s.id()));
        // A replica found lost in an earlier step missed its weight sync: its work
        // goes straight to a spare (nothing of it was in flight, nothing is requeued).
        let mut asked = match self.lost_rollouts.contains(first.id()) {
            true => spares.next().unwrap_or(first).clone(),
            false => first.clone(),
        };
        let (mut requeued, mut lost) = (Vec::new(), Vec::new());
        loop {
            let answer = {
                let _probe = self.probe.as_ref().map(|p| p.enter(asked.id()));
                asked
                    .ask(
                        RoleRequest::Serve(RolloutRequest::Generate(req.clone())),
                        timeout,
                    )
                    .await
            };
            match answer {
                Ok(RoleResponse::Served(answer)) => {
                    return Ok(GenOutcome {
                        answer,
                        requeued,
                        lost,
                    })
                }
                Ok(other) => return Err(self.protocol("rollout", "gen", variant(&other))),
                Err(e) if replica_lost(&e) => {
                    let Some(next) = spares.next() else {
                        return Err(self.call("gen", "rollout")(e));
                    };
                    tracing::warn!(step = self.step, lost = %asked.id(), to = %next.id(), error = %e,
                        "rollout replica lost mid-step; its samples are requeued on a spare");
                    lost.push(asked.id().clone());
                    requeued.extend(req.prompts.iter().flat_map(|p| {
                        (0..req.n).map(move |k| SampleId {
                            step: req.step,
                            prompt: p.id,
                            k,
                        })
                    }));
                    asked = next.clone();
                }
                Err(e) => return Err(self.call("gen", "rollout")(e)),
            }
        }
    }

    /// Fails with [`ControllerError::StaleWeights`] when a sample was generated with
    /// weights other than the policy's latest.
    pub(crate) fn check_fresh(&self, samples: &[Sample]) -> Result<(), ControllerError> {
        match samples
            .iter()
            .find(|s| s.weights_version != self.weights_version)
        {
            Some(s) => Err(ControllerError::StaleWeights {
                step: self.step_no(),
                id: s.id,
                got: s.weights_version,
                want: self.weights_version,
            }),
            None => Ok(()),
        }
    }

    /// One generation round, streamed: every rollout sends each sample as it finishes
    /// through a bounded channel (backpressure), and samples go on to the reward role
    /// in small batches while generation continues. Each sample is recorded in the
    /// ledger as generated when it arrives; the rewarded samples come back in
    /// `(prompt, k)` order, as [`Self::generate`] gives them, so the rest of the step
    /// does not depend on finishing order.
    pub(crate) async fn generate_streamed(
        &self,
        step: u64,
        prompts: Vec<yatt_roles::Prompt>,
        cfg: &ControllerConfig,
        ledger: &mut SampleLedger,
    ) -> Result<Streamed, ControllerError> {
        use futures::stream::{FuturesUnordered, StreamExt};
        let t = Instant::now();
        let order: std::collections::HashMap<SampleId, usize> = prompts
            .iter()
            .flat_map(|p| {
                (0..cfg.n).map(move |k| SampleId {
                    step,
                    prompt: p.id,
                    k,
                })
            })
            .enumerate()
            .map(|(i, id)| (id, i))
            .collect();
        let group = cfg.n as usize;
        let (tx, mut rx) = tokio::sync::mpsc::channel::<Sample>(group.max(1));
        let asks: Vec<_> = self
            .split_over_replicas(step, prompts, cfg)
            .into_iter()
            .map(|(r, req)| {
                let req = RolloutRequest::GenerateStream(req, SampleSink(tx.clone()));
                self.serve(r, req, "gen", "rollout", cfg.timeouts.generate)
            })
            .collect();
        // The channel closes when every rollout has dropped its sender.
        drop(tx);
        let gen = futures::future::try_join_all(asks);
        tokio::pin!(gen);
        let mut rewards = FuturesUnordered::new();
        let mut out = Streamed {
            samples: Vec::with_capacity(order.len()),
            stats: yatt_roles::RolloutStats::default(),
            gen_s: 0.0,
            reward_tail_s: 0.0,
            early: 0,
        };
        let (mut gen_done, mut open) = (false, true);
        let mut gen_end = Instant::now();
        while !gen_done || open || !rewards.is_empty() {
            tokio::select! {
                answers = &mut gen, if !gen_done => {
                    for a in answers? {
                        match a {
                            RolloutResponse::Streamed { stats, .. } => {
                                out.stats.absorb(&stats);
                                out.stats.seconds = out.stats.seconds.max(stats.seconds);
                            }
                            other => {
                                let got = match other {
                                    RolloutResponse::Generated { .. } => "Generated",
                                    _ => "Logits"};
                                return Err(self.protocol("rollout", "GenerateStream", got.into()));
                            }
                        }
                    }
                    gen_done = true;
                    gen_end = Instant::now();
                }
                s = rx.recv(), if open => match s {
                    Some(s) => {
                        // What else has arrived goes along, up to a prompt group.
                        let mut batch = vec![s];
                        while batch.len() < group {
                            match rx.try_recv() {
                                Ok(s) => batch.push(s),
                                Err(_) => break}
                        }
                        // An id the round did not expect fails the stage's check.
                        for s in &batch {
                            ledger.record(s.id, Stage::Generated);
                        }
                        self.check_fresh(&batch)?;
                        if !gen_done {
                            out.early += batch.len();
                        }
                        rewards.push(self.serve(
                            &self.roles.reward,
                            batch,
                            "reward",
                            "reward",
                            cfg.timeouts.score,
                        ));
                    }
                    None => open = false},
                r = rewards.next(), if !rewards.is_empty() => {
                    if let Some(r) = r {
                        out.samples.extend(r?);
                    }
                }
            }
        }
        out.gen_s = gen_end.duration_since(t).as_secs_f64();
        out.reward_tail_s = gen_end.elapsed().as_secs_f64();
        out.samples
            .sort_by_key(|s| order.get(&s.id).copied().unwrap_or(usize::MAX));
        Ok(out)
    }
}
