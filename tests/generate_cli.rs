//! `yatt generate` end to end, as a real process, on SmolLM2-135M: the imported HF
//! directory and the `.gguf` file give the same tokens, which are the engine's own greedy
//! tokens; prompts from flags or stdin, `--chat`, seeded sampling, and clear errors.

use serde_json::Value;
use std::io::Write;
use std::process::{Command, Output, Stdio};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::{
    ChatMessage, Generator, GeneratorConfig, Llama, Request, SamplingParams, Tokenizer,
};

fn yatt(args: &[&str], stdin: Option<&str>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_yatt"));
    c.arg("generate").args(args);
    c.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = c.spawn().unwrap();
    if let Some(s) = stdin {
        child.stdin.take().unwrap().write_all(s.as_bytes()).unwrap();
    }
    child.wait_with_output().unwrap()
}

fn json_lines(out: &Output) -> Vec<Value> {
    assert!(
        out.status.success(),
        "yatt generate failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

fn ids(v: &Value) -> Vec<i64> {
    v["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_i64().unwrap())
        .collect()
}

/// The engine's greedy tokens and text for `prompt`, in this process.
fn engine_greedy(
    g: &mut Generator,
    tok: &Tokenizer,
    prompt: &str,
    chat: bool,
    n: usize,
) -> (Vec<i64>, String) {
    let ids = if chat {
        tok.encode_chat(&[ChatMessage::new("user", prompt)], true)
            .unwrap()
    } else {
        tok.encode(prompt, true).unwrap()
    };
    let (done, _) = g
        .generate(&[Request {
            id: 0,
            prompt: ids,
            params: SamplingParams::greedy(n),
        }])
        .unwrap();
    let text = tok.decode(&done[0].tokens, true).unwrap();
    (done[0].tokens.clone(), text)
}

#[test]
fn generate_on_a_checkpoint_dir_and_a_gguf() {
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let gguf = yatt_engine::fixtures::smollm2_gguf().unwrap();
    let (d, g) = (dir.to_str().unwrap(), gguf.to_str().unwrap());
    let tok = Tokenizer::from_dir(&dir).unwrap();
    let model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut engine = Generator::new(
        model,
        GeneratorConfig {
            max_batch: 1,
            max_seq_len: 128,
            ..Default::default()
        },
    );
    let prompts = ["The capital of France is", "1, 2, 3, 4,"];
    let flags = ["--greedy", "--max-new-tokens", "12", "--json"];
    let mut args = vec![d, "--prompt", prompts[0], "--prompt", prompts[1]];
    args.extend(flags);
    let from_dir = json_lines(&yatt(&args, None));
    assert_eq!(from_dir.len(), 2);
    for (p, v) in prompts.iter().zip(&from_dir) {
        assert_eq!(v["prompt"], *p);
        let (want, text) = engine_greedy(&mut engine, &tok, p, false, 12);
        assert_eq!(
            ids(v),
            want,
            "{p}: token ids differ from the engine's greedy ones"
        );
        assert_eq!(v["text"], text.as_str());
        assert!(!want.is_empty());
    }
    // The same from the .gguf file (imported on the fly) and from stdin.
    args[0] = g;
    assert_eq!(json_lines(&yatt(&args, None)), from_dir);
    let mut stdin_args = vec![d];
    stdin_args.extend(flags);
    let stdin = format!("{}\n\n{}\n", prompts[0], prompts[1]);
    assert_eq!(json_lines(&yatt(&stdin_args, Some(&stdin))), from_dir);

    // --chat wraps the prompt in the model's template.
    let q = "What is the capital of France?";
    let chat = json_lines(&yatt(
        &[
            d,
            "--chat",
            "--prompt",
            q,
            "--greedy",
            "--max-new-tokens",
            "10",
            "--json",
        ],
        None,
    ));
    assert_eq!(
        ids(&chat[0]),
        engine_greedy(&mut engine, &tok, q, true, 10).0
    );

    // Seeded sampling repeats itself; plain text output is the decoded text.
    let s = [
        d,
        "--prompt",
        prompts[0],
        "--temperature",
        "0.8",
        "--top-p",
        "0.9",
        "--top-k",
        "40",
        "--seed",
        "3",
        "--max-new-tokens",
        "8",
    ];
    let (a, b) = (yatt(&s, None), yatt(&s, None));
    assert!(a.status.success(), "{}", String::from_utf8_lossy(&a.stderr));
    assert_eq!(a.stdout, b.stdout);
    assert!(!String::from_utf8_lossy(&a.stdout).trim().is_empty());
}

#[test]
fn generate_refuses_bad_input_clearly() {
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let d = dir.to_str().unwrap();
    for (args, want) in [
        (
            vec!["/nonexistent/model", "--prompt", "x"],
            "/nonexistent/model: no such file or directory",
        ),
        (vec![d, "--prompt", "x", "--top-p", "2"], "--top-p 2"),
        (vec![d, "--prompt", "x", "--temperature", "0"], "--greedy"),
        (
            vec![d, "--prompt", "x", "--greedy", "--seed", "1"],
            "--seed",
        ),
        (vec![d], "no prompts"),
    ] {
        let out = yatt(&args, if args.len() == 1 { Some("") } else { None });
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains(want),
            "{args:?}: {err}"
        );
    }
}

/// A PEFT LoRA adapter directory (no tokenizer of its own) generates what its base with
/// the adapters folded in generates, and not what the base alone does.
#[test]
fn generate_on_a_lora_adapter_dir() {
    use std::collections::HashMap;
    use yatt_engine::tch::Tensor;
    use yatt_engine::{LoraConfig, LoraTarget};
    let base = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let mut model = Llama::load(&base, Device::Cpu, Kind::Float).unwrap();
    model
        .add_lora(
            LoraConfig {
                rank: 4,
                alpha: 8.0,
                dropout: 0.0,
                targets: vec![LoraTarget::VProj, LoraTarget::DownProj],
            },
            1,
        )
        .unwrap();
    // Trained-looking adapters: B non-zero.
    yatt_engine::tch::manual_seed(2);
    let adapters: HashMap<String, Tensor> = model
        .lora()
        .unwrap()
        .peft_named_tensors()
        .into_iter()
        .map(|(n, t)| {
            let t = if n.ends_with("lora_B.weight") {
                Tensor::randn(t.size(), (Kind::Float, Device::Cpu)) * 0.02
            } else {
                t.copy()
            };
            (n, t)
        })
        .collect();
    model.load_lora_tensors(&adapters).unwrap();
    let dir = tempfile::tempdir().unwrap();
    model
        .save_adapter(dir.path(), base.to_str().unwrap())
        .unwrap();
    assert!(!dir.path().join("tokenizer.json").exists());
    let tok = Tokenizer::from_dir(&base).unwrap();
    let config = GeneratorConfig {
        max_batch: 1,
        max_seq_len: 128,
        ..Default::default()
    };
    let plain = Llama::load(&base, Device::Cpu, Kind::Float).unwrap();
    model.merge_lora();
    let p = "The capital of France is";
    let (want, _) = engine_greedy(
        &mut Generator::new(model, config.clone()),
        &tok,
        p,
        false,
        12,
    );
    let (base_ids, _) = engine_greedy(&mut Generator::new(plain, config), &tok, p, false, 12);
    assert_ne!(want, base_ids, "the adapters should change the answer");
    let out = json_lines(&yatt(
        &[
            dir.path().to_str().unwrap(),
            "--prompt",
            p,
            "--greedy",
            "--max-new-tokens",
            "12",
            "--json",
        ],
        None,
    ));
    assert_eq!(ids(&out[0]), want);
}
