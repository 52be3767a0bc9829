//! Rule-based verifiers: exact numeric answer, exact string match, format (regex), and a
//! weighted combination of reward functions.

use std::sync::OnceLock;

use regex::Regex;

use crate::reward::reward_fn::{excerpt, RewardError, RewardFn, RewardInput, RewardOutput};

/// A plain number: thousands with commas, a plain integer/decimal, or a bare decimal.
const NUM: &str = r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+";

fn re(cell: &'static OnceLock<Regex>, pattern: &str) -> &'static Regex {
    // The patterns are constants of this file, checked by the unit tests.
    cell.get_or_init(|| Regex::new(pattern).expect("built-in pattern compiles"))
}

fn num_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    re(&R, &format!(r"(?:{NUM})(?:\s*/\s*(?:{NUM}))?"))
}

fn frac_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    re(&R, r"^(-?)\\d?frac\{([^{}]*)\}\{([^{}]*)\}$")
}

fn answer_is_re() -> &'static Regex {
    static R: OnceLock<Regex> = OnceLock::new();
    re(&R, r"(?i)answer\s*(?:is|:|=)")
}

fn parse_plain(s: &str) -> Option<f64> {
    s.replace(',', "").parse::<f64>().ok()
}

/// Parses one matched token: `a` or `a/b`.
fn parse_token(tok: &str) -> Option<f64> {
    match tok.split_once('/') {
        Some((a, b)) => {
            let (a, b) = (parse_plain(a.trim())?, parse_plain(b.trim())?);
            (b != 0.0).then(|| a / b)
        }
        None => parse_plain(tok),
    }
}

/// All numbers in `text`, in order. A `-` directly after a letter or digit is a hyphen
/// or a subtraction, not a sign.
fn numbers(text: &str) -> Vec<f64> {
    num_re()
        .find_iter(text)
        .filter_map(|m| {
            let mut tok = m.as_str();
            if tok.starts_with('-') {
                let prev = text[..m.start()].chars().next_back();
                if prev.is_some_and(|c| c.is_alphanumeric()) {
                    tok = &tok[1..];
                }
            }
            parse_token(tok)
        })
        .collect()
}

/// Content of the last `\boxed{...}` (balanced braces), if any.
fn last_boxed(text: &str) -> Option<&str> {
    let start = text.rfind("\\boxed{")? + "\\boxed{".len();
    let mut depth = 1usize;
    for (i, c) in text[start..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(&text[start..start + i]);
                }
            }
            _ => {}
        }
    }
    None
}

/// Parses a boxed expression: a number, `a/b`, or `\frac{a}{b}` (LaTeX spacing and `$` removed).
fn parse_boxed(content: &str) -> Option<f64> {
    let c: String = content
        .replace("\\!", "")
        .replace("\\,", "")
        .replace("\\left", "")
        .replace("\\right", "")
        .replace(['$', ' '], "");
    if let Some(caps) = frac_re().captures(&c) {
        let (a, b) = (parse_plain(&caps[2])?, parse_plain(&caps[3])?);
        let v = if b != 0.0 { a / b } else { return None };
        return Some(if &caps[1] == "-" { -v } else { v });
    }
    numbers(&c).last().copied()
}

/// Extracts the final numeric answer of a response, trying in order: the last
/// `\boxed{...}`, the text after the last `####`, the first number after the last
/// "answer is" / "answer:", and finally the last number anywhere. Handles negatives
/// (also the Unicode minus), thousands commas, decimals, `a/b` and `\frac{a}{b}`.
pub fn extract_final_number(text: &str) -> Option<f64> {
    let text = text.replace('\u{2212}', "-");
    if let Some(v) = last_boxed(&text).and_then(parse_boxed) {
        return Some(v);
    }
    if let Some(pos) = text.rfind("####") {
        if let Some(v) = numbers(&text[pos + 4..]).first() {
            return Some(*v);
        }
    }
    if let Some(m) = answer_is_re().find_iter(&text).last() {
        if let Some(v) = numbers(&text[m.end()..]).first() {
            return Some(*v);
        }
    }
    numbers(&text).last().copied()
}

/// Exact numeric answer: the response's final number (see [`extract_final_number`])
/// equals the reference within `abs_tol + rel_tol·|reference|`.
#[derive(Debug, Clone, PartialEq)]
pub struct NumericVerifier {
    /// Score when correct.
    pub correct_score: f64,
    /// Score when wrong or when the response has no number.
    pub incorrect_score: f64,
    /// Absolute tolerance.
    pub abs_tol: f64,
    /// Relative tolerance.
    pub rel_tol: f64,
}

