//! `[roles]`: a user's roles named in the job config. Each is a role a node registers
//! (`yatt::node::main_with(|r| r.role::<MyReward>("my-reward"))`), spawned by that name
//! with its arguments written in TOML, in a built-in slot or as a stage of its own. The
//! same job then runs from the stock `yatt train` with no Rust of the user's in it.

use serde::{Deserialize, Serialize};
use yatt_runtime::validate_segment;

use crate::config::checks::{invalid, positive};
use crate::controller::extra_stages::StageAt;
use crate::error::JobError;

/// `[roles]`: user roles in the built-in slots and extra stages of the step.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RolesSection {
    /// `[roles.reward]`: takes the step's samples, gives them back with `reward` set.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reward: Option<UserRole>,
    /// `[roles.reference]`: sets `ref_logprobs`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reference: Option<UserRole>,
    /// `[roles.critic]` (PPO): answers critic requests.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub critic: Option<UserRole>,
    /// `[roles.policy]`: answers policy requests (one replica, no resume).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub policy: Option<UserRole>,
    /// `[roles.rollout]`: one replica per head (`job.controllers`), spread over the
    /// nodes that register it when `node` is empty.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollout: Option<UserRole>,
    /// `[[roles.stages]]`: stages added to the step, in this order within a place.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stages: Vec<UserStage>,
}

/// A user's role in a built-in slot.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UserRole {
    /// The name the role is registered under on its node.
    pub role: String,
    /// The node to spawn it on; empty = the first alive node (by name) that registers it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// Its spawn arguments: the fields of the role's type (or of its `role_with`
    /// argument type), as a TOML table.
    #[serde(default)]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub args: toml::Table,
}

/// A user's stage: a role taking and giving back samples, after a built-in stage.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct UserStage {
    /// The name the role is registered under on its node.
    pub role: String,
    /// The stage's name in metrics (`stage/NAME/dropped`) and errors; empty = `role`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// The built-in stage it runs after: `reward`, `reference` or `old_logprobs`.
    pub after: StageAt,
    /// The node to spawn it on; empty = the first alive node (by name) that registers it.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub node: String,
    /// Its spawn arguments, as a TOML table.
    #[serde(default)]
    #[schemars(with = "serde_json::Map<String, serde_json::Value>")]
    pub args: toml::Table,
    /// Deadline of one call, seconds.
    #[serde(default = "default_stage_timeout_s")]
    pub timeout_s: f64,
}

fn default_stage_timeout_s() -> f64 {
    300.0
}

impl UserStage {
    /// Its name in metrics: `name`, else the role's.
    pub fn stage_name(&self) -> &str {
        if self.name.is_empty() {
            &self.role
        } else {
            &self.name
        }
    }
}

impl RolesSection {
    /// Whether no user role is named.
    pub fn is_empty(&self) -> bool {
        self.slots().next().is_none() && self.stages.is_empty()
    }

    /// The slots named, with their config keys.
    pub(crate) fn slots(&self) -> impl Iterator<Item = (&'static str, &UserRole)> {
        [
            ("roles.reward", self.reward.as_ref()),
            ("roles.reference", self.reference.as_ref()),
            ("roles.critic", self.critic.as_ref()),
            ("roles.policy", self.policy.as_ref()),
            ("roles.rollout", self.rollout.as_ref()),
        ]
        .into_iter()
        .filter_map(|(k, r)| r.map(|r| (k, r)))
    }

    /// Names that spawn (role and node segments), stage names unique, deadlines positive.
    pub(crate) fn validate(&self) -> Result<(), JobError> {
        let named = |key: String, role: &str, node: &str| -> Result<(), JobError> {
            validate_segment("role", role).map_err(|e| {
                invalid(
                    &format!("{key}.role"),
                    "the name a node registers the role under",
                    &format!("{role:?}"),
                    &e.to_string(),
                )
            })?;
            if !node.is_empty() {
                validate_segment("node", node).map_err(|e| {
                    invalid(
                        &format!("{key}.node"),
                        "a node's name, or nothing for any node that registers the role",
                        &format!("{node:?}"),
                        &e.to_string(),
                    )
                })?;
            }
            Ok(())
        };
        for (key, r) in self.slots() {
            named(key.to_string(), &r.role, &r.node)?;
        }
        let mut seen: Vec<&str> = Vec::new();
        for (i, s) in self.stages.iter().enumerate() {
            let key = format!("roles.stages[{i}]");
            named(key.clone(), &s.role, &s.node)?;
            positive(
                &format!("{key}.timeout_s"),
                s.timeout_s,
                "the deadline of one call in seconds, e.g. timeout_s = 300",
            )?;
            let name = s.stage_name();
            if seen.contains(&name) {
                return Err(invalid(
                    &format!("{key}.name"),
                    "a stage name no other stage has (it names the stage's metrics)",
                    &format!("{name:?}"),
                    "give each stage of the same role its own `name`",
                ));
            }
            seen.push(name);
        }
        Ok(())
    }
}
