//! The roles of the example, written against `yatt-roles` alone (and serde, so that a
//! peer can send their settings as the spawn arguments): a length-and-format reward,
//! and a filter that runs as an extra stage of the step.

use serde::{Deserialize, Serialize};
use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError, Sample};

/// The name the role is registered under: peers spawn it by this name.
pub const ROLE_NAME: &str = "length-format-reward";

/// Rewards responses that have the right shape: half the score for a length within
/// `min_len..=max_len` characters, half for the fraction of characters in `alphabet`.
/// Its value is its spawn arguments: a peer sends one, the node builds the role from it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LengthFormatReward {
    /// Shortest acceptable response, characters.
    pub min_len: usize,
    /// Longest acceptable response, characters.
    pub max_len: usize,
    /// Characters the format allows.
    pub alphabet: String,
}

impl LengthFormatReward {
    /// The score of one response, in `[0, 1]`.
    pub fn score(&self, response: &str) -> f64 {
        let n = response.chars().count();
        let length_ok = (self.min_len..=self.max_len).contains(&n);
        let in_format = response
            .chars()
            .filter(|c| self.alphabet.contains(*c))
            .count();
        0.5 * f64::from(u8::from(length_ok)) + 0.5 * in_format as f64 / n.max(1) as f64
    }
}

impl Role for LengthFormatReward {
    // A reward role takes the step's samples and gives them back with `reward` set:
    // that is the contract the controller expects of `reward`.
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        ROLE_NAME
    }

    fn profile(&self) -> ResourceProfile {
        // Rule-based: no device memory, so placement can put it anywhere.
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        if self.min_len > self.max_len || self.alphabet.is_empty() {
            return Err(RoleError::BadRequest(format!(
                "length-format-reward: need min_len <= max_len and a non-empty alphabet (got {}..={}, {:?})",
                self.min_len, self.max_len, self.alphabet
            )));
        }
        Ok(())
    }

    fn serve(&mut self, mut samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        for s in &mut samples {
            s.reward = Some(self.score(&s.response_text));
        }
        Ok(samples)
    }
}

/// The name the filter is registered under.
pub const FILTER_NAME: &str = "repeat-filter";

/// An extra stage after the reward: drops responses with a character repeated more
/// than `max_run` times in a row (a stand-in for a safety or quality classifier).
/// What it does not give back is never trained.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RepeatFilter {
    /// Longest run of one character a response may have.
    pub max_run: usize,
}

impl RepeatFilter {
    /// Whether `response` passes.
    pub fn keeps(&self, response: &str) -> bool {
        let (mut run, mut prev) = (0, None);
        for c in response.chars() {
            run = if Some(c) == prev { run + 1 } else { 1 };
            prev = Some(c);
            if run > self.max_run {
                return false;
            }
        }
        true
    }
}

impl Role for RepeatFilter {
    type Request = Vec<Sample>;
    type Response = Vec<Sample>;

    fn name(&self) -> &str {
        FILTER_NAME
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        if self.max_run == 0 {
            return Err(RoleError::BadRequest(
                "repeat-filter: max_run must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn serve(&mut self, samples: Vec<Sample>) -> Result<Vec<Sample>, RoleError> {
        Ok(samples
            .into_iter()
            .filter(|s| self.keeps(&s.response_text))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scores_length_and_format() {
        let r = LengthFormatReward {
            min_len: 2,
            max_len: 3,
            alphabet: "ab".into(),
        };
        assert_eq!(r.score("ab"), 1.0);
        assert_eq!(r.score("abzz"), 0.25);
        assert_eq!(r.score("zz"), 0.5);
        assert_eq!(r.score(""), 0.0);
    }

    #[test]
    fn filters_long_runs() {
        let f = RepeatFilter { max_run: 2 };
        assert!(f.keeps("aabaa"));
        assert!(!f.keeps("abbbc"));
        assert!(f.keeps(""));
    }
}
