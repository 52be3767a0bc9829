//! LoRA adapters: only they train; folding them in (merge, weight sync of adapters or of
//! merged weights, snapshots) computes what the adapted model computes; checkpoints
//! resume exactly; and the files are PEFT's: `peft` loads what yatt writes onto the
//! base with the same logits, and yatt loads what `peft` writes.
//!
//! The `peft` tests need `.venv` (scripts/bootstrap.sh installs peft): without it they
//! fail, never skip.

use serde_json::json;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use yatt_engine::fixtures::arch_ref;
use yatt_engine::tch::{Device, Kind, Tensor};
use yatt_engine::*;

const TOL: f64 = 1e-4;

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn ids() -> Tensor {
    Tensor::from_slice(&[3i64, 9, 4, 7, 1, 5, 8, 2, 6, 3, 3, 1]).view([2, 6])
}

fn lora(rank: i64, targets: &[LoraTarget]) -> LoraConfig {
    LoraConfig {
        rank,
        alpha: 2.0 * rank as f64,
        dropout: 0.0,
        targets: targets.to_vec(),
    }
}

/// A next-token loss that moves every adapter.
fn lm_loss(m: &Llama, ids: &Tensor) -> Tensor {
    let logits = m.forward(ids, None);
    let (b, t, v) = logits.size3().unwrap();
    logits
        .narrow(1, 0, t - 1)
        .reshape([b * (t - 1), v])
        .cross_entropy_for_logits(&ids.narrow(1, 1, t - 1).reshape([b * (t - 1)]))
}

fn train_steps(tr: &mut Trainer, n: usize) {
    let ids = ids();
    for _ in 0..n {
        let loss = lm_loss(&tr.model, &ids);
        tr.backward_micro(loss, 1.0).unwrap();
        tr.apply_gradients().unwrap();
    }
}

fn base() -> Llama {
    Llama::random(tiny_config(), Device::Cpu, Kind::Float, 5).unwrap()
}

fn trainer_with_lora(config: LoraConfig) -> Trainer {
    let mut m = base();
    m.add_lora(config, 11).unwrap();
    let tc = TrainConfig {
        lr: 2e-2,
        ..Default::default()
    };
    Trainer::new(m, tc)
}

#[test]
fn only_the_adapters_train_and_the_base_stays_frozen() {
    let mut plain = base();
    let before = plain.forward(&ids(), None);
    let mut tr = trainer_with_lora(lora(4, &LoraTarget::ALL));
    // B = 0 at initialisation: the adapted model is the base.
    let start = tr.model.forward(&ids(), None);
    assert_eq!(max_diff(&before, &start), 0.0);
    let base_before: Vec<(String, Tensor)> = plain
        .parameters()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    train_steps(&mut tr, 3);
    // The optimizer holds state for the adapters alone.
    let (decay, no_decay) = tr.decay_groups();
    assert!(no_decay.is_empty(), "{no_decay:?}");
    assert_eq!(
        decay.len(),
        2 * 7 * tiny_config().num_hidden_layers as usize
    );
    assert!(decay.iter().all(|n| n.starts_with("lora.")), "{decay:?}");
    // The base did not move by one bit; the adapters did, and so did the output.
    let after: HashMap<String, Tensor> = tr.model.parameters().into_iter().collect();
    for (name, t) in &base_before {
        assert_eq!(
            max_diff(t, &after[name]),
            0.0,
            "base parameter {name} moved"
        );
        assert!(!after[name].requires_grad(), "{name} requires grad");
    }
    assert!(after.keys().any(|n| n.ends_with(".b")));
    for (n, t) in after.iter().filter(|(n, _)| n.ends_with(".b")) {
        assert!(
            t.abs().sum(Kind::Float).double_value(&[]) > 0.0,
            "{n} never trained"
        );
    }
    let trained = tr.model.forward(&ids(), None);
    assert!(max_diff(&before, &trained) > 1e-3);
}

/// The issue's "the base weights stay frozen and can stay in bf16": a bf16 model's
/// adapters train (through the trainer's f32 master copies) while every base weight
/// stays bf16 and unchanged.
#[test]
fn a_bf16_base_stays_bf16_and_frozen_while_its_adapters_train() {
    let mut m = Llama::random(tiny_config(), Device::Cpu, Kind::BFloat16, 5).unwrap();
    let base_before: Vec<(String, Tensor)> = m
        .parameters()
        .into_iter()
        .map(|(n, t)| (n, t.copy()))
        .collect();
    m.add_lora(lora(4, &LoraTarget::ALL), 11).unwrap();
    let mut tr = Trainer::new(
        m,
        TrainConfig {
            lr: 2e-2,
            ..Default::default()
        },
    );
    let first = lm_loss(&tr.model, &ids()).double_value(&[]);
    train_steps(&mut tr, 5);
    let last = lm_loss(&tr.model, &ids()).double_value(&[]);
    assert!(
        last < first - 1e-2,
        "the adapters did not learn: {first} -> {last}"
    );
    let after: HashMap<String, Tensor> = tr.model.parameters().into_iter().collect();
    for (name, t) in &base_before {
        let now = &after[name];
        assert_eq!(now.kind(), Kind::BFloat16, "{name}");
        assert_eq!(max_diff(t, now), 0.0, "base parameter {name} moved");
    }
    let adapters: Vec<_> = after
        .iter()
        .filter(|(n, _)| n.starts_with("lora."))
        .collect();
    assert!(!adapters.is_empty());
    assert!(adapters.iter().all(|(_, t)| t.kind() == Kind::BFloat16));
    assert!(adapters
        .iter()
        .filter(|(n, _)| n.ends_with(".b"))
        .all(|(_, t)| t.abs().sum(Kind::Float).double_value(&[]) > 0.0));
}

