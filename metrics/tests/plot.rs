//! `plot_run` on a synthetic run: which PNGs it writes, that they decode at the
//! expected size with a drawn title and curves, and its errors.

use std::collections::BTreeMap;
use std::path::Path;

use yatt_metrics::{plot_run, MetricsError, RunWriter};

/// Decodes an RGB PNG: (width, height, pixels).
fn decode(path: &Path) -> (u32, u32, Vec<u8>) {
    let decoder = png::Decoder::new(std::io::BufReader::new(std::fs::File::open(path).unwrap()));
    let mut reader = decoder.read_info().unwrap();
    let mut buf = vec![0; reader.output_buffer_size().unwrap()];
    let info = reader.next_frame(&mut buf).unwrap();
    assert_eq!(info.color_type, png::ColorType::Rgb, "{}", path.display());
    buf.truncate(info.buffer_size());
    (info.width, info.height, buf)
}

/// Pixels in rows `rows` that are not near-white.
fn inked(img: &(u32, u32, Vec<u8>), rows: std::ops::Range<u32>) -> usize {
    let (w, _, px) = img;
    rows.flat_map(|y| (0..*w).map(move |x| ((y * w + x) * 3) as usize))
        .filter(|&i| px[i..i + 3].iter().any(|&c| c < 200))
        .count()
}

fn synthetic_run(dir: &Path, steps: u64, with_kl: bool) {
    let mut w = RunWriter::create(dir).unwrap();
    for s in 1..=steps {
        let x = s as f64;
        let mut m = BTreeMap::new();
        m.insert(
            "critic/rewards/mean".to_string(),
            0.1 + 0.8 * x / steps as f64,
        );
        m.insert(
            "critic/score/mean".to_string(),
            0.12 + 0.8 * x / steps as f64,
        );
        m.insert("timing_s/gen".to_string(), 0.05);
        m.insert("timing_s/update_actor".to_string(), 0.02 + 0.001 * x);
        m.insert("timing_s/my_stage".to_string(), 0.01);
        m.insert("timing_s/step".to_string(), 0.09 + 0.001 * x);
        // A NaN step breaks the line instead of failing the plot.
        let tp = if s == 3 { f64::NAN } else { 1000.0 + 10.0 * x };
        m.insert("perf/throughput".to_string(), tp);
        if with_kl {
            m.insert("actor/kl".to_string(), 0.01 * x);
        }
        w.write_step(s, &m).unwrap();
    }
}

#[test]
fn a_run_plots_to_five_readable_pngs() {
    let run = tempfile::tempdir().unwrap();
    synthetic_run(run.path(), 12, true);
    // What `[eval] every = 4` writes.
    let evals: String = (1..=3)
        .map(|i| {
            format!(
                "{{\"step\": {}, \"eval/accuracy\": {}}}\n",
                4 * i,
                0.2 * i as f64
            )
        })
        .collect();
    std::fs::write(run.path().join("eval.jsonl"), evals).unwrap();
    let out = run.path().join("plots");
    let report = plot_run(run.path(), &out).unwrap();
    let names: Vec<&str> = report
        .written
        .iter()
        .map(|p| p.file_name().unwrap().to_str().unwrap())
        .collect();
    assert_eq!(
        names,
        [
            "reward.png",
            "kl.png",
            "timing.png",
            "throughput.png",
            "eval.png"
        ]
    );
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    for path in &report.written {
        let img = decode(path);
        assert_eq!((img.0, img.1), (1000, 600), "{}", path.display());
        // The caption sits in the top band; the plot area below it holds axes and curves.
        let title = inked(&img, 0..50);
        let body = inked(&img, 60..600);
        assert!(
            title > 200,
            "{}: no title drawn ({title} dark pixels)",
            path.display()
        );
        assert!(
            body > 5000,
            "{}: nearly empty plot ({body} dark pixels)",
            path.display()
        );
    }
}

#[test]
fn a_plot_without_its_metrics_is_skipped_and_said() {
    let run = tempfile::tempdir().unwrap();
    synthetic_run(run.path(), 1, false);
    let report = plot_run(run.path(), run.path()).unwrap();
    assert_eq!(report.written.len(), 3, "{report:?}");
    assert_eq!(report.skipped.len(), 2, "{report:?}");
    assert_eq!(report.skipped[0].0, "kl.png");
    assert!(report.skipped[0].1.contains("metrics.jsonl"), "{report:?}");
    assert!(!run.path().join("kl.png").exists());
    // A run that never evaluated: eval.png is skipped, naming the file and the key.
    assert_eq!(report.skipped[1].0, "eval.png");
    assert!(
        report.skipped[1].1.contains("eval.jsonl") && report.skipped[1].1.contains("[eval]"),
        "{report:?}"
    );
}

#[test]
fn a_dir_without_metrics_or_with_a_bad_line_is_named() {
    let run = tempfile::tempdir().unwrap();
    let e = plot_run(run.path(), run.path()).unwrap_err();
    assert!(matches!(e, MetricsError::NoMetrics { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains(&run.path().join("metrics.jsonl").display().to_string()),
        "{msg}"
    );

    std::fs::write(run.path().join("metrics.jsonl"), "").unwrap();
    let e = plot_run(run.path(), run.path()).unwrap_err();
    assert!(matches!(e, MetricsError::Empty { .. }), "{e}");

    std::fs::write(
        run.path().join("metrics.jsonl"),
        "{\"step\":1}\n{\"step\":2,\"x\":[1]}\n",
    )
    .unwrap();
    let msg = plot_run(run.path(), run.path()).unwrap_err().to_string();
    assert!(
        msg.contains("metrics.jsonl:2:") && msg.contains("\"x\""),
        "{msg}"
    );
}

#[test]
fn several_runs_compare_on_one_chart_and_a_run_without_the_metric_is_named() {
    let root = tempfile::tempdir().unwrap();
    let runs: Vec<std::path::PathBuf> = (0..3)
        .map(|i| {
            let dir = root.path().join(format!("run{i}"));
            synthetic_run(&dir, 6 + i, false);
            dir
        })
        .collect();
    let out = root.path().join("cmp/reward.png");
    yatt_metrics::plot_compare(
        &runs,
        "metrics.jsonl",
        "critic/rewards/mean",
        "reward",
        &out,
    )
    .unwrap();
    let img = decode(&out);
    assert_eq!((img.0, img.1), (1000, 600));
    assert!(inked(&img, 60..600) > 5000, "nearly empty plot");
    let e = yatt_metrics::plot_compare(&runs, "metrics.jsonl", "actor/kl", "kl", &out)
        .unwrap_err()
        .to_string();
    assert!(e.contains("run0") && e.contains("actor/kl"), "{e}");
}
