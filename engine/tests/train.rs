//! Scoring, heads, training steps, buckets, offload and checkpoints (tiny random model,
//! plus transformers loading a checkpoint).

use serde_json::json;
use yatt_engine::fixtures::run_reference;
use yatt_engine::score::{rewards, token_logprobs, values};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

fn tiny(seed: i64) -> Llama {
    tiny_on(Device::Cpu, seed)
}

fn tiny_on(dev: Device, seed: i64) -> Llama {
    tch::set_num_threads(2);
    Llama::random(tiny_config(), dev, Kind::Float, seed).unwrap()
}

fn pairs() -> Vec<(Vec<i64>, Vec<i64>)> {
    vec![
        (vec![0, 5, 6, 7], vec![8, 9, 10, 11, 12]),
        (vec![0, 20, 21], vec![22, 23]),
        (vec![0, 30, 31, 32, 33, 34], vec![35, 36, 37]),
        (vec![0, 40], vec![41, 42, 43, 44, 45, 46]),
    ]
}

fn batch(p: &[(Vec<i64>, Vec<i64>)]) -> SeqBatch {
    batch_on(Device::Cpu, p)
}

fn batch_on(dev: Device, p: &[(Vec<i64>, Vec<i64>)]) -> SeqBatch {
    let refs: Vec<(&[i64], &[i64])> = p
        .iter()
        .map(|(a, b)| (a.as_slice(), b.as_slice()))
        .collect();
    SeqBatch::from_pairs(&refs, 1, dev).unwrap()
}

/// Policy-gradient-like loss: mean negative log-prob of response tokens.
fn nll(model: &Llama, b: &SeqBatch) -> Result<Tensor> {
    let s = token_logprobs(model, b, 1.0, false);
    let m = b.response_mask.to_kind(Kind::Float);
    Ok(-(s.logprobs * &m).sum(Kind::Float) / m.sum(Kind::Float))
}

fn params_equal(a: &mut Llama, b: &mut Llama) -> bool {
    a.parameters()
        .iter()
        .zip(b.parameters().iter())
        .all(|((n1, x), (n2, y))| n1 == n2 && x.equal(y))
}

#[test]
fn scores_match_generation_logprobs_and_padding() {
    yatt_engine::test_device!(|dev| {
        let model = tiny_on(dev, 1);
        let mut g = Generator::new(
            model,
            GeneratorConfig {
                max_batch: 2,
                max_seq_len: 64,
                ..Default::default()
            },
        );
        let reqs: Vec<Request> = (0..3)
            .map(|i| Request {
                id: i,
                prompt: vec![0, 3 + i as i64, 4, 5],
                params: SamplingParams {
                    temperature: 0.8,
                    max_new_tokens: 10,
                    ignore_eos: true,
                    seed: i,
                    ..Default::default()
                },
            })
            .collect();
        let (outs, _) = g.generate(&reqs).unwrap();
        let model = tiny_on(dev, 1);
        let p: Vec<(Vec<i64>, Vec<i64>)> = reqs
            .iter()
            .zip(&outs)
            .map(|(r, c)| (r.prompt.clone(), c.tokens.clone()))
            .collect();
        let b = batch_on(dev, &p);
        let s = tch::no_grad(|| token_logprobs(&model, &b, 0.8, true));
        for (i, c) in outs.iter().enumerate() {
            let pl = reqs[i].prompt.len() as i64;
            let ours = s
                .logprobs
                .get(i as i64)
                .narrow(0, pl, c.tokens.len() as i64);
            let gen = Tensor::from_slice(&c.logprobs).to_device(dev);
            let d = (ours - gen).abs().max().double_value(&[]);
            assert!(
                d < 1e-4,
                "row {i}: generation and scoring log-probs differ by {d}"
            );
        }
        // Padding does not change a row's scores; masked positions are zero.
        let alone = tch::no_grad(|| token_logprobs(&model, &batch_on(dev, &p[1..2]), 0.8, true));
        let n = (p[1].0.len() + p[1].1.len()) as i64;
        let d = (alone.logprobs.get(0) - s.logprobs.get(1).narrow(0, 0, n))
            .abs()
            .max()
            .double_value(&[]);
        assert!(d < 1e-5, "{d}");
        assert_eq!(
            s.logprobs
                .get(1)
                .narrow(0, n, s.logprobs.size()[1] - n)
                .abs()
                .sum(Kind::Float)
                .double_value(&[]),
            0.0
        );
        let ent = s.entropy.get(0).get(3).double_value(&[]);
        assert!(ent > 0.0 && ent <= (97f64).ln() + 1e-4, "entropy {ent}");
    });
}

