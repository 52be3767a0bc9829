//! Several heads stepping together: gradient shards, the all-reduce ring, agreement
//! checks between policy replicas.

use std::time::Instant;

use yatt_metrics::names;
use yatt_roles::{GradShard, NcclGroup, PolicyRequest, PolicyResponse, SampleId, TrainReport};
use yatt_runtime::{ActorId, RingSpec};

use crate::controller::config::GradientSync;
use crate::controller::core::Controller;
use crate::controller::core::Prepared;
use crate::controller::error::ControllerError;
use crate::controller::report::StepReport;
use crate::controller::time_share::prepare_time_shared;

/// Runs one step of several controllers (data-parallel heads, each with its own shard
/// and rollout): each prepares its samples; then either their one shared policy
/// computes each head's gradients, averages them and takes one optimizer step, or,
/// with a policy replica per head (joined with [`join_policy_ring`]), the replicas
/// average their gradients among themselves and each takes the same step. Then every
/// controller syncs its rollout and closes its ledger. The controllers meet only at
/// the update. Their steps must be at the same count.
pub async fn step_data_parallel(
    controllers: &mut [Controller],
) -> Result<Vec<StepReport>, ControllerError> {
    let Some(first) = controllers.first() else {
        return Err(ControllerError::Config(
            "step_data_parallel needs at least one controller".into(),
        ));
    };
    let policy = first.roles.policy.clone();
    let step = first.step;
    if controllers.len() > 1 && controllers.iter().any(|c| c.roles.critic.is_some()) {
        return Err(ControllerError::Config(
            "a critic (PPO) is supported with one controller only; set job.controllers = 1 or use grpo/rloo/reinforce++".into(),
        ));
    }
    if let Some(c) = controllers.iter().find(|c| c.step != step) {
        return Err(ControllerError::Config(format!(
            "data-parallel controllers must be at the same step (found one at step {}, expected {step})",
            c.step
        )));
    }
    // Either every head shares one policy, or each has its own replica.
    let ids: std::collections::BTreeSet<_> = controllers
        .iter()
        .map(|c| c.roles.policy.id().clone())
        .collect();
    let replicated = ids.len() == controllers.len() && controllers.len() > 1;
    if !replicated && ids.len() != 1 {
        return Err(ControllerError::Config(format!(
            "data-parallel controllers must share one policy or each have their own replica ({} controllers, {} distinct policies; the first is {})",
            controllers.len(),
            ids.len(),
            policy.id()
        )));
    }
    let pipelined = first.config.staleness > 0;
    let time_shared = first.config.time_share.is_some();
    let (prepared, train, secs, ahead) = if pipelined {
        // Each head takes its batch generated ahead; then the heads' updates and the
        // generation of their next batches run side by side.
        let t_step = Instant::now();
        let taken =
            futures::future::try_join_all(controllers.iter_mut().map(|c| c.take_batch())).await?;
        let t_overlap = Instant::now();
        let shared: &[Controller] = controllers;
        let (carried, batches): (Vec<usize>, Vec<_>) =
            taken.into_iter().map(|(b, n)| (n, b)).unzip();
        let train = async {
            let prepared = futures::future::try_join_all(
                shared
                    .iter()
                    .zip(batches)
                    .map(|(c, b)| c.prepare_batch(b, t_step)),
            )
            .await?;
            let t = Instant::now();
            let train = update(shared, &prepared, replicated).await?;
            let secs = t.elapsed().as_secs_f64();
            let synced =
                futures::future::try_join_all(shared.iter().map(|c| c.sync_beside_generation()))
                    .await?;
            Ok::<_, ControllerError>((prepared, train, secs, synced))
        };
        let generate = futures::future::try_join_all(shared.iter().map(|c| c.generate_ahead()));
        let (trained, generated) = tokio::join!(train, generate);
        let (prepared, train, secs, synced) = trained?;
        let generated = generated?;
        let overlap: Vec<(f64, f64)> = controllers
            .iter_mut()
            .zip(generated)
            .map(|(c, g)| c.keep_ahead(g, t_overlap))
            .collect();
        (prepared, train, secs, Some((carried, overlap, synced)))
    } else {
        // The heads prepare concurrently: each drives its own rollout replica (taking
        // turns with the device in lockstep when time-shared).
        let prepared = if time_shared {
            prepare_time_shared(controllers).await?
        } else {
            futures::future::try_join_all(controllers.iter_mut().map(|c| c.prepare())).await?
        };
        let t = Instant::now();
        let train = update(controllers, &prepared, replicated).await?;
        (prepared, train, t.elapsed().as_secs_f64(), None)
    };
    let mut reports = Vec::with_capacity(prepared.len());
    let (ahead, synced) = match ahead {
        Some((carried, overlap, synced)) => (Some((carried, overlap)), synced),
        None => (None, Vec::new()),
    };
    // One per head when the heads synced beside generation; none otherwise.
    let mut synced = synced.into_iter();
    for (i, (c, p)) in controllers.iter_mut().zip(prepared).enumerate() {
        let committed = c.update_committed.take();
        // Each ledger records the trained ids of its own samples only.
        let mine: std::collections::BTreeSet<SampleId> = p.samples.iter().map(|s| s.id).collect();
        let own = TrainReport {
            trained: train
                .trained
                .iter()
                .copied()
                .filter(|id| mine.contains(id))
                .collect(),
            ..train.clone()
        };
        let sync = synced.next().flatten();
        let mut report = c.finish(p, own, None, secs, sync).await?;
        if committed.is_some() {
            // The update ran before the loss, on the batch the step lost: no statistics
            // of this batch describe it.
            report
                .metrics
                .values
                .retain(|k, _| !k.starts_with("actor/"));
            report.metrics.set(names::RECOVERY_UPDATE_COMMITTED, 1.0);
        }
        if let Some((carried, overlap)) = &ahead {
            c.report_pipeline(&mut report, carried[i], overlap[i]);
        }
        reports.push(report);
    }
    Ok(reports)
}

