//! `metrics.jsonl`: one JSON object per step, `"step"` first and then every metric in
//! name order; a non-finite value is written as `null` (JSON has no NaN) and read back
//! as NaN.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use crate::MetricsError;

/// The file name inside a run directory.
pub const FILE_NAME: &str = "metrics.jsonl";

/// The file of evaluations during training inside a run directory, in the same format
/// (one line per evaluated step).
pub const EVAL_FILE_NAME: &str = "eval.jsonl";

/// One step's metrics, as read from a line.
#[derive(Debug, Clone, PartialEq)]
pub struct StepRecord {
    /// The step.
    pub step: u64,
    /// Metric name → value; NaN where the file had `null`.
    pub values: BTreeMap<String, f64>,
}

impl StepRecord {
    /// A metric's value, if the step has it.
    pub fn get(&self, name: &str) -> Option<f64> {
        self.values.get(name).copied()
    }
}

/// The line for one step, without its newline.
///
/// ```
/// use std::collections::BTreeMap;
/// let m = BTreeMap::from([("b".to_string(), f64::NAN), ("a".to_string(), 0.5)]);
/// assert_eq!(yatt_metrics::format_line(3, &m), r#"{"step":3,"a":0.5,"b":null}"#);
/// ```
pub fn format_line(step: u64, values: &BTreeMap<String, f64>) -> String {
    let mut line = format!("{{\"step\":{step}");
    for (k, v) in values {
        let v = serde_json::Number::from_f64(*v)
            .map(Value::Number)
            .unwrap_or(Value::Null);
        line.push_str(&format!(",{}:{v}", Value::String(k.clone())));
    }
    line.push('}');
    line
}

/// Parses one line; the error says what is wrong with it.
pub fn parse_line(line: &str) -> Result<StepRecord, String> {
    let obj = match serde_json::from_str::<Value>(line) {
        Ok(Value::Object(obj)) => obj,
        Ok(other) => return Err(format!("expected a JSON object, found {other}")),
        Err(e) => {
            // serde_json's own "at line 1 column N" would contradict the file's line number.
            let full = e.to_string();
            let what = full
                .rsplit_once(" at line ")
                .map_or(full.as_str(), |(m, _)| m);
            return Err(format!("not JSON at column {}: {what}", e.column()));
        }
    };
    let step = match obj.get("step") {
        Some(v) => v
            .as_u64()
            .ok_or_else(|| format!("\"step\" must be a non-negative integer, found {v}"))?,
        None => return Err("no \"step\" key".into()),
    };
    let mut values = BTreeMap::new();
    for (k, v) in obj {
        if k == "step" {
            continue;
        }
        let x = match &v {
            Value::Null => f64::NAN,
            Value::Number(n) => n.as_f64().unwrap_or(f64::NAN),
            other => {
                return Err(format!(
                    "metric {k:?} must be a number or null, found {other}"
                ))
            }
        };
        values.insert(k, x);
    }
    Ok(StepRecord { step, values })
}

/// Reads `path`, one [`StepRecord`] per non-blank line. A missing file is
/// [`MetricsError::NoMetrics`]; a bad line is [`MetricsError::Malformed`] with its
/// 1-based number.
pub fn read_jsonl(path: &Path) -> Result<Vec<StepRecord>, MetricsError> {
    let text = std::fs::read_to_string(path).map_err(|source| {
        if source.kind() == std::io::ErrorKind::NotFound {
            MetricsError::NoMetrics { path: path.into() }
        } else {
            MetricsError::Read {
                path: path.into(),
                source,
            }
        }
    })?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            parse_line(l).map_err(|reason| MetricsError::Malformed {
                path: path.into(),
                line: i + 1,
                reason,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metrics(pairs: &[(&str, f64)]) -> BTreeMap<String, f64> {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn step_comes_first_then_names_in_order_and_non_finite_is_null() {
        let m = metrics(&[
            ("timing_s/gen", 0.25),
            ("actor/kl", f64::INFINITY),
            ("critic/rewards/mean", -1.5e-7),
            ("a\"quote", f64::NAN),
        ]);
        assert_eq!(
            format_line(7, &m),
            r#"{"step":7,"a\"quote":null,"actor/kl":null,"critic/rewards/mean":-1.5e-7,"timing_s/gen":0.25}"#
        );
    }

    #[test]
    fn lines_round_trip_through_a_file() {
        let steps = [
            metrics(&[("critic/rewards/mean", 0.125), ("actor/kl", 1.0 / 3.0)]),
            metrics(&[
                ("critic/rewards/mean", f64::NAN),
                ("perf/throughput", 12345.678),
            ]),
            metrics(&[]),
        ];
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let text: String = steps
            .iter()
            .enumerate()
            .map(|(i, m)| format_line(i as u64 + 1, m) + "\n")
            .collect();
        std::fs::write(&path, text).unwrap();
        let back = read_jsonl(&path).unwrap();
        assert_eq!(back.len(), steps.len());
        for (i, (r, m)) in back.iter().zip(&steps).enumerate() {
            assert_eq!(r.step, i as u64 + 1);
            assert_eq!(r.values.len(), m.len());
            for (k, v) in m {
                let got = r.get(k).unwrap();
                // Bit-exact: serde_json prints the shortest repr that parses back.
                assert!(
                    got.to_bits() == v.to_bits() || (got.is_nan() && v.is_nan()),
                    "{k}: {got} vs {v}"
                );
            }
        }
    }

    #[test]
    fn a_missing_file_and_a_bad_line_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let e = read_jsonl(&path).unwrap_err();
        assert!(matches!(e, MetricsError::NoMetrics { .. }), "{e}");
        let msg = e.to_string();
        assert!(
            msg.contains("metrics.jsonl") && msg.contains("fix"),
            "{msg}"
        );

        std::fs::write(&path, "{\"step\":1,\"x\":1}\n\n{\"step\":2,\"x\":\n").unwrap();
        let msg = read_jsonl(&path).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("{}:3: not JSON at column 14: EOF", path.display())),
            "{msg}"
        );

        for (line, want) in [
            ("[1,2]", "expected a JSON object"),
            ("{\"x\":1}", "no \"step\""),
            ("{\"step\":-1}", "non-negative integer"),
            (
                "{\"step\":1,\"x\":\"fast\"}",
                "metric \"x\" must be a number",
            ),
        ] {
            std::fs::write(&path, format!("{line}\n")).unwrap();
            let msg = read_jsonl(&path).unwrap_err().to_string();
            assert!(msg.contains(":1:") && msg.contains(want), "{line}: {msg}");
        }
    }
}