#[test]
fn training_reduces_loss_and_accumulation_matches_full_batch() {
    yatt_engine::test_device!(|dev| {
        let p = pairs();
        let full = batch_on(dev, &p);
        let cfg = TrainConfig {
            lr: 3e-3,
            weight_decay: 0.0,
            max_grad_norm: None,
            ..Default::default()
        };
        // Full batch vs two micro-batches of two (equal token counts are not needed: rows 0+1 and 2+3
        // both hold 7 response tokens... use per-row-mean loss to make them comparable).
        let row_mean = |model: &Llama, b: &SeqBatch| -> Result<Tensor> {
            let s = token_logprobs(model, b, 1.0, false);
            let m = b.response_mask.to_kind(Kind::Float);
            let per_row = (s.logprobs * &m).sum_dim_intlist(1, false, Kind::Float)
                / m.sum_dim_intlist(1, false, Kind::Float);
            Ok(-per_row.mean(Kind::Float))
        };
        let mut a = Trainer::new(tiny_on(dev, 2), cfg.clone());
        let mut b = Trainer::new(tiny_on(dev, 2), cfg.clone());
        a.step(&[full], row_mean).unwrap();
        b.step(
            &[batch_on(dev, &p[0..2]), batch_on(dev, &p[2..4])],
            row_mean,
        )
        .unwrap();
        for ((n, x), (_, y)) in a.model.parameters().iter().zip(b.model.parameters().iter()) {
            let d = (x - y).abs().max().double_value(&[]);
            assert!(d < 1e-6, "{n}: accumulation differs by {d}");
        }
        let mut losses = vec![];
        for _ in 0..8 {
            losses.push(a.step(&[batch_on(dev, &p)], nll).unwrap().loss);
        }
        assert!(
            losses[7] < losses[0] * 0.9,
            "loss did not go down: {losses:?}"
        );
    });
}

#[test]
fn decay_groups_clipping_and_schedule() {
    let cfg = TrainConfig {
        lr: 1e-2,
        weight_decay: 0.5,
        max_grad_norm: Some(0.01),
        schedule: LrSchedule::Cosine {
            warmup_steps: 2,
            total_steps: 10,
            min_ratio: 0.0,
        },
        ..Default::default()
    };
    let mut t = Trainer::new(tiny(3), cfg);
    let (decay, no_decay) = t.decay_groups();
    assert!(decay.iter().any(|n| n.ends_with("wqkv")) && decay.contains(&"embed".to_string()));
    assert!(no_decay.contains(&"norm".to_string()) && no_decay.iter().any(|n| n.ends_with("ln1")));
    let before: Vec<(String, Tensor)> = t
        .model
        .parameters()
        .into_iter()
        .map(|(n, x)| (n, x.detach().copy()))
        .collect();
    // A zero loss (zero gradients everywhere): only weight decay moves the parameters.
    let p = pairs();
    let s = t.step(&[batch(&p)], |m, b| Ok(nll(m, b)? * 0.0)).unwrap();
    assert_eq!(s.lr, 1e-2 * 0.5, "warm-up halves the first LR");
    for ((n, old), (_, new)) in before.iter().zip(t.model.parameters().iter()) {
        if no_decay.contains(n) {
            assert!(old.equal(new), "{n} must not decay");
        } else {
            let want = old * (1.0 - 0.5e-2 * 0.5);
            assert!(
                (new - want).abs().max().double_value(&[]) < 1e-7,
                "{n} decays"
            );
        }
    }
    let s = t.step(&[batch(&p)], nll).unwrap();
    assert!(
        s.grad_norm > 0.01,
        "the test wants clipping to engage: {}",
        s.grad_norm
    );
}

