//! The critic sharded over N ranks takes the whole critic's steps: the same value
//! losses, gradient norms and values at 1–3 ranks, across mini-batches and
//! micro-batches; its checkpoint continues at another rank count; and a step's
//! gradient does not depend on how it is split into micro-batches.

use std::time::Duration;

use super::*;
use crate::algo::loss::{LossAgg, ValueLossConfig};
use crate::builtin::policy::ShardedStart;
use crate::sample::tests::sample;
use tch::{Device, Kind, Tensor};
use yatt_engine::{tiny_config, Llama, TrainConfig};

fn train_config() -> TrainConfig {
    TrainConfig {
        lr: 1e-2,
        weight_decay: 0.01,
        max_grad_norm: Some(1.0),
        ..Default::default()
    }
}

fn critic_config(micro_batch_size: usize, agg: LossAgg) -> CriticConfig {
    CriticConfig {
        loss: ValueLossConfig {
            clip: Some(0.2),
            agg,
        },
        micro_batch_size,
        mini_batches: 2,
        pad_id: 0,
    }
}

fn start(shards: usize) -> ShardedStart {
    ShardedStart {
        shards,
        collective: Duration::from_secs(30),
        deadline: Duration::from_secs(60),
    }
}

/// A value model whose head is not zero, so the backbone has a gradient at once.
fn model() -> Llama {
    let mut m = Llama::random(tiny_config(), Device::Cpu, Kind::Float, 11).unwrap();
    m.attach_head("v_head");
    let h = m.config.hidden_size;
    let head = m.head.as_mut().unwrap();
    head.weight = ((Tensor::arange(h, (Kind::Float, Device::Cpu)) * 0.61).cos() * 0.3).view([1, h]);
    m
}

/// 11 samples with long-tail response lengths, old values and returns.
fn samples() -> Vec<Sample> {
    (0..11u64)
        .map(|i| {
            let r = [1usize, 9, 3, 17, 2, 5, 4, 12, 1, 6, 8][i as usize];
            let mut s = sample(i / 3, (i % 3) as u32, r);
            s.prompt_tokens = (0..2 + (i % 4) as i64)
                .map(|t| 3 + (t * 7 + i as i64) % 80)
                .collect();
            s.response_tokens = (0..r as i64)
                .map(|t| 2 + (t * 11 + i as i64 * 5) % 90)
                .collect();
            s.values = Some(
                (0..r)
                    .map(|t| ((t + i as usize) % 5) as f32 * 0.1 - 0.2)
                    .collect(),
            );
            s.returns = Some(
                (0..r)
                    .map(|t| ((t * 3 + i as usize) % 7) as f32 * 0.2 - 0.5)
                    .collect(),
            );
            s
        })
        .collect()
}

fn values_of<R: Role<Request = CriticRequest, Response = CriticResponse>>(
    c: &mut R,
    batch: &[Sample],
) -> Vec<Vec<f32>> {
    match c.serve(CriticRequest::Values(batch.to_vec())).unwrap() {
        CriticResponse::Valued(s) => s.into_iter().map(|s| s.values.unwrap()).collect(),
        other => panic!("{other:?}"),
    }
}

fn train<R: Role<Request = CriticRequest, Response = CriticResponse>>(
    c: &mut R,
    batch: &[Sample],
) -> CriticReport {
    match c.serve(CriticRequest::Train(batch.to_vec())).unwrap() {
        CriticResponse::Trained(r) => r,
        other => panic!("{other:?}"),
    }
}

fn close(what: &str, a: f64, b: f64) {
    assert!(
        (a - b).abs() <= 1e-4 * a.abs().max(b.abs()).max(1e-3),
        "{what}: {a} vs {b}"
    );
}

/// Rows equal within `tol` relative (1e-5 before any step; 1e-4 after a few AdamW
/// steps, which carry the sums' different orders forward, as the weights do).
fn close_rows(what: &str, a: &[Vec<f32>], b: &[Vec<f32>], tol: f32) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len(), "{what}");
        for (p, q) in x.iter().zip(y) {
            assert!(
                (p - q).abs() <= tol * q.abs().max(1.0),
                "{what}: {p} vs {q}"
            );
        }
    }
}

