//! `[placement]`: which node runs each role, and the live placement's knobs.

use serde::{Deserialize, Serialize};

use crate::config::modes::{PlacementMode, PolicyPool, TimeShare};

/// The roles of a job, by the key that places them.
pub const ROLES: [&str; 4] = ["rollout", "policy", "reference", "reward"];

/// `[placement]`: where a job's roles run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct PlacementSection {
    /// `colocate`: every role in the training process (the nodes below are not used).
    /// `disaggregated`: each role on the cluster node named below (`yatt train CONFIG
    /// --cluster SEED_ADDR`).
    pub mode: PlacementMode,
    /// Node of the rollout replicas (one per controller).
    pub rollout: String,
    /// Node of the policy (the trainer): one name for every replica, or a list with
    /// one node per replica (`job.policy_replicas`), replica `i` on entry `i`; for a
    /// sharded policy one per rank (`job.policy_shards`), rank `i` on entry `i`.
    pub policy: NodeNames,
    /// Node of the reference policy.
    pub reference: String,
    /// Node of the reward functions.
    pub reward: String,
    /// Node of the critic (`algorithm.name = "ppo"` only).
    pub critic: String,
    /// Node of the rollouts' environment actors (`rollout.env`, `disaggregated` only):
    /// each rollout starts a pool of `rollout.env.pool` of them there. Empty: the
    /// environments run inside the rollout's process.
    pub env: String,
    /// Deadline for a node to build a role, model load included, seconds.
    pub spawn_timeout_s: u64,
    /// Run the live placement actor: the rollout and the policy sit on device groups
    /// and groups move between them as the load shifts (see `crate::placement_live`).
    /// Embedded (`colocate`): `groups` virtual groups of this process; on a cluster
    /// (`disaggregated`): the devices the nodes in `nodes` advertise.
    pub live: bool,
    /// Virtual device groups of the embedded live placement (`job.controllers` + 1).
    pub groups: usize,
    /// Live placement on a cluster: the nodes whose devices (one group each, as
    /// membership advertises them) the rollout and the policy share. `rollout` and
    /// `policy` are not used then; `reward` and `reference` still place those roles.
    pub nodes: Vec<String>,
    /// Groups the rollout starts with (1 or `job.controllers`); the policy gets the rest.
    pub rollout_groups: usize,
    /// Live placement: `replicas` (each policy group holds a whole replica) or
    /// `sharded` (the policy groups are the ranks of one sharded policy, resharded in
    /// place as groups move; embedded only).
    pub policy_pool: PolicyPool,
    /// `off` | `offload`: with `mode = "colocate"` (every role on one device), offload
    /// the roles a phase does not use and reload them for the next (the policy's
    /// optimizer state during generation, the rollout's KV cache and weights during
    /// training). `off` by default: a CPU device gains nothing; GPU jobs whose roles do
    /// not fit the device together turn it on.
    pub time_share: TimeShare,
    /// The device memory the colocated roles may hold together, GiB; a reload that
    /// would go beyond it fails the step naming the role instead of running out of
    /// memory. 0: unchecked.
    pub device_memory_gb: f64,
    /// The placement policy's knobs (`[placement.replan]`: replan_every, warmup_steps,
    /// min_gain, confirmations, horizon_steps, payback, cooldown_steps,
    /// lookahead_steps, simulate_candidates, simulate_steps).
    pub replan: yatt_placement::PolicyConfig,
}

impl Default for PlacementSection {
    fn default() -> Self {
        PlacementSection {
            mode: PlacementMode::Colocate,
            rollout: String::new(),
            policy: NodeNames::default(),
            reference: String::new(),
            reward: String::new(),
            critic: String::new(),
            env: String::new(),
            spawn_timeout_s: 300,
            live: false,
            groups: 3,
            nodes: Vec::new(),
            rollout_groups: 1,
            policy_pool: PolicyPool::Replicas,
            time_share: TimeShare::Off,
            device_memory_gb: 0.0,
            replan: yatt_placement::PolicyConfig {
                // The live executor trusts the analytic model: simulating candidates
                // costs more than a CPU step.
                simulate_candidates: 0,
                ..Default::default()
            },
        }
    }
}

/// `placement.policy`: one node name, or a list of them (one per replica).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeNames {
    /// Every replica on this node.
    One(String),
    /// Replica `i` on entry `i`.
    Each(Vec<String>),
}

impl Default for NodeNames {
    fn default() -> Self {
        NodeNames::One(String::new())
    }
}

impl From<&str> for NodeNames {
    fn from(name: &str) -> Self {
        NodeNames::One(name.to_string())
    }
}

impl std::fmt::Display for NodeNames {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NodeNames::One(n) => f.write_str(n),
            NodeNames::Each(ns) => write!(f, "[{}]", ns.join(", ")),
        }
    }
}

impl schemars::JsonSchema for NodeNames {
    fn schema_name() -> std::borrow::Cow<'static, str> {
        "NodeNames".into()
    }
    fn inline_schema() -> bool {
        true
    }
    fn json_schema(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
        schemars::json_schema!({
            "anyOf": [{ "type": "string" }, { "type": "array", "items": { "type": "string" } }]
        })
    }
}

impl Serialize for NodeNames {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            NodeNames::One(n) => s.serialize_str(n),
            NodeNames::Each(ns) => ns.serialize(s),
        }
    }
}

impl<'de> Deserialize<'de> for NodeNames {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Names;
        impl<'de> serde::de::Visitor<'de> for Names {
            type Value = NodeNames;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a node name, or a list of node names (one per policy replica)")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<NodeNames, E> {
                Ok(NodeNames::One(v.to_string()))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<NodeNames, A::Error> {
                let mut names = Vec::new();
                while let Some(n) = seq.next_element::<String>()? {
                    names.push(n);
                }
                Ok(NodeNames::Each(names))
            }
        }
        d.deserialize_any(Names)
    }
}

impl PlacementSection {
    /// The node named for `role` (one of [`ROLES`]); for a policy placed replica by
    /// replica, the first replica's.
    pub fn node_of(&self, role: &str) -> &str {
        match role {
            "rollout" => &self.rollout,
            "policy" => match &self.policy {
                NodeNames::One(n) => n,
                NodeNames::Each(ns) => ns.first().map_or("", String::as_str),
            },
            "reference" => &self.reference,
            "critic" => &self.critic,
            _ => &self.reward,
        }
    }

    /// The node of each of `replicas` policy replicas, in replica order.
    pub fn policy_nodes(&self, replicas: usize) -> Vec<String> {
        match &self.policy {
            NodeNames::One(n) => vec![n.clone(); replicas],
            NodeNames::Each(ns) => ns.clone(),
        }
    }

    /// Every `(key, node)` the section names: the policy's node once when every replica
    /// runs there (not once per replica: `job.policy_replicas` may be anything until
    /// validated), else each list entry; with `critic`, the critic's.
    pub(crate) fn named_nodes(&self, critic: bool) -> Vec<(String, String)> {
        let mut v = Vec::new();
        if critic {
            v.push(("placement.critic".to_string(), self.critic.clone()));
        }
        for role in ROLES {
            if role == "policy" {
                match &self.policy {
                    NodeNames::One(n) => v.push(("placement.policy".to_string(), n.clone())),
                    NodeNames::Each(ns) => v.extend(
                        ns.iter()
                            .enumerate()
                            .map(|(i, n)| (format!("placement.policy[{i}]"), n.clone())),
                    ),
                }
            } else {
                v.push((format!("placement.{role}"), self.node_of(role).to_string()));
            }
        }
        v
    }
}
