//! Reading a job config: TOML text, `--set key=value` overrides, errors that name the key.

use std::path::{Path, PathBuf};

use crate::config::checks::invalid;
use crate::config::sections::JobConfig;
use crate::error::JobError;

impl JobConfig {
    /// Parses TOML text, applies `--set key=value` overrides, then validates. A top-level
    /// `extends = "PATH"` names a base config (relative to the current directory here;
    /// to the file's directory with [`JobConfig::load`]) whose keys this text overrides.
    pub fn parse(text: &str, origin: &str, sets: &[String]) -> Result<Self, JobError> {
        let (table, based) = with_bases(text, origin, Path::new("."), &mut Vec::new())?;
        Self::from_table(table, origin, based, sets)
    }

    /// `based`: the table merges a base config (`extends`), so, as with `--set`, its
    /// line numbers are not the file's.
    fn from_table(
        mut table: toml::Table,
        origin: &str,
        based: bool,
        sets: &[String],
    ) -> Result<Self, JobError> {
        for arg in sets {
            apply_set(&mut table, arg)?;
        }
        // Round-trip through text so type errors carry the line and the key.
        let merged = toml::to_string(&table).map_err(|e| JobError::Parse {
            origin: origin.into(),
            message: e.to_string(),
        })?;
        let origin = match (based, sets.is_empty()) {
            (false, true) => origin.to_string(),
            (true, true) => format!("{origin} (with its {EXTENDS} base)"),
            (false, false) => format!("{origin} (with --set overrides)"),
            (true, false) => format!("{origin} (with its {EXTENDS} base and --set overrides)"),
        };
        let renumbered = based || !sets.is_empty();
        let cfg: JobConfig = toml::from_str(&merged).map_err(|e| {
            let key = e.span().and_then(|span| key_at(&merged, span.start));
            if let Some(invalid) = key.as_deref().and_then(|k| unknown_word(k, e.message())) {
                return invalid;
            }
            let message = match key {
                // Merged, the line numbers refer to the merged text: name the key.
                Some(k) if renumbered => format!("key `{k}`: {}", e.message()),
                Some(k) => format!("key `{k}`: {e}"),
                None => e.to_string(),
            };
            JobError::Parse { origin, message }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads and parses a config file (see [`JobConfig::parse`]).
    pub fn load(path: impl AsRef<Path>, sets: &[String]) -> Result<Self, JobError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| JobError::Read {
            path: path.into(),
            source,
        })?;
        let origin = path.display().to_string();
        let dir = path.parent().unwrap_or(Path::new("."));
        let (table, based) = with_bases(&text, &origin, dir, &mut vec![canonical(path)])?;
        Self::from_table(table, &origin, based, sets)
    }
}

/// The key naming a config's base config.
const EXTENDS: &str = "extends";

/// Parses `text` and, when it names a base with `extends`, lays it over that base (read
/// from `dir`; recursively): tables merge key by key, any other value of the text
/// replaces the base's. `chain` holds the files already on the way, to refuse a cycle.
/// Also says whether a base was merged.
fn with_bases(
    text: &str,
    origin: &str,
    dir: &Path,
    chain: &mut Vec<PathBuf>,
) -> Result<(toml::Table, bool), JobError> {
    let parse_err = |message: String| JobError::Parse {
        origin: origin.into(),
        message,
    };
    let mut table: toml::Table = text
        .parse()
        .map_err(|e: toml::de::Error| parse_err(e.to_string()))?;
    let Some(base) = table.remove(EXTENDS) else {
        return Ok((table, false));
    };
    let toml::Value::String(name) = base else {
        return Err(invalid(
            &format!("{origin}: {EXTENDS}"),
            "the path of a base config (TOML), relative to this file",
            &base.to_string(),
            &format!("{EXTENDS} = \"smollm2-addition.toml\""),
        ));
    };
    let path = dir.join(&name);
    let base_text = std::fs::read_to_string(&path).map_err(|e| {
        parse_err(format!(
            "{EXTENDS} = {name:?}: cannot read {}: {e}; the path is relative to the directory of the file that names it",
            path.display()
        ))
    })?;
    let key = canonical(&path);
    if chain.contains(&key) {
        let names: Vec<String> = chain
            .iter()
            .chain([&key])
            .map(|p| p.display().to_string())
            .collect();
        return Err(parse_err(format!(
            "{EXTENDS} = {name:?} makes a cycle ({}); one config of the chain must not name a base",
            names.join(" -> ")
        )));
    }
    chain.push(key);
    let base_origin = format!("{} ({EXTENDS} of {origin})", path.display());
    let base_dir = path.parent().unwrap_or(Path::new("."));
    let (mut merged, _) = with_bases(&base_text, &base_origin, base_dir, chain)?;
    chain.pop();
    overlay(&mut merged, table);
    Ok((merged, true))
}

/// `top` laid over `base`: tables merge key by key, any other value replaces.
fn overlay(base: &mut toml::Table, top: toml::Table) {
    for (k, v) in top {
        match (base.get_mut(&k), v) {
            (Some(toml::Value::Table(b)), toml::Value::Table(t)) => overlay(b, t),
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

/// A file's identity for cycle detection (its path as given when it cannot be resolved).
fn canonical(path: &Path) -> PathBuf {
    std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf())
}

/// A mode's unknown word (serde's "unknown variant `x`, expected one of `a`, `b`") as
/// the error every other bad value gives: the key, the words accepted, the fix.
pub(crate) fn unknown_word(key: &str, message: &str) -> Option<JobError> {
    let rest = message.strip_prefix("unknown variant `")?;
    let (found, expected) = rest.split_once("`, expected ")?;
    let words: Vec<&str> = expected.split('`').skip(1).step_by(2).collect();
    let first = words.first()?;
    let list = words
        .iter()
        .map(|w| format!("\"{w}\""))
        .collect::<Vec<_>>()
        .join(", ");
    Some(invalid(
        key,
        &format!("one of {list}"),
        &format!("\"{found}\""),
        &format!("set {key} = \"{first}\""),
    ))
}

/// The dotted key (`section.key`) of the line holding byte `pos` of a TOML text.
pub(crate) fn key_at(text: &str, pos: usize) -> Option<String> {
    let before = text.get(..pos)?;
    let line_start = before.rfind('\n').map_or(0, |i| i + 1);
    let line = text[line_start..].lines().next()?.trim();
    let key = line
        .split_once('=')
        .map(|(k, _)| k.trim().trim_matches('"'))
        .filter(|k| !k.is_empty() && !k.starts_with('['));
    let section = before[..line_start]
        .lines()
        .rev()
        .map(str::trim)
        .find(|l| l.starts_with('['))
        .map(|l| l.trim_matches(|c| c == '[' || c == ']').trim());
    match (section, key) {
        (Some(s), Some(k)) => Some(format!("{s}.{k}")),
        (None, Some(k)) => Some(k.to_string()),
        _ => None,
    }
}

/// The default config with its optional keys set (TOML leaves out a `None`), so that its
/// keys are every key `--set` may name.
fn schema() -> JobConfig {
    let mut c = JobConfig::default();
    let a = &mut c.algorithm;
    let (low, high) = a.clip();
    a.clip_low = Some(low);
    a.clip_high = Some(high);
    a.loss_agg = Some(a.loss_agg_mode());
    a.dynamic_sampling = Some(a.name.dynamic_sampling_by_default());
    a.off_policy = Some(a.off_policy(0));
    c.rollout.partial_rollout = Some(Default::default());
    c.model.lora = Some(Default::default());
    c.algorithm.step_credit = Some(Default::default());
    c.rollout.env = Some(Default::default());
    c.data.format = Some(yatt_roles::DataFormat::Jsonl);
    c
}

/// Applies one `key=value` override (dotted key, TOML value; a bare word that is not
/// valid TOML is taken as a string). The key must exist in the schema.
pub(crate) fn apply_set(table: &mut toml::Table, arg: &str) -> Result<(), JobError> {
    let err = |reason: String| JobError::Set {
        arg: arg.into(),
        reason,
    };
    let (key, raw) = arg
        .split_once('=')
        .ok_or_else(|| err("expected key=value, e.g. job.steps=10".into()))?;
    let key = key.trim();
    let parts: Vec<&str> = key.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.is_empty()) {
        return Err(err(format!(
            "key `{key}`: expected section.key, e.g. job.steps (or section.table.key, e.g. algorithm.step_credit.penalty)"
        )));
    }
    // `[roles]` holds the user's role names and their own arguments, which no schema
    // knows: parsing the result checks what can be checked (unknown slot keys included).
    let schema = match parts[0] {
        "roles" => toml::Table::new().into(),
        _ => toml::Value::try_from(schema()).map_err(|e| err(e.to_string()))?,
    };
    // Each part but the last names a table of the schema; the last, a key of it.
    let mut level = schema
        .as_table()
        .ok_or_else(|| err("the schema is not a table".into()))?;
    let checked = if parts[0] == "roles" { 0 } else { parts.len() };
    for (depth, part) in parts.iter().enumerate().take(checked) {
        let within = match depth {
            0 => "the config".to_string(),
            _ => format!("[{}]", parts[..depth].join(".")),
        };
        let names: Vec<&String> = level.keys().collect();
        let Some(found) = level.get(*part) else {
            return Err(err(format!(
                "unknown key `{key}`: {within} has no `{part}`; it has {names:?}"
            )));
        };
        if depth + 1 < parts.len() {
            level = found.as_table().ok_or_else(|| {
                err(format!(
                    "key `{key}`: `{}` is a value, not a table",
                    parts[..=depth].join(".")
                ))
            })?;
        }
    }
    let raw = raw.trim();
    let value = match format!("v = {raw}").parse::<toml::Table>() {
        Ok(mut t) => t
            .remove("v")
            .unwrap_or_else(|| toml::Value::String(raw.into())),
        Err(_) => toml::Value::String(raw.into()),
    };
    // Tables by name; an array of tables (`[[roles.stages]]`) by index: `roles.stages.0.node`.
    let mut table = table;
    let mut depth = 0;
    while depth + 1 < parts.len() {
        let here = parts[..=depth].join(".");
        let entry = table
            .entry(parts[depth].to_string())
            .or_insert_with(|| toml::Value::Table(toml::Table::new()));
        let entry = match entry {
            toml::Value::Array(entries) => {
                let len = entries.len();
                let index: usize = parts[depth + 1].parse().map_err(|_| {
                    err(format!(
                        "`{here}` is a list: give an entry's index, e.g. {here}.0.KEY"
                    ))
                })?;
                let Some(chosen) = entries.get_mut(index) else {
                    return Err(err(format!(
                        "`{here}` has {len} entries (0..{len}); there is no entry {index}"
                    )));
                };
                depth += 1;
                if depth + 1 == parts.len() {
                    *chosen = value;
                    return Ok(());
                }
                chosen
            }
            other => other,
        };
        let toml::Value::Table(t) = entry else {
            return Err(err(format!(
                "`{}` in the config is not a table",
                parts[..=depth].join(".")
            )));
        };
        table = t;
        depth += 1;
    }
    table.insert(parts[parts.len() - 1].to_string(), value);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::modes::{RewardKind, Task};
    use yatt_roles::Algorithm;

    const DEMO: &str = include_str!("../../../config/demo-letters.toml");

    #[test]
    fn the_shipped_config_parses() {
        let c = JobConfig::parse(DEMO, "demo-letters.toml", &[]).unwrap();
        assert_eq!(c.data.task, Task::Letters);
        assert_eq!(c.reward_kinds(), vec![RewardKind::Letters]);
        assert!(c.job.steps > 0);
    }

    #[test]
    fn a_wrong_type_names_the_key() {
        let e = JobConfig::parse("[job]\nsteps = \"ten\"\n", "x.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job.steps") && e.contains("x.toml") && e.contains("fix:"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &["optim.lr=\"fast\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("key `optim.lr`") && e.contains("expected f64"),
            "{e}"
        );
    }

    #[test]
    fn an_unknown_key_is_refused() {
        let e = JobConfig::parse("[optim]\nlearning_rate = 1.0\n", "x.toml", &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("optim.learning_rate") && e.contains("unknown field"),
            "{e}"
        );
        let e = JobConfig::parse(DEMO, "d", &["optim.learning_rate=1".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--set optim.learning_rate=1") && e.contains("unknown key"),
            "{e}"
        );
    }

    #[test]
    fn a_set_override_reaches_a_nested_table() {
        let c =
            JobConfig::parse(DEMO, "d", &["algorithm.step_credit.penalty=0.25".into()]).unwrap();
        let credit = c.algorithm.step_credit.unwrap();
        assert_eq!((credit.penalty, credit.delimiter.as_str()), (0.25, "\n"));
        for (set, says) in [
            (
                "algorithm.step_credit.pnalty=1",
                "[algorithm.step_credit] has no `pnalty`",
            ),
            (
                "algorithm.kl_coef.x=1",
                "`algorithm.kl_coef` is a value, not a table",
            ),
            ("algo.kl_coef=1", "the config has no `algo`"),
        ] {
            let e = JobConfig::parse(DEMO, "d", &[set.into()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{set}: {e}");
        }
    }

    #[test]
    fn a_set_override_works() {
        let sets = [
            "job.steps=3".to_string(),
            "algorithm.name=rloo".into(),
            "optim.lr=0.5".into(),
            "reward.kind=[\"letters\"]".into(),
        ];
        let c = JobConfig::parse(DEMO, "d", &sets).unwrap();
        assert_eq!(
            (c.job.steps, c.algorithm.name, c.optim.lr),
            (3, Algorithm::Rloo, 0.5)
        );
        let e = JobConfig::parse(DEMO, "d", &["algorithm.name=ppo2".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("algorithm.name")
                && e.contains("\"grpo\"")
                && e.contains("ppo2")
                && e.contains("fix"),
            "{e}"
        );
    }

    #[test]
    fn an_unsupported_placement_says_not_implemented() {
        let e = JobConfig::parse(DEMO, "d", &["job.placement=\"split\"".into()])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("job.placement") && e.contains("not implemented yet"),
            "{e}"
        );
    }
}

/// `[roles]` (`config/user_roles.rs`) as a job config reads it.
#[cfg(test)]
mod roles_tests {
    use crate::config::sections::JobConfig;
    use crate::controller::extra_stages::StageAt;

    const DEMO: &str = include_str!("../../../config/demo-letters.toml");

    fn with(extra: &str, sets: &[&str]) -> Result<JobConfig, String> {
        let text = format!("{DEMO}\n{extra}");
        let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
        let job = JobConfig::parse(&text, "job.toml", &sets).map_err(|e| e.to_string())?;
        job.validate().map_err(|e| e.to_string())?;
        Ok(job)
    }

    const ROLES: &str = r#"
[roles.reward]
role = "my-reward"
args = { min_len = 4, alphabet = "aeiou", nested = { a = [1, 2] } }

[[roles.stages]]
role = "filter"
after = "old_logprobs"
node = "host-1"
"#;

    #[test]
    fn roles_parse_and_survive_the_written_job_config() {
        let job = with(ROLES, &[]).unwrap();
        let reward = job.roles.reward.as_ref().unwrap();
        assert_eq!(reward.role, "my-reward");
        assert_eq!(reward.args["min_len"].as_integer(), Some(4));
        assert_eq!(job.roles.stages[0].after, StageAt::OldLogProbs);
        assert_eq!(job.roles.stages[0].stage_name(), "filter");
        assert_eq!(job.roles.stages[0].timeout_s, 300.0);
        // The run directory's job.toml (and a resume) reads back the same.
        let text = toml::to_string(&job).unwrap();
        assert_eq!(JobConfig::parse(&text, "job.toml", &[]).unwrap(), job);
        // A job without roles writes no [roles].
        let plain = with("", &[]).unwrap();
        assert!(!toml::to_string(&plain).unwrap().contains("roles"));
    }

    #[test]
    fn roles_take_overrides_and_refuse_what_cannot_spawn() {
        let job = with(
            ROLES,
            &[
                "roles.reward.args.min_len=6",
                "roles.reward.node=h2",
                "roles.stages.0.node=h3",
            ],
        )
        .unwrap();
        assert_eq!(job.roles.stages[0].node, "h3");
        let reward = job.roles.reward.unwrap();
        assert_eq!(reward.args["min_len"].as_integer(), Some(6));
        assert_eq!(reward.node, "h2");
        let e = with(ROLES, &["roles.stages.1.node=h3"]).unwrap_err();
        assert!(
            e.contains("has 1 entries") && e.contains("no entry 1"),
            "{e}"
        );
        let e = with(ROLES, &["roles.stages.node=h3"]).unwrap_err();
        assert!(
            e.contains("is a list") && e.contains("roles.stages.0.KEY"),
            "{e}"
        );
        let e = with(ROLES, &["roles.reward.rol=\"x\""]).unwrap_err();
        assert!(e.contains("rol"), "{e}");
        let e = with(ROLES, &["roles.reward.role=\"my/reward\""]).unwrap_err();
        assert!(e.contains("roles.reward.role"), "{e}");
        let e = with(
            &format!("{ROLES}\n[[roles.stages]]\nrole = \"filter\"\nafter = \"reward\"\n"),
            &[],
        )
        .unwrap_err();
        assert!(e.contains("roles.stages[1].name"), "{e}");
        let e = with(
            ROLES,
            &["roles.stages=[{ role = \"f\", after = \"advantages\" }]"],
        )
        .unwrap_err();
        assert!(
            e.contains("advantages") && e.contains("old_logprobs"),
            "{e}"
        );
    }
}
