//! Running a job: its steps, metrics and checkpoints.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::Instant;
use yatt_metrics::{RunWriter, WriteError};
use yatt_runtime::{ActorId, Node};

use crate::build::custom::CustomRoles;
use crate::build::embedded::build_embedded_with;
use crate::build::respawn::{respawn_lost_roles, Recovered};
use crate::build::user_roles::{with_config_roles, NamedRoles};
use crate::checkpoint::{check_same_run, recover, save, RunState, JOB_FILE};
use crate::config::modes::PlacementMode;
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::data_parallel::step_data_parallel;
use crate::controller::release::StartedRoles;
use crate::controller::report::{average_heads, ControllerState, StepMetrics};
use crate::error::JobError;
use crate::eval::{evaluate_after_step, start_eval_log};
use crate::live::state::LivePlacement;
use crate::preflight::{preflight, Certificate};
use yatt_metrics::names;

/// Runs `steps` steps of `controllers` (together with [`step_data_parallel`] when there
/// are several) and calls `on_step` with each step's metrics (averaged over the heads).
pub async fn run_steps(
    controllers: &mut [Controller],
    steps: u64,
    mut on_step: impl FnMut(&StepMetrics) -> Result<(), JobError>,
) -> Result<(), JobError> {
    for _ in 0..steps {
        let reports = if controllers.len() == 1 {
            vec![controllers[0].step().await?]
        } else {
            step_data_parallel(controllers).await?
        };
        let metrics = average_heads(&reports);
        on_step(&metrics)?;
    }
    Ok(())
}

/// One finished step, as [`train`] reports it.
#[derive(Debug, Clone)]
pub struct Progress<'a> {
    /// 1-based step number.
    pub step: u64,
    /// Total steps.
    pub total: u64,
    /// Seconds since this session's first step started.
    pub elapsed_s: f64,
    /// Steps already done when this session began (a resumed run's checkpoint step;
    /// 0 for a fresh run): `elapsed_s` covers the steps after it.
    pub first_step: u64,
    /// The step's metrics.
    pub metrics: &'a StepMetrics,
}

/// What a finished run produced.
#[derive(Debug, Clone)]
pub struct TrainSummary {
    /// Steps run.
    pub steps: u64,
    /// `OUTPUT_DIR/metrics.jsonl`.
    pub metrics_path: PathBuf,
    /// `OUTPUT_DIR/checkpoint`.
    pub checkpoint_dir: PathBuf,
    /// Seconds of the steps (not counting set-up).
    pub seconds: f64,
    /// `critic/rewards/mean` of every step.
    pub rewards: Vec<f64>,
}

