//! The live web view in a real browser (the distribution's headless Chromium): the page
//! `yatt train --http` serves during a live-placement run that moves a group and during
//! a 3-daemon run that loses a node, the cluster page of a `yatt-node`, and `yatt view`
//! over the finished runs. The tests read the rendered DOM: the nodes and their roles,
//! the curves' point counts against the finished steps, the move and the recovery in
//! the event list. A third test sends hostile queries and 200 connections at a run's
//! server: clear errors, `/health` still answers, the run finishes, memory stays put.
//!
//! With `YATT_VIEW_SCREENSHOTS=DIR` the browser also saves screenshots of the views
//! there (docs/img/ holds the ones in docs/live-view.md).

use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use yatt_integration_tests::browser::{
    attr, attr_of, dump_dom, events, http_get, http_raw, printed_url, screenshot, tags_with,
};
use yatt_integration_tests::{
    metric_of_steps, placed, poll, steps_done, wait_for_steps, yatt_bin, Cluster,
};

const LIVE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../config/live-placement-cluster.toml"
);
const DEMO: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../config/demo-letters.toml");
/// Virtual time the page's scripts get before the DOM is read (its first poll answers
/// in milliseconds; this leaves room for a few more).
const BUDGET_MS: u64 = 3000;

/// Saves a screenshot of `url` as `name` when `YATT_VIEW_SCREENSHOTS` names a directory.
fn maybe_screenshot(url: &str, name: &str) {
    if let Some(dir) = std::env::var_os("YATT_VIEW_SCREENSHOTS") {
        screenshot(url, BUDGET_MS, &Path::new(&dir).join(name));
    }
}

/// The points of the chart `id` and the step the page's summary shows.
fn points_and_step(dom: &str, chart: &str) -> (u64, u64) {
    let n = |v: Option<&str>| v.and_then(|x| x.parse().ok()).unwrap_or(u64::MAX);
    (
        n(attr_of(dom, chart, "data-points")),
        n(attr_of(dom, "run-summary", "data-step")),
    )
}

/// Asserts the cluster table lists each of `nodes` and, alive somewhere, an actor of
/// each of `roles`.
fn assert_nodes_and_roles(dom: &str, nodes: &[&str], roles: &[&str]) {
    let rows = tags_with(dom, "class=\"node\"");
    for n in nodes {
        assert!(
            rows.iter().any(|t| attr(t, "data-node") == Some(n)),
            "node {n} is not listed: {rows:?}"
        );
    }
    let actors = tags_with(dom, "class=\"actor\"");
    for r in roles {
        assert!(
            actors
                .iter()
                .any(|t| attr(t, "data-role") == Some(r) && attr(t, "data-alive") == Some("true")),
            "no live {r} actor listed: {actors:?}"
        );
    }
}

/// The holders the cluster table shows on `node`'s devices (each device's
/// `data-holder`, empty when none holds it).
fn holders_on<'a>(dom: &'a str, node: &str) -> Vec<&'a str> {
    let row_of = |at: usize| {
        let tag = &dom[at..at + dom[at..].find('>').unwrap_or(0)];
        attr(tag, "class") == Some("node") && attr(tag, "data-node") == Some(node)
    };
    let Some((at, _)) = dom.match_indices("<tr ").find(|(at, _)| row_of(*at)) else {
        return Vec::new();
    };
    let row = &dom[at..at + dom[at..].find("</tr>").unwrap_or(dom.len() - at)];
    tags_with(row, "class=\"device\"")
        .into_iter()
        .filter_map(|t| attr(t, "data-holder"))
        .collect()
}

/// Asserts that the page lists `role` as a holder of a device of `node`.
fn assert_held_on(dom: &str, node: &str, role: &str, page: &str) {
    let holders = holders_on(dom, node);
    assert!(
        holders.iter().any(|h| h.contains(role)),
        "{page} does not show {role} holding a device of {node}: {holders:?}"
    );
}

/// `yatt view OUT --http 0`, started; its URL, and the child (killed on drop).
struct ViewProc(std::process::Child);

