//! Worker output: every line a worker writes reaches the console whole, prefixed with its rank,
//! on the stream it was written to (stdout stays stdout, stderr stays stderr), and optionally a
//! per-rank log file. It keeps the last stderr lines of each rank for the failure summary. It must
//! not interpret what workers print.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};

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

/// One worker stream to forward: its pipe, where its lines go, and what to call once it has
/// been read to its end (after its last line was written and recorded).
pub struct Source {
    pub pipe: File,
    pub route: Route,
    pub done: Box<dyn FnOnce() + Send>,
}

/// A descriptor followed beside the sources that becomes readable once (a pidfd, at its
/// process's end): `ready` then runs and the watch is dropped. A group's exits are noticed on
/// the thread that forwards its output: one thread for the group, not two. So that thread
/// must not block but on its poll: `ready` may not wait, and a console that takes no more
/// output (a pipe nobody reads) holds up the exits with the lines.
pub struct Watch {
    pub fd: OwnedFd,
    pub ready: Box<dyn FnOnce() + Send>,
}

/// Starts one thread that copies every source line by line along its route until each one's
/// end, and calls each watch's `ready` when its descriptor is: a group needs one thread,
/// however many workers it has.
pub fn forward(sources: Vec<Source>, watches: Vec<Watch>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("output".into())
        .spawn(move || forward_all(sources, watches))
        .map(drop)
}

/// Reads whatever source has data (each in turn, so none starves the others) and passes on
/// its whole lines; a source that ends is finished and dropped; then the watches that are
/// ready.
fn forward_all(sources: Vec<Source>, mut watches: Vec<Watch>) {
    use nix::errno::Errno;
    let mut open: Vec<(Source, Lines)> =
        sources.into_iter().map(|s| (s, Lines::default())).collect();
    let mut buf = vec![0u8; 64 * 1024];
    while !open.is_empty() || !watches.is_empty() {
        // Polling cannot fail on descriptors we hold; if it did, blocking reads still get
        // every line (a watch is never waited for blocking: that would stop the output).
        let (ready, ready_watches) =
            readable(&open, &watches).unwrap_or_else(|_| ((0..open.len()).collect(), Vec::new()));
        // The watches first, in their order: a worker's exit is seen (and timed) as soon as
        // the poll says so, not after this round's lines, and the first of several that end
        // together is the first told.
        fire(&mut watches, &ready_watches);
        for i in ready.into_iter().rev() {
            let (source, lines) = &mut open[i];
            match nix::unistd::read(&source.pipe, &mut buf) {
                Ok(n) if n > 0 => lines.feed(&buf[..n], |line| deliver(&source.route, line)),
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                _ => {
                    // Its end (or a pipe that cannot be read).
                    let (source, mut lines) = open.swap_remove(i);
                    lines.finish(|line| deliver(&source.route, line));
                    (source.done)();
                }
            }
        }
    }
}

/// Calls the watches at `ready` (ascending indices), in order, and drops them.
fn fire(watches: &mut Vec<Watch>, ready: &[usize]) {
    if ready.is_empty() {
        return;
    }
    let all = std::mem::take(watches);
    for (i, watch) in all.into_iter().enumerate() {
        match ready.binary_search(&i) {
            Ok(_) => (watch.ready)(),
            Err(_) => watches.push(watch),
        }
    }
}

/// The indices of the sources with data (or at their end) and of the watches that are ready,
/// waiting until there is one.
fn readable(open: &[(Source, Lines)], watches: &[Watch]) -> nix::Result<(Vec<usize>, Vec<usize>)> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    loop {
        let pipes = open.iter().map(|(s, _)| s.pipe.as_fd());
        let mut fds: Vec<PollFd> = pipes
            .chain(watches.iter().map(|w| w.fd.as_fd()))
            .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
            .collect();
        match poll(&mut fds, PollTimeout::NONE) {
            Ok(_) => {}
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e),
        }
        // Indices among fds[from..to], of those ready.
        let ready = |from: usize, to: usize| -> Vec<usize> {
            (from..to)
                .filter(|&i| fds[i].any() == Some(true))
                .map(|i| i - from)
                .collect()
        };
        return Ok((ready(0, open.len()), ready(open.len(), fds.len())));
    }
}

/// One line (its newline, if any, still on) to the console, the log file and the tail.
fn deliver(route: &Route, line: &[u8]) {
    let line = line.strip_suffix(b"\n").unwrap_or(line);
    let line = line.strip_suffix(b"\r").unwrap_or(line);
    match &route.console {
        Some((sinks, muting)) if muting.is_shown() => {
            sinks.write_line(route.stream, route.rank, line)
        }
        Some((_, muting)) => muting.hold(route.stream, tail_entry(line)),
        None => {}
    }
    if let Some(log) = &route.log {
        if let Ok(mut file) = log.lock() {
            let _ = file.write_all(line);
            let _ = file.write_all(b"\n");
        }
    }
    if let Some(tail) = &route.tail {
        if let Ok(mut tail) = tail.lock() {
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(tail_entry(line));
        }
    }
}

