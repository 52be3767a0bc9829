//! Scalar reward models: a backbone with a `score` head (HF
//! `LlamaForSequenceClassification` layout) that reads prompt + response and gives one
//! number, the head's output at the last token.
//!
//! The text goes through the same codec as the rollout's prompts (tokenizer and chat
//! template), then the response text after it, so the model scores what the policy
//! produced. [`ScalarRewardModel`] is a [`ModelScorer`] the reward role runs next to
//! its rule-based functions; [`train_reward_model`] makes one from a small set of
//! scored samples or preference pairs (save it with
//! `yatt_engine::checkpoint::save_pretrained`).

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tch::{Device, Kind, Tensor};
use yatt_engine::score::{rewards, SeqBatch};
use yatt_engine::{Llama, StepStats, TrainConfig, Trainer};

use crate::builtin::rollout::TextCodec;
use crate::builtin::scoring::model_bytes;
use crate::reward::reward_fn::{RewardInput, RewardOutput};
use crate::role::RoleError;

/// The HF name prefix of a reward head.
pub const REWARD_HEAD: &str = "score";

/// A model-backed reward the reward role runs on a whole batch at once (a scalar reward
/// model, an LLM judge). Runs on the reward role's thread; may block.
pub trait ModelScorer: Send {
    /// A short name for errors and logs.
    fn name(&self) -> &str;
    /// The device the model lives on (by default the CPU: a scorer with no model).
    fn device(&self) -> Device {
        Device::Cpu
    }
    /// Device memory the model holds, bytes (by default none).
    fn resident_bytes(&self) -> u64 {
        0
    }
    /// One output per input, in order. An `Err` fails the reward request: never a
    /// silent default score.
    fn score_batch(&mut self, inputs: &[RewardInput]) -> Result<Vec<RewardOutput>, RoleError>;
    /// [`score_batch`](Self::score_batch) with each input's label (its sample id) for
    /// errors and logs; one label per input. By default the labels are not used.
    fn score_samples(
        &mut self,
        labels: &[String],
        inputs: &[RewardInput],
    ) -> Result<Vec<RewardOutput>, RoleError> {
        let _ = labels;
        self.score_batch(inputs)
    }
}

/// Why a reward model could not be loaded, used or trained.
#[derive(Debug, thiserror::Error)]
pub enum RewardModelError {
    /// The directory does not exist or holds no model.
    #[error("reward model {dir}: {reason}; fix: point it at an HF directory with config.json and model.safetensors (train one with `yatt reward-model` or yatt_roles::train_reward_model)")]
    MissingModel {
        /// The directory.
        dir: PathBuf,
        /// What is missing.
        reason: String,
    },
    /// The model has no reward head.
    #[error("reward model {what} has no reward head (`score.weight`){found}; fix: train one with `yatt reward-model` (or attach one with Llama::attach_head(\"score\"), train it with train_reward_model and save it with save_pretrained)")]
    NoHead {
        /// The directory or model.
        what: String,
        /// What head it has instead, if any.
        found: String,
    },
    /// The engine failed (loading, forward, optimizer step).
    #[error("reward model {what}: {source}")]
    Engine {
        /// The directory or operation.
        what: String,
        /// The engine's error.
        #[source]
        source: yatt_engine::EngineError,
    },
    /// The codec could not encode a text.
    #[error("reward model: cannot encode {what}: {reason}")]
    Encode {
        /// Which text.
        what: String,
        /// The codec's message.
        reason: String,
    },
    /// The training set or settings cannot work.
    #[error("reward model training: {0}")]
    Training(String),
    /// A line of a training-set file is not a usable example.
    #[error("{path}:{line}: {reason}; fix: each line is {{\"prompt\", \"response\", \"score\"}} or {{\"prompt\", \"chosen\", \"rejected\"}}")]
    Data {
        /// The file.
        path: PathBuf,
        /// 1-based line number (0: the file itself).
        line: usize,
        /// What is wrong.
        reason: String,
    },
}

