//! # yatt-roles
//!
//! Where RLHF meets the runtime. What belongs here: the `Role` trait users implement to
//! add a role, the built-in roles (rollout, policy, critic, reference, reward) as
//! actors, the algorithms (PPO, GRPO, DAPO, REINFORCE++, RLOO), the parallel
//! controllers and the sample ledger. Models and maths kernels live in `yatt-engine`;
//! transport and actors in `yatt-runtime`.
//!
//! | module | concern |
//! |---|---|
//! | [`role`] | the `Role` trait and the actor that runs a role on its own thread |
//! | [`algo`] | advantages, policy/value losses, KL estimators (pure tensor maths) |
//! | [`reward`] | reward functions: rule-based verifiers, HTTP endpoint |
//! | [`data`] | prompt datasets: JSONL and synthetic tasks |
//! | [`sample`] | samples flowing between roles, keyed by id |
//! | [`ledger`] | the sample ledger |
//! | [`builtin`] | built-in roles: rollout, reference, policy, critic, reward |
//! | [`controller`] | parallel controllers |
//! | [`job`] | training jobs: the TOML job config, embedded build and run loop |
//! | [`bench`](mod@bench) | `yatt bench controller`: controller overhead, parallel vs single driver (fake compute) |
//! | [`wire`] | role messages on the wire: bulk weight buckets, spilled large bodies |
//! | [`placement_live`] | the live placement actor: feeds the placement policy, migrates groups between rollout and policy |
//! | [`remote`] | roles on other nodes: factories, `[placement]`, the cluster build |
//! | [`eval`] | accuracy of a job's model or checkpoint: greedy answers on held-out prompts |

pub mod algo;
pub mod bench;
pub mod builtin;
pub mod controller;
pub mod data;
pub mod eval;
pub mod job;
pub mod ledger;
pub mod placement_live;
pub mod remote;
pub mod reward;
pub mod role;
pub mod sample;
pub mod wire;
