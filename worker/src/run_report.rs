//! What the worker tells its user: the log format of its binaries, and what rank 0 leaves behind
//! when a run ends — `memory.json` (the estimate term by term next to what was measured), the
//! `summary` record of `metrics.jsonl`, and the printed summary with the popularity baseline
//! beside the model; and, for `model.kind = "pop"`, the baseline's own results. It reports; it
//! computes nothing that the run depends on.

use std::path::Path;

use common::config::Config;
use common::memory::{mib_text, DataShape, MemoryEstimate};
use common::train_plan::TrainPlan;
use serde_json::json;
use tch::Device;

use crate::memory::mib;
use crate::run_dir::{MetricsLog, RunDirError};
use crate::trainer::{eval_record, TrainReport};
use recommender::eval::Metrics;
use recommender::Split;

/// The exit code of a helper binary (`program`) whose `run` gave `result`: 0; 75
/// (`EXIT_REGROUP`) when training stopped at a checkpoint to be resumed (preempted,
/// re-forming); or 1 after one `program: error: ...` line with the whole chain of causes.
pub fn exit_code(program: &str, result: anyhow::Result<()>) -> std::process::ExitCode {
    let planned = |e: &anyhow::Error| {
        e.chain().any(|c| {
            c.downcast_ref::<crate::trainer::TrainError>()
                .is_some_and(crate::trainer::TrainError::is_planned_stop)
        })
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        // Stopped together at a checkpoint (preempted, re-forming): resumable, not a failure.
        Err(e) if planned(&e) => {
            eprintln!("{program}: {e:#}");
            std::process::ExitCode::from(common::env_contract::EXIT_REGROUP as u8)
        }
        Err(e) => {
            eprintln!("{program}: error: {e:#}");
            std::process::ExitCode::from(1)
        }
    }
}

/// Log lines of the worker's binaries: on stderr, without timestamps or targets (the launcher
/// prefixes each line with its rank), in colour only on a terminal.
pub fn init_logging() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .without_time()
        .with_target(false)
        .init();
}

/// Rank 0's memory at the milestones of start-up (bytes).
#[derive(Debug, Clone, Copy, Default)]
pub struct Milestones {
    pub runtime_rss: u64,
    pub data_rss: u64,
    pub model_rss: u64,
    pub model_peak: u64,
}

/// Everything the end-of-run report shows.
pub struct RunSummary<'a> {
    pub plan: &'a TrainPlan,
    pub device: Device,
    pub shape: &'a DataShape,
    pub estimate: &'a MemoryEstimate,
    pub milestones: Milestones,
    pub report: &'a TrainReport,
    pub pop_valid: &'a Metrics,
    /// The baseline on `test` and on the cold-start splits, in that order.
    pub pop_tests: &'a [(Split, Metrics)],
    /// The EASE baseline on `test` (none when it was left out or skipped).
    pub ease_tests: &'a [(Split, Metrics)],
    pub run_dir: &'a Path,
    pub world_size: u32,
}