/// Builds the job on `node` and runs it: writes one JSON object per step to
/// `OUTPUT_DIR/metrics.jsonl` and the same metrics as TensorBoard scalars to
/// `OUTPUT_DIR/events.out.tfevents.*` (see [`yatt_metrics::RunWriter`]), saves the policy to `OUTPUT_DIR/checkpoint` every
/// `checkpoint.every` steps and at the end, and calls `on_step` after each step.
///
/// When the job ends, finished or failed, the roles it started stop (their models freed,
/// their names free for the next job on these nodes); roles the caller brought
/// ([`TrainOptions::roles`]) keep running.
pub async fn train(
    job: &JobConfig,
    node: &Node,
    on_step: impl FnMut(&Progress<'_>),
) -> Result<TrainSummary, JobError> {
    train_with(job, node, TrainOptions::default(), on_step).await
}

/// How [`train_with`] runs a job.
#[derive(Debug, Clone, Default)]
pub struct TrainOptions {
    /// Continue the run in `job.output_dir` from its checkpoint: steps already done
    /// are skipped (`job.steps` is the run's total) and metrics are appended.
    pub resume: bool,
    /// Roles the caller brings in place of the built-in ones.
    pub roles: CustomRoles,
    /// The certificate this process joined the cluster with: its preflight checks that
    /// it outlives the run.
    pub certificate: Option<Certificate>,
}

/// [`train`] with options: resuming, custom roles.
pub async fn train_with(
    job: &JobConfig,
    node: &Node,
    options: TrainOptions,
    mut on_step: impl FnMut(&Progress<'_>),
) -> Result<TrainSummary, JobError> {
    let resume = options.resume;
    job.validate()?;
    check_live_roles(job, &options.roles)?;
    // Everything that could fail later is checked now, on the nodes where it matters.
    let checked = preflight(job, node, &options.roles, options.certificate.as_ref())
        .await
        .into_result()?;
    for w in checked.warnings() {
        tracing::warn!("preflight: {w}");
    }
    let out = job.job.output_dir.clone();
    std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
        path: out.clone(),
        source,
    })?;
    // Roles on other nodes save into the checkpoint too: a relative path would land
    // under each node's working directory instead of the run's.
    let out = out.canonicalize().map_err(|source| JobError::Write {
        path: out.clone(),
        source,
    })?;
    let checkpoint_dir = out.join("checkpoint");
    if resume {
        // Before job.toml is overwritten: it is the run's record of what it is.
        check_same_run(job, &out)?;
        recover(&checkpoint_dir)?;
    }
    let job_path = out.join(JOB_FILE);
    let text = toml::to_string(job).map_err(|e| JobError::Resume {
        dir: out.clone(),
        reason: format!("cannot write the job config: {e}"),
    })?;
    std::fs::write(&job_path, text).map_err(|source| JobError::Write {
        path: job_path.clone(),
        source,
    })?;
    let metrics_err = |e: WriteError| JobError::Write {
        path: e.path,
        source: e.source,
    };
    let (roles, mut named) = with_config_roles(job, node, &options.roles).await?;
    // The program's own roles: a node loss cannot bring them back (a role `[roles]`
    // names is spawned again by its name), and the job leaves them running at its end.
    let mut custom = roles.actor_ids();
    custom.retain(|id| !named.contains(id));
    let mut live: Option<LivePlacement> = None;
    let mut controllers: Vec<Controller> = Vec::new();
    let ran: Result<TrainSummary, JobError> = async {
        // Live placement owns the heads and re-routes them between steps.
        if job.placement.live {
            let checkpoint = resume.then_some(checkpoint_dir.as_path());
            live = Some(LivePlacement::build_from(job, node, checkpoint, &roles).await?);
        } else if job.placement.mode == PlacementMode::Disaggregated {
            let checkpoint = resume.then_some(checkpoint_dir.as_path());
            controllers =
                crate::build::cluster::build_cluster_from(job, node, checkpoint, &roles).await?;
        } else {
            controllers =
                build_embedded_with(job, node, resume.then_some(out.as_path()), &roles).await?;
        }
        let mut step = match &live {
            Some(l) => l.controllers().first().map_or(0, Controller::step_count),
            None => controllers.first().map_or(0, Controller::step_count),
        };
        // metrics.jsonl and a TensorBoard event file, both flushed after every step.
        let mut writer = if resume {
            RunWriter::resume(&out, step)
        } else {
            RunWriter::create(&out)
        }
        .map_err(metrics_err)?;
        let metrics_path = writer.metrics_path().to_path_buf();
        start_eval_log(&out, resume.then_some(step))?;
        if job.eval.before_train && !resume {
            // Nothing is trained yet, so a failure here needs no recovery hint.
            evaluate_after_step(job, None, 0, &out).await?;
        }
        let total = job.job.steps;
        let every = job.checkpoint.every;
        let t0 = Instant::now();
        let first_step = step;
        let mut rewards = Vec::new();
        let mut saved_at = None;
        let mut losses = NodeLoss {
            job,
            node,
            custom: &custom,
            named: &mut named,
        };
        for _ in step..total {
            let mut record = |m: &StepMetrics| {
                step += 1;
                let m = &with_process_memory(m);
                writer.write_step(step, &m.values).map_err(metrics_err)?;
                rewards.push(m.get(names::REWARDS_MEAN).unwrap_or(f64::NAN));
                on_step(&Progress {
                    step,
                    total,
                    elapsed_s: t0.elapsed().as_secs_f64(),
                    first_step,
                    metrics: m,
                });
                Ok::<(), JobError>(())
            };
            let stepped = match live.as_mut() {
                Some(l) => match l.step().await {
                    Ok(m) => record(&m),
                    Err(e) => Err(e),
                },
                None if job.placement.mode == PlacementMode::Disaggregated => {
                    match losses.step(&mut controllers).await {
                        Ok(m) => record(&m),
                        Err(e) => Err(e),
                    }
                }
                None => run_steps(&mut controllers, 1, record).await,
            };
            if let Err(e) = stepped {
                return Err(JobError::Stopped {
                    source: Box::new(e),
                    recovery: recovery_hint(&out, &checkpoint_dir, every),
                });
            }
            let eval_now = job.eval.every > 0 && (step % job.eval.every == 0 || step == total);
            if (every > 0 && step % every == 0 && step < total) || eval_now {
                let at = save_point(step, total);
                save_or_rescue(
                    live.as_ref(),
                    &mut losses,
                    &mut controllers,
                    &checkpoint_dir,
                    at,
                    &checked.data_dirs,
                )
                .await?;
                saved_at = Some(step);
            }
            if eval_now {
                evaluate_after_step(job, Some(&checkpoint_dir), step, &out)
                    .await
                    .map_err(|e| JobError::Stopped {
                        source: Box::new(e),
                        recovery: recovery_hint(&out, &checkpoint_dir, every),
                    })?;
            }
        }
        let seconds = t0.elapsed().as_secs_f64();
        // The last step's checkpoint is already there when it was evaluated.
        if saved_at != Some(step) {
            let at = save_point(step, total);
            save_or_rescue(
                live.as_ref(),
                &mut losses,
                &mut controllers,
                &checkpoint_dir,
                at,
                &checked.data_dirs,
            )
            .await?;
        }
        Ok(TrainSummary {
            steps: step,
            metrics_path,
            checkpoint_dir,
            seconds,
            rewards,
        })
    }
    .await;
    // The job is over, finished or not: its roles (built-in, and those `[roles]` named)
    // stop, so their memory and names are free for the next job on these nodes.
    let started = StartedRoles::default();
    started.add_custom(&roles);
    match &live {
        Some(l) => l.add_roles_to(&started),
        None => controllers.iter().for_each(|c| started.add_controller(c)),
    }
    started.forget(&custom);
    let n = started.len();
    let stopped = started.stop_all(node, job).await;
    tracing::info!(stopped, of = n, "stopped the job's roles");
    ran
}

