//! A run's curves as SVG files in `<run>/curves/`, drawn from its `metrics.jsonl` alone:
//! `loss.svg` and `lr.svg` (training loss and learning rate per optimizer step) and
//! `valid.svg` (each validation metric per epoch, with the popularity baseline's value as a
//! dashed line when the log has its `baseline` record).
//!
//! Reading only the log, it redraws any run directory: a finished run, an interrupted one (a
//! cut last line is skipped), or one written before the baseline record existed. Values beyond
//! ±[`AXIS_LIMIT`] (a diverged loss of 1e308) are drawn at the limit, with a note in the title,
//! so that every axis has a finite width.
//!
//! It must not change the log or anything else in the run directory but `curves/`, write
//! through a link (a `curves` that is one is refused; the pictures are staged and renamed into
//! place, replacing a link at their names rather than following it), or block on a log that is
//! a FIFO or a device.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::files::{self, InputError, OutputError, Staging};
use plotters::prelude::*;
use serde_json::Value;

/// Why the curves could not be drawn.
#[derive(Debug, thiserror::Error)]
pub enum CurvesError {
    /// The log cannot be read (the message names it).
    #[error("{0}")]
    Input(#[from] InputError),
    /// The pictures cannot be written (the message names the path).
    #[error("{0}")]
    Output(#[from] OutputError),
    #[error("{path}: no training steps to draw")]
    Empty { path: String },
    /// `curves` is something the pictures must not go into.
    #[error("{path}: is {what}, not a directory; nothing was written")]
    Target { path: String, what: &'static str },
    #[error("drawing {path}: {detail}")]
    Draw { path: String, detail: String },
}

/// Largest log read (a million logged steps are about 150 MB).
const MAX_LOG: u64 = 1 << 30;

/// Largest magnitude drawn: plotters' axis arithmetic needs the axis's width to be finite
/// (±1e308 is an infinite width, on which it loops forever); larger values are drawn at it.
pub const AXIS_LIMIT: f64 = 1e100;

/// Validation metrics drawn at most (a panel each).
const MAX_PANELS: usize = 32;

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
    /// Values beyond ±[`AXIS_LIMIT`], drawn at it.
    clamped: usize,
}

/// `x` within ±[`AXIS_LIMIT`] (what was beyond counted in `clamped`); `None` when not finite.
fn drawable(x: f64, clamped: &mut usize) -> Option<f64> {
    if !x.is_finite() {
        return None;
    }
    let y = x.clamp(-AXIS_LIMIT, AXIS_LIMIT);
    if y != x {
        *clamped += 1;
    }
    Some(y)
}

/// Metric keys of an evaluation record (the rest is bookkeeping), their values drawable.
fn metric_entries(
    record: &serde_json::Map<String, Value>,
    clamped: &mut usize,
) -> BTreeMap<String, f64> {
    record
        .iter()
        .filter(|(k, _)| k.contains('@'))
        .filter_map(|(k, v)| Some((k.clone(), drawable(v.as_f64()?, clamped)?)))
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
            series.add(&record);
        }
        series
    }

    fn add(&mut self, record: &serde_json::Map<String, Value>) {
        let clamped = &mut self.clamped;
        let mut field =
            |name: &str| drawable(record.get(name).and_then(Value::as_f64)?, &mut *clamped);
        let split_is_valid = record.get("split").and_then(Value::as_str) == Some("valid");
        match record.get("kind").and_then(Value::as_str) {
            Some("step") => {
                if let (Some(step), Some(loss), Some(lr)) =
                    (field("step"), field("loss"), field("lr"))
                {
                    self.steps.push((step, loss, lr));
                }
            }
            Some("eval") if split_is_valid => {
                if let Some(epoch) = record.get("epoch").and_then(Value::as_u64) {
                    let metrics = metric_entries(record, &mut self.clamped);
                    self.valid.insert(epoch, metrics);
                }
            }
            Some("baseline") if split_is_valid => {
                self.baseline = metric_entries(record, &mut self.clamped)
            }
            _ => {}
        }
    }

    /// What the titles add when values were drawn at the limit.
    fn note(&self) -> String {
        if self.clamped == 0 {
            String::new()
        } else {
            format!(
                " ({} values beyond ±{AXIS_LIMIT:e} drawn at it)",
                self.clamped
            )
        }
    }

    /// Every picture the log gives: (file name, SVG text).
    fn pictures(&self, dir: &Path) -> Result<Vec<(&'static str, String)>, CurvesError> {
        let points = |pick: fn(&(f64, f64, f64)) -> f64| -> Vec<(f64, f64)> {
            thin(self.steps.iter().map(|s| (s.0, pick(s))).collect())
        };
        let note = self.note();
        let mut pictures = Vec::new();
        for (name, title, values) in [
            ("loss.svg", "training loss", points(|s| s.1)),
            ("lr.svg", "learning rate", points(|s| s.2)),
        ] {
            let svg = line_chart(&format!("{title}{note}"), title, "optimizer step", &values)
                .map_err(|e| draw_error(&dir.join(name), e))?;
            pictures.push((name, svg));
        }
        if !self.valid.is_empty() {
            let svg = valid_chart(self).map_err(|e| draw_error(&dir.join("valid.svg"), e))?;
            pictures.push(("valid.svg", svg));
        }
        Ok(pictures)
    }
}