#[test]
fn exact_resume_from_checkpoint() {
    let p = pairs();
    let cfg = TrainConfig {
        lr: 1e-3,
        schedule: LrSchedule::Cosine {
            warmup_steps: 1,
            total_steps: 4,
            min_ratio: 0.1,
        },
        ..Default::default()
    };
    let mut straight = Trainer::new(tiny(4), cfg.clone());
    for _ in 0..4 {
        straight
            .step(&[batch(&p[0..2]), batch(&p[2..4])], nll)
            .unwrap();
    }
    let dir = std::env::temp_dir().join(format!("yatt-ckpt-{}", std::process::id()));
    let mut first = Trainer::new(tiny(4), cfg);
    for _ in 0..2 {
        first
            .step(&[batch(&p[0..2]), batch(&p[2..4])], nll)
            .unwrap();
    }
    first.save_checkpoint(&dir, None).unwrap();
    drop(first);
    let mut resumed = Trainer::load_checkpoint(&dir, Device::Cpu, Kind::Float).unwrap();
    assert_eq!(resumed.step_count(), 2);
    for _ in 0..2 {
        resumed
            .step(&[batch(&p[0..2]), batch(&p[2..4])], nll)
            .unwrap();
    }
    assert!(
        params_equal(&mut straight.model, &mut resumed.model),
        "resumed training must be bit-identical"
    );
    // transformers loads the checkpoint and agrees on logits.
    let prompt: Vec<i64> = vec![0, 5, 6, 7, 8, 9];
    let r = run_reference("load", &json!({"model": dir, "prompt": prompt}), Some(2)).unwrap();
    let ours = tch::no_grad(|| {
        Trainer::load_checkpoint(&dir, Device::Cpu, Kind::Float)
            .unwrap()
            .model
            .forward(&Tensor::from_slice(&prompt).unsqueeze(0), None)
    });
    let last = ours.get(0).get(5);
    for (i, v) in r["last_logits_head"].as_array().unwrap().iter().enumerate() {
        let d = (last.get(i as i64).double_value(&[]) - v.as_f64().unwrap()).abs();
        assert!(d < 1e-4, "logit {i} differs by {d}");
    }
    assert_eq!(
        r["argmax"].as_i64().unwrap(),
        last.argmax(0, false).int64_value(&[])
    );
    let _ = std::fs::remove_dir_all(&dir);
    let e = Trainer::load_checkpoint(
        std::env::temp_dir().join("yatt-no-such-ckpt"),
        Device::Cpu,
        Kind::Float,
    )
    .err()
    .unwrap();
    assert!(e.to_string().contains("trainer_state.json"), "{e}");
}

