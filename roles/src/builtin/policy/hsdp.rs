//! Replicas of a sharded policy (HSDP, `job.policy_replicas = R` with
//! `job.policy_shards = N`): shard within a replica, replicate across replicas. Each
//! replica is driven by its own head, trains on that head's samples and normalises its
//! own loss, as replicas of the whole policy do; rank `r` of every replica holds the
//! same shards, and those R ranks form a ring of their own that averages their
//! gradient shards before each optimizer step (`ShardedTrainer::join_replicas`).
//! Every replica then takes the same step, bit for bit, and no rank moves more than
//! 2·(R−1)/R of its own shards for it.
//!
//! The heads set the rings up as they do for replicas of the whole policy
//! ([`PolicyRequest::RingInbox`], answered with one inbox per rank, then
//! [`PolicyRequest::JoinShardRings`]), and train with
//! [`PolicyRequest::TrainAllReduce`].
//!
//! [`PolicyRequest::RingInbox`]: super::PolicyRequest::RingInbox
//! [`PolicyRequest::JoinShardRings`]: super::PolicyRequest::JoinShardRings
//! [`PolicyRequest::TrainAllReduce`]: super::PolicyRequest::TrainAllReduce

use yatt_engine::ShardedTrainer;
use yatt_runtime::{ActorId, RingMember, RingSpec};

use super::rank::{join_replica_ring, RankRequest, RankResponse};
use super::report::TrainReport;
use super::sharded::ShardedPolicyRole;
use crate::role::RoleError;
use crate::sample::Sample;

impl ShardedPolicyRole {
    /// One of several replicas of the sharded policy: `members` are the local ranks'
    /// members (rank order) of their rings with the other replicas' ranks, joined when
    /// the heads ask ([`super::PolicyRequest::JoinShardRings`]).
    pub fn with_replica_members(mut self, members: Vec<RingMember>) -> Self {
        self.replica_members = members;
        self
    }

    /// Every rank's inbox in its ring with the other replicas, in rank order.
    pub(super) fn shard_ring_inboxes(&mut self) -> Result<Vec<ActorId>, RoleError> {
        if self.replica_members.len() != self.ranks.local() {
            return Err(no_replicas());
        }
        let mut ids: Vec<ActorId> = self
            .replica_members
            .iter()
            .map(|m| m.inbox_id().clone())
            .collect();
        let jobs = (0..self.ranks.local())
            .map(|_| |_: &mut ShardedTrainer| ())
            .collect();
        let (_, remote) = self
            .ranks
            .run_all("the replicas' ring inboxes", jobs, |_| {
                RankRequest::ReplicaRingInbox
            })?;
        for a in remote {
            match a {
                RankResponse::RingInbox(id) => ids.push(id),
                other => {
                    return Err(RoleError::Failed(format!(
                        "the replicas' ring inboxes: a rank answered {other:?}"
                    )))
                }
            }
        }
        Ok(ids)
    }

    /// Rank `r` joins `specs[r]`, the ring of rank `r` of every replica.
    pub(super) fn join_shard_rings(&mut self, specs: Vec<RingSpec>) -> Result<(), RoleError> {
        let n = self.ranks.len();
        if specs.len() != n {
            return Err(RoleError::BadRequest(format!(
                "JoinShardRings has {} ring(s) for a replica of {n} ranks: one per rank",
                specs.len()
            )));
        }
        if self.replica_members.len() != self.ranks.local() {
            return Err(no_replicas());
        }
        let members = std::mem::take(&mut self.replica_members);
        let jobs = members
            .into_iter()
            .zip(specs.iter().cloned())
            .map(|(member, spec)| {
                move |tr: &mut ShardedTrainer| join_replica_ring(tr, member, spec)
            })
            .collect();
        let (local, remote) = self
            .ranks
            .run_all("joining the replicas' rings", jobs, |r| {
                RankRequest::JoinReplicaRing(specs[r].clone())
            })?;
        let joined =
            self.ranks
                .parts("joining the replicas' rings", local, remote, |a| match a {
                    RankResponse::Joined => Ok(()),
                    other => Err(other),
                })?;
        debug_assert_eq!(joined.len(), n);
        self.replicas_joined = true;
        Ok(())
    }

    /// An update whose gradients every rank averages with its peers in the other
    /// replicas before its optimizer step (every replica's heads ask at once): one step
    /// over all `samples`, as replicas of the whole policy take.
    pub(super) fn train_with_replicas(
        &mut self,
        samples: Vec<Sample>,
    ) -> Result<TrainReport, RoleError> {
        // A replica started alone (no replicas to join): a ring of one, one optimizer
        // step on these samples (heads sharing one sharded policy send theirs together).
        let alone = !self.replicas_joined && self.replica_members.is_empty();
        if !self.replicas_joined && !alone {
            return Err(RoleError::BadRequest(
                "this sharded policy replica has not joined its replicas' rings yet (JoinShardRings)"
                    .into(),
            ));
        }
        self.train_in(samples, true)
    }
}

/// A replica ring asked of a sharded policy started without members for one.
fn no_replicas() -> RoleError {
    RoleError::BadRequest(
        "this sharded policy has no replicas' rings to join: it was started with job.policy_replicas = 1 (or has joined them already)".into(),
    )
}
