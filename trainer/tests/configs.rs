//! The shipped job configs parse and hold what their comments promise; the held-out
//! evaluation prompts of the SmolLM2 addition config are disjoint from its training
//! prompts and the same on every call. No model is loaded: `model.source` points at a
//! directory `yatt import-gguf` creates, so it is replaced by a temporary one here.

use std::collections::HashSet;

use yatt_trainer::JobConfig;
use yatt_trainer::{eval_prompts, EvalOptions, Split};
use yatt_trainer::{Algorithm, Dtype, KlMode, LossAgg, LossAggMode, OldLogprobs, RewardKind, Task};

const SMOLLM2: &str = include_str!("../../config/smollm2-addition.toml");

/// The SmolLM2 config with `model.source` pointed at an existing (empty) directory, as
/// validation checks that the source is a directory.
fn smollm2(dir: &tempfile::TempDir) -> JobConfig {
    let set = format!("model.source=\"{}\"", dir.path().display());
    JobConfig::parse(SMOLLM2, "smollm2-addition.toml", &[set]).unwrap()
}

#[test]
fn the_smollm2_addition_config_parses_and_validates() {
    let dir = tempfile::tempdir().unwrap();
    let c = smollm2(&dir);
    c.validate().unwrap();
    // The settings of the TRL comparison in docs/benchmarks.md.
    assert_eq!(c.algorithm.name, Algorithm::Grpo);
    assert_eq!((c.data.prompts_per_step, c.data.samples_per_prompt), (2, 8));
    assert_eq!(c.rollout.max_new_tokens, 16);
    assert_eq!((c.model.threads, c.model.dtype), (2, Dtype::F32));
    assert!(c.model.chat);
    assert_eq!((c.data.task, c.data.length), (Task::Addition, 2));
    assert_eq!(c.reward_kinds(), vec![RewardKind::Numeric]);
    // No KL term and on-policy old log-probs, as TRL's defaults (beta 0, one iteration).
    assert_eq!(c.algorithm.kl_mode, KlMode::None);
    assert_eq!(c.algorithm.old_logprobs, OldLogprobs::OnPolicy);
    assert_eq!(c.optim.mini_batches, 1);
    // As shipped, the source is the directory the documented import command writes.
    let shipped: toml::Table = SMOLLM2.parse().unwrap();
    assert_eq!(
        shipped["model"]["source"].as_str(),
        Some("models/smollm2-135m")
    );
    assert!(SMOLLM2.contains("yatt import-gguf \"$YATT_SMOLLM2_GGUF\" models/smollm2-135m"));
}

/// The error of the SmolLM2 config with `sets` applied.
fn error_with(sets: &[String]) -> String {
    JobConfig::parse(SMOLLM2, "smollm2-addition.toml", sets)
        .unwrap_err()
        .to_string()
}

#[test]
fn a_missing_model_directory_is_named() {
    let e = error_with(&["model.source=\"/nonexistent/smollm2\"".into()]);
    assert!(
        e.contains("model.source") && e.contains("/nonexistent/smollm2"),
        "{e}"
    );
}

#[test]
fn on_policy_old_logprobs_need_one_mini_batch() {
    let dir = tempfile::tempdir().unwrap();
    let e = error_with(&[
        format!("model.source=\"{}\"", dir.path().display()),
        "optim.mini_batches=2".into(),
    ]);
    assert!(
        e.contains("algorithm.old_logprobs") && e.contains("mini_batches"),
        "{e}"
    );
}

#[test]
fn held_out_prompts_are_disjoint_from_training_and_deterministic() {
    let dir = tempfile::tempdir().unwrap();
    let c = smollm2(&dir);
    let options = EvalOptions {
        prompts: 100,
        ..Default::default()
    };
    let held = eval_prompts(&c, &options).unwrap();
    assert_eq!(held.len(), 100);
    assert_eq!(held, eval_prompts(&c, &options).unwrap());
    let train = eval_prompts(
        &c,
        &EvalOptions {
            prompts: c.data.num_prompts,
            split: Split::Train,
            ..Default::default()
        },
    )
    .unwrap();
    let train: HashSet<&str> = train.iter().map(|p| p.text.as_str()).collect();
    let texts: HashSet<&str> = held.iter().map(|p| p.text.as_str()).collect();
    assert_eq!(texts.len(), 100, "held-out prompts repeat");
    assert!(texts.is_disjoint(&train));
    for p in &held {
        assert!(
            p.text.starts_with("What is ") && p.reference.is_some(),
            "{p:?}"
        );
    }
}

#[test]
fn a_task_without_held_out_prompts_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let c = JobConfig::parse(
        SMOLLM2,
        "x.toml",
        &[
            format!("model.source=\"{}\"", dir.path().display()),
            // One-digit addition has 100 questions; 100 go to training.
            "data.length=1".into(),
            "data.num_prompts=100".into(),
        ],
    )
    .unwrap();
    let e = eval_prompts(
        &c,
        &EvalOptions {
            prompts: 50,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("held-out") && e.contains("--split train"), "{e}");
    let e = eval_prompts(
        &c,
        &EvalOptions {
            prompts: 0,
            ..Default::default()
        },
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("--prompts"), "{e}");
}

