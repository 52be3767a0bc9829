//! Sharded training (ZeRO-3): ranks that each hold a shard of the training state and
//! each train on their part of the global batch take the steps the unsharded trainer
//! takes on the whole batch, at 1, 2 and 4 ranks (threads of this process, exchanging
//! through shared memory); the state each holds is 16Ψ/N plus a few units; what moves
//! is 3·(N−1)/N·Ψ·b per micro-batch; a rank that fails fails the others at once.

use std::thread;
use std::time::{Duration, Instant};
use tch::{Device, Kind, Tensor};
use yatt_engine::fixtures::run_reference;
use yatt_engine::fixtures::sharded::{
    configs, global_tokens, loss, max_rel, micro_batch, model, train_config, train_rank, unsharded,
};
use yatt_engine::{
    merge_sharded_checkpoint, model_layout, moved_bytes_per_micro_batch, test_devices, Llama,
    LocalGroup, ModelConfig, RankState, ShardedStepStats, ShardedTrainer, PREFETCH_DEPTH,
};

/// `world` ranks, rank r training on micro-batches r, r+world, ... of steps `steps`;
/// every rank's statistics, and the gathered weights. Each rank's trainer comes from
/// `start` (a fresh model, or a checkpoint); with `save`, the ranks save at the end.
fn run_ranks(
    world: usize,
    device: Device,
    steps: std::ops::Range<usize>,
    n: usize,
    start: impl Fn(LocalGroup) -> ShardedTrainer,
    save: Option<&std::path::Path>,
) -> (Vec<Vec<ShardedStepStats>>, Vec<(String, Tensor)>) {
    let save = save.map(|p| p.to_path_buf());
    let (stats, mut weights) = run_ranks_then(world, device, steps, n, start, move |mut tr| {
        if let Some(dir) = &save {
            tr.save_sharded(dir, None).unwrap();
        }
        tr.full_weights().unwrap()
    });
    (stats, weights.swap_remove(0))
}

/// `world` ranks built by `start` (all made before any rank starts: `Llama::random`
/// and every step seed libtorch's global RNG) train steps `steps` on their threads,
/// then each ends with `finish`; every rank's statistics and what `finish` gave, in
/// rank order.
fn run_ranks_then<T: Send + 'static>(
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
    job.run(train_rank, start, finish)
}

/// What every rank of a test replica runs: steps `steps` of `n` micro-batches each.
pub(crate) struct RankJob {
    pub(crate) world: usize,
    pub(crate) device: Device,
    pub(crate) steps: std::ops::Range<usize>,
    pub(crate) n: usize,
}

/// How a rank trains its part of `steps` (the fixtures' `train_rank` and
/// `train_critic_rank`).
pub(crate) type TrainRank = fn(
    &mut ShardedTrainer,
    usize,
    usize,
    std::ops::Range<usize>,
    usize,
    Device,
) -> Vec<ShardedStepStats>;

