//! A sharded policy replica on cluster nodes (`job.policy_shards = N` with
//! `placement.mode = "disaggregated"`): rank `r` on the node `placement.policy[r]`
//! names (or every rank on the one node named). The policy actor the controller drives
//! is rank 0; it spawns ranks 1..N as `policy-rank` actors on their nodes, joins them
//! in a ring (QUIC between nodes, the mailbox within one) and asks them for their part
//! of every request. Each rank shards the model it loaded (or loads its part of a
//! sharded checkpoint), so no process holds more than its shards while training.
//!
//! A rank that is lost fails the request within its deadline and breaks the replica:
//! the run stops with the resume hint (a sharded policy is not rebuilt in place).

use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_engine::ShardedTrainer;
use yatt_engine::{is_sharded_checkpoint, layout_of};
use yatt_roles::{
    PolicyRankRole, RankRef, RankRequest, RankResponse, RankSource, RemoteRanks, Role, RoleActor,
    RoleError, RoleRequest, RoleResponse, ShardedCriticRole, ShardedPolicyRole,
    ShardedReferenceRole, ShardedStart, SlicePusher,
};
use yatt_runtime::{ActorName, Node, RingMember, RingSpec, RING_CHUNK_BYTES};

use crate::build::devices::model_here;
use crate::build::parts::{
    critic_config, critic_train_config, memory_options, policy_config, sharded_start, train_config,
    whole_checkpoint_refused, HSDP_RING,
};
use crate::build::remote::{start_role, RoleArgs};
use crate::config::sections::JobConfig;
use crate::error::JobError;

/// The ring members of a sharded replica's ranks: `node/policy-shard/RANK`.
pub const SHARD_RING: &str = "policy-shard";

/// What a node needs to start rank 0 of a sharded policy replica (the policy actor).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ShardedArgs {
    /// The job, and the run's checkpoint when it resumes.
    pub role: RoleArgs,
    /// Which of the `job.policy_replicas` replicas: its ranks go on the nodes
    /// `placement.policy[replica·N .. (replica+1)·N]` names.
    pub replica: u32,
}

impl ShardedArgs {
    /// The job these arguments carry.
    fn job(&self) -> Result<JobConfig, String> {
        JobConfig::parse(&self.role.job, "the job config sent by the controller", &[])
            .map_err(|e| e.to_string())
    }
}

/// What a node needs to start one rank (1..N) of a sharded policy replica.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RankArgs {
    /// The job, and the run's checkpoint when it resumes.
    pub role: RoleArgs,
    /// The rank.
    pub rank: u32,
    /// Replicas of the sharded policy (HSDP): with more than one, the rank also joins
    /// the ring of its peers in the other replicas.
    pub replicas: u32,
    /// Which sharded role the rank belongs to.
    pub of: RankOf,
}

/// The sharded role a rank belongs to: what it loads and what it answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RankOf {
    /// The policy: trains (its shards of the run's checkpoint on a resume).
    Policy,
    /// The reference: loads the run's initial model to score with, never to train.
    Reference,
    /// PPO's critic: the model with a value head, trained on the value loss (its shards
    /// of the checkpoint's `critic` on a resume).
    Critic,
}

/// A ring member on `node` named by `name`'s replica number, unique on the node (so
/// the ranks of several replicas fit on one node).
fn ring_member(node: &Node, ring: &str, name: &ActorName) -> Result<RingMember, String> {
    RingMember::start(node, ring, name.replica).map_err(|e| e.to_string())
}

