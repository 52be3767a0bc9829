//! Local actors: bounded mailboxes, typed references, tell and ask with deadlines.
//!
//! An actor is a value that handles one request at a time on its own tokio task. Its
//! mailbox is bounded: [`ActorRef::tell`] waits for room (backpressure) and
//! [`ActorRef::try_tell`] hands the message back when the mailbox is full. Every
//! [`ActorRef::ask`] carries a deadline.
//!
//! An actor that computes (tch calls block) must not block this task: it hands the work
//! to a dedicated OS thread and awaits the answer over a channel.
//!
//! A request whose answer waits on other actors (a fan-out to remote peers, say) need not
//! hold the actor that long: [`Actor::handle_deferred`] may do the part that needs the
//! actor and answer [`Handled::Later`] with a future for the rest, which runs on a task of
//! its own while the actor takes its next requests.
//!
//! ```
//! use std::time::Duration;
//! use yatt_runtime::{spawn, Actor, ActorError, ActorName, Context};
//!
//! struct Counter(u64);
//! impl Actor for Counter {
//!     type Request = u64;
//!     type Response = u64;
//!     async fn handle(&mut self, add: u64, _ctx: &mut Context) -> Result<u64, ActorError> {
//!         self.0 += add;
//!         Ok(self.0)
//!     }
//! }
//!
//! # #[tokio::main(flavor = "current_thread")] async fn main() {
//! let name = ActorName::new("local", "counter", 0).unwrap();
//! let running = spawn(name, Counter(0), 16);
//! let counter = running.actor_ref.clone();
//! counter.tell(2).await.unwrap();
//! assert_eq!(counter.ask(3, Duration::from_secs(1)).await.unwrap(), 5);
//! # }
//! ```

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};

use crate::addr::{next_incarnation, ActorId, ActorName};
use crate::membership::DeviceClaim;

/// A boxed, sendable future.
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An error an actor's handler returns. It travels back to the caller, also across
/// nodes; the actor itself keeps running.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum ActorError {
    /// The request was malformed or not acceptable; the text says how to fix it.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The actor could not do the work.
    #[error("failed: {0}")]
    Failed(String),
    /// The actor is not able to serve now (draining, offloaded, starting); retry later.
    #[error("unavailable: {0}")]
    Unavailable(String),
}

/// Why an [`ActorRef::ask`] failed. It also travels back from a remote node, so a
/// caller sees the same error whether the actor is in-process or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum CallError {
    /// No answer came before the deadline; the request may or may not have been handled.
    #[error("no reply from {target} within {after:?}")]
    Timeout {
        /// The actor asked.
        target: ActorId,
        /// The deadline that passed.
        after: Duration,
    },
    /// The actor has stopped; its mailbox is closed.
    #[error("{target} is not running")]
    Closed {
        /// The actor asked.
        target: ActorId,
    },
    /// The actor died while the request was queued or being handled.
    #[error("{target} died before replying")]
    Died {
        /// The actor asked.
        target: ActorId,
    },
    /// The name now belongs to another incarnation: the actor was replaced. Resolve the
    /// name again through the directory.
    #[error("{target} was replaced (current incarnation: {current:?}); resolve the name again")]
    Stale {
        /// The actor asked.
        target: ActorId,
        /// The incarnation now registered under that name, if any.
        current: Option<u64>,
    },
    /// The handler returned an error.
    #[error("{target}: {error}")]
    Handler {
        /// The actor asked.
        target: ActorId,
        /// What the handler said.
        error: ActorError,
    },
    /// The node is shutting down or not ready yet; retry elsewhere or later.
    #[error("node {node} is unavailable: {reason}")]
    Unavailable {
        /// The node.
        node: String,
        /// Why.
        reason: String,
    },
    /// The target's node is known to be dead.
    #[error("node {node} is down")]
    NodeDown {
        /// The dead node.
        node: String,
    },
    /// The transport failed (connection, stream, TLS).
    #[error("transport to {node}: {reason}")]
    Transport {
        /// The peer node.
        node: String,
        /// What failed.
        reason: String,
    },
    /// The request or reply could not be encoded or decoded.
    #[error("codec: {0}")]
    Codec(String),
}

/// Why a tell failed. The message comes back to the caller.
#[derive(Debug)]
pub enum TellError<T> {
    /// The mailbox is full (only from [`ActorRef::try_tell`]).
    Full(T),
    /// The actor is not running.
    Closed(T),
    /// A remote peer could not be reached before anything was sent.
    Unreachable(T, CallError),
    /// The message was handed to the transport and the transport failed afterwards; it
    /// may or may not have been delivered, so it cannot be given back.
    Lost(CallError),
}

