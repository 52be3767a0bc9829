//! One multi-turn episode as a pure state machine: model turns and observations are
//! appended to one response, with a loss mask (1 = the model's token, 0 = an inserted
//! one), log-probs (the rollout's for the model's tokens, 0 for inserted ones, which the
//! mask keeps out of every loss), the turn and token limits, and the episode's counters.
//!
//! No I/O: the rollout role generates, calls the environment and encodes observations,
//! and feeds the results in here; everything this decides is testable without a model.

use crate::env::api::{EnvStep, EpisodeLimits};
use crate::sample::EpisodeInfo;

/// What the episode needs after a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnOutcome {
    /// Show the environment's observation (encode it and call
    /// [`Episode::push_observation`]), then the model's next turn.
    Observe(String),
    /// The episode is over.
    Done,
}

/// A multi-turn episode in progress (see the module docs).
#[derive(Debug, Clone, PartialEq)]
pub struct Episode {
    limits: EpisodeLimits,
    tokens: Vec<i64>,
    logprobs: Vec<f32>,
    mask: Vec<u8>,
    info: EpisodeInfo,
    /// Where the model's current turn starts in `tokens`.
    turn_start: usize,
    /// The current turn started with the environment's prefix.
    prefixed: bool,
    done: bool,
}

impl Episode {
    /// An episode that has not started.
    pub fn new(limits: EpisodeLimits) -> Self {
        Episode {
            limits,
            tokens: Vec::new(),
            logprobs: Vec::new(),
            mask: Vec::new(),
            info: EpisodeInfo::default(),
            turn_start: 0,
            prefixed: false,
            done: false,
        }
    }

    /// Whether the episode is over.
    pub fn is_done(&self) -> bool {
        self.done
    }

    /// Response tokens the model may still generate in its next turn.
    pub fn remaining(&self) -> usize {
        self.limits.budget.saturating_sub(self.tokens.len())
    }

    /// Tokens the model's next turn may take: what is left, at most `max_turn_tokens`.
    pub fn turn_budget(&self) -> usize {
        match self.limits.max_turn_tokens {
            0 => self.remaining(),
            m => m.min(self.remaining()),
        }
    }

    /// The response so far (model and observation tokens).
    pub fn tokens(&self) -> &[i64] {
        &self.tokens
    }

    /// The tokens of the latest turn: the environment's prefix, if any, and the model's.
    pub fn last_turn(&self) -> &[i64] {
        &self.tokens[self.turn_start..]
    }

    /// The counters so far.
    pub fn info(&self) -> &EpisodeInfo {
        &self.info
    }

    /// The limits.
    pub fn limits(&self) -> EpisodeLimits {
        self.limits
    }

    /// Starts the model's next turn with the environment's `tokens` (see
    /// `Env::turn_prefix`), part of the turn the environment reads. Without `logprobs`
    /// they are masked out of the loss; with them (the rollout model's log-probs of
    /// these tokens) they are trained as the model's own (guidance). Returns false,
    /// ending the episode, when no token would be left for the model.
    pub fn push_turn_prefix(&mut self, tokens: &[i64], logprobs: Option<&[f32]>) -> bool {
        if tokens.len() >= self.remaining() {
            self.done = true;
            return false;
        }
        self.turn_start = self.tokens.len();
        self.prefixed = true;
        self.info.prefixed = true;
        self.tokens.extend_from_slice(tokens);
        match logprobs {
            Some(lp) => {
                debug_assert_eq!(lp.len(), tokens.len());
                self.logprobs.extend_from_slice(lp);
                self.mask.resize(self.tokens.len(), 1);
            }
            None => {
                self.logprobs.resize(self.tokens.len(), 0.0);
                self.mask.resize(self.tokens.len(), 0);
            }
        }
        true
    }

    /// Appends the model's turn (its tokens and their log-probs).
    pub fn push_model_turn(&mut self, tokens: &[i64], logprobs: &[f32]) {
        debug_assert_eq!(tokens.len(), logprobs.len());
        if !std::mem::take(&mut self.prefixed) {
            self.turn_start = self.tokens.len();
        }
        self.tokens.extend_from_slice(tokens);
        self.logprobs.extend_from_slice(logprobs);
        self.mask.resize(self.tokens.len(), 1);
        self.info.turns += 1;
    }

    /// The environment's answer to the latest turn, which took `seconds`. The episode
    /// ends when the environment says so, at the turn limit, or when no token is left
    /// for another turn; otherwise the observation is to be shown.
    pub fn apply_env_step(&mut self, step: EnvStep, seconds: f64) -> TurnOutcome {
        self.info.env_seconds += seconds;
        self.info.env_reward += step.reward;
        self.info.tool_calls += step.tool_calls;
        self.info.tool_errors += step.tool_errors;
        if step.done || self.info.turns >= self.limits.max_turns || self.remaining() == 0 {
            self.done = true;
            return TurnOutcome::Done;
        }
        TurnOutcome::Observe(step.observation)
    }

    /// Appends an encoded observation (template tokens included), masked out of the
    /// loss. When it would leave no token for the model's next turn, the episode ends
    /// instead (a turn the model cannot take is no turn); returns whether it was added.
    pub fn push_observation(&mut self, tokens: &[i64]) -> bool {
        if tokens.len() >= self.remaining() {
            self.done = true;
            return false;
        }
        self.tokens.extend_from_slice(tokens);
        self.logprobs.resize(self.tokens.len(), 0.0);
        self.mask.resize(self.tokens.len(), 0);
        self.turn_start = self.tokens.len();
        true
    }