/// Where a rank's shards come from (its part of the run's checkpoint, or the model it
/// loads from `model.source`), the padding id and the model's parameter count.
fn rank_source(
    job: &JobConfig,
    checkpoint: Option<&std::path::Path>,
    of: RankOf,
) -> Result<(RankSource, i64, u64), JobError> {
    let (mut model, _, pad_id) = model_here(job)?;
    if of == RankOf::Critic {
        model.attach_head("v_head");
    }
    let params = layout_of(&model).iter().map(|u| u.numel as u64).sum();
    if of == RankOf::Reference {
        // A reference is the run's initial model, also when the run resumes.
        model.memory = memory_options(job);
        return Ok((RankSource::Frozen(Box::new(model)), pad_id, params));
    }
    let (key, shards, dir) = match of {
        RankOf::Critic => (
            "job.critic_shards",
            job.job.critic_shards,
            checkpoint.map(|d| d.join("critic")),
        ),
        _ => {
            job.check_policy_shards_fit(&model.config)?;
            (
                "job.policy_shards",
                job.job.policy_shards,
                checkpoint.map(std::path::Path::to_path_buf),
            )
        }
    };
    let source = match dir {
        Some(dir) if is_sharded_checkpoint(&dir) => RankSource::Checkpoint {
            dir,
            device: model.device(),
            kind: model.kind(),
            memory: memory_options(job),
        },
        Some(dir) => {
            let role = match of {
                RankOf::Critic => "critic",
                _ => "policy",
            };
            return Err(whole_checkpoint_refused(&dir, role, key, shards));
        }
        None if of == RankOf::Critic => {
            model.memory = memory_options(job);
            RankSource::Model(Box::new(model), critic_train_config(job))
        }
        None => RankSource::Model(Box::new(model), train_config(job)),
    };
    Ok((source, pad_id, params))
}

/// The factory of a rank 1..N: its ring member on this node, then the role, which
/// loads the model (or waits for the ring to load its part of the checkpoint).
pub(crate) async fn start_rank(
    node: &Node,
    name: &ActorName,
    a: RankArgs,
) -> Result<yatt_roles::RoleActor<PolicyRankRole>, String> {
    let member = ring_member(node, SHARD_RING, name)?;
    let replica_member = match a.replicas > 1 {
        true => Some(ring_member(node, HSDP_RING, name)?),
        false => None,
    };
    hold_no_freed_blocks(a.rank);
    let root = node.config().data_dir.clone();
    let checkpoint = a.role.checkpoint.clone();
    let pusher = SlicePusher::new(node.downgrade(), tokio::runtime::Handle::current());
    let of = a.of;
    start_role(a.role, "policy-rank", move |job| {
        let (source, pad_id, params) = rank_source(job, checkpoint.as_deref(), of)?;
        let mut role = PolicyRankRole::new(policy_config(job, pad_id), member, source, params)
            .map_err(|e| JobError::Model {
                source_desc: job.model.source.to_string(),
                reason: format!("a policy rank: {e}"),
            })?;
        if of == RankOf::Critic {
            role = role.with_critic(critic_config(job, pad_id));
        }
        let role = role.with_write_root(root).with_pusher(pusher);
        Ok(match replica_member {
            Some(m) => role.with_replica_member(m),
            None => role,
        })
    })
    .await
}

/// The factory of rank 0, the policy actor: spawns ranks 1..N, joins every rank in
/// one ring, then shards its own part. A failure stops the ranks it started.
pub(crate) async fn start_sharded_policy(
    node: &Node,
    name: &ActorName,
    args: ShardedArgs,
) -> Result<RoleActor<ShardedPolicyRole>, String> {
    let job = &args.job()?;
    // One node per rank, in rank order (one name: every rank there), replica by replica.
    let (n, replicas) = (job.job.policy_shards, job.job.policy_replicas);
    let first = args.replica as usize * n;
    let nodes = job.placement.policy_nodes(n * replicas);
    let nodes = nodes.get(first..first + n).ok_or_else(|| {
        format!(
            "policy replica {} of {replicas}: placement.policy names {} node(s)",
            args.replica,
            nodes.len()
        )
    })?;
    let a = args.role;
    let start = sharded_start(job);
    let replica_member = match replicas > 1 {
        true => Some(ring_member(node, HSDP_RING, name)?),
        false => None,
    };
    let rank_args = |r: usize| RankArgs {
        role: a.clone(),
        rank: r as u32,
        replicas: replicas as u32,
        of: RankOf::Policy,
    };
    let (member, ranks) = spawn_ranks(node, name, job, nodes, &start, rank_args).await?;
    let remote = RemoteRanks::new(ranks.clone(), 1, tokio::runtime::Handle::current());
    let root = node.config().data_dir.clone();
    let checkpoint = a.checkpoint.clone();
    let deadline = start.deadline;
    let pusher = SlicePusher::new(node.downgrade(), tokio::runtime::Handle::current());
    let role = start_role(a, "policy", move |job| {
        let failed = |e: String| JobError::Model {
            source_desc: job.model.source.to_string(),
            reason: format!("sharded policy rank 0: {e}"),
        };
        let (source, pad_id, _) = rank_source(job, checkpoint.as_deref(), RankOf::Policy)?;
        let rank0 = source.shard(member).map_err(failed)?;
        let role = ShardedPolicyRole::with_remote_ranks(
            rank0,
            remote,
            policy_config(job, pad_id),
            deadline,
        )
        .map_err(|e| failed(e.to_string()))?;
        let role = role.with_write_root(root).with_pusher(pusher);
        Ok(match replica_member {
            Some(m) => role.with_replica_members(vec![m]),
            None => role,
        })
    })
    .await;
    match role {
        // Weight sync goes by slices, each rank sending its own: the role itself
        // pushes (through its pusher), so its actor needs no `PushingPolicy`.
        Ok(role) => Ok(role),
        Err(e) => {
            stop_ranks(&ranks).await;
            Err(e)
        }
    }
}

