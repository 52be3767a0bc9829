//! `yatt sim`: the cluster simulator's shell. The simulation, the policy and the search
//! live in `yatt-placement`; this reads the config, times the search, writes the JSON
//! report and draws the PNG.

use std::path::{Path, PathBuf};
use std::sync::Once;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};
use yatt_placement::calibrate;
use yatt_placement::search::{search, Space};
use yatt_placement::sim::{format_report, run_scenario, ScenarioReport, SimConfig, Strategy};
use yatt_placement::workload::ForecastParams;
use yatt_placement::{
    CostModel, CostSetup, GpuSpec, Inventory, JobShape, ModelSpec, PlacementPolicy, PolicyConfig,
    RewardKind,
};

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
    plot(&reports, &png)?;
    println!("report: {}\nplot: {}", json.display(), png.display());
    Ok(())
}

fn calibrate_run(path: &Path, iterations: u32) -> Result<()> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let steps = calibrate::parse_metrics(&text)?;
    let c = calibrate::check(&steps, f64::from(iterations))?;
    println!(
        "fitted on {} step(s) after the warm-up step; replayed {} step(s) in the simulator",
        c.fit_steps,
        c.predicted_s.len()
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

const FONT: &str = "yatt-sim";

fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Only fails on bytes that are not a font; these are a fixed, valid TTF.
        if register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_err() {
            panic!("ttf-noto-sans's REGULAR is not a font ab_glyph can read");
        }
    });
}

const PANEL_W: u32 = 700;
const PANEL_H: u32 = 420;

fn color(s: Strategy) -> RGBColor {
    match s {
        Strategy::Colocate => RGBColor(214, 39, 40),
        Strategy::Static => RGBColor(31, 119, 180),
        Strategy::Dynamic => RGBColor(44, 160, 44),
    }
}

/// One panel per scenario: each placement's step time over training, and the bound.
fn plot(reports: &[ScenarioReport], path: &Path) -> Result<()> {
    register_fonts();
    let cols = if reports.len() > 1 { 2 } else { 1 };
    let rows = reports.len().div_ceil(cols);
    let (w, h) = (PANEL_W * cols as u32, PANEL_H * rows as u32);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| anyhow::anyhow!("{e}"))?;
        let panels = root.split_evenly((rows, cols));
        for (area, r) in panels.iter().zip(reports) {
            panel(area, r).map_err(|e| anyhow::anyhow!("drawing {}: {e}", r.name))?;
        }
        root.present().map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(file), w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let mut writer = enc.write_header()?;
    writer.write_image_data(&buf)?;
    writer.finish()?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn panel(area: &Area<'_>, r: &ScenarioReport) -> Result<(), Box<dyn std::error::Error>> {
    let steps = r.steps.max(2);
    let ymax = r
        .strategies
        .iter()
        .flat_map(|s| s.steps_s.iter().copied())
        .chain(r.bound_steps_s.iter().copied())
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max);
    let summary = match (r.get(Strategy::Dynamic), r.get(Strategy::Colocate)) {
        (Some(d), Some(_)) if d.partial => format!(
            ": dynamic {:.2}x colocate ({:.2}x on-policy), {:.2}x bound",
            d.speedup.unwrap_or(f64::NAN),
            d.speedup_vs_on_policy.unwrap_or(f64::NAN),
            d.vs_bound
        ),
        (Some(d), Some(_)) => format!(
            ": dynamic {:.2}x colocate, {:.2}x bound",
            d.speedup.unwrap_or(f64::NAN),
            d.vs_bound
        ),
        (Some(d), None) => format!(": dynamic {:.2}x bound", d.vs_bound),
        _ => String::new(),
    };
    let title = format!("{} GPUs, {}{}", r.gpus, r.model, summary);
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FONT, 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0u32..steps, 0f64..ymax * 1.05)?;
    chart
        .configure_mesh()
        .x_desc("training step")
        .y_desc("seconds per step")
        .label_style((FONT, 14))
        .axis_desc_style((FONT, 15))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    // One line per step series, with its legend entry.
    let mut line = |values: &[f64],
                    c: RGBColor,
                    label: String|
     -> Result<(), Box<dyn std::error::Error>> {
        let pts = values.iter().enumerate().map(|(i, v)| (i as u32, *v));
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
        Ok(())
    };
    for s in r.strategies.iter().filter(|s| s.refused.is_none()) {
        let label = format!(
            "{}{} {:.0} s/step ({:.2}x bound, idle {:.0}%)",
            s.strategy.name(),
            if s.partial { "+partial" } else { "" },
            s.step_s,
            s.vs_bound,
            s.idle_frac * 100.0
        );
        // Runs without partial rollouts, there for comparison, are drawn paler.
        let c = color(s.strategy);
        let c = if r.partial_rollout.is_some() && !s.partial {
            RGBColor(
                ((u16::from(c.0) + 2 * 255) / 3) as u8,
                ((u16::from(c.1) + 2 * 255) / 3) as u8,
                ((u16::from(c.2) + 2 * 255) / 3) as u8,
            )
        } else {
            c
        };
        line(&s.steps_s, c, label)?;
    }
    line(
        &r.bound_steps_s,
        BLACK,
        format!("lower bound {:.0} s/step", r.bound_step_s),
    )?;
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(RGBColor(180, 180, 180))
        .label_font((FONT, 13))
        .draw()?;
    Ok(())
}
