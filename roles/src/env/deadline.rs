//! Environment calls under a deadline. Each call runs on a thread of its own (the calls
//! of a turn's episodes run side by side); a call that panics is a crash, and one that
//! misses its deadline is abandoned with its environment (its thread finishes on its
//! own; a Python tool's process is killed by the tool's own limit). Either way the
//! episode is marked failed and the rollout goes on.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::env::api::{Env, EnvError};

/// An episode's environment, or nothing once a call lost it.
pub(crate) struct EnvSlot(Option<Box<dyn Env>>);

type Pending<R> = mpsc::Receiver<(Box<dyn Env>, std::thread::Result<Result<R, EnvError>>)>;

impl EnvSlot {
    pub(crate) fn new(env: Box<dyn Env>) -> Self {
        EnvSlot(Some(env))
    }

    /// Starts `f` on the environment on a thread of its own.
    fn start<R: Send + 'static>(
        &mut self,
        op: &'static str,
        f: impl FnOnce(&mut dyn Env) -> Result<R, EnvError> + Send + 'static,
    ) -> Result<Pending<R>, EnvError> {
        let mut env = self.0.take().ok_or_else(|| EnvError::Crashed {
            op,
            reason: "an earlier call lost the environment".into(),
        })?;
        let (tx, rx) = mpsc::sync_channel(1);
        std::thread::Builder::new()
            .name(format!("yatt-env-{op}"))
            .spawn(move || {
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(env.as_mut())));
                let _ = tx.send((env, r));
            })
            .map_err(|e| EnvError::Crashed {
                op,
                reason: format!("cannot start its thread: {e}"),
            })?;
        Ok(rx)
    }

    /// Waits for a started call until `deadline`.
    fn finish<R>(
        &mut self,
        op: &'static str,
        rx: Pending<R>,
        deadline: Instant,
        timeout: Duration,
    ) -> Result<R, EnvError> {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((env, Ok(r))) => {
                self.0 = Some(env);
                r
            }
            Ok((_, Err(panic))) => Err(EnvError::Crashed {
                op,
                reason: panic_message(panic.as_ref()),
            }),
            Err(mpsc::RecvTimeoutError::Timeout) => Err(EnvError::Deadline {
                op,
                seconds: timeout.as_secs_f64(),
            }),
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(EnvError::Crashed {
                op,
                reason: "its thread went away".into(),
            }),
        }
    }
}

/// Runs `f` on every `(slot, input)` pair side by side, each under `timeout`; results in
/// order, with the seconds each took.
pub(crate) fn call_all<I, R>(
    op: &'static str,
    calls: Vec<(&mut EnvSlot, I)>,
    timeout: Duration,
    f: impl Fn(&mut dyn Env, I) -> Result<R, EnvError> + Send + Sync + Clone + 'static,
) -> Vec<(Result<R, EnvError>, f64)>
where
    I: Send + 'static,
    R: Send + 'static,
{
    let t0 = Instant::now();
    let deadline = t0 + timeout;
    let started: Vec<_> = calls
        .into_iter()
        .map(|(slot, input)| {
            let f = f.clone();
            let rx = slot.start(op, move |env| f(env, input));
            (slot, rx)
        })
        .collect();
    started
        .into_iter()
        .map(|(slot, rx)| {
            let r = rx.and_then(|rx| slot.finish(op, rx, deadline, timeout));
            (r, t0.elapsed().as_secs_f64())
        })
        .collect()
}

fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic".into())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::prompt::Prompt;
    use crate::env::api::EnvStep;

    /// Answers `ok`, panics on `panic`, and blocks until told on `hang`.
    struct Scripted(Option<mpsc::Receiver<()>>);

    impl Env for Scripted {
        fn reset(&mut self, _: &Prompt) -> Result<String, EnvError> {
            Ok(String::new())
        }
        fn step(&mut self, action: &str) -> Result<EnvStep, EnvError> {
            match action {
                "panic" => panic!("the tool crashed"),
                "hang" => {
                    let _ = self.0.take().map(|rx| rx.recv());
                    Ok(EnvStep::done(0.0))
                }
                _ => Ok(EnvStep::observe(action.to_uppercase())),
            }
        }
    }

    #[test]
    fn calls_run_side_by_side_and_crashes_and_deadlines_fail_only_their_episode() {
        let (release, hold) = mpsc::channel();
        let mut slots: Vec<EnvSlot> = vec![
            EnvSlot::new(Box::new(Scripted(None))),
            EnvSlot::new(Box::new(Scripted(None))),
            EnvSlot::new(Box::new(Scripted(Some(hold)))),
        ];
        let actions = ["ok", "panic", "hang"];
        let t0 = Instant::now();
        let calls = slots.iter_mut().zip(actions.map(String::from)).collect();
        // Long enough for a panic's backtrace on a loaded machine; the hang never ends
        // on its own, so it always misses it.
        let out = call_all("step", calls, Duration::from_secs(2), |env, a: String| {
            env.step(&a)
        });
        assert!(t0.elapsed() < Duration::from_secs(5));
        assert_eq!(out[0].0.as_ref().unwrap().observation, "OK");
        assert!(
            matches!(&out[1].0, Err(EnvError::Crashed { reason, .. }) if reason.contains("the tool crashed"))
        );
        assert!(matches!(
            out[2].0,
            Err(EnvError::Deadline { op: "step", .. })
        ));
        // The surviving environment answers again; the lost ones say so.
        let calls = slots
            .iter_mut()
            .zip(["again", "x", "x"].map(String::from))
            .collect();
        let out = call_all("step", calls, Duration::from_secs(5), |env, a: String| {
            env.step(&a)
        });
        assert_eq!(out[0].0.as_ref().unwrap().observation, "AGAIN");
        assert!(out[1].0.as_ref().unwrap_err().to_string().contains("lost"));
        let _ = release.send(());
    }
}
