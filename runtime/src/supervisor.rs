//! Supervision: restart policies and the events a supervisor hears.
//!
//! The restart decision is a pure function of the policy and the exit history
//! ([`RestartTracker`]), so it is unit-tested without time or tasks; [`supervise`] is
//! the thin async loop around it.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::sync::{broadcast, watch};
use tokio::time::Instant;

use crate::actor::{spawn_with_id, Actor, ActorRef, ExitReason};
use crate::addr::{next_incarnation, ActorId, ActorName};
use crate::membership::DeviceClaim;

/// When a supervisor restarts a child.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum RestartPolicy {
    /// Never restart; report the exit.
    Never,
    /// Restart after a failure (panic, failed start), not after a normal stop.
    OnFailure {
        /// At most this many restarts within `window`; then give up.
        max_restarts: u32,
        /// The window over which restarts are counted.
        window: Duration,
        /// Delay before the first restart; doubles each time up to `max_backoff`.
        initial_backoff: Duration,
        /// The largest delay between restarts.
        max_backoff: Duration,
    },
}

impl RestartPolicy {
    /// Restart on failure up to 5 times a minute, backing off from 100 ms to 5 s.
    pub fn on_failure() -> Self {
        RestartPolicy::OnFailure {
            max_restarts: 5,
            window: Duration::from_secs(60),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(5),
        }
    }
}

/// What a supervisor decides after a child exits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Start a new incarnation after this delay.
    Restart {
        /// How long to wait first.
        after: Duration,
    },
    /// Leave it stopped: normal exit, or the policy says no.
    Stop,
    /// Too many restarts within the window.
    GiveUp {
        /// Restarts counted within the window.
        restarts: u32,
    },
}

/// The restart history of one child, and the decision rule.
#[derive(Debug, Clone)]
pub struct RestartTracker {
    policy: RestartPolicy,
    restarts: Vec<Instant>,
}

impl RestartTracker {
    /// A tracker with no history.
    pub fn new(policy: RestartPolicy) -> Self {
        RestartTracker {
            policy,
            restarts: Vec::new(),
        }
    }

    /// Decides what to do about an exit at `now`, and records a restart if it is one.
    pub fn on_exit(&mut self, now: Instant, reason: &ExitReason) -> Decision {
        let RestartPolicy::OnFailure {
            max_restarts,
            window,
            initial_backoff,
            max_backoff,
        } = &self.policy
        else {
            return Decision::Stop;
        };
        if !reason.is_failure() {
            return Decision::Stop;
        }
        self.restarts.retain(|t| now.duration_since(*t) < *window);
        let recent = self.restarts.len() as u32;
        if recent >= *max_restarts {
            return Decision::GiveUp { restarts: recent };
        }
        let after = initial_backoff
            .checked_mul(1u32 << recent.min(20))
            .unwrap_or(*max_backoff)
            .min(*max_backoff);
        self.restarts.push(now);
        Decision::Restart { after }
    }
}

/// What happened to a supervised child.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChildEvent {
    /// An incarnation started.
    Started(ActorId),
    /// An incarnation exited.
    Exited {
        /// Which incarnation.
        id: ActorId,
        /// Why.
        reason: ExitReason,
    },
    /// The policy gave up; the child stays down.
    GaveUp {
        /// The child's name.
        name: ActorName,
        /// Restarts counted within the window.
        restarts: u32,
    },
}

/// A handle on a supervised child: the current incarnation's reference, and events.
pub struct Supervised<Req, Resp> {
    current: watch::Receiver<Option<ActorRef<Req, Resp>>>,
    events: broadcast::Sender<ChildEvent>,
    task: tokio::task::JoinHandle<()>,
}

impl<Req: Send + 'static, Resp: Send + 'static> Supervised<Req, Resp> {
    /// The running incarnation, if any.
    pub fn current(&self) -> Option<ActorRef<Req, Resp>> {
        self.current.borrow().clone()
    }
    /// A watch that changes with every new incarnation (None while down).
    pub fn watch(&self) -> watch::Receiver<Option<ActorRef<Req, Resp>>> {
        self.current.clone()
    }
    /// Subscribes to the child's events.
    pub fn events(&self) -> broadcast::Receiver<ChildEvent> {
        self.events.subscribe()
    }
    /// Stops supervising (the running incarnation stops when its references drop).
    pub fn abort(&self) {
        self.task.abort();
    }
}

/// Hooks a supervisor calls around each incarnation, e.g. to register it with a node.
pub trait Lifecycle<Req, Resp>: Send + Sync + 'static {
    /// An incarnation started, holding `claim` ([`crate::Actor::device_claim`]).
    fn started(&self, _actor: &ActorRef<Req, Resp>, _claim: Option<&DeviceClaim>) {}
    /// An incarnation exited.
    fn exited(&self, _id: &ActorId, _reason: &ExitReason) {}
}

/// No hooks.
pub struct NoHooks;
impl<Req, Resp> Lifecycle<Req, Resp> for NoHooks {}

