//! `yatt sim`: the cluster simulator's shell. The scenarios, the report, its PNG and
//! calibration live in `yatt-sim`, the engine, the policy and the search in
//! `yatt-placement`; this reads the config and metrics, times the search, and writes
//! the JSON report and the PNG.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use yatt_placement::{
    search, CostModel, CostSetup, ForecastParams, GpuSpec, Inventory, JobShape, ModelSpec,
    PlacementPolicy, PolicyConfig, RewardKind, Space,
};
use yatt_sim::{check_calibration, format_report, plot_png, run_scenario, run_steps, SimConfig};

/// Arguments of `yatt sim`.
#[derive(clap::Args)]
pub struct SimArgs {
    /// The simulation config (TOML), e.g. config/sim-longtail.toml.
    config: Option<PathBuf>,
    /// Where to write report.json and sim.png (default: runs/sim-NAME).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Run only the scenario with this index (0-based).
    #[arg(long)]
    scenario: Option<usize>,
    /// Staleness of the static and dynamic placements (overrides sim.staleness).
    #[arg(long)]
    staleness: Option<u32>,
    /// Time the plan search on 512 to 4,096 GPUs instead of simulating.
    #[arg(long)]
    bench: bool,
    /// Fit the simulator to a run's metrics.jsonl and report how well it predicts it.
    #[arg(long, value_name = "METRICS_JSONL")]
    calibrate: Option<PathBuf>,
    /// Decoding iterations per step of the calibrated run (its rollout.max_new_tokens).
    #[arg(long)]
    iterations: Option<u32>,
}

/// Runs `yatt sim`.
pub fn run(args: SimArgs) -> Result<()> {
    if args.bench {
        return bench();
    }
    if let Some(path) = &args.calibrate {
        let iterations = args.iterations.context(
            "--calibrate needs --iterations: the run's rollout.max_new_tokens (decoding iterations per step)",
        )?;
        return calibrate_run(path, iterations);
    }
    let Some(path) = &args.config else {
        bail!(
            "give a config (e.g. config/sim-longtail.toml), --bench, or --calibrate METRICS_JSONL"
        );
    };
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the sim config {}", path.display()))?;
    let mut config = SimConfig::parse(&text).with_context(|| format!("in {}", path.display()))?;
    if let Some(s) = args.staleness {
        config.sim.staleness = s;
    }
    let out = args
        .out
        .unwrap_or_else(|| PathBuf::from(format!("runs/sim-{}", config.sim.name)));
    std::fs::create_dir_all(&out).with_context(|| format!("creating {}", out.display()))?;
    let mut reports = Vec::new();
    for (i, sc) in config.scenarios()?.iter().enumerate() {
        if args.scenario.is_some_and(|s| s != i) {
            continue;
        }
        let t = Instant::now();
        let r = run_scenario(sc)?;
        print!("{}", format_report(&r));
        println!("  (simulated in {:.1} s)\n", t.elapsed().as_secs_f64());
        reports.push(r);
    }
    if reports.is_empty() {
        bail!(
            "no scenario with index {:?}; the config has {}",
            args.scenario,
            config.scenarios()?.len()
        );
    }
    let json = out.join("report.json");
    std::fs::write(&json, serde_json::to_vec_pretty(&reports)?)
        .with_context(|| format!("writing {}", json.display()))?;
    let png = out.join("sim.png");
    std::fs::write(&png, plot_png(&reports)?)
        .with_context(|| format!("writing {}", png.display()))?;
    println!("report: {}\nplot: {}", json.display(), png.display());
    Ok(())
}

fn calibrate_run(path: &Path, iterations: u32) -> Result<()> {
    let records = yatt_metrics::read_jsonl(path)?;
    let steps = run_steps(&records).with_context(|| format!("in {}", path.display()))?;
    let c = check_calibration(&steps, f64::from(iterations))?;
    let staleness = yatt_sim::run_staleness(&steps);
    println!(
        "fitted on {} step(s) after the warm-up step; replayed {} step(s) in the simulator ({})",
        c.fit_steps,
        c.predicted_s.len(),
        match staleness {
            0 => "on-policy, every role on one group".to_string(),
            k => format!("asynchronous, staleness {k}: the rollout on one group, the trainer's roles on another"),
        }
    );
    println!(
        "rates: gen {:.3} ms/iteration + {:.3} µs/token, slots {}, sync {:.1} ms, other {:.1} ms/step",
        c.rates.gen.a * 1e3,
        c.rates.gen.b * 1e6,
        c.rates.slots,
        c.rates.sync_s * 1e3,
        c.rates.overhead_s * 1e3
    );
    for (stage, s) in &c.rates.s_per_token {
        println!("  {}: {:.3} µs/token", stage.metric(), s * 1e6);
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let held = c.fit_steps;
    println!(
        "mean step, held-out steps: predicted {:.1} ms, measured {:.1} ms, error {:.1}%",
        mean(&c.predicted_s[held..]) * 1e3,
        mean(&c.measured_s[held..]) * 1e3,
        c.held_out_error * 100.0
    );
    println!(
        "mean step, all steps: error {:.1}%",
        c.overall_error * 100.0
    );
    Ok(())
}

/// Times the plan search on clusters of 512 to 4,096 GPUs (70B, generative reward).
fn bench() -> Result<()> {
    let gpu = GpuSpec::preset("h100").context("preset")?;
    let m = ModelSpec::preset("70b").context("preset")?;
    println!("| GPUs | groups | analytic search (median of 5) | shapes evaluated | with simulated candidates | chosen plan | analytic prediction of the search's best, s/step |");
    println!("|---:|---:|---:|---:|---:|---|---:|");
    for gpus in [512u32, 1024, 2048, 4096] {
        let inv = Inventory::uniform(gpus / 8, 8, 8, gpu.memory_bytes, gpu.host_memory_bytes)?;
        let setup = CostSetup {
            job: JobShape::new(
                m.clone(),
                RewardKind::Generative { model: m.clone() },
                16384,
            ),
            gpu: gpu.clone(),
            group_devices: 8,
            staleness: 1,
            partial_rollout: None,
        };
        let forecast = ForecastParams::lognormal(gpus, 16, 1500.0, 1.0, 16384)
            .with_drop(0.2)
            .with_judge(300.0, 0.6, 2048);
        let cm = CostModel::new(setup.clone(), forecast);
        let f = cm.forecast(0.0);
        let space = Space::of(&inv);
        let mut times = Vec::new();
        let mut found = None;
        for _ in 0..5 {
            let t = Instant::now();
            found = search(&cm, &f, &space);
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let found = found.context("no plan fits")?;
        // The policy's full choice: the analytic search, then its best shapes simulated
        // for a few steps on a slice of the cluster.
        let t = Instant::now();
        let policy = PlacementPolicy::new(PolicyConfig::default(), inv.clone(), setup, forecast)?;
        let full = t.elapsed().as_secs_f64();
        println!(
            "| {gpus} | {} | {:.0} ms | {} | {:.0} ms | {} | {:.0} |",
            inv.len(),
            times[2] * 1e3,
            found.evaluated,
            full * 1e3,
            policy.plan().summary(),
            found.prediction.step_s
        );
    }
    Ok(())
}
