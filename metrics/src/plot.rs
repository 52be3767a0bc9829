//! PNG plots of a run's `metrics.jsonl`: reward, KL, stage timing and throughput
//! against the step.
//!
//! Text is drawn with Noto Sans, embedded in the binary (`ttf-noto-sans`), so plots
//! render the same on a machine with no system fonts.

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::sync::Once;

use plotters::coord::types::{RangedCoordf64, RangedCoordu64};
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::jsonl::{read_jsonl, StepRecord, EVAL_FILE_NAME, FILE_NAME};
use crate::{names, MetricsError, WriteError};

const WIDTH: u32 = 1000;
const HEIGHT: u32 = 600;
const FONT: &str = "sans-serif";

/// Distinct, colour-blind-friendly line colours (the Okabe–Ito set, then greys).
const PALETTE: [RGBColor; 10] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(240, 228, 66),
    RGBColor(110, 110, 110),
    RGBColor(170, 170, 170),
    RGBColor(40, 40, 40),
];

/// Pipeline order of the stage times, so the timing stack reads bottom-up as a step
/// runs; stages not listed follow in name order.
const STAGE_ORDER: [&str; 8] = [
    names::GEN_S,
    names::REWARD_S,
    names::REF_S,
    names::OLD_LOG_PROB_S,
    names::VALUES_S,
    names::ADV_S,
    names::UPDATE_ACTOR_S,
    names::WEIGHT_SYNC_S,
];

/// The whole step's wall time: drawn as a line over the stacked stages.
const STEP_TIME: &str = names::STEP_S;

/// What [`plot_run`] wrote and what it left out.
#[derive(Debug, Clone, PartialEq)]
pub struct PlotReport {
    /// The PNGs written.
    pub written: Vec<PathBuf>,
    /// `(file name, why)` for each plot not drawn because the run has none of its metrics.
    pub skipped: Vec<(String, String)>,
}

/// One line on a chart: its legend name and its `(step, value)` points.
struct Series {
    name: String,
    points: Vec<(u64, f64)>,
}

fn series(steps: &[StepRecord], name: &str) -> Option<Series> {
    let points: Vec<(u64, f64)> = steps
        .iter()
        .filter_map(|s| s.get(name).map(|v| (s.step, v)))
        .collect();
    (!points.is_empty()).then(|| Series {
        name: name.to_string(),
        points,
    })
}

fn register_fonts() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Only fails on bytes that are not a font; these are a fixed, valid TTF.
        if register_font(FONT, FontStyle::Normal, ttf_noto_sans::REGULAR).is_err() {
            panic!("ttf-noto-sans's REGULAR is not a font ab_glyph can read");
        }
    });
}

