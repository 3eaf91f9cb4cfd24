//! Sends this rank's progress to `launch` over the pipe it passed (see `common::progress`).
//!
//! Owns opening that inherited descriptor safely (once, and only if it is a pipe) and writing
//! without ever holding training up: the descriptor is non-blocking, a report that does not fit
//! the pipe is dropped, and a pipe whose reader is gone ends the reports. Must not decide what
//! is reported or when (the trainer does), nor print anything but one warning.

use std::fs::File;
use std::io::Write;
use std::os::fd::{BorrowedFd, FromRawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::progress::{Phase, ProgressRecord, PROGRESS_FD_VAR};
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::stat::{fstat, SFlag};
use tracing::warn;

/// Reports closer together than this are skipped unless forced (a display redraws at about
/// this rate; a fast model steps thousands of times a second).
const MIN_INTERVAL: Duration = Duration::from_millis(100);

/// Whether the descriptor has been taken: a second `File` on it would close it twice.
static TAKEN: AtomicBool = AtomicBool::new(false);

/// The writing end of the progress pipe.
pub struct ProgressSender {
    pipe: File,
    last_sent: Option<Instant>,
    last_phase: Option<Phase>,
}

impl ProgressSender {
    /// The sender `launch` asked for through [`PROGRESS_FD_VAR`], or `None` when it did not (or
    /// the variable names no open pipe: warned, and training goes on without reports).
    pub fn from_env() -> Option<ProgressSender> {
        let value = std::env::var(PROGRESS_FD_VAR).ok()?;
        match open(&value) {
            Ok(pipe) => Some(ProgressSender {
                pipe,
                last_sent: None,
                last_phase: None,
            }),
            Err(why) => {
                warn!("{PROGRESS_FD_VAR}={value}: {why}; no live progress for launch");
                None
            }
        }
    }

    /// Sends `record` unless the last report was under [`MIN_INTERVAL`] ago and in the same
    /// phase; `force` sends it anyway (an epoch's last step). Returns `false` once the reader
    /// is gone.
    pub fn send(&mut self, record: &ProgressRecord, force: bool) -> bool {
        let now = Instant::now();
        let same_phase = self.last_phase == Some(record.phase);
        if !force && same_phase && self.last_sent.is_some_and(|t| now - t < MIN_INTERVAL) {
            return true;
        }
        self.last_sent = Some(now);
        self.last_phase = Some(record.phase);
        // One write of less than PIPE_BUF bytes: all of it or nothing, never interleaved.
        match self.pipe.write(record.to_line().as_bytes()) {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => true,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => true,
            Err(_) => false,
        }
    }
}

/// Takes ownership of the descriptor `value` names after checking it is an open pipe, and makes
/// it non-blocking.
fn open(value: &str) -> Result<File, String> {
    let fd: i32 = value
        .trim()
        .parse()
        .ok()
        .filter(|&fd| fd > 2)
        .ok_or("not a descriptor number above 2")?;
    // SAFETY: only borrowed for the checks below; fstat fails cleanly on a closed descriptor.
    let borrowed = unsafe { BorrowedFd::borrow_raw(fd) };
    let stat = fstat(borrowed).map_err(|e| format!("descriptor {fd}: {e}"))?;
    if SFlag::from_bits_truncate(stat.st_mode) & SFlag::S_IFMT != SFlag::S_IFIFO {
        return Err(format!("descriptor {fd} is not a pipe"));
    }
    let flags = fcntl(borrowed, FcntlArg::F_GETFL).map_err(|e| e.to_string())?;
    let flags = OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK;
    fcntl(borrowed, FcntlArg::F_SETFL(flags)).map_err(|e| e.to_string())?;
    if TAKEN.swap(true, Ordering::SeqCst) {
        return Err("already in use".into());
    }
    // SAFETY: an open pipe descriptor this process inherited for this purpose; `TAKEN` makes
    // this the only owner.
    Ok(unsafe { File::from_raw_fd(fd) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::os::fd::IntoRawFd;

    fn record(step: u64) -> ProgressRecord {
        record_in(step, Phase::Train)
    }

    fn record_in(step: u64, phase: Phase) -> ProgressRecord {
        ProgressRecord {
            rank: 0,
            phase,
            epoch: 1,
            epochs: 1,
            step,
            total_steps: 10,
            loss: None,
            samples_per_s: None,
            eta_s: None,
        }
    }

    /// Not a number, a standard stream, a file that is not a pipe, a closed descriptor: refused.
    #[test]
    fn only_an_open_pipe_is_taken() {
        let file = tempfile::tempfile().unwrap();
        let file_fd = file.into_raw_fd();
        for (value, want) in [
            ("x", "not a descriptor number"),
            ("1", "not a descriptor number"),
            (&file_fd.to_string(), "is not a pipe"),
            ("987654", "descriptor 987654"),
        ] {
            let err = open(value).unwrap_err();
            assert!(err.contains(want), "{value}: {err}");
        }
        // SAFETY: the descriptor this test opened and still owns.
        drop(unsafe { File::from_raw_fd(file_fd) });
    }

    /// Reports arrive whole and in order; between forced ones, at most one per interval; a full
    /// pipe drops reports instead of blocking; a closed reader ends them.
    #[test]
    fn reports_never_block_and_end_with_the_reader() {
        let (reader, writer) = nix::unistd::pipe().unwrap();
        let (reader, fd) = (File::from(reader), writer.into_raw_fd());
        let mut sender = ProgressSender {
            pipe: open(&fd.to_string()).unwrap(),
            last_sent: None,
            last_phase: None,
        };
        assert!(sender.send(&record(1), false));
        assert!(sender.send(&record(2), false)); // within the interval: skipped
        assert!(sender.send(&record_in(2, Phase::Evaluate), false)); // a new phase: sent
        assert!(sender.send(&record(3), true));
        let started = Instant::now();
        for step in 0..20_000 {
            assert!(sender.send(&record(step), true)); // fills the pipe, never blocks
        }
        assert!(started.elapsed() < Duration::from_secs(20));
        let mut lines = BufReader::new(reader).lines();
        let first: Vec<(u64, Phase)> = (0..3)
            .map(|_| ProgressRecord::from_line(&lines.next().unwrap().unwrap()).unwrap())
            .map(|r| (r.step, r.phase))
            .collect();
        assert_eq!(
            first,
            vec![(1, Phase::Train), (2, Phase::Evaluate), (3, Phase::Train)]
        );
        drop(lines);
        assert!(!sender.send(&record(9), true));
    }
}
