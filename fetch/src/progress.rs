//! What a download shows while it runs: an `indicatif` bar on stderr when stderr is a
//! terminal, otherwise (or with `--quiet`) nothing until a one-line summary at the end
//! (none with `--quiet`).
//!
//! Must not: download, write files, or print anything but progress.

use std::io::IsTerminal;
use std::time::Instant;

use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The progress of one file.
pub struct Progress {
    label: String,
    bar: Option<ProgressBar>,
    quiet: bool,
    start: Instant,
    /// Bytes that were already there (resumed) when this run started.
    resumed_from: u64,
    got: u64,
}

impl Progress {
    /// Starts showing `label` of `total` bytes, `done` of which are already there.
    pub fn new(label: &str, total: Option<u64>, done: u64, quiet: bool) -> Progress {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| bar(label, total, done));
        Progress {
            label: label.to_string(),
            bar,
            quiet,
            start: Instant::now(),
            resumed_from: done,
            got: 0,
        }
    }

    /// `n` more bytes arrived.
    pub fn add(&mut self, n: u64) {
        self.got += n;
        if let Some(bar) = &self.bar {
            bar.inc(n);
        }
    }

    /// The transfer started over from byte 0 (the server ignored the range).
    pub fn restart(&mut self) {
        self.resumed_from = 0;
        self.got = 0;
        if let Some(bar) = &self.bar {
            bar.set_position(0);
        }
    }

    /// Prints a line (`fetch: ...`) above the bar, or on stderr when there is none.
    pub fn note(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(format!("fetch: {line}")),
            None => eprintln!("fetch: {line}"),
        }
    }

    /// Ends the display; prints the summary line unless quiet.
    pub fn finish(self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if !self.quiet {
            eprintln!("fetch: {}", self.summary());
        }
    }

    /// Ends the display without a summary (the download failed).
    pub fn abandon(self) {
        if let Some(bar) = &self.bar {
            bar.abandon();
        }
    }

    fn summary(&self) -> String {
        let secs = self.start.elapsed().as_secs_f64();
        let rate = self.got as f64 / secs.max(1e-3);
        let resumed = if self.resumed_from > 0 {
            format!(", resumed at {}", HumanBytes(self.resumed_from))
        } else {
            String::new()
        };
        format!(
            "got {}: {} in {secs:.1} s ({}/s{resumed})",
            self.label,
            HumanBytes(self.got),
            HumanBytes(rate as u64)
        )
    }
}

fn bar(label: &str, total: Option<u64>, done: u64) -> ProgressBar {
    let bar = ProgressBar::with_draw_target(total, ProgressDrawTarget::stderr());
    let template = "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}";
    if let Ok(style) = ProgressStyle::with_template(template) {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(format!("fetch: {label}"));
    bar.set_position(done);
    bar
}