impl<T> TellError<T> {
    /// The message, when it was not sent.
    pub fn into_inner(self) -> Option<T> {
        match self {
            TellError::Full(m) | TellError::Closed(m) | TellError::Unreachable(m, _) => Some(m),
            TellError::Lost(_) => None,
        }
    }
}

impl<T> fmt::Display for TellError<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TellError::Full(_) => write!(f, "mailbox full"),
            TellError::Closed(_) => write!(f, "actor not running"),
            TellError::Unreachable(_, e) => write!(f, "unreachable: {e}"),
            TellError::Lost(e) => write!(f, "sent but the transport failed: {e}"),
        }
    }
}

impl<T: fmt::Debug> std::error::Error for TellError<T> {}

/// What an actor's handler sees besides the request.
pub struct Context {
    id: ActorId,
    stop: bool,
}

impl Context {
    /// This actor's identity.
    pub fn id(&self) -> &ActorId {
        &self.id
    }
    /// Stops the actor after the current request (a normal exit).
    pub fn stop(&mut self) {
        self.stop = true;
    }
}

/// A value that serves requests one at a time.
pub trait Actor: Send + 'static {
    /// What it is asked.
    type Request: Send + 'static;
    /// What it answers.
    type Response: Send + 'static;

    /// Runs once before the first request. An error ends the actor as a failure.
    fn started(
        &mut self,
        _ctx: &mut Context,
    ) -> impl Future<Output = Result<(), ActorError>> + Send {
        async { Ok(()) }
    }

    /// Handles one request. An `Err` goes back to the caller; the actor keeps running.
    fn handle(
        &mut self,
        request: Self::Request,
        ctx: &mut Context,
    ) -> impl Future<Output = Result<Self::Response, ActorError>> + Send;

    /// Handles one request, and may answer later: [`Handled::Later`]'s future runs on a
    /// task of its own and its output is the reply, while the actor goes on to its next
    /// requests. The default answers now, with [`Actor::handle`]. The future should hold
    /// no more than it needs: the actor's state is not borrowed by it, and a panic in it
    /// fails that request only, not the actor.
    fn handle_deferred(
        &mut self,
        request: Self::Request,
        ctx: &mut Context,
    ) -> impl Future<Output = Handled<Self::Response>> + Send {
        async move { Handled::Now(self.handle(request, ctx).await) }
    }

    /// Runs once when the actor stops normally (not after a panic).
    fn stopped(&mut self) -> impl Future<Output = ()> + Send {
        async {}
    }

    /// The devices of its node the actor holds while it runs, if any. A node that
    /// spawns it records them in the directory with the actor, so every node's replica
    /// says which actor holds which device. None by default.
    fn device_claim(&self) -> Option<DeviceClaim> {
        None
    }
}

/// What [`Actor::handle_deferred`] answers.
pub enum Handled<R> {
    /// The reply.
    Now(Result<R, ActorError>),
    /// A future whose output is the reply; it runs beside the actor's next requests.
    Later(BoxFuture<'static, Result<R, ActorError>>),
}

impl<R> fmt::Debug for Handled<R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Handled::Now(r) => write!(f, "Now({})", if r.is_ok() { "Ok" } else { "Err" }),
            Handled::Later(_) => write!(f, "Later"),
        }
    }
}

/// How an actor's life ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ExitReason {
    /// It stopped itself, or every reference to it was dropped.
    Normal,
    /// `started` returned an error.
    StartFailed(String),
    /// A handler panicked.
    Panicked(String),
    /// Its node died or left the cluster.
    NodeDown(String),
}

impl ExitReason {
    /// Whether a supervisor with an on-failure policy should restart after this exit.
    pub fn is_failure(&self) -> bool {
        !matches!(self, ExitReason::Normal)
    }
}

pub(crate) type Reply<Resp> = oneshot::Sender<Result<Resp, ActorError>>;

pub(crate) struct Envelope<Req, Resp> {
    pub(crate) request: Req,
    pub(crate) reply: Option<Reply<Resp>>,
}

/// How a reference reaches an actor in another process. Built by the node, which knows
/// how to encode the actor's messages; the reference itself needs no `Message` bound.
pub(crate) trait RemoteRoute<Req, Resp>: Send + Sync {
    fn ask(&self, request: Req, timeout: Duration) -> BoxFuture<'static, Result<Resp, CallError>>;
    fn tell(&self, request: Req) -> BoxFuture<'static, Result<(), TellError<Req>>>;
}

