//! CAPO-style step credit (Xie et al., arXiv 2508.02298): a judge's verdict on each
//! reasoning step of a response becomes token-level credit.
//!
//! Steps are the response's pieces after splitting it at a delimiter (a newline by
//! default); a piece that is only whitespace joins the step before it, so the judge,
//! the rollout's token spans and a user's Python reward all count the same steps
//! (`[l for l in text.split("\n") if l.strip()]`). Every response token keeps the
//! outcome advantage its estimator gave it; the tokens of a step the judge failed
//! lose `penalty` more. The penalty is smaller than a typical outcome advantage, so
//! the split stays asymmetric as in the paper: a right answer reached through a
//! wrong step still scores above a wrong answer, and a wrong step costs the tokens
//! that wrote it, not the whole response.
//!
//! Several critiques of one response are combined per step by a [`StepVote`].

use std::ops::Range;

use serde::{Deserialize, Serialize};

use super::checks::AlgoError;

/// How several critiques of one response are combined, step by step.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, schemars::JsonSchema,
)]
#[serde(rename_all = "kebab-case")]
pub enum StepVote {
    /// A step fails when more than half of the critiques that judged it failed it.
    #[default]
    Majority,
    /// A step fails only when every critique that judged it failed it (fewest false
    /// alarms).
    Intersection,
    /// The step's score is the mean of the critiques' scores.
    Average,
}

/// Step credit's settings.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepCreditConfig {
    /// Subtracted from the advantage of every token of a failed step (> 0).
    pub penalty: f32,
    /// A step whose score is below this fails.
    pub threshold: f32,
    /// Centre the credit within each prompt group ([`centre_step_credit`]): the
    /// penalties' group mean per token is given back to every token of the group, so
    /// the credit only ranks steps against each other and never rewards writing less.
    pub centre: bool,
}

/// What step credit did to one response.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepCreditOutcome {
    /// Steps the response has.
    pub steps: usize,
    /// Steps that failed.
    pub failed_steps: usize,
    /// Tokens whose advantage was lowered.
    pub penalised_tokens: usize,
    /// The verdicts did not number the response's steps (none applied).
    pub mismatched: bool,
}

/// The steps of `text`: byte ranges that together cover it, each ending just after a
/// `delimiter` (the last one at the end of the text). A piece that is only whitespace
/// joins the step before it (at the start, the step after it). Empty for a text with
/// nothing but whitespace, or an empty delimiter's text (no split: one step).
pub fn step_spans(text: &str, delimiter: &str) -> Vec<Range<usize>> {
    let mut pieces = Vec::new();
    let mut start = 0;
    if !delimiter.is_empty() {
        while let Some(i) = text[start..].find(delimiter) {
            let end = start + i + delimiter.len();
            pieces.push(start..end);
            start = end;
        }
    }
    if start < text.len() {
        pieces.push(start..text.len());
    }
    let mut steps: Vec<Range<usize>> = Vec::new();
    let mut leading = None;
    for p in pieces {
        if text[p.clone()].trim().is_empty() {
            match steps.last_mut() {
                Some(last) => last.end = p.end,
                None => leading = Some(leading.unwrap_or(p.start)),
            }
        } else {
            steps.push(leading.take().unwrap_or(p.start)..p.end);
        }
    }
    steps
}

