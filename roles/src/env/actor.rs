//! Environments as actors: an [`EnvRole`] hosts the episodes of many rollouts' samples on
//! any node, and a [`RemoteEnvPool`] is a rollout's pool of such actors, handing each
//! episode an [`Env`] that forwards its calls there (each under the rollout's deadline).
//!
//! The pool supervises its actors: a call that finds its actor dead (a crash, a missed
//! deadline, its node gone) drops it, and the next call on that slot spawns a new one
//! through the pool's spawn function. The episode whose call failed is marked failed
//! (a reset is retried once by the rollout, which lands on the new actor).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_runtime::{ActorRef, CallError};

use crate::data::prompt::Prompt;
use crate::env::api::{Env, EnvError, EnvFactory, EnvStep};
use crate::role::{DeviceGroup, ResourceProfile, Role, RoleError, RoleRequest, RoleResponse};

/// Most episodes one environment actor holds at once (a bounded table).
pub const MAX_EPISODES_PER_ACTOR: usize = 4096;

/// What an environment actor is asked.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum EnvRequest {
    /// Start episode `episode` on `prompt`.
    Reset {
        /// The episode (unique within the pool).
        episode: u64,
        /// Its prompt.
        prompt: Prompt,
    },
    /// The model's turn of episode `episode`.
    Step {
        /// The episode.
        episode: u64,
        /// The model's text.
        action: String,
    },
    /// Forget episode `episode`.
    End {
        /// The episode.
        episode: u64,
    },
}

/// What an environment actor answers.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum EnvResponse {
    /// The first observation, and the next turn's prefix.
    Reset(String, Option<String>),
    /// The step, and the next turn's prefix.
    Stepped(EnvStep, Option<String>),
    /// The episode is forgotten.
    Ended,
}

/// A reference to an environment actor.
pub type EnvActorRef = ActorRef<RoleRequest<EnvRequest>, RoleResponse<EnvResponse>>;

/// The role that hosts episodes: one environment per episode, made by its factory.
pub struct EnvRole {
    factory: Arc<dyn EnvFactory>,
    episodes: HashMap<u64, Box<dyn Env>>,
}

impl EnvRole {
    /// A host of `factory`'s environments.
    pub fn new(factory: Arc<dyn EnvFactory>) -> Self {
        EnvRole {
            factory,
            episodes: HashMap::new(),
        }
    }

    fn episode(&mut self, id: u64) -> Result<&mut Box<dyn Env>, RoleError> {
        self.episodes.get_mut(&id).ok_or_else(|| {
            RoleError::BadRequest(format!(
                "episode {id} is not running here (no reset, or this actor restarted)"
            ))
        })
    }
}

impl Role for EnvRole {
    type Request = EnvRequest;
    type Response = EnvResponse;

    fn name(&self) -> &str {
        "env"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> {
        Ok(())
    }

    fn serve(&mut self, request: EnvRequest) -> Result<EnvResponse, RoleError> {
        let env_err = |e: EnvError| RoleError::Failed(e.to_string());
        match request {
            EnvRequest::Reset { episode, prompt } => {
                if self.episodes.len() >= MAX_EPISODES_PER_ACTOR {
                    return Err(RoleError::Failed(format!(
                        "{MAX_EPISODES_PER_ACTOR} episodes already run on this environment actor; end some, or give the pool more actors (rollout.env.pool)"
                    )));
                }
                let mut env = self.factory.make(&prompt).map_err(env_err)?;
                let first = env.reset(&prompt).map_err(env_err)?;
                let prefix = env.turn_prefix();
                self.episodes.insert(episode, env);
                Ok(EnvResponse::Reset(first, prefix))
            }
            EnvRequest::Step { episode, action } => {
                let env = self.episode(episode)?;
                let step = env.step(&action).map_err(env_err)?;
                let prefix = env.turn_prefix();
                Ok(EnvResponse::Stepped(step, prefix))
            }
            EnvRequest::End { episode } => {
                self.episodes.remove(&episode);
                Ok(EnvResponse::Ended)
            }
        }
    }
}

/// Starts a new environment actor (for the pool's supervision).
pub type SpawnEnvActor = Arc<
    dyn Fn() -> Pin<Box<dyn Future<Output = Result<EnvActorRef, String>> + Send>> + Send + Sync,
>;

/// A rollout's pool of environment actors (see the module docs).
pub struct RemoteEnvPool {
    slots: Vec<Mutex<Option<EnvActorRef>>>,
    spawn: SpawnEnvActor,
    runtime: tokio::runtime::Handle,
    call_timeout: Duration,
    next_episode: AtomicU64,
    restarts: AtomicU64,
}

impl RemoteEnvPool {
    /// A pool of `size` actors started with `spawn` on `runtime`; each call waits at
    /// most `call_timeout`. Call it from inside the runtime.
    pub async fn start(
        size: usize,
        spawn: SpawnEnvActor,
        call_timeout: Duration,
    ) -> Result<Arc<Self>, String> {
        let mut slots = Vec::with_capacity(size.max(1));
        for _ in 0..size.max(1) {
            slots.push(Mutex::new(Some(spawn().await?)));
        }
        Ok(Arc::new(RemoteEnvPool {
            slots,
            spawn,
            runtime: tokio::runtime::Handle::current(),
            call_timeout,
            next_episode: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
        }))
    }

