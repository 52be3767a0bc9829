//! A real browser for the live-view tests: the distribution's headless Chromium, run
//! once per page load (`--dump-dom` after the page's scripts ran, or `--screenshot`),
//! and a plain HTTP/1.1 client over `std::net` for requests a browser would not send.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::poll;

/// The Chromium binary: `$YATT_CHROMIUM`, or Debian's `/usr/bin/chromium`. Panics,
/// saying how to install it, when there is none: the view tests need a real browser.
pub fn chromium() -> PathBuf {
    let path: PathBuf = std::env::var_os("YATT_CHROMIUM")
        .map(Into::into)
        .unwrap_or_else(|| "/usr/bin/chromium".into());
    assert!(
        path.is_file(),
        "no browser at {}: the live-view tests load the page in headless Chromium; install it with `apt-get install -y chromium chromium-driver` (scripts/bootstrap.sh does), or point YATT_CHROMIUM at one",
        path.display()
    );
    path
}

/// Runs Chromium headless on `url` with `extra` arguments and the page given `budget_ms`
/// of virtual time for its scripts (its fetches to the server are real); returns what
/// it printed on stdout. Fails after 60 s.
fn run_chromium(url: &str, budget_ms: u64, extra: &[String]) -> String {
    let profile = tempfile::tempdir().expect("profile dir");
    let out = tempfile::NamedTempFile::new().expect("stdout file");
    let mut child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-dev-shm-usage",
        ])
        .arg(format!("--user-data-dir={}", profile.path().display()))
        .arg(format!("--virtual-time-budget={budget_ms}"))
        .args(extra)
        .arg(url)
        .stdin(Stdio::null())
        .stdout(out.reopen().expect("stdout file"))
        .stderr(Stdio::null())
        .spawn()
        .expect("start chromium");
    let status = poll(Duration::from_secs(60), || child.try_wait().ok().flatten());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
        panic!("chromium did not finish loading {url} within 60 s");
    }
    std::fs::read_to_string(out.path()).unwrap_or_default()
}

/// The page at `url` as the browser rendered it, after its scripts had `budget_ms`.
pub fn dump_dom(url: &str, budget_ms: u64) -> String {
    let dom = run_chromium(url, budget_ms, &["--dump-dom".into()]);
    assert!(
        dom.contains("<html"),
        "chromium printed no page for {url}: {dom:.300}"
    );
    dom
}

/// Saves a 1400×1700 screenshot of `url` to `path`.
pub fn screenshot(url: &str, budget_ms: u64, path: &Path) {
    run_chromium(
        url,
        budget_ms,
        &[
            "--window-size=1400,1700".into(),
            "--hide-scrollbars".into(),
            format!("--screenshot={}", path.display()),
        ],
    );
    assert!(
        path.is_file(),
        "no screenshot of {url} at {}",
        path.display()
    );
}

/// The opening tags in `dom` that contain `needle` (e.g. `class="event"`).
pub fn tags_with<'a>(dom: &'a str, needle: &str) -> Vec<&'a str> {
    dom.match_indices('<')
        .filter_map(|(i, _)| dom[i..].find('>').map(|j| &dom[i..i + j + 1]))
        .filter(|t| t.contains(needle))
        .collect()
}

/// The value of attribute `name` in an opening `tag`.
pub fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let at = tag.find(&key)? + key.len();
    tag[at..].find('"').map(|end| &tag[at..at + end])
}

/// The element with `id="ID"`'s attribute `name`.
pub fn attr_of<'a>(dom: &'a str, id: &str, name: &str) -> Option<&'a str> {
    tags_with(dom, &format!("id=\"{id}\""))
        .first()
        .and_then(|t| attr(t, name))
}

/// The text of each `<li class="event" ...>` with its kind: `(kind, text)`.
pub fn events(dom: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for (i, _) in dom.match_indices("<li class=\"event\"") {
        let tag_end = dom[i..].find('>').map_or(i, |j| i + j + 1);
        let kind = attr(&dom[i..tag_end], "data-kind")
            .unwrap_or("")
            .to_string();
        let end = dom[tag_end..]
            .find("</li>")
            .map_or(dom.len(), |j| tag_end + j);
        let text = strip_tags(&dom[tag_end..end]);
        out.push((kind, text));
    }
    out
}

fn strip_tags(s: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in s.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out.replace("&gt;", ">")
        .replace("&lt;", "<")
        .replace("&amp;", "&")
}

/// One raw HTTP/1.1 request (`request` is the whole head, e.g. "GET / HTTP/1.1\r\n...")
/// to `addr`; returns the status code and body. 10 s timeouts.
pub fn http_raw(addr: SocketAddr, request: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(10)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(10))).ok()?;
    s.set_write_timeout(Some(Duration::from_secs(10))).ok()?;
    s.write_all(request.as_bytes()).ok()?;
    let mut buf = Vec::new();
    let _ = s.take(4 << 20).read_to_end(&mut buf);
    let text = String::from_utf8_lossy(&buf).to_string();
    let code = text.split(' ').nth(1)?.parse().ok()?;
    let body = text
        .split_once("\r\n\r\n")
        .map_or(String::new(), |(_, b)| b.to_string());
    Some((code, body))
}

/// `GET path` on `addr`, with the connection closed after the answer.
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    http_raw(
        addr,
        &format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"),
    )
}

/// The `http://127.0.0.1:PORT/` a `yatt train --http` or `yatt view` printed in the
/// file `log`, waiting at most `timeout` for it.
pub fn printed_url(log: &Path, timeout: Duration) -> Option<(String, SocketAddr)> {
    poll(timeout, || {
        let text = std::fs::read_to_string(log).ok()?;
        let at = text.find("view: http://")? + "view: http://".len();
        let addr: SocketAddr = text[at..].split('/').next()?.parse().ok()?;
        Some((format!("http://{addr}/"), addr))
    })
}