impl RunSummary<'_> {
    /// Writes `memory.json`, appends the summary record and prints the summary.
    pub fn finish(&self) -> Result<(), RunDirError> {
        self.write_memory_json();
        MetricsLog::open(&self.run_dir.join("metrics.jsonl"))?.append(&self.record())?;
        self.print();
        self.draw_curves();
        Ok(())
    }

    /// The curves next to `metrics.jsonl`, and where they are (a failure to draw them is a
    /// warning: `plot-curves` can redraw them).
    fn draw_curves(&self) {
        match crate::curves::draw(self.run_dir) {
            Ok(files) => {
                let names: Vec<String> = files
                    .iter()
                    .filter_map(|f| Some(f.file_name()?.to_string_lossy().into_owned()))
                    .collect();
                println!(
                    "  curves: {}/curves/{{{}}}",
                    self.run_dir.display(),
                    names.join(",")
                );
            }
            Err(e) => tracing::warn!("no curves: {e} (redraw with `plot-curves RUN_DIR`)"),
        }
    }

    fn peaks(&self) -> (Vec<f64>, Option<Vec<f64>>) {
        let r = self.report;
        (
            r.peak_rss.iter().map(|&b| mib(b)).collect(),
            r.peak_device
                .as_ref()
                .map(|v| v.iter().map(|&b| mib(b)).collect()),
        )
    }

    /// The estimate next to what rank 0 measured, term by term where a measurement exists (a
    /// failure to write it is a warning: the run's results are elsewhere).
    fn write_memory_json(&self) {
        let m = self.milestones;
        let (peak_rss, peak_device) = self.peaks();
        let terms: Vec<serde_json::Value> = self
            .estimate
            .terms
            .iter()
            .map(|t| json!({"name": t.name, "mib": mib(t.bytes), "phase": format!("{:?}", t.held).to_lowercase(), "detail": t.detail}))
            .collect();
        let (b, s) = (self.plan.batch, self.shape);
        let record = json!({
            "device": format!("{:?}", self.device),
            "plan": {"global": b.global, "micro": b.micro, "grad_accum": b.grad_accum, "world": b.world_size},
            "data": {"users": s.users, "items": s.items, "interactions": s.interactions, "user_tokens": s.user_tokens, "item_tokens": s.item_tokens},
            "estimate": {"peak_mib": mib(self.estimate.peak_bytes()), "terms": terms},
            "measured": {
                "runtime_rss_mib": mib(m.runtime_rss),
                "after_data_rss_mib": mib(m.data_rss),
                "after_model_rss_mib": mib(m.model_rss),
                "after_model_peak_mib": mib(m.model_peak),
                "peak_rss_mib": peak_rss,
                "peak_device_mib": peak_device,
            },
        });
        let path = self.run_dir.join("memory.json");
        if let Err(e) = std::fs::write(&path, format!("{record:#}\n")) {
            tracing::warn!("could not write {}: {e}", path.display());
        }
    }

    /// The `summary` record of `metrics.jsonl`: when this run took no step (a finished run
    /// evaluated again), the training's own record, kept.
    fn record(&self) -> serde_json::Value {
        let r = self.report;
        if let (0, Some(earlier)) = (r.steps_run, &r.earlier_summary) {
            return earlier.clone();
        }
        let (peak_rss, peak_device) = self.peaks();
        json!({
            "kind": "summary",
            "steps": r.steps,
            "epochs": r.epochs_done,
            "stopped_early": r.stopped_early,
            "last_loss": r.last_loss,
            "samples_per_s": r.samples_per_s,
            "steady_samples_per_s": r.steady_samples_per_s,
            "seconds": {
                "steps": r.seconds.steps, "evaluation": r.seconds.evaluation,
                "checkpoints": r.seconds.checkpoints, "total": r.seconds.total,
            },
            "seconds_per_epoch": r.seconds_per_epoch,
            "peak_rss_mib": peak_rss,
            "peak_device_mib": peak_device,
            "estimated_peak_mib": mib(self.estimate.peak_bytes()),
            "world_size": self.world_size,
            "time_per_step_ms": r.rank_times.iter().map(|t| json!({
                "compute": t.compute_ms, "data": t.data_ms,
                "collective": t.collective_ms, "update": t.update_ms,
            })).collect::<Vec<_>>(),
            "straggler_rank": crate::trainer::straggler(&r.rank_times).map(|s| s.0),
            "sent_mib_per_step": r.sent_per_step.iter().map(|&b| mib(b)).collect::<Vec<_>>(),
            "steady_time_per_step_ms": r.steady_rank_time.map(|t| json!({
                "compute": t.compute_ms, "data": t.data_ms,
                "collective": t.collective_ms, "update": t.update_ms,
            })),
        })
    }

    fn print(&self) {
        let r = self.report;
        let peak: Vec<String> = r
            .peak_rss
            .iter()
            .map(|&b| format!("{:.0}", mib(b)))
            .collect();
        println!(
            "summary: {} steps, {} epoch(s){}, {}, peak RSS per rank [{}] MiB",
            r.steps,
            r.epochs_done,
            if r.stopped_early {
                " (stopped early)"
            } else {
                ""
            },
            self.training_figures(),
            peak.join(", ")
        );
        for line in crate::trainer::rank_time_lines(&r.rank_times, self.device.is_cuda()) {
            println!("{line}");
        }
        if !r.sent_per_step.is_empty() {
            let sent: Vec<String> = r
                .sent_per_step
                .iter()
                .map(|&b| format!("{:.2}", mib(b)))
                .collect();
            println!(
                "  traffic: sent per step per rank [{}] MiB (dist.zero = {})",
                sent.join(", "),
                self.plan.config.dist.zero
            );
        }
        let measured_peak = match &r.peak_device {
            Some(dev) => dev.iter().copied().max().unwrap_or(0),
            None => r.peak_rss.iter().copied().max().unwrap_or(0),
        };
        println!(
            "  memory: estimated peak {} per worker, measured {} ({}; memory.json has each term)",
            mib_text(self.estimate.peak_bytes()),
            mib_text(measured_peak),
            if r.peak_device.is_some() {
                "device memory, NVML"
            } else {
                "peak RSS"
            }
        );
        if let Some(best) = &r.best {
            println!(
                "  best valid {} {:.4} at epoch {} (step {}); model in {}",
                best.metric,
                best.value,
                best.epoch,
                best.step,
                self.run_dir.join("best").display()
            );
            println!("  {:<15}{}", "valid", best.valid.summary_line());
        }
        let ours: Vec<(Split, &Metrics)> = r
            .test
            .iter()
            .map(|m| (Split::Test, m))
            .chain(r.cold.iter().map(|(s, m)| (*s, m)))
            .collect();
        for (split, m) in &ours {
            println!("  {:<15}{}", split.label(), m.summary_line());
        }
        println!("  {:<15}{}", "pop valid", self.pop_valid.summary_line());
        for (split, m) in self.pop_tests {
            let label = format!("pop {}", split.label());
            println!("  {label:<15}{}", m.summary_line());
        }
        for (split, m) in self.ease_tests {
            let label = format!("ease {}", split.label());
            println!("  {label:<15}{}", m.summary_line());
        }
        for (split, m) in &ours {
            self.print_comparison(*split, m);
        }
    }

    /// `last loss 0.5682, 122768 samples/s, 5.9 s/epoch`: this run's, or the earlier run's
    /// (from its summary record) when this one took no step.
    fn training_figures(&self) -> String {
        let r = self.report;
        let (loss, rate, epoch_secs, when) = match (r.steps_run, &r.earlier_summary) {
            (0, Some(earlier)) => (
                earlier["last_loss"].as_f64(),
                earlier["samples_per_s"].as_f64().unwrap_or(0.0),
                earlier["seconds_per_epoch"].as_f64(),
                " (trained by an earlier run; this one only evaluated)",
            ),
            (0, None) => return "trained by an earlier run (this one only evaluated)".into(),
            _ => (r.last_loss, r.samples_per_s, r.seconds_per_epoch, ""),
        };
        let beside = match r.steps_run {
            0 => String::new(),
            _ => format!(
                " (training steps: {:.1} s{}; not counted: evaluation {:.1} s, checkpoints {:.1} s)",
                r.seconds.steps,
                r.steady_samples_per_s.map_or(String::new(), |s| format!(
                    ", {s:.0} samples/s after {} warm-up steps",
                    crate::trainer::WARM_UP_STEPS
                )),
                r.seconds.evaluation,
                r.seconds.checkpoints,
            ),
        };
        format!(
            "last loss {}, {rate:.0} samples/s{beside}, {} s/epoch{when}",
            loss.map_or("-".into(), |l| format!("{l:.4}")),
            epoch_secs.map_or("-".into(), |s| format!("{s:.1}")),
        )
    }

    /// `test ndcg@10: 0.1675 vs popularity 0.0934 (+79.4%), EASE 0.1599 (+4.8%, 95% CI -1.0% to
    /// +10.5%)` (paired over the users both ranked), and so for a
    /// cold-start split (`cold items ndcg@10: ...`; EASE scores warm items only).
    fn print_comparison(&self, split: Split, tested: &Metrics) {
        let metric = self.plan.config.eval.metric.trim().to_ascii_lowercase();
        let pop = self.pop_tests.iter().find(|(s, _)| *s == split);
        if let (Some(ours), Some(pop)) =
            (tested.get(&metric), pop.and_then(|(_, m)| m.get(&metric)))
        {
            let change = if pop > 0.0 {
                format!("{:+.1}%", (ours / pop - 1.0) * 100.0)
            } else {
                "popularity has nothing to go on".to_string()
            };
            let name = split.label();
            let ease = (self.ease_tests.iter().find(|(s, _)| *s == split))
                .and_then(|(_, m)| Some((m.get(&metric)?, m)))
                .map_or(String::new(), |(e, m)| {
                    let versus = ours_vs(tested, m, &metric);
                    format!(", EASE {e:.4}{versus}")
                });
            println!("  {name} {metric}: {ours:.4} vs popularity {pop:.4} ({change}){ease}");
        }
    }
}