impl Drop for ViewProc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn yatt_view(out: &Path) -> (ViewProc, String) {
    let log = out.join("view.log");
    let child = Command::new(yatt_bin())
        .arg("view")
        .arg(out)
        .args(["--http", "0"])
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&log).unwrap())
        .stderr(Stdio::null())
        .spawn()
        .expect("start yatt view");
    let proc = ViewProc(child);
    let (url, _) = printed_url(&log, Duration::from_secs(30)).expect("yatt view printed no URL");
    (proc, url)
}

/// The finished run in `out` through `yatt view`: every step a point, and an event of
/// `kind` whose text contains `text`.
fn assert_finished_view(out: &Path, steps: u64, kind: &str, text: &str, shot: &str) {
    let (_view, url) = yatt_view(out);
    let dom = dump_dom(&url, BUDGET_MS);
    assert_eq!(points_and_step(&dom, "chart-reward"), (steps, steps));
    assert_eq!(
        attr_of(&dom, "chart-step-time", "data-points"),
        Some(steps.to_string().as_str())
    );
    let ev = events(&dom);
    assert!(
        ev.iter().any(|(k, t)| k == kind && t.contains(text)),
        "no {kind} event with {text:?} in yatt view's page: {ev:?}"
    );
    // No cluster here: that half of the page stays hidden.
    assert!(
        attr_of(&dom, "cluster-view", "hidden").is_some(),
        "a finished run shows no cluster"
    );
    maybe_screenshot(&url, shot);
}

#[test]
fn the_live_view_shows_a_placement_move_and_the_nodes_roles_in_a_browser() {
    let t0 = Instant::now();
    let cluster = Cluster::start_with("vm", &[&[], &["--virtual-devices", "2"], &[]]);
    let out = tempfile::tempdir().unwrap();
    // Longer than the example so that the move (responses grow over the run) comes with
    // tens of steps still to go while the page is read.
    let steps = 80;
    let sets = [
        format!("job.steps={steps}"),
        "placement.nodes=[\"vm-1\", \"vm-2\"]".into(),
        "placement.reward=\"vm-0\"".into(),
    ];
    let mut run = cluster.spawn_train_with(LIVE, &sets, out.path(), false, &["--http", "0"]);
    let (url, _) = printed_url(run.stdout_path(), Duration::from_secs(60))
        .unwrap_or_else(|| panic!("yatt train --http printed no URL:\n{}", run.printed()));
    let log = out.path().join("placement.jsonl");
    let moved = poll(Duration::from_secs(150), || {
        let text = std::fs::read_to_string(&log).ok()?;
        text.lines()
            .any(|l| l.contains("\"kind\":\"migrated\"") && l.contains("\"ok\":true"))
            .then_some(())
    });
    assert!(moved.is_some(), "no move within 150 s:\n{}", run.printed());
    let before = steps_done(out.path()) as u64;
    let dom = dump_dom(&url, BUDGET_MS);
    let after = steps_done(out.path()) as u64;
    assert_nodes_and_roles(
        &dom,
        &["vm-0", "vm-1", "vm-2"],
        &["rollout", "policy", "reward"],
    );
    let (points, step) = points_and_step(&dom, "chart-reward");
    assert_eq!(
        points, step,
        "the reward curve has a point per finished step"
    );
    assert!(
        (before..=after).contains(&points),
        "{points} points; {before} to {after} steps were done while the page loaded"
    );
    let ev = events(&dom);
    assert!(
        ev.iter()
            .any(|(k, t)| k == "move" && t.contains("policy -> rollout")),
        "no move in the event list: {ev:?}"
    );
    assert!(ev.iter().any(|(k, _)| k == "migrated"), "{ev:?}");
    // The device the move gave the rollout shows it as its holder.
    let devices = tags_with(&dom, "class=\"device\"");
    assert!(
        devices
            .iter()
            .filter(|t| attr(t, "data-holder").is_some_and(|h| h.contains("rollout")))
            .count()
            >= 2,
        "two devices held by the rollout after the move: {devices:?}"
    );
    maybe_screenshot(&url, "live-view-placement.png");
    run.wait_success(Duration::from_secs(240), &cluster);
    assert_finished_view(
        out.path(),
        steps,
        "move",
        "policy -> rollout",
        "live-view-finished.png",
    );
    eprintln!(
        "live view of a live-placement run on 3 nodes ({steps} steps; page read at step {points}): {:.2?} in all",
        t0.elapsed()
    );
}

