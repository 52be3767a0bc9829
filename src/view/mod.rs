//! The live web view: a page served beside `/health` and `/metrics` by `yatt-node run
//! --http`, by `yatt train --http` and by `yatt view RUN_DIR`. The cluster view (any
//! node) shows the nodes, their devices and actors, the leader and term and the recent
//! membership events; the run view (the trainer, or a finished run's directory) shows
//! the step, ETA, curves, the stage timeline, placement decisions and recoveries.
//!
//! Everything is read-only: the routes are `GET` only and nothing they call changes
//! anything. The HTML, CSS and JS are built into the binary. The page polls
//! `/api/cluster` and `/api/run` once a second and asks only for what is new
//! (`?since=STEP&events_since=SEQ`).
//!
//! Cost bounds: [`serve`] serves at most [`MAX_CONNECTIONS`] connections at once (one
//! more sheds the longest-waiting of them, or gets a 503 when all are being answered),
//! closes one whose request does not arrive whole within [`REQUEST_TIMEOUT`], one idle
//! for [`IDLE_TIMEOUT`] and one that does not read its answer for [`WRITE_TIMEOUT`];
//! the API answers at most [`MAX_API_IN_FLIGHT`] requests at a time (503 beyond: try
//! again).
//! A query string over [`MAX_QUERY`] bytes or a malformed number is a 400 saying why.

mod cluster;
mod listener;
mod run;

use std::sync::Arc;

use axum::extract::{RawQuery, Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use tokio::sync::Semaphore;
use yatt_runtime::Node;

pub use cluster::{cluster_json, ClusterEvent, ClusterEvents, EventKind, EVENT_CAPACITY};
pub use listener::{
    serve, IDLE_TIMEOUT, MAX_CONNECTIONS, REQUEST_TIMEOUT, SHED_CLOSING, SHED_WAIT, WRITE_TIMEOUT,
};
pub use run::{RunEvent, RunEventKind, RunSource, MAX_EVENTS, MAX_STEPS};

/// Longest query string accepted.
pub const MAX_QUERY: usize = 256;
/// API requests answered at once.
pub const MAX_API_IN_FLIGHT: usize = 16;

const INDEX_HTML: &str = include_str!("assets/index.html");
const VIEW_JS: &str = include_str!("assets/view.js");
const VIEW_CSS: &str = include_str!("assets/view.css");

/// What a view serves: a node's cluster view, a run, or both.
#[derive(Clone)]
pub struct View {
    cluster: Option<(Node, ClusterEvents)>,
    run: Option<Arc<RunSource>>,
    in_flight: Arc<Semaphore>,
}

impl View {
    /// A view with neither half; add them with [`View::cluster`] and [`View::run`].
    pub fn new() -> Self {
        View {
            cluster: None,
            run: None,
            in_flight: Arc::new(Semaphore::new(MAX_API_IN_FLIGHT)),
        }
    }

    /// Adds the cluster view of `node`, recording its membership events from now on.
    /// Needs a Tokio runtime.
    pub fn cluster(mut self, node: &Node) -> Self {
        self.cluster = Some((node.clone(), ClusterEvents::start(node)));
        self
    }

    /// Adds the run view of `run`.
    pub fn run(mut self, run: RunSource) -> Self {
        self.run = Some(Arc::new(run));
        self
    }

    /// The routes: `/` and `/ui` (the page), `/view.js`, `/view.css`, `/api/cluster`,
    /// `/api/run`.
    pub fn router(self) -> Router {
        Router::new()
            .route("/", get(page))
            .route("/ui", get(page))
            .route("/view.js", get(js))
            .route("/view.css", get(css))
            .route("/api/cluster", get(api_cluster))
            .route("/api/run", get(api_run))
            .with_state(self)
    }
}

impl Default for View {
    fn default() -> Self {
        View::new()
    }
}

/// Refuses query strings longer than [`MAX_QUERY`] on every route it wraps (a 400
/// saying so), before any handler runs.
pub async fn limit_query(req: Request, next: Next) -> Response {
    match req.uri().query() {
        Some(q) if q.len() > MAX_QUERY => bad(format!(
            "query string of {} bytes; at most {MAX_QUERY} are accepted (the page asks for ?since=STEP&events_since=SEQ)",
            q.len()
        )),
        _ => next.run(req).await,
    }
}

fn bad(msg: String) -> Response {
    (StatusCode::BAD_REQUEST, msg + "\n").into_response()
}

/// The numbers a viewer asks after.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Since {
    /// Steps after this one.
    pub step: u64,
    /// Events after this sequence number.
    pub events: u64,
}