    /// Actors started again after a failure, so far.
    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// The actors now in the pool (a dead one's slot is empty until its next call).
    pub fn actors(&self) -> Vec<EnvActorRef> {
        self.slots
            .iter()
            .filter_map(|s| s.lock().unwrap_or_else(|e| e.into_inner()).clone())
            .collect()
    }

    /// The slot's actor, spawned again if the last call lost it.
    fn actor(&self, slot: usize) -> Result<EnvActorRef, EnvError> {
        let mut s = self.slots[slot].lock().unwrap_or_else(|e| e.into_inner());
        if let Some(a) = s.as_ref() {
            return Ok(a.clone());
        }
        let a = self
            .runtime
            .block_on((self.spawn)())
            .map_err(|reason| EnvError::Crashed {
                op: "restart",
                reason: format!("cannot start the environment actor again: {reason}"),
            })?;
        self.restarts.fetch_add(1, Ordering::Relaxed);
        tracing::info!(actor = %a.id(), "environment actor restarted");
        *s = Some(a.clone());
        Ok(a)
    }

    fn call(
        &self,
        slot: usize,
        op: &'static str,
        req: EnvRequest,
    ) -> Result<EnvResponse, EnvError> {
        let actor = self.actor(slot)?;
        let answer = self
            .runtime
            .block_on(actor.ask(RoleRequest::Serve(req), self.call_timeout));
        match answer {
            Ok(RoleResponse::Served(r)) => Ok(r),
            Ok(_) => Err(EnvError::Failed(format!(
                "{}: an answer of another kind",
                actor.id()
            ))),
            // The environment itself refused or failed: the actor is fine.
            Err(CallError::Handler { error, .. }) => Err(EnvError::Failed(error.to_string())),
            Err(e) => {
                // Dead, replaced, unreachable or hung: the slot starts a new actor next.
                let mut s = self.slots[slot].lock().unwrap_or_else(|e| e.into_inner());
                if s.as_ref().is_some_and(|a| a.id() == actor.id()) {
                    *s = None;
                }
                Err(match e {
                    CallError::Timeout { after, .. } => EnvError::Deadline {
                        op,
                        seconds: after.as_secs_f64(),
                    },
                    other => EnvError::Crashed {
                        op,
                        reason: other.to_string(),
                    },
                })
            }
        }
    }
}

impl EnvFactory for Arc<RemoteEnvPool> {
    fn make(&self, _prompt: &Prompt) -> Result<Box<dyn Env>, EnvError> {
        let episode = self.next_episode.fetch_add(1, Ordering::Relaxed);
        Ok(Box::new(RemoteEnv {
            pool: self.clone(),
            slot: (episode % self.slots.len() as u64) as usize,
            episode,
            prefix: None,
            started: false,
        }))
    }
}

/// One episode's environment, living on an actor of the pool.
struct RemoteEnv {
    pool: Arc<RemoteEnvPool>,
    slot: usize,
    episode: u64,
    prefix: Option<String>,
    started: bool,
}

impl Env for RemoteEnv {
    fn reset(&mut self, prompt: &Prompt) -> Result<String, EnvError> {
        let req = EnvRequest::Reset {
            episode: self.episode,
            prompt: prompt.clone(),
        };
        match self.pool.call(self.slot, "reset", req)? {
            EnvResponse::Reset(first, prefix) => {
                self.started = true;
                self.prefix = prefix;
                Ok(first)
            }
            _ => Err(EnvError::Failed("reset: an answer of another kind".into())),
        }
    }

    fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
        let req = EnvRequest::Step {
            episode: self.episode,
            action: action.to_string(),
        };
        match self.pool.call(self.slot, "step", req)? {
            EnvResponse::Stepped(step, prefix) => {
                self.prefix = prefix;
                Ok(step)
            }
            _ => Err(EnvError::Failed("step: an answer of another kind".into())),
        }
    }

    fn turn_prefix(&mut self) -> Option<String> {
        self.prefix.take()
    }
}

impl Drop for RemoteEnv {
    fn drop(&mut self) {
        if !self.started {
            return;
        }
        // Best effort, without waiting: a lost `End` leaves one entry in a bounded table.
        let actor = self.pool.slots[self.slot]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Some(a) = actor {
            let end = RoleRequest::Serve(EnvRequest::End {
                episode: self.episode,
            });
            self.pool.runtime.spawn(async move {
                let _ = a.try_tell(end).await;
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env::api::EnvStep;
    use crate::role::RoleActor;

    /// Echoes actions; panics (a crash of the whole actor) on "crash".
    struct Crashy;

    impl Env for Crashy {
        fn reset(&mut self, p: &Prompt) -> Result<String, EnvError> {
            Ok(format!("start {}", p.text))
        }
        fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
            if action == "crash" {
                panic!("the tool crashed");
            }
            Ok(EnvStep::observe(action.to_uppercase()))
        }
    }

    fn prompt() -> Prompt {
        Prompt {
            id: 1,
            text: "p".into(),
            reference: None,
            metadata: serde_json::Value::Null,
            messages: Vec::new(),
        }
    }

    /// Real actors (in-process route): a crash mid-episode fails that episode's call,
    /// the pool starts a new actor, and the next episodes run there.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_crashed_environment_actor_is_restarted_and_only_its_episode_fails() {
        let spawn: SpawnEnvActor = Arc::new(|| {
            Box::pin(async {
                let factory: Arc<dyn EnvFactory> =
                    Arc::new(|_: &Prompt| -> Result<Box<dyn Env>, EnvError> {
                        Ok(Box::new(Crashy))
                    });
                let role = RoleActor::build(
                    "env",
                    move || Ok(EnvRole::new(factory)),
                    crate::role::DeviceGroup::cpu("test"),
                    4,
                )
                .await
                .map_err(|e| e.to_string())?;
                let name =
                    yatt_runtime::ActorName::new("test", "env", 0).map_err(|e| e.to_string())?;
                Ok(yatt_runtime::spawn(name, role, 8).actor_ref)
            })
        });
        let pool = RemoteEnvPool::start(1, spawn, Duration::from_secs(10))
            .await
            .unwrap();
        let first = pool.actors()[0].id().clone();
        let p = pool.clone();
        // Environment calls block: they run on threads of their own, as in a rollout.
        tokio::task::spawn_blocking(move || {
            let mut a = p.make(&prompt()).unwrap();
            assert_eq!(a.reset(&prompt()).unwrap(), "start p");
            assert_eq!(a.step("ok").unwrap().observation, "OK");
            let e = a.step("crash").unwrap_err();
            assert!(matches!(e, EnvError::Crashed { op: "step", .. }), "{e}");
            let mut b = p.make(&prompt()).unwrap();
            assert_eq!(b.reset(&prompt()).unwrap(), "start p");
            assert_eq!(b.step("fine").unwrap().observation, "FINE");
            // The crashed episode is gone with its actor.
            let e = a.step("again").unwrap_err();
            assert!(e.to_string().contains("not running here"), "{e}");
        })
        .await
        .unwrap();
        assert_eq!(pool.restarts(), 1);
        assert_ne!(pool.actors()[0].id(), &first);
    }
}
