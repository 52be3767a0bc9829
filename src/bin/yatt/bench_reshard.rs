//! `yatt bench reshard`: what the live placement's move of a rank costs. One sharded
//! replica's ranks (threads of this process, random weights by unit) are resharded
//! N → M in memory (`ShardedTrainer::into_rank_state` / `from_rank_states`, what a move
//! does between two steps), and the same N → M through a sharded checkpoint on disk
//! (every rank saves, M ranks load: what a resume with another `job.policy_shards`
//! does). Both give the same state (tests hold them to it); this measures the time.

use anyhow::{anyhow, bail, Result};
use std::path::PathBuf;
use std::time::{Duration, Instant};
use yatt_engine::tch::{Device, Kind};
use yatt_engine::{set_threads, LocalGroup, RankState, ShardedTrainer, TrainConfig};

use crate::bench_sharded::model_config;

#[derive(clap::Args, Clone)]
pub struct BenchReshardArgs {
    /// Model shapes, with random weights: `smollm2-135m`, `smollm2-360m`, `tiny`, or a
    /// model directory's config.json.
    #[arg(long, default_value = "smollm2-135m")]
    pub model: String,
    /// Rank counts in turn: the replica starts on the first and is resharded to each
    /// next one (in memory), e.g. 4,3,4 for a rank moved out and back.
    #[arg(long, value_delimiter = ',', default_values_t = [4usize, 3, 4])]
    pub ranks: Vec<usize>,
    /// Where the checkpoint path writes (a directory it creates and removes).
    #[arg(long, default_value_os_t = std::env::temp_dir().join("yatt-bench-reshard"))]
    pub dir: PathBuf,
}

const SEED: i64 = 7;

fn trainers_of(
    n: usize,
    make: impl Fn(LocalGroup) -> Result<ShardedTrainer>,
) -> Result<Vec<ShardedTrainer>> {
    LocalGroup::new(n, Duration::from_secs(600))
        .into_iter()
        .map(make)
        .collect()
}

/// Runs `job` on every rank at once (a collective), each on its own thread.
fn on_every_rank<T: Send + 'static>(
    trainers: Vec<ShardedTrainer>,
    job: impl Fn(&mut ShardedTrainer) -> Result<T> + Clone + Send + 'static,
) -> Result<Vec<(ShardedTrainer, T)>> {
    let handles: Vec<_> = trainers
        .into_iter()
        .map(|mut tr| {
            let job = job.clone();
            std::thread::spawn(move || job(&mut tr).map(|t| (tr, t)))
        })
        .collect();
    handles
        .into_iter()
        .map(|h| h.join().map_err(|_| anyhow!("a rank panicked"))?)
        .collect()
}

fn state_bytes(trainers: &[ShardedTrainer]) -> u64 {
    trainers.iter().map(|t| t.shard_state_bytes()).sum()
}

pub fn run(args: BenchReshardArgs) -> Result<()> {
    let config = model_config(&args.model)?;
    if args.ranks.len() < 2 {
        bail!("--ranks: give at least two rank counts, e.g. 4,3,4");
    }
    let first = args.ranks[0];
    set_threads(1);
    let t = Instant::now();
    let mut ranks = trainers_of(first, |g| {
        Ok(ShardedTrainer::random(
            config.clone(),
            Device::Cpu,
            Kind::Float,
            SEED,
            TrainConfig::default(),
            Box::new(g),
        )?)
    })?;
    eprintln!(
        "built {first} ranks of {} ({:.1} GB of training state) in {:.1?}",
        args.model,
        state_bytes(&ranks) as f64 / 1e9,
        t.elapsed()
    );
    println!("| Path | Ranks | Seconds | State (GB) |");
    println!("|---|---|---|---|");
    for pair in args.ranks.windows(2) {
        let (from, to) = (pair[0], pair[1]);
        let gb = state_bytes(&ranks) as f64 / 1e9;
        // Through a checkpoint: every rank writes its shard, the new ranks read theirs.
        let dir = args.dir.join(format!("{from}-to-{to}"));
        let save_dir = dir.clone();
        let t = Instant::now();
        let saved = on_every_rank(ranks, move |tr| Ok(tr.save_sharded(&save_dir, None)?))?;
        let save_s = t.elapsed().as_secs_f64();
        ranks = saved.into_iter().map(|(tr, ())| tr).collect();
        let t = Instant::now();
        let loaded = trainers_of(to, |g| {
            Ok(ShardedTrainer::load_sharded(
                &dir,
                Device::Cpu,
                Kind::Float,
                Box::new(g),
            )?)
        })?;
        let load_s = t.elapsed().as_secs_f64();
        drop(loaded);
        let _ = std::fs::remove_dir_all(&dir);
        println!("| checkpoint (save + load) | {from} → {to} | {:.2} ({save_s:.2} + {load_s:.2}) | {gb:.2} |", save_s + load_s);
        // In memory: the ranks hand their states over, the new ranks take their parts.
        let t = Instant::now();
        let states: Vec<RankState> = ranks
            .into_iter()
            .map(|tr| tr.into_rank_state())
            .collect::<yatt_engine::Result<_>>()?;
        ranks = trainers_of(to, |g| {
            Ok(ShardedTrainer::from_rank_states(&states, Box::new(g))?)
        })?;
        drop(states);
        println!(
            "| in memory | {from} → {to} | {:.2} | {gb:.2} |",
            t.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