enum Route<Req, Resp> {
    Local(mpsc::Sender<Envelope<Req, Resp>>),
    Remote(Arc<dyn RemoteRoute<Req, Resp>>),
}

impl<Req, Resp> Clone for Route<Req, Resp> {
    fn clone(&self) -> Self {
        match self {
            Route::Local(tx) => Route::Local(tx.clone()),
            Route::Remote(r) => Route::Remote(r.clone()),
        }
    }
}

/// A typed reference to an actor, local or remote. Cheap to clone.
pub struct ActorRef<Req, Resp> {
    id: ActorId,
    route: Route<Req, Resp>,
}

/// The reference type for actor `A`.
pub type Addr<A> = ActorRef<<A as Actor>::Request, <A as Actor>::Response>;

impl<Req, Resp> Clone for ActorRef<Req, Resp> {
    fn clone(&self) -> Self {
        ActorRef {
            id: self.id.clone(),
            route: self.route.clone(),
        }
    }
}

impl<Req, Resp> fmt::Debug for ActorRef<Req, Resp> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let kind = match self.route {
            Route::Local(_) => "local",
            Route::Remote(_) => "remote",
        };
        write!(f, "ActorRef({} {kind})", self.id)
    }
}

impl<Req: Send + 'static, Resp: Send + 'static> ActorRef<Req, Resp> {
    pub(crate) fn remote(id: ActorId, route: Arc<dyn RemoteRoute<Req, Resp>>) -> Self {
        ActorRef {
            id,
            route: Route::Remote(route),
        }
    }

    /// The actor's identity (name and incarnation).
    pub fn id(&self) -> &ActorId {
        &self.id
    }

    /// Whether the actor lives in this process (messages move without encoding).
    pub fn is_local(&self) -> bool {
        matches!(self.route, Route::Local(_))
    }

    /// Sends without waiting for an answer; waits for mailbox room (backpressure).
    pub async fn tell(&self, request: Req) -> Result<(), TellError<Req>> {
        match &self.route {
            Route::Local(tx) => tx
                .send(Envelope {
                    request,
                    reply: None,
                })
                .await
                .map_err(|e| TellError::Closed(e.0.request)),
            Route::Remote(r) => r.tell(request).await,
        }
    }

    /// Sends without waiting; a full mailbox gives the message back at once.
    /// For a remote actor this is the same as [`ActorRef::tell`].
    pub async fn try_tell(&self, request: Req) -> Result<(), TellError<Req>> {
        match &self.route {
            Route::Local(tx) => tx
                .try_send(Envelope {
                    request,
                    reply: None,
                })
                .map_err(|e| match e {
                    mpsc::error::TrySendError::Full(env) => TellError::Full(env.request),
                    mpsc::error::TrySendError::Closed(env) => TellError::Closed(env.request),
                }),
            Route::Remote(r) => r.tell(request).await,
        }
    }

    /// Asks and waits for the answer, at most `timeout` (queueing included).
    pub async fn ask(&self, request: Req, timeout: Duration) -> Result<Resp, CallError> {
        let started = tokio::time::Instant::now();
        let result = self.ask_within(request, timeout).await;
        // Tokio's timer fires on millisecond ticks, so a reply could beat a sub-millisecond
        // deadline it actually missed; a reply after the deadline counts as none.
        if result.is_ok() && started.elapsed() > timeout {
            return Err(CallError::Timeout {
                target: self.id.clone(),
                after: timeout,
            });
        }
        result
    }

    async fn ask_within(&self, request: Req, timeout: Duration) -> Result<Resp, CallError> {
        match &self.route {
            Route::Local(tx) => {
                let target = &self.id;
                let work = async {
                    let (reply, answer) = oneshot::channel();
                    tx.send(Envelope {
                        request,
                        reply: Some(reply),
                    })
                    .await
                    .map_err(|_| CallError::Closed {
                        target: target.clone(),
                    })?;
                    match answer.await {
                        Ok(Ok(resp)) => Ok(resp),
                        Ok(Err(error)) => Err(CallError::Handler {
                            target: target.clone(),
                            error,
                        }),
                        Err(_) => Err(CallError::Died {
                            target: target.clone(),
                        }),
                    }
                };
                match tokio::time::timeout(timeout, work).await {
                    Ok(result) => result,
                    Err(_) => Err(CallError::Timeout {
                        target: target.clone(),
                        after: timeout,
                    }),
                }
            }
            Route::Remote(r) => r.ask(request, timeout).await,
        }
    }
}

