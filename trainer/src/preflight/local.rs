//! The preflight checks the trainer makes itself: the data, the `[roles]` roles'
//! registration, the memory estimate and its certificate; and the model size they
//! (and the free-space check) estimate from.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime};

use yatt_placement::ModelSpec;
use yatt_runtime::{DeviceKind, Node};

use super::probe::{gib, Outcome};
use super::report::{Certificate, PreflightReport};
use crate::config::modes::{KlMode, ModelSource, PlacementMode, TimeShare};
use crate::config::sections::JobConfig;
use crate::eval::{eval_prompts, training_eval_options, EvalError};

/// The model's parameter count: the tiny model's, or the sum of the tensors the
/// safetensors files of `model.source` declare (read from their headers, not the
/// weights). None when this process cannot tell (a model it does not hold).
pub(crate) fn model_params(job: &JobConfig) -> Option<f64> {
    match &job.model.source {
        ModelSource::Tiny => crate::build::parts::tiny_model(job)
            .ok()
            .map(|(mut m, _, _)| m.num_parameters() as f64),
        ModelSource::Dir(d) => {
            let files = std::fs::read_dir(d).ok()?;
            let mut n = 0.0;
            let mut any = false;
            for f in files.flatten() {
                let p = f.path();
                if p.extension().is_some_and(|e| e == "safetensors") {
                    n += safetensors_params(&p)?;
                    any = true;
                }
            }
            any.then_some(n)
        }
    }
}

/// The parameters one safetensors file declares: its header's shapes.
fn safetensors_params(path: &Path) -> Option<f64> {
    use std::io::Read as _;
    let mut f = std::fs::File::open(path).ok()?;
    let mut len = [0u8; 8];
    f.read_exact(&mut len).ok()?;
    let len = u64::from_le_bytes(len);
    if len > 100 << 20 {
        return None;
    }
    let mut header = vec![0u8; len as usize];
    f.read_exact(&mut header).ok()?;
    let v: serde_json::Value = serde_json::from_slice(&header).ok()?;
    Some(
        v.as_object()?
            .iter()
            .filter(|(k, _)| *k != "__metadata__")
            .filter_map(|(_, t)| t.get("shape")?.as_array().cloned())
            .map(|s| s.iter().map(|d| d.as_f64().unwrap_or(0.0)).product::<f64>())
            .sum(),
    )
}

/// The disk the checkpoints this job keeps take at most: the policy (and PPO's critic)
/// with their optimizer state, about 12 bytes a parameter (f32 weights and two AdamW
/// moments), twice: a save writes the new checkpoint beside the current one before it
/// replaces it (`checkpoint.every` does not change how many are kept).
pub(crate) fn checkpoint_bytes(job: &JobConfig, params: Option<f64>) -> u64 {
    let models = if job.algorithm.name.needs_critic() {
        2.0
    } else {
        1.0
    };
    (params.unwrap_or(0.0) * 12.0 * models * 2.0) as u64
}

/// The dataset reads, every prompt fits, and the eval prompts draw.
pub(crate) fn data(job: &JobConfig, me: &str, report: &mut PreflightReport) {
    let key = if job.data.dataset().is_some() {
        "data"
    } else {
        "data.task"
    };
    let outcome = match crate::build::data::training_prompts(job) {
        Ok(p) => Outcome::Pass(format!(
            "{} prompt(s); each fits model.max_seq_len = {} with rollout.max_new_tokens = {} (counted where the tokenizer loads)",
            p.len(),
            job.model.max_seq_len,
            job.rollout.max_new_tokens
        )),
        Err(e) => Outcome::Fail(e.to_string()),
    };
    report.line(me, "prompts", key, outcome);
    if job.eval.every > 0 || job.eval.before_train {
        let outcome = match eval_prompts(job, &training_eval_options(job, None)) {
            Ok(p) => Outcome::Pass(format!("{} held-out prompt(s) drawn", p.len())),
            Err(EvalError::Job(e)) => Outcome::Fail(e.to_string()),
            Err(e) => Outcome::Fail(format!(
                "{e}; fix: lower eval.prompts, or set eval.every = 0"
            )),
        };
        report.line(me, "eval prompts", "eval", outcome);
    }
}

