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
    assert!(page.contains("| `heartbeat_ms` | integer | `500` |"), "{page}");
}