/// The factory of a sharded reference's rank 0 (`job.reference_shards`): spawns ranks
/// 1..N frozen, rank r on the node `placement.policy[r]` names (beside the policy's
/// ranks), joins them in one ring, then shards its own part of the run's initial
/// model. A failure stops the ranks it started.
pub(crate) async fn start_sharded_reference(
    node: &Node,
    name: &ActorName,
    args: ShardedArgs,
) -> Result<RoleActor<ShardedReferenceRole>, String> {
    start_beside_policy(
        node,
        name,
        args,
        RankOf::Reference,
        |job, rank0, remote, start, pad_id| {
            ShardedReferenceRole::with_remote_ranks(
                rank0,
                remote,
                policy_config(job, pad_id),
                start,
            )
        },
    )
    .await
}

/// The factory of a sharded critic's rank 0 (`job.critic_shards > 1`): spawns ranks
/// 1..N as critic ranks, rank r on the node `placement.policy[r]` names (beside the
/// policy's ranks), joins them in one ring, then shards its own part of a fresh critic
/// (or loads it from the run's checkpoint). A failure stops the ranks it started.
pub(crate) async fn start_sharded_critic(
    node: &Node,
    name: &ActorName,
    args: ShardedArgs,
) -> Result<RoleActor<ShardedCriticRole>, String> {
    let root = node.config().data_dir.clone();
    start_beside_policy(
        node,
        name,
        args,
        RankOf::Critic,
        |job, rank0, remote, start, pad_id| {
            let role = ShardedCriticRole::with_remote_ranks(
                rank0,
                remote,
                critic_config(job, pad_id),
                start,
            )?;
            Ok(role.with_write_root(root))
        },
    )
    .await
}

/// Rank 0 of a sharded reference or critic (`of`), built by `build` from its own
/// trainer and the ranks 1..N it spawned beside the policy's (rank r on the node
/// `placement.policy[r]` names) and joined in one ring. A failure stops the ranks it
/// started.
async fn start_beside_policy<R: Role>(
    node: &Node,
    name: &ActorName,
    args: ShardedArgs,
    of: RankOf,
    build: impl FnOnce(&JobConfig, ShardedTrainer, RemoteRanks, &ShardedStart, i64) -> Result<R, RoleError>
        + Send
        + 'static,
) -> Result<RoleActor<R>, String> {
    let job = &args.job()?;
    let (what, n) = match of {
        RankOf::Critic => ("critic", job.job.critic_shards),
        _ => ("reference", job.job.reference_shards),
    };
    let nodes = job.placement.policy_nodes(n);
    let nodes = nodes.get(..n).ok_or_else(|| {
        format!(
            "a {what} over {n} ranks: placement.policy names {} node(s)",
            nodes.len()
        )
    })?;
    let a = args.role;
    let start = ShardedStart {
        shards: n,
        ..sharded_start(job)
    };
    let rank_args = |r: usize| RankArgs {
        role: a.clone(),
        rank: r as u32,
        replicas: 1,
        of,
    };
    let (member, ranks) = spawn_ranks(node, name, job, nodes, &start, rank_args).await?;
    let remote = RemoteRanks::new(ranks.clone(), 1, tokio::runtime::Handle::current());
    // A reference is the run's initial model, also when the run resumes.
    let checkpoint = a.checkpoint.clone().filter(|_| of == RankOf::Critic);
    let role = start_role(a, what, move |job| {
        let failed = |e: String| JobError::Model {
            source_desc: job.model.source.to_string(),
            reason: format!("sharded {what} rank 0: {e}"),
        };
        let (source, pad_id, _) = rank_source(job, checkpoint.as_deref(), of)?;
        let rank0 = source.shard(member).map_err(failed)?;
        build(job, rank0, remote, &start, pad_id).map_err(|e| failed(e.to_string()))
    })
    .await;
    if role.is_err() {
        stop_ranks(&ranks).await;
    }
    role
}

