//! The README and the guide under `docs/` checked against the repository:
//! - every relative link (`[text](path)`, `[text](path#anchor)`, `(#anchor)`) names a file
//!   that exists, and an anchor names a heading of the target file (GitHub's slugs);
//! - every script, config file or other path under `config/`, `scripts/`, `examples/`,
//!   `deploy/` or `docs/` quoted in code exists;
//! - every `--flag` of a quoted `yatt SUB ...` or `yatt-node SUB ...` command line is one
//!   that `SUB --help` lists.
//!
//! Only std: the files are scanned by hand, not with a Markdown crate. Links and paths in
//! fenced code blocks are not links; commands are read from fenced blocks and inline code.

use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// The repository root.
fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every Markdown file under docs/, sorted.
fn markdown_files(root: &Path) -> Vec<PathBuf> {
    let mut files = vec![root.join("README.md")];
    let mut stack = vec![root.join("docs")];
    while let Some(dir) = stack.pop() {
        let entries = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|e| e == "md") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

fn display(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// GitHub's anchor for a heading's text: markup dropped, lowercase, every character
/// but letters, digits, `-`, `_` and spaces dropped, spaces turned into `-`.
fn slug(heading: &str) -> String {
    let text = strip_inline_markup(heading);
    let mut out = String::new();
    for c in text.trim().chars().flat_map(char::to_lowercase) {
        if c.is_alphanumeric() || c == '-' || c == '_' {
            out.push(c);
        } else if c == ' ' {
            out.push('-');
        }
    }
    out
}

/// A heading's rendered text: `[text](url)` becomes `text`, HTML tags and backticks go.
fn strip_inline_markup(s: &str) -> String {
    let mut out = String::new();
    let chars: Vec<char> = s.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '<' {
            if let Some(end) = chars[i..].iter().position(|&x| x == '>') {
                i += end + 1;
                continue;
            }
        }
        if c == ']' && chars.get(i + 1) == Some(&'(') {
            if let Some(end) = chars[i..].iter().position(|&x| x == ')') {
                i += end + 1;
                continue;
            }
        }
        if c != '`' && c != '[' {
            out.push(c);
        }
        i += 1;
    }
    out
}

/// A Markdown file split into prose and code, line numbers kept.
struct Doc {
    /// The text with fenced code blocks and HTML comments blanked (newlines kept).
    prose: String,
    /// Fenced code blocks: (first line of the content, 1-based; the content).
    blocks: Vec<(usize, String)>,
}

fn fence_of(line: &str) -> Option<(char, usize)> {
    let t = line.trim_start();
    let c = t.chars().next()?;
    if c != '`' && c != '~' {
        return None;
    }
    let n = t.chars().take_while(|&x| x == c).count();
    (n >= 3).then_some((c, n))
}

fn parse_doc(text: &str) -> Doc {
    let mut prose = String::new();
    let mut blocks = Vec::new();
    let mut open: Option<(char, usize, usize, String)> = None;
    for (i, line) in text.split('\n').enumerate() {
        match &mut open {
            None => {
                if let Some((c, n)) = fence_of(line) {
                    open = Some((c, n, i + 2, String::new()));
                    prose.push('\n');
                } else {
                    prose.push_str(line);
                    prose.push('\n');
                }
            }
            Some((c, n, start, content)) => {
                let t = line.trim();
                let closes = t.len() >= *n && t.chars().all(|x| x == *c);
                if closes {
                    blocks.push((*start, std::mem::take(content)));
                    open = None;
                } else {
                    content.push_str(line);
                    content.push('\n');
                }
                prose.push('\n');
            }
        }
    }
    if let Some((_, _, start, content)) = open {
        blocks.push((start, content));
    }
    // HTML comments are not rendered: blank them, keeping line numbers.
    let mut out = String::with_capacity(prose.len());
    let mut rest = prose.as_str();
    while let Some(start) = rest.find("<!--") {
        out.push_str(&rest[..start]);
        let end = rest[start..]
            .find("-->")
            .map_or(rest.len(), |e| start + e + 3);
        out.extend(rest[start..end].chars().filter(|&c| c == '\n'));
        rest = &rest[end..];
    }
    out.push_str(rest);
    Doc { prose: out, blocks }
}

fn line_of(text: &str, offset: usize) -> usize {
    text[..offset].matches('\n').count() + 1
}

/// Inline code spans of the prose: (line, content), and the prose with them blanked.
fn code_spans(prose: &str) -> (Vec<(usize, String)>, String) {
    let bytes = prose.as_bytes();
    let mut spans = Vec::new();
    let mut blanked = String::with_capacity(prose.len());
    let mut i = 0;
    let mut copied = 0;
    while i < bytes.len() {
        if bytes[i] != b'`' {
            i += 1;
            continue;
        }
        let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
        let open_end = i + run;
        // The closing run: the same number of backticks, before a blank line.
        let mut j = open_end;
        let mut close = None;
        while j < bytes.len() {
            if bytes[j] == b'`' {
                let r = bytes[j..].iter().take_while(|&&b| b == b'`').count();
                if r == run {
                    close = Some(j);
                    break;
                }
                j += r;
            } else if bytes[j] == b'\n' && bytes.get(j + 1) == Some(&b'\n') {
                break;
            } else {
                j += 1;
            }
        }
        match close {
            Some(j) => {
                let content = prose[open_end..j].replace('\n', " ");
                spans.push((line_of(prose, i), content.trim().to_string()));
                blanked.push_str(&prose[copied..i]);
                blanked.extend(
                    prose[i..j + run]
                        .chars()
                        .map(|c| if c == '\n' { '\n' } else { ' ' }),
                );
                i = j + run;
                copied = i;
            }
            None => i = open_end,
        }
    }
    blanked.push_str(&prose[copied..]);
    (spans, blanked)
}

/// The anchors a Markdown file offers: its headings' slugs (duplicates `-1`, `-2`, ...)
/// and the `id`/`name` of its HTML anchors.
fn anchors(text: &str) -> HashSet<String> {
    let doc = parse_doc(text);
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = HashSet::new();
    for line in doc.prose.split('\n') {
        let indent = line.len() - line.trim_start_matches(' ').len();
        let t = line.trim_start_matches(' ');
        let hashes = t.chars().take_while(|&c| c == '#').count();
        let after = &t[hashes..];
        if indent <= 3 && (1..=6).contains(&hashes) && (after.is_empty() || after.starts_with(' '))
        {
            let title = after.trim().trim_end_matches('#').trim_end();
            let base = slug(title);
            let n = seen.entry(base.clone()).or_insert(0);
            let s = if *n == 0 {
                base.clone()
            } else {
                format!("{base}-{n}")
            };
            *n += 1;
            out.insert(s);
        }
        for key in ["id=\"", "name=\""] {
            let mut rest = line;
            while let Some(p) = rest.find(key) {
                let v = &rest[p + key.len()..];
                if let Some(end) = v.find('"') {
                    out.insert(v[..end].to_string());
                }
                rest = &rest[p + key.len()..];
            }
        }
    }
    out
}

/// Relative link targets of the prose: (line, target).
fn link_targets(prose: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    // Inline links and images: `](target)`.
    let mut from = 0;
    while let Some(p) = prose[from..].find("](") {
        let start = from + p + 2;
        let mut depth = 1;
        let mut end = None;
        for (k, c) in prose[start..].char_indices() {
            match c {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        end = Some(start + k);
                        break;
                    }
                }
                '\n' => break,
                _ => {}
            }
        }
        if let Some(end) = end {
            let raw = prose[start..end].trim();
            let raw = raw.split_whitespace().next().unwrap_or("");
            let raw = raw.trim_start_matches('<').trim_end_matches('>');
            out.push((line_of(prose, start), raw.to_string()));
            from = end;
        } else {
            from = start;
        }
    }
    // Reference definitions: `[label]: target`.
    for (i, line) in prose.split('\n').enumerate() {
        let t = line.trim_start();
        if t.starts_with('[') {
            if let Some(p) = t.find("]: ") {
                if !t[..p].contains("](") {
                    let target = t[p + 3..].split_whitespace().next().unwrap_or("");
                    out.push((i + 1, target.to_string()));
                }
            }
        }
    }
    out
}

