use std::time::Instant;
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;
fn main() {
    tch::set_num_threads(2);
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let t = Instant::now();
    let model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    eprintln!("load {:?}", t.elapsed());
    let ids = Tensor::from_slice(&(0..40i64).collect::<Vec<_>>()).unsqueeze(0);
    for _ in 0..3 {
        let t = Instant::now();
        let _ = tch::no_grad(|| model.forward(&ids, None));
        eprintln!("forward 40 {:?}", t.elapsed());
    }
    let b: i64 = std::env::args().nth(1).map(|s| s.parse().unwrap()).unwrap_or(16);
    let mut g = Generator::new(model, GeneratorConfig { max_batch: b as usize, max_seq_len: 128, max_prefill_batch: 64, ..Default::default() });
    let reqs: Vec<Request> = (0..b).map(|i| Request { id: i as u64, prompt: (1..30 + i).collect(), params: SamplingParams { top_k: 50, max_new_tokens: 64, ignore_eos: true, seed: i as u64, ..Default::default() } }).collect();
    for _ in 0..2 {
        let (_, st) = g.generate(&reqs).unwrap();
        eprintln!("{st:?} tok/s {}", st.generated_tokens as f64 / st.seconds);
    }
}
