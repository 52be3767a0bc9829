//! A job's preflight: every check that could fail the run later, made before its first
//! step on the node where it matters, each failure naming the node, the key and the
//! fix (docs/reliability.md, "Preflight", lists them).
//!
//! | check | where |
//! |---|---|
//! | checkpoint path: data-directory rule, probe file, free space | each node that writes (policy, critic) and the trainer |
//! | model present, content hash equal across nodes | each node that loads `model.source` |
//! | Python / HTTP reward answers one call | the reward's node (the trainer when embedded) |
//! | `[roles]` roles registered on an alive node | the cluster's nodes |
//! | dataset reads, prompts fit, eval prompts draw | the trainer |
//! | memory estimate within the device or `placement.device_memory_gb` | per node, from membership |
//! | trainer certificate valid for the run | the trainer |

pub(crate) mod dry_run;
pub(crate) mod local;
pub(crate) mod probe;
pub(crate) mod report;

pub use report::{Certificate, CheckLine, PreflightReport};

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use yatt_runtime::{Node, NodeError};

use crate::build::custom::CustomRoles;
use crate::config::modes::{KlMode, ModelSource, PlacementMode, RewardKind};
use crate::config::sections::JobConfig;
use crate::error::JobError;
use probe::{Outcome, ProbeAnswer, ProbeCheck, ProbeRequest};

/// How long a node has to start its `preflight` actor, and then to answer (a Python
/// reward's workers import within `max(reward.timeout_s, 60)` seconds).
const SPAWN_DEADLINE: Duration = Duration::from_secs(30);
const ASK_DEADLINE: Duration = Duration::from_secs(150);

/// The trainer's certificate before it joins: an error naming it and the fix when it
/// has expired (the nodes would refuse it with a TLS error naming neither); a warning
/// (logged) when it expires within a day.
pub fn check_certificate(c: &Certificate) -> Result<(), JobError> {
    match local::certificate(c, SystemTime::now(), None) {
        Outcome::Fail(text) => Err(JobError::Preflight {
            checks: 1,
            failed: vec![CheckLine {
                node: c.name.clone(),
                check: "certificate".into(),
                key: "--certs".into(),
                outcome: Outcome::Fail(text),
            }
            .to_string()],
        }),
        Outcome::Warn(text) => {
            tracing::warn!("preflight: {text}");
            Ok(())
        }
        Outcome::Pass(_) => Ok(()),
    }
}

/// The run's directory as every node sees it: absolute (a relative one would land
/// under each node's working directory).
pub(crate) fn run_dir(job: &JobConfig) -> PathBuf {
    let out = &job.job.output_dir;
    out.canonicalize()
        .or_else(|_| std::path::absolute(out))
        .unwrap_or_else(|_| out.clone())
}

