//! Times the parts of one policy update on the real SmolLM2 model: forward (a batch of
//! `rows` × `len` tokens, log-probs of the last `resp` tokens), backward, and the
//! optimizer step (clip + AdamW).
//!
//! `cargo run --release -p yatt-engine --example train_cost -- [threads] [rows] [len] [resp] [repeats]`

use std::time::Instant;
use yatt_engine::tch::{self, Device, Kind, Tensor};
use yatt_engine::*;

fn main() {
    let arg = |i: usize, d: i64| std::env::args().nth(i).map_or(d, |s| s.parse().unwrap());
    let (threads, rows, len, resp, reps) =
        (arg(1, 2), arg(2, 16), arg(3, 61), arg(4, 16), arg(5, 3));
    tch::set_num_threads(threads as i32);
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let model = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut trainer = Trainer::new(model, TrainConfig::default());
    let ids = Tensor::randint(1000, [rows, len], (Kind::Int64, Device::Cpu));
    let mut best = [f64::MAX; 3];
    for _ in 0..reps {
        let t = Instant::now();
        let logits = trainer.model.forward(&ids, None);
        let lp = logits
            .narrow(1, len - resp - 1, resp)
            .log_softmax(-1, Kind::Float)
            .gather(-1, &ids.narrow(1, len - resp, resp).unsqueeze(-1), false);
        let loss = lp.mean(Kind::Float);
        let t1 = t.elapsed().as_secs_f64();
        trainer.backward_micro(loss, 1.0).unwrap();
        let t2 = t.elapsed().as_secs_f64();
        trainer.apply_gradients().unwrap();
        let t3 = t.elapsed().as_secs_f64();
        for (b, v) in best.iter_mut().zip([t1, t2 - t1, t3 - t2]) {
            *b = b.min(v);
        }
    }
    eprintln!(
        "forward {:.3} s, backward {:.3} s, optimizer {:.3} s",
        best[0], best[1], best[2]
    );
}
