//! A policy sharded over N ranks takes the whole policy's steps: the same losses,
//! gradient norms and weights at 1–3 ranks, across mini-batches, thinned micro-batches
//! and recomputed old log-probs; its checkpoint continues at another rank count; a rank
//! that dies fails the request at once, with the resume hint, and every later one.

use std::time::{Duration, Instant};

use super::split_tests::samples;
use super::*;
use tch::{Device, Kind};
use yatt_engine::{tiny_config, Llama, ShardedTrainer, TrainConfig};

fn train_config() -> TrainConfig {
    TrainConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        max_grad_norm: Some(1.0),
        ..Default::default()
    }
}

fn policy_config() -> PolicyConfig {
    PolicyConfig {
        micro_batch_size: 3,
        mini_batches: 2,
        ..Default::default()
    }
}

fn start(shards: usize) -> ShardedStart {
    ShardedStart {
        shards,
        collective: Duration::from_secs(30),
        deadline: Duration::from_secs(60),
    }
}

fn ask<R: Role<Request = PolicyRequest, Response = PolicyResponse>>(
    p: &mut R,
    batch: &[Sample],
) -> TrainReport {
    let scored = match p.serve(PolicyRequest::OldLogProbs(batch.to_vec())).unwrap() {
        PolicyResponse::Scored(s) => s,
        other => panic!("{other:?}"),
    };
    match p.serve(PolicyRequest::Train(scored)).unwrap() {
        PolicyResponse::Trained(r) => r,
        other => panic!("{other:?}"),
    }
}

fn close(what: &str, a: f64, b: f64) {
    assert!(
        (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-3),
        "{what}: {a} vs {b}"
    );
}

fn max_diff(a: &[(String, Tensor)], b: &[(String, Tensor)]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|((na, x), (nb, y))| {
            assert_eq!(na, nb);
            (x - y).abs().max().double_value(&[])
        })
        .fold(0.0, f64::max)
}

#[test]
fn a_sharded_policy_takes_the_whole_policys_steps() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 31).unwrap();
    let batch = samples(&base);
    let copy = || base.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let mut whole = PolicyRole::new(Trainer::new(copy(), train_config()), policy_config()).unwrap();
    let mut sharded: Vec<ShardedPolicyRole> = [1, 2, 3]
        .iter()
        .map(|&n| {
            ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(n)).unwrap()
        })
        .collect();
    for round in 0..2 {
        let want = ask(&mut whole, &batch);
        assert!(want.grad_norm > 0.0);
        for p in &mut sharded {
            let n = p.shards();
            let got = ask(p, &batch);
            let what = |k: &str| format!("{n} shards, round {round}: {k}");
            close(&what("loss"), want.loss, got.loss);
            close(&what("grad_norm"), want.grad_norm, got.grad_norm);
            assert_eq!((got.version, got.optimizer_steps), (want.version, 2));
            let s = got.sharded.as_ref().expect("a sharded report");
            assert_eq!(s.shards, n);
            assert!(s.train_state_bytes > 0);
            // One rank gathers and reduces nothing over the wire.
            assert_eq!(s.gathered_bytes == 0, n == 1, "{s:?}");
        }
    }
    let want = whole.trainer.model.hf_named_tensors();
    for p in &mut sharded {
        let got = p.gathered_model().unwrap().hf_named_tensors();
        let d = max_diff(&want, &got);
        assert!(d < 1e-4, "{} shards: weights differ by {d}", p.shards());
    }
}

#[test]
fn a_sharded_checkpoint_continues_at_another_shard_count() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 37).unwrap();
    let batch = samples(&base);
    let mut two = ShardedPolicyRole::new(base, train_config(), policy_config(), &start(2)).unwrap();
    ask(&mut two, &batch);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("checkpoint");
    assert!(matches!(
        two.serve(PolicyRequest::SaveCheckpoint(ckpt.clone()))
            .unwrap(),
        PolicyResponse::Saved
    ));
    let want = ask(&mut two, &batch);
    let want_w = two.gathered_model().unwrap().hf_named_tensors();
    for n in [1, 3] {
        let mut p = ShardedPolicyRole::load(
            &ckpt,
            Device::Cpu,
            Kind::Float,
            Default::default(),
            policy_config(),
            &start(n),
        )
        .unwrap();
        assert_eq!(p.step_count(), 2);
        let got = ask(&mut p, &batch);
        close(&format!("{n} shards: loss"), want.loss, got.loss);
        assert_eq!(got.version, want.version);
        let d = max_diff(&want_w, &p.gathered_model().unwrap().hf_named_tensors());
        assert!(d < 1e-5, "{n} shards: weights differ by {d}");
    }
}

#[test]
fn a_shard_count_the_units_cannot_split_is_refused() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 3).unwrap();
    let huge = 1 << 20;
    let e = ShardedPolicyRole::new(base, train_config(), policy_config(), &start(huge))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("job.policy_shards") && e.contains("at most"),
        "{e}"
    );
}