/// Rank 0's ring member on this node, and ranks 1..N spawned (`args(r)` each) on
/// `nodes[1..]` and joined with it in one ring. A failure stops the ranks it started.
async fn spawn_ranks(
    node: &Node,
    name: &ActorName,
    job: &JobConfig,
    nodes: &[String],
    start: &ShardedStart,
    args: impl Fn(usize) -> RankArgs,
) -> Result<(RingMember, Vec<RankRef>), String> {
    let spawn_timeout = Duration::from_secs(job.placement.spawn_timeout_s);
    let mut member = ring_member(node, SHARD_RING, name)?;
    hold_no_freed_blocks(0);
    let spawned = futures::future::join_all(nodes.iter().enumerate().skip(1).map(|(r, target)| {
        let args = args(r);
        async move {
            node.spawn_remote_linked::<RoleRequest<RankRequest>, RoleResponse<RankResponse>, _>(
                target,
                "policy-rank",
                &args,
                spawn_timeout,
            )
            .await
            .map_err(|e| format!("spawning rank {r} on node {target}: {e}"))
        }
    }))
    .await;
    let (ranks, failed): (Vec<_>, Vec<_>) = spawned.into_iter().partition(Result::is_ok);
    let ranks: Vec<RankRef> = ranks.into_iter().map(Result::unwrap).collect();
    if let Some(Err(e)) = failed.into_iter().next() {
        stop_ranks(&ranks).await;
        return Err(e);
    }
    let joined = join_ring(&mut member, &ranks, start.collective, start.deadline).await;
    if let Err(e) = joined {
        stop_ranks(&ranks).await;
        return Err(e);
    }
    Ok((member, ranks))
}

/// A node that holds a rank returns large freed blocks to the OS at once, so that its
/// resident memory is what the rank holds, not what its step once allocated (see
/// [`yatt_engine::tune_host_allocator_for_shards`]; rollouts on the node then decode
/// with page faults on their large activations).
fn hold_no_freed_blocks(rank: u32) {
    yatt_engine::tune_host_allocator_for_shards();
    tracing::info!(
        rank,
        "this node holds a policy rank: large freed blocks go back to the OS at once"
    );
}

/// Every rank's ring inbox into one spec; each remote rank joins (and shards its
/// model) at once, then rank 0's member.
async fn join_ring(
    member: &mut RingMember,
    ranks: &[RankRef],
    collective: Duration,
    deadline: Duration,
) -> Result<(), String> {
    let mut members = vec![member.inbox_id().clone()];
    for r in ranks {
        match r
            .ask(RoleRequest::Serve(RankRequest::RingInbox), deadline)
            .await
        {
            Ok(RoleResponse::Served(RankResponse::RingInbox(id))) => members.push(id),
            Ok(other) => return Err(format!("{} answered RingInbox with {other:?}", r.id())),
            Err(e) => return Err(format!("asking {} for its ring inbox: {e}", r.id())),
        }
    }
    let spec = |rank: usize| RingSpec {
        rank: rank as u32,
        members: members.clone(),
        timeout: collective,
        chunk_bytes: RING_CHUNK_BYTES,
    };
    let joins = ranks.iter().enumerate().map(|(i, r)| {
        let spec = spec(i + 1);
        async move {
            match r
                .ask(RoleRequest::Serve(RankRequest::JoinRing(spec)), deadline)
                .await
            {
                Ok(RoleResponse::Served(RankResponse::Joined)) => Ok(()),
                Ok(other) => Err(format!("{} answered JoinRing with {other:?}", r.id())),
                Err(e) => Err(format!(
                    "policy rank {} could not join the ring: {e}",
                    i + 1
                )),
            }
        }
    });
    futures::future::try_join_all(joins).await?;
    member.join(spec(0)).map_err(|e| e.to_string())
}

/// Stops the ranks a failed start spawned (best effort: a lost one is gone already).
pub(crate) async fn stop_ranks(ranks: &[RankRef]) {
    let stops = ranks
        .iter()
        .map(|r| r.ask(RoleRequest::Stop, Duration::from_secs(10)));
    futures::future::join_all(stops).await;
}