fn is_external(target: &str) -> bool {
    let lower = target.to_ascii_lowercase();
    lower.starts_with("http://")
        || lower.starts_with("https://")
        || lower.starts_with("mailto:")
        || lower.contains("://")
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' && i + 2 < bytes.len() {
            if let Ok(b) = u8::from_str_radix(&s[i + 1..i + 3], 16) {
                out.push(b);
                i += 3;
                continue;
            }
        }
        out.push(bytes[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn normalize(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

/// Every problem with the relative links of one file.
fn check_links(
    root: &Path,
    file: &Path,
    cache: &mut HashMap<PathBuf, HashSet<String>>,
) -> Vec<String> {
    let text = std::fs::read_to_string(file).expect("a readable Markdown file");
    let doc = parse_doc(&text);
    let (_, prose) = code_spans(&doc.prose);
    let name = display(root, file);
    let mut problems = Vec::new();
    for (line, target) in link_targets(&prose) {
        if is_external(&target) {
            continue;
        }
        if target.is_empty() {
            problems.push(format!("{name}:{line}: link `()`: the link has no target"));
            continue;
        }
        let (path_part, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let dest = if path_part.is_empty() {
            file.to_path_buf()
        } else {
            let decoded = percent_decode(path_part);
            normalize(&file.parent().expect("a file's folder").join(decoded))
        };
        if !dest.exists() {
            problems.push(format!(
                "{name}:{line}: link `{target}`: {} does not exist",
                display(root, &dest)
            ));
            continue;
        }
        let Some(anchor) = anchor else { continue };
        if dest.is_dir() || dest.extension().is_none_or(|e| e != "md") {
            problems.push(format!(
                "{name}:{line}: link `{target}`: an anchor into {}, which is not a Markdown file",
                display(root, &dest)
            ));
            continue;
        }
        let set = cache.entry(dest.clone()).or_insert_with(|| {
            anchors(&std::fs::read_to_string(&dest).expect("a readable Markdown file"))
        });
        let anchor = percent_decode(anchor);
        if !set.contains(&anchor) {
            let near: Vec<&String> = {
                let mut v: Vec<&String> = set
                    .iter()
                    .filter(|a| {
                        let head: String = anchor.chars().take(8).collect();
                        a.starts_with(&head)
                    })
                    .collect();
                v.sort();
                v.truncate(3);
                v
            };
            problems.push(format!(
                "{name}:{line}: link `{target}`: {} has no heading whose anchor is `#{anchor}`{}",
                display(root, &dest),
                if near.is_empty() {
                    String::new()
                } else {
                    format!(" (close: {near:?})")
                }
            ));
        }
    }
    problems
}

/// Code quoted in a file: fenced blocks and inline spans, as (line, text).
fn quoted_code(text: &str) -> Vec<(usize, String)> {
    let doc = parse_doc(text);
    let (spans, _) = code_spans(&doc.prose);
    let mut out = doc.blocks;
    out.extend(spans);
    out
}

const PATH_ROOTS: [&str; 5] = ["config/", "scripts/", "examples/", "deploy/", "docs/"];

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '/' | '-' | '*')
}

/// Path-looking tokens under the checked roots in a piece of code.
fn path_tokens(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let chars: Vec<(usize, char)> = code.char_indices().collect();
    for (k, &(at, _)) in chars.iter().enumerate() {
        let rest = &code[at..];
        if !PATH_ROOTS.iter().any(|p| rest.starts_with(p)) {
            continue;
        }
        // A token starts here: at the start, after a character that is not part of a
        // path, or after `./` that follows such a character.
        let before = |n: usize| if k >= n { Some(chars[k - n].1) } else { None };
        let starts = match before(1) {
            None => true,
            Some('/') if before(2) == Some('.') => before(3).is_none_or(|c| !is_path_char(c)),
            Some(c) => !is_path_char(c),
        };
        if !starts {
            continue;
        }
        // Path characters, and a shell brace list (`visit-{1,2,3}.md`) inside braces.
        let mut token = String::new();
        let mut depth = 0;
        for c in rest.chars() {
            match c {
                '{' => depth += 1,
                '}' if depth > 0 => depth -= 1,
                ',' if depth > 0 => {}
                c if is_path_char(c) => {}
                _ => break,
            }
            token.push(c);
        }
        if depth > 0 {
            token.truncate(token.find('{').expect("an open brace"));
        }
        let token = token.trim_end_matches(['.', ',', ':']).to_string();
        out.extend(expand_braces(&token));
    }
    out
}

/// A shell brace list expanded: `a-{1,2}.md` is `a-1.md` and `a-2.md`.
fn expand_braces(token: &str) -> Vec<String> {
    let (Some(open), Some(close)) = (token.find('{'), token.find('}')) else {
        return vec![token.to_string()];
    };
    if close < open {
        return vec![token.to_string()];
    }
    let (head, tail) = (&token[..open], &token[close + 1..]);
    token[open + 1..close]
        .split(',')
        .flat_map(|alt| expand_braces(&format!("{head}{alt}{tail}")))
        .collect()
}

/// A file-name component that stands for any name (`NAME.toml`, `X`).
fn is_placeholder(component: &str) -> bool {
    let stem = component.split('.').next().unwrap_or("");
    !stem.is_empty()
        && stem
            .chars()
            .all(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_')
        && stem.chars().any(|c| c.is_ascii_uppercase())
}

fn glob_matches(pattern: &str, name: &str) -> bool {
    match pattern.split_once('*') {
        None => pattern == name,
        Some((head, tail)) => {
            name.len() >= head.len() + tail.len()
                && name.starts_with(head)
                && (tail.contains('*') || name.ends_with(tail))
        }
    }
}

/// Whether a quoted path names something in the repository: as it is, or, for a
/// placeholder or a glob in its last component, in a folder that exists (and, for a
/// glob, holds a match).
fn path_exists(root: &Path, token: &str) -> Result<(), String> {
    let trimmed = token.trim_end_matches('/');
    if root.join(trimmed).exists() {
        return Ok(());
    }
    let (dir, last) = trimmed.rsplit_once('/').unwrap_or(("", trimmed));
    if dir.contains('*') || dir.split('/').any(is_placeholder) {
        return Err("a placeholder or glob before the last component".into());
    }
    let folder = root.join(dir);
    if last.contains('*') {
        let names: Vec<String> = std::fs::read_dir(&folder)
            .map_err(|_| format!("{dir}/ does not exist"))?
            .filter_map(|e| e.ok().map(|e| e.file_name().to_string_lossy().into_owned()))
            .collect();
        return if names.iter().any(|n| glob_matches(last, n)) {
            Ok(())
        } else {
            Err(format!("nothing in {dir}/ matches {last}"))
        };
    }
    if is_placeholder(last) {
        return if folder.is_dir() {
            Ok(())
        } else {
            Err(format!("{dir}/ does not exist"))
        };
    }
    Err("no such file or folder".into())
}

/// Shell-like words of one command line; operators are words of their own.
fn shell_words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut quote: Option<char> = None;
    let mut has = false;
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        match quote {
            Some(q) => {
                if c == q {
                    quote = None;
                } else {
                    cur.push(c);
                }
            }
            None => match c {
                '\'' | '"' => {
                    quote = Some(c);
                    has = true;
                }
                ' ' | '\t' => {
                    if has {
                        words.push(std::mem::take(&mut cur));
                        has = false;
                    }
                }
                '#' if !has => break,
                '|' | ';' | '&' | '>' | '<' => {
                    if has {
                        words.push(std::mem::take(&mut cur));
                        has = false;
                    }
                    let mut op = c.to_string();
                    if let Some(&n) = chars.peek() {
                        if (c == '|' || c == '&' || c == '>') && n == c {
                            op.push(n);
                            chars.next();
                        }
                    }
                    words.push(op);
                }
                _ => {
                    cur.push(c);
                    has = true;
                }
            },
        }
    }
    if has {
        words.push(cur);
    }
    words
}

fn is_operator(w: &str) -> bool {
    matches!(w, "|" | "||" | "&" | "&&" | ";" | ">" | ">>" | "<")
}

fn is_assignment(w: &str) -> bool {
    match w.split_once('=') {
        Some((name, _)) => {
            !name.is_empty()
                && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                && !name.starts_with(|c: char| c.is_ascii_digit())
        }
        None => false,
    }
}

/// A yatt command found in quoted code: the binary ("yatt" or "yatt-node") and its
/// arguments.
struct YattCommand {
    bin: &'static str,
    args: Vec<String>,
}

/// The yatt commands of a piece of code, each with the line it starts on (relative).
fn yatt_commands(code: &str) -> Vec<(usize, YattCommand)> {
    let mut vars: HashMap<String, String> = HashMap::new();
    let mut out = Vec::new();
    // Join continued lines.
    let mut logical: Vec<(usize, String)> = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, line) in code.split('\n').enumerate() {
        let (start, mut text) = pending.take().unwrap_or((i, String::new()));
        let t = line.trim_end();
        if let Some(stripped) = t.strip_suffix('\\') {
            text.push_str(stripped);
            text.push(' ');
            pending = Some((start, text));
        } else {
            text.push_str(t);
            logical.push((start, text));
        }
    }
    if let Some(p) = pending {
        logical.push(p);
    }
    for (i, line) in logical {
        let line = line.trim_start().trim_start_matches("$ ");
        let words = shell_words(line);
        let mut k = 0;
        while k < words.len() {
            // A command position: skip assignments and prefixes.
            let mut j = k;
            while j < words.len()
                && (is_assignment(&words[j])
                    || matches!(
                        words[j].as_str(),
                        "time" | "exec" | "sudo" | "nohup" | "then" | "do" | "!"
                    ))
            {
                if is_assignment(&words[j]) && (j + 1 == words.len() || is_operator(&words[j + 1]))
                {
                    let (name, value) = words[j].split_once('=').expect("an assignment");
                    vars.insert(name.to_string(), value.to_string());
                }
                j += 1;
            }
            let end = (j..words.len())
                .find(|&m| is_operator(&words[m]))
                .unwrap_or(words.len());
            if j < end {
                let mut cmd = words[j].clone();
                if let Some(name) = cmd.strip_prefix('$') {
                    let name = name.trim_start_matches('{').trim_end_matches('}');
                    if let Some(v) = vars.get(name) {
                        cmd = v.clone();
                    }
                }
                let base = cmd.rsplit('/').next().unwrap_or("");
                let bin = match base {
                    "yatt" => Some("yatt"),
                    "yatt-node" => Some("yatt-node"),
                    _ => None,
                };
                if let Some(bin) = bin {
                    out.push((
                        i,
                        YattCommand {
                            bin,
                            args: words[j + 1..end].to_vec(),
                        },
                    ));
                }
            }
            k = end + 1;
        }
    }
    out
}

