//! The controllers of a job: what each runs, and how the heads share the roles.

use std::sync::Arc;
use std::time::Duration;

use yatt_engine::SamplingParams;
use yatt_roles::{Dataloader, GaeConfig, OffPolicyConfig, Prompt, StepCreditConfig};

use crate::build::parts::kl_term;
use crate::config::modes::{Driver, KlMode, TimeShare};
use crate::config::sections::JobConfig;
use crate::controller::config::{
    ControllerConfig, DynamicSamplingConfig, KlPenalty, OverlongConfig, PartialRolloutConfig,
    TimeShareConfig, Timeouts,
};
use crate::controller::core::Controller;
use crate::controller::refs::{PolicyRef, RoleRefs, RolloutRef};
use crate::error::JobError;

/// What each controller of the job runs.
pub(crate) fn controller_config(job: &JobConfig) -> ControllerConfig {
    let a = &job.algorithm;
    let advantage = a.name.estimator(GaeConfig {
        gamma: a.gamma,
        lam: a.lam,
        norm: a.advantage_norm,
        ..Default::default()
    });
    let r = &job.rollout;
    ControllerConfig {
        prompts_per_step: job.data.prompts_per_step,
        n: job.data.samples_per_prompt,
        sampling: SamplingParams {
            temperature: r.temperature as f32,
            top_p: r.top_p as f32,
            top_k: r.top_k,
            max_new_tokens: r.max_new_tokens,
            ignore_eos: r.ignore_eos,
            stop_strings: r.stop.clone(),
            ..Default::default()
        },
        seed: job.job.seed,
        advantage,
        kl_in_reward: kl_term(job)
            .filter(|_| a.kl_mode == KlMode::Reward)
            .map(|(estimator, coef)| KlPenalty { estimator, coef }),
        kl_metric: a.kl_estimator,
        dynamic_sampling: a
            .dynamic_sampling
            .unwrap_or(a.name.dynamic_sampling_by_default())
            .then_some(DynamicSamplingConfig {
                max_rounds: a.max_sampling_rounds,
                tolerance: 1e-6,
            }),
        overlong: (a.overlong_buffer > 0).then_some(OverlongConfig {
            max_len: r.max_new_tokens,
            buffer: a.overlong_buffer,
            coef: a.overlong_coef,
        }),
        step_credit: a.step_credit.as_ref().map(|c| StepCreditConfig {
            penalty: c.penalty as f32,
            threshold: c.threshold as f32,
            centre: c.centre,
        }),
        stream: r.stream,
        staleness: r.staleness,
        partial_rollout: r.partial_rollout.map(|p| PartialRolloutConfig {
            chunk_tokens: p.chunk_tokens,
        }),
        off_policy: OffPolicyConfig {
            correction: a.off_policy(r.staleness),
            cap: a.behaviour_cap,
        },
        logprob_diff_warn: r.logprob_diff_warn,
        weight_sync: r.weight_sync,
        gradient_sync: job.job.gradient_sync,
        time_share: match job.placement.time_share {
            TimeShare::Off => None,
            TimeShare::Offload => Some(TimeShareConfig {
                budget_bytes: (job.placement.device_memory_gb * (1u64 << 30) as f64) as u64,
            }),
        },
        timeouts: job_timeouts(job),
        ..Default::default()
    }
}

/// The job's `[timeouts]` as the controllers take them.
pub(crate) fn job_timeouts(job: &JobConfig) -> Timeouts {
    let t = &job.timeouts;
    Timeouts {
        generate: Duration::from_secs_f64(t.generate_s),
        score: Duration::from_secs_f64(t.score_s),
        train: Duration::from_secs_f64(t.train_s),
        sync: Duration::from_secs_f64(t.sync_s),
        collective: Duration::from_secs_f64(t.collective_s),
    }
}

/// The job's controllers over running roles and `all` its prompts
/// ([`crate::build::data::training_prompts`]): with `driver = "parallel"`, one per
/// rollout (data-parallel head), each with its shard of the prompts, sharing the other
/// roles of `shared` (each head gets its own policy from `policies` when there is one
/// per head); with `driver = "single"`, one driver with the global batch over every
/// rollout.
pub(crate) fn controllers(
    job: &JobConfig,
    all: Arc<[Prompt]>,
    shared: RoleRefs,
    mut rollouts: Vec<RolloutRef>,
    policies: Vec<PolicyRef>,
) -> Result<Vec<Controller>, JobError> {
    let config = controller_config(job);
    let heads = rollouts.len();
    let seed = job.job.seed.wrapping_add(3);
    if job.job.driver == Driver::Single {
        let loader = Dataloader::new(all, 0, 1, seed)?;
        let roles = RoleRefs {
            rollout: rollouts.remove(0),
            extra_rollouts: rollouts,
            ..shared
        };
        let config = ControllerConfig {
            prompts_per_step: config.prompts_per_step * heads,
            ..config
        };
        return Ok(vec![Controller::new(config, loader, roles)?]);
    }
    let mut controllers = Vec::with_capacity(heads);
    for (i, rollout) in rollouts.into_iter().enumerate() {
        let loader = Dataloader::new(all.clone(), i, heads, seed)?;
        let roles = RoleRefs {
            rollout,
            policy: policies
                .get(i)
                .cloned()
                .unwrap_or_else(|| shared.policy.clone()),
            ..shared.clone()
        };
        controllers.push(Controller::new(config.clone(), loader, roles)?);
    }
    Ok(controllers)
}
