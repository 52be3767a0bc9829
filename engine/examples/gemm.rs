use std::time::Instant;
use yatt_engine::tch::{self, Device, Kind, Tensor};
fn main() {
    let th: i32 = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(2);
    tch::set_num_threads(th);
    eprintln!("threads {}", tch::get_num_threads());
    let x = Tensor::randn([16, 576], (Kind::Float, Device::Cpu));
    let ws: Vec<Tensor> = (0..100).map(|_| Tensor::randn([2304, 576], (Kind::Float, Device::Cpu))).collect();
    for _ in 0..2 {
        let t = Instant::now();
        for w in &ws { let _ = x.matmul(&w.tr()); }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("cold matmul GFLOP/s {:.1}", 2.0 * 16.0 * 576.0 * 2304.0 * 100.0 / dt / 1e9);
        let t = Instant::now();
        for w in &ws { let _ = x.linear(w, None::<Tensor>); }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("cold linear GFLOP/s {:.1}", 2.0 * 16.0 * 576.0 * 2304.0 * 100.0 / dt / 1e9);
        let t = Instant::now();
        for _ in 0..100 { let _ = x.linear(&ws[0], None::<Tensor>); }
        let dt = t.elapsed().as_secs_f64();
        eprintln!("hot linear GFLOP/s {:.1}", 2.0 * 16.0 * 576.0 * 2304.0 * 100.0 / dt / 1e9);
    }
}