impl Default for NumericVerifier {
    fn default() -> Self {
        Self {
            correct_score: 1.0,
            incorrect_score: 0.0,
            abs_tol: 1e-6,
            rel_tol: 1e-9,
        }
    }
}

impl NumericVerifier {
    /// Sets the scores for a correct and an incorrect answer.
    pub fn with_scores(mut self, correct: f64, incorrect: f64) -> Self {
        self.correct_score = correct;
        self.incorrect_score = incorrect;
        self
    }

    /// Parses a reference: the whole string as a number, else its final number
    /// (so GSM8K's "...#### 42" works).
    fn reference(&self, r: &str) -> Result<f64, RewardError> {
        let t = r.trim().replace(['$', ' '], "");
        parse_token(&t)
            .or_else(|| extract_final_number(r))
            .ok_or_else(|| RewardError::BadReference {
                verifier: self.name().into(),
                reference: excerpt(r, 80),
                reason: "no number in it; the numeric verifier needs a numeric reference".into(),
            })
    }
}

impl RewardFn for NumericVerifier {
    fn name(&self) -> &str {
        "numeric"
    }

    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let reference = s
            .reference
            .as_deref()
            .ok_or_else(|| RewardError::MissingReference {
                verifier: self.name().into(),
            })?;
        let want = self.reference(reference)?;
        let (score, explanation) = match extract_final_number(&s.response) {
            None => (
                self.incorrect_score,
                "no number in the response".to_string(),
            ),
            Some(got) if (got - want).abs() <= self.abs_tol + self.rel_tol * want.abs() => {
                (self.correct_score, format!("correct: {got}"))
            }
            Some(got) => (
                self.incorrect_score,
                format!("wrong: got {got}, expected {want}"),
            ),
        };
        Ok(RewardOutput {
            score,
            step_scores: None,
            explanation,
        })
    }
}

/// Exact string match of the answer with the reference, after normalisation: the
/// content of the last `<answer>...</answer>` if present (else the whole response),
/// trimmed, whitespace collapsed, spaces around commas removed, optionally lowercased.
#[derive(Debug, Clone, PartialEq)]
pub struct ExactMatchVerifier {
    /// Score when equal.
    pub correct_score: f64,
    /// Score otherwise.
    pub incorrect_score: f64,
    /// Compare case-insensitively.
    pub ignore_case: bool,
}

impl Default for ExactMatchVerifier {
    fn default() -> Self {
        Self {
            correct_score: 1.0,
            incorrect_score: 0.0,
            ignore_case: true,
        }
    }
}

fn normalise(s: &str, ignore_case: bool) -> String {
    let joined = s.split_whitespace().collect::<Vec<_>>().join(" ");
    let joined = joined.replace(" ,", ",").replace(", ", ",");
    let joined = joined.trim_end_matches('.').to_string();
    if ignore_case {
        joined.to_lowercase()
    } else {
        joined
    }
}

fn answer_block(s: &str) -> &str {
    match (s.rfind("<answer>"), s.rfind("</answer>")) {
        (Some(a), Some(b)) if a + 8 <= b => &s[a + 8..b],
        _ => s,
    }
}

impl RewardFn for ExactMatchVerifier {
    fn name(&self) -> &str {
        "exact_match"
    }

    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let reference = s
            .reference
            .as_deref()
            .ok_or_else(|| RewardError::MissingReference {
                verifier: self.name().into(),
            })?;
        let got = normalise(answer_block(&s.response), self.ignore_case);
        let want = normalise(reference, self.ignore_case);
        Ok(if got == want {
            RewardOutput {
                score: self.correct_score,
                step_scores: None,
                explanation: "exact match".into(),
            }
        } else {
            RewardOutput {
                score: self.incorrect_score,
                step_scores: None,
                explanation: format!(
                    "mismatch: got {:?}, expected {:?}",
                    excerpt(&got, 60),
                    excerpt(&want, 60)
                ),
            }
        })
    }
}

/// Format check: the response must match a regex (e.g.
/// `(?s)<think>.*</think>\s*<answer>.*</answer>`).
#[derive(Debug, Clone)]
pub struct FormatVerifier {
    pattern: String,
    regex: Regex,
    /// Score when the response matches.
    pub match_score: f64,
    /// Score when it does not.
    pub mismatch_score: f64,
}

impl FormatVerifier {
    /// Compiles `pattern`. With `full_match` the whole response (trimmed) must match,
    /// otherwise any substring may. Flags go inline, e.g. `(?s)` so `.` spans lines.
    pub fn new(pattern: &str, full_match: bool) -> Result<Self, RewardError> {
        let compiled = if full_match {
            format!(r"\A(?:{pattern})\z")
        } else {
            pattern.to_string()
        };
        let regex = Regex::new(&compiled).map_err(|e| RewardError::InvalidRegex {
            pattern: pattern.to_string(),
            source: Box::new(e),
        })?;
        Ok(Self {
            pattern: pattern.to_string(),
            regex,
            match_score: 1.0,
            mismatch_score: 0.0,
        })
    }

