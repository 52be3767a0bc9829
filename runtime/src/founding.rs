//! Whether a node started without a seed founds a new cluster or rejoins a live one.
//!
//! A launcher's first node (Kubernetes pod 0, the head of a Slurm node list) has no
//! seed: it leads. Started again after a crash, it must not lead a second cluster
//! beside the one its peers still run. So, given the other nodes' stable addresses
//! (`NodeConfig::peers`), it first asks each whom it follows, and [`decide`] reads the
//! answers. Pure: the node asks and waits, this decides.

use crate::leadership::Lead;

/// What one peer said when asked whom it follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAnswer {
    /// No answer within the bound: not started, unreachable, or not a yatt node.
    Silent,
    /// It answers but follows no leader yet (term 0): it is itself still joining,
    /// typically through this very node on a fresh start.
    Joining,
    /// A member of a cluster that follows `lead`.
    Member(Lead),
}

impl PeerAnswer {
    /// The answer of a peer that follows `lead`: term 0 is a node still joining.
    pub fn following(lead: Lead) -> Self {
        match lead.term {
            0 => PeerAnswer::Joining,
            _ => PeerAnswer::Member(lead),
        }
    }
}

/// What the node does after one round of asking.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Founding {
    /// No peer belongs to a cluster: lead a new one (term 1).
    Lead,
    /// Peers (these indices) belong to a cluster led by another node: join through
    /// them (a join follows the redirect to the leader).
    Join(Vec<usize>),
    /// Peers belong to a cluster, but every one still follows this node's name as its
    /// leader: an earlier life of this node, not yet found dead (or another process
    /// under this name). Ask again once they have elected another leader.
    Wait {
        /// The term they follow.
        term: u64,
    },
}

/// Decides from one round of `answers` for the node named `me`.
///
/// Joining peers never count as a cluster: on a fresh start every node comes up at
/// once and waits to join through this one, so waiting on them would deadlock. A
/// member counts whatever the others say: one live cluster is enough to join.
pub fn decide(me: &str, answers: &[PeerAnswer]) -> Founding {
    let members: Vec<(usize, &Lead)> = answers
        .iter()
        .enumerate()
        .filter_map(|(i, a)| match a {
            PeerAnswer::Member(lead) => Some((i, lead)),
            _ => None,
        })
        .collect();
    if members.is_empty() {
        return Founding::Lead;
    }
    let through: Vec<usize> = members
        .iter()
        .filter(|(_, lead)| lead.leader != me)
        .map(|(i, _)| *i)
        .collect();
    if through.is_empty() {
        let term = members.iter().map(|(_, l)| l.term).max().unwrap_or(1);
        return Founding::Wait { term };
    }
    Founding::Join(through)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(term: u64, leader: &str) -> PeerAnswer {
        PeerAnswer::Member(Lead {
            term,
            leader: leader.into(),
        })
    }

    #[test]
    fn a_fresh_start_leads_whether_peers_are_silent_or_joining() {
        use PeerAnswer::{Joining, Silent};
        assert_eq!(decide("n-0", &[]), Founding::Lead);
        assert_eq!(decide("n-0", &[Silent, Silent]), Founding::Lead);
        assert_eq!(decide("n-0", &[Joining, Silent, Joining]), Founding::Lead);
    }

    #[test]
    fn a_live_cluster_led_by_another_node_is_joined_through_its_members() {
        let answers = [
            PeerAnswer::Silent,
            member(2, "n-1"),
            PeerAnswer::Joining,
            member(2, "n-1"),
        ];
        assert_eq!(decide("n-0", &answers), Founding::Join(vec![1, 3]));
        // Members that disagree (one has not heard of the new term yet): the join
        // goes through those that name another leader; redirects do the rest.
        let answers = [member(1, "n-0"), member(2, "n-2")];
        assert_eq!(decide("n-0", &answers), Founding::Join(vec![1]));
    }

    #[test]
    fn members_that_still_follow_this_name_are_waited_on_not_split_from() {
        let answers = [member(1, "n-0"), PeerAnswer::Silent, member(3, "n-0")];
        assert_eq!(decide("n-0", &answers), Founding::Wait { term: 3 });
        // Another node's name is not this one's: its cluster is joined.
        assert_eq!(decide("n-1", &[member(1, "n-0")]), Founding::Join(vec![0]));
    }

    #[test]
    fn term_zero_is_a_node_still_joining() {
        let lead = |term| Lead {
            term,
            leader: "n-1".into(),
        };
        assert_eq!(PeerAnswer::following(lead(0)), PeerAnswer::Joining);
        assert_eq!(PeerAnswer::following(lead(4)), PeerAnswer::Member(lead(4)));
    }
}
