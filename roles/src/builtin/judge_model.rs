//! A generative reward model (LLM as judge) on a generation engine of its own.
//!
//! For each sample the judge prompt ([`JudgeTemplate`] over the prompt, the response and
//! a rubric) goes through the judge's codec (its chat template when it has one). Two
//! ways to score:
//! - [`JudgeMode::Generate`]: greedy generation, then [`parse_judge_output`]: the final
//!   `Score: x/10` and the per-step `Step k: s` lines (process rewards, kept on the
//!   sample). Output with no score is an error, or the configured fallback score.
//! - [`JudgeMode::DigitLogits`]: no generation; the prompt is followed by a prefilled
//!   `Score: ` and the score is the expectation over the judge's next-token
//!   distribution restricted to the digits 0–9, `Σ p(d)·d / 9`. It always gives a
//!   number (no parsing), and a graded one where greedy decoding would round.
//!
//! The judge runs inside the reward role (its own [`Generator`], on the role's
//! thread), so it works embedded and on a reward node alike.

use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use yatt_engine::score::{last_hidden, SeqBatch};
use yatt_engine::{Generator, Request, SamplingParams};

use super::reward_model::ModelScorer;
use crate::algo::{numbered_steps, vote_steps, StepVote};
use crate::builtin::rollout::TextCodec;
use crate::builtin::scoring::model_bytes;
use crate::reward::judge::{parse_judge_output, JudgeTemplate, JudgeVerdict};
use crate::reward::reward_fn::{RewardInput, RewardOutput};
use crate::role::RoleError;

/// How the judge turns its view of a sample into a score.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum JudgeMode {
    /// Greedy generation, parsed for `Step k: s` and `Score: x/y` lines.
    Generate,
    /// The expected digit after a prefilled `Score: ` (no generation, no steps).
    DigitLogits,
}

/// What to do with judge output that has no score ([`JudgeMode::Generate`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OnUnparsed {
    /// Fail the reward request, naming the sample and quoting the output.
    Error,
    /// Give the sample this score (normalised, in `[0, 1]`) and no step scores.
    Fallback(f64),
}

/// A judge's settings.
#[derive(Debug, Clone)]
pub struct JudgeConfig {
    /// The judge prompt.
    pub template: JudgeTemplate,
    /// What fills `{rubric}`.
    pub rubric: String,
    /// Most tokens the judge writes ([`JudgeMode::Generate`]).
    pub max_tokens: usize,
    /// How it scores.
    pub mode: JudgeMode,
    /// Output without a score.
    pub on_unparsed: OnUnparsed,
    /// The scale when the judge writes none ("Score: 7" is out of this).
    pub out_of: f64,
    /// What the prefilled answer starts with in [`JudgeMode::DigitLogits`].
    pub score_prefix: String,
    /// With step credit: what ends a step of the response. The judge then reads the
    /// response as numbered `Step k: …` lines, the steps the rollout marked in tokens.
    pub step_delimiter: Option<String>,
    /// Critiques per response ([`JudgeMode::Generate`]): 1 is one greedy verdict; more
    /// are sampled at `temperature`, their scores averaged and their step verdicts
    /// combined by `vote`.
    pub critiques: usize,
    /// How the critiques' step verdicts are combined.
    pub vote: StepVote,
    /// A step scored below this fails (in the votes).
    pub step_threshold: f32,
    /// Sampling temperature of the critiques when there are several.
    pub temperature: f32,
}

impl Default for JudgeConfig {
    fn default() -> Self {
        JudgeConfig {
            template: JudgeTemplate::default(),
            rubric: "Reward correct, clear and complete answers.".into(),
            max_tokens: 128,
            mode: JudgeMode::Generate,
            on_unparsed: OnUnparsed::Error,
            out_of: 10.0,
            score_prefix: "Score: ".into(),
            step_delimiter: None,
            critiques: 1,
            vote: StepVote::Majority,
            step_threshold: 0.5,
            temperature: 1.0,
        }
    }
}