#[test]
fn the_live_view_shows_a_lost_node_and_its_roles_respawned_in_a_browser() {
    let t0 = Instant::now();
    let mut cluster = Cluster::start("vk", 3);
    let out = tempfile::tempdir().unwrap();
    // The demo's steps are short: enough of them that the run is still going when the
    // page is read after the recovery.
    let steps = 200;
    let sets = placed(
        "vk",
        steps,
        &[
            ("rollout", 0),
            ("policy", 1),
            ("reference", 1),
            ("reward", 2),
        ],
    );
    let mut run = cluster.spawn_train_with(DEMO, &sets, out.path(), false, &["--http", "0"]);
    let (url, _) = printed_url(run.stdout_path(), Duration::from_secs(60))
        .unwrap_or_else(|| panic!("yatt train --http printed no URL:\n{}", run.printed()));
    wait_for_steps(out.path(), 3, &run, &cluster);
    cluster.nodes[2].kill9();
    let recovered = poll(Duration::from_secs(90), || {
        let r = metric_of_steps(out.path(), "recovery/respawned_roles");
        r.first().copied()
    });
    let Some((recovered_at, _)) = recovered else {
        panic!("no recovery within 90 s:\n{}", run.printed())
    };
    let before = steps_done(out.path()) as u64;
    let dom = dump_dom(&url, BUDGET_MS);
    let after = steps_done(out.path()) as u64;
    assert_nodes_and_roles(
        &dom,
        &["vk-0", "vk-1", "vk-2"],
        &["rollout", "policy", "reward"],
    );
    let dead = tags_with(&dom, "data-node=\"vk-2\"");
    assert!(
        dead.iter().any(|t| attr(t, "data-alive") == Some("false")),
        "vk-2 is not shown dead: {dead:?}"
    );
    let (points, step) = points_and_step(&dom, "chart-reward");
    assert_eq!(points, step);
    assert!(
        (before..=after).contains(&points),
        "{points} not in {before}..={after}"
    );
    let ev = events(&dom);
    assert!(
        ev.iter()
            .any(|(k, t)| k == "recovery" && t.contains(&format!("step {recovered_at}"))),
        "no recovery of step {recovered_at} in the event list: {ev:?}"
    );
    assert!(
        ev.iter().any(|(k, t)| k == "death" && t.contains("vk-2")),
        "no death of vk-2: {ev:?}"
    );
    assert!(
        ev.iter()
            .any(|(k, t)| k == "actor_up" && t.contains("/reward/") && !t.starts_with("vk-2")),
        "the reward's respawn is not listed: {ev:?}"
    );
    // Who holds the devices, from the directory: roles of the daemons' processes.
    assert_held_on(&dom, "vk-1", "policy", "the trainer's page");
    assert_held_on(&dom, "vk-0", "rollout", "the trainer's page");
    assert!(
        holders_on(&dom, "vk-2").iter().all(|h| h.is_empty()),
        "the dead vk-2 holds nothing: {:?}",
        holders_on(&dom, "vk-2")
    );
    maybe_screenshot(&url, "live-view-recovery.png");
    // A daemon's own page: the cluster view alone.
    let node_url = format!("http://{}/", cluster.nodes[0].http);
    let node_dom = dump_dom(&node_url, BUDGET_MS);
    assert_nodes_and_roles(
        &node_dom,
        &["vk-0", "vk-1", "vk-2"],
        &["rollout", "policy", "reward"],
    );
    assert!(
        attr_of(&node_dom, "run-view", "hidden").is_some(),
        "a node has no run"
    );
    // Its own role, and roles another daemon's process holds.
    assert_held_on(&node_dom, "vk-0", "rollout", "vk-0's page");
    assert_held_on(&node_dom, "vk-1", "policy", "vk-0's page");
    assert!(
        holders_on(&node_dom, "vk-2").iter().all(|h| h.is_empty()),
        "the dead vk-2 holds nothing: {:?}",
        holders_on(&node_dom, "vk-2")
    );
    let node_events = events(&node_dom);
    assert!(
        node_events
            .iter()
            .any(|(k, t)| k == "death" && t.contains("vk-2")),
        "{node_events:?}"
    );
    maybe_screenshot(&node_url, "live-view-node.png");
    run.wait_success(Duration::from_secs(240), &cluster);
    assert_finished_view(
        out.path(),
        steps,
        "recovery",
        &format!("step {recovered_at}"),
        "live-view-recovery-finished.png",
    );
    eprintln!(
        "live view of a 3-node run losing vk-2 (recovered in step {recovered_at}; page read at step {points}): {:.2?} in all",
        t0.elapsed()
    );
}

