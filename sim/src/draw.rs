//! `sim.png`: each scenario's step times by placement against the lower bound.
//!
//! Text is drawn with Noto Sans, embedded in the binary (`ttf-noto-sans`), so the plot
//! renders the same on a machine with no system fonts. It returns the PNG's bytes:
//! writing them is the caller's business.

use std::sync::Once;

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::config::Strategy;
use crate::report::ScenarioReport;

/// Why the PNG could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum DrawError {
    /// The drawing library failed.
    #[error("drawing {what} of sim.png: {reason}")]
    Draw {
        /// What was being drawn.
        what: String,
        /// The drawing library's message.
        reason: String,
    },
    /// The PNG encoder failed.
    #[error("encoding sim.png: {0}")]
    Encode(String),
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

fn draw_error(what: impl Into<String>, e: impl std::fmt::Display) -> DrawError {
    DrawError::Draw {
        what: what.into(),
        reason: e.to_string(),
    }
}

/// The PNG of `reports` (the bytes of `sim.png`): one panel per scenario, each
/// placement's step time over training, and the bound.
pub fn plot_png(reports: &[ScenarioReport]) -> Result<Vec<u8>, DrawError> {
    register_fonts();
    let cols = if reports.len() > 1 { 2 } else { 1 };
    let rows = reports.len().div_ceil(cols);
    let (w, h) = (PANEL_W * cols as u32, PANEL_H * rows as u32);
    let mut buf = vec![0u8; (w * h * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buf, (w, h)).into_drawing_area();
        root.fill(&WHITE)
            .map_err(|e| draw_error("the background", e))?;
        let panels = root.split_evenly((rows, cols));
        for (area, r) in panels.iter().zip(reports) {
            panel(area, r).map_err(|e| draw_error(format!("scenario {}", r.name), e))?;
        }
        root.present().map_err(|e| draw_error("the bitmap", e))?;
    }
    let mut png_bytes = Vec::new();
    let mut enc = png::Encoder::new(&mut png_bytes, w, h);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    let encode = |e: png::EncodingError| DrawError::Encode(e.to_string());
    let mut writer = enc.write_header().map_err(encode)?;
    writer.write_image_data(&buf).map_err(encode)?;
    writer.finish().map_err(encode)?;
    Ok(png_bytes)
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