/// A spawned actor: its reference and a future that resolves when it exits.
pub struct Running<Req, Resp> {
    /// The reference to send to it.
    pub actor_ref: ActorRef<Req, Resp>,
    /// Resolves with the exit reason.
    pub exit: tokio::task::JoinHandle<ExitReason>,
}

/// Spawns `actor` under `name` with a fresh incarnation and a mailbox of `capacity`.
pub fn spawn<A: Actor>(
    name: ActorName,
    actor: A,
    capacity: usize,
) -> Running<A::Request, A::Response> {
    spawn_with_id(
        ActorId {
            name,
            incarnation: next_incarnation(),
        },
        actor,
        capacity,
    )
}

/// Spawns with a given identity (used by the node and supervisors).
pub fn spawn_with_id<A: Actor>(
    id: ActorId,
    actor: A,
    capacity: usize,
) -> Running<A::Request, A::Response> {
    let (tx, rx) = mpsc::channel(capacity.max(1));
    let actor_ref = ActorRef {
        id: id.clone(),
        route: Route::Local(tx),
    };
    let exit = tokio::spawn(run(id, actor, rx));
    Running { actor_ref, exit }
}

async fn run<A: Actor>(
    id: ActorId,
    mut actor: A,
    mut rx: mpsc::Receiver<Envelope<A::Request, A::Response>>,
) -> ExitReason {
    let mut ctx = Context { id, stop: false };
    match std::panic::AssertUnwindSafe(actor.started(&mut ctx))
        .catch_unwind()
        .await
    {
        Ok(Ok(())) => {}
        Ok(Err(e)) => return ExitReason::StartFailed(e.to_string()),
        Err(panic) => return ExitReason::Panicked(panic_text(&panic)),
    }
    while let Some(Envelope { request, reply }) = rx.recv().await {
        let outcome = std::panic::AssertUnwindSafe(actor.handle_deferred(request, &mut ctx))
            .catch_unwind()
            .await;
        match outcome {
            Ok(Handled::Now(result)) => {
                if let Some(reply) = reply {
                    // The asker may have given up (deadline); that is not our failure.
                    let _ = reply.send(result);
                }
            }
            Ok(Handled::Later(answer)) => {
                let id = ctx.id.clone();
                tokio::spawn(async move {
                    let result = match std::panic::AssertUnwindSafe(answer).catch_unwind().await {
                        Ok(result) => result,
                        Err(panic) => {
                            let text = panic_text(&panic);
                            tracing::error!(actor = %id, panic = %text, "deferred answer panicked");
                            Err(ActorError::Failed(format!("the answer panicked: {text}")))
                        }
                    };
                    if let Some(reply) = reply {
                        let _ = reply.send(result);
                    }
                });
            }
            Err(panic) => {
                let text = panic_text(&panic);
                tracing::error!(actor = %ctx.id, panic = %text, "actor panicked");
                return ExitReason::Panicked(text);
            }
        }
        if ctx.stop {
            break;
        }
    }
    actor.stopped().await;
    ExitReason::Normal
}