/// How often one step may lose roles and run again before the run stops.
const STEP_RECOVERIES: usize = 3;

/// What a disaggregated run needs to put back the roles of a node it lost (see
/// [`respawn_lost_roles`]) and go on.
struct NodeLoss<'a> {
    job: &'a JobConfig,
    node: &'a Node,
    /// The program's own roles, which a loss cannot bring back.
    custom: &'a BTreeSet<ActorId>,
    named: &'a mut NamedRoles,
}

impl NodeLoss<'_> {
    /// One step of a disaggregated run. A step that fails because a node hosting
    /// stateless roles or a policy replica died runs again with those roles on
    /// surviving nodes; its metrics then count the whole wall time and the roles
    /// respawned (`recovery/respawned_roles`).
    async fn step(&mut self, controllers: &mut [Controller]) -> Result<StepMetrics, JobError> {
        let t = Instant::now();
        let mut respawned = 0;
        // The heads as they were before the step: every recovery puts them back here.
        let before: Vec<ControllerState> = controllers.iter().map(Controller::state).collect();
        for attempt in 0.. {
            let mut done = None;
            let stepped = run_steps(controllers, 1, |m| {
                done = Some(m.clone());
                Ok(())
            })
            .await;
            let failed = match stepped {
                Ok(()) => {
                    let mut m = done.expect("one step reports its metrics");
                    if respawned > 0 {
                        m.values
                            .insert(names::STEP_S.into(), t.elapsed().as_secs_f64());
                        m.values
                            .insert(names::RECOVERY_RESPAWNED.into(), respawned as f64);
                    }
                    return Ok(m);
                }
                Err(e) => e,
            };
            let step = before.first().map_or(0, |s| s.step) + 1;
            let error = failed.to_string();
            let moved = self.put_back(controllers, &before, failed, attempt).await?;
            tracing::warn!(step, error, moved = ?moved, "a node was lost; its roles run elsewhere and the step runs again");
            respawned += moved.len();
        }
        unreachable!("the loop returns")
    }

    /// Saves the checkpoint `dir`. A save that fails because a node was lost (a policy
    /// without replicas, rebuilt from its log) puts back what the node held and saves
    /// again.
    async fn save(&mut self, controllers: &mut [Controller], dir: &Path) -> Result<(), JobError> {
        // The heads stay where they are: a recovery only puts the lost roles back.
        let now: Vec<ControllerState> = controllers.iter().map(Controller::state).collect();
        for attempt in 0.. {
            let failed = match save(controllers, dir).await {
                Ok(()) => return Ok(()),
                Err(e) => e,
            };
            let error = failed.to_string();
            let moved = self.put_back(controllers, &now, failed, attempt).await?;
            tracing::warn!(error, moved = ?moved, "a node was lost during the checkpoint; its roles run elsewhere and the checkpoint is saved again");
        }
        unreachable!("the loop returns")
    }

    /// After `failed`, the `attempt`th failure of one step or save, puts the lost
    /// roles back with the heads at `before`: what moved, or the error to stop with.
    async fn put_back(
        &mut self,
        controllers: &mut [Controller],
        before: &[ControllerState],
        failed: JobError,
        attempt: usize,
    ) -> Result<Vec<String>, JobError> {
        if attempt == STEP_RECOVERIES {
            return Err(failed);
        }
        let (job, node) = (self.job, self.node);
        let recovered = respawn_lost_roles(
            job,
            node,
            controllers,
            before,
            &failed,
            self.custom,
            self.named,
        );
        match recovered.await? {
            Recovered::Moved(moved) if !moved.is_empty() => Ok(moved),
            Recovered::Moved(_) => Err(failed),
            Recovered::NotMoved(why) => Err(why.unwrap_or(failed)),
        }
    }
}