/// Reads `RUN_DIR/metrics.jsonl` and writes into `out_dir` (created if missing):
/// - `reward.png`: `critic/rewards/mean` and `critic/score/mean`;
/// - `kl.png`: `actor/kl` and `actor/kl_loss`;
/// - `timing.png`: the `timing_s/*` stage times stacked, with `timing_s/step` on top;
/// - `throughput.png`: `perf/throughput`;
/// - `eval.png`: `eval/accuracy` from `RUN_DIR/eval.jsonl`, when the run evaluated.
///
/// A plot whose metrics are all absent (e.g. KL in a run without a reference) is
/// skipped and listed in [`PlotReport::skipped`].
pub fn plot_run(run_dir: &Path, out_dir: &Path) -> Result<PlotReport, MetricsError> {
    let path = run_dir.join(FILE_NAME);
    let steps = read_jsonl(&path)?;
    if steps.is_empty() {
        return Err(MetricsError::Empty { path });
    }
    std::fs::create_dir_all(out_dir).map_err(|source| WriteError {
        path: out_dir.into(),
        source,
    })?;
    register_fonts();
    let run = run_dir
        .canonicalize()
        .unwrap_or_else(|_| run_dir.to_path_buf())
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| run_dir.display().to_string());
    let mut report = PlotReport {
        written: Vec::new(),
        skipped: Vec::new(),
    };
    let lines = |names: &[&str]| -> Vec<Series> {
        names.iter().filter_map(|n| series(&steps, n)).collect()
    };
    let charts: [(&str, &str, &str, Vec<Series>); 3] = [
        (
            "reward.png",
            "reward",
            "mean reward per sample",
            lines(&[names::REWARDS_MEAN, names::SCORE_MEAN]),
        ),
        (
            "kl.png",
            "KL to the reference",
            "KL (nats per token)",
            lines(&[names::KL, names::KL_LOSS]),
        ),
        (
            "throughput.png",
            "throughput",
            "tokens/s per device",
            lines(&[names::THROUGHPUT]),
        ),
    ];
    for (file, title, y_desc, lines) in charts {
        let out = out_dir.join(file);
        if lines.is_empty() {
            report.skipped.push((
                file.into(),
                format!("{} has none of its metrics", path.display()),
            ));
            continue;
        }
        let title = format!("{run}: {title}");
        render(&out, |root| line_chart(root, &title, y_desc, &lines))?;
        report.written.push(out);
    }
    let (stages, wall) = timing_series(&steps);
    let out = out_dir.join("timing.png");
    if stages.is_empty() && wall.is_none() {
        report.skipped.push((
            "timing.png".into(),
            format!("{} has no timing_s/* metrics", path.display()),
        ));
    } else {
        let title = format!("{run}: time per step by stage");
        render(&out, |root| {
            timing_chart(root, &title, &stages, wall.as_ref())
        })?;
        report.written.push(out);
    }
    let eval_path = run_dir.join(EVAL_FILE_NAME);
    let evals = match read_jsonl(&eval_path) {
        Ok(e) => Some(e),
        Err(MetricsError::NoMetrics { .. }) => None,
        Err(e) => return Err(e),
    };
    let out = out_dir.join("eval.png");
    match evals
        .as_deref()
        .and_then(|e| series(e, names::EVAL_ACCURACY))
    {
        Some(accuracy) => {
            let title = format!("{run}: greedy accuracy on held-out prompts");
            render(&out, |root| {
                line_chart(root, &title, names::EVAL_ACCURACY, &[accuracy])
            })?;
            report.written.push(out);
        }
        None => report.skipped.push((
            "eval.png".into(),
            format!(
                "{} has no {} (a run evaluates with [eval] every = N)",
                eval_path.display(),
                names::EVAL_ACCURACY
            ),
        )),
    }
    // Pipeline order (reward, kl, timing, throughput, eval) reads better than chart order.
    report.written.sort_by_key(|p| {
        [
            "reward.png",
            "kl.png",
            "timing.png",
            "throughput.png",
            "eval.png",
        ]
        .iter()
        .position(|f| p.ends_with(f))
    });
    Ok(report)
}

/// One metric of several runs on one chart (e.g. the eval accuracy of the baselines):
/// reads `RUN/file_name` for each run (`metrics.jsonl`, or another file in its format)
/// and draws `metric` against the step, one line per run, named by its directory.
pub fn plot_compare(
    runs: &[PathBuf],
    file_name: &str,
    metric: &str,
    title: &str,
    out: &Path,
) -> Result<(), MetricsError> {
    let mut lines = Vec::new();
    for run in runs {
        let path = run.join(file_name);
        let steps = read_jsonl(&path)?;
        let mut line = series(&steps, metric).ok_or_else(|| MetricsError::NoSuchMetric {
            path,
            metric: metric.to_string(),
        })?;
        line.name = run
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| run.display().to_string());
        lines.push(line);
    }
    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).map_err(|source| WriteError {
            path: dir.into(),
            source,
        })?;
    }
    register_fonts();
    render(out, |root| line_chart(root, title, metric, &lines))
}

/// The stage times in pipeline order, and the step wall time.
fn timing_series(steps: &[StepRecord]) -> (Vec<Series>, Option<Series>) {
    let mut names: Vec<&str> = STAGE_ORDER.to_vec();
    let mut others: Vec<&str> = steps
        .iter()
        .flat_map(|s| s.values.keys())
        .map(String::as_str)
        .filter(|k| {
            k.starts_with(names::TIMING_PREFIX) && *k != STEP_TIME && !STAGE_ORDER.contains(k)
        })
        .collect();
    others.sort_unstable();
    others.dedup();
    names.extend(others);
    let stages = names.iter().filter_map(|n| series(steps, n)).collect();
    (stages, series(steps, STEP_TIME))
}

type Root<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type DrawResult = Result<(), Box<dyn std::error::Error + 'static>>;

