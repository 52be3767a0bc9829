//! `[rollout.env]`: the shipped tool configs parse and validate, and a bad environment
//! setting is refused with an error that names the key and the fix. No model is loaded.

use yatt_trainer::{JobConfig, RewardKind, Task};

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
    assert_eq!((e.max_turns, e.call_prefix), (2, true));
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
