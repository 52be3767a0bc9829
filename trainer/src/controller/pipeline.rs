//! Asynchronous RL (`staleness` ≥ 1): the next batches generate while the policy
//! trains this one, each sample within the staleness bound, each batch trained once.
//!
//! A batch is generated for a given step (its sample ids carry that step) and keeps
//! its own ledger until that step trains it, so the ledger accounts for every sample
//! exactly once even when it is generated in one step and trained in a later one.
//! Batches generated ahead are part of the controller's checkpointed state.

use std::sync::atomic::Ordering;
use std::time::Instant;

use yatt_metrics::names;
use yatt_placement::{lag, within_bound};
use yatt_roles::{off_policy_stats, Sample, SampleId};

use crate::controller::core::{Controller, GenBatch};
use crate::controller::error::ControllerError;
use crate::controller::report::{PendingBatch, StepMetrics, StepReport};
use crate::controller::stages::Synced;
use crate::ledger::{SampleLedger, Stage};

impl Controller {
    /// One step with generation ahead: trains the batch generated for this step (in an
    /// earlier step, or now for the first), and meanwhile generates the batches of the
    /// next steps up to `staleness` ahead with the weights the policy has now. Weight
    /// sync follows the update, so a batch generated during step n on version v trains
    /// at step n + j on version v + j, j ≤ staleness.
    pub(crate) async fn step_pipelined(&mut self) -> Result<StepReport, ControllerError> {
        let t_step = Instant::now();
        let (batch, carried) = self.take_batch().await?;
        let t_overlap = Instant::now();
        let train = async {
            let mut p = self.prepare_batch(batch, t_step).await?;
            let (train, critic, secs) = self.update(&mut p).await?;
            let synced = self.sync_beside_generation().await?;
            Ok::<_, ControllerError>((p, train, critic, secs, synced))
        };
        let (trained, generated) = tokio::join!(train, self.generate_ahead());
        let (p, train, critic, secs, synced) = trained?;
        let ahead = self.keep_ahead(generated?, t_overlap);
        let mut report = self.finish(p, train, critic, secs, synced).await?;
        self.report_pipeline(&mut report, carried, ahead);
        Ok(report)
    }

    /// With partial rollouts, the weight sync right after the update, while the next
    /// batch may still be generating: its later chunks decode on the new weights.
    pub(crate) async fn sync_beside_generation(&self) -> Result<Option<Synced>, ControllerError> {
        if self.config.partial_rollout.is_none() {
            return Ok(None);
        }
        let t = Instant::now();
        let pushed = self.push_weights().await?;
        Ok(Some(Synced {
            pushed,
            seconds: t.elapsed().as_secs_f64(),
        }))
    }

    /// The batch this step trains (generated ahead, or now for the first step) and how
    /// many of its samples were generated in an earlier step.
    pub(crate) async fn take_batch(&mut self) -> Result<(GenBatch, usize), ControllerError> {
        let batch = match self.pending.pop_front() {
            Some(b) if b.step == self.step => b,
            Some(b) => {
                return Err(ControllerError::Config(format!(
                    "the batch generated ahead is for step {}, but step {} is next: restore a checkpoint taken with this controller",
                    b.step + 1,
                    self.step_no()
                )))
            }
            None => {
                let mut b = self.gen_batch(self.step).await?;
                self.lost_rollouts.extend(b.lost.drain(..));
                b
            }
        };
        let carried = match batch.generated_at < self.step {
            true => batch.samples.len(),
            false => 0,
        };
        Ok((batch, carried))
    }

    /// Generates, one after the other, the batches of the next steps up to `staleness`
    /// ahead that are not generated yet, with the weights the rollouts hold now; and
    /// the seconds it took.
    pub(crate) async fn generate_ahead(&self) -> Result<(Vec<GenBatch>, f64), ControllerError> {
        let t = Instant::now();
        let next = self.step + 1 + self.pending.len() as u64;
        let last = self.step + u64::from(self.config.staleness);
        let mut out = Vec::new();
        for step in next..=last {
            out.push(self.gen_batch(step).await?);
        }
        Ok((out, t.elapsed().as_secs_f64()))
    }

    /// Queues the batches generated ahead; gives the seconds generation overlapped the
    /// update (which started at `since`), and the seconds it took.
    pub(crate) fn keep_ahead(
        &mut self,
        generated: (Vec<GenBatch>, f64),
        since: Instant,
    ) -> (f64, f64) {
        let (batches, gen_s) = generated;
        for mut b in batches {
            self.lost_rollouts.extend(b.lost.drain(..));
            self.pending.push_back(b);
        }
        (gen_s.min(since.elapsed().as_secs_f64()), gen_s)
    }