#[test]
fn dr_grpo_gspo_and_cispo_take_their_papers_defaults_unless_set() {
    let dir = tempfile::tempdir().unwrap();
    let source = format!("model.source=\"{}\"", dir.path().display());
    let with = |sets: &[&str]| {
        let mut all = vec![source.clone()];
        all.extend(sets.iter().map(|s| s.to_string()));
        JobConfig::parse(SMOLLM2, "smollm2-addition.toml", &all)
    };
    let c = with(&["algorithm.name=\"dr-grpo\""]).unwrap();
    assert_eq!(c.algorithm.clip(), (0.2, 0.2));
    // max_new_tokens = 16 in this config: the constant normaliser
    assert_eq!(
        c.algorithm.loss_agg(c.rollout.max_new_tokens),
        LossAgg::SeqMeanTokenSumNorm { max_len: 16.0 }
    );
    let c = with(&["algorithm.name=\"gspo\""]).unwrap();
    assert_eq!(c.algorithm.clip(), (3e-4, 4e-4));
    assert_eq!(c.algorithm.loss_agg_mode(), LossAggMode::SeqMeanTokenMean);
    let c = with(&["algorithm.name=\"cispo\""]).unwrap();
    assert_eq!(c.algorithm.clip(), (1.0, 0.2));
    assert_eq!(c.algorithm.loss_agg_mode(), LossAggMode::TokenMean);
    // what the config sets wins
    let c = with(&[
        "algorithm.name=\"cispo\"",
        "algorithm.clip_high=4.0",
        "algorithm.loss_agg=\"seq-mean-token-mean\"",
    ])
    .unwrap();
    assert_eq!(c.algorithm.clip(), (1.0, 4.0));
    assert_eq!(c.algorithm.loss_agg_mode(), LossAggMode::SeqMeanTokenMean);
    // PPO's 0.2 on a sequence ratio never clips: refused, naming the key and the fix
    let e = with(&["algorithm.name=\"gspo\"", "algorithm.clip_high=0.2"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("algorithm.clip_high") && e.contains("3e-4"),
        "{e}"
    );
    // a lower bound of 1 is CISPO's only
    let e = with(&["algorithm.name=\"grpo\"", "algorithm.clip_low=1.0"])
        .unwrap_err()
        .to_string();
    assert!(e.contains("algorithm.clip_low"), "{e}");
    with(&["algorithm.name=\"cispo\"", "algorithm.clip_low=1.0"]).unwrap();
}

/// Every shipped baseline config (`config/baselines/*.toml`) extends the SmolLM2 addition
/// config: the algorithm its file names, everything else the base's.
#[test]
fn each_baseline_config_is_the_addition_config_with_its_algorithm() {
    let dir = tempfile::tempdir().unwrap();
    let source = format!("model.source=\"{}\"", dir.path().display());
    let base = smollm2(&dir);
    let configs = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/baselines");
    let mut names = Vec::new();
    for entry in std::fs::read_dir(configs).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_stem().unwrap().to_str().unwrap().to_string();
        let c = JobConfig::load(&path, std::slice::from_ref(&source))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let (algorithm, kl) = match name.as_str() {
            "grpo" => (Algorithm::Grpo, KlMode::None),
            "grpo-kl" => (Algorithm::Grpo, KlMode::Loss),
            "dr-grpo" => (Algorithm::DrGrpo, KlMode::None),
            "gspo" => (Algorithm::Gspo, KlMode::None),
            "cispo" => (Algorithm::Cispo, KlMode::None),
            "rloo" => (Algorithm::Rloo, KlMode::None),
            "reinforce++" => (Algorithm::ReinforcePp, KlMode::None),
            "dapo" => (Algorithm::Dapo, KlMode::None),
            "ppo" => (Algorithm::Ppo, KlMode::None),
            other => panic!("{}: no expectation for {other}", path.display()),
        };
        assert_eq!(
            (c.algorithm.name, c.algorithm.kl_mode),
            (algorithm, kl),
            "{name}"
        );
        assert_eq!(
            c.job.output_dir,
            std::path::PathBuf::from(format!("runs/baselines/{name}"))
        );
        // The base's settings stand: the same sample budget and sampling for every row.
        assert_eq!(c.job.steps, base.job.steps);
        assert_eq!(
            (c.data.prompts_per_step, c.data.samples_per_prompt),
            (base.data.prompts_per_step, base.data.samples_per_prompt)
        );
        assert_eq!(c.rollout.temperature, base.rollout.temperature);
        assert_eq!(c.optim.lr, base.optim.lr);
        names.push(name);
    }
    names.sort();
    assert_eq!(names.len(), 9, "{names:?}");
}

