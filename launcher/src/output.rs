//! Worker output: every line a worker writes reaches the console whole, prefixed with its rank,
//! on the stream it was written to (stdout stays stdout, stderr stays stderr), and optionally a
//! per-rank log file. It keeps the last stderr lines of each rank for the failure summary. It must
//! not interpret what workers print.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crate::console::Muting;

/// Lines longer than this are cut into pieces so one runaway line cannot exhaust memory.
const MAX_LINE: usize = 1 << 20;
/// Stderr lines kept per rank for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Of each kept line, at most this many bytes (the whole line went to the console and log).
const TAIL_LINE_BYTES: usize = 2048;

/// Which console stream a line belongs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    Stdout,
    Stderr,
}

/// The last stderr lines of one rank.
pub type Tail = Arc<Mutex<VecDeque<String>>>;

/// The console for all ranks. One lock covers both streams, so lines never interleave mid-line,
/// not even when the user merges them with `2>&1`.
pub struct Sinks {
    console: Mutex<()>,
    /// Width the rank number is padded to, so columns line up.
    rank_width: usize,
}

impl Sinks {
    pub fn new(world_size: u32) -> Arc<Sinks> {
        Arc::new(Sinks {
            console: Mutex::new(()),
            rank_width: world_size.saturating_sub(1).to_string().len(),
        })
    }

    fn write_line(&self, stream: Stream, rank: u32, line: &[u8]) {
        let mut buf = Vec::with_capacity(line.len() + 16);
        let _ = write!(buf, "[rank {rank:>width$}] ", width = self.rank_width);
        buf.extend_from_slice(line);
        buf.push(b'\n');
        // One write_all under the console lock: the whole line or nothing (a closed console
        // must not kill the launcher, so errors are ignored), above the progress display if
        // one is up.
        let _guard = self
            .console
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        crate::progress::on_console(|| match stream {
            Stream::Stdout => {
                let mut out = std::io::stdout().lock();
                let _ = out.write_all(&buf);
                let _ = out.flush();
            }
            Stream::Stderr => {
                let _ = std::io::stderr().lock().write_all(&buf);
            }
        });
    }
}

/// Opens `dir/rank-N.log` for appending (restarts append to the same file).
pub fn open_log(dir: &Path, rank: u32) -> std::io::Result<Arc<Mutex<File>>> {
    std::fs::create_dir_all(dir)?;
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("rank-{rank}.log")))?;
    Ok(Arc::new(Mutex::new(file)))
}

/// Where one stream of one worker goes.
pub struct Route {
    pub stream: Stream,
    pub rank: u32,
    /// The console, unless the stream goes to the log file only (`--redirects`); while the
    /// worker is hidden (`--local-ranks-filter`) its lines are held instead.
    pub console: Option<(Arc<Sinks>, Muting)>,
    pub log: Option<Arc<Mutex<File>>>,
    /// The last lines kept for the failure summary (stderr).
    pub tail: Option<Tail>,
}

/// Starts a thread that copies `source` line by line along `route` until EOF, then calls
/// `done` (after the last line has been written and recorded).
pub fn forward(
    source: impl Read + Send + 'static,
    route: Route,
    done: impl FnOnce() + Send + 'static,
) -> std::io::Result<JoinHandle<()>> {
    let Route {
        stream,
        rank,
        console,
        log,
        tail,
    } = route;
    std::thread::Builder::new()
        .name(format!("rank{rank}-{stream:?}"))
        .spawn(move || {
            let mut reader = BufReader::with_capacity(64 * 1024, source);
            let mut line = Vec::new();
            loop {
                line.clear();
                match read_line_capped(&mut reader, &mut line) {
                    Ok(0) | Err(_) => break,
                    Ok(_) => {}
                }
                if line.last() == Some(&b'\n') {
                    line.pop();
                }
                if line.last() == Some(&b'\r') {
                    line.pop();
                }
                match &console {
                    Some((sinks, muting)) if muting.is_shown() => {
                        sinks.write_line(stream, rank, &line)
                    }
                    Some((_, muting)) => muting.hold(stream, tail_entry(&line)),
                    None => {}
                }
                if let Some(log) = &log {
                    if let Ok(mut file) = log.lock() {
                        let _ = file.write_all(&line);
                        let _ = file.write_all(b"\n");
                    }
                }
                if let Some(tail) = &tail {
                    if let Ok(mut tail) = tail.lock() {
                        if tail.len() == TAIL_LINES {
                            tail.pop_front();
                        }
                        tail.push_back(tail_entry(&line));
                    }
                }
            }
            done();
        })
}

/// A line as the failure summary keeps it: cut to [`TAIL_LINE_BYTES`], saying how much is cut.
fn tail_entry(line: &[u8]) -> String {
    if line.len() <= TAIL_LINE_BYTES {
        return String::from_utf8_lossy(line).into_owned();
    }
    let kept = String::from_utf8_lossy(&line[..TAIL_LINE_BYTES]);
    // A multi-byte character cut in two shows as a replacement character; drop it.
    let kept = kept.trim_end_matches('\u{fffd}');
    format!(
        "{kept} [... {} more bytes of this line not shown]",
        line.len() - kept.len()
    )
}

/// Reads up to and including the next newline, or `MAX_LINE` bytes, whichever comes first.
fn read_line_capped(reader: &mut impl BufRead, line: &mut Vec<u8>) -> std::io::Result<usize> {
    loop {
        let available = match reader.fill_buf() {
            Ok(buf) => buf,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if available.is_empty() {
            return Ok(line.len());
        }
        let room = MAX_LINE - line.len();
        let (take, done) = match memchr(available, room) {
            Some(pos) => (pos + 1, true),
            None => (available.len().min(room), available.len() >= room),
        };
        line.extend_from_slice(&available[..take]);
        reader.consume(take);
        if done {
            return Ok(line.len());
        }
    }
}

fn memchr(buf: &[u8], limit: usize) -> Option<usize> {
    buf.iter().take(limit).position(|&b| b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines_of(input: &[u8]) -> Vec<Vec<u8>> {
        let mut reader = BufReader::with_capacity(7, input);
        let mut out = Vec::new();
        loop {
            let mut line = Vec::new();
            if read_line_capped(&mut reader, &mut line).unwrap() == 0 {
                return out;
            }
            out.push(line);
        }
    }

    #[test]
    fn kept_tail_lines_are_cut_and_say_so() {
        assert_eq!(tail_entry(b"short"), "short");
        let long = vec![b'x'; 5 << 20];
        let kept = tail_entry(&long);
        assert!(kept.len() < TAIL_LINE_BYTES + 100, "{}", kept.len());
        assert!(kept.ends_with(&format!(
            "[... {} more bytes of this line not shown]",
            (5 << 20) - TAIL_LINE_BYTES
        )));
        // A cut through a multi-byte character leaves no half of it.
        let mut accents = vec![b'a'; TAIL_LINE_BYTES - 1];
        accents.extend_from_slice("é".repeat(10).as_bytes());
        assert!(!tail_entry(&accents).contains('\u{fffd}'));
    }

    #[test]
    fn splits_on_newlines_across_buffer_refills() {
        let lines = lines_of(b"first line\nsecond, longer line\nno newline at end");
        assert_eq!(
            lines,
            vec![
                b"first line\n".to_vec(),
                b"second, longer line\n".to_vec(),
                b"no newline at end".to_vec()
            ]
        );
    }

    #[test]
    fn caps_runaway_lines() {
        let long = vec![b'x'; MAX_LINE + 10];
        let lines = lines_of(&long);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), MAX_LINE);
        assert_eq!(lines[1].len(), 10);
    }
}
