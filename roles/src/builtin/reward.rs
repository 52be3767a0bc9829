//! The reward role: weighted rule-based reward functions over sample text.
//!
//! It answers a batch of samples with each sample's `reward` set to
//! `Σ weight_i · score_i(prompt text, response text, reference)`. A reward function that
//! cannot score a sample (missing reference, bad config) fails the whole request with
//! the sample and the function named: a silent 0 would train on a wrong signal.

use crate::reward::{RewardFn, RewardInput};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError};
use crate::sample::Sample;

/// Weighted reward functions.
pub struct RewardRole {
    parts: Vec<(f64, Box<dyn RewardFn>)>,
}

impl RewardRole {
    /// A reward role over `(weight, function)` pairs; at least one, finite weights.
    pub fn new(parts: Vec<(f64, Box<dyn RewardFn>)>) -> Result<Self, RoleError> {
        if parts.is_empty() {
            return Err(RoleError::BadRequest(
                "the reward role needs at least one reward function".into(),
            ));
        }
        if let Some((w, f)) = parts.iter().find(|(w, _)| !w.is_finite()) {
            return Err(RoleError::BadRequest(format!(
                "reward function {}: weight {w} is not finite",
                f.name()
            )));
        }
        Ok(RewardRole { parts })
    }
}

impl Role for RewardRole {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        "reward"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        for s in samples.iter_mut() {
            let input = RewardInput {
                prompt: s.prompt_text.clone(),
                response: s.response_text.clone(),
                reference: s.reference.clone(),
                metadata: s.metadata.clone(),
            };
            let mut total = 0.0;
            for (w, f) in &self.parts {
                let out = f.score(&input).map_err(|e| {
                    RoleError::Failed(format!("{}: reward {}: {e}", s.id, f.name()))
                })?;
                total += w * out.score;
            }
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