/// `extends`: tables merge key by key, a value of the extending file wins, the base's
/// path is relative to the file that names it, and a chain may be longer than one.
#[test]
fn a_config_extends_its_base_key_by_key() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    std::fs::create_dir(&model).unwrap();
    std::fs::create_dir(dir.path().join("sub")).unwrap();
    let base = dir.path().join("base.toml");
    std::fs::write(
        &base,
        SMOLLM2.replace("models/smollm2-135m", &model.display().to_string()),
    )
    .unwrap();
    let middle = dir.path().join("sub/middle.toml");
    std::fs::write(&middle, "extends = \"../base.toml\"\n[optim]\nlr = 3e-5\n").unwrap();
    let top = dir.path().join("top.toml");
    std::fs::write(
        &top,
        "extends = \"sub/middle.toml\"\n[algorithm]\nname = \"rloo\"\n",
    )
    .unwrap();
    let c = JobConfig::load(&top, &[]).unwrap();
    assert_eq!(c.algorithm.name, Algorithm::Rloo);
    assert_eq!(c.optim.lr, 3e-5);
    // Untouched keys of the merged tables keep the base's values.
    assert_eq!(c.optim.max_grad_norm, 1.0);
    assert_eq!(c.algorithm.kl_mode, KlMode::None);
    assert_eq!(c.data.samples_per_prompt, 8);
    // --set still wins over every file.
    let c = JobConfig::load(&top, &["optim.lr=2e-5".into()]).unwrap();
    assert_eq!(c.optim.lr, 2e-5);
    // A wrong type in the extending file names the key.
    std::fs::write(
        &top,
        "extends = \"sub/middle.toml\"\n[optim]\nlr = \"fast\"\n",
    )
    .unwrap();
    let e = JobConfig::load(&top, &[]).unwrap_err().to_string();
    assert!(e.contains("optim.lr") && e.contains("top.toml"), "{e}");
}

#[test]
fn a_missing_or_circular_base_is_refused_naming_the_files() {
    let dir = tempfile::tempdir().unwrap();
    let a = dir.path().join("a.toml");
    std::fs::write(&a, "extends = \"missing.toml\"\n").unwrap();
    let e = JobConfig::load(&a, &[]).unwrap_err().to_string();
    assert!(
        e.contains("a.toml")
            && e.contains("missing.toml")
            && e.contains("relative to the directory"),
        "{e}"
    );
    std::fs::write(&a, "extends = \"b.toml\"\n").unwrap();
    std::fs::write(dir.path().join("b.toml"), "extends = \"a.toml\"\n").unwrap();
    let e = JobConfig::load(&a, &[]).unwrap_err().to_string();
    assert!(
        e.contains("cycle") && e.contains("b.toml") && e.contains("a.toml"),
        "{e}"
    );
    std::fs::write(&a, "extends = 3\n").unwrap();
    let e = JobConfig::load(&a, &[]).unwrap_err().to_string();
    assert!(e.contains("extends") && e.contains("a.toml"), "{e}");
}

/// `config/smollm2-addition-long.toml`: the addition config with the plateau run's
/// changes (4 x 16 samples, a cosine rate over 240 steps, evaluation every 40 steps) and
/// nothing else.
#[test]
fn the_long_addition_config_is_the_addition_config_with_the_plateau_changes() {
    let dir = tempfile::tempdir().unwrap();
    let source = format!("model.source=\"{}\"", dir.path().display());
    let base = smollm2(&dir);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/smollm2-addition-long.toml"
    );
    let c = JobConfig::load(path, std::slice::from_ref(&source)).unwrap();
    assert_eq!(c.job.steps, 240);
    assert_eq!(
        (
            c.data.num_prompts,
            c.data.prompts_per_step,
            c.data.samples_per_prompt
        ),
        (4096, 4, 16)
    );
    assert_eq!(c.optim.schedule, yatt_trainer::Schedule::Cosine);
    assert_eq!(
        (c.eval.every, c.eval.prompts, c.eval.before_train),
        (40, 200, true)
    );
    let mut same = c.clone();
    same.job = base.job.clone();
    same.data = base.data.clone();
    same.optim.schedule = base.optim.schedule;
    same.eval = base.eval.clone();
    assert_eq!(same, base);
}

/// `config/smollm2-addition-dynamic.toml`: the long config with dynamic sampling (the run
/// that passed 90 %), its own name and output directory, and nothing else.
#[test]
fn the_dynamic_sampling_config_is_the_long_config_with_dynamic_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let source = format!("model.source=\"{}\"", dir.path().display());
    smollm2(&dir);
    let load = |name: &str| {
        let path = format!("{}/../config/{name}", env!("CARGO_MANIFEST_DIR"));
        JobConfig::load(&path, std::slice::from_ref(&source)).unwrap()
    };
    let long = load("smollm2-addition-long.toml");
    let c = load("smollm2-addition-dynamic.toml");
    assert_eq!(long.algorithm.dynamic_sampling, None);
    assert_eq!(c.algorithm.dynamic_sampling, Some(true));
    assert_eq!(c.job.name, "smollm2-addition-dynamic");
    assert_ne!(c.job.output_dir, long.job.output_dir);
    let mut same = c.clone();
    same.algorithm.dynamic_sampling = long.algorithm.dynamic_sampling;
    same.job.name = long.job.name.clone();
    same.job.output_dir = long.job.output_dir.clone();
    assert_eq!(same, long);
}
