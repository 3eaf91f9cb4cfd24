//! A run's curves as SVG files in `<run>/curves/`, drawn from its `metrics.jsonl` alone:
//! `loss.svg` and `lr.svg` (training loss and learning rate per optimizer step) and
//! `valid.svg` (each validation metric per epoch, with the popularity baseline's value as a
//! dashed line when the log has its `baseline` record).
//!
//! Reading only the log, it redraws any run directory: a finished run, an interrupted one (a
//! cut last line is skipped), or one written before the baseline record existed. It must not
//! change the log or anything else in the run directory but `curves/`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use plotters::prelude::*;
use serde_json::Value;

/// Why the curves could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum CurvesError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: no training steps to draw")]
    Empty { path: String },
    #[error("drawing {path}: {detail}")]
    Draw { path: String, detail: String },
}

/// What a log holds for the pictures.
#[derive(Debug, Default, PartialEq)]
struct Series {
    /// (step, loss, learning rate) of each step record.
    steps: Vec<(f64, f64, f64)>,
    /// Each validation's metrics by name (`ndcg@10`, ...), by epoch.
    valid: BTreeMap<u64, BTreeMap<String, f64>>,
    /// The popularity baseline's validation metrics, when recorded.
    baseline: BTreeMap<String, f64>,
    /// Lines that are not JSON objects (a cut last line of an interrupted run).
    skipped: usize,
}

/// Metric keys of an evaluation record (the rest is bookkeeping).
fn metric_entries(record: &serde_json::Map<String, Value>) -> BTreeMap<String, f64> {
    record
        .iter()
        .filter(|(k, _)| k.contains('@'))
        .filter_map(|(k, v)| Some((k.clone(), v.as_f64()?)))
        .collect()
}

impl Series {
    fn parse(text: &str) -> Series {
        let mut series = Series::default();
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let Ok(Value::Object(record)) = serde_json::from_str::<Value>(line) else {
                series.skipped += 1;
                continue;
            };
            let field = |name: &str| record.get(name).and_then(Value::as_f64);
            let split_is_valid = record.get("split").and_then(Value::as_str) == Some("valid");
            match record.get("kind").and_then(Value::as_str) {
                Some("step") => {
                    if let (Some(step), Some(loss), Some(lr)) =
                        (field("step"), field("loss"), field("lr"))
                    {
                        series.steps.push((step, loss, lr));
                    }
                }
                Some("eval") if split_is_valid => {
                    if let Some(epoch) = record.get("epoch").and_then(Value::as_u64) {
                        series.valid.insert(epoch, metric_entries(&record));
                    }
                }
                Some("baseline") if split_is_valid => series.baseline = metric_entries(&record),
                _ => {}
            }
        }
        series
    }
}

/// Draws the curves of the run in `run_dir` into `run_dir/curves/`; returns the files written.
pub fn draw(run_dir: &Path) -> Result<Vec<PathBuf>, CurvesError> {
    let log = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&log).map_err(|source| CurvesError::Io {
        path: log.display().to_string(),
        source,
    })?;
    let series = Series::parse(&text);
    if series.steps.is_empty() {
        return Err(CurvesError::Empty {
            path: log.display().to_string(),
        });
    }
    let dir = run_dir.join("curves");
    std::fs::create_dir_all(&dir).map_err(|source| CurvesError::Io {
        path: dir.display().to_string(),
        source,
    })?;
    let mut written = Vec::new();
    let points = |pick: fn(&(f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
        thin(series.steps.iter().map(|s| (s.0, pick(s))).collect())
    };
    for (name, title, values) in [
        ("loss.svg", "training loss", points(|s| s.1)),
        ("lr.svg", "learning rate", points(|s| s.2)),
    ] {
        let path = dir.join(name);
        line_chart(&path, title, "optimizer step", &values).map_err(|e| draw_error(&path, e))?;
        written.push(path);
    }
    if !series.valid.is_empty() {
        let path = dir.join("valid.svg");
        valid_chart(&path, &series).map_err(|e| draw_error(&path, e))?;
        written.push(path);
    }
    Ok(written)
}

fn draw_error(path: &Path, e: Box<dyn std::error::Error>) -> CurvesError {
    CurvesError::Draw {
        path: path.display().to_string(),
        detail: e.to_string(),
    }
}

/// Points drawn per line at most: a long run's steps are averaged in runs of consecutive ones
/// (the file stays small, and the average is what the eye would read from the noise anyway).
const MAX_POINTS: usize = 2000;

fn thin(points: Vec<(f64, f64)>) -> Vec<(f64, f64)> {
    if points.len() <= MAX_POINTS {
        return points;
    }
    let run = points.len().div_ceil(MAX_POINTS);
    points
        .chunks(run)
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect()
}

/// Whole numbers on an axis of steps or epochs.
fn whole(x: &f64) -> String {
    format!("{x:.0}")
}

/// The range of `values` widened a little (and made non-empty), for an axis.
fn padded(values: impl Iterator<Item = f64> + Clone) -> std::ops::Range<f64> {
    let lo = values.clone().fold(f64::INFINITY, f64::min);
    let hi = values.fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs().max(1e-12) * 1e-3);
    (lo - pad)..(hi + pad)
}