/// `yatt train` of the demo into `out` with `--http 0`, `job.steps = steps` and `sets`,
/// printing to OUT/train.log and OUT/train.err.
fn train_demo(out: &Path, steps: u64, sets: &[&str]) -> std::process::Child {
    let mut cmd = Command::new(yatt_bin());
    cmd.args(["train", DEMO, "--http", "0"])
        .args(["--set", &format!("job.steps={steps}")])
        .arg("--set")
        .arg(format!("job.output_dir=\"{}\"", out.display()));
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(out.join("train.log")).unwrap())
        .stderr(std::fs::File::create(out.join("train.err")).unwrap())
        .spawn()
        .expect("start yatt train")
}

/// The URL and address a [`train_demo`] run serves on, once it has done `steps` steps.
fn serving(out: &Path, steps: usize) -> (String, std::net::SocketAddr) {
    let at = printed_url(&out.join("train.log"), Duration::from_secs(60))
        .unwrap_or_else(|| panic!("no URL:\n{}", printed(out)));
    let done = poll(Duration::from_secs(120), || {
        (steps_done(out) >= steps).then_some(())
    });
    assert!(done.is_some(), "not {steps} steps:\n{}", printed(out));
    at
}

/// What a [`train_demo`] run printed.
fn printed(out: &Path) -> String {
    let read = |f: &str| std::fs::read_to_string(out.join(f)).unwrap_or_default();
    read("train.log") + &read("train.err")
}

/// Waits (240 s at most) for a [`train_demo`] run to end, and asserts it succeeded.
fn assert_finishes(child: &mut std::process::Child, out: &Path) {
    let status = poll(Duration::from_secs(240), || child.try_wait().ok().flatten());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{}",
        printed(out)
    );
}

/// Resident memory of process `pid`, bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// Asserts that resident memory grew by less than 64 MiB from `before` to `during`.
fn assert_grew_little(before: u64, during: u64, what: &str) {
    let grew = during.saturating_sub(before);
    assert!(grew < 64 << 20, "{what} by {} MiB", grew >> 20);
}

/// Queries from a fixed-seed generator: printable bytes, some percent-escapes, lengths
/// up to 300 (past the 256-byte limit).
fn fuzzed_queries(n: usize) -> Vec<String> {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let alphabet: Vec<char> = "since=events_&%0123456789-+abcxyz;,/?.~!$'()*:@"
        .chars()
        .collect();
    (0..n)
        .map(|_| {
            let len = (next() % 300) as usize;
            (0..len)
                .map(|_| alphabet[(next() % alphabet.len() as u64) as usize])
                .collect()
        })
        .collect()
}