/// Runs every check of `job` before its first step (`custom`: the slots the caller's
/// own roles take, which are not checked as built-in roles). Never fails itself: what
/// it could not check is a failed line.
pub(crate) async fn preflight(
    job: &JobConfig,
    node: &Node,
    custom: &CustomRoles,
    certificate: Option<&Certificate>,
) -> PreflightReport {
    let mut report = PreflightReport::default();
    let me = node.name().to_string();
    let out = run_dir(job);
    let params = local::model_params(job);
    let need = local::checkpoint_bytes(job, params);
    let (remote, local_checks) = plan(job, node, custom, &out, need);
    // Nodes started just before the run may still be joining: wait for them as the
    // build does, briefly. One that stays away fails its line below, by name.
    let named: Vec<(String, String)> = remote
        .iter()
        .map(|(target, _)| ("placement".to_string(), target.clone()))
        .collect();
    let _ = crate::build::remote::wait_for_nodes(node, &named).await;
    // The nodes' checks, all at once; the trainer's meanwhile.
    let asks = remote.iter().map(|(target, checks)| async move {
        (target.clone(), ask(node, target, checks.clone()).await)
    });
    let local = tokio::task::spawn_blocking(move || probe::run_checks(None, &local_checks));
    let answers = futures::future::join_all(asks).await;
    let mut digests: Vec<(String, String)> = Vec::new();
    let mut factories: BTreeMap<String, Vec<String>> = BTreeMap::new();
    match local.await {
        Ok(results) => {
            for r in results {
                if let Some(d) = &r.digest {
                    digests.push((me.clone(), d.clone()));
                }
                report.push(&me, r);
            }
        }
        Err(e) => report.line(
            &me,
            "checks",
            "-",
            Outcome::Fail(format!("the checks panicked: {e}")),
        ),
    }
    for (target, answer) in answers {
        match answer {
            Ok(a) => {
                report.data_dirs.insert(target.clone(), a.data_dir);
                factories.insert(target.clone(), a.factories);
                for r in a.results {
                    if let Some(d) = &r.digest {
                        digests.push((target.clone(), d.clone()));
                    }
                    report.push(&target, r);
                }
            }
            Err(Unanswered::NoPreflight(known)) => {
                factories.insert(target.clone(), known);
                report.line(
                    &target,
                    "checks",
                    "-",
                    Outcome::Warn("this node's yatt-node has no preflight checks (an older build): its paths, model and reward are checked when the roles start; fix: run a yatt-node of this yatt build there".into()),
                );
            }
            Err(Unanswered::Failed(e)) => report.line(
                &target,
                "checks",
                "-",
                Outcome::Fail(format!(
                    "could not run the preflight checks there: {e}; fix: check that the node is up and reachable (yatt-node /health)"
                )),
            ),
        }
    }
    if let Some(line) = same_model(job, &digests) {
        report.line("all nodes", "model", "model.source", line);
    }
    if job.placement.mode == PlacementMode::Disaggregated {
        local::user_roles(job, &factories, &mut report);
    }
    local::data(job, &me, &mut report);
    local::memory(job, node, params, &mut report);
    if let Some(c) = certificate {
        let line = local::certificate(c, SystemTime::now(), None);
        report.line(&me, "certificate", "--certs", line);
    }
    report
}

/// Whether every node that loads the model holds the same one.
fn same_model(job: &JobConfig, digests: &[(String, String)]) -> Option<Outcome> {
    let first = digests.first()?;
    if digests.iter().all(|(_, d)| *d == first.1) {
        return (digests.len() > 1).then(|| {
            Outcome::Pass(format!(
                "the same weights on {} ({})",
                names(digests),
                first.1
            ))
        });
    }
    let each: Vec<String> = digests.iter().map(|(n, d)| format!("{n} {d}")).collect();
    Some(Outcome::Fail(format!(
        "{} differs between the nodes that load it (content hash: {}): their replicas would diverge silently; fix: copy one model to every node (e.g. rsync -a --delete) and run again",
        job.model.source,
        each.join(", ")
    )))
}

fn names(v: &[(String, String)]) -> String {
    let mut n: Vec<&str> = v.iter().map(|(n, _)| n.as_str()).collect();
    n.dedup();
    n.join(", ")
}

/// Why a node gave no answer.
enum Unanswered {
    /// Its build registers no `preflight` actor; what it registers.
    NoPreflight(Vec<String>),
    Failed(String),
}

/// Spawns the `preflight` actor on `target` and asks it `checks`, each with a deadline.
async fn ask(
    node: &Node,
    target: &str,
    checks: Vec<ProbeCheck>,
) -> Result<ProbeAnswer, Unanswered> {
    let actor = node
        .spawn_remote_linked::<ProbeRequest, ProbeAnswer, _>(
            target,
            "preflight",
            &(),
            SPAWN_DEADLINE,
        )
        .await
        .map_err(|e| match e {
            NodeError::NoFactory { known, .. } => Unanswered::NoPreflight(known),
            e => Unanswered::Failed(e.to_string()),
        })?;
    actor
        .ask(ProbeRequest { checks }, ASK_DEADLINE)
        .await
        .map_err(|e| Unanswered::Failed(e.to_string()))
}