impl RankJob {
    /// The ranks built by `start` (all before any runs) each `train` on their thread,
    /// then end with `finish`; every rank's statistics and what `finish` gave, in
    /// rank order.
    pub(crate) fn run<T: Send + 'static>(
        self,
        train: TrainRank,
        start: impl Fn(LocalGroup) -> ShardedTrainer,
        finish: impl Fn(ShardedTrainer) -> T + Clone + Send + 'static,
    ) -> (Vec<Vec<ShardedStepStats>>, Vec<T>) {
        let RankJob {
            world,
            device,
            steps,
            n,
        } = self;
        let trainers: Vec<ShardedTrainer> = LocalGroup::new(world, Duration::from_secs(120))
            .into_iter()
            .map(start)
            .collect();
        let handles: Vec<_> = trainers
            .into_iter()
            .enumerate()
            .map(|(rank, mut tr)| {
                let (steps, finish) = (steps.clone(), finish.clone());
                thread::spawn(move || {
                    let stats = train(&mut tr, rank, world, steps, n, device);
                    (stats, finish(tr))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).unzip()
    }
}

/// [`run_ranks`] from fresh copies of the test model.
fn sharded(
    config: &ModelConfig,
    device: Device,
    world: usize,
    steps: usize,
    n: usize,
) -> (Vec<Vec<ShardedStepStats>>, Vec<(String, Tensor)>) {
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(model(config, device), train_config(), Box::new(g)).unwrap()
    };
    run_ranks(world, device, 0..steps, n, fresh, None)
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

/// Parity: per-step loss and gradient norm within 1e-4 relative of the unsharded
/// trainer at 1, 2 and 4 ranks, weights after the steps within 1e-4 max relative;
/// with 3 micro-batches over 4 ranks one rank has none and still takes part.
#[test]
fn sharded_steps_match_the_unsharded_trainer() {
    for device in test_devices() {
        for (name, config) in configs() {
            for (world, n) in [(3usize, 3usize), (2, 3), (1, 4), (2, 4), (4, 4), (4, 3)] {
                let steps = 4;
                let (want, want_w) = unsharded(&config, device, steps, n);
                let (got, got_w) = sharded(&config, device, world, steps, n);
                for (step, w) in want.iter().enumerate() {
                    for rank_stats in &got {
                        let g = &rank_stats[step].step;
                        assert_eq!(g.step, w.step);
                        assert!(
                            rel(g.loss, w.loss) < 1e-4,
                            "{name} {device:?} N={world} n={n} step {step}: loss {} vs {}",
                            g.loss,
                            w.loss
                        );
                        assert!(
                            rel(g.grad_norm, w.grad_norm) < 1e-4,
                            "{name} {device:?} N={world} n={n} step {step}: grad norm {} vs {}",
                            g.grad_norm,
                            w.grad_norm
                        );
                    }
                }
                let d = max_rel(&got_w, &want_w);
                assert!(
                    d < 1e-4,
                    "{name} {device:?} N={world}: weights differ by {d:e}"
                );
            }
        }
    }
}

/// HSDP: `replicas` replicas of a model sharded over `shards` ranks each (threads),
/// global rank `i·shards + r` training on micro-batches g, g + R·N, ... of each step.
/// Each replica's loss is scaled by R, as replicas average their gradients. Returns
/// per replica the step statistics of its rank 0, and every replica's weights.
fn hsdp(
    config: &ModelConfig,
    device: Device,
    replicas: usize,
    shards: usize,
    steps: usize,
    n: usize,
) -> (Vec<Vec<ShardedStepStats>>, Vec<Vec<(String, Tensor)>>) {
    let mut across: Vec<Vec<LocalGroup>> = (0..shards)
        .map(|_| LocalGroup::new(replicas, Duration::from_secs(120)))
        .collect();
    let mut trainers = Vec::new();
    for i in 0..replicas {
        for (r, g) in LocalGroup::new(shards, Duration::from_secs(120))
            .into_iter()
            .enumerate()
        {
            let mut tr =
                ShardedTrainer::new(model(config, device), train_config(), Box::new(g)).unwrap();
            tr.join_replicas(Box::new(across[r].remove(0))).unwrap();
            assert_eq!(tr.replicas(), replicas);
            trainers.push((i, r, tr));
        }
    }
    let world = replicas * shards;
    let handles: Vec<_> = trainers
        .into_iter()
        .map(|(i, r, mut tr)| {
            thread::spawn(move || {
                let global = i * shards + r;
                let mut stats = Vec::new();
                for step in 0..steps {
                    let (batches, advs): (Vec<_>, Vec<_>) = (global..n)
                        .step_by(world)
                        .map(|j| micro_batch(step, j, device))
                        .unzip();
                    let g = global_tokens(step, n) / replicas as f64;
                    let s = tr
                        .step_tokens(&batches, 1.0, |j, s| Ok(loss(s, &batches[j], &advs[j], g)))
                        .unwrap();
                    stats.push(s);
                }
                (i, r, stats, tr.full_weights().unwrap())
            })
        })
        .collect();
    let mut stats = vec![Vec::new(); replicas];
    let mut weights: Vec<Vec<(String, Tensor)>> = (0..replicas).map(|_| Vec::new()).collect();
    for h in handles {
        let (i, r, s, w) = h.join().unwrap();
        if r == 0 {
            stats[i] = s;
            weights[i] = w;
        }
    }
    (stats, weights)
}

/// HSDP parity: 2 replicas × 1, 2 shards take the unsharded trainer's steps on the
/// whole batch (gradient norm within 1e-4, the replicas' mean loss too), every replica
/// ends with the same weights bit for bit, within 1e-4 of the unsharded; the averaging
/// moves 2·(R−1)/R of a rank's shards.
#[test]
fn replicas_of_a_sharded_model_take_the_whole_batchs_steps() {
    for device in test_devices() {
        let (name, config) = configs().remove(0);
        for (replicas, shards, n) in [(2usize, 2usize, 4usize), (2, 1, 3), (3, 2, 5)] {
            let steps = 3;
            let (want, want_w) = unsharded(&config, device, steps, n);
            let (got, got_w) = hsdp(&config, device, replicas, shards, steps, n);
            for (step, w) in want.iter().enumerate() {
                let mean_loss =
                    got.iter().map(|s| s[step].step.loss).sum::<f64>() / replicas as f64;
                assert!(
                    rel(mean_loss, w.loss) < 1e-4,
                    "{name} R={replicas} N={shards} step {step}: loss {mean_loss} vs {}",
                    w.loss
                );
                for s in &got {
                    let g = &s[step];
                    assert!(
                        rel(g.step.grad_norm, w.grad_norm) < 1e-4,
                        "{name} R={replicas} N={shards} step {step}: grad norm {} vs {}",
                        g.step.grad_norm,
                        w.grad_norm
                    );
                    assert!(g.comm.replica_bytes > 0);
                }
            }
            for w in &got_w[1..] {
                assert_eq!(max_rel(w, &got_w[0]), 0.0, "replicas differ");
            }
            let d = max_rel(&got_w[0], &want_w);
            assert!(
                d < 1e-4,
                "{name} R={replicas} N={shards}: weights differ by {d:e}"
            );
        }
    }
}

/// Each rank holds 16Ψ/N of state (plus padding) and at most three of the largest unit
/// gathered at once, plus the prefetched ones; it moves what the schedule says, a little under 3·(N−1)/N·Ψ·b
/// per micro-batch.
#[test]
fn a_rank_holds_its_shard_and_moves_three_gathers_worth() {
    let (_, config) = configs().remove(0);
    let layout = model_layout(&config);
    let psi: i64 = layout.iter().map(|u| u.numel).sum();
    let largest = layout.iter().map(|u| u.numel).max().unwrap() as u64 * 4;
    for world in [1usize, 2, 4] {
        let n = 4;
        let (stats, _) = sharded(&config, Device::Cpu, world, 1, n);
        for s in stats.iter().map(|r| &r[0]) {
            let shard: u64 = layout.iter().map(|u| 16 * u.shard_len(world) as u64).sum();
            assert!(shard as f64 <= 16.0 * psi as f64 / world as f64 + 16.0 * layout.len() as f64);
            assert!(s.train_state_bytes >= shard);
            let bound = shard + (3 + PREFETCH_DEPTH as u64) * largest;
            assert!(
                s.train_state_bytes <= bound,
                "N={world}: {} bytes held, bound {bound}",
                s.train_state_bytes,
            );
            let per_micro =
                (s.comm.gathered_bytes + s.comm.reduced_bytes) as f64 / s.micro_batches as f64;
            let exact = moved_bytes_per_micro_batch(&layout, world, 4);
            let issue = 3.0 * (world as f64 - 1.0) / world as f64 * psi as f64 * 4.0;
            assert!(
                (per_micro - exact).abs() < 1.0,
                "N={world}: {per_micro} bytes, want {exact}"
            );
            // A little under the issue's 3·(N−1)/N·Ψ·b: the embeddings and the head are
            // gathered once.
            assert!(
                per_micro <= issue && per_micro >= 0.9 * issue,
                "N={world}: {per_micro} vs {issue}"
            );
        }
    }
}

/// Prefetch changes when the collectives run, not what they compute: with it on and
/// off the ranks take bit-identical steps, and the gather time left exposed is part of
/// the gather time.
#[test]
fn sharded_prefetch_on_and_off_give_the_same_bits() {
    for (name, config) in configs() {
        for (world, n) in [(2usize, 5usize), (3, 4)] {
            let run = |prefetch: bool| {
                let start = |g: LocalGroup| {
                    let mut tr = ShardedTrainer::new(
                        model(&config, Device::Cpu),
                        train_config(),
                        Box::new(g),
                    )
                    .unwrap();
                    tr.prefetch = prefetch;
                    tr
                };
                run_ranks(world, Device::Cpu, 0..3, n, start, None)
            };
            let (on, on_w) = run(true);
            let (off, off_w) = run(false);
            for (rank, (a, b)) in on.iter().zip(&off).enumerate() {
                for (sa, sb) in a.iter().zip(b) {
                    let what = format!("{name} N={world} rank {rank} step {}", sa.step.step);
                    assert_eq!(sa.step, sb.step, "{what}");
                    assert_eq!(sa.comm.gathered_bytes, sb.comm.gathered_bytes, "{what}");
                    assert_eq!(sa.comm.reduced_bytes, sb.comm.reduced_bytes, "{what}");
                    for c in [&sa.comm, &sb.comm] {
                        assert!(c.gather_exposed_s <= c.gather_s, "{what}: {c:?}");
                        assert!(c.reduce_exposed_s <= c.reduce_s, "{what}: {c:?}");
                    }
                }
            }
            for ((n_on, w_on), (n_off, w_off)) in on_w.iter().zip(&off_w) {
                assert_eq!(n_on, n_off);
                assert!(w_on.equal(w_off), "{name} N={world}: `{n_on}` differs");
            }
        }
    }
}

/// A rank whose step fails leaves its group: the others' steps fail at once, naming
/// it, instead of waiting for the deadline.
#[test]
fn a_failing_rank_fails_the_others_within_the_deadline() {
    let (_, config) = configs().remove(0);
    let t0 = Instant::now();
    let models: Vec<Llama> = (0..3).map(|_| model(&config, Device::Cpu)).collect();
    let handles: Vec<_> = LocalGroup::new(3, Duration::from_secs(60))
        .into_iter()
        .zip(models)
        .enumerate()
        .map(|(rank, (group, m))| {
            thread::spawn(move || {
                let mut tr = ShardedTrainer::new(m, train_config(), Box::new(group)).unwrap();
                let (b, _) = micro_batch(0, rank, Device::Cpu);
                tr.step_tokens(&[b], 1.0, |_, s| {
                    if rank == 1 {
                        Err(yatt_engine::EngineError::InvalidArgument(
                            "rank 1's loss failed".into(),
                        ))
                    } else {
                        Ok(s.logprobs.sum(Kind::Float))
                    }
                })
                .map(|_| ())
                .map_err(|e| e.to_string())
            })
        })
        .collect();
    let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    assert!(out[1]
        .as_ref()
        .unwrap_err()
        .contains("rank 1's loss failed"));
    for r in [0, 2] {
        let e = out[r].as_ref().unwrap_err();
        assert!(e.contains("rank 1 left the group"), "rank {r}: {e}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(50),
        "a rank waited for the deadline"
    );
}

/// More shards than the smallest unit has parameters is refused, naming the unit.
#[test]
fn too_many_shards_are_refused_by_unit() {
    let (_, config) = configs().remove(0);
    let world = 65; // the final norm has 64 parameters
    let group = LocalGroup::new(world, Duration::from_secs(5)).remove(0);
    let e = ShardedTrainer::new(model(&config, Device::Cpu), train_config(), Box::new(group))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("65 shards cannot split unit `head` of 64 parameters"),
        "{e}"
    );
}

/// A checkpoint written by 4 ranks resumes on 2, and one by 2 on 4: the next step's
/// loss is within 1e-5 of the uninterrupted run's, and so are the weights.
#[test]
fn sharded_checkpoints_resume_on_another_rank_count() {
    let (_, config) = configs().remove(0);
    let dev = Device::Cpu;
    let n = 4;
    let tmp = tempfile::tempdir().unwrap();
    for (from, to) in [(4usize, 2usize), (2, 4)] {
        let (whole, whole_w) = sharded(&config, dev, from, 3, n);
        let dir = tmp.path().join(format!("ckpt-{from}-{to}"));
        let fresh = |g: LocalGroup| {
            ShardedTrainer::new(model(&config, dev), train_config(), Box::new(g)).unwrap()
        };
        run_ranks(from, dev, 0..2, n, fresh, Some(&dir));
        let resumed = |g: LocalGroup| {
            ShardedTrainer::load_sharded(&dir, dev, Kind::Float, Box::new(g)).unwrap()
        };
        let (next, next_w) = run_ranks(to, dev, 2..3, n, resumed, None);
        let (want, got) = (&whole[0][2].step, &next[0][0].step);
        assert_eq!(got.step, 3);
        assert!(
            rel(got.loss, want.loss) < 1e-5,
            "{from}->{to}: next-step loss {} vs {}",
            got.loss,
            want.loss
        );
        assert!(rel(got.grad_norm, want.grad_norm) < 1e-5);
        let d = max_rel(&next_w, &whole_w);
        assert!(d < 1e-5, "{from}->{to}: weights differ by {d:e} relative");
    }
}

/// `world` ranks built by `start` train steps `steps`, then hand their states over.
fn run_and_hand_over(
    world: usize,
    device: Device,
    steps: std::ops::Range<usize>,
    n: usize,
    start: impl Fn(LocalGroup) -> ShardedTrainer,
) -> (Vec<Vec<ShardedStepStats>>, Vec<RankState>) {
    run_ranks_then(world, device, steps, n, start, |tr| {
        tr.into_rank_state().unwrap()
    })
}

fn resharded(old: &[RankState], g: LocalGroup) -> ShardedTrainer {
    ShardedTrainer::from_rank_states(old, Box::new(g)).unwrap()
}

/// The live placement's reshard: a replica of 4 ranks hands its states over to 3 new
/// ranks in memory after 2 steps, and those to 4 again after the third; each next
/// step's loss and the final weights are the uninterrupted 4-rank run's within 1e-5,
/// and the step count carries over.
#[test]
fn a_running_replica_reshards_in_memory_and_takes_the_same_steps() {
    let (_, config) = configs().remove(0);
    let dev = Device::Cpu;
    let n = 4;
    let (whole, whole_w) = sharded(&config, dev, 4, 4, n);
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(model(&config, dev), train_config(), Box::new(g)).unwrap()
    };
    let (_, four) = run_and_hand_over(4, dev, 0..2, n, fresh);
    assert!(four.iter().all(|s| s.step_count() == 2));
    let (three_stats, three) = run_and_hand_over(3, dev, 2..3, n, |g| resharded(&four, g));
    let (four_stats, four_again) = run_and_hand_over(4, dev, 3..4, n, |g| resharded(&three, g));
    for (got, want) in [
        (&three_stats[0][0].step, &whole[0][2].step),
        (&four_stats[0][0].step, &whole[0][3].step),
    ] {
        assert!(
            rel(got.loss, want.loss) < 1e-5 && rel(got.grad_norm, want.grad_norm) < 1e-5,
            "step {}: loss {} vs {}, grad norm {} vs {}",
            got.step,
            got.loss,
            want.loss,
            got.grad_norm,
            want.grad_norm
        );
    }
    assert_eq!(four_stats[0][0].step.step, 4);
    // The resharded run's weights, gathered by a last replica of 2 ranks.
    let last: Vec<ShardedTrainer> = LocalGroup::new(2, Duration::from_secs(60))
        .into_iter()
        .map(|g| ShardedTrainer::from_rank_states(&four_again, Box::new(g)).unwrap())
        .collect();
    let gathering: Vec<_> = last
        .into_iter()
        .map(|mut tr| thread::spawn(move || tr.full_weights().unwrap()))
        .collect();
    let weights: Vec<_> = gathering.into_iter().map(|h| h.join().unwrap()).collect();
    let d = max_rel(&weights[0], &whole_w);
    assert!(d < 1e-5, "resharded weights differ by {d:e} relative");
}

/// Handing over refuses what cannot be resharded, naming it: no states, a rank
/// missing, and ranks at different steps.
#[test]
fn resharding_refuses_missing_and_mismatched_rank_states() {
    let (_, config) = configs().remove(0);
    let dev = Device::Cpu;
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(model(&config, dev), train_config(), Box::new(g)).unwrap()
    };
    let (_, mut one_step) = run_and_hand_over(2, dev, 0..1, 2, fresh);
    let (_, mut two_steps) = run_and_hand_over(2, dev, 0..2, 2, fresh);
    let refused = |old: &[RankState]| {
        let g = LocalGroup::new(1, Duration::from_secs(10)).remove(0);
        match ShardedTrainer::from_rank_states(old, Box::new(g)) {
            Ok(_) => panic!("resharded what it should refuse"),
            Err(e) => e.to_string(),
        }
    };
    let e = refused(&[]);
    assert!(e.contains("old ranks' states"), "{e}");
    let e = refused(&one_step[..1]);
    assert!(e.contains("all 2 old ranks"), "{e}");
    let mixed = [one_step.remove(0), two_steps.remove(1)];
    let e = refused(&mixed);
    assert!(e.contains("at one step"), "{e}");
}

