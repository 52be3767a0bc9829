//! A step's advantages from its rewards, through the estimator registry in `yatt-roles`.

use std::collections::BTreeMap;

use tch::{Device, Kind, Tensor};
use yatt_roles::{
    apply_step_credit, centre_step_credit, group_indices, kl_estimate, masked_mean, response_mask,
    split_rows, token_matrix, AdvantageInputs, AlgoError, Sample, StepCreditConfig, TokenField,
};

use crate::controller::core::Controller;
use crate::controller::error::ControllerError;
use crate::controller::report::StepMetrics;
use yatt_metrics::names;

impl Controller {
    /// Fills in `advantages` (and the reward/KL metrics).
    pub(crate) fn advantages(
        &self,
        samples: &mut [Sample],
        m: &mut StepMetrics,
    ) -> Result<(), ControllerError> {
        let step = self.step_no();
        let se = |source| ControllerError::Sample { step, source };
        let ae = |source| ControllerError::Algo { step, source };
        let dev = Device::Cpu;
        let mask = response_mask(samples, dev).map_err(se)?;
        let scores: Vec<f32> = samples
            .iter()
            .map(|s| s.require_reward().map(|r| r as f32))
            .collect::<Result<_, _>>()
            .map_err(se)?;
        let scores = Tensor::from_slice(&scores);
        let groups = group_indices(samples);
        // Per-token KL(old ‖ ref), when a reference is there.
        let kl = if self.roles.reference.is_some() {
            let old = token_matrix(samples, TokenField::OldLogprobs, dev).map_err(se)?;
            let rf = token_matrix(samples, TokenField::RefLogprobs, dev).map_err(se)?;
            let metric = kl_estimate(&old, &rf, &mask, self.config.kl_metric).map_err(ae)?;
            m.set(names::KL, masked_mean(&metric, &mask).double_value(&[]));
            match self.config.kl_in_reward {
                Some(p) => Some((
                    kl_estimate(&old, &rf, &mask, p.estimator).map_err(ae)?,
                    p.coef,
                )),
                None => None,
            }
        } else {
            None
        };
        // Sequence rewards after the KL penalty (the outcome estimators' input).
        let rewards = match &kl {
            Some((k, coef)) => &scores - k.sum_dim_intlist(1, false, Kind::Float) * *coef,
            None => scores.shallow_clone(),
        };
        // The critic's values, for the estimators that read them (GAE).
        let gae = self.config.advantage.uses_values();
        let values = match gae {
            true => Some(token_matrix(samples, TokenField::Values, dev).map_err(se)?),
            false => None,
        };
        let adv = self
            .config
            .advantage
            .compute(&AdvantageInputs {
                scores: &scores,
                rewards: &rewards,
                mask: &mask,
                groups: &groups,
                kl: kl.as_ref().map(|(k, c)| (k, *c)),
                values: values.as_ref(),
            })
            .map_err(ae)?;
        let rows = split_rows(&adv.advantages, samples);
        let returns = split_rows(&adv.returns, samples);
        for ((s, a), r) in samples.iter_mut().zip(rows).zip(returns) {
            s.advantages = Some(a);
            if gae {
                s.returns = Some(r);
            }
        }
        if let Some(v) = &values {
            m.set(
                names::RETURNS_MEAN,
                masked_mean(&adv.returns, &mask).double_value(&[]),
            );
            m.set(names::VALUES_MEAN, masked_mean(v, &mask).double_value(&[]));
        }
        if let Some(credit) = self.config.step_credit {
            step_credit(samples, credit, m).map_err(ae)?;
        }
        // Process rewards (an LLM judge's per-step scores): their mean shows whether
        // the judge gives any.
        let steps: Vec<f32> = samples
            .iter()
            .filter_map(|s| s.step_rewards.as_deref())
            .flatten()
            .copied()
            .collect();
        if !steps.is_empty() {
            m.set(
                names::STEP_SCORES_MEAN,
                steps.iter().map(|&x| x as f64).sum::<f64>() / steps.len() as f64,
            );
        }
        episode_metrics(samples, m);
        let n = samples.len().max(1) as f64;
        m.set(
            names::SCORE_MEAN,
            scores.sum(Kind::Float).double_value(&[]) / n,
        );
        m.set(
            names::REWARDS_MEAN,
            rewards.sum(Kind::Float).double_value(&[]) / n,
        );
        m.set(
            names::ADVANTAGES_MEAN,
            masked_mean(&adv.advantages, &mask).double_value(&[]),
        );
        Ok(())
    }
}

