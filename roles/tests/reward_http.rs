//! The HTTP reward client against a tiny hand-written HTTP/1.1 server on 127.0.0.1:0.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use yatt_roles::{HttpRewardClient, HttpRewardConfig, RewardError, RewardInput};

#[derive(Clone)]
enum Reply {
    /// Answer with this status and body.
    Http(u16, &'static str),
    /// Read the request, then never answer.
    Hang,
}

struct Server {
    url: String,
    hits: Arc<AtomicUsize>,
    bodies: Arc<Mutex<Vec<String>>>,
}

/// Serves `script[i]` to the i-th connection (the last entry repeats).
async fn serve(script: Vec<Reply>) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}/score", listener.local_addr().unwrap());
    let hits = Arc::new(AtomicUsize::new(0));
    let bodies = Arc::new(Mutex::new(Vec::new()));
    let (h, b) = (hits.clone(), bodies.clone());
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let i = h.fetch_add(1, Ordering::SeqCst);
            let reply = script[i.min(script.len() - 1)].clone();
            let b = b.clone();
            tokio::spawn(async move { handle(sock, reply, b).await });
        }
    });
    Server { url, hits, bodies }
}

async fn handle(mut sock: TcpStream, reply: Reply, bodies: Arc<Mutex<Vec<String>>>) {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let body_start = loop {
        let n = sock.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
        if let Some(p) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break p + 4;
        }
    };
    let head = String::from_utf8_lossy(&buf[..body_start]).to_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map(|v| v.trim().parse().unwrap())
        .unwrap_or(0);
    while buf.len() < body_start + len {
        let n = sock.read(&mut chunk).await.unwrap_or(0);
        if n == 0 {
            return;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
    bodies
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(&buf[body_start..]).into_owned());
    match reply {
        Reply::Hang => tokio::time::sleep(Duration::from_secs(60)).await,
        Reply::Http(status, body) => {
            let resp = format!(
                "HTTP/1.1 {status} X\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
            let _ = sock.write_all(resp.as_bytes()).await;
            let _ = sock.shutdown().await;
        }
    }
}

fn inputs() -> Vec<RewardInput> {
    vec![
        RewardInput {
            prompt: "What is 2+3?".into(),
            response: "5".into(),
            reference: Some("5".into()),
            metadata: serde_json::json!({"task": "addition"}),
        },
        RewardInput {
            prompt: "Say hi".into(),
            response: "hi".into(),
            reference: None,
            metadata: serde_json::Value::Null,
        },
    ]
}

fn client(url: &str, timeout_ms: u64, retries: u32) -> HttpRewardClient {
    let mut cfg = HttpRewardConfig::new(url);
    cfg.timeout = Duration::from_millis(timeout_ms);
    cfg.max_retries = retries;
    cfg.backoff_initial = Duration::from_millis(10);
    cfg.backoff_max = Duration::from_millis(40);
    HttpRewardClient::new(cfg).unwrap()
}

#[tokio::test]
async fn success_with_step_scores() {
    let s = serve(vec![Reply::Http(
        200,
        r#"{"scores": [1.0, 0.25], "step_scores": [[0.5, 1.0], null]}"#,
    )])
    .await;
    let out = client(&s.url, 2000, 0)
        .score_batch(&inputs())
        .await
        .unwrap();
    assert_eq!(out.len(), 2);
    assert_eq!((out[0].score, out[1].score), (1.0, 0.25));
    assert_eq!(out[0].step_scores, Some(vec![0.5, 1.0]));
    assert_eq!(out[1].step_scores, None);
    let sent: serde_json::Value = serde_json::from_str(&s.bodies.lock().unwrap()[0]).unwrap();
    assert_eq!(sent[0]["prompt"], "What is 2+3?");
    assert_eq!(sent[0]["response"], "5");
    assert_eq!(sent[0]["reference"], "5");
    assert_eq!(sent[0]["metadata"]["task"], "addition");
    assert!(sent[1]["reference"].is_null());
    // an empty batch sends nothing
    assert!(client(&s.url, 2000, 0)
        .score_batch(&[])
        .await
        .unwrap()
        .is_empty());
    assert_eq!(s.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn retries_after_500() {
    let s = serve(vec![
        Reply::Http(500, "boom"),
        Reply::Http(200, r#"{"scores": [0, 1]}"#),
    ])
    .await;
    let out = client(&s.url, 2000, 2)
        .score_batch(&inputs())
        .await
        .unwrap();
    assert_eq!((out[0].score, out[1].score), (0.0, 1.0));
    assert_eq!(s.hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn persistent_5xx_names_url_status_and_body() {
    let s = serve(vec![Reply::Http(503, "model is loading, try later")]).await;
    let e = client(&s.url, 2000, 2)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RewardError::HttpStatus {
                status: 503,
                attempts: 3,
                ..
            }
        ),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains(&s.url) && msg.contains("503") && msg.contains("model is loading"),
        "{msg}"
    );
    assert_eq!(s.hits.load(Ordering::SeqCst), 3);
}

#[tokio::test]
async fn client_errors_are_not_retried() {
    let s = serve(vec![Reply::Http(400, "bad field")]).await;
    let e = client(&s.url, 2000, 3)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RewardError::HttpStatus {
                status: 400,
                attempts: 1,
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(s.hits.load(Ordering::SeqCst), 1);
}

#[tokio::test]
async fn timeout_then_error() {
    let s = serve(vec![Reply::Hang]).await;
    let t0 = std::time::Instant::now();
    let e = client(&s.url, 150, 1)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RewardError::Timeout {
                timeout_ms: 150,
                attempts: 2,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains(&s.url));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(s.hits.load(Ordering::SeqCst), 2);
}

#[tokio::test]
async fn timeout_then_success() {
    let s = serve(vec![Reply::Hang, Reply::Http(200, r#"{"scores": [1, 1]}"#)]).await;
    let out = client(&s.url, 150, 1).score_batch(&inputs()).await.unwrap();
    assert_eq!(out.len(), 2);
}

#[tokio::test]
async fn bad_json_is_an_error() {
    let s = serve(vec![Reply::Http(200, "<html>oops</html>")]).await;
    let e = client(&s.url, 2000, 2)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(matches!(e, RewardError::BadResponse { .. }), "{e}");
    assert!(e.to_string().contains("<html>oops</html>"), "{e}");
    // null scores are not silently zero
    let s = serve(vec![Reply::Http(200, r#"{"scores": [1, null]}"#)]).await;
    assert!(matches!(
        client(&s.url, 2000, 0).score_batch(&inputs()).await,
        Err(RewardError::BadResponse { .. })
    ));
}

#[tokio::test]
async fn wrong_count_is_an_error() {
    let s = serve(vec![Reply::Http(200, r#"{"scores": [1]}"#)]).await;
    let e = client(&s.url, 2000, 2)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RewardError::CountMismatch {
                what: "scores",
                expected: 2,
                got: 1,
                ..
            }
        ),
        "{e}"
    );
    let s = serve(vec![Reply::Http(
        200,
        r#"{"scores": [1, 2], "step_scores": [[1]]}"#,
    )])
    .await;
    let e = client(&s.url, 2000, 2)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(
            e,
            RewardError::CountMismatch {
                what: "step_scores",
                ..
            }
        ),
        "{e}"
    );
}

#[tokio::test]
async fn unreachable_endpoint() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/score");
    let e = client(&url, 1000, 1)
        .score_batch(&inputs())
        .await
        .unwrap_err();
    assert!(
        matches!(e, RewardError::Transport { attempts: 2, .. }),
        "{e}"
    );
    assert!(e.to_string().contains(&url));
}

#[test]
fn url_validation() {
    for bad in [
        "https://x/score",
        "ftp://x",
        "http://",
        "http://host:notaport/x",
    ] {
        let e = HttpRewardClient::new(HttpRewardConfig::new(bad)).unwrap_err();
        assert!(matches!(e, RewardError::InvalidUrl { .. }), "{bad}: {e}");
    }
    let c = HttpRewardClient::new(HttpRewardConfig::new("http://reward.local/score?x=1")).unwrap();
    assert_eq!(c.url(), "http://reward.local/score?x=1");
    assert!(HttpRewardClient::new(HttpRewardConfig::new("http://[::1]:8080/s")).is_ok());
}

/// Text samples for the reward role.
fn samples(responses: &[&str]) -> Vec<yatt_roles::Sample> {
    responses
        .iter()
        .enumerate()
        .map(|(k, r)| yatt_roles::Sample {
            prompt_text: "q".into(),
            response_text: r.to_string(),
            ..yatt_roles::Sample::new(
                yatt_roles::SampleId {
                    step: 0,
                    prompt: 3,
                    k: k as u32,
                },
                3,
            )
        })
        .collect()
}

/// The endpoint as the reward role's batched scorer: the role blocks on its own
/// current-thread runtime on its own thread (here a plain thread, as a `RoleActor`'s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reward_role_scores_through_the_endpoint() {
    use yatt_roles::{HttpRewardScorer, ModelScorer, RewardRole, Role};
    let s = serve(vec![
        Reply::Http(200, r#"{"scores": [1.0, 0.25, 0.5]}"#),
        Reply::Http(404, "no such path"),
    ])
    .await;
    let mut cfg = HttpRewardConfig::new(s.url.clone());
    cfg.timeout = Duration::from_secs(5);
    cfg.max_retries = 0;
    let scorer = HttpRewardScorer::new(cfg).unwrap();
    let (url, bodies) = (s.url.clone(), s.bodies.clone());
    let role_thread = std::thread::spawn(move || {
        let mut role = RewardRole::with_models(
            Vec::new(),
            vec![(2.0, Box::new(scorer) as Box<dyn ModelScorer>)],
        )
        .unwrap();
        let ok = role.serve(samples(&["a", "b", "c"])).unwrap();
        let err = role.serve(samples(&["d"])).unwrap_err().to_string();
        (ok, err)
    });
    let (ok, err) = tokio::task::spawn_blocking(move || role_thread.join().unwrap())
        .await
        .unwrap();
    assert_eq!(
        ok.iter().map(|s| s.reward.unwrap()).collect::<Vec<_>>(),
        vec![2.0, 0.5, 1.0]
    );
    assert!(err.contains(&url) && err.contains("404"), "{err}");
    let sent: serde_json::Value = serde_json::from_str(&bodies.lock().unwrap()[0]).unwrap();
    assert_eq!(sent[2]["response"], "c");
    assert_eq!(s.hits.load(Ordering::SeqCst), 2);
}
