//! Following cluster membership: nodes lost and joined.

use yatt_placement::Event;
use yatt_placement::GroupId;
use yatt_placement::Record;
use yatt_runtime::NodeInfo;

use crate::error::JobError;
use crate::live::state::node_desc;
use crate::live::state::Hosts;
use crate::live::state::LivePlacement;
use crate::live::state::Replica;

impl LivePlacement {
    /// On a cluster: feeds the policy the nodes of `placement.nodes` that left (or
    /// restarted) and joined since the last step, and carries out its decisions.
    pub(crate) async fn follow_membership(&mut self, step: u64) -> Result<(), JobError> {
        if !matches!(self.hosts, Hosts::Cluster { .. }) {
            return Ok(());
        }
        for node in self.dead_nodes() {
            self.lose_node(&node, step).await?;
        }
        let wanted = self.job.placement.nodes.clone();
        let alive: Vec<NodeInfo> = self.node.directory().read(|d| {
            wanted
                .iter()
                .filter_map(|w| d.alive_nodes().find(|n| n.name == *w).cloned())
                .collect()
        });
        for info in alive {
            if !self.known_nodes.contains_key(&info.name) {
                self.join_node(info, step).await?;
            }
        }
        Ok(())
    }

    /// A node of the plan is gone: its groups leave the inventory and the plan. Its
    /// rollout replicas are dropped (their samples were requeued during the step); the
    /// policy's `NodeLost` migration moves the plan onto the remaining groups.
    pub(crate) async fn lose_node(&mut self, node: &str, step: u64) -> Result<(), JobError> {
        let groups: Vec<GroupId> = self
            .policy
            .inventory()
            .groups()
            .filter(|g| g.node == node)
            .map(|g| g.id)
            .collect();
        let policy_on: Vec<String> = groups
            .iter()
            .filter(|g| matches!(self.replicas.get(g), Some(Replica::Policy(_))))
            .map(|g| g.to_string())
            .collect();
        // Another policy replica on a live node holds the same trainer state: the
        // re-plan runs the heads on it.
        let survives = self.replicas.iter().any(|(g, r)| {
            matches!(r, Replica::Policy(_)) && self.node_of(*g).is_ok_and(|n| n != node)
        });
        if !policy_on.is_empty() && !survives {
            return Err(JobError::Placement {
                what: format!(
                    "node {node} left the cluster with the last policy replica(s), of {}: the trainer state (weights, optimizer) there is lost",
                    policy_on.join(", ")
                ),
                fix: "live placement recovers from losing nodes that host rollout replicas, the reward, the reference, or policy replicas while another lives; resume the run on nodes that stay up (see below for its last checkpoint)".into()});
        }
        self.known_nodes.remove(node);
        for g in &groups {
            self.replicas.remove(g);
        }
        let names: Vec<String> = groups.iter().map(|g| g.to_string()).collect();
        self.write(&Record::Search {
            step,
            line: format!(
                "node {node} left the cluster (declared dead or gone): its group(s) {} leave the inventory",
                names.join(" ")
            )})?;
        let decisions = self.policy.on_event(Event::NodeLeft { node: node.into() });
        self.write_policy_log(step)?;
        let used = self.plan.roles_by_group();
        if decisions.is_empty() && groups.iter().any(|g| used.contains_key(g)) {
            return Err(JobError::Placement {
                what: format!(
                    "after losing node {node} ({}), no plan of the {} remaining group(s) fits the live executor (a rollout group and 1 or job.controllers policy groups)",
                    names.join(" "),
                    self.policy.inventory().len()
                ),
                fix: "start a node of placement.nodes again (it joins the run) before the next step, or resume the run (see below for its last checkpoint)".into()});
        }
        self.apply(decisions, step).await
    }

    /// A node of `placement.nodes` joined (or came back): its devices become groups of
    /// the inventory, which the policy may use from its next search.
    pub(crate) async fn join_node(&mut self, info: NodeInfo, step: u64) -> Result<(), JobError> {
        let decisions = self.policy.on_event(Event::NodeJoined(node_desc(&info)));
        let added: Vec<GroupId> = self
            .policy
            .inventory()
            .groups()
            .filter(|g| g.node == info.name)
            .map(|g| g.id)
            .collect();
        self.known_nodes.insert(info.name.clone(), info.incarnation);
        let names: Vec<String> = added.iter().map(|g| g.to_string()).collect();
        self.write(&Record::Search {
            step,
            line: format!(
                "node {} joined the cluster with {} device(s): group(s) {} join the inventory ({} group(s) in all)",
                info.name,
                info.devices.len(),
                names.join(" "),
                self.policy.inventory().len()
            )})?;
        self.write_policy_log(step)?;
        self.apply(decisions, step).await
    }
}
