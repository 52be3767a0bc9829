//! Times the pieces of a weight sync on the real SmolLM2 model: exporting the policy's
//! weights as buckets, copying them into a rollout model in place from views of the
//! payloads (and, for comparison, through fresh tensors as before), and repacking its
//! inference matrices for oneDNN.
//!
//! `cargo run --release -p yatt-engine --example sync_cost -- [threads] [repeats]`

use std::time::Instant;
use yatt_engine::tch::{self, Device, Kind};
use yatt_engine::*;

fn main() {
    let threads: i32 = std::env::args().nth(1).map_or(2, |s| s.parse().unwrap());
    let reps: usize = std::env::args().nth(2).map_or(3, |s| s.parse().unwrap());
    tch::set_num_threads(threads);
    let dir = yatt_engine::fixtures::smollm2_hf_dir().unwrap();
    let policy = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    // Copy into an unpacked model and time the repack on its own.
    let mut rollout = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut packed = Llama::load(&dir, Device::Cpu, Kind::Float).unwrap();
    let mut best = [f64::MAX; 5];
    for _ in 0..reps {
        let t = Instant::now();
        let named = policy.hf_named_tensors();
        let buckets = tch::no_grad(|| to_buckets(&named, 256 << 20)).unwrap();
        let t1 = t.elapsed().as_secs_f64();
        // What the roles do: views of the payloads, copied into the model once.
        let views: Vec<BucketViews> = buckets.iter().map(|b| b.views().unwrap()).collect();
        rollout
            .copy_weights_from(views.iter().flat_map(|v| v.iter()))
            .unwrap();
        drop(views);
        let t2 = t.elapsed().as_secs_f64();
        // Before: fresh tensors out of the payloads, then the copy in place.
        let mut tensors = Vec::new();
        for b in &buckets {
            tensors.extend(b.tensors(Device::Cpu).unwrap());
        }
        let t3 = t.elapsed().as_secs_f64();
        rollout
            .copy_weights_from(tensors.iter().map(|(n, t)| (n.as_str(), t)))
            .unwrap();
        let t4 = t.elapsed().as_secs_f64();
        packed.pack_for_inference(16);
        let t5 = t.elapsed().as_secs_f64();
        for (b, v) in best
            .iter_mut()
            .zip([t1, t2 - t1, t3 - t2, t4 - t3, t5 - t4])
        {
            *b = b.min(v);
        }
    }
    eprintln!(
        "export to buckets {:.3} s; load from views {:.3} s; before: buckets to tensors {:.3} s + copy in place {:.3} s; repack {:.3} s",
        best[0], best[1], best[2], best[3], best[4]
    );
}