/// One optimizer step over every head's prepared samples: through the replicas' ring,
/// or by gathering the heads' gradients and applying their average.
async fn update(
    controllers: &[Controller],
    prepared: &[Prepared],
    replicated: bool,
) -> Result<TrainReport, ControllerError> {
    if let Some(report) = committed_update(controllers, prepared)? {
        return Ok(report);
    }
    if replicated && controllers.iter().all(|c| c.in_policy_ring) {
        return all_reduce_update(controllers, prepared).await;
    }
    if !replicated && controllers[0].policy_sharded {
        return sharded_update(&controllers[0], prepared).await;
    }
    // Replicas outside a ring (the live placement's) get every head's gradients
    // through the controllers and apply the same average.
    let shards = gather_shards(controllers, prepared).await?;
    let appliers = if replicated {
        controllers
    } else {
        &controllers[..1]
    };
    let trained = apply_shards(appliers, shards).await?;
    check_replicas_agree(&trained)?;
    Ok(trained.into_iter().next().expect("at least one controller"))
}

/// One optimizer step of the heads' shared sharded policy on every head's samples, in
/// head order (a ring of one replica: [`PolicyRequest::TrainAllReduce`]).
async fn sharded_update(
    first: &Controller,
    prepared: &[Prepared],
) -> Result<TrainReport, ControllerError> {
    let all: Vec<_> = prepared
        .iter()
        .flat_map(|p| p.samples.iter().cloned())
        .collect();
    match first
        .serve_policy(
            PolicyRequest::TrainAllReduce(all),
            "update_actor",
            first.config.timeouts.train,
        )
        .await?
    {
        PolicyResponse::Trained(r) => Ok(r),
        other => Err(first.protocol("policy", "TrainAllReduce", format!("{other:?}"))),
    }
}