/// An LLM judge over its own generator.
pub struct JudgeScorer {
    generator: Generator,
    codec: Arc<dyn TextCodec>,
    config: JudgeConfig,
    digits: Vec<i64>,
    pad_id: i64,
    name: String,
}

impl JudgeScorer {
    /// A judge over `generator` (greedy; its cache must hold the judge prompt plus
    /// `max_tokens`) reading text with `codec`. In [`JudgeMode::DigitLogits`] each digit
    /// must be one token of the codec.
    pub fn new(
        generator: Generator,
        codec: Arc<dyn TextCodec>,
        config: JudgeConfig,
        pad_id: i64,
    ) -> Result<Self, RoleError> {
        if config.max_tokens == 0 && config.mode == JudgeMode::Generate {
            return Err(RoleError::BadRequest(
                "judge max_tokens must be >= 1 to generate a verdict".into(),
            ));
        }
        if config.critiques == 0 {
            return Err(RoleError::BadRequest(
                "judge critiques must be >= 1 (1 = one greedy verdict)".into(),
            ));
        }
        if config.critiques > 1 && config.mode == JudgeMode::DigitLogits {
            return Err(RoleError::BadRequest(
                "judge critiques > 1 need judge mode \"generate\": the digit mode reads one distribution and has no critique to vote on".into(),
            ));
        }
        if config.critiques > 1 && !(config.temperature > 0.0 && config.temperature.is_finite()) {
            return Err(RoleError::BadRequest(format!(
                "judge temperature {} must be > 0 with {} critiques: greedy critiques would all agree",
                config.temperature, config.critiques
            )));
        }
        if let OnUnparsed::Fallback(f) = config.on_unparsed {
            if !(0.0..=1.0).contains(&f) {
                return Err(RoleError::BadRequest(format!(
                    "judge fallback score {f} is outside [0, 1]; scores are normalised"
                )));
            }
        }
        let mut digits = Vec::new();
        if config.mode == JudgeMode::DigitLogits {
            for d in 0..10 {
                let t = codec.encode_response(&d.to_string()).map_err(|e| {
                    RoleError::BadRequest(format!("judge: cannot encode digit {d}: {e}"))
                })?;
                match t.as_slice() {
                    [one] => digits.push(*one),
                    _ => {
                        return Err(RoleError::BadRequest(format!(
                        "judge: digit {d} is {} tokens in the judge's tokenizer, not one; use judge mode \"generate\"",
                        t.len()
                    )))
                    }
                }
            }
        }
        Ok(JudgeScorer {
            generator,
            codec,
            config,
            digits,
            pad_id,
            name: "judge".into(),
        })
    }

    /// The judge prompt's tokens for `input` (the prefilled score prefix included in
    /// [`JudgeMode::DigitLogits`]).
    pub fn prompt_tokens(&self, input: &RewardInput) -> Result<Vec<i64>, RoleError> {
        let response = match &self.config.step_delimiter {
            Some(d) => numbered_steps(&input.response, d),
            None => input.response.clone(),
        };
        let text = self
            .config
            .template
            .render(&input.prompt, &response, &self.config.rubric);
        let mut t = self.codec.encode_prompt(&text).map_err(|e| {
            RoleError::Failed(format!("judge: cannot encode the judge prompt: {e}"))
        })?;
        if self.config.mode == JudgeMode::DigitLogits {
            t.extend(
                self.codec
                    .encode_response(&self.config.score_prefix)
                    .map_err(|e| {
                        RoleError::Failed(format!("judge: cannot encode the score prefix: {e}"))
                    })?,
            );
        }
        Ok(t)
    }