/// Runs `make()` as a child named `name`, restarting it as `policy` says. Each life gets
/// a new incarnation, so messages for a dead life never reach its successor.
pub fn supervise<A, F, L>(
    name: ActorName,
    capacity: usize,
    policy: RestartPolicy,
    hooks: L,
    make: F,
) -> Supervised<A::Request, A::Response>
where
    A: Actor,
    F: Fn() -> A + Send + 'static,
    L: Lifecycle<A::Request, A::Response>,
{
    let (current_tx, current) = watch::channel(None);
    let (events, _) = broadcast::channel(64);
    let events_tx = events.clone();
    let task = tokio::spawn(async move {
        let mut tracker = RestartTracker::new(policy);
        loop {
            let id = ActorId {
                name: name.clone(),
                incarnation: next_incarnation(),
            };
            let actor = make();
            let claim = actor.device_claim();
            let running = spawn_with_id(id.clone(), actor, capacity);
            hooks.started(&running.actor_ref, claim.as_ref());
            let _ = current_tx.send(Some(running.actor_ref));
            let _ = events_tx.send(ChildEvent::Started(id.clone()));
            let reason = running
                .exit
                .await
                .unwrap_or_else(|e| ExitReason::Panicked(e.to_string()));
            let _ = current_tx.send(None);
            hooks.exited(&id, &reason);
            let _ = events_tx.send(ChildEvent::Exited {
                id,
                reason: reason.clone(),
            });
            match tracker.on_exit(Instant::now(), &reason) {
                Decision::Restart { after } => tokio::time::sleep(after).await,
                Decision::Stop => return,
                Decision::GiveUp { restarts } => {
                    tracing::error!(child = %name, restarts, "supervisor gave up restarting");
                    let _ = events_tx.send(ChildEvent::GaveUp { name, restarts });
                    return;
                }
            }
        }
    });
    Supervised {
        current,
        events,
        task,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::actor::{ActorError, CallError, Context};

    fn policy(max: u32) -> RestartPolicy {
        RestartPolicy::OnFailure {
            max_restarts: max,
            window: Duration::from_secs(10),
            initial_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_millis(350),
        }
    }

    #[test]
    fn backoff_doubles_caps_and_gives_up() {
        let t0 = Instant::now();
        let mut tr = RestartTracker::new(policy(4));
        let fail = ExitReason::Panicked("x".into());
        let ms = |d| Decision::Restart {
            after: Duration::from_millis(d),
        };
        assert_eq!(tr.on_exit(t0, &fail), ms(100));
        assert_eq!(tr.on_exit(t0, &fail), ms(200));
        assert_eq!(tr.on_exit(t0, &fail), ms(350));
        assert_eq!(tr.on_exit(t0, &fail), ms(350));
        assert_eq!(tr.on_exit(t0, &fail), Decision::GiveUp { restarts: 4 });
        // Outside the window the history is forgotten.
        assert_eq!(tr.on_exit(t0 + Duration::from_secs(11), &fail), ms(100));
    }

    #[test]
    fn normal_exit_and_never_policy_stop() {
        let t0 = Instant::now();
        assert_eq!(
            RestartTracker::new(policy(3)).on_exit(t0, &ExitReason::Normal),
            Decision::Stop
        );
        assert_eq!(
            RestartTracker::new(RestartPolicy::Never)
                .on_exit(t0, &ExitReason::Panicked("p".into())),
            Decision::Stop
        );
    }

    struct Fragile;
    impl Actor for Fragile {
        type Request = bool;
        type Response = u8;
        async fn handle(&mut self, crash: bool, _: &mut Context) -> Result<u8, ActorError> {
            if crash {
                panic!("crash requested");
            }
            Ok(1)
        }
    }

    #[tokio::test(start_paused = true)]
    async fn restarts_with_new_incarnation_and_old_ref_is_refused() {
        let name = ActorName::new("n", "fragile", 0).unwrap();
        let sup = supervise(name, 8, policy(3), NoHooks, || Fragile);
        let mut events = sup.events();
        let mut watch = sup.watch();
        let first = watch
            .wait_for(|r| r.is_some())
            .await
            .unwrap()
            .clone()
            .unwrap();
        assert_eq!(first.ask(false, Duration::from_secs(1)).await.unwrap(), 1);
        assert!(matches!(
            first.ask(true, Duration::from_secs(1)).await,
            Err(CallError::Died { .. })
        ));
        let second = watch
            .wait_for(|r| r.as_ref().is_some_and(|r| r.id() != first.id()))
            .await
            .unwrap()
            .clone()
            .unwrap();
        assert!(second.id().incarnation > first.id().incarnation);
        // The old incarnation's reference does not reach the successor.
        assert!(matches!(
            first.ask(false, Duration::from_secs(1)).await,
            Err(CallError::Closed { .. })
        ));
        assert_eq!(second.ask(false, Duration::from_secs(1)).await.unwrap(), 1);
        assert_eq!(
            events.recv().await.unwrap(),
            ChildEvent::Started(first.id().clone())
        );
        assert!(matches!(
            events.recv().await.unwrap(),
            ChildEvent::Exited {
                reason: ExitReason::Panicked(_),
                ..
            }
        ));
    }
}