/// Each `[roles]` role (and stage) is registered on an alive node: the one it names,
/// or any. `factories`: what each node that answered registers.
pub(crate) fn user_roles(
    job: &JobConfig,
    factories: &BTreeMap<String, Vec<String>>,
    report: &mut PreflightReport,
) {
    let stages = job
        .roles
        .stages
        .iter()
        .enumerate()
        .map(|(i, s)| (format!("roles.stages[{i}]"), s.role.clone(), s.node.clone()));
    let slots = job
        .roles
        .slots()
        .map(|(k, r)| (k.to_string(), r.role.clone(), r.node.clone()));
    for (key, role, node) in slots.chain(stages) {
        let hosts: Vec<&String> = factories
            .iter()
            .filter(|(n, f)| (node.is_empty() || **n == node) && f.contains(&role))
            .map(|(n, _)| n)
            .collect();
        let outcome = match hosts.first() {
            Some(h) => Outcome::Pass(format!("role {role:?} is registered on {h}")),
            None => {
                let seen: Vec<String> = factories
                    .iter()
                    .map(|(n, f)| format!("{n} ({})", f.join(", ")))
                    .collect();
                let where_ = if node.is_empty() {
                    "any alive node".to_string()
                } else {
                    format!("node {node}")
                };
                Outcome::Fail(format!(
                    "role {role:?} is not registered on {where_}; the nodes register: {}; fix: start a daemon that registers it (yatt::node::main_with(|r| r.role::<MyRole>(NAME))) and join it to this cluster, or fix {key}.role",
                    seen.join("; ")
                ))
            }
        };
        report.line(
            "cluster",
            "role registered",
            &format!("{key}.role"),
            outcome,
        );
    }
}

/// Each node's roles' resident estimate (the placement's: bf16 weights for the rollout,
/// with its `rollout.kv_cache_bytes`, and the reference, 16 bytes a parameter of
/// training state for the policy and the critic) against its GPU memory or
/// `placement.device_memory_gb`. Unchecked where neither is known (CPU nodes without a
/// budget).
pub(crate) fn memory(
    job: &JobConfig,
    node: &Node,
    params: Option<f64>,
    report: &mut PreflightReport,
) {
    let Some(params) = params else {
        return;
    };
    let spec = ModelSpec {
        name: job.model.source.to_string(),
        params,
        layers: 0,
        kv_heads: 0,
        head_dim: 0,
    };
    let (serve, train) = (spec.weight_bytes(), spec.train_state_bytes());
    // A rollout holds its paged KV cache's budget besides its weights, when one is set.
    let rollout = serve + job.rollout.kv_cache_bytes as f64;
    let p = &job.placement;
    let ppo = job.algorithm.name.needs_critic();
    let kl = job.algorithm.kl_mode != KlMode::None;
    // (node, role, bytes)
    let mut placed: Vec<(String, &str, f64)> = Vec::new();
    let me = node.name().to_string();
    if p.mode != PlacementMode::Disaggregated || p.live {
        let on = |n: &str| {
            if p.mode == PlacementMode::Disaggregated {
                n.to_string()
            } else {
                me.clone()
            }
        };
        placed.push((on(&me), "rollout", rollout));
        placed.push((on(&me), "policy", train));
        if kl {
            placed.push((on(&p.reference), "reference", serve));
        }
        if ppo {
            placed.push((on(&me), "critic", train));
        }
    } else {
        placed.push((p.rollout.clone(), "rollout", rollout));
        for n in p.policy_nodes(job.job.policy_replicas) {
            placed.push((n, "policy", train));
        }
        if kl {
            placed.push((p.reference.clone(), "reference", serve));
        }
        if ppo {
            placed.push((p.critic.clone(), "critic", train));
        }
    }
    let budget = (p.device_memory_gb > 0.0).then(|| {
        (
            p.device_memory_gb * f64::from(1u32 << 30),
            "placement.device_memory_gb".to_string(),
        )
    });
    let infos: BTreeMap<String, Vec<yatt_runtime::DeviceInfo>> = node.directory().read(|d| {
        d.alive_nodes()
            .map(|n| (n.name.clone(), n.devices.clone()))
            .collect()
    });
    let mut by_node: BTreeMap<String, Vec<(&str, f64)>> = BTreeMap::new();
    for (n, role, bytes) in placed {
        by_node.entry(n).or_default().push((role, bytes));
    }
    let offload = p.time_share == TimeShare::Offload;
    for (n, roles) in by_node {
        let gpu = infos
            .get(&n)
            .and_then(|ds| {
                ds.iter()
                    .filter(|d| d.kind == DeviceKind::Cuda)
                    .min_by_key(|d| d.memory_bytes)
            })
            .map(|d| (d.memory_bytes as f64, format!("{} of {}", d.name, n)));
        let Some((have, what)) = budget.clone().or(gpu) else {
            continue;
        };
        // Time-shared roles hold one at a time; otherwise together.
        let need = if offload {
            roles.iter().map(|r| r.1).fold(0.0, f64::max)
        } else {
            roles.iter().map(|r| r.1).sum()
        };
        let list: Vec<String> = roles
            .iter()
            .map(|(r, b)| format!("{r} {}", gib(*b as u64)))
            .collect();
        let outcome = if need <= have {
            Outcome::Pass(format!(
                "{} within {} ({what})",
                list.join(" + "),
                gib(have as u64)
            ))
        } else {
            let kv = if job.rollout.kv_cache_bytes > 0 {
                ", lower rollout.kv_cache_bytes (the rollout's KV cache)"
            } else {
                ""
            };
            Outcome::Fail(format!(
                "the roles on {n} need about {} resident ({}), beyond the {} of {what}; fix: put the roles on more nodes ([placement]), use a smaller model{kv}, set placement.time_share = \"offload\", or raise placement.device_memory_gb if the budget is wrong",
                gib(need as u64),
                list.join(" + "),
                gib(have as u64)
            ))
        };
        report.line(&n, "memory", "[placement]", outcome);
    }
}