#[test]
fn hostile_queries_and_200_connections_leave_the_run_and_health_unaffected() {
    let out = tempfile::tempdir().unwrap();
    // Enough steps that the run is still going through all of the below.
    let steps = 300;
    let mut child = train_demo(out.path(), steps, &[]);
    let printed = || printed(out.path());
    let (_, addr) = serving(out.path(), 1);
    let expect = |path: &str, code: u16, says: &str| {
        let (got, body) = http_get(addr, path).unwrap_or_else(|| panic!("no answer to {path:.80}"));
        assert_eq!(got, code, "{path:.80}: {body}");
        assert!(body.contains(says), "{path:.80}: {body}");
    };
    expect(
        "/api/run?since=-1",
        400,
        "since=\"-1\": expected a whole number",
    );
    expect(
        "/api/run?since=99999999999999999999",
        400,
        "18446744073709551615",
    );
    expect(
        &format!("/api/run?since={}", "9".repeat(10_000)),
        400,
        "at most 256",
    );
    expect(
        &format!("/health?{}", "a".repeat(10_000)),
        400,
        "at most 256",
    );
    expect("/api/cluster?events_since=x", 400, "events_since=\"x\"");
    expect("/api/run?since=0&unknown=1", 200, "\"steps\"");
    expect("/no-such-page", 404, "");
    let (code, _) = http_raw(
        addr,
        &format!("POST /api/run HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"),
    )
    .expect("an answer to POST");
    assert_eq!(code, 405, "the view is read-only");
    let mut codes = std::collections::BTreeMap::new();
    for (i, q) in fuzzed_queries(120).iter().enumerate() {
        let path = ["/api/run", "/api/cluster", "/"][i % 3];
        let (code, body) = http_get(addr, &format!("{path}?{q}"))
            .unwrap_or_else(|| panic!("no answer to {path}?{q}"));
        assert!(
            code == 200 || code == 400 || code == 503,
            "{path}?{q}: {code} {body}"
        );
        *codes.entry(code).or_insert(0) += 1;
    }

    // 200 connections at once: half send part of a request and hang, half ask for the
    // whole run and go away without reading the answer.
    let rss_before = rss(child.id());
    let mut held: Vec<TcpStream> = Vec::new();
    for i in 0..200 {
        use std::io::Write as _;
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(5))
            .unwrap_or_else(|e| panic!("connection {i}: {e}"));
        let req = match i % 2 {
            0 => format!("GET /api/run?since=0 HTTP/1.1\r\nHost: {addr}\r\n"),
            _ => format!("GET /api/run?since=0 HTTP/1.1\r\nHost: {addr}\r\n\r\n"),
        };
        s.write_all(req.as_bytes()).unwrap();
        held.push(s);
    }
    let t = Instant::now();
    let health = poll(Duration::from_secs(10), || {
        http_get(addr, "/health").filter(|(c, _)| *c == 200)
    });
    assert!(
        health.is_some(),
        "/health did not answer with 200 connections open"
    );
    let health_s = t.elapsed();
    let rss_during = rss(child.id());
    drop(held);
    assert_finishes(&mut child, out.path());
    assert_eq!(steps_done(out.path()), steps as usize, "{}", printed());
    assert_grew_little(rss_before, rss_during, "200 connections grew the trainer");
    eprintln!(
        "hostile input: fuzzed answers {codes:?}; /health answered in {health_s:.2?} beside 200 open connections; RSS {} -> {} MiB",
        rss_before >> 20,
        rss_during >> 20
    );
}

/// The markup of the timeline row of `step` and `head` ("" for a row of means), up to
/// the next row.
fn timeline_row<'a>(dom: &'a str, step: u64, head: &str) -> Option<&'a str> {
    let open = format!("<div class=\"tl-row\" data-step=\"{step}\" data-head=\"{head}\">");
    let at = dom.find(&open)?;
    let rest = &dom[at + open.len()..];
    Some(&rest[..rest.find("class=\"tl-row\"").unwrap_or(rest.len())])
}

/// A metric of `step` in `out`'s metrics.jsonl.
fn metric_at(out: &Path, step: u64, key: &str) -> Option<f64> {
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).ok()?;
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["step"].as_u64() == Some(step))?[key]
        .as_f64()
}