#[test]
fn folded_adapters_compute_what_the_adapted_model_computes() {
    // Attention and MLP targets partly adapted: the untargeted parts of the fused
    // matrices must stay as they are.
    let mut tr = trainer_with_lora(lora(
        3,
        &[
            LoraTarget::QProj,
            LoraTarget::VProj,
            LoraTarget::UpProj,
            LoraTarget::DownProj,
        ],
    ));
    train_steps(&mut tr, 3);
    let want = tr.model.forward(&ids(), None);

    // merge_lora, deep_copy and an HF export fold them in.
    let merged = tr.model.deep_copy(Device::Cpu, Kind::Float).unwrap();
    assert!(merged.lora().is_none());
    assert!(max_diff(&want, &merged.forward(&ids(), None)) < 1e-5);
    let mut full = base();
    full.copy_weights_from(
        tr.model
            .merged_hf_named_tensors()
            .iter()
            .map(|(n, t)| (n.as_str(), t)),
    )
    .unwrap();
    assert!(max_diff(&want, &full.forward(&ids(), None)) < 1e-5);
    let mut adopter = base();
    adopter.set_requires_grad(false);
    adopter.adopt_weights(&tr.model.weights_snapshot()).unwrap();
    assert!(max_diff(&want, &adopter.forward(&ids(), None)) < 1e-5);

    // An adapter weight sync into a packed inference model: folded from the base every
    // time, so a second sync replaces the first rather than adding to it.
    let mut rollout = base();
    rollout.set_requires_grad(false);
    rollout.pack_for_inference(8);
    let sync = tr.model.adapter_sync_tensors();
    let n = rollout
        .copy_weights_from(sync.iter().map(|(n, t)| (n.as_str(), t)))
        .unwrap();
    assert_eq!(n, sync.len());
    assert!(max_diff(&want, &rollout.forward(&ids(), None)) < 1e-5);
    train_steps(&mut tr, 2);
    let want2 = tr.model.forward(&ids(), None);
    let sync = tr.model.adapter_sync_tensors();
    rollout
        .copy_weights_from(sync.iter().map(|(n, t)| (n.as_str(), t)))
        .unwrap();
    assert!(max_diff(&want2, &rollout.forward(&ids(), None)) < 1e-5);
    // Adapters are a small fraction of the weights.
    let bytes = |v: &[(String, Tensor)]| v.iter().map(|(_, t)| t.numel() * 4).sum::<usize>();
    assert!(bytes(&sync) * 10 < bytes(&tr.model.merged_hf_named_tensors()));

    let prompts = vec![vec![3i64, 9, 4, 7], vec![1, 5, 8]];
    let reqs: Vec<Request> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| Request {
            id: i as u64,
            prompt: p.clone(),
            params: SamplingParams::greedy(8),
        })
        .collect();
    // The adapted model itself (adapters apart, tch path) ...
    let mut adapted = base();
    adapted
        .add_lora(tr.model.lora().unwrap().config.clone(), 0)
        .unwrap();
    let trained: HashMap<String, Tensor> = tr
        .model
        .lora()
        .unwrap()
        .peft_named_tensors()
        .into_iter()
        .collect();
    adapted.load_lora_tensors(&trained).unwrap();
    assert!(max_diff(&want2, &adapted.forward(&ids(), None)) < 1e-6);
    // ... and the rollout that folded them in (fused decode) generate the same tokens.
    let mut g = Generator::new(adapted, GeneratorConfig::default());
    let (a, _) = g.generate(&reqs).unwrap();
    let mut g2 = Generator::new(rollout, GeneratorConfig::default());
    let (b, _) = g2.generate(&reqs).unwrap();
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.tokens, y.tokens);
    }
}

