//! The live progress display of `launch` when its stderr is a terminal: one bar for the job
//! (epoch, step of total, loss, samples/s, ETA), one line per rank while the ranks drift apart
//! (one still starting, evaluating or stalled while the others go on), and every worker or
//! launcher line printed above it.
//!
//! Owns: the reading ends of the workers' progress pipes (a thread per worker, fed by the
//! records of `common::progress`, never by worker log text) and the drawing; the one place
//! that writes to the console while a display is up ([`on_console`]). Must not: slow a worker
//! (the workers' writes never block, see the worker's `progress_channel`), draw anywhere but a
//! terminal, or decide anything about the run.
//!
//! A pipe is read to its end whatever comes through it, in bounded memory: a line longer than
//! [`MAX_LINE`] is discarded, a line that is not a record (not UTF-8, not JSON) is skipped, and
//! a record of a rank this launch did not start on this node is dropped; each is counted and
//! told in a rate-limited warning, and the reader goes on, so the writer never blocks or gets
//! `EPIPE`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use common::progress::{Phase, ProgressRecord, PROGRESS_FD, PROGRESS_FD_VAR};
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};
use tracing::warn;

use crate::child::Command;

/// How long ranks may disagree (one still starting, another phase, a stale step) before the
/// per-rank lines appear: reports arrive up to 0.1 s apart even when the ranks are in step.
const DRIFT_AFTER: Duration = Duration::from_secs(1);

/// The longest line a progress pipe may carry (a record is about 150 bytes); the rest of a
/// longer one is read and discarded.
const MAX_LINE: usize = 64 * 1024;

/// The least time between two warnings about one pipe's skipped lines.
const WARN_EVERY: Duration = Duration::from_secs(30);

/// The display of one launcher, shared by the reader threads and the console writers.
pub struct Display {
    multi: MultiProgress,
    state: Mutex<State>,
}

struct State {
    bar: ProgressBar,
    /// This node's ranks, each with its latest report and when it came.
    ranks: BTreeMap<u32, Option<(ProgressRecord, Instant)>>,
    /// Since when the ranks have disagreed, and the per-rank lines once shown.
    drift_since: Option<Instant>,
    rank_lines: Vec<ProgressBar>,
}

/// The display while one is up: [`on_console`] draws lines above it.
static ACTIVE: Mutex<Option<Arc<Display>>> = Mutex::new(None);

/// Whether a person watches (see [`common::progress::wanted`]).
pub fn wanted() -> bool {
    common::progress::wanted(std::io::IsTerminal::is_terminal(&std::io::stderr()))
}

/// Runs `write` (one whole console write) with the display, if one is up, lifted off the screen,
/// so the lines land above it and it is redrawn below them.
pub fn on_console<R>(write: impl FnOnce() -> R) -> R {
    let active = lock(&ACTIVE).clone();
    match active {
        Some(display) => display.multi.suspend(write),
        None => write(),
    }
}

