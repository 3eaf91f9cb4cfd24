//! The progress channel from workers to `launch`: what a worker reports as it trains, one JSON
//! line per report on a pipe that `launch` opens for it as descriptor [`PROGRESS_FD`] and names
//! in [`PROGRESS_FD_VAR`] (only when it shows a live display: its stderr is a terminal).
//!
//! It owns the record and its wire form, which both ends must agree on. It must not open or
//! write descriptors (the worker does), decide what is shown (the launcher's display) or when
//! a report is due (the trainer).

use serde::{Deserialize, Serialize};

/// The environment variable naming the descriptor a worker writes its reports to.
pub const PROGRESS_FD_VAR: &str = "GPTREC_PROGRESS_FD";

/// The descriptor number `launch` gives the pipe in every worker.
pub const PROGRESS_FD: i32 = 3;

/// The variable that turns live displays off (`plain`) for a person who wants lines only.
pub const PLAIN_VAR: &str = "GPTREC_PROGRESS";

/// The bar both displays draw (`launch`'s for the job, a lone worker's for itself): indicatif's
/// template, the message carrying epoch, loss and samples/s, the prefix the ETA
/// ([`eta_prefix`]). Not indicatif's own `{eta}`: it guesses from how often the bar was moved,
/// and a bar drawn before the first step, or moved in jumps, gets minutes for a run of seconds.
pub const BAR_TEMPLATE: &str = "{msg} [{bar:30}] step {pos}/{len}{prefix}";

/// The bar's prefix for `eta_s`: ` ETA 12s`, or nothing before the first step.
pub fn eta_prefix(eta_s: Option<f64>) -> String {
    eta_s.map_or_else(String::new, |s| format!(" ETA {}", duration_text(s)))
}

/// `1h02m`, `3m05s`, `12s`.
pub fn duration_text(secs: f64) -> String {
    let s = secs.max(0.0).round() as u64;
    match (s / 3600, (s % 3600) / 60, s % 60) {
        (0, 0, s) => format!("{s}s"),
        (0, m, s) => format!("{m}m{s:02}s"),
        (h, m, _) => format!("{h}h{m:02}m"),
    }
}

/// Whether to draw a live display: a person watches (`stderr_is_terminal`) and
/// [`PLAIN_VAR`] is not `plain`.
pub fn wanted(stderr_is_terminal: bool) -> bool {
    stderr_is_terminal && std::env::var(PLAIN_VAR).map_or(true, |v| v != "plain")
}

/// Where a rank is in its run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Training steps.
    Train,
    /// Validating or testing.
    Evaluate,
    /// Training and evaluation are over.
    Done,
}

/// One report of one rank.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProgressRecord {
    /// Global rank of the reporting worker.
    pub rank: u32,
    pub phase: Phase,
    /// The epoch under way (1-based) and the run's number of epochs.
    pub epoch: u64,
    pub epochs: u64,
    /// Optimizer steps done (counting those of earlier runs this one resumed) and the run's
    /// total.
    pub step: u64,
    pub total_steps: u64,
    /// Mean loss of the last step over the global batch, when a step has run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss: Option<f64>,
    /// Samples per second of this run's steps so far (global batch), when a step has run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub samples_per_s: Option<f64>,
    /// Seconds left at this run's pace so far, when a step has run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eta_s: Option<f64>,
}

impl ProgressRecord {
    /// The record as one line (newline included).
    pub fn to_line(&self) -> String {
        // Serialising plain numbers and enums cannot fail.
        let mut line = serde_json::to_string(self).unwrap_or_default();
        line.push('\n');
        line
    }

    /// A record from one line; `None` for anything else (a reader skips what it cannot use).
    pub fn from_line(line: &str) -> Option<ProgressRecord> {
        serde_json::from_str(line.trim_end()).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_eta_reads_in_the_largest_useful_units() {
        assert_eq!(eta_prefix(None), "");
        assert_eq!(eta_prefix(Some(1.6)), " ETA 2s");
        assert_eq!(eta_prefix(Some(185.0)), " ETA 3m05s");
        assert_eq!(eta_prefix(Some(3720.0)), " ETA 1h02m");
    }

    #[test]
    fn a_record_survives_its_line_and_junk_is_skipped() {
        let record = ProgressRecord {
            rank: 2,
            phase: Phase::Train,
            epoch: 1,
            epochs: 3,
            step: 17,
            total_steps: 90,
            loss: Some(0.5),
            samples_per_s: None,
            eta_s: Some(1.5),
        };
        let line = record.to_line();
        assert!(
            line.ends_with('\n') && !line.contains("samples_per_s"),
            "{line}"
        );
        assert!(line.contains(r#""phase":"train""#), "{line}");
        assert_eq!(ProgressRecord::from_line(&line), Some(record));
        for junk in ["", "step 3", "{\"rank\":1}", "\u{0}\u{1}"] {
            assert_eq!(ProgressRecord::from_line(junk), None, "{junk:?}");
        }
    }
}