/// A stream's bytes, as they come, cut into whole lines: each up to and including its newline,
/// or [`MAX_LINE`] bytes of a longer one.
#[derive(Default)]
struct Lines {
    partial: Vec<u8>,
}

impl Lines {
    /// Takes in `bytes`; passes on every line they complete.
    fn feed(&mut self, mut bytes: &[u8], mut emit: impl FnMut(&[u8])) {
        while !bytes.is_empty() {
            let room = MAX_LINE - self.partial.len();
            let (take, complete) = match memchr(bytes, room) {
                Some(pos) => (pos + 1, true),
                None => (bytes.len().min(room), bytes.len() >= room),
            };
            let (line, rest) = bytes.split_at(take);
            bytes = rest;
            if complete && self.partial.is_empty() {
                emit(line); // the common case: no copy
                continue;
            }
            self.partial.extend_from_slice(line);
            if complete {
                emit(&self.partial);
                self.partial.clear();
            }
        }
    }

    /// At the stream's end: passes on a last line that had no newline.
    fn finish(&mut self, mut emit: impl FnMut(&[u8])) {
        if !self.partial.is_empty() {
            emit(&self.partial);
            self.partial.clear();
        }
    }
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

fn memchr(buf: &[u8], limit: usize) -> Option<usize> {
    buf.iter().take(limit).position(|&b| b == b'\n')
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The lines of `input` arriving in pieces of `chunk` bytes.
    fn lines_of(input: &[u8], chunk: usize) -> Vec<Vec<u8>> {
        let (mut lines, mut out) = (Lines::default(), Vec::new());
        for piece in input.chunks(chunk) {
            lines.feed(piece, |l| out.push(l.to_vec()));
        }
        lines.finish(|l| out.push(l.to_vec()));
        out
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
        let lines = lines_of(b"first line\nsecond, longer line\nno newline at end", 7);
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
        let lines = lines_of(&long, 64 * 1024);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), MAX_LINE);
        assert_eq!(lines[1].len(), 10);
    }

    /// One thread follows sources and watches: a watch's `ready` runs once its descriptor is
    /// readable, while a source is still open, and every line of the source reaches its log.
    #[test]
    fn watches_are_called_beside_the_sources() {
        use std::time::Duration;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let log = Arc::new(Mutex::new(File::create(&path).unwrap()));
        let (source_read, source_write) = nix::unistd::pipe().unwrap();
        let (watch_read, watch_write) = nix::unistd::pipe().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let done = tx.clone();
        let source = Source {
            pipe: File::from(source_read),
            route: Route {
                stream: Stream::Stdout,
                rank: 0,
                console: None,
                log: Some(log),
                tail: None,
            },
            done: Box::new(move || done.send("done").unwrap()),
        };
        let watch = Watch {
            fd: watch_read,
            ready: Box::new(move || tx.send("ready").unwrap()),
        };
        forward(vec![source], vec![watch]).unwrap();
        let mut writer = File::from(source_write);
        writeln!(writer, "one").unwrap();
        nix::unistd::write(&watch_write, b"x").unwrap();
        let wait = Duration::from_secs(10);
        assert_eq!(rx.recv_timeout(wait), Ok("ready"));
        writeln!(writer, "two").unwrap();
        drop(writer);
        assert_eq!(rx.recv_timeout(wait), Ok("done"));
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "one\ntwo\n");
    }

    /// Watches ready together are called in their order (the first worker's exit first).
    #[test]
    fn watches_ready_together_fire_in_order() {
        let (tx, rx) = std::sync::mpsc::channel();
        let mut ends = Vec::new();
        let watches: Vec<Watch> = (0..4)
            .map(|i| {
                let (read, write) = nix::unistd::pipe().unwrap();
                ends.push(write);
                let tx = tx.clone();
                Watch {
                    fd: read,
                    ready: Box::new(move || tx.send(i).unwrap()),
                }
            })
            .collect();
        // All readable before the thread's first poll.
        for end in &ends {
            nix::unistd::write(end, b"x").unwrap();
        }
        forward(Vec::new(), watches).unwrap();
        let wait = std::time::Duration::from_secs(10);
        let order: Vec<i32> = (0..4).map(|_| rx.recv_timeout(wait).unwrap()).collect();
        assert_eq!(order, vec![0, 1, 2, 3]);
    }
}