#[test]
fn an_embedded_run_shows_each_heads_timeline_with_its_overlap_and_who_holds_its_device() {
    let t0 = Instant::now();
    let out = tempfile::tempdir().unwrap();
    // Two heads generating a step ahead; the demo's steps take tens of milliseconds, so
    // enough of them that the page is read mid-run.
    let steps = 600;
    let mut child = train_demo(
        out.path(),
        steps,
        &["job.controllers=2", "rollout.staleness=1"],
    );
    let (url, _) = serving(out.path(), 3);
    let dom = dump_dom(&url, BUDGET_MS);

    // The trainer's node: its device held by every role of the run, both rollouts.
    let devices = tags_with(&dom, "class=\"device\"");
    let holder = devices
        .iter()
        .filter_map(|t| attr(t, "data-holder"))
        .find(|h| !h.is_empty())
        .unwrap_or_else(|| panic!("no device shows a holder: {devices:?}"));
    for role in ["policy", "rollout ×2", "reward"] {
        assert!(holder.contains(role), "{role} not in {holder:?}");
    }

    // One timeline row per head, each with the generation of later batches beside its
    // training and their overlap, as that head's own figures in metrics.jsonl say.
    assert_eq!(attr_of(&dom, "timeline", "data-heads"), Some("2"));
    let shown: u64 = attr_of(&dom, "run-summary", "data-step")
        .and_then(|s| s.parse().ok())
        .expect("the page's step");
    assert!(shown >= 3, "{shown}");
    for head in ["0", "1"] {
        let row = timeline_row(&dom, shown, head)
            .unwrap_or_else(|| panic!("no row for step {shown}, head {head}"));
        let ahead = tags_with(row, "data-stage=\"gen_ahead\"");
        let secs = ahead
            .first()
            .and_then(|t| attr(t, "data-seconds"))
            .and_then(|s| s.parse::<f64>().ok())
            .unwrap_or_else(|| panic!("head {head}: no generation of later batches in {row}"));
        let want = metric_at(out.path(), shown, &format!("head/{head}/async/gen_ahead_s"))
            .expect("the head's own generation time");
        assert!(
            (secs - want).abs() < 1e-3,
            "head {head}: {secs} drawn, {want} written"
        );
        assert!(
            !tags_with(row, "data-stage=\"update_actor\"").is_empty(),
            "head {head}: no training in {row}"
        );
        let overlap = tags_with(row, "class=\"overlap\"");
        assert!(
            overlap
                .first()
                .and_then(|t| attr(t, "data-overlap-s"))
                .and_then(|s| s.parse::<f64>().ok())
                .is_some_and(|s| s > 0.0),
            "head {head}: no overlap drawn: {row}"
        );
    }
    maybe_screenshot(&url, "live-view-heads.png");
    assert_finishes(&mut child, out.path());

    // A run directory written before the heads' own values were: a row per step, from
    // the means, and nothing else amiss.
    let old = tempfile::tempdir().unwrap();
    let text = std::fs::read_to_string(out.path().join("metrics.jsonl")).unwrap();
    let mut lines = String::new();
    for l in text.lines() {
        let mut v: serde_json::Map<String, serde_json::Value> = serde_json::from_str(l).unwrap();
        v.retain(|k, _| !k.starts_with("head/") && k != "async/gen_ahead_s");
        lines += &(serde_json::Value::Object(v).to_string() + "\n");
    }
    std::fs::write(old.path().join("metrics.jsonl"), lines).unwrap();
    let (_view, old_url) = yatt_view(old.path());
    let dom = dump_dom(&old_url, BUDGET_MS);
    assert_eq!(points_and_step(&dom, "chart-reward"), (steps, steps));
    assert_eq!(attr_of(&dom, "timeline", "data-heads"), Some("0"));
    let row = timeline_row(&dom, steps, "").expect("a row of means for the last step");
    assert!(
        !tags_with(row, "data-stage=\"update_actor\"").is_empty(),
        "{row}"
    );
    eprintln!(
        "embedded run with 2 heads at staleness 1 ({steps} steps; page read at step {shown}): {:.2?} in all",
        t0.elapsed()
    );
}

/// Open file descriptors of process `pid`.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

