//! A sharded model with a scalar head (a PPO critic's value head): ranks that each hold
//! a shard of its training state, each training on its part of the step's batch, take
//! the unsharded trainer's steps; their values are the whole model's; the head goes
//! through a sharded checkpoint and an in-memory reshard.

use crate::sharded::RankJob;
use std::time::Duration;
use tch::{Device, Tensor};
use yatt_engine::fixtures::sharded::{
    configs, critic_model, max_rel, train_config, train_critic_rank, unsharded_critic,
};
use yatt_engine::score::values;
use yatt_engine::{test_devices, LocalGroup, SeqBatch, ShardedStepStats, ShardedTrainer};

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// `world` ranks from `start` train `steps` with the value loss, then `finish`; every
/// rank's statistics and what `finish` gave, in rank order.
fn critic_ranks<T: Send + 'static>(
    world: usize,
    device: Device,
    steps: std::ops::Range<usize>,
    n: usize,
    start: impl Fn(LocalGroup) -> ShardedTrainer,
    finish: impl Fn(ShardedTrainer) -> T + Clone + Send + 'static,
) -> (Vec<Vec<ShardedStepStats>>, Vec<T>) {
    let job = RankJob {
        world,
        device,
        steps,
        n,
    };
    job.run(train_critic_rank, start, finish)
}

/// Parity: per-step value loss and gradient norm within 1e-4 relative of the unsharded
/// trainer at 1 to 4 ranks (one rank with no micro-batch at 4 ranks over 3), weights
/// (the value head's included) within 1e-4; then the ranks' values equal the trained
/// unsharded model's within 1e-5.
#[test]
fn a_sharded_critic_takes_the_unsharded_steps_and_gives_its_values() {
    for device in test_devices() {
        for (name, config) in configs() {
            for (world, n) in [(1usize, 3usize), (2, 3), (4, 3)] {
                let steps = 3;
                let (want, want_w) = unsharded_critic(&config, device, steps, n);
                let fresh = |g: LocalGroup| {
                    let m = critic_model(&config, device);
                    ShardedTrainer::new(m, train_config(), Box::new(g)).unwrap()
                };
                // One row to score after training: rank 0 scores it, the others take
                // part with none.
                let row: Vec<i64> = (0..7).map(|t| 3 + (t * 13) % 80).collect();
                let score = {
                    let row = row.clone();
                    move |mut tr: ShardedTrainer| {
                        let batch = SeqBatch::from_pairs(&[(&row[..2], &row[2..])], 0, device);
                        let mine = match tr.rank().0 {
                            0 => vec![batch.unwrap()],
                            _ => vec![],
                        };
                        let scored = tr.score_values(&mine).unwrap();
                        (tr.full_weights().unwrap(), scored)
                    }
                };
                let (got, finished) = critic_ranks(world, device, 0..steps, n, fresh, score);
                for (step, w) in want.iter().enumerate() {
                    for rank_stats in &got {
                        let g = &rank_stats[step].step;
                        assert!(
                            rel(g.loss, w.loss) < 1e-4,
                            "{name} {device:?} N={world} step {step}: loss {} vs {}",
                            g.loss,
                            w.loss
                        );
                        assert!(
                            rel(g.grad_norm, w.grad_norm) < 1e-4,
                            "{name} {device:?} N={world} step {step}: grad norm {} vs {}",
                            g.grad_norm,
                            w.grad_norm
                        );
                    }
                }
                let (got_w, scored) = &finished[0];
                assert!(got_w.iter().any(|(k, _)| k == "v_head.weight"));
                let d = max_rel(got_w, &want_w);
                assert!(
                    d < 1e-4,
                    "{name} {device:?} N={world}: weights differ by {d:e}"
                );
                // The trained weights, whole, give the same values.
                let mut whole = critic_model(&config, device);
                for (k, p) in whole.all_parameters_mut() {
                    let (_, t) = want_w.iter().find(|(n, _)| *n == k).unwrap();
                    *p = t.copy();
                }
                let batch = SeqBatch::from_pairs(&[(&row[..2], &row[2..])], 0, device).unwrap();
                let want_v = tch::no_grad(|| values(&whole, &batch)).unwrap();
                let diff = (&scored[0] - &want_v).abs().max().double_value(&[]);
                assert!(diff < 1e-5, "{name} N={world}: values differ by {diff}");
                for (_, s) in &finished[1..] {
                    assert!(s.is_empty());
                }
            }
        }
    }
}

/// A language model has no values to score or train on.
#[test]
fn a_sharded_language_model_refuses_values() {
    let (_, config) = configs().remove(0);
    let g = LocalGroup::new(1, Duration::from_secs(10)).remove(0);
    let m = yatt_engine::fixtures::sharded::model(&config, Device::Cpu);
    let mut tr = ShardedTrainer::new(m, train_config(), Box::new(g)).unwrap();
    let e = tr.score_values(&[]).unwrap_err().to_string();
    assert!(e.contains("no scalar head"), "{e}");
    let e = tr
        .step_values(&[], |_, v: &Tensor| Ok(v.sum(tch::Kind::Float)))
        .unwrap_err();
    assert!(e.to_string().contains("no scalar head"), "{e}");
}

/// The value head survives a sharded checkpoint written at 2 ranks and resumed at 3,
/// and an in-memory reshard from 3 ranks to 1: the next steps are the uninterrupted
/// run's.
#[test]
fn a_sharded_critic_resumes_and_reshards_with_its_head() {
    let (_, config) = configs().remove(0);
    let device = Device::Cpu;
    let n = 3;
    let (want, want_w) = unsharded_critic(&config, device, 4, n);
    let dir = tempfile::tempdir().unwrap();
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(critic_model(&config, device), train_config(), Box::new(g)).unwrap()
    };
    let path = dir.path().join("ckpt");
    let save = {
        let path = path.clone();
        move |mut tr: ShardedTrainer| tr.save_sharded(&path, None).unwrap()
    };
    critic_ranks(2, device, 0..2, n, fresh, save);
    let load = |g: LocalGroup| {
        ShardedTrainer::load_sharded(&path, device, tch::Kind::Float, Box::new(g)).unwrap()
    };
    let (got, states) = critic_ranks(3, device, 2..3, n, load, |tr| tr.into_rank_state().unwrap());
    assert!(rel(got[0][0].step.loss, want[2].loss) < 1e-4);
    let resharded = |g: LocalGroup| ShardedTrainer::from_rank_states(&states, Box::new(g)).unwrap();
    let (got, weights) = critic_ranks(1, device, 3..4, n, resharded, |mut tr| {
        tr.full_weights().unwrap()
    });
    assert!(
        rel(got[0][0].step.grad_norm, want[3].grad_norm) < 1e-4,
        "{} vs {}",
        got[0][0].step.grad_norm,
        want[3].grad_norm
    );
    let d = max_rel(&weights[0], &want_w);
    assert!(d < 1e-4, "weights differ by {d:e}");
}
