//! `yatt train --dry-run`: the job built and run as far as it can be without training
//! it: every preflight check, every role spawned where the placement puts it, the
//! first weight sync, one step through every stage; then everything stopped, nothing
//! left on the nodes or in a run directory that was not there before.

use std::time::Instant;

use yatt_runtime::Node;

use super::probe::Outcome;
use super::{preflight, run_dir, CheckLine, PreflightReport};
use crate::build::custom::CustomRoles;
use crate::build::embedded::build_embedded_with;
use crate::build::user_roles::with_config_roles;
use crate::config::modes::{KlMode, PlacementMode};
use crate::config::sections::JobConfig;
use crate::controller::core::Controller;
use crate::controller::release::StartedRoles;
use crate::error::JobError;
use crate::live::state::LivePlacement;
use crate::run::{check_live_roles, run_steps, TrainOptions};

/// What a dry run found.
#[derive(Debug, Clone)]
pub struct DryRun {
    /// What would run where, one line per role.
    pub placement: Vec<String>,
    /// Every check: the preflight's, then the build (spawns and first weight sync) and
    /// the one step.
    pub report: PreflightReport,
    /// Seconds the one step took (none when it did not run).
    pub step_s: Option<f64>,
}

impl DryRun {
    /// Whether every check passed (warnings pass).
    pub fn passed(&self) -> bool {
        self.report.failures().is_empty()
    }
}

/// Runs `job` dry on `node` (see the module doc). Fails only on an invalid config;
/// what a check, the build or the step found is in the answer.
pub async fn dry_run(
    job: &JobConfig,
    node: &Node,
    options: TrainOptions,
) -> Result<DryRun, JobError> {
    job.validate()?;
    check_live_roles(job, &options.roles)?;
    let mut report = preflight(job, node, &options.roles, options.certificate.as_ref()).await;
    let mut dry = DryRun {
        placement: placement_lines(job, node, &options.roles),
        report: PreflightReport::default(),
        step_s: None,
    };
    if !report.failures().is_empty() {
        report.line(
            node.name(),
            "build and one step",
            "-",
            Outcome::Warn("not tried: a check above failed".into()),
        );
        dry.report = report;
        return Ok(dry);
    }
    // The build's logs go into the run directory: made for the dry run, removed after.
    let out = run_dir(job);
    let made_out = !out.exists();
    if made_out {
        std::fs::create_dir_all(&out).map_err(|source| JobError::Write {
            path: out.clone(),
            source,
        })?;
    }
    let mut job = job.clone();
    job.job.output_dir = out.clone();
    let me = node.name().to_string();
    let (roles, named) = match with_config_roles(&job, node, &options.roles).await {
        Ok(r) => r,
        Err(e) => {
            report.line(&me, "build", "[roles]", Outcome::Fail(e.to_string()));
            dry.report = report;
            cleanup(&out, made_out);
            return Ok(dry);
        }
    };
    let mut custom = roles.actor_ids();
    custom.retain(|id| !named.contains(id));
    let mut live: Option<LivePlacement> = None;
    let mut controllers: Vec<Controller> = Vec::new();
    let built: Result<(), JobError> = async {
        if job.placement.live {
            live = Some(LivePlacement::build_from(&job, node, None, &roles).await?);
        } else if job.placement.mode == PlacementMode::Disaggregated {
            controllers =
                crate::build::cluster::build_cluster_from(&job, node, None, &roles).await?;
        } else {
            controllers = build_embedded_with(&job, node, None, &roles).await?;
        }
        Ok(())
    }
    .await;
    match built {
        Ok(()) => {
            report.line(
                &me,
                "build",
                "[placement]",
                Outcome::Pass("every role spawned; the first weight sync reached every rollout (and the reference)".into()),
            );
            let t = Instant::now();
            let stepped = match live.as_mut() {
                Some(l) => l.step().await.map(drop),
                None => run_steps(&mut controllers, 1, |_| Ok(())).await,
            };
            let secs = t.elapsed().as_secs_f64();
            let outcome = match stepped {
                Ok(()) => {
                    dry.step_s = Some(secs);
                    Outcome::Pass(format!(
                        "one step through every stage in {secs:.1}s (generation, reward, reference, stages, update, weight sync); {} steps would take about {:.0}s",
                        job.job.steps,
                        secs * job.job.steps as f64
                    ))
                }
                Err(e) => Outcome::Fail(e.to_string()),
            };
            report.line(&me, "one step", "job", outcome);
        }
        Err(e) => report.line(&me, "build", "[placement]", Outcome::Fail(e.to_string())),
    }
    if let (Some(c), Some(s)) = (options.certificate.as_ref(), dry.step_s) {
        // Now the run's length can be estimated: the certificate must outlive it.
        let run = std::time::Duration::from_secs_f64(s * job.job.steps as f64);
        let line = super::local::certificate(c, std::time::SystemTime::now(), Some(run));
        report.line(&me, "certificate", "--certs", line);
    }
    let started = StartedRoles::default();
    started.add_custom(&roles);
    match &live {
        Some(l) => l.add_roles_to(&started),
        None => controllers.iter().for_each(|c| started.add_controller(c)),
    }
    started.forget(&custom);
    started.stop_all(node, &job).await;
    drop(controllers);
    drop(live);
    cleanup(&out, made_out);
    dry.report = report;
    Ok(dry)
}

