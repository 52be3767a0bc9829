//! The workspace's layout rules, checked on its sources:
//! - no import cycle between the files of a crate (a file's `use crate::…`,
//!   `super::…`, `self::…` and child-module paths are its edges);
//! - no `.rs` file over 1,200 lines;
//! - library crates keep their modules private: `lib.rs` has no `pub mod` but the
//!   namespaces listed in `NAMESPACES`, each with its reason.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 1200;

/// The library crates: name and source directory, relative to the workspace root.
const LIBRARIES: [(&str, &str); 7] = [
    ("yatt-runtime", "runtime/src"),
    ("yatt-engine", "engine/src"),
    ("yatt-metrics", "metrics/src"),
    ("yatt-placement", "placement/src"),
    ("yatt-sim", "sim/src"),
    ("yatt-roles", "roles/src"),
    ("yatt-trainer", "trainer/src"),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | ".venv" | "node_modules")
                && !name.starts_with("target")
            {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// The module path of `file` in the crate rooted at `src` (`lib.rs` is the root).
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel
        .components()
        .map(|c| c.as_os_str().to_string_lossy().to_string())
        .collect();
    if parts.last().is_some_and(|p| p == "mod") {
        parts.pop();
    }
    if parts == ["lib"] || parts == ["main"] {
        parts.clear();
    }
    parts
}

/// Source without comments (line and block) and string literals, so that paths in
/// docs or messages are not read as imports.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
            i += 2;
            while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                i += 1;
            }
            i += 2;
        } else if b[i] == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else {
            out.push(b[i] as char);
            i += 1;
        }
    }
    out
}

/// Every `a::b::c` path in `code` (identifier segments joined by `::`), including those
/// inside `use` trees, flattened one level (`crate::x::{a, b}` gives `crate::x::a` and
/// `crate::x::b`).
fn paths(code: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    let mut i = 0;
    while i < chars.len() {
        if ident(chars[i]) && (i == 0 || !(ident(chars[i - 1]) || chars[i - 1] == ':')) {
            let mut segs = Vec::new();
            let mut j = i;
            loop {
                let start = j;
                while j < chars.len() && ident(chars[j]) {
                    j += 1;
                }
                segs.push(chars[start..j].iter().collect::<String>());
                if chars.get(j) == Some(&':') && chars.get(j + 1) == Some(&':') {
                    j += 2;
                    if chars.get(j) == Some(&'{') {
                        // One level of a use tree.
                        let close = chars[j..].iter().position(|&c| c == '}').map(|p| p + j);
                        if let Some(close) = close {
                            let inner: String = chars[j + 1..close].iter().collect();
                            for item in inner.split(',') {
                                let item = item.trim();
                                let head = item.split_whitespace().next().unwrap_or("");
                                let mut p = segs.clone();
                                p.extend(head.split("::").map(str::to_string));
                                out.push(p);
                            }
                            j = close + 1;
                        }
                        segs.clear();
                        break;
                    }
                    if j < chars.len() && ident(chars[j]) {
                        continue;
                    }
                }
                break;
            }
            if segs.len() > 1 {
                out.push(segs);
            }
            i = j.max(i + 1);
        } else {
            i += 1;
        }
    }
    out
}

/// The file-level import graph of the crate in `src`: module → modules it imports from.
fn import_graph(src: &Path) -> BTreeMap<Vec<String>, BTreeSet<Vec<String>>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let modules: BTreeMap<Vec<String>, PathBuf> = files
        .iter()
        .map(|f| (module_of(src, f), f.clone()))
        .collect();
    let mut graph = BTreeMap::new();
    for (me, file) in &modules {
        let code = code_only(&std::fs::read_to_string(file).unwrap());
        let mut edges = BTreeSet::new();
        for p in paths(&code) {
            let absolute: Vec<String> = match p[0].as_str() {
                "crate" => p[1..].to_vec(),
                "super" => {
                    let mut base = me[..me.len().saturating_sub(1)].to_vec();
                    let mut rest = &p[1..];
                    while rest.first().is_some_and(|s| s == "super") {
                        base.pop();
                        rest = &rest[1..];
                    }
                    base.extend(rest.iter().cloned());
                    base
                }
                "self" => me.iter().chain(&p[1..]).cloned().collect(),
                _ => me.iter().chain(&p[..]).cloned().collect(),
            };
            // The longest prefix that is a module of this crate is the file imported.
            let target = (1..=absolute.len())
                .rev()
                .map(|n| absolute[..n].to_vec())
                .find(|m| modules.contains_key(m));
            if let Some(t) = target {
                if &t != me {
                    edges.insert(t);
                }
            }
        }
        graph.insert(me.clone(), edges);
    }
    graph
}