/// The report of an update the replicas already took before a lost peer failed the
/// step (a recovery found a survivor past the step's version and gave every replica
/// its state, see `Controller::update_committed`): every head's samples count as
/// trained, with no loss statistics, and no optimizer step is taken again.
fn committed_update(
    controllers: &[Controller],
    prepared: &[Prepared],
) -> Result<Option<TrainReport>, ControllerError> {
    let Some(version) = controllers.iter().find_map(|c| c.update_committed) else {
        return Ok(None);
    };
    if let Some(c) = controllers
        .iter()
        .find(|c| c.update_committed != Some(version) || c.weights_version != version)
    {
        // Training again would take the update twice; going on without would leave
        // some replica behind.
        return Err(ControllerError::Config(format!(
            "a recovered step's update was taken to version {version}, but a head holds weights {} (update taken: {:?}); resume from the last checkpoint",
            c.weights_version, c.update_committed
        )));
    }
    Ok(Some(TrainReport {
        trained: prepared
            .iter()
            .flat_map(|p| p.samples.iter().map(|s| s.id))
            .collect(),
        optimizer_steps: 0,
        version,
        ..Default::default()
    }))
}

/// Each head's gradients on its own samples (side by side when the policy is
/// replicated; one after the other on a shared one). The shards keep head order
/// whatever order they finish in, so their average is the same every run.
pub(crate) async fn gather_shards(
    controllers: &[Controller],
    prepared: &[Prepared],
) -> Result<Vec<GradShard>, ControllerError> {
    futures::future::try_join_all(controllers.iter().zip(prepared).map(|(c, p)| async move {
        match c
            .serve_policy(
                PolicyRequest::Gradients(p.samples.clone()),
                "update_actor",
                c.config.timeouts.train,
            )
            .await?
        {
            PolicyResponse::Gradients(g) => Ok(g),
            other => Err(c.protocol("policy", "Gradients", format!("{other:?}"))),
        }
    }))
    .await
}

/// Has the policy of each of `appliers` average `shards` and take one optimizer step.
pub(crate) async fn apply_shards(
    appliers: &[Controller],
    shards: Vec<GradShard>,
) -> Result<Vec<TrainReport>, ControllerError> {
    let n = appliers.len();
    let mut shards = Some(shards);
    let applies = appliers.iter().enumerate().map(|(i, c)| {
        // Every applier but the last gets a copy; the last takes the shards themselves.
        let mine = if i + 1 == n {
            shards.take().unwrap_or_default()
        } else {
            shards.clone().unwrap_or_default()
        };
        async move {
            match c
                .serve_policy(
                    PolicyRequest::ApplyGradients(mine),
                    "update_actor",
                    c.config.timeouts.train,
                )
                .await?
            {
                PolicyResponse::Trained(r) => Ok(r),
                other => Err(c.protocol("policy", "ApplyGradients", format!("{other:?}"))),
            }
        }
    });
    futures::future::try_join_all(applies).await
}

/// Identical gradients give bit-identical norms: a differing norm or version after the
/// same update means the replicas' weights no longer agree.
pub(crate) fn check_replicas_agree(trained: &[TrainReport]) -> Result<(), ControllerError> {
    let Some(first) = trained.first() else {
        return Ok(());
    };
    match trained.iter().enumerate().find(|(_, r)| {
        r.version != first.version || r.grad_norm.to_bits() != first.grad_norm.to_bits()
    }) {
        Some((i, r)) => Err(ControllerError::Config(format!(
            "policy replicas diverged: replica 0 is at version {} with gradient norm {}, replica {i} at version {} with {} after the same update",
            first.version, first.grad_norm, r.version, r.grad_norm
        ))),
        None => Ok(()),
    }
}

