//! Parity with HF transformers on the imported SmolLM2 directory.

use serde_json::json;
use yatt_engine::fixtures::{run_reference, smollm2_hf_dir};
use yatt_engine::tch::{Device, Kind, Tensor};
use yatt_engine::{ChatMessage, Llama, Tokenizer};

#[test]
fn logits_match_transformers_f32() {
    let dir = smollm2_hf_dir().unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let prompts: Vec<Vec<i64>> = vec![
        tok.encode("The capital of France is", true).unwrap(),
        tok.encode_chat(
            &[ChatMessage::new(
                "user",
                "Write a haiku about Rust and memory safety.",
            )],
            true,
        )
        .unwrap(),
        tok.encode(
            "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
            true,
        )
        .unwrap(),
        tok.encode("Ünïcödé ✓ 日本語のテキスト 12345", true)
            .unwrap(),
    ];
    let out = std::env::temp_dir().join(format!(
        "yatt-parity-logits-{}.safetensors",
        std::process::id()
    ));
    run_reference(
        "logits",
        &json!({"model": dir, "prompts": prompts, "out": out}),
        Some(2),
    )
    .unwrap();
    let reference: std::collections::HashMap<String, Tensor> = Tensor::read_safetensors(&out)
        .unwrap()
        .into_iter()
        .collect();
    let _ = std::fs::remove_file(&out);
    let model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    for (i, p) in prompts.iter().enumerate() {
        let ids = Tensor::from_slice(p).unsqueeze(0);
        let ours = yatt_engine::tch::no_grad(|| model.forward(&ids, None)).squeeze_dim(0);
        let theirs = &reference[&format!("logits_{i}")];
        let diff = (&ours - theirs).abs().max().double_value(&[]);
        eprintln!("prompt {i} ({} tokens): max |Δlogit| = {diff:.3e}", p.len());
        assert!(
            diff < 1e-3,
            "prompt {i}: max abs logit difference {diff} ≥ 1e-3"
        );
        // Padded batch (left padding + mask) gives the same logits on real tokens.
    }
    // A left-padded batch of two prompts agrees with the unpadded runs.
    let (a, b) = (&prompts[0], &prompts[2]);
    let l = a.len().max(b.len());
    let pad = |p: &Vec<i64>| -> (Vec<i64>, Vec<i64>) {
        let n = l - p.len();
        (
            std::iter::repeat_n(0, n).chain(p.iter().copied()).collect(),
            std::iter::repeat_n(0, n)
                .chain(std::iter::repeat_n(1, p.len()))
                .collect(),
        )
    };
    let (ia, ma) = pad(a);
    let (ib, mb) = pad(b);
    let ids = Tensor::from_slice(&[ia, ib].concat()).view([2, l as i64]);
    let mask = Tensor::from_slice(&[ma, mb].concat()).view([2, l as i64]);
    let lg = yatt_engine::tch::no_grad(|| model.forward(&ids, Some(&mask)));
    let ta = &reference["logits_0"];
    let got = lg.get(0).narrow(0, (l - a.len()) as i64, a.len() as i64);
    let diff = (&got - ta).abs().max().double_value(&[]);
    assert!(diff < 1e-3, "left-padded batch differs by {diff}");
}

#[test]
fn token_ids_match_transformers() {
    let dir = smollm2_hf_dir().unwrap();
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let texts = vec![
        "Hello, world!",
        "  leading and trailing spaces   ",
        "tabs\tand\nnewlines\n\n\nand   multiple    spaces",
        "Numbers: 1234567890 3.14159 -42 1e-5",
        "Ünïcödé: naïve café, Straße, 日本語, 中文, 한국어, العربية, emoji 🦀🚀👍🏽",
        "code: fn main() { println!(\"{}\", x?); } // ok",
        "<|im_start|>user\nspecial tokens inline<|im_end|>",
        "",
        "don't won't it's we'll they've I'm you'd",
        "\u{200b}zero width and \u{00a0}nbsp",
    ];
    let chats = vec![
        vec![ChatMessage::new("user", "What is 2+2?")],
        vec![
            ChatMessage::new("system", "You are terse."),
            ChatMessage::new("user", "Name a prime."),
            ChatMessage::new("assistant", "7"),
            ChatMessage::new("user", "Another?"),
        ],
    ];
    let r = run_reference(
        "tokenize",
        &json!({"model": dir, "texts": texts, "chats": chats}),
        Some(2),
    )
    .unwrap();
    for (i, t) in texts.iter().enumerate() {
        let theirs: Vec<i64> = serde_json::from_value(r["texts"][i].clone()).unwrap();
        let ours = tok.encode(t, true).unwrap();
        assert_eq!(ours, theirs, "token ids differ for {t:?}");
        let dec = tok.decode(&ours, false).unwrap();
        assert_eq!(
            dec,
            r["decoded"][i].as_str().unwrap(),
            "decode differs for {t:?}"
        );
        assert_eq!(&dec, t, "round trip for {t:?}");
    }
    for (i, c) in chats.iter().enumerate() {
        let text = tok.apply_chat_template(c, true).unwrap();
        assert_eq!(
            text,
            r["chats"][i]["text"].as_str().unwrap(),
            "chat template render differs"
        );
        let theirs: Vec<i64> = serde_json::from_value(r["chats"][i]["ids"].clone()).unwrap();
        assert_eq!(tok.encode_chat(c, true).unwrap(), theirs);
    }
}
