//! The node's HTTP side: `/health` (JSON) and `/metrics` (Prometheus text), and with
//! [`with_view`] the live web view beside them (`crate::view`).

use std::fmt::Write as _;
use std::sync::atomic::Ordering;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use yatt_runtime::Liveness;
use yatt_runtime::Membership;
use yatt_runtime::Node;

/// The routes, bound to `node`.
pub fn router(node: Node) -> Router {
    Router::new()
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .with_state(node)
}

/// [`router`] and the live view's routes, every one of them behind the view's query
/// limit ([`crate::view::limit_query`]).
pub fn with_view(node: &Node, view: crate::view::View) -> Router {
    router(node.clone())
        .merge(view.router())
        .layer(axum::middleware::from_fn(crate::view::limit_query))
}

async fn health(State(node): State<Node>) -> impl IntoResponse {
    let dir = node.directory().snapshot();
    let nodes: Vec<serde_json::Value> = dir
        .nodes()
        .map(|n| {
            serde_json::json!({
                "name": n.info.name,
                "incarnation": n.info.incarnation,
                "addr": n.info.addr.to_string(),
                "alive": n.liveness == Liveness::Alive,
                "devices": n.info.devices.len(),
            })
        })
        .collect();
    let actors: Vec<serde_json::Value> = dir
        .actors()
        .map(
            |a| serde_json::json!({"id": a.id.to_string(), "alive": a.liveness == Liveness::Alive}),
        )
        .collect();
    let rejoining = match node.membership() {
        Membership::Member => None,
        Membership::Rejoining { reason } => Some(reason),
    };
    // Unhealthy while draining, and while rejoining after having been declared dead:
    // the actors it hosted were stopped and it serves nothing until it has rejoined.
    let status = if node.is_stopping() {
        "draining"
    } else if rejoining.is_some() {
        "rejoining"
    } else {
        "ok"
    };
    let code = if status == "ok" {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = serde_json::json!({
        "status": status,
        "declared_dead": rejoining,
        "node": node.name(),
        "incarnation": node.incarnation(),
        "leader": node.leader(),
        "term": node.term(),
        "epoch": dir.epoch(),
        "nodes": nodes,
        "actors": actors,
        "hosted": node.hosted().iter().map(|a| a.to_string()).collect::<Vec<_>>(),
        "factories": node.factory_roles(),
    });
    (code, axum::Json(body))
}

async fn metrics(State(node): State<Node>) -> impl IntoResponse {
    let dir = node.directory().snapshot();
    let s = node.transport_stats();
    let alive = dir.alive_nodes().count();
    let dead = dir.nodes().count() - alive;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, value: u64| {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{node=\"{}\"}} {value}",
            node.name()
        );
    };
    metric(
        "yatt_up",
        "gauge",
        "1 while the node serves, 0 while it drains or rejoins after having been declared dead.",
        u64::from(!node.is_stopping() && node.membership() == Membership::Member),
    );
    metric(
        "yatt_directory_term",
        "gauge",
        "Term of the directory leader this node follows (one more per fail-over).",
        node.term(),
    );
    metric(
        "yatt_directory_epoch",
        "gauge",
        "Epoch of this node's directory replica.",
        dir.epoch(),
    );
    metric(
        "yatt_nodes_alive",
        "gauge",
        "Alive nodes in the directory.",
        alive as u64,
    );
    metric(
        "yatt_nodes_dead",
        "gauge",
        "Dead or departed nodes in the directory.",
        dead as u64,
    );
    metric(
        "yatt_actors_hosted",
        "gauge",
        "Actors hosted by this node.",
        node.hosted().len() as u64,
    );
    metric(
        "yatt_requests_in_flight",
        "gauge",
        "Requests from peers being handled.",
        node.in_flight(),
    );
    metric(
        "yatt_requests_sent_total",
        "counter",
        "Requests sent to peers.",
        s.sent.load(Ordering::Relaxed),
    );
    metric(
        "yatt_requests_received_total",
        "counter",
        "Requests received from peers.",
        s.received.load(Ordering::Relaxed),
    );
    metric(
        "yatt_bulk_bytes_sent_total",
        "counter",
        "Bulk payload bytes sent.",
        s.bulk_bytes_sent.load(Ordering::Relaxed),
    );
    metric(
        "yatt_bad_frames_total",
        "counter",
        "Streams closed for a malformed or oversized frame.",
        s.bad_frames.load(Ordering::Relaxed),
    );
    metric(
        "yatt_connections_total",
        "counter",
        "QUIC connections dialled or accepted.",
        s.connections.load(Ordering::Relaxed),
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out)
}