/// Draws into an RGB buffer with `draw` and encodes it as `path` (PNG).
fn render(path: &Path, draw: impl FnOnce(&Root<'_>) -> DrawResult) -> Result<(), MetricsError> {
    let derr = |reason: String| MetricsError::Draw {
        path: path.into(),
        reason,
    };
    let mut buf = vec![0u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE).map_err(|e| derr(e.to_string()))?;
        draw(&root).map_err(|e| derr(e.to_string()))?;
        root.present().map_err(|e| derr(e.to_string()))?;
    }
    let werr = |e: std::io::Error| {
        MetricsError::Write(WriteError {
            path: path.into(),
            source: e,
        })
    };
    let file = File::create(path).map_err(werr)?;
    let mut enc = png::Encoder::new(BufWriter::new(file), WIDTH, HEIGHT);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let io = |e: png::EncodingError| match e {
        png::EncodingError::IoError(e) => werr(e),
        other => derr(other.to_string()),
    };
    let mut w = enc.write_header().map_err(io)?;
    w.write_image_data(&buf).map_err(io)?;
    w.finish().map_err(io)
}

/// The x range covering every step (at least two wide, so one step still plots).
fn step_range<'a>(series: impl IntoIterator<Item = &'a Series>) -> std::ops::Range<u64> {
    let (mut lo, mut hi) = (u64::MAX, 0);
    for s in series {
        for &(x, _) in &s.points {
            lo = lo.min(x);
            hi = hi.max(x);
        }
    }
    lo..hi.max(lo + 1)
}

/// A y range around `values`' finite ones with 5 % headroom; `floor` pins the bottom.
fn value_range(values: impl IntoIterator<Item = f64>, floor: Option<f64>) -> std::ops::Range<f64> {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in values.into_iter().filter(|v| v.is_finite()) {
        lo = lo.min(v);
        hi = hi.max(v);
    }
    if let Some(f) = floor {
        lo = lo.min(f);
    }
    if !lo.is_finite() {
        return 0.0..1.0;
    }
    let span = if hi > lo { hi - lo } else { lo.abs().max(1e-3) };
    let lo = match floor {
        Some(f) if lo >= f => f,
        _ => lo - 0.05 * span,
    };
    lo..hi + 0.05 * span
}

/// Y tick labels with one number of decimals for the whole axis (enough to tell
/// neighbouring ticks apart), and k/M for large values: `0.02`, `0.10`, `25k`.
fn y_labels(range: &std::ops::Range<f64>) -> impl Fn(&f64) -> String {
    let max_abs = range.start.abs().max(range.end.abs());
    let (scale, suffix) = if max_abs >= 1e6 {
        (1e6, "M")
    } else if max_abs >= 1e4 {
        (1e3, "k")
    } else {
        (1.0, "")
    };
    // plotters spaces at most ten ticks by 1, 2 or 5 times a power of ten; the smallest
    // such step over a tenth of the span is at most the real one, so its decimals are
    // enough.
    let raw = (range.end - range.start) / scale / 10.0;
    let decimals = if raw.is_finite() && raw > 0.0 {
        let k = raw.log10().floor();
        let k = if raw / 10f64.powf(k) > 5.0 {
            k + 1.0
        } else {
            k
        };
        (-k).clamp(0.0, 9.0) as usize
    } else {
        0
    };
    move |v| format!("{:.*}{suffix}", decimals, v / scale)
}