/// Strongly connected components of more than one module (Tarjan).
fn cycles(graph: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>) -> Vec<Vec<String>> {
    struct State<'a> {
        graph: &'a BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
        index: BTreeMap<&'a Vec<String>, usize>,
        low: BTreeMap<&'a Vec<String>, usize>,
        stack: Vec<&'a Vec<String>>,
        on_stack: BTreeSet<&'a Vec<String>>,
        next: usize,
        found: Vec<Vec<String>>,
    }
    fn visit<'a>(s: &mut State<'a>, v: &'a Vec<String>) {
        s.index.insert(v, s.next);
        s.low.insert(v, s.next);
        s.next += 1;
        s.stack.push(v);
        s.on_stack.insert(v);
        for w in &s.graph[v] {
            let Some((w, _)) = s.graph.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let lw = s.low[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(lw);
            } else if s.on_stack.contains(w) {
                let iw = s.index[w];
                let lv = s.low.get_mut(v).unwrap();
                *lv = (*lv).min(iw);
            }
        }
        if s.low[v] == s.index[v] {
            let mut comp = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack.remove(w);
                comp.push(if w.is_empty() {
                    "lib".into()
                } else {
                    w.join("::")
                });
                if w == v {
                    break;
                }
            }
            if comp.len() > 1 {
                comp.sort();
                s.found.push(comp);
            }
        }
    }
    let mut s = State {
        graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        next: 0,
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !s.index.contains_key(v) {
            visit(&mut s, v);
        }
    }
    s.found
}

#[test]
fn no_import_cycle_between_the_files_of_a_crate() {
    let mut crates: Vec<(String, PathBuf)> = LIBRARIES
        .iter()
        .map(|(n, d)| (n.to_string(), root().join(d)))
        .collect();
    crates.push(("yatt (facade)".into(), root().join("src")));
    let mut found = Vec::new();
    for (name, src) in &crates {
        assert!(src.is_dir(), "{} is missing", src.display());
        let mut graph = import_graph(src);
        // The crate root declares every module and re-exports the public API: its
        // edges are the module tree, not imports.
        graph.remove(&Vec::new());
        for c in cycles(&graph) {
            found.push(format!("{name}: {}", c.join(" ↔ ")));
        }
    }
    assert!(
        found.is_empty(),
        "files that import each other (move what both need into a leaf file):\n{}",
        found.join("\n")
    );
}

#[test]
fn no_source_file_is_over_1200_lines() {
    let mut files = Vec::new();
    rust_files(&root(), &mut files);
    let long: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = std::fs::read_to_string(f).ok()?.lines().count();
            (n > MAX_LINES).then(|| format!("{} ({n} lines)", f.display()))
        })
        .collect();
    assert!(
        long.is_empty(),
        "split these by concern (at most {MAX_LINES} lines each):\n{}",
        long.join("\n")
    );
}

/// The public modules a library's `lib.rs` may have: namespaces chosen on purpose, each
/// with its reason. Anything else is a private module behind `pub use`.
const NAMESPACES: [(&str, &str, &str); 6] = [
    (
        "yatt-engine",
        "gguf",
        "the GGUF importer's re-exports, kept together",
    ),
    (
        "yatt-engine",
        "score",
        "scoring's batch and result types, kept together",
    ),
    (
        "yatt-engine",
        "bench",
        "`yatt bench engine`, behind the `bench` feature",
    ),
    (
        "yatt-engine",
        "fixtures",
        "test fixtures, behind the `test-fixtures` feature",
    ),
    (
        "yatt-runtime",
        "testing",
        "stream tags for the runtime's own tests, doc(hidden)",
    ),
    (
        "yatt-metrics",
        "names",
        "the metric names: `names::GEN_S` reads better than a bare GEN_S",
    ),
];

#[test]
fn library_crates_keep_their_modules_private() {
    let mut public = Vec::new();
    for (name, dir) in LIBRARIES {
        let lib = root().join(dir).join("lib.rs");
        let text = std::fs::read_to_string(&lib).unwrap();
        for line in code_only(&text).lines() {
            let t = line.trim_start();
            let Some(rest) = t.strip_prefix("pub mod ") else {
                continue;
            };
            let module: String = rest
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if !NAMESPACES
                .iter()
                .any(|(c, m, _)| *c == name && *m == module)
            {
                public.push(format!("{name}: {}", t.trim()));
            }
        }
    }
    assert!(
        public.is_empty(),
        "make these modules private and `pub use` what users need:\n{}",
        public.join("\n")
    );
}

#[test]
fn the_cycle_finder_finds_a_cycle() {
    // The rule above must be able to fail: two files that import each other.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("lib.rs"), "mod a;\nmod b;\n").unwrap();
    std::fs::write(dir.path().join("a.rs"), "use crate::b::B;\npub struct A;\n").unwrap();
    std::fs::write(dir.path().join("b.rs"), "use super::a::A;\npub struct B;\n").unwrap();
    let mut graph = import_graph(dir.path());
    graph.remove(&Vec::new());
    assert_eq!(cycles(&graph), vec![vec!["a".to_string(), "b".to_string()]]);
}