fn panic_text(panic: &Box<dyn std::any::Any + Send>) -> String {
    if let Some(s) = panic.downcast_ref::<&str>() {
        s.to_string()
    } else if let Some(s) = panic.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Echo;
    impl Actor for Echo {
        type Request = String;
        type Response = String;
        async fn handle(&mut self, r: String, ctx: &mut Context) -> Result<String, ActorError> {
            match r.as_str() {
                "panic" => panic!("asked to panic"),
                "bad" => Err(ActorError::BadRequest("bad".into())),
                "stop" => {
                    ctx.stop();
                    Ok(r)
                }
                "slow" => {
                    tokio::time::sleep(Duration::from_secs(3600)).await;
                    Ok(r)
                }
                _ => Ok(r),
            }
        }
    }

    fn name() -> ActorName {
        ActorName::new("n", "echo", 0).unwrap()
    }

    #[tokio::test]
    async fn ask_tell_and_errors() {
        let r = spawn(name(), Echo, 4);
        let a = r.actor_ref;
        assert_eq!(
            a.ask("hi".into(), Duration::from_secs(5)).await.unwrap(),
            "hi"
        );
        assert!(matches!(
            a.ask("bad".into(), Duration::from_secs(5)).await,
            Err(CallError::Handler {
                error: ActorError::BadRequest(_),
                ..
            })
        ));
        // The actor survives a handler error.
        assert_eq!(
            a.ask("x".into(), Duration::from_secs(5)).await.unwrap(),
            "x"
        );
        a.tell("stop".into()).await.unwrap();
        assert_eq!(r.exit.await.unwrap(), ExitReason::Normal);
        match a.tell("late".into()).await {
            Err(TellError::Closed(m)) => assert_eq!(m, "late"),
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            a.ask("x".into(), Duration::from_secs(1)).await,
            Err(CallError::Closed { .. })
        ));
    }

    #[tokio::test]
    async fn panic_is_reported_and_pending_ask_fails() {
        let r = spawn(name(), Echo, 4);
        let err = r
            .actor_ref
            .ask("panic".into(), Duration::from_secs(5))
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Died { .. }), "{err:?}");
        assert_eq!(
            r.exit.await.unwrap(),
            ExitReason::Panicked("asked to panic".into())
        );
    }

    #[tokio::test(start_paused = true)]
    async fn ask_has_a_deadline() {
        let r = spawn(name(), Echo, 4);
        let err = r
            .actor_ref
            .ask("slow".into(), Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(matches!(err, CallError::Timeout { .. }), "{err:?}");
    }

    /// Regression: tokio's timer fires on millisecond ticks, so an immediate reply beat
    /// a 1 µs deadline now and then, and a deadline test failed at a later step.
    #[tokio::test]
    async fn a_reply_that_comes_after_the_deadline_is_a_timeout() {
        let r = spawn(name(), Echo, 4);
        for _ in 0..20 {
            let err = r
                .actor_ref
                .ask("x".into(), Duration::from_nanos(1))
                .await
                .unwrap_err();
            assert!(matches!(err, CallError::Timeout { .. }), "{err:?}");
        }
        assert_eq!(
            r.actor_ref
                .ask("x".into(), Duration::from_secs(5))
                .await
                .unwrap(),
            "x"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn bounded_mailbox_gives_message_back() {
        let r = spawn(name(), Echo, 1);
        let a = r.actor_ref;
        // Occupy the actor, then fill its one-slot mailbox.
        a.tell("slow".into()).await.unwrap();
        tokio::task::yield_now().await;
        a.try_tell("one".into()).await.unwrap();
        match a.try_tell("two".into()).await {
            Err(TellError::Full(m)) => assert_eq!(m, "two"),
            other => panic!("expected Full, got {other:?}"),
        }
    }

    /// Answers "wait" when `release` fires, without holding the actor meanwhile; "boom"
    /// panics in its deferred part.
    struct Deferring {
        release: Option<oneshot::Receiver<()>>,
    }
    impl Actor for Deferring {
        type Request = String;
        type Response = String;
        async fn handle(&mut self, r: String, _ctx: &mut Context) -> Result<String, ActorError> {
            Ok(r)
        }
        async fn handle_deferred(&mut self, r: String, ctx: &mut Context) -> Handled<String> {
            match r.as_str() {
                "wait" => {
                    let release = self.release.take().expect("one wait");
                    Handled::Later(Box::pin(async move {
                        release
                            .await
                            .map_err(|_| ActorError::Failed("dropped".into()))?;
                        Ok("waited".to_string())
                    }))
                }
                "boom" => Handled::Later(Box::pin(async { panic!("deferred boom") })),
                _ => Handled::Now(self.handle(r, ctx).await),
            }
        }
    }

    #[tokio::test]
    async fn a_deferred_answer_does_not_hold_the_actor() {
        let (release, rx) = oneshot::channel();
        let a = spawn(name(), Deferring { release: Some(rx) }, 4).actor_ref;
        let waiting = tokio::spawn({
            let a = a.clone();
            async move { a.ask("wait".into(), Duration::from_secs(30)).await }
        });
        // Served while "wait" is still unanswered (a held actor would time out here).
        let t = Duration::from_secs(10);
        assert_eq!(a.ask("hi".into(), t).await.unwrap(), "hi");
        assert!(!waiting.is_finished());
        // A panic in a deferred answer fails that request only.
        match a.ask("boom".into(), t).await {
            Err(CallError::Handler {
                error: ActorError::Failed(why),
                ..
            }) => assert!(why.contains("deferred boom"), "{why}"),
            other => panic!("expected the panic as an error, got {other:?}"),
        }
        assert_eq!(a.ask("still".into(), t).await.unwrap(), "still");
        release.send(()).unwrap();
        assert_eq!(waiting.await.unwrap().unwrap(), "waited");
    }
}