/// Whether a display is up (lines then land above it whole: it is redrawn below each).
pub fn is_up() -> bool {
    lock(&ACTIVE).is_some()
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Display {
    /// A display for the group of `ranks` (this node's global ranks), made the active one; it
    /// shows itself at the first report.
    pub fn start(ranks: impl IntoIterator<Item = u32>) -> Arc<Display> {
        // Hidden until the first report: a program that sends none (`launch -- python x.py`)
        // never gets a display.
        let multi = MultiProgress::with_draw_target(ProgressDrawTarget::hidden());
        let bar = multi.add(ProgressBar::new(0));
        bar.set_style(
            ProgressStyle::with_template(common::progress::BAR_TEMPLATE)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        let display = Arc::new(Display {
            multi,
            state: Mutex::new(State {
                bar,
                ranks: ranks.into_iter().map(|r| (r, None)).collect(),
                drift_since: None,
                rank_lines: Vec::new(),
            }),
        });
        *lock(&ACTIVE) = Some(display.clone());
        display
    }

    /// Takes the display off the screen for good (the run's end, a teardown before a restart).
    pub fn stop(&self) {
        let state = lock(&self.state);
        for line in &state.rank_lines {
            line.finish_and_clear();
        }
        state.bar.finish_and_clear();
        let mut active = lock(&ACTIVE);
        if active.as_ref().is_some_and(|a| std::ptr::eq(&**a, self)) {
            *active = None;
        }
    }

    /// Passes a new pipe to the worker `command` will start as [`PROGRESS_FD`], and returns the
    /// reading end's follower to call once the worker is spawned (it drops our copy of the
    /// writing end, so the pipe ends when the worker does).
    pub fn connect(self: &Arc<Self>, command: &mut Command, rank: u32) -> std::io::Result<Follow> {
        let (reader, writer) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let fd: RawFd = writer.as_raw_fd();
        command.env(PROGRESS_FD_VAR, PROGRESS_FD.to_string());
        command.hand_down(fd, PROGRESS_FD);
        Ok(Follow {
            display: self.clone(),
            reader,
            writer,
            rank,
        })
    }

    /// Takes in one report and redraws; `false` (and nothing drawn) for a rank that is not one
    /// of this node's.
    fn update(&self, record: ProgressRecord) -> bool {
        let mut state = lock(&self.state);
        if !state.ranks.contains_key(&record.rank) {
            return false;
        }
        if state.ranks.values().all(Option::is_none) {
            self.multi
                .set_draw_target(ProgressDrawTarget::stderr_with_hz(10));
        }
        state
            .ranks
            .insert(record.rank, Some((record, Instant::now())));
        state.redraw(&self.multi);
        true
    }
}

/// The reading end of one worker's pipe, to follow once the worker runs.
pub struct Follow {
    display: Arc<Display>,
    reader: OwnedFd,
    writer: OwnedFd,
    rank: u32,
}

impl Follow {
    /// Reads the worker's reports on a thread of their own until it closes the pipe.
    pub fn start(self) -> std::io::Result<()> {
        drop(self.writer);
        let (display, reader, rank) = (self.display, self.reader, self.rank);
        std::thread::Builder::new()
            .name(format!("rank{rank}-progress"))
            .spawn(move || {
                follow(&display, rank, std::fs::File::from(reader));
            })?;
        Ok(())
    }
}

/// Reads rank `rank`'s pipe to its end: records of this node's ranks go to the display, the
/// rest is counted and warned about. Returns what was skipped.
fn follow(display: &Display, rank: u32, pipe: impl Read) -> Skipped {
    let mut lines = Lines::new(pipe);
    let mut warnings = Warnings::default();
    loop {
        let skip = match lines.next_line() {
            Ok(Line::End) | Err(_) => break,
            Ok(Line::TooLong) => Skip::TooLong,
            Ok(Line::Text(bytes)) => match std::str::from_utf8(bytes) {
                Ok(text) if text.trim().is_empty() => continue,
                Ok(text) => match ProgressRecord::from_line(text) {
                    Some(record) => {
                        let claimed = record.rank;
                        if display.update(record) {
                            continue;
                        }
                        Skip::Foreign(claimed)
                    }
                    None => Skip::Unreadable,
                },
                Err(_) => Skip::Unreadable,
            },
        };
        warnings.count(skip, rank);
    }
    warnings.finish(rank);
    warnings.counts
}

/// One line of a progress pipe.
#[derive(Debug, PartialEq, Eq)]
enum Line<'a> {
    /// Its bytes, without the newline.
    Text(&'a [u8]),
    /// Longer than [`MAX_LINE`]: read to its newline and discarded.
    TooLong,
    /// The pipe is closed.
    End,
}

/// Splits a pipe into lines, holding at most [`MAX_LINE`] bytes of one.
struct Lines<R> {
    reader: BufReader<R>,
    line: Vec<u8>,
}

impl<R: Read> Lines<R> {
    fn new(reader: R) -> Self {
        Lines {
            reader: BufReader::new(reader),
            line: Vec::new(),
        }
    }

    /// The next line (a last one without a newline included); an error only when the pipe
    /// cannot be read at all.
    fn next_line(&mut self) -> std::io::Result<Line<'_>> {
        self.line.clear();
        let mut too_long = false;
        loop {
            let buf = match self.reader.fill_buf() {
                Ok(buf) => buf,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            let (chunk, used, ended) = match buf.iter().position(|&b| b == b'\n') {
                Some(at) => (&buf[..at], at + 1, true),
                None => (buf, buf.len(), buf.is_empty()),
            };
            if too_long || self.line.len() + chunk.len() > MAX_LINE {
                too_long = true;
                self.line.clear();
            } else {
                self.line.extend_from_slice(chunk);
            }
            let at_end = used == 0;
            self.reader.consume(used);
            if ended {
                return Ok(match (too_long, at_end && self.line.is_empty()) {
                    (true, _) => Line::TooLong,
                    (false, true) => Line::End,
                    (false, false) => Line::Text(&self.line),
                });
            }
        }
    }
}

/// Why a line was not shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Skip {
    TooLong,
    /// Not UTF-8, or not a record.
    Unreadable,
    /// A record of this rank, which is not one of this node's.
    Foreign(u32),
}

/// Lines one pipe's reader skipped, by reason.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
struct Skipped {
    too_long: u64,
    unreadable: u64,
    foreign: u64,
    /// The first rank that is not this node's, for the warning.
    first_foreign: Option<u32>,
}

impl Skipped {
    /// `1 line over 64 KiB, 2 unreadable lines, 20000 records of ranks not on this node (the
    /// first: rank 20000)`.
    fn describe(&self) -> String {
        let mut parts = Vec::new();
        if self.too_long > 0 {
            parts.push(format!(
                "{} line(s) over {} KiB",
                self.too_long,
                MAX_LINE >> 10
            ));
        }
        if self.unreadable > 0 {
            parts.push(format!(
                "{} line(s) that are not a progress record (not UTF-8 or not JSON)",
                self.unreadable
            ));
        }
        if let Some(first) = self.first_foreign {
            parts.push(format!(
                "{} record(s) of ranks not started on this node (the first: rank {first})",
                self.foreign
            ));
        }
        parts.join(", ")
    }
}

/// One pipe's skip counts and when they were last told.
#[derive(Default)]
struct Warnings {
    counts: Skipped,
    told: Skipped,
    last: Option<Instant>,
}

impl Warnings {
    /// Counts `skip`; warns at the first skip of each kind, and then at most once every
    /// [`WARN_EVERY`].
    fn count(&mut self, skip: Skip, rank: u32) {
        let counts = &mut self.counts;
        match skip {
            Skip::TooLong => counts.too_long += 1,
            Skip::Unreadable => counts.unreadable += 1,
            Skip::Foreign(claimed) => {
                counts.foreign += 1;
                counts.first_foreign.get_or_insert(claimed);
            }
        }
        let (now, told) = (self.counts, self.told);
        let new_kind = (now.too_long > 0 && told.too_long == 0)
            || (now.unreadable > 0 && told.unreadable == 0)
            || (now.foreign > 0 && told.foreign == 0);
        if new_kind || self.last.is_some_and(|at| at.elapsed() >= WARN_EVERY) {
            warn!(
                "rank {rank}'s progress pipe: skipped {} so far (the display goes on; at most one such warning every {} s)",
                now.describe(),
                WARN_EVERY.as_secs()
            );
            self.told = now;
            self.last = Some(Instant::now());
        }
    }

    /// The totals, when some were not told yet.
    fn finish(&self, rank: u32) {
        if self.counts != self.told {
            warn!(
                "rank {rank}'s progress pipe: skipped {} in all",
                self.counts.describe()
            );
        }
    }
}

impl State {
    /// The job's bar from the slowest rank's report, and the per-rank lines while the ranks
    /// have disagreed for [`DRIFT_AFTER`].
    fn redraw(&mut self, multi: &MultiProgress) {
        let reports: Vec<&(ProgressRecord, Instant)> = self.ranks.values().flatten().collect();
        let Some(slowest) = reports.iter().map(|(r, _)| r).min_by_key(|r| r.step) else {
            return;
        };
        let bar = &self.bar;
        if bar.length() != Some(slowest.total_steps) {
            bar.set_length(slowest.total_steps);
        }
        // A rank that has not reported yet is at step 0: the bar never moves back.
        let position = if reports.len() < self.ranks.len() {
            0
        } else {
            slowest.step
        };
        if bar.position() != position {
            bar.set_position(position);
        }
        bar.set_message(job_message(&reports));
        // The job ends with its slowest rank.
        let eta = reports.iter().filter_map(|(r, _)| r.eta_s).reduce(f64::max);
        bar.set_prefix(common::progress::eta_prefix(eta));
        let now = Instant::now();
        if !self.disagree(now) {
            self.drift_since = None;
            for line in self.rank_lines.drain(..) {
                line.finish_and_clear();
                multi.remove(&line);
            }
            return;
        }
        let since = *self.drift_since.get_or_insert(now);
        if now - since < DRIFT_AFTER {
            return;
        }
        if self.rank_lines.is_empty() {
            for _ in &self.ranks {
                let line = multi.add(ProgressBar::new_spinner());
                line.set_style(
                    ProgressStyle::with_template("  {msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                self.rank_lines.push(line);
            }
        }
        for ((rank, report), line) in self.ranks.iter().zip(&self.rank_lines) {
            line.set_message(rank_message(*rank, report.as_ref().map(|(r, _)| r)));
        }
    }

    /// Whether a rank has not reported yet, the ranks are in different phases, or one's step
    /// is behind another's with no report for [`DRIFT_AFTER`].
    fn disagree(&self, now: Instant) -> bool {
        let reports: Vec<&(ProgressRecord, Instant)> = self.ranks.values().flatten().collect();
        if reports.len() < self.ranks.len() {
            return true;
        }
        let top = reports.iter().map(|(r, _)| r.step).max().unwrap_or(0);
        reports.iter().any(|(r, at)| {
            r.phase != reports[0].0.phase || (r.step + 1 < top && now - *at >= DRIFT_AFTER)
        })
    }
}

/// `epoch 2/5 loss 0.5123 135,120 samples/s` (or `evaluating`, `done`), from the slowest rank.
fn job_message(reports: &[&(ProgressRecord, Instant)]) -> String {
    let Some((first, _)) = reports.iter().min_by_key(|(r, _)| (r.step, r.rank)) else {
        return String::new();
    };
    let mut text = format!("epoch {}/{}", first.epoch, first.epochs);
    match reports
        .iter()
        .map(|(r, _)| r.phase)
        .min_by_key(|p| *p as u8)
    {
        Some(Phase::Evaluate) => text.push_str(" evaluating"),
        Some(Phase::Done) => text.push_str(" done"),
        _ => {}
    }
    if let Some(loss) = first.loss {
        text.push_str(&format!(" loss {loss:.4}"));
    }
    if let Some(rate) = first.samples_per_s {
        text.push_str(&format!(" {} samples/s", thousands(rate)));
    }
    text
}

/// `rank 1: step 118/400, training`.
fn rank_message(rank: u32, report: Option<&ProgressRecord>) -> String {
    match report {
        None => format!("rank {rank}: starting"),
        Some(r) => format!(
            "rank {rank}: step {}/{}, {}",
            r.step,
            r.total_steps,
            match r.phase {
                Phase::Train => "training",
                Phase::Evaluate => "evaluating",
                Phase::Done => "done",
            }
        ),
    }
}

/// `135120.4` -> `135,120`.
fn thousands(value: f64) -> String {
    let digits = format!("{:.0}", value.max(0.0));
    let mut out = String::new();
    for (i, c) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(c);
    }
    out
}

/// A `tracing` writer for the launcher's own messages: each event is collected whole and
/// written through [`on_console`], so it lands above the display.
#[derive(Default)]
pub struct ConsoleWriter {
    buffer: Vec<u8>,
}

impl Write for ConsoleWriter {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.buffer.extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for ConsoleWriter {
    fn drop(&mut self) {
        if !self.buffer.is_empty() {
            crate::console_line::end_open_line();
            on_console(|| {
                let _ = std::io::stderr().lock().write_all(&self.buffer);
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(rank: u32, step: u64, phase: Phase) -> ProgressRecord {
        ProgressRecord {
            rank,
            phase,
            epoch: 2,
            epochs: 3,
            step,
            total_steps: 30,
            loss: Some(0.25),
            samples_per_s: Some(1234567.8),
            eta_s: Some(step as f64),
        }
    }

    fn state(ranks: &[(u32, Option<(ProgressRecord, Instant)>)]) -> State {
        State {
            bar: ProgressBar::hidden(),
            ranks: ranks.iter().cloned().collect(),
            drift_since: None,
            rank_lines: Vec::new(),
        }
    }

    #[test]
    fn the_job_line_follows_the_slowest_rank() {
        let now = Instant::now();
        let (a, b) = (
            (report(0, 12, Phase::Train), now),
            (report(1, 11, Phase::Train), now),
        );
        assert_eq!(
            job_message(&[&a, &b]),
            "epoch 2/3 loss 0.2500 1,234,568 samples/s"
        );
        // The job is in the least advanced phase of its ranks.
        let (c, d) = (
            (report(0, 20, Phase::Evaluate), now),
            (report(1, 20, Phase::Evaluate), now),
        );
        assert!(job_message(&[&c, &d]).starts_with("epoch 2/3 evaluating"));
        assert!(!job_message(&[&a, &d]).contains("evaluating"));
        // The bar stands at the slowest rank's step, with the longest ETA of the ranks'.
        let mut drawn = state(&[(0, Some(a.clone())), (1, Some(b.clone()))]);
        drawn.redraw(&MultiProgress::with_draw_target(
            ProgressDrawTarget::hidden(),
        ));
        assert_eq!(drawn.bar.position(), 11);
        assert_eq!(drawn.bar.prefix(), " ETA 12s");
        assert_eq!(thousands(999.4), "999");
        assert_eq!(thousands(1000.0), "1,000");
    }

    /// A line over the cap is discarded up to its newline, the lines after it are whole, and
    /// a last line without a newline still counts.
    #[test]
    fn lines_are_capped_and_the_rest_of_a_long_one_is_discarded() {
        let mut input = vec![b'x'; 3 * MAX_LINE + 5];
        input.extend_from_slice(b"\nnext\n\n\xff\xfe\n");
        input.extend_from_slice(&vec![b'y'; MAX_LINE]);
        input.extend_from_slice(b"\nlast");
        let mut lines = Lines::new(std::io::Cursor::new(input));
        assert_eq!(lines.next_line().unwrap(), Line::TooLong);
        assert_eq!(lines.next_line().unwrap(), Line::Text(b"next"));
        assert_eq!(lines.next_line().unwrap(), Line::Text(b""));
        assert_eq!(lines.next_line().unwrap(), Line::Text(b"\xff\xfe"));
        assert_eq!(lines.next_line().unwrap(), Line::Text(&[b'y'; MAX_LINE]));
        assert_eq!(lines.next_line().unwrap(), Line::Text(b"last"));
        assert_eq!(lines.next_line().unwrap(), Line::End);
        assert!(lines.line.capacity() <= 2 * MAX_LINE);
    }

    /// Junk, bad UTF-8 and records of ranks that are not this node's are counted and the
    /// records after them still reach the display; foreign ranks are never drawn.
    #[test]
    fn the_reader_skips_junk_and_foreign_ranks_and_goes_on() {
        let display = Display::start([4, 5]);
        let mut input = vec![b'z'; MAX_LINE + 1];
        input.extend_from_slice(b"\n\xff\n{\"rank\":4}\nnot json\n");
        for rank in [20_000, 3, 4, 9] {
            input.extend_from_slice(report(rank, 7, Phase::Train).to_line().as_bytes());
        }
        let skipped = follow(&display, 4, std::io::Cursor::new(input));
        assert_eq!(
            (skipped.too_long, skipped.unreadable, skipped.foreign),
            (1, 3, 3)
        );
        assert_eq!(skipped.first_foreign, Some(20_000));
        let text = skipped.describe();
        assert!(text.contains("1 line(s) over 64 KiB"), "{text}");
        assert!(text.contains("(the first: rank 20000)"), "{text}");
        let state = lock(&display.state);
        assert_eq!(state.ranks.keys().copied().collect::<Vec<_>>(), [4, 5]);
        assert_eq!(state.ranks[&4].as_ref().map(|(r, _)| r.step), Some(7));
        drop(state);
        display.stop();
    }

    /// In step (reports a few steps apart but fresh) is not drift; a missing rank, another
    /// phase, or a rank behind with a stale report is.
    #[test]
    fn drift_is_a_rank_missing_elsewhere_or_stale_behind() {
        let now = Instant::now();
        let old = now - Duration::from_secs(5);
        let fresh = |r, s| Some((report(r, s, Phase::Train), now));
        assert!(!state(&[(0, fresh(0, 40)), (1, fresh(1, 25))]).disagree(now));
        assert!(state(&[(0, fresh(0, 40)), (1, None)]).disagree(now));
        let evaluating = Some((report(1, 40, Phase::Evaluate), now));
        assert!(state(&[(0, fresh(0, 40)), (1, evaluating)]).disagree(now));
        let stale = Some((report(1, 25, Phase::Train), old));
        assert!(state(&[(0, fresh(0, 40)), (1, stale)]).disagree(now));
        let stale_in_step = Some((report(1, 39, Phase::Train), old));
        assert!(!state(&[(0, fresh(0, 40)), (1, stale_in_step)]).disagree(now));
        assert_eq!(rank_message(1, None), "rank 1: starting");
        assert_eq!(
            rank_message(0, Some(&report(0, 7, Phase::Evaluate))),
            "rank 0: step 7/30, evaluating"
        );
    }
}
