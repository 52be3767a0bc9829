use std::time::Instant;
use yatt_engine::model::{Attn, KvCache};
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;
fn time<F: FnMut()>(name: &str, n: usize, mut f: F) {
    f();
    let t = Instant::now();
    for _ in 0..n {
        f();
    }
    eprintln!(
        "{name}: {:.2} ms",
        t.elapsed().as_secs_f64() * 1000.0 / n as f64
    );
}
fn main() {
    tch::set_num_threads(
        std::env::args()
            .nth(2)
            .map(|s| s.parse().unwrap())
            .unwrap_or(2),
    );
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let mut model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let b: i64 = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(16);
    if std::env::var("PACK").is_ok() {
        eprintln!("packed {}", model.pack_for_inference(b));
    }
    let mut cache = KvCache::new(&model, b, 160);
    let ids = Tensor::randint(1000, [b, 1], (Kind::Int64, Device::Cpu));
    let pos = Tensor::full([b, 1], 100, (Kind::Int64, Device::Cpu));
    let a = Tensor::randn([b, 576], (Kind::Float, Device::Cpu));
    let w = Tensor::randn([2304, 576], (Kind::Float, Device::Cpu));
    time("gemm 16x576x2304 (linear)", 50, || {
        let _ = a.linear(&w, None::<Tensor>);
    });
    let wt = w.tr().contiguous();
    time("gemm 16x576x2304 (matmul)", 50, || {
        let _ = a.matmul(&wt);
    });
    tch::no_grad(|| {
        time("decode hidden", 5, || {
            let _ = model.hidden(
                &ids,
                &pos,
                Attn::Decode {
                    cache: &mut cache,
                    span: 101,
                },
            );
        });
        let h = Tensor::randn([b, 576], (Kind::Float, Device::Cpu));
        time("lm_head", 5, || {
            let _ = model.logits(&h);
        });
        let lg = model.logits(&h);
        let rp = yatt_engine::generate::RowParams {
            temperature: vec![1.0; b as usize],
            top_k: vec![50; b as usize],
            top_p: vec![1.0; b as usize],
            uniform: vec![0.5; b as usize],
        };
        time("sample", 5, || {
            let _ = yatt_engine::generate::sample(&lg, &rp);
        });
        let q = Tensor::randn([b, 9, 1, 64], (Kind::Float, Device::Cpu));
        let k = Tensor::randn([b, 3, 101, 64], (Kind::Float, Device::Cpu));
        let m = Tensor::ones([b, 1, 1, 101], (Kind::Bool, Device::Cpu));
        time("sdpa gqa mask", 20, || {
            let _ =
                Tensor::scaled_dot_product_attention(&q, &k, &k, Some(&m), 0.0, false, None, true);
        });
        time("sdpa gqa nomask", 20, || {
            let _ = Tensor::scaled_dot_product_attention(
                &q,
                &k,
                &k,
                None::<Tensor>,
                0.0,
                false,
                None,
                true,
            );
        });
        let x = Tensor::randn([b, 1, 576], (Kind::Float, Device::Cpu));
        let l = &model.layers[0];
        time("qkv linear", 20, || {
            let _ = x.matmul(&l.wqkv);
        });
        time("gate_up linear", 20, || {
            let _ = x.matmul(&l.w_gate_up);
        });
        let rows = Tensor::arange(b, (Kind::Int64, Device::Cpu));
        let pf = pos.reshape([b]);
        let kc = Tensor::zeros([b, 3, 160, 64], (Kind::Float, Device::Cpu));
        let kn = Tensor::randn([b, 3, 64], (Kind::Float, Device::Cpu));
        let mut kc2 = kc.shallow_clone();
        time("index_put", 20, || {
            let _ = kc2.index_put_(&[Some(&rows), None, Some(&pf)], &kn, false);
        });
        let kk = kc.narrow(2, 0, 101);
        time("sdpa gqa mask narrow", 20, || {
            let _ = Tensor::scaled_dot_product_attention(
                &q,
                &kk,
                &kk,
                Some(&m),
                0.0,
                false,
                None,
                true,
            );
        });
        let cosf = Tensor::randn([8192, 32], (Kind::Float, Device::Cpu));
        time("index_select rope", 20, || {
            let _ = cosf.index_select(0, &pf);
        });
        let xx = Tensor::randn([b, 1, 1536], (Kind::Float, Device::Cpu));
        time("down linear", 20, || {
            let _ = xx.matmul(&l.w_down);
        });
        let oo = Tensor::randn([b, 1, 576], (Kind::Float, Device::Cpu));
        time("o linear", 20, || {
            let _ = oo.matmul(&l.wo);
        });
        time("all layer linears x30", 1, || {
            for l in &model.layers {
                let _ = oo.linear(&l.wqkv, None::<Tensor>);
                let _ = oo.matmul(&l.wo);
                let _ = oo.linear(&l.w_gate_up, None::<Tensor>);
                let _ = xx.matmul(&l.w_down);
            }
        });
        time("rms", 20, || {
            let _ = x.rms_norm([576], Some(&l.ln1), 1e-5);
        });
    });
}
