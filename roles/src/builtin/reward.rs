//! The reward role: weighted reward functions and reward models over sample text.
//!
//! It answers a batch of samples with each sample's `reward` set to
//! `Σ weight_i · score_i(prompt text, response text, reference)`, over rule-based
//! [`RewardFn`]s (scored one sample at a time) and [`ModelScorer`]s (a scalar reward
//! model, an LLM judge, a pool of Python workers, an HTTP endpoint: scored a batch at a
//! time, told the samples' ids for their errors). A reward that cannot score a sample
//! (missing reference, unparseable judge output) fails the whole request with the
//! sample and the reward named: a silent 0 would train on a wrong signal. Per-step
//! scores (process rewards) of the first reward that gives them go to the sample's
//! `step_rewards`.

use super::reward_model::ModelScorer;
use crate::builtin::scoring::check_device;
use crate::reward::reward_fn::{RewardFn, RewardInput, RewardOutput};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use crate::sample::Sample;

/// Weighted reward functions and reward models.
pub struct RewardRole {
    parts: Vec<(f64, Box<dyn RewardFn>)>,
    models: Vec<(f64, Box<dyn ModelScorer>)>,
}

impl RewardRole {
    /// A reward role over `(weight, function)` pairs; at least one, finite weights.
    pub fn new(parts: Vec<(f64, Box<dyn RewardFn>)>) -> Result<Self, RoleError> {
        Self::with_models(parts, Vec::new())
    }

    /// A reward role over rule-based functions and reward models, each with its weight;
    /// at least one of either, finite weights.
    pub fn with_models(
        parts: Vec<(f64, Box<dyn RewardFn>)>,
        models: Vec<(f64, Box<dyn ModelScorer>)>,
    ) -> Result<Self, RoleError> {
        if parts.is_empty() && models.is_empty() {
            return Err(RoleError::BadRequest(
                "the reward role needs at least one reward function or model".into(),
            ));
        }
        let weights = parts
            .iter()
            .map(|(w, f)| (*w, f.name()))
            .chain(models.iter().map(|(w, m)| (*w, m.name())));
        for (w, name) in weights {
            if !w.is_finite() {
                return Err(RoleError::BadRequest(format!(
                    "reward {name}: weight {w} is not finite"
                )));
            }
        }
        Ok(RewardRole { parts, models })
    }
}

impl Role for RewardRole {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> ResourceProfile {
        let mut p = ResourceProfile::cpu_only();
        p.resident_bytes = self.models.iter().map(|(_, m)| m.resident_bytes()).sum();
        p
    }

    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
        for (_, m) in &self.models {
            check_device("reward", m.device(), group)?;
        }
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        let inputs: Vec<RewardInput> = samples
            .iter()
            .map(|s| RewardInput {
                prompt: s.prompt_text.clone(),
                response: s.response_text.clone(),
                reference: s.reference.clone(),
                metadata: s.metadata.clone(),
            })
            .collect();
        let labels: Vec<String> = samples.iter().map(|s| s.id.to_string()).collect();
        let mut scored: Vec<(f64, Vec<RewardOutput>)> = Vec::with_capacity(self.models.len());
        for (w, m) in self.models.iter_mut() {
            let out = m.score_samples(&labels, &inputs).map_err(|e| {
                RoleError::Failed(format!(
                    "reward {} on {} samples: {e}",
                    m.name(),
                    inputs.len()
                ))
            })?;
            if out.len() != inputs.len() {
                return Err(RoleError::Failed(format!(
                    "reward {} gave {} scores for {} samples",
                    m.name(),
                    out.len(),
                    inputs.len()
                )));
            }
            scored.push((*w, out));
        }
        for (i, (s, input)) in samples.iter_mut().zip(&inputs).enumerate() {
            let mut total = 0.0;
            let mut steps = None;
            for (w, f) in &self.parts {
                let out = f.score(input).map_err(|e| {
                    RoleError::Failed(format!("{}: reward {}: {e}", s.id, f.name()))
                })?;
                total += w * out.score;
                steps = steps.or(out.step_scores);
            }
            for (w, outs) in &scored {
                total += w * outs[i].score;
                steps = steps.or_else(|| outs[i].step_scores.clone());
            }
            s.step_rewards = steps;
            if !total.is_finite() {
                return Err(RoleError::Failed(format!(
                    "{}: the reward is {total}",
                    s.id
                )));
            }
            s.reward = Some(total);
        }
        Ok(samples)
    }
}
