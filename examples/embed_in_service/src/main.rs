//! An HTTP service that embeds a yatt node and answers requests by asking an actor on
//! another node, over QUIC with mutual TLS.
//!
//! ```text
//! cargo run -p embed_in_service                     # self-contained: a worker node in-process
//! cargo run -p embed_in_service -- --seed ADDR --on NODE   # join a yatt-node cluster
//! curl 'http://127.0.0.1:8080/shout?text=hello'      # {"answer":"HELLO!","served_by":"..."}
//! ```

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::routing::get;
use axum::{Json, Router};
use clap::Parser;
use serde::{Deserialize, Serialize};
use yatt_runtime::Node;
use yatt_runtime::{Actor, ActorError, ActorRef, Context};

/// The actor the service calls: it shouts.
pub struct Shouter;

impl Actor for Shouter {
    type Request = String;
    type Response = String;
    async fn handle(&mut self, text: String, _: &mut Context) -> Result<String, ActorError> {
        if text.is_empty() {
            return Err(ActorError::BadRequest(
                "text is empty; pass ?text=...".into(),
            ));
        }
        Ok(format!("{}!", text.to_uppercase()))
    }
}

#[derive(Parser)]
struct Args {
    /// HTTP address to serve on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    http: SocketAddr,
    /// Join this cluster member instead of starting a worker node in-process.
    #[arg(long)]
    seed: Option<SocketAddr>,
    /// With --seed: the node to spawn the shouter on (it must register `shouter`; the
    /// self-contained mode does).
    #[arg(long)]
    on: Option<String>,
    /// Dev CA directory shared with the cluster.
    #[arg(long, default_value = ".yatt/dev-ca")]
    ca: PathBuf,
}

#[derive(Deserialize)]
struct ShoutQuery {
    text: String,
}

#[derive(Serialize)]
struct ShoutAnswer {
    answer: String,
    served_by: String,
}

/// The service's routes; `shouter` may live on any node.
pub fn app(shouter: ActorRef<String, String>) -> Router {
    Router::new()
        .route("/shout", get(shout))
        .with_state(shouter)
}

async fn shout(
    State(shouter): State<ActorRef<String, String>>,
    Query(q): Query<ShoutQuery>,
) -> Result<Json<ShoutAnswer>, (StatusCode, String)> {
    // Every call has a deadline: a slow or dead node gives a 504, never a hang.
    match shouter.ask(q.text, Duration::from_secs(2)).await {
        Ok(answer) => Ok(Json(ShoutAnswer {
            answer,
            served_by: shouter.id().to_string(),
        })),
        Err(yatt_runtime::CallError::Handler { error, .. }) => {
            Err((StatusCode::BAD_REQUEST, error.to_string()))
        }
        Err(e) => Err((StatusCode::GATEWAY_TIMEOUT, e.to_string())),
    }
}

/// Starts the service's node, and in self-contained mode a worker node beside it.
/// Returns the nodes (keep them alive) and a reference to the remote shouter.
pub async fn start(
    args_seed: Option<SocketAddr>,
    on: Option<String>,
    ca: PathBuf,
) -> anyhow::Result<(Vec<Node>, ActorRef<String, String>)> {
    let mut nodes = Vec::new();
    let (seed, target) = match args_seed {
        Some(seed) => (
            seed,
            on.ok_or_else(|| anyhow::anyhow!("--seed needs --on NODE"))?,
        ),
        None => {
            let worker = Node::builder("worker")
                .dev_certs(&ca)
                .factory("shouter", |_: ()| Ok(Shouter))
                .start()
                .await?;
            let addr = worker.addr();
            nodes.push(worker);
            (addr, "worker".to_string())
        }
    };
    let me = Node::builder("web")
        .dev_certs(&ca)
        .seed(seed)
        .start()
        .await?;
    let shouter = me
        .spawn_remote::<String, String, _>(&target, "shouter", &(), Duration::from_secs(10))
        .await?;
    nodes.push(me);
    Ok((nodes, shouter))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt().with_env_filter("info").init();
    let args = Args::parse();
    let (_nodes, shouter) = start(args.seed, args.on, args.ca).await?;
    let listener = tokio::net::TcpListener::bind(args.http).await?;
    println!(
        "serving on http://{}/shout?text=hello",
        listener.local_addr()?
    );
    axum::serve(listener, app(shouter)).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn handler_asks_the_remote_actor() {
        let ca = std::env::temp_dir().join(format!("yatt-embed-test-{}", std::process::id()));
        let (_nodes, shouter) = start(None, None, ca.clone()).await.unwrap();
        assert!(!shouter.is_local(), "the shouter must be reached over QUIC");
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app(shouter)).await });
        let get = |path: String| async move {
            use tokio::io::{AsyncReadExt, AsyncWriteExt};
            let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
            s.write_all(
                format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes(),
            )
            .await
            .unwrap();
            let mut out = String::new();
            s.read_to_string(&mut out).await.unwrap();
            out
        };
        let ok = get("/shout?text=hello".into()).await;
        assert!(
            ok.starts_with("HTTP/1.1 200")
                && ok.contains("\"answer\":\"HELLO!\"")
                && ok.contains("worker/shouter/"),
            "{ok}"
        );
        let bad = get("/shout?text=".into()).await;
        assert!(
            bad.starts_with("HTTP/1.1 400") && bad.contains("text is empty"),
            "{bad}"
        );
        let _ = std::fs::remove_dir_all(ca);
    }
}