/// A rank whose thread dies mid-request fails it at once (its group is dropped, so its
/// peers' collectives fail), names the resume, and fails every later request too.
#[test]
fn a_lost_rank_fails_the_request_at_once_with_the_resume_hint() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap();
    let groups = ranks::groups(2, Duration::from_secs(60));
    let trainers: Vec<ShardedTrainer> = groups
        .into_iter()
        .map(|g| {
            let m = base.deep_copy(Device::Cpu, Kind::Float).unwrap();
            ShardedTrainer::new(m, train_config(), Box::new(g)).unwrap()
        })
        .collect();
    let mut r = ranks::Ranks::start("policy", trainers, Duration::from_secs(60)).unwrap();
    let t0 = Instant::now();
    let jobs: Vec<Box<dyn FnOnce(&mut ShardedTrainer) -> bool + Send>> = vec![
        Box::new(|_| panic!("rank 0 lost (this panic is the test's)")),
        Box::new(|tr| tr.gathered_model().is_ok()),
    ];
    let e = r.run("a test", jobs).err().unwrap().to_string();
    assert!(t0.elapsed() < Duration::from_secs(30), "{:?}", t0.elapsed());
    assert!(e.contains("[0]") && e.contains("--resume"), "{e}");
    let again: Vec<Box<dyn FnOnce(&mut ShardedTrainer) -> bool + Send>> =
        vec![Box::new(|_| true), Box::new(|_| true)];
    let e2 = r.run("again", again).err().unwrap().to_string();
    assert!(e2.contains("--resume"), "{e2}");
}

fn scored<R: Role<Request = PolicyRequest, Response = PolicyResponse>>(
    p: &mut R,
    batch: &[Sample],
) -> Vec<Vec<f32>> {
    match p.serve(PolicyRequest::OldLogProbs(batch.to_vec())).unwrap() {
        PolicyResponse::Scored(s) => s.into_iter().map(|s| s.old_logprobs.unwrap()).collect(),
        other => panic!("{other:?}"),
    }
}

/// The ranks score their own parts of the samples, unit by unit, and together give
/// the whole policy's old log-probs (no rank gathers the model for them).
#[test]
fn the_ranks_old_logprobs_are_the_whole_policys() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 33).unwrap();
    let batch = samples(&base);
    let copy = || base.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let mut whole = PolicyRole::new(Trainer::new(copy(), train_config()), policy_config()).unwrap();
    let want = scored(&mut whole, &batch);
    for n in [2, 3] {
        let mut p =
            ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(n)).unwrap();
        let got = scored(&mut p, &batch);
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.len(), w.len(), "sample {i} at {n} shards");
            for (a, b) in g.iter().zip(w) {
                assert!((a - b).abs() < 1e-5, "sample {i} at {n} shards: {a} vs {b}");
            }
        }
    }
}

fn reshard(p: &mut ShardedPolicyRole, shards: u32) -> Result<PolicyResponse, RoleError> {
    p.serve(PolicyRequest::Reshard { shards })
}

/// The live placement's move: a replica of 3 ranks resharded in place to 2 after one
/// update, and back to 3 after the next, takes the unresharded replica's steps (the
/// same loss, version and weights) and keeps answering.
#[test]
fn a_replica_resharded_in_place_takes_the_same_steps() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 41).unwrap();
    let batch = samples(&base);
    let copy = || base.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let mut kept =
        ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(3)).unwrap();
    let mut moved =
        ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(3)).unwrap();
    ask(&mut kept, &batch);
    ask(&mut moved, &batch);
    for (round, to) in [2u32, 3].into_iter().enumerate() {
        let from = moved.shards() as u32;
        assert!(matches!(
            reshard(&mut moved, to).unwrap(),
            PolicyResponse::Resharded { from: f, to: t } if (f, t) == (from, to)
        ));
        assert_eq!(moved.shards(), to as usize);
        let (want, got) = (ask(&mut kept, &batch), ask(&mut moved, &batch));
        close(&format!("round {round}: loss"), want.loss, got.loss);
        close(
            &format!("round {round}: grad_norm"),
            want.grad_norm,
            got.grad_norm,
        );
        assert_eq!(got.version, want.version);
        assert_eq!(got.sharded.as_ref().map(|s| s.shards), Some(to as usize));
    }
    let d = max_diff(
        &kept.gathered_model().unwrap().hf_named_tensors(),
        &moved.gathered_model().unwrap().hf_named_tensors(),
    );
    assert!(d < 1e-5, "weights differ by {d}");
}

/// A reshard the units cannot be split over is refused naming why, and the replica
/// goes on at its old rank count with its state; the whole policy has nothing to
/// reshard.
#[test]
fn a_refused_reshard_keeps_the_ranks_and_their_state() {
    let base = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 43).unwrap();
    let batch = samples(&base);
    let copy = || base.deep_copy(Device::Cpu, Kind::Float).unwrap();
    let mut kept =
        ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(2)).unwrap();
    let mut p = ShardedPolicyRole::new(copy(), train_config(), policy_config(), &start(2)).unwrap();
    ask(&mut kept, &batch);
    ask(&mut p, &batch);
    let e = reshard(&mut p, 1 << 20).err().unwrap().to_string();
    assert!(
        e.contains("at most") && e.contains("the 2 ranks are kept"),
        "{e}"
    );
    assert!(reshard(&mut p, 0).is_err());
    assert_eq!(p.shards(), 2);
    let (want, got) = (ask(&mut kept, &batch), ask(&mut p, &batch));
    close("loss after a refused reshard", want.loss, got.loss);
    let mut whole = PolicyRole::new(Trainer::new(copy(), train_config()), policy_config()).unwrap();
    let e = whole
        .serve(PolicyRequest::Reshard { shards: 2 })
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("no ranks to reshard"), "{e}");
}