/// The steps of `text` as the judge reads them: `Step 1: …` lines, each step's text
/// without its delimiter and surrounding whitespace.
pub fn numbered_steps(text: &str, delimiter: &str) -> String {
    step_spans(text, delimiter)
        .into_iter()
        .enumerate()
        .map(|(k, r)| format!("Step {}: {}", k + 1, text[r].trim()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Where each step of a response ends, in tokens (exclusive), from each token's own
/// decoded text: a token belongs to the step its first byte falls in. Step `k` is the
/// tokens `ends[k-1]..ends[k]`; the last end is the token count.
pub fn step_token_ends(token_texts: &[String], delimiter: &str) -> Vec<u32> {
    let mut text = String::new();
    let mut starts = Vec::with_capacity(token_texts.len());
    for t in token_texts {
        starts.push(text.len());
        text.push_str(t);
    }
    let spans = step_spans(&text, delimiter);
    let last = spans.len().saturating_sub(1);
    spans
        .iter()
        .enumerate()
        .map(|(k, span)| match k == last {
            true => token_texts.len() as u32,
            false => starts.partition_point(|&s| s < span.end) as u32,
        })
        .collect()
}

/// One score per step from several critiques, each a list of step scores in `[0, 1]`
/// (a critique that stopped early abstains on the steps it did not reach). Majority and
/// intersection give 0 (failed) or 1; average gives the mean.
pub fn vote_steps(critiques: &[Vec<f32>], vote: StepVote, threshold: f32) -> Vec<f32> {
    let steps = critiques.iter().map(Vec::len).max().unwrap_or(0);
    (0..steps)
        .map(|k| {
            let scores: Vec<f32> = critiques.iter().filter_map(|c| c.get(k).copied()).collect();
            let failing = scores.iter().filter(|&&s| s < threshold).count();
            let pass = |failed: bool| if failed { 0.0 } else { 1.0 };
            match vote {
                StepVote::Majority => pass(2 * failing > scores.len()),
                StepVote::Intersection => pass(failing == scores.len()),
                StepVote::Average => scores.iter().sum::<f32>() / scores.len() as f32,
            }
        })
        .collect()
}

/// Lowers the advantage of every token of each failed step by `config.penalty`.
/// `step_ends` are [`step_token_ends`]; `step_scores` the judge's, one per step. When the
/// verdicts do not number the response's steps, nothing is applied: a step credit that
/// may point at the wrong tokens is worse than none.
pub fn apply_step_credit(
    advantages: &mut [f32],
    step_ends: &[u32],
    step_scores: &[f32],
    config: StepCreditConfig,
) -> Result<StepCreditOutcome, AlgoError> {
    let mut outcome = StepCreditOutcome {
        steps: step_ends.len(),
        ..Default::default()
    };
    let mut start = 0usize;
    for &end in step_ends {
        let end = end as usize;
        if end < start || end > advantages.len() {
            return Err(AlgoError::StepEnds {
                ends: step_ends.to_vec(),
                tokens: advantages.len(),
            });
        }
        start = end;
    }
    if step_scores.len() != step_ends.len() {
        outcome.mismatched = true;
        return Ok(outcome);
    }
    let mut start = 0usize;
    for (&end, &score) in step_ends.iter().zip(step_scores) {
        let end = end as usize;
        if score < config.threshold {
            outcome.failed_steps += 1;
            outcome.penalised_tokens += end - start;
            for a in &mut advantages[start..end] {
                *a -= config.penalty;
            }
        }
        start = end;
    }
    Ok(outcome)
}

/// Gives every token of a prompt group the group's mean step penalty per token back:
/// `penalised` of the group's `tokens` lost `penalty` each, so
/// `credit = penalty · penalised / tokens` is added to all of the group's tokens.
/// Without it, a group whose outcomes are all equal (zero outcome advantage) trains on
/// penalties alone, and a policy escapes them by writing fewer checkable steps; centred,
/// a failed step's tokens lose `penalty − credit` and every other token gains `credit`.
pub fn centre_step_credit(penalised: usize, tokens: usize, penalty: f32) -> f32 {
    match tokens {
        0 => 0.0,
        n => penalty * penalised as f32 / n as f32,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(t: &[&str]) -> Vec<String> {
        t.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn steps_split_after_each_delimiter_and_whitespace_joins_a_neighbour() {
        let t = "\n12+30=42\n\n42+5=47\nAnswer: 47";
        let spans = step_spans(t, "\n");
        let pieces: Vec<&str> = spans.iter().map(|r| &t[r.clone()]).collect();
        assert_eq!(pieces, ["\n12+30=42\n\n", "42+5=47\n", "Answer: 47"]);
        assert_eq!(
            numbered_steps(t, "\n"),
            "Step 1: 12+30=42\nStep 2: 42+5=47\nStep 3: Answer: 47"
        );
        assert!(step_spans(" \n \n", "\n").is_empty());
        assert_eq!(step_spans("one step", ""), vec![0..8]);
        // What a Python reward counts: the non-blank lines.
        let lines = t.split('\n').filter(|l| !l.trim().is_empty()).count();
        assert_eq!(lines, spans.len());
    }

    #[test]
    fn token_ends_follow_the_first_byte_of_each_token() {
        let toks = texts(&[
            "12", "+", "30", "=", "42", "\n", "42", "+5", "=", "47\n", "A", ": 47",
        ]);
        assert_eq!(step_token_ends(&toks, "\n"), vec![6, 10, 12]);
        // A token that carries the delimiter and the next step's start stays in the
        // step its first byte is in.
        let toks = texts(&["a", "\nb", "\n"]);
        assert_eq!(step_token_ends(&toks, "\n"), vec![2, 3]);
        assert!(step_token_ends(&[], "\n").is_empty());
    }

    #[test]
    fn votes_combine_critiques_per_step() {
        let c = vec![vec![1.0, 0.0, 0.0], vec![1.0, 0.0, 1.0], vec![0.0, 1.0]];
        assert_eq!(vote_steps(&c, StepVote::Majority, 0.5), vec![1.0, 0.0, 1.0]);
        assert_eq!(
            vote_steps(&c, StepVote::Intersection, 0.5),
            vec![1.0, 1.0, 1.0]
        );
        let avg = vote_steps(&c, StepVote::Average, 0.5);
        assert!(
            (avg[0] - 2.0 / 3.0).abs() < 1e-6 && avg[2] == 0.5,
            "{avg:?}"
        );
        assert!(vote_steps(&[], StepVote::Majority, 0.5).is_empty());
    }

    #[test]
    fn only_the_failed_steps_tokens_lose_the_penalty() {
        let cfg = StepCreditConfig {
            penalty: 0.5,
            threshold: 0.5,
            centre: false,
        };
        let mut adv = vec![1.0f32; 7];
        let out = apply_step_credit(&mut adv, &[2, 5, 7], &[1.0, 0.2, 0.9], cfg).unwrap();
        assert_eq!(adv, vec![1.0, 1.0, 0.5, 0.5, 0.5, 1.0, 1.0]);
        assert_eq!(
            out,
            StepCreditOutcome {
                steps: 3,
                failed_steps: 1,
                penalised_tokens: 3,
                mismatched: false
            }
        );
        // Verdicts for another number of steps: nothing applied, and said.
        let mut adv = vec![1.0f32; 7];
        let out = apply_step_credit(&mut adv, &[2, 5, 7], &[0.0, 0.0], cfg).unwrap();
        assert!(out.mismatched && adv.iter().all(|&a| a == 1.0));
        assert!(apply_step_credit(&mut adv, &[5, 2], &[0.0, 0.0], cfg).is_err());
        assert!(apply_step_credit(&mut adv, &[9], &[0.0], cfg).is_err());
    }

    #[test]
    fn centring_gives_the_group_its_mean_penalty_back() {
        // 3 of 10 tokens penalised by 0.5: every token gets 0.15 back, so the group's
        // credit sums to zero.
        let credit = centre_step_credit(3, 6 + 4, 0.5);
        assert!((credit - 0.15).abs() < 1e-6);
        let total = 3.0 * (credit - 0.5) + 7.0 * credit;
        assert!(total.abs() < 1e-6);
        assert_eq!(centre_step_credit(0, 0, 0.5), 0.0);
    }
}