/// A backbone with a scalar reward head, and the codec its text goes through.
pub struct ScalarRewardModel {
    model: Llama,
    codec: Arc<dyn TextCodec>,
    pad_id: i64,
    micro: usize,
    name: String,
}

impl ScalarRewardModel {
    /// A reward model over `model`, which must have a `score` head; `micro` is the most
    /// sequences per forward call.
    pub fn new(
        mut model: Llama,
        codec: Arc<dyn TextCodec>,
        pad_id: i64,
        micro: usize,
    ) -> Result<Self, RewardModelError> {
        check_head(&model, "given")?;
        model.set_requires_grad(false);
        Ok(ScalarRewardModel {
            model,
            codec,
            pad_id,
            micro: micro.max(1),
            name: "reward-model".into(),
        })
    }

    /// Loads the HF directory `dir` (f32, on `device`).
    pub fn load(
        dir: &Path,
        device: Device,
        codec: Arc<dyn TextCodec>,
        pad_id: i64,
        micro: usize,
    ) -> Result<Self, RewardModelError> {
        let model = load_model(dir, device)?;
        check_head(&model, &dir.display().to_string())?;
        let mut rm = Self::new(model, codec, pad_id, micro)?;
        rm.name = format!("reward-model {}", dir.display());
        Ok(rm)
    }

    /// The model.
    pub fn model(&self) -> &Llama {
        &self.model
    }

    /// The token ids the model reads for `input`: the prompt as the rollout encodes it,
    /// then the response text.
    pub fn tokens(&self, input: &RewardInput) -> Result<Vec<i64>, RewardModelError> {
        encode_pair(&*self.codec, &input.prompt, &input.response)
    }

    /// The reward of each input (no gradients).
    pub fn score(&self, inputs: &[RewardInput]) -> Result<Vec<f64>, RewardModelError> {
        let seqs: Vec<Vec<i64>> = inputs
            .iter()
            .map(|i| self.tokens(i))
            .collect::<Result<_, _>>()?;
        let mut out = Vec::with_capacity(seqs.len());
        for chunk in seqs.chunks(self.micro) {
            let r = tch::no_grad(|| sequence_rewards(&self.model, chunk, self.pad_id)).map_err(
                |source| RewardModelError::Engine {
                    what: format!("scoring {} samples", chunk.len()),
                    source,
                },
            )?;
            out.extend(
                Vec::<f32>::try_from(r.to_device(Device::Cpu))
                    .map_err(|e| RewardModelError::Training(format!("reading scores: {e}")))?
                    .into_iter()
                    .map(f64::from),
            );
        }
        Ok(out)
    }
}

impl ModelScorer for ScalarRewardModel {
    fn name(&self) -> &str {
        &self.name
    }

    fn device(&self) -> Device {
        self.model.device()
    }

    fn resident_bytes(&self) -> u64 {
        model_bytes(&self.model)
    }

    fn score_batch(&mut self, inputs: &[RewardInput]) -> Result<Vec<RewardOutput>, RoleError> {
        let scores = self
            .score(inputs)
            .map_err(|e| RoleError::Failed(e.to_string()))?;
        Ok(scores
            .into_iter()
            .map(|score| RewardOutput {
                score,
                ..Default::default()
            })
            .collect())
    }
}

/// Loads an HF model directory as f32 on `device`, naming the directory in errors.
pub fn load_model(dir: &Path, device: Device) -> Result<Llama, RewardModelError> {
    if !dir.join("config.json").is_file() {
        return Err(RewardModelError::MissingModel {
            dir: dir.into(),
            reason: if dir.is_dir() {
                "the directory has no config.json".into()
            } else {
                "no such directory".into()
            },
        });
    }
    Llama::load(dir, device, Kind::Float).map_err(|source| RewardModelError::Engine {
        what: dir.display().to_string(),
        source,
    })
}