/// `merge_sharded_checkpoint` writes an HF directory that transformers loads, with
/// logits within 1e-4 of the sharded trainer's weights.
#[test]
fn a_merged_checkpoint_loads_in_transformers_with_the_same_logits() {
    let (_, config) = configs().remove(0);
    let dev = Device::Cpu;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(model(&config, dev), train_config(), Box::new(g)).unwrap()
    };
    let (_, weights) = run_ranks(2, dev, 0..2, 4, fresh, Some(&dir));
    let out = tmp.path().join("merged");
    merge_sharded_checkpoint(&dir, &out).unwrap();
    // The trained weights, installed in a model of their own: what the logits should be.
    let mut want_model = model(&config, dev);
    {
        let mut params = want_model.all_parameters_mut();
        for ((name, p), (wn, w)) in params.iter_mut().zip(&weights) {
            assert_eq!(name, wn);
            tch::no_grad(|| p.copy_(w));
        }
    }
    let merged = Llama::load(&out, dev, Kind::Float).unwrap();
    let prompt: Vec<i64> = (0..12).map(|t| 2 + (t * 7 % 90)).collect();
    let ids = Tensor::from_slice(&prompt).unsqueeze(0);
    let want = tch::no_grad(|| want_model.forward(&ids, None));
    let ours = tch::no_grad(|| merged.forward(&ids, None));
    let scale = want.abs().max().double_value(&[]);
    assert!((&ours - &want).abs().max().double_value(&[]) / scale < 1e-5);
    let logits_file = tmp.path().join("hf-logits.safetensors");
    run_reference(
        "logits",
        &serde_json::json!({"model": out, "prompts": [prompt], "out": logits_file}),
        Some(2),
    )
    .unwrap();
    let hf: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&logits_file)
        .unwrap()
        .into_iter()
        .collect();
    let d = (&hf["logits_0"] - want.squeeze_dim(0))
        .abs()
        .max()
        .double_value(&[]);
    assert!(
        d / scale < 1e-4,
        "transformers' logits differ by {d:e} (scale {scale:e})"
    );
}

