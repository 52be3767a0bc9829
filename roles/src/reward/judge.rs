//! Pure parts of a generative reward model (LLM as judge): building the judge prompt and
//! parsing the judge's output into a final score and per-step (process) scores. The
//! generation itself runs on a rollout engine and is wired up by the reward role.

use std::collections::BTreeMap;
use std::sync::OnceLock;

use regex::Regex;

use crate::reward::reward_fn::{excerpt, RewardError};

/// The default judge template. Placeholders: `{question}`, `{response}`, `{rubric}`.
pub const DEFAULT_JUDGE_TEMPLATE: &str =
    "You are a strict grader. Evaluate the response to the question below.

[Question]
{question}

[Response]
{response}

[Rubric]
{rubric}

Judge each reasoning step of the response in order. For every step write one line
\"Step k: s\" where s is between 0 and 1 (1 = correct and useful). Then write the final
line \"Score: x/10\" where x is an integer from 0 to 10.";

const PLACEHOLDERS: [&str; 3] = ["{question}", "{response}", "{rubric}"];

/// A judge prompt template with `{question}`, `{response}` and `{rubric}` placeholders.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeTemplate {
    template: String,
}

impl Default for JudgeTemplate {
    fn default() -> Self {
        Self {
            template: DEFAULT_JUDGE_TEMPLATE.to_string(),
        }
    }
}

impl JudgeTemplate {
    /// A custom template; it must contain `{response}` (the judge has to see what it grades).
    pub fn new(template: impl Into<String>) -> Result<Self, RewardError> {
        let template = template.into();
        if !template.contains("{response}") {
            return Err(RewardError::Config(
                "judge template has no {response} placeholder; add it where the graded response goes".into(),
            ));
        }
        Ok(Self { template })
    }

    /// Fills the placeholders in one pass, so text inside the question or response that
    /// looks like a placeholder is left alone.
    pub fn render(&self, question: &str, response: &str, rubric: &str) -> String {
        let mut out = String::with_capacity(
            self.template.len() + question.len() + response.len() + rubric.len(),
        );
        let mut rest = self.template.as_str();
        while let Some(i) = rest.find('{') {
            out.push_str(&rest[..i]);
            let tail = &rest[i..];
            match PLACEHOLDERS.iter().position(|p| tail.starts_with(p)) {
                Some(k) => {
                    out.push_str([question, response, rubric][k]);
                    rest = &tail[PLACEHOLDERS[k].len()..];
                }
                None => {
                    out.push('{');
                    rest = &tail[1..];
                }
            }
        }
        out.push_str(rest);
        out
    }
}

/// What a judge said.
#[derive(Debug, Clone, PartialEq)]
pub struct JudgeVerdict {
    /// The final score as written, e.g. 7 for "Score: 7/10".
    pub raw_score: f64,
    /// Its scale: the written denominator, else the caller's default.
    pub out_of: f64,
    /// `raw_score / out_of`, clamped to `[0, 1]`.
    pub normalized: f64,
    /// Per-step scores ordered by step number ("Step 2: 8/10" becomes 0.8); empty if none.
    pub step_scores: Vec<f32>,
}

const N: &str = r"-?\d+(?:\.\d+)?";

fn score_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    R.get_or_init(|| {
        Regex::new(&format!(
            r"(?im)^(.*?)(?:score|rating|grade)\s*\**\s*[:=]?\s*\**\s*({N})\s*(?:/\s*({N})|out\s+of\s+({N}))?"
        ))
        .expect("built-in pattern compiles")
    })
}

fn bracket_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    R.get_or_init(|| Regex::new(&format!(r"\[\[({N})\]\]")).expect("built-in pattern compiles"))
}

fn step_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    R.get_or_init(|| {
        Regex::new(&format!(
            r"(?im)^[\s>*\-]*step\s*(\d+)\**\s*(?:score)?\s*[:=\-–]\s*\**\s*({N})(?:\s*/\s*({N}))?"
        ))
        .expect("built-in pattern compiles")
    })
}

fn f(s: &str) -> f64 {
    s.parse::<f64>().unwrap_or(f64::NAN)
}