/// Draws the curves of the run in `run_dir` into `run_dir/curves/`; returns the files written.
/// The pictures replace the previous ones together, or none of them does.
pub fn draw(run_dir: &Path) -> Result<Vec<PathBuf>, CurvesError> {
    let log = run_dir.join("metrics.jsonl");
    let text = files::read_input_text(&log, MAX_LOG)?;
    let series = Series::parse(&text);
    if series.steps.is_empty() {
        return Err(CurvesError::Empty {
            path: log.display().to_string(),
        });
    }
    let dir = curves_dir(run_dir)?;
    let pictures = series.pictures(&dir)?;
    let staging = Staging::new(&dir)?;
    for (name, svg) in &pictures {
        staging.write(name, svg.as_bytes())?;
    }
    let names: Vec<&str> = pictures.iter().map(|(name, _)| *name).collect();
    staging.commit(&names)?;
    Ok(names.iter().map(|name| dir.join(name)).collect())
}

/// `run_dir/curves`, created when missing; a link or anything else but a directory there is
/// refused (the pictures would go wherever it points).
fn curves_dir(run_dir: &Path) -> Result<PathBuf, CurvesError> {
    let dir = run_dir.join("curves");
    let target = |what| CurvesError::Target {
        path: dir.display().to_string(),
        what,
    };
    match std::fs::symlink_metadata(&dir) {
        Ok(meta) if meta.file_type().is_symlink() => Err(target("a symbolic link")),
        Ok(meta) if !meta.is_dir() => Err(target(files::file_type_name(&meta.file_type()))),
        Ok(_) => Ok(dir),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => match std::fs::create_dir(&dir) {
            Ok(()) => Ok(dir),
            Err(error) => Err(OutputError::Io { path: dir, error }.into()),
        },
        Err(error) => Err(OutputError::Io { path: dir, error }.into()),
    }
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
            // Each term divided first: a sum of values near the limit stays finite.
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0 / n).sum::<f64>(),
                c.iter().map(|p| p.1 / n).sum::<f64>(),
            )
        })
        .collect()
}

/// Whole numbers on an axis of steps or epochs (in scientific notation when they are huge).
fn whole(x: &f64) -> String {
    if x.abs() < 1e15 {
        format!("{x:.0}")
    } else {
        format!("{x:e}")
    }
}

/// The range of `values` widened a little (and made non-empty), for an axis. Values are
/// within ±[`AXIS_LIMIT`], so the range's width is finite.
fn padded(values: impl Iterator<Item = f64> + Clone) -> std::ops::Range<f64> {
    let lo = values.clone().fold(f64::INFINITY, f64::min);
    let hi = values.fold(f64::NEG_INFINITY, f64::max);
    if !lo.is_finite() || !hi.is_finite() {
        return 0.0..1.0;
    }
    let pad = ((hi - lo) * 0.05).max(hi.abs().max(lo.abs()).max(1e-12) * 1e-3);
    (lo - pad)..(hi + pad)
}

/// One line over the steps, as SVG text.
fn line_chart(
    caption: &str,
    y_label: &str,
    x_label: &str,
    values: &[(f64, f64)],
) -> Result<String, Box<dyn std::error::Error>> {
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (800, 450)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(caption, ("sans-serif", 22))
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
            .y_desc(y_label)
            .draw()?;
        chart.draw_series(LineSeries::new(values.iter().copied(), &BLUE))?;
        root.present()?;
    }
    Ok(svg)
}

/// A panel per validation metric (the first [`MAX_PANELS`]): the model per epoch, popularity
/// as a dashed line; SVG text.
fn valid_chart(series: &Series) -> Result<String, Box<dyn std::error::Error>> {
    let names: Vec<&String> = series
        .valid
        .values()
        .flat_map(|m| m.keys())
        .collect::<std::collections::BTreeSet<_>>()
        .into_iter()
        .take(MAX_PANELS)
        .collect();
    let cols = 2usize.min(names.len()).max(1);
    let rows = names.len().div_ceil(cols).max(1);
    let mut svg = String::new();
    {
        let root =
            SVGBackend::with_string(&mut svg, (900, 260 * rows as u32 + 40)).into_drawing_area();
        root.fill(&WHITE)?;
        let title = format!(
            "validation per epoch (blue) against popularity (dashed){}",
            series.note()
        );
        let root = root.titled(&title, ("sans-serif", 22))?;
        let panels = root.split_evenly((rows, cols));
        for (name, panel) in names.iter().zip(panels.iter()) {
            metric_panel(panel, name, series)?;
        }
        root.present()?;
    }
    Ok(svg)
}

