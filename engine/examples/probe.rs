//! Times the pieces of one generation on the real SmolLM2 model: a decode step (whole,
//! its GEMMs alone, the LM head, sampling) and a prefill. Best of several repeats, so it
//! stays readable on a shared machine.
//!
//! `cargo run --release -p yatt-engine --example probe -- [batch] [threads] [span]`

use std::time::Instant;
use yatt_engine::bench::kernels::{self, RowParams};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

fn best<F: FnMut()>(name: &str, n: usize, mut f: F) -> f64 {
    f();
    let mut b = f64::MAX;
    for _ in 0..n {
        let t = Instant::now();
        f();
        b = b.min(t.elapsed().as_secs_f64());
    }
    eprintln!("{name}: {:.3} ms", b * 1e3);
    b
}

fn arg(i: usize, d: i64) -> i64 {
    std::env::args()
        .nth(i)
        .map(|s| s.parse().unwrap())
        .unwrap_or(d)
}

fn main() {
    let b = arg(1, 16);
    tch::set_num_threads(arg(2, 2) as i32);
    let span = arg(3, 80);
    let reps = arg(4, 10) as usize;
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut g = Generator::new(model, GeneratorConfig::default());
    let model = g.model_mut();
    eprintln!("packed {}", model.pack_for_inference(b));
    let model = &*model;
    let c = model.config.clone();
    let mut cache = KvCache::new(model, b, 400);
    let ids = Tensor::randint(1000, [b, 1], (Kind::Int64, Device::Cpu));
    let pos = Tensor::full([b, 1], span - 1, (Kind::Int64, Device::Cpu));
    tch::no_grad(|| {
        let mut decode = || {
            let attn = Attn::Decode {
                cache: &mut cache,
                span,
                table: None,
            };
            let _ = model.logits(&model.hidden(&ids, &pos, attn).squeeze_dim(1));
        };
        if std::env::var("PROBE_DECODE_ONLY").is_ok() {
            // For `perf record`: nothing but decode steps.
            (0..reps).for_each(|_| decode());
            return;
        }
        let step = best("decode step (hidden + logits)", reps, decode);
        let x = Tensor::randn([b, c.hidden_size], (Kind::Float, Device::Cpu));
        let xf = Tensor::randn([b, c.intermediate_size], (Kind::Float, Device::Cpu));
        let pk = |w: &Tensor| (kernels::pack(&w.tr(), b.max(512)).unwrap(), w.size()[1]);
        let packed: Vec<_> = model
            .layers
            .iter()
            .map(|l| [pk(&l.wqkv), pk(&l.wo), pk(&l.w_gate_up), pk(&l.w_down)])
            .collect();
        let gemm = best("decode GEMMs alone (30 layers)", reps, || {
            for l in &packed {
                for (i, (p, out)) in l.iter().enumerate() {
                    let xin = if i == 3 { &xf } else { &x };
                    let _ = kernels::linear(xin, p, None, *out).unwrap();
                }
            }
        });
        let head = best("LM head", reps, || {
            let _ = model.logits(&x);
        });
        eprintln!(
            "  → non-GEMM part of a decode step: {:.3} ms",
            (step - gemm - head) * 1e3
        );
        let lg = model.logits(&x);
        let rp = RowParams {
            temperature: vec![1.0; b as usize],
            top_k: vec![50; b as usize],
            top_p: vec![1.0; b as usize],
            uniform: vec![0.5; b as usize],
        };
        best("sample (top-k 50)", reps, || {
            let _ = kernels::sample(&lg, &rp);
        });
        let plen = 40;
        let pids = Tensor::randint(1000, [b, plen], (Kind::Int64, Device::Cpu));
        let ppos = Tensor::arange(plen, (Kind::Int64, Device::Cpu))
            .unsqueeze(0)
            .expand([b, plen], true);
        let pre = best(&format!("prefill {b}×{plen}"), reps.min(3), || {
            let _ = model.hidden(
                &pids,
                &ppos,
                Attn::Prefill {
                    cache: &mut cache,
                    start: 0,
                    offset: 0,
                    lens: None,
                },
            );
        });
        let per_token: i64 = model.layers[0..1]
            .iter()
            .map(|l| l.wqkv.numel() + l.wo.numel() + l.w_gate_up.numel() + l.w_down.numel())
            .map(|n| n as i64)
            .sum::<i64>()
            * c.num_hidden_layers;
        let fl = 2.0 * (b * plen) as f64 * per_token as f64;
        eprintln!("  → {:.0} GFLOP/s in the prefill", fl / pre / 1e9);
    });
}