#[test]
fn a_lora_checkpoint_resumes_exactly() {
    let dir = std::env::temp_dir().join(format!("yatt-lora-ckpt-{}", std::process::id()));
    let mut tr = trainer_with_lora(lora(4, &LoraTarget::ALL));
    train_steps(&mut tr, 2);
    tr.save_checkpoint(&dir, None).unwrap();
    // PEFT's files, and the base beside them (it was built in memory).
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "model.safetensors",
        "optimizer.safetensors",
    ] {
        assert!(dir.join(f).exists(), "{f} missing");
    }
    let mut back = Trainer::load_checkpoint(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(back.model.lora().is_some());
    assert_eq!(back.step_count(), 2);
    train_steps(&mut tr, 2);
    train_steps(&mut back, 2);
    let (a, b) = (
        tr.model.forward(&ids(), None),
        back.model.forward(&ids(), None),
    );
    assert!(
        max_diff(&a, &b) < 1e-6,
        "resumed run diverged by {}",
        max_diff(&a, &b)
    );
    // Loading the directory as a model folds the adapters in.
    tr.save_checkpoint(&dir, None).unwrap();
    let plain = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    assert!(plain.lora().is_none());
    assert!(max_diff(&a, &plain.forward(&ids(), None)) < 1e-5);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn adapter_configs_yatt_cannot_run_are_refused_by_key() {
    let dir = std::env::temp_dir().join(format!("yatt-lora-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = json!({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                      "base_model_name_or_path": "/nowhere"});
    for (key, value, says) in [
        ("use_dora", json!(true), "use_dora"),
        ("peft_type", json!("IA3"), "peft_type"),
        ("target_modules", json!(["q_proj", "lm_head"]), "lm_head"),
        ("r", json!(0), "rank 0"),
        ("rank_pattern", json!({"q_proj": 8}), "rank_pattern"),
    ] {
        let mut v = good.clone();
        v[key] = value;
        std::fs::write(dir.join("adapter_config.json"), v.to_string()).unwrap();
        let e = Llama::load(&dir, Device::Cpu, Kind::Float)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(says) && e.contains("adapter_config.json"),
            "{key}: {e}"
        );
    }
    std::fs::write(dir.join("adapter_config.json"), good.to_string()).unwrap();
    let e = Llama::load(&dir, Device::Cpu, Kind::Float)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nowhere") && e.contains("base_model_name_or_path"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

fn read(path: &Path) -> HashMap<String, Tensor> {
    Tensor::read_safetensors(path)
        .unwrap()
        .into_iter()
        .collect()
}

struct Work(PathBuf);
impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn peft_loads_yatt_adapters_and_yatt_loads_peft_adapters_with_the_same_logits() {
    let work = Work(std::env::temp_dir().join(format!("yatt-lora-peft-{}", std::process::id())));
    std::fs::create_dir_all(&work.0).unwrap();
    let prompts: Vec<Vec<i64>> = vec![
        (0..11).map(|i| (i * 37 + 11) % 128).collect(),
        vec![5, 9, 2],
    ];
    // A transformers-made Qwen2 base (biases too), saved by transformers.
    let base_dir = work.0.join("base");
    let config = json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": false, "bos_token_id": null, "eos_token_id": null,
    });
    arch_ref(
        "make",
        &json!({"model_type": "qwen2", "config": config, "seed": 3, "dir": base_dir,
                "prompts": prompts, "new_tokens": 1, "out": work.0.join("make.safetensors")}),
        &work.0,
    );
    // yatt trains adapters on it and writes them as a checkpoint would.
    let mut m = Llama::load(&base_dir, Device::Cpu, Kind::Float).unwrap();
    m.add_lora(
        lora(
            4,
            &[
                LoraTarget::QProj,
                LoraTarget::KProj,
                LoraTarget::OProj,
                LoraTarget::GateProj,
                LoraTarget::DownProj,
            ],
        ),
        2,
    )
    .unwrap();
    m.lora_mut().unwrap().base_path = Some(base_dir.clone());
    let mut tr = Trainer::new(
        m,
        TrainConfig {
            lr: 3e-2,
            ..Default::default()
        },
    );
    let ids = Tensor::from_slice(&prompts[0]).view([1, -1]);
    for _ in 0..3 {
        let loss = lm_loss(&tr.model, &ids);
        tr.backward_micro(loss, 1.0).unwrap();
        tr.apply_gradients().unwrap();
    }
    let ours = work.0.join("ours");
    tr.save_checkpoint(&ours, None).unwrap();
    assert!(
        !ours.join("model.safetensors").exists(),
        "a known base is not copied"
    );
    let made = work.0.join("made");
    let out = work.0.join("peft.safetensors");
    arch_ref(
        "peft",
        &json!({"base": base_dir, "adapter": ours, "prompts": prompts, "out": out,
                "make": {"dir": made, "r": 3, "alpha": 5, "seed": 4,
                         "targets": ["q_proj", "v_proj", "up_proj", "o_proj"]}}),
        &work.0,
    );
    let reference = read(&out);
    let theirs = Llama::load(&made, Device::Cpu, Kind::Float).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let x = Tensor::from_slice(p).view([1, -1]);
        let ours = tr.model.forward(&x, None).squeeze_dim(0);
        let d = max_diff(&ours, &reference[&format!("logits_{i}")]);
        assert!(
            d < TOL,
            "prompt {i}: peft on yatt's adapter differs by {d:.3e}"
        );
        let moved = max_diff(&ours, &reference[&format!("made_logits_{i}")]);
        assert!(moved > 1e-3, "the two adapters should differ");
        let d = max_diff(
            &theirs.forward(&x, None).squeeze_dim(0),
            &reference[&format!("made_logits_{i}")],
        );
        assert!(
            d < TOL,
            "prompt {i}: yatt on peft's adapter differs by {d:.3e}"
        );
    }
}