/// One validation metric's panel.
fn metric_panel<DB: DrawingBackend>(
    panel: &DrawingArea<DB, plotters::coord::Shift>,
    name: &str,
    series: &Series,
) -> Result<(), Box<dyn std::error::Error>>
where
    DB::ErrorType: 'static,
{
    let model: Vec<(f64, f64)> = series
        .valid
        .iter()
        .filter_map(|(epoch, m)| Some((*epoch as f64, *m.get(name)?)))
        .collect();
    let pop = series.baseline.get(name).copied();
    let epochs = padded(model.iter().map(|v| v.0));
    let y = padded(model.iter().map(|v| v.1).chain(pop));
    let mut chart = ChartBuilder::on(panel)
        .caption(name, ("sans-serif", 16))
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
        assert!(
            err.ends_with("nowhere/metrics.jsonl: no such file"),
            "{err}"
        );
    }

    /// Values near the ends of f64 (a diverged loss) are drawn at the limit, said in the
    /// title: before, ±1e308 made an axis of infinite width, on which plotters looped forever.
    #[test]
    fn values_near_the_ends_of_f64_are_drawn_at_the_limit() {
        let dir = tempfile::tempdir().unwrap();
        let log = [
            r#"{"kind":"step","epoch":1,"step":1,"loss":1e308,"lr":0.001}"#,
            r#"{"kind":"step","epoch":1,"step":2,"loss":-1e308,"lr":1.7e308}"#,
            r#"{"kind":"step","epoch":1,"step":3,"loss":"NaN","lr":0.001}"#,
            r#"{"kind":"step","epoch":1,"step":1e308,"loss":1e-308,"lr":0.001}"#,
            r#"{"kind":"step","epoch":1,"step":5,"loss":1e999,"lr":0.001}"#,
            r#"{"kind":"eval","split":"valid","epoch":1,"ndcg@10":1e308,"recall@10":-1e308}"#,
            r#"{"kind":"baseline","split":"valid","ndcg@10":-1.7e308}"#,
        ]
        .join("\n");
        std::fs::write(dir.path().join("metrics.jsonl"), log).unwrap();
        let written = draw(dir.path()).unwrap();
        assert_eq!(written.len(), 3);
        let loss = std::fs::read_to_string(dir.path().join("curves/loss.svg")).unwrap();
        assert!(loss.contains("values beyond ±1e100 drawn at it"), "{loss}");
        // Many steps near the limit average to a finite value.
        let many: Vec<String> = (0..5000)
            .map(|i| format!(r#"{{"kind":"step","step":{i},"loss":1e308,"lr":1}}"#))
            .collect();
        std::fs::write(dir.path().join("metrics.jsonl"), many.join("\n")).unwrap();
        draw(dir.path()).unwrap();
    }

    /// Links at the pictures' names are replaced, not written through; a `curves` that is a
    /// link is refused; the log may not be a FIFO.
    #[test]
    fn nothing_outside_the_run_is_written_and_a_fifo_log_is_refused() {
        use std::os::unix::fs::symlink;
        let dir = tempfile::tempdir().unwrap();
        let (run, outside) = (dir.path().join("run"), dir.path().join("outside"));
        std::fs::create_dir_all(run.join("curves")).unwrap();
        std::fs::write(&outside, "precious").unwrap();
        std::fs::write(run.join("metrics.jsonl"), LOG).unwrap();
        symlink(&outside, run.join("curves/loss.svg")).unwrap();
        draw(&run).unwrap();
        assert_eq!(std::fs::read_to_string(&outside).unwrap(), "precious");
        let svg = std::fs::read_to_string(run.join("curves/loss.svg")).unwrap();
        assert!(svg.starts_with("<svg"));
        let mut left: Vec<String> = std::fs::read_dir(run.join("curves"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["loss.svg", "lr.svg", "valid.svg"]);

        std::fs::remove_dir_all(run.join("curves")).unwrap();
        let elsewhere = dir.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        symlink(&elsewhere, run.join("curves")).unwrap();
        let err = draw(&run).unwrap_err().to_string();
        assert!(
            err.ends_with("curves: is a symbolic link, not a directory; nothing was written"),
            "{err}"
        );
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0);

        std::fs::remove_file(run.join("metrics.jsonl")).unwrap();
        nix::unistd::mkfifo(&run.join("metrics.jsonl"), nix::sys::stat::Mode::S_IRWXU).unwrap();
        let err = draw(&run).unwrap_err().to_string();
        assert!(
            err.ends_with("metrics.jsonl: is a FIFO, not a file"),
            "{err}"
        );
    }
}