/// Parses `since=STEP&events_since=SEQ` (both optional; other keys are ignored). A value
/// that is not a whole number from 0 to 2^64 − 1 is an error naming the key.
pub fn parse_since(query: Option<&str>) -> Result<Since, String> {
    let mut out = Since::default();
    for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let slot = match key {
            "since" => &mut out.step,
            "events_since" => &mut out.events,
            _ => continue,
        };
        *slot = value.parse::<u64>().map_err(|_| {
            let shown: String = value.chars().take(32).collect();
            let more = if value.chars().count() > 32 {
                "..."
            } else {
                ""
            };
            format!(
                "{key}={shown:?}{more}: expected a whole number from 0 to {}",
                u64::MAX
            )
        })?;
    }
    Ok(out)
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        INDEX_HTML,
    )
}

async fn js() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/javascript; charset=utf-8")],
        VIEW_JS,
    )
}

async fn css() -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/css; charset=utf-8")],
        VIEW_CSS,
    )
}

fn busy() -> Response {
    (
        StatusCode::SERVICE_UNAVAILABLE,
        [(header::RETRY_AFTER, "1")],
        format!("{MAX_API_IN_FLIGHT} viewer requests are being answered; try again in a second\n"),
    )
        .into_response()
}

fn no_cache(body: serde_json::Value) -> Response {
    ([(header::CACHE_CONTROL, "no-store")], axum::Json(body)).into_response()
}

async fn api_cluster(State(view): State<View>, RawQuery(q): RawQuery) -> Response {
    let since = match parse_since(q.as_deref()) {
        Ok(s) => s,
        Err(e) => return bad(e),
    };
    let Some((node, events)) = &view.cluster else {
        return (
            StatusCode::NOT_FOUND,
            "no cluster view here: this serves a finished run's files\n",
        )
            .into_response();
    };
    let Ok(_permit) = view.in_flight.try_acquire() else {
        return busy();
    };
    no_cache(cluster_json(node, events, since.events))
}

async fn api_run(State(view): State<View>, RawQuery(q): RawQuery) -> Response {
    let since = match parse_since(q.as_deref()) {
        Ok(s) => s,
        Err(e) => return bad(e),
    };
    let Some(run) = view.run.clone() else {
        return (StatusCode::NOT_FOUND, "no run here: a yatt-node serves the cluster view; the run view is served by `yatt train --http` and `yatt view RUN_DIR`\n").into_response();
    };
    let Ok(permit) = view.in_flight.clone().try_acquire_owned() else {
        return busy();
    };
    let answer = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        run.answer(since.step, since.events)
    })
    .await;
    match answer {
        Ok(v) => no_cache(v),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading the run failed: {e}\n"),
        )
            .into_response(),
    }
}

/// `addr` for an HTTP flag: `HOST:PORT`, or a bare `PORT` / `:PORT` on loopback.
pub fn parse_http_addr(addr: &str) -> Result<std::net::SocketAddr, String> {
    let a = addr.trim();
    let port = a.strip_prefix(':').unwrap_or(a);
    if let Ok(p) = port.parse::<u16>() {
        return Ok(std::net::SocketAddr::from(([127, 0, 0, 1], p)));
    }
    a.parse().map_err(|_| {
        format!("{addr:?} is not an HTTP address: give HOST:PORT (e.g. 127.0.0.1:8080) or a port (8080, on loopback)")
    })
}

/// The warning for a non-loopback HTTP address, shared by every process that serves.
pub fn warn_if_exposed(addr: std::net::SocketAddr) {
    if !addr.ip().is_loopback() {
        tracing::warn!(%addr, "/health, /metrics and the live view are served without authentication on a non-loopback address: anyone who reaches it reads the node's and the run's state; bind to 127.0.0.1, or firewall the port");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_queries_are_refused_with_the_key_and_the_range() {
        assert_eq!(parse_since(None), Ok(Since::default()));
        assert_eq!(
            parse_since(Some("since=5&events_since=7&x=zz&&=")),
            Ok(Since { step: 5, events: 7 })
        );
        let e = parse_since(Some("since=-1")).unwrap_err();
        assert!(
            e.starts_with("since=\"-1\": expected a whole number"),
            "{e}"
        );
        let e = parse_since(Some("since=99999999999999999999")).unwrap_err();
        assert!(e.contains("18446744073709551615"), "{e}");
        let long = "9".repeat(10_000);
        let e = parse_since(Some(&format!("events_since={long}"))).unwrap_err();
        assert!(e.len() < 200 && e.contains("..."), "{e}");
        assert!(parse_since(Some("since")).is_err());
    }

    #[test]
    fn http_addresses_default_to_loopback() {
        assert_eq!(
            parse_http_addr("8080").unwrap().to_string(),
            "127.0.0.1:8080"
        );
        assert_eq!(parse_http_addr(":0").unwrap().to_string(), "127.0.0.1:0");
        assert_eq!(parse_http_addr("[::1]:9").unwrap().to_string(), "[::1]:9");
        assert!(parse_http_addr("localhost").is_err());
    }
}
