//! `[rollout.env]`: the shipped tool configs parse and validate, and a bad environment
//! setting is refused with an error that names the key and the fix. No model is loaded.

use yatt_trainer::{CallPrefix, JobConfig, RewardKind, Task};

const TOOLS: &str = include_str!("../../config/smollm2-multiply-tools.toml");
const BASELINE: &str = include_str!("../../config/smollm2-multiply.toml");

fn parse(text: &str, sets: &[&str]) -> Result<JobConfig, String> {
    let dir = tempfile::tempdir().unwrap();
    let mut all = vec![format!("model.source=\"{}\"", dir.path().display())];
    all.extend(sets.iter().map(|s| s.to_string()));
    let c =
        JobConfig::parse(text, "smollm2-multiply-tools.toml", &all).map_err(|e| e.to_string())?;
    c.validate().map_err(|e| e.to_string())?;
    Ok(c)
}

#[test]
fn the_tool_config_and_its_baseline_differ_only_by_the_environment() {
    let tools = parse(TOOLS, &[]).unwrap();
    let e = tools.rollout.env.as_ref().expect("an environment");
    assert_eq!(e.kind, yatt_roles::EnvKind::Calculator);
    assert_eq!((e.max_turns, e.call_prefix), (2, CallPrefix::Always));
    assert_eq!(
        (tools.data.task, tools.data.length),
        (Task::Multiplication, 3)
    );
    assert_eq!(tools.reward_kinds(), vec![RewardKind::Numeric]);
    let mut base = parse(BASELINE, &[]).unwrap();
    assert!(base.rollout.env.is_none());
    // Same job otherwise (the prompt with tool instructions needs the longer context).
    base.rollout.env = tools.rollout.env.clone();
    base.job = tools.job.clone();
    base.model = tools.model.clone();
    assert_eq!(base, tools);
}

/// The guided job is the tool job with `call_prefix = "guide"` (by `extends`); the key
/// still takes the booleans it took before its words.
#[test]
fn the_guided_config_is_the_tool_config_with_guidance() {
    let dir = tempfile::tempdir().unwrap();
    let source = format!("model.source=\"{}\"", dir.path().display());
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../config/smollm2-multiply-tools-guided.toml"
    );
    let guided =
        JobConfig::load(std::path::Path::new(path), std::slice::from_ref(&source)).unwrap();
    guided.validate().unwrap();
    let e = guided.rollout.env.as_ref().unwrap();
    assert_eq!((e.call_prefix, e.guide_fraction), (CallPrefix::Guide, 0.5));
    let mut tools = parse(TOOLS, &[]).unwrap();
    tools.job = guided.job.clone();
    tools.model.source = guided.model.source.clone();
    tools.rollout.env.as_mut().unwrap().call_prefix = CallPrefix::Guide;
    assert_eq!(tools, guided);
    for (word, mode) in [
        ("true", CallPrefix::Always),
        ("false", CallPrefix::Off),
        ("\"off\"", CallPrefix::Off),
        ("\"always\"", CallPrefix::Always),
        ("\"guide\"", CallPrefix::Guide),
    ] {
        let set = format!("rollout.env.call_prefix={word}");
        let c = parse(TOOLS, &[set.as_str()]).unwrap();
        assert_eq!(c.rollout.env.unwrap().call_prefix, mode, "{word}");
    }
}

#[test]
fn bad_environment_settings_name_the_key_and_the_fix() {
    for (set, key, says) in [
        (
            "rollout.env={ kind = \"abacus\" }",
            "rollout.env",
            "guess-number",
        ),
        (
            "rollout.env={ kind = \"calculator\", max_turns = 0 }",
            "rollout.env.max_turns",
            "1 to 64",
        ),
        (
            "rollout.env={ kind = \"calculator\", timeout_s = 0 }",
            "rollout.env.timeout_s",
            "timeout_s = 10",
        ),
        (
            "rollout.env={ kind = \"calculator\", turns = 3 }",
            "turns",
            "max_turns",
        ),
        (
            "rollout.env={ kind = \"python\", python_timeout_s = 30, timeout_s = 10 }",
            "rollout.env.python_timeout_s",
            "lower python_timeout_s",
        ),
        (
            "rollout.env={ kind = \"guess-number\", call_prefix = true }",
            "rollout.env.call_prefix",
            "no tools",
        ),
        (
            "rollout.env={ kind = \"calculator\", call_prefix = \"sometimes\" }",
            "call_prefix",
            "guide",
        ),
        (
            "rollout.env={ kind = \"calculator\", call_prefix = \"guide\", guide_fraction = 1.0 }",
            "rollout.env.guide_fraction",
            "0.5",
        ),
        ("placement.env=\"n1\"", "placement.env", "disaggregated"),
        (
            "rollout.partial_rollout={ chunk_tokens = 8 }",
            "rollout.partial_rollout",
            "remove",
        ),
    ] {
        let mut sets = vec![set];
        if set.starts_with("rollout.partial_rollout") {
            sets.push("rollout.staleness=1");
            sets.push("algorithm.old_logprobs=\"rollout\"");
        }
        let e = parse(TOOLS, &sets).unwrap_err();
        assert!(e.contains(key) && e.contains(says), "{set}: {e}");
    }
    let e = parse(BASELINE, &["placement.env=\"n1\""]).unwrap_err();
    assert!(
        e.contains("placement.env") && e.contains("rollout.env"),
        "{e}"
    );
}