/// The binaries the commands are checked against.
fn binary(name: &str) -> Result<PathBuf, String> {
    let built = match name {
        "yatt" => option_env!("CARGO_BIN_EXE_yatt"),
        _ => option_env!("CARGO_BIN_EXE_yatt-node"),
    };
    let var = if name == "yatt" {
        "YATT_BIN"
    } else {
        "YATT_NODE_BIN"
    };
    let path = built
        .map(PathBuf::from)
        .or_else(|| std::env::var_os(var).map(PathBuf::from))
        .ok_or_else(|| {
            format!("no `{name}` binary to check the docs' commands against: build it with cargo (CARGO_BIN_EXE_{name}) or set {var}")
        })?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "`{name}` binary {} does not exist ({var} or CARGO_BIN_EXE_{name})",
            path.display()
        ))
    }
}

/// `BIN WORDS... --help`: its output when it succeeds.
fn help(
    bins: &HashMap<&str, PathBuf>,
    cache: &mut HashMap<(String, Vec<String>), Option<String>>,
    bin: &str,
    words: &[String],
) -> Option<String> {
    cache
        .entry((bin.to_string(), words.to_vec()))
        .or_insert_with(|| {
            let out = Command::new(&bins[bin])
                .args(words)
                .arg("--help")
                .output()
                .ok()?;
            out.status.success().then(|| {
                let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
                s.push_str(&String::from_utf8_lossy(&out.stderr));
                s
            })
        })
        .clone()
}

