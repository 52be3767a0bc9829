//! Batched async client for a remote reward endpoint.
//!
//! Protocol: `POST <url>` with a JSON array of `{prompt, response, reference, metadata}`
//! (one per sample); the endpoint answers `200` with
//! `{"scores": [f, ...], "step_scores": [[f, ...] | null, ...]}` (`step_scores`
//! optional), one entry per sample in order. Each attempt has its own timeout;
//! connection errors, timeouts and HTTP 408/429/5xx are retried with exponential
//! backoff; other statuses, malformed JSON and wrong counts fail at once. A failure is
//! always an error naming the URL — never a silent zero reward.
//!
//! Plain `http://` only (HTTP/1.1, one connection per attempt): run the endpoint on the
//! cluster network or behind a local TLS-terminating proxy.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::client::conn::http1;
use hyper_util::rt::TokioIo;
use serde::Deserialize;
use tokio::net::TcpStream;

use crate::builtin::reward_model::ModelScorer;
use crate::reward::reward_fn::{excerpt, RewardError, RewardInput, RewardOutput};
use crate::role::RoleError;

/// Client options.
#[derive(Debug, Clone, PartialEq)]
pub struct HttpRewardConfig {
    /// `http://host:port/path` of the endpoint.
    pub url: String,
    /// Limit for one attempt (connect + send + full answer).
    pub timeout: Duration,
    /// Retries after the first attempt (so `max_retries + 1` attempts at most).
    pub max_retries: u32,
    /// Sleep before the first retry; doubled each retry.
    pub backoff_initial: Duration,
    /// Upper bound of the backoff sleep.
    pub backoff_max: Duration,
}

impl HttpRewardConfig {
    /// Defaults for `url`: 30 s timeout, 3 retries, backoff 200 ms doubling up to 5 s.
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            timeout: Duration::from_secs(30),
            max_retries: 3,
            backoff_initial: Duration::from_millis(200),
            backoff_max: Duration::from_secs(5),
        }
    }
}

/// The reward-endpoint client. Cheap to clone; holds no connection between calls.
#[derive(Debug, Clone)]
pub struct HttpRewardClient {
    cfg: HttpRewardConfig,
    /// `host:port` to connect to.
    addr: String,
    /// `Host` header value.
    authority: String,
    /// Request path (with query).
    path: String,
}

#[derive(Deserialize)]
struct Answer {
    scores: Vec<f64>,
    #[serde(default)]
    step_scores: Option<Vec<Option<Vec<f32>>>>,
}

/// Outcome of one attempt, before retry policy.
enum Attempt {
    Answer(u16, Bytes),
    Transport(String),
}

const BODY_EXCERPT: usize = 300;

impl HttpRewardClient {
    /// Validates the URL and timeouts.
    pub fn new(cfg: HttpRewardConfig) -> Result<Self, RewardError> {
        let bad = |reason: &str| RewardError::InvalidUrl {
            url: cfg.url.clone(),
            reason: reason.into(),
        };
        let rest = cfg.url.strip_prefix("http://").ok_or_else(|| {
            bad("must start with http:// (https is not supported; use a local TLS-terminating proxy)")
        })?;
        let (authority, path) = match rest.find(['/', '?']) {
            Some(i) if rest[i..].starts_with('/') => (&rest[..i], rest[i..].to_string()),
            Some(i) => (&rest[..i], format!("/{}", &rest[i..])),
            None => (rest, "/".to_string()),
        };
        if authority.is_empty() {
            return Err(bad("has no host"));
        }
        let has_port = match authority.rfind(':') {
            Some(i) => !authority[i..].contains(']'),
            None => false,
        };
        if has_port {
            let port = &authority[authority.rfind(':').map_or(0, |i| i + 1)..];
            port.parse::<u16>()
                .map_err(|_| bad("port is not a number in 1..65535"))?;
        }
        let addr = if has_port {
            authority.to_string()
        } else {
            format!("{authority}:80")
        };
        if cfg.timeout.is_zero() {
            return Err(RewardError::Config(
                "HTTP reward timeout must be > 0".into(),
            ));
        }
        Ok(Self {
            authority: authority.to_string(),
            addr,
            path,
            cfg,
        })
    }

    /// The configured URL.
    pub fn url(&self) -> &str {
        &self.cfg.url
    }