/// ` (+4.8%, 95% CI -1.0% to +10.5%)`: how far `ours` is from `base` on `metric`, paired over the
/// users both evaluated; empty where either lacks its users' metrics (read back from a file).
fn ours_vs(ours: &Metrics, base: &Metrics, metric: &str) -> String {
    let (Some(a), Some(b)) = (&ours.per_user, &base.per_user) else {
        return String::new();
    };
    recommender::per_user::paired(a, b, metric)
        .map_or(String::new(), |p| format!(" ({})", p.relative_line()))
}

/// `model.kind = "pop"`: the baseline's results are the run's (an earlier run's files are moved
/// aside first, not lost).
pub fn popularity_only(
    run_dir: &Path,
    config: &Config,
    valid: &Metrics,
    tests: &[(Split, Metrics)],
) -> Result<(), RunDirError> {
    if let Some((to, moved)) = crate::run_dir::set_aside(run_dir, 0, None)? {
        tracing::info!(
            "moved {} of an earlier run to {}",
            moved.join(", "),
            to.display()
        );
    }
    let io = |path: &Path| {
        let path = path.display().to_string();
        move |source| RunDirError::Io { path, source }
    };
    let path = run_dir.join("config.resolved.toml");
    let toml = config
        .to_toml()
        .map_err(|e| std::io::Error::other(e.to_string()))
        .map_err(io(&path))?;
    std::fs::write(&path, toml).map_err(io(&path))?;
    let mut log = MetricsLog::open(&run_dir.join("metrics.jsonl"))?;
    log.append(&eval_record("valid", 0, 0, valid, 0.0))?;
    for (split, m) in tests {
        log.append(&eval_record(split.name(), 0, 0, m, 0.0))?;
    }
    println!("summary: model pop (nothing to train)");
    println!("  {:<15}{}", "valid", valid.summary_line());
    for (split, m) in tests {
        println!("  {:<15}{}", split.label(), m.summary_line());
    }
    Ok(())
}