/// The checks each node makes (by node name) and those of this process.
fn plan(
    job: &JobConfig,
    node: &Node,
    custom: &CustomRoles,
    out: &Path,
    need: u64,
) -> (BTreeMap<String, Vec<ProbeCheck>>, Vec<ProbeCheck>) {
    let p = &job.placement;
    let ppo = job.algorithm.name.needs_critic();
    let writable = |what: &str| ProbeCheck::Writable {
        key: "job.output_dir".into(),
        what: what.into(),
        dir: out.to_path_buf(),
        need_bytes: need,
    };
    let model = match &job.model.source {
        // As given: a relative path is each node's own, as its roles load it.
        ModelSource::Dir(d) => Some(ProbeCheck::Model { source: d.clone() }),
        ModelSource::Tiny => None,
    };
    let python_or_http = job
        .reward_kinds()
        .iter()
        .any(|k| matches!(k, RewardKind::Python | RewardKind::Http));
    let own_reward = custom.reward.is_none() && job.roles.reward.is_none() && python_or_http;
    let reward = own_reward.then(|| reward_check(job)).flatten();
    let mut local = vec![writable("the trainer's metrics and run state")];
    let mut remote: BTreeMap<String, Vec<ProbeCheck>> = BTreeMap::new();
    if p.mode != PlacementMode::Disaggregated {
        local.extend(model);
        local.extend(reward);
        return (remote, local);
    }
    let mut add = |n: &str, c: ProbeCheck| {
        if !n.is_empty() {
            remote.entry(n.to_string()).or_default().push(c);
        }
    };
    let mut writers: Vec<(String, &str)> = Vec::new();
    let mut loaders: Vec<String> = Vec::new();
    if p.live {
        for n in &p.nodes {
            writers.push((n.clone(), "the policy's checkpoint"));
            loaders.push(n.clone());
        }
    } else {
        if custom.policy.is_none() && job.roles.policy.is_none() {
            for n in p.policy_nodes(job.job.policy_replicas) {
                writers.push((n.clone(), "the policy's checkpoint"));
                loaders.push(n);
            }
        }
        if custom.rollouts.is_empty() && job.roles.rollout.is_none() {
            loaders.push(p.rollout.clone());
        }
        if ppo && custom.critic.is_none() && job.roles.critic.is_none() {
            writers.push((p.critic.clone(), "the critic's checkpoint"));
            loaders.push(p.critic.clone());
        }
    }
    let reference = custom.reference.is_none() && job.roles.reference.is_none();
    if reference && job.algorithm.kl_mode != KlMode::None {
        loaders.push(p.reference.clone());
    }
    writers.sort();
    writers.dedup_by(|a, b| a.0 == b.0);
    for (n, what) in writers {
        add(&n, writable(what));
    }
    loaders.sort();
    loaders.dedup();
    if let Some(m) = model {
        for n in &loaders {
            add(n, m.clone());
        }
    }
    if let Some(r) = reward {
        add(&p.reward, r);
    }
    // Every alive node answers which roles it registers, for the `[roles]` check.
    if job.roles.slots().next().is_some() || !job.roles.stages.is_empty() {
        let alive: Vec<String> = node
            .directory()
            .read(|d| d.alive_nodes().map(|n| n.name.clone()).collect());
        for n in alive.into_iter().filter(|n| n != node.name()) {
            remote.entry(n).or_default();
        }
    }
    (remote, local)
}

/// The reward check with the job's first prompt as the input (an empty response).
fn reward_check(job: &JobConfig) -> Option<ProbeCheck> {
    let text = crate::build::remote::job_text(job).ok()?;
    let first = crate::build::data::prompts(job)
        .ok()
        .and_then(|p| p.into_iter().next());
    Some(ProbeCheck::Reward {
        job: text,
        prompt: first.as_ref().map_or_else(String::new, |p| p.text.clone()),
        response: String::new(),
        reference: first.and_then(|p| p.reference),
    })
}
