//! The generated reference pages under docs/reference/ are what the code generates
//! now: `yatt config reference` (every config key) and `yatt config cli-reference`
//! (every command's help). A page that disagrees fails with the command that rewrites it.

use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `yatt config SUB` and compares its output with `docs/reference/FILE`.
fn holds_equal(sub: &str, file: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_yatt"))
        .args(["config", sub])
        .env_remove("YATT_LOG_JSON")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "yatt config {sub}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let generated = String::from_utf8(out.stdout).unwrap();
    let path = root().join("docs/reference").join(file);
    let on_disk = std::fs::read_to_string(&path).unwrap_or_default();
    if generated == on_disk {
        return;
    }
    let line = generated
        .lines()
        .zip(on_disk.lines().chain(std::iter::repeat("<end of file>")))
        .position(|(g, d)| g != d)
        .map_or_else(
            || generated.lines().count().min(on_disk.lines().count()) + 1,
            |i| i + 1,
        );
    panic!(
        "{} disagrees with `yatt config {sub}` from line {line} on:\n  generated: {:?}\n  on disk:   {:?}\n\
         regenerate it: cargo run --release --bin yatt -- config {sub} > docs/reference/{file}",
        path.display(),
        generated.lines().nth(line - 1).unwrap_or("<end>"),
        on_disk.lines().nth(line - 1).unwrap_or("<end>"),
    );
}

#[test]
fn config_reference_page_matches_the_typed_config() {
    holds_equal("reference", "config.md");
}

#[test]
fn cli_reference_page_matches_the_command_line() {
    holds_equal("cli-reference", "cli.md");
}

/// The page names every section of the job config and of the node config, and a key
/// of each with its default: the generator walks the whole schema.
#[test]
fn config_reference_covers_every_section() {
    let page = yatt::config_reference_page();
    for section in [
        "[job]",
        "[model]",
        "[model.lora]",
        "[data]",
        "[rollout]",
        "[rollout.env]",
        "[algorithm]",
        "[optim]",
        "[reward]",
        "[checkpoint]",
        "[eval]",
        "[placement]",
        "[timeouts]",
        "[roles]",
        "[node]",
        "[tls]",
        "[http]",
        "[membership]",
        "[transport]",
    ] {
        assert!(
            page.contains(&format!("### `{section}`")),
            "no {section} in the reference"
        );
    }
    assert!(page.contains("| `steps` | integer | `30` |"), "{page}");
    assert!(
        page.contains("| `heartbeat_ms` | integer | `500` |"),
        "{page}"
    );
}

/// The keys of a config-notes table row's first cell: `section.key` tokens, and bare
/// `key` tokens after one of them (`optim.lr`, `weight_decay`), which share its section.
fn keys_of_cell(cell: &str) -> Vec<(String, String)> {
    let mut keys = Vec::new();
    let mut section: Option<String> = None;
    for (i, token) in cell.split('`').enumerate() {
        // Odd pieces are inside backticks.
        if i % 2 == 0 || token.contains(' ') || token.contains('=') {
            continue;
        }
        if !token
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_' || c == '.')
        {
            continue;
        }
        match token.rsplit_once('.') {
            Some((s, k)) => {
                section = Some(s.to_string());
                keys.push((s.to_string(), k.to_string()));
            }
            None => {
                if let Some(s) = &section {
                    keys.push((s.clone(), token.to_string()));
                }
            }
        }
    }
    keys
}

/// Every key the hand-written configuration notes name is a key of the generated
/// reference: the notes cannot drift from the code by a renamed or removed key.
#[test]
fn config_notes_name_only_real_keys() {
    let page = yatt::config_reference_page();
    let notes = std::fs::read_to_string(root().join("docs/reference/config-notes.md")).unwrap();
    // The keys of each table of the reference, by section.
    let mut tables: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    let mut current = String::new();
    for line in page.lines() {
        if let Some(h) = line.strip_prefix("### `[") {
            current = h
                .trim_matches(|c| c == '[' || c == ']' || c == '`')
                .to_string();
        } else if let Some(row) = line.strip_prefix("| `") {
            if let Some((key, _)) = row.split_once('`') {
                tables
                    .entry(current.clone())
                    .or_default()
                    .push(key.to_string());
            }
        }
    }
    let mut unknown = Vec::new();
    let mut checked = 0;
    for (n, line) in notes.lines().enumerate() {
        let Some(first) = line.strip_prefix('|').and_then(|r| r.split('|').next()) else {
            continue;
        };
        for (section, key) in keys_of_cell(first) {
            // Only tokens whose section is a table of the reference are config keys.
            let Some(keys) = tables.get(&section) else {
                continue;
            };
            checked += 1;
            if !keys.contains(&key) {
                unknown.push(format!(
                    "docs/reference/config-notes.md:{}: `{section}.{key}` is not a key of [{section}]",
                    n + 1
                ));
            }
        }
    }
    assert!(checked > 50, "only {checked} keys found in the notes");
    assert!(unknown.is_empty(), "{}", unknown.join("\n"));
}

#[test]
fn keys_of_a_cell() {
    assert_eq!(
        keys_of_cell("`optim.lr`, `weight_decay`, `schedule`"),
        [
            ("optim", "lr"),
            ("optim", "weight_decay"),
            ("optim", "schedule")
        ]
        .map(|(s, k)| (s.to_string(), k.to_string()))
    );
    assert_eq!(
        keys_of_cell("`rollout.env.keep_kv`"),
        vec![("rollout.env".to_string(), "keep_kv".to_string())]
    );
    assert!(keys_of_cell("`algorithm.name = \"gspo\"`").is_empty());
}