fn lists_flag(help: &str, flag: &str) -> bool {
    help.match_indices(flag).any(|(p, _)| {
        let next = help[p + flag.len()..].chars().next();
        let prev = help[..p].chars().next_back();
        next.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '-' || c == '_'))
            && prev.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '-'))
    })
}

#[test]
fn slug_follows_github_rules() {
    assert_eq!(
        slug("Reliability: what survives what"),
        "reliability-what-survives-what"
    );
    assert_eq!(slug("`yatt generate`"), "yatt-generate");
    assert_eq!(
        slug("Configuration reference (`yatt-node run`)"),
        "configuration-reference-yatt-node-run"
    );
    assert_eq!(
        slug("The ~70 % plateau: what limits it"),
        "the-70--plateau-what-limits-it"
    );
    assert_eq!(
        slug("Asynchronous RL (`rollout.staleness`)"),
        "asynchronous-rl-rolloutstaleness"
    );
    assert_eq!(
        slug("GPU check on an H200, 2026-11-28: CUDA IPC"),
        "gpu-check-on-an-h200-2026-11-28-cuda-ipc"
    );
    assert_eq!(
        slug("Writing your own actor or `Role`"),
        "writing-your-own-actor-or-role"
    );
    assert_eq!(
        slug("snake_case and [a link](x.md)"),
        "snake_case-and-a-link"
    );
    let set =
        anchors("# A\n\n## Step\n\n```\n# Step\n```\n\n## Step\n\n### Step\n<a id=\"here\"></a>\n");
    for a in ["a", "step", "step-1", "step-2", "here"] {
        assert!(set.contains(a), "{a} missing from {set:?}");
    }
    assert!(
        !set.contains("step-3"),
        "a heading inside a code block counted: {set:?}"
    );
}