    /// The environment failed (`why`): the episode ends with what it has.
    pub fn fail(&mut self, seconds: f64, why: String) {
        self.info.env_seconds += seconds;
        self.info.env_failed = Some(why);
        self.done = true;
    }

    /// The model's turn produced nothing more to act on (its last turn stopped at the
    /// budget with no room left): the episode ends.
    pub fn finish(&mut self) {
        self.done = true;
    }

    /// Tokens, log-probs, loss mask and counters of the finished episode.
    pub fn into_parts(self) -> (Vec<i64>, Vec<f32>, Vec<u8>, EpisodeInfo) {
        (self.tokens, self.logprobs, self.mask, self.info)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_turns: u32, budget: usize) -> EpisodeLimits {
        EpisodeLimits {
            max_turns,
            max_env_tokens: 8,
            max_turn_tokens: 0,
            budget,
        }
    }

    #[test]
    fn masks_follow_who_wrote_each_token_and_limits_end_the_episode() {
        let mut e = Episode::new(limits(3, 20));
        e.push_model_turn(&[1, 2, 3], &[-0.1, -0.2, -0.3]);
        let tool = EnvStep::tool_result("408".into(), false);
        let TurnOutcome::Observe(obs) = e.apply_env_step(tool, 0.5) else {
            panic!("the episode should go on")
        };
        assert!(obs.contains("408"));
        assert!(e.push_observation(&[9, 9]));
        assert_eq!(e.last_turn(), &[] as &[i64]);
        e.push_model_turn(&[4], &[-0.4]);
        assert_eq!(e.last_turn(), &[4]);
        let bad = EnvStep::tool_result("Error: x".into(), true);
        assert!(matches!(
            e.apply_env_step(bad, 0.25),
            TurnOutcome::Observe(_)
        ));
        assert!(e.push_observation(&[8]));
        e.push_model_turn(&[5, 6], &[-0.5, -0.6]);
        // The third turn is the last one, whatever the environment says.
        assert_eq!(
            e.apply_env_step(EnvStep::observe("more"), 0.0),
            TurnOutcome::Done
        );
        assert!(e.is_done());
        let (tokens, logprobs, mask, info) = e.into_parts();
        assert_eq!(tokens, vec![1, 2, 3, 9, 9, 4, 8, 5, 6]);
        assert_eq!(mask, vec![1, 1, 1, 0, 0, 1, 0, 1, 1]);
        assert_eq!(
            logprobs,
            vec![-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, 0.0, -0.5, -0.6]
        );
        assert_eq!(
            (
                info.turns,
                info.tool_calls,
                info.tool_errors,
                info.env_seconds
            ),
            (3, 2, 1, 0.75)
        );

        // An observation that leaves the model no token ends the episode, unmasked
        // tokens untouched; so does the environment's `done`, with its reward.
        let mut e = Episode::new(limits(5, 6));
        e.push_model_turn(&[1, 2], &[-1.0, -1.0]);
        assert!(matches!(
            e.apply_env_step(EnvStep::observe("o"), 0.0),
            TurnOutcome::Observe(_)
        ));
        assert!(!e.push_observation(&[7, 7, 7, 7]));
        assert!(e.is_done());
        assert_eq!(e.tokens(), &[1, 2]);
        let mut e = Episode::new(limits(5, 6));
        e.push_model_turn(&[1], &[-1.0]);
        assert_eq!(e.apply_env_step(EnvStep::done(1.0), 0.0), TurnOutcome::Done);
        assert_eq!(e.info().env_reward, 1.0);
    }

    #[test]
    fn a_turn_prefix_is_masked_or_trained_with_its_logprobs() {
        // Masked: the environment's tokens, no loss; the turn is prefix and model tokens.
        let mut e = Episode::new(limits(2, 20));
        assert!(!e.info().prefixed);
        assert!(e.push_turn_prefix(&[7, 8], None));
        e.push_model_turn(&[1, 2], &[-0.1, -0.2]);
        assert_eq!(e.last_turn(), &[7, 8, 1, 2]);
        assert!(e.info().prefixed);
        let (_, logprobs, mask, _) = e.into_parts();
        assert_eq!(
            (mask, logprobs),
            (vec![0, 0, 1, 1], vec![0.0, 0.0, -0.1, -0.2])
        );
        // Trained (guidance): the prefix is in the loss with the given log-probs.
        let mut e = Episode::new(limits(2, 20));
        assert!(e.push_turn_prefix(&[7, 8], Some(&[-3.0, -0.5])));
        e.push_model_turn(&[1], &[-0.1]);
        assert_eq!(e.last_turn(), &[7, 8, 1]);
        let (_, logprobs, mask, info) = e.into_parts();
        assert_eq!((mask, logprobs), (vec![1, 1, 1], vec![-3.0, -0.5, -0.1]));
        assert!(info.prefixed);
        // A prefix that leaves the model no token ends the episode, whichever way.
        let mut e = Episode::new(limits(2, 2));
        assert!(!e.push_turn_prefix(&[7, 8], Some(&[-1.0, -1.0])));
        assert!(e.is_done() && e.tokens().is_empty());
    }
}