    async fn attempt(&self, body: Bytes) -> Attempt {
        let stream = match TcpStream::connect(&self.addr).await {
            Ok(s) => s,
            Err(e) => return Attempt::Transport(format!("connect {}: {e}", self.addr)),
        };
        let (mut sender, conn) = match http1::handshake(TokioIo::new(stream)).await {
            Ok(x) => x,
            Err(e) => return Attempt::Transport(format!("HTTP handshake: {e}")),
        };
        let conn = tokio::spawn(conn);
        let req = hyper::Request::post(self.path.as_str())
            .header(hyper::header::HOST, self.authority.as_str())
            .header(hyper::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body));
        let result = match req {
            Err(e) => Attempt::Transport(format!("building request: {e}")),
            Ok(req) => match sender.send_request(req).await {
                Err(e) => Attempt::Transport(format!("sending request: {e}")),
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    match resp.into_body().collect().await {
                        Ok(b) => Attempt::Answer(status, b.to_bytes()),
                        Err(e) => {
                            Attempt::Transport(format!("reading answer (HTTP {status}): {e}"))
                        }
                    }
                }
            },
        };
        conn.abort();
        result
    }

    /// Scores `inputs` in one request (retried as configured); returns one output per
    /// input, in order. An empty batch sends nothing.
    pub async fn score_batch(
        &self,
        inputs: &[RewardInput],
    ) -> Result<Vec<RewardOutput>, RewardError> {
        if inputs.is_empty() {
            return Ok(Vec::new());
        }
        let body =
            Bytes::from(serde_json::to_vec(inputs).map_err(|e| {
                RewardError::Config(format!("cannot serialise reward inputs: {e}"))
            })?);
        let url = self.cfg.url.clone();
        let attempts = self.cfg.max_retries + 1;
        let mut backoff = self.cfg.backoff_initial;
        let mut last: Option<RewardError> = None;
        for attempt in 1..=attempts {
            let err = match tokio::time::timeout(self.cfg.timeout, self.attempt(body.clone())).await
            {
                Err(_) => RewardError::Timeout {
                    url: url.clone(),
                    timeout_ms: self.cfg.timeout.as_millis() as u64,
                    attempts: attempt,
                },
                Ok(Attempt::Transport(message)) => RewardError::Transport {
                    url: url.clone(),
                    attempts: attempt,
                    message,
                },
                Ok(Attempt::Answer(status, bytes)) if (200..300).contains(&status) => {
                    return self.parse(inputs.len(), &bytes);
                }
                Ok(Attempt::Answer(status, bytes)) => {
                    let e = RewardError::HttpStatus {
                        url: url.clone(),
                        status,
                        body_excerpt: excerpt(&String::from_utf8_lossy(&bytes), BODY_EXCERPT),
                        attempts: attempt,
                    };
                    if !(status >= 500 || status == 408 || status == 429) {
                        return Err(e);
                    }
                    e
                }
            };
            tracing::warn!(url = %url, attempt, error = %err, "reward endpoint attempt failed");
            last = Some(err);
            if attempt < attempts {
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(self.cfg.backoff_max);
            }
        }
        Err(last.unwrap_or_else(|| RewardError::Transport {
            url,
            attempts,
            message: "no attempt made".into(),
        }))
    }

    fn parse(&self, n: usize, bytes: &[u8]) -> Result<Vec<RewardOutput>, RewardError> {
        let url = &self.cfg.url;
        let ans: Answer = serde_json::from_slice(bytes).map_err(|e| RewardError::BadResponse {
            url: url.clone(),
            reason: format!(
                "expected JSON {{\"scores\": [numbers], \"step_scores\"?: [...]}}: {e}"
            ),
            body_excerpt: excerpt(&String::from_utf8_lossy(bytes), BODY_EXCERPT),
        })?;
        if ans.scores.len() != n {
            return Err(RewardError::CountMismatch {
                url: url.clone(),
                what: "scores",
                expected: n,
                got: ans.scores.len(),
            });
        }
        let steps = match ans.step_scores {
            Some(s) if s.len() != n => {
                return Err(RewardError::CountMismatch {
                    url: url.clone(),
                    what: "step_scores",
                    expected: n,
                    got: s.len(),
                })
            }
            Some(s) => s,
            None => vec![None; n],
        };
        Ok(ans
            .scores
            .into_iter()
            .zip(steps)
            .map(|(score, step_scores)| RewardOutput {
                score,
                step_scores,
                explanation: format!("endpoint {url}"),
            })
            .collect())
    }
}

/// The endpoint client as a batched scorer of the reward role: each batch is one
/// request, run on a small current-thread tokio runtime of the role's own thread
/// (made at the first batch, so the scorer can be built inside an async context).
pub struct HttpRewardScorer {
    client: HttpRewardClient,
    runtime: Option<tokio::runtime::Runtime>,
    name: String,
}

impl HttpRewardScorer {
    /// Validates the URL and timeouts; connects nothing yet.
    pub fn new(cfg: HttpRewardConfig) -> Result<Self, RewardError> {
        let client = HttpRewardClient::new(cfg)?;
        let name = format!("http {}", client.url());
        Ok(HttpRewardScorer {
            client,
            runtime: None,
            name,
        })
    }
}

impl ModelScorer for HttpRewardScorer {
    fn name(&self) -> &str {
        &self.name
    }

    fn score_batch(&mut self, inputs: &[RewardInput]) -> Result<Vec<RewardOutput>, RoleError> {
        if self.runtime.is_none() {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| RoleError::Failed(format!("{}: tokio runtime: {e}", self.name)))?;
            self.runtime = Some(rt);
        }
        let rt = self
            .runtime
            .as_ref()
            .ok_or_else(|| RoleError::Failed(format!("{}: no runtime", self.name)))?;
        rt.block_on(self.client.score_batch(inputs))
            .map_err(|e| RoleError::Failed(e.to_string()))
    }
}