#[test]
fn relative_links_and_anchors_resolve() {
    let root = repo_root();
    let mut cache = HashMap::new();
    let mut problems = Vec::new();
    let files = markdown_files(&root);
    assert!(
        files.len() > 5,
        "found only {files:?} under {}",
        root.display()
    );
    for file in &files {
        problems.extend(check_links(&root, file, &mut cache));
    }
    assert!(
        problems.is_empty(),
        "{} broken link(s) in the docs:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn quoted_paths_exist() {
    let root = repo_root();
    let mut problems = Vec::new();
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(&file).expect("a readable Markdown file");
        let name = display(&root, &file);
        for (line, code) in quoted_code(&text) {
            for (offset, piece) in code.split('\n').enumerate() {
                for token in path_tokens(piece) {
                    if let Err(why) = path_exists(&root, &token) {
                        problems.push(format!("{name}:{}: `{token}`: {why}", line + offset));
                    }
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "{} quoted path(s) that do not exist:\n{}",
        problems.len(),
        problems.join("\n")
    );
}

#[test]
fn quoted_yatt_commands_use_real_flags() {
    let root = repo_root();
    let mut bins = HashMap::new();
    for name in ["yatt", "yatt-node"] {
        match binary(name) {
            Ok(p) => {
                bins.insert(name, p);
            }
            Err(e) => panic!("{e}"),
        }
    }
    let mut helps = HashMap::new();
    let mut problems = Vec::new();
    let mut checked = 0;
    for file in markdown_files(&root) {
        let text = std::fs::read_to_string(&file).expect("a readable Markdown file");
        let name = display(&root, &file);
        for (line, code) in quoted_code(&text) {
            for (offset, cmd) in yatt_commands(&code) {
                checked += 1;
                let at = line + offset;
                let shown = format!("{} {}", cmd.bin, cmd.args.join(" "));
                // Subcommand words: the leading arguments that look like one.
                let words: Vec<String> = cmd
                    .args
                    .iter()
                    .take_while(|w| {
                        w.starts_with(|c: char| c.is_ascii_lowercase())
                            && w.chars()
                                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-')
                    })
                    .cloned()
                    .collect();
                let mut depth = words.len();
                let text = loop {
                    if let Some(h) = help(&bins, &mut helps, cmd.bin, &words[..depth]) {
                        break h;
                    }
                    if depth == 0 {
                        break String::new();
                    }
                    depth -= 1;
                };
                if !words.is_empty() && depth == 0 {
                    problems.push(format!("{name}:{at}: `{shown}`: `{} {}` is not a subcommand (`{} {} --help` fails)", cmd.bin, words[0], cmd.bin, words[0]));
                    continue;
                }
                let sub = std::iter::once(cmd.bin.to_string())
                    .chain(words[..depth].iter().cloned())
                    .collect::<Vec<_>>()
                    .join(" ");
                for arg in &cmd.args {
                    if arg == "--" {
                        break;
                    }
                    if !arg.starts_with("--") || arg.len() < 3 {
                        continue;
                    }
                    let flag = arg.split('=').next().expect("a flag");
                    if !lists_flag(&text, flag) {
                        problems.push(format!(
                            "{name}:{at}: `{shown}`: `{sub} --help` does not list {flag}"
                        ));
                    }
                }
            }
        }
    }
    assert!(
        checked > 10,
        "found only {checked} yatt command(s) in the docs"
    );
    assert!(
        problems.is_empty(),
        "{} quoted command(s) with an unknown subcommand or flag:\n{}",
        problems.len(),
        problems.join("\n")
    );
}