/// Removes the run directory the dry run made.
fn cleanup(out: &std::path::Path, made: bool) {
    if made {
        if let Err(e) = std::fs::remove_dir_all(out) {
            tracing::warn!(dir = %out.display(), error = %e, "could not remove the dry run's directory");
        }
    }
}

/// What would run where.
fn placement_lines(job: &JobConfig, node: &Node, custom: &CustomRoles) -> Vec<String> {
    let p = &job.placement;
    let mut v = Vec::new();
    let user = |slot: &str| {
        if custom.slots().contains(&slot) {
            return Some("the program's own role".to_string());
        }
        job.roles
            .slots()
            .find(|(k, _)| k.trim_start_matches("roles.") == slot)
            .map(|(_, r)| match r.node.is_empty() {
                true => format!("role {:?} on the first node that registers it", r.role),
                false => format!("role {:?} on {}", r.role, r.node),
            })
    };
    let kl = job.algorithm.kl_mode != KlMode::None;
    let ppo = job.algorithm.name.needs_critic();
    let mut slot = |name: &str, on: String, wanted: bool| {
        if wanted {
            v.push(format!("{name}: {}", user(name).unwrap_or(on)));
        }
    };
    if p.mode != PlacementMode::Disaggregated {
        let here = format!("this process (node {})", node.name());
        let live = if p.live {
            format!(", live placement over {} virtual groups", p.groups)
        } else {
            String::new()
        };
        slot("rollout", format!("{here}{live}"), true);
        slot("policy", format!("{here}{live}"), true);
        slot("reference", here.clone(), kl);
        slot("reward", here.clone(), true);
        slot("critic", here, ppo);
    } else if p.live {
        let groups = format!("live placement over the devices of {}", p.nodes.join(", "));
        slot("rollout", groups.clone(), true);
        slot("policy", groups, true);
        slot("reference", p.reference.clone(), kl);
        slot("reward", p.reward.clone(), true);
    } else {
        let policies = p.policy_nodes(job.job.policy_replicas).join(", ");
        slot("rollout", p.rollout.clone(), true);
        slot("policy", policies, true);
        slot("reference", p.reference.clone(), kl);
        slot("reward", p.reward.clone(), true);
        slot("critic", p.critic.clone(), ppo);
    }
    for (i, s) in job.roles.stages.iter().enumerate() {
        let on = if s.node.is_empty() {
            "the first node that registers it"
        } else {
            &s.node
        };
        v.push(format!(
            "stage {i} (after {:?}): role {:?} on {on}",
            s.after, s.role
        ));
    }
    v.push(format!(
        "controllers: {} in this process (node {})",
        job.job.controllers,
        node.name()
    ));
    v
}

impl std::fmt::Display for DryRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "would run:")?;
        for l in &self.placement {
            writeln!(f, "  {l}")?;
        }
        writeln!(f, "checks:")?;
        for l in &self.report.lines {
            writeln!(f, "  {l}")?;
        }
        let failed: Vec<&CheckLine> = self.report.failures();
        match failed.len() {
            0 => write!(
                f,
                "dry run passed: {} check(s), {} warning(s); nothing was left running",
                self.report.lines.len(),
                self.report.warnings().len()
            ),
            n => write!(
                f,
                "dry run FAILED: {n} of {} check(s) failed",
                self.report.lines.len()
            ),
        }
    }
}
