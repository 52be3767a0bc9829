//! Sharded training over the runtime's ring: ranks on two nodes, QUIC between them,
//! take the unsharded trainer's steps (loss, gradient norm and weights within 1e-4),
//! and a rank that is lost mid-step fails the others within the ring's deadline.

use std::thread;
use std::time::{Duration, Instant};
use tch::Device;
use yatt_engine::fixtures::sharded::{
    configs, max_rel, model, train_config, train_rank, unsharded,
};
use yatt_engine::{ShardedStepStats, ShardedTrainer};
use yatt_roles::RingShardGroup;
use yatt_runtime::{Node, RingMember, RingSpec};

struct Cluster {
    rt: tokio::runtime::Runtime,
    nodes: Vec<Node>,
    _dir: tempfile::TempDir,
}

fn cluster() -> Cluster {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let nodes = rt.block_on(async {
        let a = Node::builder("shard-a")
            .dev_certs(dir.path())
            .start()
            .await
            .unwrap();
        let b = Node::builder("shard-b")
            .dev_certs(dir.path())
            .seed(a.addr())
            .start()
            .await
            .unwrap();
        assert!(
            a.directory()
                .wait_until(Duration::from_secs(10), |d| d.alive_nodes().count() == 2)
                .await
        );
        vec![a, b]
    });
    Cluster {
        rt,
        nodes,
        _dir: dir,
    }
}

/// `world` ranks alternating between the two nodes, joined into one ring.
fn groups(c: &Cluster, name: &str, world: usize, timeout: Duration) -> Vec<RingShardGroup> {
    let _inside = c.rt.enter();
    let mut members: Vec<RingMember> = (0..world)
        .map(|r| RingMember::start(&c.nodes[r % 2], name, r as u32).unwrap())
        .collect();
    let ids: Vec<_> = members.iter().map(|m| m.inbox_id().clone()).collect();
    for (rank, m) in members.iter_mut().enumerate() {
        m.join(RingSpec {
            rank: rank as u32,
            members: ids.clone(),
            timeout,
            chunk_bytes: 64 << 10,
        })
        .unwrap();
    }
    members
        .into_iter()
        .map(|m| RingShardGroup::new(m).unwrap())
        .collect()
}

#[test]
fn ranks_on_two_nodes_take_the_unsharded_steps() {
    let c = cluster();
    let (_, config) = configs().remove(0);
    let (steps, n) = (3, 4);
    let (want, want_w) = unsharded(&config, Device::Cpu, steps, n);
    for world in [2usize, 3] {
        // Every model before any rank starts: libtorch's RNG is global.
        let trainers: Vec<ShardedTrainer> =
            groups(&c, &format!("shard{world}"), world, Duration::from_secs(30))
                .into_iter()
                .map(|g| {
                    ShardedTrainer::new(model(&config, Device::Cpu), train_config(), Box::new(g))
                        .unwrap()
                })
                .collect();
        let handles: Vec<_> = trainers
            .into_iter()
            .enumerate()
            .map(|(rank, mut tr)| {
                thread::spawn(move || {
                    let s = train_rank(&mut tr, rank, world, 0..steps, n, Device::Cpu);
                    (s, tr.full_weights().unwrap())
                })
            })
            .collect();
        let out: Vec<(Vec<ShardedStepStats>, _)> =
            handles.into_iter().map(|h| h.join().unwrap()).collect();
        for (rank, (stats, w)) in out.iter().enumerate() {
            for (s, w0) in stats.iter().zip(&want) {
                let rel = |a: f64, b: f64| (a - b).abs() / b.abs().max(1e-12);
                assert!(
                    rel(s.step.loss, w0.loss) < 1e-4,
                    "N={world} rank {rank}: loss {} vs {}",
                    s.step.loss,
                    w0.loss
                );
                assert!(
                    rel(s.step.grad_norm, w0.grad_norm) < 1e-4,
                    "N={world} rank {rank}: grad norm"
                );
                assert!(s.comm.gathered_bytes > 0 && s.comm.reduced_bytes > 0);
            }
            let d = max_rel(w, &want_w);
            assert!(d < 1e-4, "N={world} rank {rank}: weights differ by {d:e}");
        }
    }
}

/// A rank lost before the step: the others' steps fail within the ring's deadline,
/// naming the collective, instead of hanging.
#[test]
fn a_lost_rank_fails_the_step_within_the_deadline() {
    let c = cluster();
    let (_, config) = configs().remove(0);
    let deadline = Duration::from_secs(3);
    let mut trainers: Vec<ShardedTrainer> = groups(&c, "lost", 3, deadline)
        .into_iter()
        .map(|g| {
            ShardedTrainer::new(model(&config, Device::Cpu), train_config(), Box::new(g)).unwrap()
        })
        .collect();
    drop(trainers.remove(2));
    let t0 = Instant::now();
    let handles: Vec<_> = trainers
        .into_iter()
        .enumerate()
        .map(|(rank, mut tr)| {
            thread::spawn(move || {
                let (b, _) = yatt_engine::fixtures::sharded::micro_batch(0, rank, Device::Cpu);
                tr.step_tokens(&[b], 1.0, |_, s| Ok(s.logprobs.sum(tch::Kind::Float)))
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect();
    for h in handles {
        let e = h.join().unwrap();
        assert!(e.contains("collective"), "{e}");
    }
    assert!(t0.elapsed() < 4 * deadline, "took {:?}", t0.elapsed());
}