fn check_head(model: &Llama, what: &str) -> Result<(), RewardModelError> {
    match &model.head {
        Some(h) if h.prefix == REWARD_HEAD => Ok(()),
        other => Err(RewardModelError::NoHead {
            what: what.into(),
            found: other
                .as_ref()
                .map(|h| format!(" (it has a `{}` head: a critic's value head)", h.prefix))
                .unwrap_or_default(),
        }),
    }
}

/// Prompt tokens as the rollout encodes them, then the response text's tokens.
pub(crate) fn encode_pair(
    codec: &dyn TextCodec,
    prompt: &str,
    response: &str,
) -> Result<Vec<i64>, RewardModelError> {
    let mut t = codec
        .encode_prompt(prompt)
        .map_err(|reason| RewardModelError::Encode {
            what: format!("prompt {:?}", crate::reward::reward_fn::excerpt(prompt, 40)),
            reason,
        })?;
    t.extend(
        codec
            .encode_response(response)
            .map_err(|reason| RewardModelError::Encode {
                what: format!(
                    "response {:?}",
                    crate::reward::reward_fn::excerpt(response, 40)
                ),
                reason,
            })?,
    );
    if t.is_empty() {
        return Err(RewardModelError::Encode {
            what: "an empty prompt and response".into(),
            reason: "no tokens to score".into(),
        });
    }
    Ok(t)
}

/// The reward head's output `[B]` at each sequence's last token.
fn sequence_rewards(model: &Llama, seqs: &[Vec<i64>], pad_id: i64) -> yatt_engine::Result<Tensor> {
    // The whole sequence is one "prompt": `rewards` reads the last real token.
    let pairs: Vec<(&[i64], &[i64])> = seqs.iter().map(|s| (s.as_slice(), &[][..])).collect();
    let batch = SeqBatch::from_pairs(&pairs, pad_id, model.device())?;
    rewards(model, &batch)
}

/// One example a reward model learns from.
#[derive(Debug, Clone, PartialEq)]
pub enum RmExample {
    /// A response and the score the model should give it (squared error).
    Scored {
        /// The prompt.
        prompt: String,
        /// The response.
        response: String,
        /// Its target score.
        target: f64,
    },
    /// Two responses to one prompt, the first preferred (Bradley–Terry:
    /// `-log σ(r_chosen - r_rejected)`).
    Pair {
        /// The prompt.
        prompt: String,
        /// The preferred response.
        chosen: String,
        /// The other response.
        rejected: String,
    },
}

/// Reads a JSONL training set: one example a line, `{"prompt", "response", "score"}`
/// (regression) or `{"prompt", "chosen", "rejected"}` (preference pair); blank lines
/// are skipped.
pub fn load_rm_jsonl(path: &Path) -> Result<Vec<RmExample>, RewardModelError> {
    let bad = |line: usize, reason: String| RewardModelError::Data {
        path: path.into(),
        line,
        reason,
    };
    let text = std::fs::read_to_string(path).map_err(|e| bad(0, format!("cannot read: {e}")))?;
    let mut out = Vec::new();
    for (i, l) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let v: serde_json::Value =
            serde_json::from_str(l).map_err(|e| bad(i + 1, format!("not JSON: {e}")))?;
        let s = |k: &str| {
            v.get(k)
                .and_then(serde_json::Value::as_str)
                .map(String::from)
        };
        let prompt = s("prompt").ok_or_else(|| bad(i + 1, "no \"prompt\" string".into()))?;
        let ex = match (s("response"), s("chosen"), s("rejected")) {
            (Some(response), None, None) => RmExample::Scored {
                prompt,
                response,
                target: v
                    .get("score")
                    .and_then(serde_json::Value::as_f64)
                    .filter(|x| x.is_finite())
                    .ok_or_else(|| bad(i + 1, "\"response\" needs a finite \"score\"".into()))?,
            },
            (None, Some(chosen), Some(rejected)) => RmExample::Pair {
                prompt,
                chosen,
                rejected,
            },
            _ => return Err(bad(
                i + 1,
                "expected either \"response\" (with \"score\") or both \"chosen\" and \"rejected\""
                    .into(),
            )),
        };
        out.push(ex);
    }
    if out.is_empty() {
        return Err(bad(0, "no examples".into()));
    }
    Ok(out)
}