/// Runs of consecutive finite points: a NaN step breaks the line, not bridges it.
fn segments(points: &[(u64, f64)]) -> Vec<Vec<(u64, f64)>> {
    let mut out: Vec<Vec<(u64, f64)>> = vec![Vec::new()];
    for &(x, y) in points {
        if y.is_finite() {
            out.last_mut().expect("never empty").push((x, y));
        } else if !out.last().expect("never empty").is_empty() {
            out.push(Vec::new());
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// The legend corner with the fewest points near it, so the legend hides little data.
fn legend_corner(
    series: &[&Series],
    x: &std::ops::Range<u64>,
    y: &std::ops::Range<f64>,
) -> SeriesLabelPosition {
    let mut counts = [0usize; 4]; // upper-left, upper-right, lower-left, lower-right
    let xw = (x.end - x.start).max(1) as f64;
    let yh = (y.end - y.start).max(f64::MIN_POSITIVE);
    for s in series {
        for &(px, py) in s.points.iter().filter(|p| p.1.is_finite()) {
            let fx = (px - x.start) as f64 / xw;
            let fy = (py - y.start) / yh;
            let col = if fx < 0.4 {
                Some(0)
            } else if fx > 0.6 {
                Some(1)
            } else {
                None
            };
            let row = if fy > 0.6 {
                Some(0)
            } else if fy < 0.4 {
                Some(2)
            } else {
                None
            };
            if let (Some(c), Some(r)) = (col, row) {
                counts[r + c] += 1;
            }
        }
    }
    let best = (0..4)
        .min_by_key(|&i| (counts[i], [1, 0, 3, 2][i]))
        .unwrap_or(1);
    [
        SeriesLabelPosition::UpperLeft,
        SeriesLabelPosition::UpperRight,
        SeriesLabelPosition::LowerLeft,
        SeriesLabelPosition::LowerRight,
    ][best]
        .clone()
}

type Chart<'a, 'b> =
    ChartContext<'a, BitMapBackend<'b>, Cartesian2d<RangedCoordu64, RangedCoordf64>>;

/// A titled chart over steps `x` and values `y`, with its grid and labelled axes drawn.
fn axes<'a, 'b>(
    root: &'a Root<'b>,
    title: &str,
    y_desc: &str,
    x: &std::ops::Range<u64>,
    y: &std::ops::Range<f64>,
) -> Result<Chart<'a, 'b>, Box<dyn std::error::Error + 'static>> {
    let mut chart = ChartBuilder::on(root)
        .caption(title, (FONT, 26))
        .margin(20)
        .x_label_area_size(55)
        .y_label_area_size(90)
        .build_cartesian_2d(x.clone(), y.clone())?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .y_label_formatter(&y_labels(y))
        .label_style((FONT, 15))
        .axis_desc_style((FONT, 18))
        .light_line_style(RGBColor(235, 235, 235))
        .draw()?;
    Ok(chart)
}

/// The legend of the series drawn so far, boxed, at `corner`.
fn legend<'a, 'b: 'a>(chart: &mut Chart<'a, 'b>, corner: SeriesLabelPosition) -> DrawResult {
    chart
        .configure_series_labels()
        .position(corner)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font((FONT, 16))
        .draw()?;
    Ok(())
}

fn line_chart(root: &Root<'_>, title: &str, y_desc: &str, lines: &[Series]) -> DrawResult {
    let x = step_range(lines);
    let y = value_range(
        lines.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
        None,
    );
    let mut chart = axes(root, title, y_desc, &x, &y)?;
    let points = lines.iter().map(|s| s.points.len()).max().unwrap_or(0);
    // Markers show individual steps on short runs; on long ones they would blot the line.
    let marker = if points <= 60 { 3 } else { 0 };
    for (i, s) in lines.iter().enumerate() {
        let color = PALETTE[i % PALETTE.len()];
        // Earlier lines are wider, so a line drawn exactly over another (rewards equal to
        // scores when no KL penalty applies) still shows both colours.
        let width = 2 + 3 * (lines.len() - 1 - i) as u32;
        let mut labelled = false;
        for seg in segments(&s.points) {
            let drawn = chart.draw_series(
                LineSeries::new(seg, color.stroke_width(width))
                    .point_size(marker + (width - 2) / 2),
            )?;
            if !labelled {
                drawn.label(s.name.as_str()).legend(move |(lx, ly)| {
                    PathElement::new(vec![(lx, ly), (lx + 24, ly)], color.stroke_width(width + 1))
                });
                labelled = true;
            }
        }
    }
    let refs: Vec<&Series> = lines.iter().collect();
    legend(&mut chart, legend_corner(&refs, &x, &y))
}

fn timing_chart(
    root: &Root<'_>,
    title: &str,
    stages: &[Series],
    wall: Option<&Series>,
) -> DrawResult {
    // Stack the stages: each band's top is the running sum up to it. A step missing a
    // stage (or NaN) adds nothing for it.
    let mut xs: Vec<u64> = stages
        .iter()
        .chain(wall)
        .flat_map(|s| s.points.iter().map(|p| p.0))
        .collect();
    xs.sort_unstable();
    xs.dedup();
    let mut tops: Vec<Series> = Vec::with_capacity(stages.len());
    let mut sum = vec![0.0f64; xs.len()];
    for s in stages {
        for &(x, v) in &s.points {
            if v.is_finite() {
                let i = xs.binary_search(&x).expect("x taken from these points");
                sum[i] += v;
            }
        }
        tops.push(Series {
            name: s.name.trim_start_matches(names::TIMING_PREFIX).to_string(),
            points: xs.iter().copied().zip(sum.iter().copied()).collect(),
        });
    }
    let wall = wall.map(|w| Series {
        name: "step (wall)".into(),
        points: w.points.clone(),
    });
    let all: Vec<&Series> = tops.iter().chain(wall.as_ref()).collect();
    let x = step_range(all.iter().copied());
    let y = value_range(
        all.iter().flat_map(|s| s.points.iter().map(|p| p.1)),
        Some(0.0),
    );
    let mut chart = axes(root, title, "seconds (stages stacked)", &x, &y)?;
    // Top band first, so each lower band is painted over the ones above it and the
    // legend lists the bands top to bottom, as they appear.
    for (i, band) in tops.iter().enumerate().rev() {
        let color = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(
                AreaSeries::new(band.points.iter().copied(), 0.0, color.filled())
                    .border_style(color.stroke_width(1)),
            )?
            .label(band.name.as_str())
            .legend(move |(lx, ly)| {
                Rectangle::new([(lx, ly - 6), (lx + 14, ly + 6)], color.filled())
            });
    }
    if let Some(w) = &wall {
        let drawn = chart.draw_series(LineSeries::new(
            w.points.iter().copied().filter(|p| p.1.is_finite()),
            BLACK.stroke_width(2),
        ))?;
        drawn.label(w.name.as_str()).legend(|(lx, ly)| {
            PathElement::new(vec![(lx, ly), (lx + 24, ly)], BLACK.stroke_width(2))
        });
    }
    legend(&mut chart, legend_corner(&all, &x, &y))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nan_breaks_a_line() {
        let pts = [(1, 1.0), (2, f64::NAN), (3, 2.0), (4, 3.0), (5, f64::NAN)];
        assert_eq!(
            segments(&pts),
            vec![vec![(1, 1.0)], vec![(3, 2.0), (4, 3.0)]]
        );
    }

    #[test]
    fn ranges_cover_the_data() {
        assert_eq!(value_range([1.0, 3.0, f64::NAN], None), 0.9..3.1);
        // With a floor the headroom is 5 % of the span shown, 0..3.
        let floored = value_range([1.0, 3.0], Some(0.0));
        assert_eq!(floored.start, 0.0);
        assert!((floored.end - 3.15).abs() < 1e-12, "{floored:?}");
        let flat = value_range([2.0, 2.0], None);
        assert!(flat.start < 2.0 && flat.end > 2.0, "{flat:?}");
        assert_eq!(value_range([f64::NAN], None), 0.0..1.0);
        let s = Series {
            name: "x".into(),
            points: vec![(4, 0.0)],
        };
        assert_eq!(step_range([&s]), 4..5);
    }

    #[test]
    fn tick_labels_share_their_decimals_and_scale() {
        let f = y_labels(&(0.0..1.0));
        assert_eq!((f(&0.5), f(&1.0)), ("0.5".to_string(), "1.0".to_string()));
        assert_eq!(y_labels(&(0.0..0.15))(&0.1), "0.10");
        assert_eq!(y_labels(&(0.0..2.4))(&1.5), "1.5");
        let f = y_labels(&(4000.0..32000.0));
        assert_eq!(
            (f(&5000.0), f(&30000.0)),
            ("5k".to_string(), "30k".to_string())
        );
        assert_eq!(y_labels(&(0.0..5e6))(&2.5e6), "2.5M");
        assert_eq!(y_labels(&(0.0..500.0))(&250.0), "250");
    }

    #[test]
    fn the_legend_avoids_the_data() {
        // A rising curve fills the lower left and upper right.
        let s = Series {
            name: "r".into(),
            points: (0..=10).map(|i| (i, i as f64)).collect(),
        };
        let pos = legend_corner(&[&s], &(0..10), &(0.0..10.0));
        assert!(matches!(pos, SeriesLabelPosition::UpperLeft), "{pos:?}");
    }
}