/// The trainer's certificate: an expired one fails (the nodes would refuse it), one
/// that expires within `run` (the run's estimated duration; a day when unknown) warns.
pub(crate) fn certificate(c: &Certificate, now: SystemTime, run: Option<Duration>) -> Outcome {
    let reissue = format!(
        "issue a new one: yatt-node cert --ca-dir CA_DIR --name {} --kind trainer --out DIR",
        c.name
    );
    let left = match c.not_after.duration_since(now) {
        Ok(left) => left,
        Err(_) => {
            return Outcome::Fail(format!(
                "the trainer's certificate {} expired {} ago; the nodes refuse it; fix: {reissue}",
                c.path,
                human(now.duration_since(c.not_after).unwrap_or_default())
            ))
        }
    };
    let run = run.unwrap_or(Duration::from_secs(24 * 3600));
    if left < run {
        return Outcome::Warn(format!(
            "the trainer's certificate {} expires in {}, before the run's estimated {} are over; fix: {reissue}",
            c.path,
            human(left),
            human(run)
        ));
    }
    Outcome::Pass(format!("{} valid for {} more", c.path, human(left)))
}

fn human(d: Duration) -> String {
    let s = d.as_secs();
    match s {
        s if s < 3600 => format!("{}m", s / 60),
        s if s < 3 * 86400 => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
        s => format!("{} days", s / 86400),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_expired_certificate_fails_and_a_short_one_warns() {
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000_000);
        let c = |at| Certificate {
            path: "certs/train.pem".into(),
            name: "train".into(),
            not_after: at,
        };
        let o = certificate(&c(now - Duration::from_secs(7200)), now, None);
        assert!(
            matches!(&o, Outcome::Fail(t) if t.contains("expired 2h00m ago") && t.contains("yatt-node cert")),
            "{o:?}"
        );
        let o = certificate(
            &c(now + Duration::from_secs(3600)),
            now,
            Some(Duration::from_secs(7200)),
        );
        assert!(
            matches!(&o, Outcome::Warn(t) if t.contains("expires in 1h00m")),
            "{o:?}"
        );
        let o = certificate(
            &c(now + Duration::from_secs(86400 * 30)),
            now,
            Some(Duration::from_secs(7200)),
        );
        assert!(matches!(o, Outcome::Pass(_)), "{o:?}");
    }
}