/// The update of heads with a policy replica each: every replica computes its head's
/// gradients and averages them with the others' in a ring all-reduce that runs between
/// the replicas themselves (no gradient passes through a controller), then takes the
/// same optimizer step. Returns one report for all: the heads' loss statistics
/// averaged in head order (as `ApplyGradients` gives them), the optimizer's from the
/// first replica after checking that every replica agrees.
pub(crate) async fn all_reduce_update(
    controllers: &[Controller],
    prepared: &[Prepared],
) -> Result<TrainReport, ControllerError> {
    // Every replica must be in the exchange at once: they wait on each other.
    let trained =
        futures::future::try_join_all(controllers.iter().zip(prepared).map(|(c, p)| async move {
            match c
                .serve_policy(
                    PolicyRequest::TrainAllReduce(p.samples.clone()),
                    "update_actor",
                    c.config.timeouts.train,
                )
                .await?
            {
                PolicyResponse::Trained(r) => Ok(r),
                other => Err(c.protocol("policy", "TrainAllReduce", format!("{other:?}"))),
            }
        }))
        .await?;
    check_replicas_agree(&trained)?;
    let first = &trained[0];
    let reports: Vec<&TrainReport> = trained.iter().collect();
    Ok(TrainReport {
        optimizer_steps: first.optimizer_steps,
        version: first.version,
        grad_norm: first.grad_norm,
        lr: first.lr,
        // The replicas work side by side: the update took as long as the slowest.
        seconds: trained.iter().map(|r| r.seconds).fold(0.0, f64::max),
        nccl_all_reduce: trained.iter().all(|r| r.nccl_all_reduce),
        // HSDP: the ranks of every replica hold and move the same amounts.
        sharded: first.sharded.clone(),
        ..TrainReport::merge_heads(&reports)
    })
}

/// Sets up the gradient all-reduce of heads with a policy replica each: asks each
/// replica for its ring inbox, then has every replica join the ring of all of them in
/// head order. The heads' train deadline bounds each ask and each wait inside the
/// all-reduce; `chunk_bytes` is the largest message of it.
pub async fn join_policy_ring(
    controllers: &mut [Controller],
    chunk_bytes: u64,
) -> Result<(), ControllerError> {
    const STAGE: &str = "join_policy_ring";
    let mut members = Vec::with_capacity(controllers.len());
    let mut sharded = Vec::new();
    for c in controllers.iter() {
        match c
            .serve_policy(PolicyRequest::RingInbox, STAGE, c.config.timeouts.train)
            .await?
        {
            PolicyResponse::RingInbox(id) => members.push(id),
            PolicyResponse::ShardRingInboxes(ids) => sharded.push(ids),
            other => return Err(c.protocol("policy", "RingInbox", format!("{other:?}"))),
        }
    }
    if !sharded.is_empty() {
        join_shard_rings(controllers, sharded, chunk_bytes).await?;
    } else {
        join_whole_ring(controllers, members, chunk_bytes).await?;
        join_gradient_group(controllers).await?;
    }
    let all: Vec<_> = controllers.iter().map(|c| c.roles.policy.clone()).collect();
    for (i, c) in controllers.iter_mut().enumerate() {
        c.in_policy_ring = true;
        c.peer_policies = all
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != i)
            .map(|(_, p)| p.clone())
            .collect();
    }
    Ok(())
}

/// Replicas of the whole policy: every replica joins the ring of all of them.
async fn join_whole_ring(
    controllers: &[Controller],
    members: Vec<ActorId>,
    chunk_bytes: u64,
) -> Result<(), ControllerError> {
    ask_to_join(controllers, "JoinRing", |rank, c| {
        PolicyRequest::JoinRing(RingSpec {
            rank: rank as u32,
            members: members.clone(),
            timeout: c.config.timeouts.train,
            chunk_bytes,
        })
    })
    .await
}

/// Replicas of a sharded policy (HSDP): `inboxes[i][r]` is rank `r` of replica `i`;
/// rank `r` of every replica joins the ring of rank `r` of all of them.
async fn join_shard_rings(
    controllers: &[Controller],
    inboxes: Vec<Vec<ActorId>>,
    chunk_bytes: u64,
) -> Result<(), ControllerError> {
    let shards = inboxes[0].len();
    if inboxes.len() != controllers.len() || inboxes.iter().any(|r| r.len() != shards) {
        let counts: Vec<usize> = inboxes.iter().map(Vec::len).collect();
        return Err(ControllerError::Config(format!(
            "every policy replica must be sharded over the same rank count to average gradients rank by rank: {} head(s), replicas with {counts:?} rank(s)",
            controllers.len()
        )));
    }
    ask_to_join(controllers, "JoinShardRings", |i, c| {
        PolicyRequest::JoinShardRings(
            (0..shards)
                .map(|r| RingSpec {
                    rank: i as u32,
                    members: inboxes.iter().map(|replica| replica[r].clone()).collect(),
                    timeout: c.config.timeouts.collective,
                    chunk_bytes,
                })
                .collect(),
        )
    })
    .await
}