#[test]
fn slow_drip_connections_past_the_limit_cannot_lock_a_real_viewer_out() {
    use std::io::{Read as _, Write as _};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    let out = tempfile::tempdir().unwrap();
    let mut metrics = String::new();
    for step in 1..=20 {
        metrics += &format!(
            "{{\"step\":{step},\"critic/rewards/mean\":0.5,\"timing_s/step\":1.0,\"timing_s/gen\":0.6}}\n"
        );
    }
    std::fs::write(out.path().join("metrics.jsonl"), metrics).unwrap();
    let (view, url) = yatt_view(out.path());
    let addr: std::net::SocketAddr = url
        .trim_start_matches("http://")
        .trim_end_matches('/')
        .parse()
        .unwrap();
    let pid = view.0.id();
    let limit = 256; // yatt::view::MAX_CONNECTIONS
    let (rss_before, fds_before) = (rss(pid), open_fds(pid));

    // 300 clients, each starting a request and then sending one more byte of an
    // endless header every second: each keeps its connection busy, never idle. A client
    // the server closes connects again at once.
    let clients = limit + 44;
    let stop = Arc::new(AtomicBool::new(false));
    let reconnects = Arc::new(AtomicUsize::new(0));
    let open = move || -> Option<TcpStream> {
        let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
        s.write_all(b"GET /api/run?since=0 HTTP/1.1\r\nHost: x\r\nX-Drip: ")
            .ok()?;
        s.set_nonblocking(true).ok()?;
        Some(s)
    };
    let mut conns: Vec<Option<TcpStream>> = (0..clients).map(|_| open()).collect();
    assert!(
        conns.iter().filter(|c| c.is_some()).count() > limit,
        "could not open {clients} connections"
    );
    let drip = {
        let (stop, reconnects) = (stop.clone(), reconnects.clone());
        std::thread::spawn(move || {
            let mut next = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                for c in conns.iter_mut() {
                    let mut buf = [0u8; 512];
                    let alive = c.as_mut().is_some_and(|s| {
                        let open = match s.read(&mut buf) {
                            Err(e) => e.kind() == std::io::ErrorKind::WouldBlock,
                            Ok(_) => false, // an answer or the close: start over
                        };
                        open && s.write_all(b"a").is_ok()
                    });
                    if !alive {
                        reconnects.fetch_add(1, Ordering::Relaxed);
                        *c = open();
                    }
                }
                next += Duration::from_secs(1);
                while Instant::now() < next && !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        })
    };

    // A viewer's requests, spread over longer than every deadline of the server, each
    // answered at once.
    let mut worst = Duration::ZERO;
    let mut peak_fds = 0;
    let t_all = Instant::now();
    for i in 0..8 {
        let t = Instant::now();
        let got = http_get(addr, "/api/run?since=0");
        let took = t.elapsed();
        assert!(
            got.as_ref()
                .is_some_and(|(c, b)| *c == 200 && b.contains("\"steps\"")),
            "request {i} beside {clients} dripping connections: {got:?} after {took:.2?}"
        );
        assert!(
            took < Duration::from_secs(3),
            "request {i} took {took:.2?} beside {clients} dripping connections"
        );
        worst = worst.max(took);
        peak_fds = peak_fds.max(open_fds(pid));
        std::thread::sleep(Duration::from_millis(1500));
    }
    let rss_during = rss(pid);
    stop.store(true, Ordering::Relaxed);
    drip.join().unwrap();
    assert_grew_little(
        rss_before,
        rss_during,
        &format!("{clients} dripping connections grew the server"),
    );
    // The server holds at most its limit of connections (and a few in passing).
    assert!(
        peak_fds <= fds_before + limit + 8,
        "{peak_fds} descriptors open (from {fds_before}) with a limit of {limit} connections"
    );
    assert!(
        reconnects.load(Ordering::Relaxed) >= clients - limit,
        "the server never closed a dripping connection"
    );
    eprintln!(
        "slow drip: {clients} dripping clients, {} reconnects in {:.1?}; a viewer's request answered in at most {worst:.2?}; server RSS {} -> {} MiB, {peak_fds} descriptors at most",
        reconnects.load(Ordering::Relaxed),
        t_all.elapsed(),
        rss_before >> 20,
        rss_during >> 20
    );
}