/// Saves the run's checkpoint `dir`: the live placement's controllers when there is
/// one, a disaggregated run's surviving a node's loss.
async fn save_checkpoint(
    live: Option<&LivePlacement>,
    losses: &mut NodeLoss<'_>,
    controllers: &mut [Controller],
    dir: &Path,
) -> Result<(), JobError> {
    match live {
        Some(l) => save(l.controllers(), dir).await,
        None if losses.job.placement.mode == PlacementMode::Disaggregated => {
            losses.save(controllers, dir).await
        }
        None => save(controllers, dir).await,
    }
}

/// What a run that just failed can be resumed from: its last checkpoint and the command,
/// or that it saved none and why.
fn recovery_hint(out: &Path, checkpoint: &Path, every: u64) -> String {
    match RunState::read(checkpoint) {
        Ok(state) => format!(
            "the last checkpoint is at step {}: continue with `yatt train --resume {}` (add --cluster ... for a cluster run)",
            state.controllers.first().map_or(0, |c| c.step),
            out.display()
        ),
        Err(_) if every == 0 => "no checkpoint was saved (checkpoint.every = 0 saves only at the end), so this run cannot be resumed; set checkpoint.every = N to save every N steps".into(),
        Err(_) => format!(
            "no checkpoint was saved yet (checkpoint.every = {every}), so this run cannot be resumed; start it again"
        ),
    }
}

/// Live placement builds and moves the rollout and policy replicas itself; roles
/// outside the groups (reward, reference, stages) are the user's to bring.
pub(crate) fn check_live_roles(job: &JobConfig, custom: &CustomRoles) -> Result<(), JobError> {
    if job.placement.live {
        let config_slots = job
            .roles
            .slots()
            .map(|(k, _)| k.trim_start_matches("roles."));
        let moved: Vec<&str> = custom
            .slots()
            .into_iter()
            .chain(config_slots)
            .filter(|s| matches!(*s, "rollout" | "policy" | "critic"))
            .collect();
        if !moved.is_empty() {
            return Err(JobError::NotImplemented {
                key: "placement.live".into(),
                found: "true".into(),
                fix: format!(
                    "live placement builds and moves its own rollout and policy replicas (and runs no critic), so it cannot take user roles in the slots {moved:?}; user rewards, references and stages work with it, and every slot works with placement.live = false"
                ),
            });
        }
    }
    Ok(())
}