/// How [`train_reward_model`] trains.
#[derive(Debug, Clone)]
pub struct RmTrainConfig {
    /// Optimizer steps.
    pub steps: usize,
    /// Examples per step (drawn in order, wrapping around the set).
    pub batch: usize,
    /// AdamW settings (learning rate, clipping, seed).
    pub optim: TrainConfig,
    /// Padding id.
    pub pad_id: i64,
}

impl Default for RmTrainConfig {
    fn default() -> Self {
        RmTrainConfig {
            steps: 100,
            batch: 32,
            optim: TrainConfig {
                lr: 1e-3,
                ..Default::default()
            },
            pad_id: 0,
        }
    }
}

/// The loss of one batch of examples: mean squared error over the scored ones plus the
/// mean Bradley–Terry loss over the pairs.
pub fn reward_model_loss(
    model: &Llama,
    codec: &dyn TextCodec,
    examples: &[RmExample],
    pad_id: i64,
) -> Result<Tensor, RewardModelError> {
    let mut seqs = Vec::new();
    let (mut targets, mut scored, mut pairs) = (Vec::new(), Vec::new(), Vec::new());
    for e in examples {
        match e {
            RmExample::Scored {
                prompt,
                response,
                target,
            } => {
                scored.push(seqs.len() as i64);
                targets.push(*target as f32);
                seqs.push(encode_pair(codec, prompt, response)?);
            }
            RmExample::Pair {
                prompt,
                chosen,
                rejected,
            } => {
                pairs.push((seqs.len() as i64, seqs.len() as i64 + 1));
                seqs.push(encode_pair(codec, prompt, chosen)?);
                seqs.push(encode_pair(codec, prompt, rejected)?);
            }
        }
    }
    if seqs.is_empty() {
        return Err(RewardModelError::Training("an empty batch".into()));
    }
    let dev = model.device();
    let r = sequence_rewards(model, &seqs, pad_id).map_err(|source| RewardModelError::Engine {
        what: "forward".into(),
        source,
    })?;
    let mut loss = Tensor::zeros([], (Kind::Float, dev));
    if !scored.is_empty() {
        let got = r.index_select(0, &Tensor::from_slice(&scored).to_device(dev));
        let want = Tensor::from_slice(&targets).to_device(dev);
        loss = loss + (got - want).square().mean(Kind::Float);
    }
    if !pairs.is_empty() {
        let (c, j): (Vec<i64>, Vec<i64>) = pairs.into_iter().unzip();
        let rc = r.index_select(0, &Tensor::from_slice(&c).to_device(dev));
        let rj = r.index_select(0, &Tensor::from_slice(&j).to_device(dev));
        loss = loss - (rc - rj).log_sigmoid().mean(Kind::Float);
    }
    Ok(loss)
}

