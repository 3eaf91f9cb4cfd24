//! The line the console's cursor is on: a worker's line that `output` left open (a progress bar
//! after its `\r`, the start of a line shown after its wait) until something else is written.
//! Owns that state, so that whatever writes next, a worker's line or the launcher's own message,
//! ends the open line first. Must not write anything but what it is given.

use std::io::Write as _;
use std::sync::{Mutex, MutexGuard};

/// A rank's line that the console's cursor is still on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenLine {
    /// On stdout (else stderr).
    pub stdout: bool,
    pub rank: u32,
    /// Its last byte was `\r`: the next text redraws the line from its start.
    pub redraw: bool,
}

static OPEN: Mutex<Option<OpenLine>> = Mutex::new(None);

/// The open line, locked: hold it across the write that changes it.
pub fn lock() -> MutexGuard<'static, Option<OpenLine>> {
    OPEN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Ends the open line, if any, with a newline on its stream: before the launcher writes a
/// message of its own.
pub fn end_open_line() {
    let mut open = lock();
    if let Some(line) = open.take() {
        end(line.stdout);
    }
}

/// Writes the newline that ends an open line on stdout (`stdout`) or stderr.
pub fn end(stdout: bool) {
    write(stdout, b"\n");
}

/// Writes `bytes` to stdout (flushed) or stderr, ignoring errors: a closed console must not
/// kill the launcher.
pub fn write(stdout: bool, bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    if stdout {
        let mut out = std::io::stdout().lock();
        let _ = out.write_all(bytes);
        let _ = out.flush();
    } else {
        let _ = std::io::stderr().lock().write_all(bytes);
    }
}
