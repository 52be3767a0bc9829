//! # yatt-trainer
//!
//! The application that trains: a typed job config validated once, the parallel
//! controllers and the sample ledger, the builds that put a job's roles in this process
//! or on cluster nodes, the live placement actor, the run loop with its metrics and
//! checkpoints, and evaluation.
//!
//! What belongs here: everything that decides *how a job runs*. What does not: the roles
//! themselves, the algorithms' maths, rewards and data (`yatt-roles`, the SDK a user's
//! role depends on); the placement policy and cost model (`yatt-placement`, no I/O);
//! writing and reading metrics (`yatt-metrics`); models (`yatt-engine`); actors and
//! transport (`yatt-runtime`).
//!
//! | module | concern |
//! |---|---|
//! | `config/` | TOML sections, `--set` overrides, modes as enums, the one validation |
//! | `controller/` | a head's step: generation, stages, advantages, weights; data parallelism |
//! | `ledger` | every sample of a step accounted for exactly once |
//! | `build/` | models and roles from the config; embedded and cluster builds; heads |
//! | `live/` | the live placement actor: build, routing, migration, membership, observation |
//! | `run`, `checkpoint` | the run loop, metrics, checkpoints and resume |
//! | `eval`, `bench` | greedy accuracy on held-out prompts; the controller benchmark |
//!
//! Every module is private; this page is the whole public API.

mod bench;
mod build;
mod checkpoint;
mod config;
mod controller;
mod error;
mod eval;
mod ledger;
mod live;
mod preflight;
mod run;

pub use error::JobError;

// The job config.
pub use config::modes::{
    CallPrefix, DeviceSetting, Driver, Dtype, KlMode, ModelSource, OldLogprobs, PlacementMode,
    PolicyPool, RewardKind, Schedule, Task, TimeShare, UnparsedVerdict, VerdictMode,
};
pub use config::placement::{NodeNames, PlacementSection, ROLES};
pub use config::reference::config_reference;
pub use config::user_roles::{RolesSection, UserRole, UserStage};
// The config's modes that are `yatt-roles`' own enums.
pub use config::sections::{
    AlgorithmSection, CheckpointSection, DataSection, EvalSection, JobConfig, JobSection,
    ModelSection, OptimSection, RewardKinds, RewardSection, RolloutSection, StepCreditSection,
};
pub use yatt_roles::{Algorithm, KlEstimator, LossAgg, LossAggMode, StepVote};

// Building a job's roles and controllers.
pub use build::cluster::{build_cluster, register};
pub use build::custom::CustomRoles;
pub use build::embedded::{build, build_embedded, build_embedded_with};
pub use build::parts::{
    base_model, critic_role, policy_role, policy_role_from, reference_role, rollout_role,
    POLICY_RING,
};
pub use build::remote::RoleArgs;
pub use build::reward::reward_role;
pub use controller::extra_stages::{ExtraStage, StageAt};

// Controllers and the ledger.
pub use controller::config::{
    ControllerConfig, DynamicSamplingConfig, GradientSync, KlPenalty, OverlongConfig,
    PartialRolloutConfig, TimeShareConfig, Timeouts, WeightSync,
};
pub use controller::core::Controller;
pub use controller::data_parallel::{join_policy_ring, step_data_parallel};
pub use controller::error::ControllerError;
pub use controller::probe::GenProbe;
pub use controller::refs::{spawn_role, CriticRef, PolicyRef, RoleRefs, RolloutRef, SamplesRef};
pub use controller::report::{ControllerState, StepMetrics, StepReport};
pub use ledger::{LedgerError, LedgerReport, SampleLedger, Stage};

// Live placement.
pub use live::state::LivePlacement;

// Preflight: the checks made before the first step, and `yatt train --dry-run`.
pub use preflight::dry_run::{dry_run, DryRun};
pub use preflight::probe::{Outcome, FREE_BYTES_TEST_HOOK};
pub use preflight::{check_certificate, Certificate, CheckLine, PreflightReport};

// Running, checkpoints, evaluation, benchmarks.
pub use bench::{markdown_table, run_controller_bench, ControllerBenchOptions, ControllerBenchRow};
pub use checkpoint::{RunState, JOB_FILE};
pub use eval::{eval_prompts, evaluate, EvalError, EvalOptions, EvalReport, EvalSample, Split};
pub use run::{run_steps, train, train_with, Progress, TrainOptions, TrainSummary};
