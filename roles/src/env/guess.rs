//! Guess-the-number: a small deterministic multi-turn game for tests and demos. The
//! environment holds a secret in `1..=range`; each turn the model's last integer is its
//! guess, answered "higher" or "lower"; the right guess ends the episode with reward 1.

use crate::data::prompt::Prompt;
use crate::env::api::{Env, EnvError, EnvStep};

/// The guess-the-number game.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GuessNumberEnv {
    secret: u32,
    range: u32,
    guesses: u32,
}

impl GuessNumberEnv {
    /// A game with `secret` in `1..=range`.
    pub fn new(secret: u32, range: u32) -> Self {
        GuessNumberEnv {
            secret: secret.clamp(1, range.max(1)),
            range: range.max(1),
            guesses: 0,
        }
    }

    /// The game of a prompt: the secret is the prompt's reference when that is an
    /// integer, else drawn from the prompt id; the range is 1..=100.
    pub fn for_prompt(p: &Prompt) -> Self {
        let range = 100;
        let secret = p
            .reference
            .as_deref()
            .and_then(|r| r.trim().parse::<u32>().ok())
            .unwrap_or((p.id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33) as u32 % range + 1);
        GuessNumberEnv::new(secret, range)
    }
}

/// The last integer in `text`, if any.
fn last_integer(text: &str) -> Option<i64> {
    let mut last = None;
    let mut cur = String::new();
    for c in text.chars().chain(std::iter::once(' ')) {
        if c.is_ascii_digit() {
            cur.push(c);
        } else if !cur.is_empty() {
            last = cur.parse::<i64>().ok().or(last);
            cur.clear();
        }
    }
    last
}

impl Env for GuessNumberEnv {
    fn reset(&mut self, _prompt: &Prompt) -> Result<String, EnvError> {
        self.guesses = 0;
        Ok(format!(
            "I am thinking of a number from 1 to {}. Guess it: answer with one number, and I will say higher or lower.",
            self.range
        ))
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
        let Some(guess) = last_integer(action) else {
            return Ok(EnvStep::observe(
                "That is not a number. Answer with one number.",
            ));
        };
        self.guesses += 1;
        let secret = i64::from(self.secret);
        Ok(match guess.cmp(&secret) {
            std::cmp::Ordering::Equal => EnvStep::done(1.0),
            std::cmp::Ordering::Less => EnvStep::observe(format!("{guess} is too low. Higher.")),
            std::cmp::Ordering::Greater => EnvStep::observe(format!("{guess} is too high. Lower.")),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bisection_wins_the_game_and_feedback_is_deterministic() {
        let p = Prompt {
            id: 3,
            text: String::new(),
            reference: Some("37".into()),
            metadata: serde_json::Value::Null,
            messages: Vec::new(),
        };
        let mut env = GuessNumberEnv::for_prompt(&p);
        assert!(env.reset(&p).unwrap().contains("1 to 100"));
        assert!(!env.step("no idea").unwrap().done);
        let (mut lo, mut hi, mut turns) = (1, 100, 0);
        loop {
            turns += 1;
            let g = (lo + hi) / 2;
            let s = env.step(&format!("My guess: {g}")).unwrap();
            if s.done {
                assert_eq!((g, s.reward), (37, 1.0));
                break;
            }
            if s.observation.contains("Higher") {
                lo = g + 1;
            } else {
                assert!(s.observation.contains("Lower"), "{}", s.observation);
                hi = g - 1;
            }
            assert!(turns < 8);
        }
        let q = Prompt {
            reference: None,
            ..p
        };
        assert_eq!(
            GuessNumberEnv::for_prompt(&q),
            GuessNumberEnv::for_prompt(&q)
        );
        assert_eq!(last_integer("a 12 b 345."), Some(345));
    }
}