    /// Sets the scores for a matching and a non-matching response.
    pub fn with_scores(mut self, matched: f64, mismatched: f64) -> Self {
        self.match_score = matched;
        self.mismatch_score = mismatched;
        self
    }

    /// The pattern as given.
    pub fn pattern(&self) -> &str {
        &self.pattern
    }
}

impl RewardFn for FormatVerifier {
    fn name(&self) -> &str {
        "format"
    }

    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        Ok(if self.regex.is_match(s.response.trim()) {
            RewardOutput {
                score: self.match_score,
                step_scores: None,
                explanation: "format ok".into(),
            }
        } else {
            RewardOutput {
                score: self.mismatch_score,
                step_scores: None,
                explanation: format!("response does not match {:?}", self.pattern),
            }
        })
    }
}

/// Weighted sum of reward functions: `Σ w_i · score_i`. Step scores are taken from the
/// first component that gives them. Any component error fails the whole score.
pub struct CombinedReward {
    parts: Vec<(f64, Box<dyn RewardFn>)>,
}

impl CombinedReward {
    /// Builds the combination; needs at least one part and finite weights.
    pub fn new(parts: Vec<(f64, Box<dyn RewardFn>)>) -> Result<Self, RewardError> {
        if parts.is_empty() {
            return Err(RewardError::Config(
                "combined reward needs at least one component".into(),
            ));
        }
        if let Some((w, f)) = parts.iter().find(|(w, _)| !w.is_finite()) {
            return Err(RewardError::Config(format!(
                "weight {w} of component {:?} is not finite",
                f.name()
            )));
        }
        Ok(Self { parts })
    }
}

impl RewardFn for CombinedReward {
    fn name(&self) -> &str {
        "combined"
    }

    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let mut out = RewardOutput::default();
        let mut why = Vec::with_capacity(self.parts.len());
        for (w, f) in &self.parts {
            let r = f.score(s).map_err(|e| RewardError::Component {
                name: f.name().into(),
                source: Box::new(e),
            })?;
            out.score += w * r.score;
            if out.step_scores.is_none() {
                out.step_scores = r.step_scores;
            }
            why.push(format!("{}={}×{w} ({})", f.name(), r.score, r.explanation));
        }
        out.explanation = why.join("; ");
        Ok(out)
    }
}

/// Characters the `letters` reward likes by default: 10 of the 95 printable ones.
pub const LETTERS: &str = "abcdefghij";

/// Fraction of the response's characters that are in a target set: a trivially
/// learnable reward that a tiny random model picks up in a few dozen steps.
#[derive(Debug, Clone)]
pub struct LettersReward {
    /// The target set.
    pub letters: String,
}

