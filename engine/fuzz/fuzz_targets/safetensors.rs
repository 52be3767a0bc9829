//! Arbitrary bytes as a model directory's `model.safetensors`: the loader's read
//! (`read_safetensors_dir`: the safetensors header, then a tensor per entry, any dtype
//! and shape) and yatt's use of what it read (`Llama::from_tensors`: names, shapes,
//! dtype conversions, heads, leftover tensors) against a one-layer model of width 2
//! (tied embeddings, two-token vocabulary). Nothing may panic or abort. CPU only.
#![no_main]

#[path = "scratch.rs"]
mod scratch;

use libfuzzer_sys::fuzz_target;
use std::sync::OnceLock;
use yatt_engine::tch::{Device, Kind};
use yatt_engine::{read_safetensors_dir, Llama, ModelConfig};

fn config() -> ModelConfig {
    static C: OnceLock<ModelConfig> = OnceLock::new();
    C.get_or_init(|| {
        ModelConfig::from_json(&serde_json::json!({
            "model_type": "llama", "hidden_size": 2, "intermediate_size": 1,
            "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1,
            "vocab_size": 2, "tie_word_embeddings": true,
        }))
        .expect("the target's config is valid")
    })
    .clone()
}

fuzz_target!(
    init: {
        // Shapes are tiny: one libtorch thread, and none to spare on a shared machine.
        yatt_engine::tch::set_num_threads(1);
        yatt_engine::tch::set_num_interop_threads(1);
    },
    |data: &[u8]| {
        let dir = scratch::dir("safetensors");
        std::fs::write(dir.join("model.safetensors"), data).expect("writing the input");
        let Ok(tensors) = read_safetensors_dir(dir) else {
            return;
        };
        let _ = Llama::from_tensors(config(), tensors, Device::Cpu, Kind::Float);
    }
);