/// One line over the steps.
fn line_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    values: &[(f64, f64)],
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (800, 450)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(
            padded(values.iter().map(|v| v.0)),
            padded(values.iter().map(|v| v.1)),
        )?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .x_label_formatter(&whole)
        .y_desc(title)
        .draw()?;
    chart.draw_series(LineSeries::new(values.iter().copied(), &BLUE))?;
    root.present()?;
    Ok(())
}

/// A panel per validation metric: the model per epoch, popularity as a dashed line.
fn valid_chart(path: &Path, series: &Series) -> Result<(), Box<dyn std::error::Error>> {
    let names: Vec<&String> = series
        .valid
        .values()
        .flat_map(|m| m.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .collect();
    let cols = 2usize.min(names.len()).max(1);
    let rows = names.len().div_ceil(cols).max(1);
    let root = SVGBackend::new(path, (900, 260 * rows as u32 + 40)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(
        "validation per epoch (blue) against popularity (dashed)",
        ("sans-serif", 22),
    )?;
    let panels = root.split_evenly((rows, cols));
    for (name, panel) in names.iter().zip(panels.iter()) {
        let model: Vec<(f64, f64)> = series
            .valid
            .iter()
            .filter_map(|(epoch, m)| Some((*epoch as f64, *m.get(*name)?)))
            .collect();
        let pop = series.baseline.get(*name).copied();
        let epochs = padded(model.iter().map(|v| v.0));
        let y = padded(model.iter().map(|v| v.1).chain(pop));
        let mut chart = ChartBuilder::on(panel)
            .caption(name.as_str(), ("sans-serif", 16))
            .margin(8)
            .x_label_area_size(30)
            .y_label_area_size(55)
            .build_cartesian_2d(epochs.clone(), y)?;
        chart
            .configure_mesh()
            .x_desc("epoch")
            .x_labels(model.len().clamp(2, 10))
            .x_label_formatter(&whole)
            .draw()?;
        chart.draw_series(LineSeries::new(model.iter().copied(), &BLUE))?;
        chart.draw_series(model.iter().map(|&p| Circle::new(p, 3, BLUE.filled())))?;
        if let Some(pop) = pop {
            chart.draw_series(DashedLineSeries::new(
                [(epochs.start, pop), (epochs.end, pop)],
                6,
                4,
                ShapeStyle::from(&RED),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = r#"{"kind":"baseline","model":"pop","split":"valid","users":10,"ndcg@10":0.05,"recall@10":0.1}
{"kind":"step","epoch":1,"step":1,"loss":0.7,"lr":0.001,"grad_norm":1.0,"samples_per_s":5.0}
{"kind":"step","epoch":1,"step":2,"loss":0.6,"lr":0.002,"grad_norm":1.0,"samples_per_s":5.0}
{"kind":"eval","split":"valid","epoch":1,"step":2,"users":10,"ndcg@10":0.07,"recall@10":0.12,"seconds":0.1}
{"kind":"eval","split":"test","epoch":1,"step":2,"users":10,"ndcg@10":0.09,"recall@10":0.2,"seconds":0.1}
{"kind":"step","epoch":2,"st"#;

    /// Steps, validations and the baseline are picked out; test evaluations and a cut last
    /// line (an interrupted run) are not.
    #[test]
    fn the_log_gives_steps_validations_and_the_baseline() {
        let s = Series::parse(LOG);
        assert_eq!(s.steps, vec![(1.0, 0.7, 0.001), (2.0, 0.6, 0.002)]);
        assert_eq!(s.valid.len(), 1);
        assert_eq!(s.valid[&1]["ndcg@10"], 0.07);
        assert_eq!(s.baseline["recall@10"], 0.1);
        assert_eq!(s.skipped, 1);
    }

    #[test]
    fn long_runs_are_averaged_down_to_a_few_thousand_points() {
        let many: Vec<(f64, f64)> = (0..5000).map(|i| (i as f64, (i % 2) as f64)).collect();
        let thinned = thin(many);
        assert_eq!(thinned.len(), 1667);
        assert_eq!(thinned[0], (1.0, 1.0 / 3.0));
        assert_eq!(thin(vec![(1.0, 2.0)]), vec![(1.0, 2.0)]);
    }

    #[test]
    fn svg_files_are_drawn_next_to_the_log_and_a_log_without_steps_is_named() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("metrics.jsonl"), LOG).unwrap();
        let written = draw(dir.path()).unwrap();
        let names: Vec<String> = written
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        assert_eq!(names, vec!["loss.svg", "lr.svg", "valid.svg"]);
        let valid = std::fs::read_to_string(dir.path().join("curves/valid.svg")).unwrap();
        assert!(
            valid.starts_with("<svg") && valid.contains("ndcg@10"),
            "{valid}"
        );

        std::fs::write(dir.path().join("metrics.jsonl"), "").unwrap();
        let err = draw(dir.path()).unwrap_err().to_string();
        assert!(
            err.ends_with("metrics.jsonl: no training steps to draw"),
            "{err}"
        );
        let err = draw(&dir.path().join("nowhere")).unwrap_err().to_string();
        assert!(err.contains("nowhere/metrics.jsonl: "), "{err}");
    }
}