impl RewardFn for LettersReward {
    fn name(&self) -> &str {
        "letters"
    }
    fn score(&self, s: &RewardInput) -> Result<RewardOutput, RewardError> {
        let n = s.response.chars().count().max(1) as f64;
        let hits = s
            .response
            .chars()
            .filter(|c| self.letters.contains(*c))
            .count() as f64;
        Ok(RewardOutput {
            score: hits / n,
            ..Default::default()
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(response: &str, reference: Option<&str>) -> RewardInput {
        RewardInput {
            prompt: "q".into(),
            response: response.into(),
            reference: reference.map(str::to_string),
            metadata: serde_json::Value::Null,
        }
    }

    #[test]
    fn extracts_final_numbers() {
        let cases: &[(&str, Option<f64>)] = &[
            ("The answer is 42.", Some(42.0)),
            (
                "First 3 then 5, so the answer is 42. Check: 7 * 6",
                Some(42.0),
            ),
            ("blah\n#### 1,234", Some(1234.0)),
            ("so we get \\boxed{42} in the end 99", Some(42.0)),
            ("\\boxed{\\frac{1}{4}}", Some(0.25)),
            ("\\boxed{-\\frac{3}{2}}", Some(-1.5)),
            ("\\boxed{1,000,000}", Some(1_000_000.0)),
            ("The temperature is -17 degrees", Some(-17.0)),
            ("minus: \u{2212}3", Some(-3.0)),
            ("Answer: $3.50", Some(3.5)),
            ("it is 3/4", Some(0.75)),
            ("x-5", Some(5.0)),
            ("We have 1,234,567 apples", Some(1_234_567.0)),
            ("no digits here", None),
            ("values .5", Some(0.5)),
        ];
        for (text, want) in cases {
            assert_eq!(extract_final_number(text), *want, "{text:?}");
        }
    }

    #[test]
    fn numeric_verifier_scores() {
        let v = NumericVerifier::default();
        assert_eq!(
            v.score(&input("The answer is 81.", Some("81")))
                .unwrap()
                .score,
            1.0
        );
        assert_eq!(
            v.score(&input("The answer is 80.", Some("81")))
                .unwrap()
                .score,
            0.0
        );
        assert_eq!(
            v.score(&input("I don't know", Some("81"))).unwrap().score,
            0.0
        );
        // GSM8K-style reference and thousands separators
        assert_eq!(
            v.score(&input("\\boxed{1234}", Some("so 1000 + 234\n#### 1,234")))
                .unwrap()
                .score,
            1.0
        );
        // tolerance: |0.3333333 − 1/3| = 3.3e-8
        assert_eq!(
            v.score(&input("0.3333333", Some("1/3"))).unwrap().score,
            1.0
        );
        let strict = NumericVerifier {
            abs_tol: 1e-9,
            rel_tol: 0.0,
            ..Default::default()
        };
        assert_eq!(
            strict
                .score(&input("0.3333333", Some("1/3")))
                .unwrap()
                .score,
            0.0
        );
        // configurable scores
        let v = NumericVerifier::default().with_scores(2.0, -1.0);
        assert_eq!(v.score(&input("7", Some("8"))).unwrap().score, -1.0);
        assert_eq!(v.score(&input("8", Some("8"))).unwrap().score, 2.0);
        // errors: no reference, non-numeric reference
        assert!(matches!(
            v.score(&input("8", None)),
            Err(RewardError::MissingReference { .. })
        ));
        let e = v
            .score(&input("8", Some("banana")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("banana"), "{e}");
    }

    #[test]
    fn exact_match() {
        let v = ExactMatchVerifier::default();
        assert_eq!(
            v.score(&input("3,5,  9", Some("3, 5, 9"))).unwrap().score,
            1.0
        );
        assert_eq!(
            v.score(&input(
                "<think>hm</think><answer> D C b a </answer>",
                Some("d c b a")
            ))
            .unwrap()
            .score,
            1.0
        );
        assert_eq!(
            v.score(&input("d c a b", Some("d c b a"))).unwrap().score,
            0.0
        );
    }

    #[test]
    fn format_verifier() {
        let f = FormatVerifier::new(r"(?s)<think>.*</think>\s*<answer>.*</answer>", true).unwrap();
        assert_eq!(
            f.score(&input("<think>a\nb</think>\n<answer>4</answer>", None))
                .unwrap()
                .score,
            1.0
        );
        assert_eq!(
            f.score(&input("<answer>4</answer>", None)).unwrap().score,
            0.0
        );
        // full match: trailing text fails; substring mode accepts it
        assert_eq!(
            f.score(&input("<think></think><answer>4</answer> extra", None))
                .unwrap()
                .score,
            0.0
        );
        let sub = FormatVerifier::new(r"(?s)<think>.*</think>\s*<answer>.*</answer>", false)
            .unwrap()
            .with_scores(0.5, -0.5);
        assert_eq!(
            sub.score(&input("<think></think><answer>4</answer> extra", None))
                .unwrap()
                .score,
            0.5
        );
        assert_eq!(sub.score(&input("nothing", None)).unwrap().score, -0.5);
        let e = FormatVerifier::new("<answer>(.*</answer>", false).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("<answer>(.*</answer>") && msg.contains("invalid regex"),
            "{msg}"
        );
    }

    #[test]
    fn combined_weighted_sum() {
        let fmt = FormatVerifier::new(r"<answer>.*</answer>", false).unwrap();
        let c = CombinedReward::new(vec![
            (1.0, Box::new(NumericVerifier::default())),
            (0.1, Box::new(fmt)),
        ])
        .unwrap();
        let r = c.score(&input("<answer>42</answer>", Some("42"))).unwrap();
        assert!((r.score - 1.1).abs() < 1e-12, "{r:?}");
        assert!(
            r.explanation.contains("numeric=1") && r.explanation.contains("format=1"),
            "{}",
            r.explanation
        );
        let r = c.score(&input("41", Some("42"))).unwrap();
        assert_eq!(r.score, 0.0);
        let e = c.score(&input("41", None)).unwrap_err().to_string();
        assert!(e.contains("numeric") && e.contains("reference"), "{e}");
        assert!(CombinedReward::new(vec![]).is_err());
        assert!(
            CombinedReward::new(vec![(f64::NAN, Box::new(NumericVerifier::default()))]).is_err()
        );
    }
}
