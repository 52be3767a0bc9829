//! # yatt-sim
//!
//! The cluster simulator behind `yatt sim`: a discrete-event simulation of an RLHF job
//! on a cluster of 8 to 4,096 GPUs that compares three ways of placing it:
//! - **colocate**: full colocation, synchronous and on-policy, as verl runs it: every
//!   role on every group, one phase after another, offloading between phases;
//! - **static**: the best fixed split the search finds, chosen in hindsight among plans
//!   searched for the workload at the start, middle and end of the run and the plans
//!   the dynamic policy used;
//! - **dynamic**: yatt's placement policy re-planning as the workload shifts.
//!
//! It reports each against the lower bound: the work of every step at full efficiency
//! (decoding at full slots, passes at the hardware's rates) divided by every device.
//! The configuration is TOML ([`SimConfig`]); `config/sim-*.toml` are examples.
//!
//! What belongs here: the scenarios and their configuration, running them
//! ([`run_scenario`]), the report and its table ([`format_report`]) and PNG
//! ([`plot_png`]), and calibration of the simulator against a real run's
//! `metrics.jsonl` ([`check_calibration`]). What does not: the discrete-event engine
//! itself, the policy it drives and the cost model are `yatt-placement`'s (the policy
//! runs the same engine to judge its candidates); reading and naming metrics is
//! `yatt-metrics`'. Nothing here reads or writes files: callers pass text and records
//! in and write the report and PNG out.

mod bound;
mod calibrate;
mod config;
mod draw;
mod report;
mod run;

pub use bound::lower_bound;
pub use calibrate::{
    check_calibration, fit_rates, replay_run, run_staleness, run_steps, CalibrateError,
    Calibration, RunStep,
};
pub use config::{
    true_efficiency, HardwareSection, JobSection, Scenario, ScenarioSection, SimConfig, SimError,
    SimSection, Strategy,
};
pub use draw::{plot_png, DrawError};
pub use report::{format_report, ScenarioReport, StrategyReport};
pub use run::{run, run_scenario};