/// CAPO-style step credit: the tokens of each step the verdicts failed lose
/// `credit.penalty` of advantage, after the estimator gave every token its outcome
/// advantage (so it composes with every estimator), and the step's metrics.
fn step_credit(
    samples: &mut [Sample],
    credit: StepCreditConfig,
    m: &mut StepMetrics,
) -> Result<(), AlgoError> {
    let (mut judged, mut mismatched, mut unjudged) = (0usize, 0usize, 0usize);
    let (mut steps, mut failed, mut penalised, mut tokens) = (0usize, 0usize, 0usize, 0usize);
    // Per prompt group: penalised tokens and tokens of its judged responses.
    let mut groups: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    let mut judged_at = Vec::new();
    for (i, s) in samples.iter_mut().enumerate() {
        let (Some(ends), Some(adv)) = (s.step_ends.as_deref(), s.advantages.as_mut()) else {
            continue;
        };
        let Some(verdicts) = s.step_rewards.as_deref() else {
            unjudged += 1;
            continue;
        };
        let out = apply_step_credit(adv, ends, verdicts, credit)?;
        if out.mismatched {
            mismatched += 1;
            continue;
        }
        judged += 1;
        steps += out.steps;
        failed += out.failed_steps;
        penalised += out.penalised_tokens;
        tokens += adv.len();
        let g = groups.entry(s.group).or_default();
        g.0 += out.penalised_tokens;
        g.1 += adv.len();
        judged_at.push(i);
    }
    if credit.centre {
        // Only the responses whose steps were judged share their group's credit.
        for i in judged_at {
            let s = &mut samples[i];
            let (p, n) = groups[&s.group];
            let back = centre_step_credit(p, n, credit.penalty);
            if let Some(adv) = s.advantages.as_mut() {
                adv.iter_mut().for_each(|a| *a += back);
            }
        }
    }
    if judged > 0 {
        m.set(names::STEP_CREDIT_STEPS, steps as f64 / judged as f64);
        m.set(
            names::STEP_CREDIT_FAILED_STEPS,
            failed as f64 / judged as f64,
        );
        m.set(
            names::STEP_CREDIT_PENALISED_SHARE,
            penalised as f64 / tokens.max(1) as f64,
        );
    }
    m.set(names::STEP_CREDIT_MISMATCHED, mismatched as f64);
    m.set(names::STEP_CREDIT_UNJUDGED, unjudged as f64);
    Ok(())
}

/// The multi-turn metrics of a step's episodes (nothing for single-turn samples).
fn episode_metrics(samples: &[Sample], m: &mut StepMetrics) {
    let episodes: Vec<_> = samples.iter().filter_map(|s| s.episode.as_ref()).collect();
    if episodes.is_empty() {
        return;
    }
    let n = episodes.len() as f64;
    let sum =
        |f: &dyn Fn(&yatt_roles::EpisodeInfo) -> f64| episodes.iter().map(|e| f(e)).sum::<f64>();
    m.set(names::ENV_TURNS_MEAN, sum(&|e| e.turns as f64) / n);
    m.set(
        names::ENV_TOOL_CALLS_MEAN,
        sum(&|e| e.tool_calls as f64) / n,
    );
    m.set(
        names::ENV_TOOL_CALL_RATE,
        sum(&|e| f64::from(e.tool_calls > 0)) / n,
    );
    let prefixed = sum(&|e| f64::from(e.prefixed));
    m.set(names::ENV_PREFIXED_SHARE, prefixed / n);
    if prefixed < n {
        let own = sum(&|e| f64::from(!e.prefixed && e.tool_calls > 0));
        m.set(names::ENV_OWN_TOOL_CALL_RATE, own / (n - prefixed));
    }
    m.set(names::ENV_TOOL_ERRORS, sum(&|e| e.tool_errors as f64));
    m.set(
        names::ENV_FAILED,
        sum(&|e| f64::from(e.env_failed.is_some())),
    );
    m.set(names::ENV_SECONDS, sum(&|e| e.env_seconds));
    m.set(names::ENV_REWARD_MEAN, sum(&|e| e.env_reward) / n);
    let (model, all) = samples.iter().fold((0usize, 0usize), |(a, b), s| {
        let own = (0..s.response_len())
            .filter(|&t| s.is_model_token(t))
            .count();
        (a + own, b + s.response_len())
    });
    m.set(
        names::ENV_MODEL_TOKEN_SHARE,
        model as f64 / all.max(1) as f64,
    );
}
