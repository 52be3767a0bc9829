//! Arbitrary bytes as a model directory's `config.json` (`ModelConfig::from_dir`), and
//! what the model builder derives from an accepted config at once: the rotary inverse
//! frequencies and each layer's attention window. Nothing may panic or allocate
//! without bound.
#![no_main]

#[path = "scratch.rs"]
mod scratch;

use libfuzzer_sys::fuzz_target;
use yatt_engine::ModelConfig;

fuzz_target!(|data: &[u8]| {
    let dir = scratch::dir("model_config");
    std::fs::write(dir.join("config.json"), data).expect("writing config.json");
    let Ok(c) = ModelConfig::from_dir(dir) else {
        return;
    };
    assert!(c.hidden_size > 0 && c.num_hidden_layers > 0 && c.vocab_size > 0);
    assert!(c.head_dim > 0 && c.head_dim % 2 == 0);
    assert_eq!(c.num_attention_heads % c.num_key_value_heads, 0);
    assert_eq!(c.rope_inv_freq().len() as i64, c.head_dim / 2);
    for layer in 0..c.num_hidden_layers as usize {
        if let Some(w) = c.window(layer) {
            assert!(w > 0);
        }
    }
});