/// Asks every head's replica at once to join what `join(head, controller)` asks
/// (`asked` names it); each must answer `Joined` within the train deadline.
async fn ask_to_join(
    controllers: &[Controller],
    asked: &'static str,
    join: impl Fn(usize, &Controller) -> PolicyRequest,
) -> Result<(), ControllerError> {
    const STAGE: &str = "join_policy_ring";
    let joins = controllers.iter().enumerate().map(|(i, c)| {
        let request = join(i, c);
        async move {
            match c
                .serve_policy(request, STAGE, c.config.timeouts.train)
                .await?
            {
                PolicyResponse::Joined => Ok(()),
                other => Err(c.protocol("policy", asked, format!("{other:?}"))),
            }
        }
    });
    futures::future::try_join_all(joins).await?;
    Ok(())
}

/// After the ring: the replicas' NCCL gradient group (`job.gradient_sync`), where every
/// replica can use NCCL; otherwise they average over the ring, the reason logged. Asked
/// again whenever the ring is rebuilt, so a replaced replica gets a new group.
async fn join_gradient_group(controllers: &[Controller]) -> Result<(), ControllerError> {
    const STAGE: &str = "join_policy_ring";
    let Some(first) = controllers.first() else {
        return Ok(());
    };
    let (mode, t) = (first.config.gradient_sync, first.config.timeouts.train);
    let (mut id, mut unavailable) = (None, None);
    if mode != GradientSync::Quic {
        for (rank, c) in controllers.iter().enumerate() {
            let ask = PolicyRequest::GradientGroup { make_id: rank == 0 };
            match c.serve_policy(ask, STAGE, t).await? {
                PolicyResponse::GradientGroup(made) if rank == 0 => id = made,
                PolicyResponse::GradientGroup(_) => {}
                PolicyResponse::NcclUnavailable(why) => {
                    unavailable = Some(format!("replica {rank}: {why}"));
                    break;
                }
                other => return Err(c.protocol("policy", "GradientGroup", format!("{other:?}"))),
            }
        }
    }
    let id = match (mode, id, unavailable) {
        (GradientSync::Quic, ..) => None,
        (_, Some(id), None) => Some(id),
        (GradientSync::Nccl, _, why) => {
            return Err(ControllerError::Config(format!(
                "job.gradient_sync = \"nccl\", but the policy replicas cannot average gradients through NCCL: {}; set job.gradient_sync = \"auto\" (falls back to the QUIC ring) or \"quic\"",
                why.unwrap_or_else(|| "replica 0 made no group id".into())
            )))
        }
        (_, _, why) => {
            let why = why.unwrap_or_else(|| "replica 0 made no group id".into());
            tracing::info!(reason = %why, "gradient all-reduce: NCCL unavailable, so the policy replicas average gradients over the QUIC ring");
            None
        }
    };
    let nranks = controllers.len() as u32;
    let joins = controllers.iter().enumerate().map(|(rank, c)| {
        let group = id.map(|id| NcclGroup {
            id,
            rank: rank as u32,
            nranks,
            deadline_ms: c.config.timeouts.collective.as_millis() as u64,
            bucket_bytes: 0,
        });
        async move {
            match c
                .serve_policy(PolicyRequest::JoinGradientGroup(group), STAGE, t)
                .await?
            {
                PolicyResponse::Joined => Ok(()),
                other => Err(c.protocol("policy", "JoinGradientGroup", format!("{other:?}"))),
            }
        }
    });
    futures::future::try_join_all(joins).await.map(drop)
}