/// A checkpoint's place in the run, for its errors: the end-of-run save is not "step
/// N+1".
/// The step's metrics plus the job process's resident memory at the step's end and its
/// peak so far (what a user watches for a run whose memory creeps up, step after step).
fn with_process_memory(m: &StepMetrics) -> StepMetrics {
    let mut m = m.clone();
    if let Some(memory) = yatt_metrics::process_memory() {
        m.set(names::PROCESS_RSS_BYTES, memory.resident_bytes as f64);
        m.set(
            names::PROCESS_PEAK_RSS_BYTES,
            memory.peak_resident_bytes as f64,
        );
    }
    m
}

fn save_point(step: u64, total: u64) -> String {
    match step >= total {
        true => format!("the end-of-run save (after step {step} of {total})"),
        false => format!("the checkpoint after step {step} of {total}"),
    }
}

/// Saves the checkpoint `dir`; when that fails, before the job's roles stop (they hold
/// the only copy of the trained weights), reports it and saves the weights where a
/// node can write them ([`rescue`]), then fails naming both.
async fn save_or_rescue(
    live: Option<&LivePlacement>,
    losses: &mut NodeLoss<'_>,
    controllers: &mut [Controller],
    dir: &Path,
    at: String,
    data_dirs: &BTreeMap<String, PathBuf>,
) -> Result<(), JobError> {
    let failed = match save_checkpoint(live, losses, controllers, dir).await {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    tracing::error!(error = %failed, "{at} failed; saving the weights elsewhere before the job's roles stop");
    let heads = match live {
        Some(l) => l.controllers(),
        None => controllers,
    };
    let rescued = rescue(losses.job, heads, data_dirs).await;
    Err(JobError::Checkpoint {
        at,
        source: Box::new(failed),
        rescued,
    })
}

/// Saves the policy (and the critic) of `controllers` into `yatt-rescue/NAME` under the
/// data directory of a node that writes it (the policy's first, as the preflight found
/// them), or, embedded, under this process's temporary directory; writes the run's
/// state beside them when this process can. Says where they went, or that nothing
/// could be saved.
async fn rescue(
    job: &JobConfig,
    controllers: &[Controller],
    data_dirs: &BTreeMap<String, PathBuf>,
) -> String {
    let Some(c) = controllers.first() else {
        return "no controller held the weights; nothing could be saved".into();
    };
    let stamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let name = format!("{}-step{}-{stamp}", job.job.name, c.step_count());
    let p = &job.placement;
    let mut roots: Vec<(String, PathBuf)> = Vec::new();
    if p.mode == PlacementMode::Disaggregated {
        let mut first: Vec<String> = if p.live {
            p.nodes.clone()
        } else {
            p.policy_nodes(1)
        };
        first.dedup();
        for n in first.iter().chain(data_dirs.keys()) {
            if let Some(d) = data_dirs.get(n) {
                if !roots.iter().any(|(m, _)| m == n) {
                    roots.push((n.clone(), d.join("yatt-rescue").join(&name)));
                }
            }
        }
    } else {
        roots.push((
            "this process".into(),
            std::env::temp_dir().join("yatt-rescue").join(&name),
        ));
    }
    let mut tried = Vec::new();
    for (node, dir) in roots {
        match c.save_policy(dir.clone()).await {
            Ok(()) => {
                let critic = match c.save_critic(dir.join("critic")).await {
                    Ok(()) => String::new(),
                    Err(e) => format!(" (the critic could not be saved there: {e})"),
                };
                let state = RunState {
                    format: "yatt-run-v1".into(),
                    controllers: controllers.iter().map(Controller::state).collect(),
                };
                let text = serde_json::to_string_pretty(&state).unwrap_or_default();
                let state_note = match std::fs::write(dir.join("run_state.json"), text) {
                    Ok(()) => format!(
                        "; to continue the run, move it to OUTPUT_DIR/checkpoint and run `yatt train --resume OUTPUT_DIR` with a job.output_dir every writing node accepts"
                    ),
                    Err(_) => "; the run's state (run_state.json) could not be written beside it from this process".into(),
                };
                return format!(
                    "the weights were saved instead on {node} at {}{critic}{state_note}",
                    dir.display()
                );
            }
            Err(e) => tried.push(format!("{node} ({}): {e}", dir.display())),
        }
    }
    format!(
        "the weights could not be saved anywhere else either: {}",
        if tried.is_empty() {
            "no node reported a data directory".into()
        } else {
            tried.join("; ")
        }
    )
}