    /// The pipeline's metrics of a step; `ahead` is what [`Controller::keep_ahead`] gave.
    pub(crate) fn report_pipeline(
        &self,
        report: &mut StepReport,
        carried: usize,
        (overlap, gen_ahead): (f64, f64),
    ) {
        let m = &mut report.metrics;
        if self.config.partial_rollout.is_some() {
            let interrupted = report.samples.iter();
            let interrupted = interrupted.filter(|s| s.weights_version_last.is_some());
            m.set(names::SAMPLES_INTERRUPTED, interrupted.count() as f64);
        }
        m.set(names::SAMPLES_CARRIED, carried as f64);
        m.set(names::PENDING_BATCHES, self.pending.len() as f64);
        m.set(names::OVERLAP_S, overlap);
        m.set(names::GEN_AHEAD_S, gen_ahead);
    }

    /// Refuses a batch that would train beyond the staleness bound, and reports the
    /// step's lag. Versions count the policy's updates (steps), as the simulator's do;
    /// the lag of a sample is counted from the version its generation started with.
    /// Every sample of a batch started on the weights of the step that generated it
    /// ([`Controller::check_fresh`] holds at generation).
    pub(crate) fn check_staleness(
        &self,
        samples: &[Sample],
        generated_at: u64,
        m: &mut StepMetrics,
    ) -> Result<(), ControllerError> {
        let (trains, bound) = (self.step, self.config.staleness);
        if !within_bound(trains, generated_at, bound) {
            if let Some(s) = samples.first() {
                return Err(ControllerError::BeyondStaleness {
                    step: self.step_no(),
                    id: s.id,
                    started: generated_at,
                    trains,
                    bound,
                });
            }
        }
        if bound > 0 {
            let l = lag(trains, generated_at) as f64;
            m.set(names::STALENESS_MAX, l);
            m.set(names::STALENESS_MEAN, l);
        }
        Ok(())
    }

    /// The importance weights and the recomputed-vs-rollout log-prob differences of
    /// samples with old log-probs; warns once when the samples on the newest weights
    /// differ by more than `logprob_diff_warn` per token.
    pub(crate) fn off_policy_metrics(&self, samples: &[Sample], m: &mut StepMetrics) {
        let cfg = &self.config;
        let rows = |fresh: bool| {
            samples
                .iter()
                .filter(move |s| !fresh || s.weights_version == self.weights_version)
                .filter_map(|s| {
                    let old = s.old_logprobs.as_deref()?;
                    Some((old, s.rollout_logprobs.as_slice(), s.loss_mask.as_deref()))
                })
        };
        let all = off_policy_stats(rows(false), &cfg.off_policy);
        if all.tokens == 0 {
            return;
        }
        m.set(names::LOGPROB_DIFF_MEAN, all.logprob_diff_mean);
        m.set(names::LOGPROB_DIFF_MAX, all.logprob_diff_max);
        if cfg.staleness > 0 {
            m.set(names::IS_WEIGHT_MEAN, all.weight_mean);
            m.set(names::IS_WEIGHT_MAX, all.weight_max);
            m.set(names::IS_CAPPED_FRAC, all.capped_frac);
        }
        // Only samples on the newest weights tell a mismatch apart from the policy's own
        // change since the rollout's version (with staleness ≥ 1: the first step's).
        let fresh = off_policy_stats(rows(true), &cfg.off_policy);
        let bound = cfg.logprob_diff_warn;
        if bound > 0.0
            && fresh.tokens > 0
            && fresh.logprob_diff_mean > bound
            && !self.warned_mismatch.swap(true, Ordering::Relaxed)
        {
            tracing::warn!(
                step = self.step_no(),
                mean = fresh.logprob_diff_mean,
                max = fresh.logprob_diff_max,
                tokens = fresh.tokens,
                bound,
                "train/rollout log-prob mismatch: mean |old - rollout| per token {:.4} (max {:.4}) over {} tokens generated on the weights being trained, above rollout.logprob_diff_warn = {bound}; the rollout and the trainer disagree on the same weights: check the rollout's dtype, temperature and weight sync (warned once)",
                fresh.logprob_diff_mean,
                fresh.logprob_diff_max,
                fresh.tokens,
            );
        }
    }

    /// A checkpointed batch back as a batch in flight: a fresh ledger that expects its
    /// samples, generated and rewarded.
    pub(crate) fn from_pending(&self, p: PendingBatch) -> Result<GenBatch, ControllerError> {
        let mut ledger = SampleLedger::new(p.step, &self.stages());
        let ids: Vec<SampleId> = p.samples.iter().map(|s| s.id).collect();
        let step = p.step + 1;
        let err = move |source| ControllerError::Ledger { step, source };
        ledger.expect(ids.iter().copied()).map_err(err)?;
        for stage in [Stage::Generated, Stage::Rewarded] {
            ledger.record_all(&ids, stage);
            ledger.verify_stage(stage).map_err(err)?;
        }
        Ok(GenBatch {
            step: p.step,
            generated_at: p.generated_at,
            ledger,
            samples: p.samples,
            gen: p.gen,
            metrics: p.metrics,
            lost: Vec::new(),
        })
    }
}

impl GenBatch {
    /// The batch as a checkpoint keeps it.
    pub(crate) fn to_pending(&self) -> PendingBatch {
        PendingBatch {
            step: self.step,
            generated_at: self.generated_at,
            samples: self.samples.clone(),
            gen: self.gen.clone(),
            metrics: self.metrics.clone(),
        }
    }
}