/// Trains `model` as a reward model on `examples` (attaching a zero `score` head when it
/// has none; backbone and head both train) and returns it with each step's loss.
/// Save it with `yatt_engine::checkpoint::save_pretrained` and point
/// `reward.model` at the directory.
pub fn train_reward_model(
    mut model: Llama,
    codec: &dyn TextCodec,
    examples: &[RmExample],
    config: &RmTrainConfig,
) -> Result<(Llama, Vec<StepStats>), RewardModelError> {
    if examples.is_empty() || config.batch == 0 || config.steps == 0 {
        return Err(RewardModelError::Training(format!(
            "need examples ({}), batch ≥ 1 ({}) and steps ≥ 1 ({})",
            examples.len(),
            config.batch,
            config.steps
        )));
    }
    match &model.head {
        Some(h) if h.prefix == REWARD_HEAD => {}
        Some(_) => {
            return Err(RewardModelError::NoHead {
                what: "to train".into(),
                found: " (it has a value head; start from a model without a head)".into(),
            })
        }
        None => model.attach_head(REWARD_HEAD),
    }
    let mut trainer = Trainer::new(model, config.optim.clone());
    let mut stats = Vec::with_capacity(config.steps);
    let mut at = 0;
    for _ in 0..config.steps {
        let batch: Vec<RmExample> = (0..config.batch)
            .map(|i| examples[(at + i) % examples.len()].clone())
            .collect();
        at = (at + config.batch) % examples.len();
        let mut err = None;
        let s = trainer.step(&[batch], |m, b| {
            reward_model_loss(m, codec, b, config.pad_id).map_err(|e| {
                let msg = e.to_string();
                err = Some(e);
                yatt_engine::EngineError::InvalidArgument(msg)
            })
        });
        match (s, err) {
            (_, Some(e)) => return Err(e),
            (Err(source), None) => {
                return Err(RewardModelError::Engine {
                    what: "optimizer step".into(),
                    source,
                })
            }
            (Ok(s), None) => stats.push(s),
        }
    }
    let mut model = trainer.model;
    model.set_requires_grad(false);
    Ok((model, stats))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::builtin::rollout::TINY_CODEC;
    use yatt_engine::tiny_config;

    #[test]
    fn preference_pairs_teach_the_order() {
        let pair = |i: usize| RmExample::Pair {
            prompt: format!("q{i}:"),
            chosen: "abab".repeat(1 + i % 2),
            rejected: "zyzy".repeat(1 + (i + 1) % 2),
        };
        let examples: Vec<RmExample> = (0..8).map(pair).collect();
        let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 3).unwrap();
        let config = RmTrainConfig {
            steps: 30,
            batch: 8,
            optim: TrainConfig {
                lr: 3e-3,
                ..Default::default()
            },
            pad_id: 0,
        };
        let (m, stats) = train_reward_model(base, &TINY_CODEC, &examples, &config).unwrap();
        assert!(stats[29].loss < stats[0].loss, "{stats:?}");
        let rm = ScalarRewardModel::new(m, Arc::new(TINY_CODEC), 0, 4).unwrap();
        let input = |r: &str| RewardInput {
            prompt: "q9:".into(),
            response: r.into(),
            ..Default::default()
        };
        let s = rm.score(&[input("abab"), input("zyzy")]).unwrap();
        assert!(s[0] > s[1], "chosen {} vs rejected {}", s[0], s[1]);
        // A value head is not a reward head.
        let mut critic = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 3).unwrap();
        critic.attach_head("v_head");
        let e = ScalarRewardModel::new(critic, Arc::new(TINY_CODEC), 0, 4)
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("v_head") && e.contains("yatt reward-model"),
            "{e}"
        );
    }

    #[test]
    fn training_sets_read_both_shapes_and_name_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("rm.jsonl");
        std::fs::write(
            &p,
            "{\"prompt\": \"a\", \"response\": \"b\", \"score\": 0.5}\n\n{\"prompt\": \"a\", \"chosen\": \"x\", \"rejected\": \"y\"}\n",
        )
        .unwrap();
        let ex = load_rm_jsonl(&p).unwrap();
        assert_eq!(ex.len(), 2);
        assert!(matches!(&ex[0], RmExample::Scored { target, .. } if *target == 0.5));
        assert!(matches!(&ex[1], RmExample::Pair { chosen, .. } if chosen == "x"));
        std::fs::write(&p, "{\"prompt\": \"a\", \"response\": \"b\"}\n").unwrap();
        let e = load_rm_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("rm.jsonl:1") && e.contains("score"), "{e}");
        std::fs::write(&p, "{\"prompt\": \"a\", \"chosen\": \"b\"}\n").unwrap();
        let e = load_rm_jsonl(&p).unwrap_err().to_string();
        assert!(e.contains("rejected"), "{e}");
    }
}