/// Two updates (two mini-batches each), then values: the sharded critic at 1, 2 and 3
/// ranks matches the whole critic.
#[test]
fn a_sharded_critic_takes_the_whole_critics_steps() {
    let batch = samples();
    for agg in [LossAgg::TokenMean, LossAgg::SeqMeanTokenMean] {
        let cfg = critic_config(2, agg);
        let mut whole =
            CriticRole::new(Trainer::new(model(), train_config()), cfg.clone()).unwrap();
        let want_before = values_of(&mut whole, &batch);
        let want: Vec<CriticReport> = (0..2).map(|_| train(&mut whole, &batch)).collect();
        let want_after = values_of(&mut whole, &batch);
        for shards in 1..=3 {
            let mut c =
                ShardedCriticRole::new(model(), train_config(), cfg.clone(), &start(shards))
                    .unwrap();
            assert_eq!(c.shards(), shards);
            let what = format!("{agg:?}, {shards} shards");
            close_rows(
                &format!("{what}: values"),
                &values_of(&mut c, &batch),
                &want_before,
                1e-5,
            );
            for (step, w) in want.iter().enumerate() {
                let got = train(&mut c, &batch);
                close(
                    &format!("{what} step {step}: vf_loss"),
                    got.vf_loss,
                    w.vf_loss,
                );
                close(
                    &format!("{what} step {step}: grad norm"),
                    got.grad_norm,
                    w.grad_norm,
                );
                assert_eq!(got.trained, w.trained);
            }
            close_rows(
                &format!("{what}: trained values"),
                &values_of(&mut c, &batch),
                &want_after,
                1e-4,
            );
        }
    }
}

/// The whole critic's step does not depend on its micro-batch size (each micro-batch
/// weighted by its share of the step's tokens, not 1/n).
#[test]
fn a_critic_step_does_not_depend_on_the_micro_batch_size() {
    let batch = samples();
    let run = |micro: usize| {
        let cfg = critic_config(micro, LossAgg::TokenMean);
        let mut c = CriticRole::new(Trainer::new(model(), train_config()), cfg).unwrap();
        let r = train(&mut c, &batch);
        (r, values_of(&mut c, &batch))
    };
    let (one, v1) = run(11);
    for micro in [1, 3, 4] {
        let (got, v) = run(micro);
        close(
            &format!("micro {micro}: grad norm"),
            got.grad_norm,
            one.grad_norm,
        );
        close(&format!("micro {micro}: vf_loss"), got.vf_loss, one.vf_loss);
        close_rows(&format!("micro {micro}: values"), &v, &v1, 1e-4);
    }
}

/// A sharded critic's checkpoint, written at 3 ranks, continues at 2 (and at 1) with
/// the steps of the critic that never stopped.
#[test]
fn a_sharded_critic_checkpoint_continues_at_another_rank_count() {
    let batch = samples();
    let cfg = critic_config(3, LossAgg::TokenMean);
    let mut whole =
        ShardedCriticRole::new(model(), train_config(), cfg.clone(), &start(3)).unwrap();
    train(&mut whole, &batch);
    let dir = tempfile::tempdir().unwrap();
    let ckpt = dir.path().join("critic");
    assert!(matches!(
        whole
            .serve(CriticRequest::SaveCheckpoint(ckpt.clone()))
            .unwrap(),
        CriticResponse::Saved
    ));
    let want = train(&mut whole, &batch);
    let want_v = values_of(&mut whole, &batch);
    for shards in [2, 1] {
        let mut c =
            ShardedCriticRole::load(&ckpt, Device::Cpu, Kind::Float, cfg.clone(), &start(shards))
                .unwrap();
        let got = train(&mut c, &batch);
        close(
            &format!("{shards} shards: vf_loss"),
            got.vf_loss,
            want.vf_loss,
        );
        close(
            &format!("{shards} shards: grad norm"),
            got.grad_norm,
            want.grad_norm,
        );
        close_rows(
            &format!("{shards} shards: values"),
            &values_of(&mut c, &batch),
            &want_v,
            1e-4,
        );
    }
}

/// Samples without returns are refused, naming the field; a shard count the model
/// cannot be split over is refused, naming the key.
#[test]
fn a_sharded_critic_refuses_what_it_cannot_use() {
    let cfg = critic_config(2, LossAgg::TokenMean);
    let mut c = ShardedCriticRole::new(model(), train_config(), cfg.clone(), &start(2)).unwrap();
    let mut bad = samples();
    bad[3].returns = None;
    let e = c.serve(CriticRequest::Train(bad)).unwrap_err().to_string();
    assert!(e.contains("returns"), "{e}");
    let e = ShardedCriticRole::new(model(), train_config(), cfg, &start(100_000))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("job.critic_shards"), "{e}");
}