/// A checkpoint missing a rank's shard file is refused, naming the file.
#[test]
fn a_sharded_checkpoint_missing_a_shard_names_the_file() {
    let (_, config) = configs().remove(0);
    let dev = Device::Cpu;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let fresh = |g: LocalGroup| {
        ShardedTrainer::new(model(&config, dev), train_config(), Box::new(g)).unwrap()
    };
    run_ranks(2, dev, 0..1, 2, fresh, Some(&dir));
    std::fs::remove_file(dir.join("shard-00001-of-00002.safetensors")).unwrap();
    let g = LocalGroup::new(1, Duration::from_secs(5)).remove(0);
    let e = ShardedTrainer::load_sharded(&dir, dev, Kind::Float, Box::new(g))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("shard-00001-of-00002.safetensors"), "{e}");
}

/// Random weights drawn unit by unit are the same model at every rank count, and the
/// whole model `random_model_by_units` builds.
#[test]
fn unit_by_unit_random_weights_do_not_depend_on_the_rank_count() {
    let (_, config) = configs().remove(1);
    let mut whole = yatt_engine::random_model_by_units(config.clone(), Device::Cpu, Kind::Float, 3);
    let want = whole.parameters();
    for world in [1usize, 3] {
        let trainers: Vec<ShardedTrainer> = LocalGroup::new(world, Duration::from_secs(30))
            .into_iter()
            .map(|g| {
                ShardedTrainer::random(
                    config.clone(),
                    Device::Cpu,
                    Kind::Float,
                    3,
                    train_config(),
                    Box::new(g),
                )
                .unwrap()
            })
            .collect();
        let handles: Vec<_> = trainers
            .into_iter()
            .map(|mut tr| thread::spawn(move || tr.full_weights().unwrap()))
            .collect();
        for h in handles {
            assert_eq!(max_rel(&h.join().unwrap(), &want), 0.0, "N={world}");
        }
    }
}