    /// The judge's written verdicts, `critiques` per input (input-major): one greedy
    /// verdict, or several sampled ones, each seeded by its prompt and its number, so the
    /// same response gets the same critiques.
    pub fn verdict_texts(&mut self, inputs: &[RewardInput]) -> Result<Vec<String>, RoleError> {
        let k = self.config.critiques;
        let mut requests = Vec::with_capacity(inputs.len() * k);
        for input in inputs {
            let prompt = self.prompt_tokens(input)?;
            let seed = prompt.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &t| {
                (h ^ t as u64).wrapping_mul(0x0100_0000_01b3)
            });
            for c in 0..k {
                let params = match k {
                    1 => SamplingParams::greedy(self.config.max_tokens),
                    _ => SamplingParams {
                        temperature: self.config.temperature,
                        max_new_tokens: self.config.max_tokens,
                        seed: seed.wrapping_add(c as u64),
                        ..Default::default()
                    },
                };
                requests.push(Request {
                    id: requests.len() as u64,
                    prompt: prompt.clone(),
                    params,
                });
            }
        }
        let (done, _) = self
            .generator
            .generate(&requests)
            .map_err(|e| RoleError::Failed(format!("judge generation: {e}")))?;
        done.into_iter()
            .map(|c| {
                self.codec
                    .decode(&c.tokens)
                    .map_err(|e| RoleError::Failed(format!("judge: cannot decode its output: {e}")))
            })
            .collect()
    }

    /// One reward from a response's critiques: the mean of the scores of those that
    /// have one, and their step verdicts voted step by step. With none scored, the
    /// first critique's error (or the fallback).
    pub fn critiques_output(&self, texts: &[String]) -> Result<RewardOutput, RoleError> {
        if let [one] = texts {
            return self.verdict_output(one);
        }
        let parsed: Vec<JudgeVerdict> = texts
            .iter()
            .filter_map(|t| parse_judge_output(t, self.config.out_of).ok())
            .collect();
        if parsed.is_empty() {
            return self.verdict_output(texts.first().map_or("", String::as_str));
        }
        let steps: Vec<Vec<f32>> = parsed.iter().map(|v| v.step_scores.clone()).collect();
        let voted = vote_steps(&steps, self.config.vote, self.config.step_threshold);
        let score = parsed.iter().map(|v| v.normalized).sum::<f64>() / parsed.len() as f64;
        Ok(RewardOutput {
            score,
            step_scores: (!voted.is_empty()).then_some(voted),
            explanation: format!(
                "judge: {} of {} critiques scored, mean {score:.3}",
                parsed.len(),
                texts.len()
            ),
        })
    }

    /// Expected digit after the score prefix, `Σ p(d)·d / 9` in `[0, 1]`, per input.
    pub fn digit_scores(&self, inputs: &[RewardInput]) -> Result<Vec<f64>, RoleError> {
        let seqs: Vec<Vec<i64>> = inputs
            .iter()
            .map(|i| self.prompt_tokens(i))
            .collect::<Result<_, _>>()?;
        let model = self.generator.model();
        let dev = model.device();
        let pairs: Vec<(&[i64], &[i64])> = seqs.iter().map(|s| (s.as_slice(), &[][..])).collect();
        let batch = SeqBatch::from_pairs(&pairs, self.pad_id, dev)
            .map_err(|e| RoleError::Failed(format!("judge: {e}")))?;
        let p = tch::no_grad(|| {
            let hl = last_hidden(model, &batch);
            let digits = Tensor::from_slice(&self.digits).to_device(dev);
            // Softmax over the ten digits only: the score is conditional on a digit.
            let p = model
                .logits(&hl)
                .to_kind(Kind::Float)
                .index_select(1, &digits)
                .softmax(-1, Kind::Float);
            let d = Tensor::arange(10, (Kind::Float, dev));
            (p * d).sum_dim_intlist(1, false, Kind::Float) / 9.0
        });
        Vec::<f32>::try_from(p.to_device(Device::Cpu))
            .map(|v| v.into_iter().map(f64::from).collect())
            .map_err(|e| RoleError::Failed(format!("judge: reading scores: {e}")))
    }

    /// Turns one written verdict into a reward: the normalised score and the step
    /// scores, or the fallback (or an error) when it has no score.
    pub fn verdict_output(&self, text: &str) -> Result<RewardOutput, RoleError> {
        match parse_judge_output(text, self.config.out_of) {
            Ok(v) => Ok(RewardOutput {
                score: v.normalized,
                step_scores: (!v.step_scores.is_empty()).then_some(v.step_scores),
                explanation: format!("judge: {}/{}", v.raw_score, v.out_of),
            }),
            Err(e) => match self.config.on_unparsed {
                OnUnparsed::Error => Err(RoleError::Failed(format!(
                    "{e}; fix: raise reward.judge_max_tokens, use a judge that follows the template, set reward.judge_mode = \"logits\", or set reward.judge_on_unparsed = \"fallback\" with reward.judge_fallback_score"
                ))),
                OnUnparsed::Fallback(f) => Ok(RewardOutput {
                    score: f,
                    step_scores: None,
                    explanation: format!("judge fallback {f}: {e}"),
                }),
            },
        }
    }
}