/// Parses judge output: the *last* "Score: x", "Score: x/y", "Rating: x out of y",
/// "**Final score:** x" (or MT-bench style "\[\[x\]\]") is the final score — lines that
/// start with "Step" are per-step scores, never the final one. `default_out_of` is the
/// scale when none is written (10 for the default template).
pub fn parse_judge_output(text: &str, default_out_of: f64) -> Result<JudgeVerdict, RewardError> {
    let no_score = || RewardError::NoJudgeScore {
        excerpt: excerpt(text, 200),
    };
    let mut found: Option<(f64, Option<f64>)> = None;
    for c in score_re().captures_iter(text) {
        if c[1]
            .trim_start_matches([' ', '*', '-', '>', '#'])
            .to_lowercase()
            .starts_with("step")
        {
            continue;
        }
        let denom = c.get(3).or(c.get(4)).map(|m| f(m.as_str()));
        found = Some((f(&c[2]), denom));
    }
    if found.is_none() {
        found = bracket_re()
            .captures_iter(text)
            .last()
            .map(|c| (f(&c[1]), None));
    }
    let (raw_score, denom) = found.ok_or_else(no_score)?;
    let out_of = denom.unwrap_or(default_out_of);
    if !raw_score.is_finite() || out_of.is_nan() || out_of <= 0.0 || !out_of.is_finite() {
        return Err(no_score());
    }
    let mut steps: BTreeMap<u64, f32> = BTreeMap::new();
    for c in step_re().captures_iter(text) {
        let (Ok(k), v) = (c[1].parse::<u64>(), f(&c[2])) else {
            continue;
        };
        let v = match c.get(3).map(|m| f(m.as_str())) {
            Some(d) if d > 0.0 => v / d,
            _ => v,
        };
        if v.is_finite() {
            steps.insert(k, v as f32);
        }
    }
    Ok(JudgeVerdict {
        raw_score,
        out_of,
        normalized: (raw_score / out_of).clamp(0.0, 1.0),
        step_scores: steps.into_values().collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_template_in_one_pass() {
        let t =
            JudgeTemplate::new("Q: {question}\nR: {response}\nRubric: {rubric} {other}").unwrap();
        let s = t.render("2+2?", "I say {rubric}", "be strict");
        assert_eq!(s, "Q: 2+2?\nR: I say {rubric}\nRubric: be strict {other}");
        let d = JudgeTemplate::default().render("QQ", "RR", "UU");
        assert!(
            d.contains("QQ") && d.contains("RR") && d.contains("UU") && d.contains("Score: x/10")
        );
        assert!(JudgeTemplate::new("no response here {question}").is_err());
    }

    #[test]
    fn parses_scores_and_steps() {
        let out =
            "Step 1: 0.8\nStep 2: 1\n- Step 3 score: 3/10\nThe work is mostly right.\nScore: 7/10";
        let v = parse_judge_output(out, 10.0).unwrap();
        assert_eq!(v.raw_score, 7.0);
        assert_eq!(v.out_of, 10.0);
        assert!((v.normalized - 0.7).abs() < 1e-12);
        assert_eq!(v.step_scores, vec![0.8, 1.0, 0.3]);

        // last score wins; markdown; "out of"; default scale
        let v = parse_judge_output("Score: 2\n**Final score:** 8 out of 10", 5.0).unwrap();
        assert_eq!((v.raw_score, v.out_of), (8.0, 10.0));
        let v = parse_judge_output("Rating: 4", 5.0).unwrap();
        assert!((v.normalized - 0.8).abs() < 1e-12);
        assert!(v.step_scores.is_empty());
        // MT-bench style
        let v = parse_judge_output("Overall good. [[9]]", 10.0).unwrap();
        assert_eq!(v.raw_score, 9.0);
        // out-of-range scores are clamped in `normalized`
        assert_eq!(
            parse_judge_output("Score: 12/10", 10.0).unwrap().normalized,
            1.0
        );
        // steps out of order, repeated: ordered by number, last wins
        let v =
            parse_judge_output("Step 2: 0.5\nStep 1: 0.1\nStep 2: 0.6\nScore: 1/2", 10.0).unwrap();
        assert_eq!(v.step_scores, vec![0.1, 0.6]);
        assert_eq!(v.normalized, 0.5);
    }

    #[test]
    fn missing_score_is_an_error() {
        let e = parse_judge_output("Step 1: 0.5\nLooks fine to me.", 10.0).unwrap_err();
        assert!(matches!(e, RewardError::NoJudgeScore { .. }), "{e}");
        assert!(e.to_string().contains("Looks fine"));
    }
}