#[test]
fn offload_reload_buckets_reference_and_heads() {
    yatt_engine::test_device!(|dev| {
        let p = pairs();
        let mut t = Trainer::new(tiny_on(dev, 5), TrainConfig::default());
        t.step(&[batch_on(dev, &p)], nll).unwrap();
        let reference = t.model.deep_copy(dev, Kind::Float).unwrap();
        let snapshot: Vec<Tensor> = t
            .model
            .parameters()
            .into_iter()
            .map(|(_, x)| x.detach().copy())
            .collect();
        let full = t.resident_bytes();
        t.offload().unwrap();
        assert!(t.is_offloaded());
        assert_eq!(
            t.resident_bytes(),
            0,
            "offload must drop every parameter and optimizer tensor"
        );
        assert!(t.step(&[batch_on(dev, &p)], nll).is_err());
        t.reload().unwrap();
        assert!(
            t.resident_bytes() >= full - t.model.num_parameters() as usize * 4,
            "reload restores the state (grads dropped)"
        );
        for (x, y) in t.model.parameters().iter().zip(&snapshot) {
            assert!(x.1.equal(y));
        }
        t.step(&[batch_on(dev, &p)], nll).unwrap();
        // The frozen reference did not move and does not require grad.
        let mut reference = reference;
        for ((_, r), s) in reference.parameters().iter().zip(&snapshot) {
            assert!(r.equal(s));
            assert!(!r.requires_grad());
        }
        // Weight sync: trainer → buckets → a generator's model, in place.
        let buckets = to_buckets(&t.model.hf_named_tensors(), 64 << 10).unwrap();
        assert!(buckets.len() > 1);
        let mut gen = Generator::new(
            tiny_on(dev, 99),
            GeneratorConfig {
                max_batch: 2,
                max_seq_len: 32,
                ..Default::default()
            },
        );
        for b in &buckets {
            let header = b.encode_header();
            let wire = WeightBucket {
                entries: WeightBucket::decode_header(&header).unwrap(),
                data: b.data.clone(),
            };
            let ts = wire.tensors(dev).unwrap();
            gen.update_weights(ts.iter().map(|(n, x)| (n.as_str(), x)))
                .unwrap();
        }
        let ids = Tensor::from_slice(&[0i64, 5, 6, 7])
            .unsqueeze(0)
            .to_device(dev);
        // The weights arrive bit for bit; the forward passes agree to rounding (the
        // generator's packed kernels sum in another order than the trainer's matmuls
        // on some CPUs).
        let theirs = gen.model().hf_named_tensors();
        for (name, mine) in t.model.hf_named_tensors() {
            let (_, got) = theirs.iter().find(|(n, _)| *n == name).unwrap();
            assert!(mine.equal(got), "{name} differs after the weight sync");
        }
        let a = tch::no_grad(|| t.model.forward(&ids, None));
        let b = tch::no_grad(|| gen.model().forward(&ids, None));
        let diff = (a - b).abs().max().double_value(&[]);
        assert!(diff < 1e-5, "forward passes differ by {diff}");
        // Gradient buckets round trip.
        nll(&t.model, &batch_on(dev, &p)).unwrap().backward();
        let gb = t.grad_buckets(1 << 20).unwrap();
        t.set_grads(&gb).unwrap();
        // The flat buffer an all-reduce averages: every parameter's gradient in order;
        // written back (here halved) it is what the buckets then carry.
        let flat = t.flat_grads().unwrap();
        let numel: usize = t
            .model
            .parameters_mut()
            .iter()
            .map(|(_, p)| p.numel())
            .sum();
        assert_eq!(flat.len(), numel);
        assert!(flat.iter().any(|&g| g != 0.0));
        let half: Vec<f32> = flat.iter().map(|g| g * 0.5).collect();
        t.set_flat_grads(&half).unwrap();
        assert_eq!(t.flat_grads().unwrap(), half);
        let e = t.set_flat_grads(&half[1..]).unwrap_err().to_string();
        assert!(e.contains("gradient values for"), "{e}");
        t.set_grads(&gb).unwrap();
        assert_eq!(t.flat_grads().unwrap(), flat);
        // Regression: a replica that has run no backward pass yet (its whole shard had zero
        // advantage) takes all-reduced gradients too; materialising its gradient tensors
        // used to run a backward inside `no_grad` and fail.
        let mut fresh = Trainer::new(tiny_on(dev, 12), TrainConfig::default());
        fresh.set_grads(&gb).unwrap();
        let want = gb[0].tensors(dev).unwrap();
        let (name, g) = &want[0];
        let got = fresh
            .grad_buckets(1 << 20)
            .unwrap()
            .iter()
            .flat_map(|b| b.tensors(dev).unwrap())
            .find(|(n, _)| n == name)
            .unwrap()
            .1;
        assert!(
            got.equal(g),
            "`{name}` did not take the all-reduced gradient"
        );
        fresh.apply_gradients().unwrap();
        // The same through the flat buffer of the ring all-reduce.
        let mut fresh = Trainer::new(tiny_on(dev, 12), TrainConfig::default());
        let flat = t.flat_grads().unwrap();
        fresh.set_flat_grads(&flat).unwrap();
        assert_eq!(fresh.flat_grads().unwrap(), flat);
        // Heads.
        let mut critic = tiny_on(dev, 6);
        critic.attach_head("v_head");
        let b = batch_on(dev, &p);
        let v = values(&critic, &b).unwrap();
        assert_eq!(v.size(), b.ids.size());
        let mut rm = tiny_on(dev, 7);
        rm.attach_head("score");
        let r = rewards(&rm, &b).unwrap();
        assert_eq!(r.size(), vec![4]);
        let mut tr = Trainer::new(
            critic,
            TrainConfig {
                lr: 1e-2,
                ..Default::default()
            },
        );
        let s = tr
            .step(&[b], |m, b| {
                Ok((values(m, b)? - 1.0).square().mean(Kind::Float))
            })
            .unwrap();
        assert!(s.grad_norm > 0.0);
        assert!(
            tr.model
                .head
                .as_ref()
                .unwrap()
                .weight
                .abs()
                .sum(Kind::Float)
                .double_value(&[])
                > 0.0,
            "the value head trains"
        );
        let e = values(&tiny_on(dev, 8), &batch_on(dev, &p)).unwrap_err();
        assert!(e.to_string().contains("attach_head"));
    });
}

/// Regression: a checkpoint whose config.json names fewer layers than its weights hold
/// loaded as the smaller model and dropped the rest without a word (a deepened tiny
/// model's checkpoints came back with 2 layers and broke the gradient all-reduce).
#[test]
fn a_checkpoint_with_tensors_its_config_does_not_name_is_refused() {
    let model = tiny(3);
    let dir = std::env::temp_dir().join(format!("yatt-extra-tensors-{}", std::process::id()));
    yatt_engine::save_pretrained(&model, &dir, None).unwrap();
    Llama::load(&dir, Device::Cpu, Kind::Float).expect("a consistent checkpoint loads");
    let path = dir.join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config["num_hidden_layers"] = json!(1);
    std::fs::write(&path, config.to_string()).unwrap();
    let e = Llama::load(&dir, Device::Cpu, Kind::Float)
        .err()
        .expect("extra layers are refused")
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        e.contains("model.layers.1.") && e.contains("num_hidden_layers") && e.contains("1 layers"),
        "{e}"
    );
}
