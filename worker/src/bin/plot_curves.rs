//! `plot-curves RUN_DIR...`: (re)draws the curves of runs from their `metrics.jsonl` into
//! `RUN_DIR/curves/` (`loss.svg`, `lr.svg`, `valid.svg`), for any run directory: a finished
//! one, an interrupted one, or one whose pictures were deleted. Exit code 2 (one line naming
//! the path) for a log that is missing, empty, a FIFO, a device or too large, or a `curves`
//! that cannot be written; values near the ends of f64 are drawn at a limit, never a hang.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use worker::curves::{self, CurvesError};

/// Draw a run's training loss, learning rate and validation metrics (against the popularity
/// baseline) as SVG files in RUN_DIR/curves/, from RUN_DIR/metrics.jsonl.
#[derive(Debug, Parser)]
#[command(name = "plot-curves", version)]
struct Cli {
    /// Run directories (`<run.output_dir>/<run.name>`, e.g. runs/default).
    #[arg(required = true)]
    run_dirs: Vec<PathBuf>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let mut code = ExitCode::SUCCESS;
    for dir in &cli.run_dirs {
        match curves::draw(dir) {
            Ok(files) => {
                for file in files {
                    println!("{}", file.display());
                }
            }
            Err(e) => {
                eprintln!("plot-curves: error: {e}");
                // The log and the run directory are the caller's input; drawing is ours.
                code = match e {
                    CurvesError::Draw { .. } => ExitCode::from(1),
                    _ => ExitCode::from(2),
                };
            }
        }
    }
    code
}