impl ModelScorer for JudgeScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn device(&self) -> Device {
        self.generator.model().device()
    }

    fn resident_bytes(&self) -> u64 {
        model_bytes(self.generator.model())
    }

    fn score_batch(&mut self, inputs: &[RewardInput]) -> Result<Vec<RewardOutput>, RoleError> {
        match self.config.mode {
            JudgeMode::DigitLogits => Ok(self
                .digit_scores(inputs)?
                .into_iter()
                .map(|score| RewardOutput {
                    score,
                    ..Default::default()
                })
                .collect()),
            JudgeMode::Generate => {
                let texts = self.verdict_texts(inputs)?;
                texts
                    .chunks(self.config.critiques)
                    .enumerate()
                    .map(|(i, t)| {
                        self.critiques_output(t)
                            .map_err(|e| RoleError::Failed(format!("sample {i} of the batch: {e}")))
                    })
                    .collect()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::reward::RewardRole;
    use crate::builtin::rollout::TINY_CODEC;
    use crate::role::Role;
    use crate::sample::tests::sample;
    use yatt_engine::tiny_config;
    use yatt_engine::{GeneratorConfig, Llama};

    fn judge(mode: JudgeMode, on_unparsed: OnUnparsed) -> Result<JudgeScorer, RoleError> {
        let m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 2).unwrap();
        let g = Generator::new(
            m,
            GeneratorConfig {
                max_batch: 2,
                max_seq_len: 64,
                ..Default::default()
            },
        );
        let config = JudgeConfig {
            template: JudgeTemplate::new("{response}=").unwrap(),
            mode,
            on_unparsed,
            max_tokens: 4,
            ..Default::default()
        };
        JudgeScorer::new(g, Arc::new(TINY_CODEC), config, 0)
    }

    #[test]
    fn verdicts_become_scores_and_step_scores_or_say_why_not() {
        let j = judge(JudgeMode::Generate, OnUnparsed::Error).unwrap();
        let out = j
            .verdict_output("Step 1: 1\nStep 2: 0.5\nStep 3: 0/1\nScore: 6/10")
            .unwrap();
        assert!((out.score - 0.6).abs() < 1e-12);
        assert_eq!(out.step_scores, Some(vec![1.0, 0.5, 0.0]));
        let e = j.verdict_output("looks fine").unwrap_err().to_string();
        assert!(
            e.contains("looks fine") && e.contains("judge_on_unparsed"),
            "{e}"
        );
        let j = judge(JudgeMode::Generate, OnUnparsed::Fallback(0.3)).unwrap();
        let out = j.verdict_output("looks fine").unwrap();
        assert_eq!((out.score, out.step_scores), (0.3, None));
        assert!(out.explanation.contains("fallback"));
        // A fallback outside the normalised range is refused.
        let e = judge(JudgeMode::Generate, OnUnparsed::Fallback(3.0))
            .err()
            .unwrap();
        assert!(e.to_string().contains("outside [0, 1]"), "{e}");
    }

    #[test]
    fn several_critiques_are_averaged_and_their_steps_voted() {
        let mut j = judge(JudgeMode::Generate, OnUnparsed::Error).unwrap();
        j.config.critiques = 3;
        let texts = [
            "Step 1: 1\nStep 2: 0\nScore: 6/10",
            "Step 1: 1\nStep 2: 0.2\nStep 3: 0\nScore: 8/10",
            "no verdict at all",
        ]
        .map(String::from);
        let out = j.critiques_output(&texts).unwrap();
        assert!((out.score - 0.7).abs() < 1e-12, "{}", out.score);
        // Step 2 failed by both critiques that scored; step 3 by the one that reached it.
        assert_eq!(out.step_scores, Some(vec![1.0, 0.0, 0.0]));
        j.config.vote = StepVote::Intersection;
        let texts = ["Step 1: 0\nScore: 1/10", "Step 1: 1\nScore: 1/10"].map(String::from);
        assert_eq!(
            j.critiques_output(&texts).unwrap().step_scores,
            Some(vec![1.0])
        );
        let none = ["hmm", "no"].map(String::from);
        let e = j.critiques_output(&none).unwrap_err().to_string();
        assert!(e.contains("hmm"), "{e}");
        // The judge generates every critique: sampled, seeded by the prompt.
        j.config.temperature = 1.0;
        let inputs = vec![RewardInput {
            prompt: "q".into(),
            response: "ab".into(),
            ..Default::default()
        }];
        let a = j.verdict_texts(&inputs).unwrap();
        assert_eq!(a.len(), 3);
        assert_eq!(
            a,
            j.verdict_texts(&inputs).unwrap(),
            "the same response, the same critiques"
        );
    }

    #[test]
    fn with_steps_the_judge_reads_them_numbered() {
        let mut j = judge(JudgeMode::Generate, OnUnparsed::Error).unwrap();
        j.config.template = JudgeTemplate::new("{response}").unwrap();
        j.config.step_delimiter = Some("\n".into());
        let input = RewardInput {
            response: "a\n\nb".into(),
            ..Default::default()
        };
        let want = TINY_CODEC.encode_prompt("Step 1: a\nStep 2: b").unwrap();
        assert_eq!(j.prompt_tokens(&input).unwrap(), want);
        // Several critiques need something to vote on, and sampling.
        let m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 2).unwrap();
        let g = Generator::new(m, GeneratorConfig::default());
        let config = JudgeConfig {
            mode: JudgeMode::DigitLogits,
            critiques: 2,
            ..Default::default()
        };
        let e = JudgeScorer::new(g, Arc::new(TINY_CODEC), config, 0)
            .err()
            .unwrap();
        assert!(e.to_string().contains("generate"), "{e}");
    }

    /// A rule-based stand-in for a judge's per-step verdicts, to follow step scores
    /// through the reward role onto the sample.
    struct Steps;

    impl crate::reward::reward_fn::RewardFn for Steps {
        fn name(&self) -> &str {
            "steps"
        }
        fn score(
            &self,
            s: &RewardInput,
        ) -> Result<RewardOutput, crate::reward::reward_fn::RewardError> {
            Ok(RewardOutput {
                score: 1.0,
                step_scores: Some(vec![0.5; s.response.len()]),
                explanation: String::new(),
            })
        }
    }

    #[test]
    fn the_reward_role_keeps_step_scores_on_the_sample() {
        let j = judge(JudgeMode::DigitLogits, OnUnparsed::Error).unwrap();
        let mut role = RewardRole::with_models(
            vec![(1.0, Box::new(Steps))],
            vec![(2.0, Box::new(j) as Box<dyn ModelScorer>)],
        )
        .unwrap();
        let mut s = sample(1, 0, 2);
        s.response_text = "ab".into();
        let out = role.serve(vec![s]).unwrap();
        assert_eq!(out[0].step_rewards, Some(vec![0.5, 0.5]));
        // 1 from the rule, 2 × an expected digit in [0, 1] from the judge.
        let r = out[0].reward.unwrap();
        assert!((1.0..=3.0).contains(&r), "{r}");
    }
}
