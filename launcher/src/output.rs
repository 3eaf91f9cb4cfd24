//! Worker output: every line a worker writes reaches the console prefixed with its rank, on the
//! stream it was written to (stdout stays stdout, stderr stays stderr), and optionally a per-rank
//! log file. A line ending in `\r` (a progress bar redrawn in place, as tqdm does) and a partial
//! line that has waited [`PARTIAL_WAIT`] are shown as they come, so bars move; another rank's
//! output first ends such an open line, so ranks never interleave mid-line. It keeps the last
//! stderr lines of each rank for the failure summary. It must not interpret what workers print.

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::console::Muting;
pub use crate::console::Stream;
use crate::console_line::OpenLine;

/// Lines longer than this are cut into pieces so one runaway line cannot exhaust memory.
const MAX_LINE: usize = 1 << 20;
/// How long the start of a line may wait for its end before it is shown anyway (a prompt, a
/// progress bar drawn without `\r` at its end): short enough to look live, long enough that a
/// line written in two pieces almost always arrives whole.
pub const PARTIAL_WAIT: Duration = Duration::from_millis(100);
/// Stderr lines kept per rank for the failure summary.
pub const TAIL_LINES: usize = 20;
/// Of each kept line, at most this many bytes (the whole line went to the console and log).
const TAIL_LINE_BYTES: usize = 2048;

/// The last stderr lines of one rank.
pub type Tail = Arc<Mutex<VecDeque<String>>>;

/// The console for all ranks. One lock covers both streams (the open line's,
/// [`crate::console_line`]), so lines never interleave mid-line, not even when the user merges
/// them with `2>&1`.
pub struct Sinks {
    /// Width the rank number is padded to, so columns line up.
    rank_width: usize,
}

impl Sinks {
    pub fn new(world_size: u32) -> Arc<Sinks> {
        Arc::new(Sinks {
            rank_width: world_size.saturating_sub(1).to_string().len(),
        })
    }

    /// Shows `piece` of `rank`'s `stream` ([`render`]). One write under the console lock: the
    /// whole piece or nothing (a closed console must not kill the launcher, so errors are
    /// ignored), above the progress display if one is up (which needs whole lines).
    fn write_piece(&self, stream: Stream, rank: u32, piece: &Piece<'_>) {
        let mut open = crate::console_line::lock();
        let whole_lines = crate::progress::is_up();
        let (close, bytes) = render(&mut open, stream, rank, self.rank_width, piece, whole_lines);
        crate::progress::on_console(|| {
            if let Some(other) = close {
                crate::console_line::end(other == Stream::Stdout);
            }
            crate::console_line::write(stream == Stream::Stdout, &bytes);
        });
    }
}

/// What the console gets for `piece` of `rank`'s `stream`, given the line left `open` (which it
/// updates): the stream whose open line must first be ended (another rank's or stream's), then
/// the bytes. The piece's text not shown yet is labelled with the rank where it starts a line on
/// the console or redraws one after `\r`; an empty piece that only ends what was shown gets no
/// label. With `whole_lines`, every piece ends its line.
fn render(
    open: &mut Option<OpenLine>,
    stream: Stream,
    rank: u32,
    width: usize,
    piece: &Piece<'_>,
    whole_lines: bool,
) -> (Option<Stream>, Vec<u8>) {
    let end = if whole_lines { End::Newline } else { piece.end };
    let stdout = stream == Stream::Stdout;
    let stream_of = |o: OpenLine| {
        if o.stdout {
            Stream::Stdout
        } else {
            Stream::Stderr
        }
    };
    let (mine, close) = match *open {
        Some(o) if o.stdout == stdout && o.rank == rank => (Some(o), None),
        Some(o) => (None, Some(stream_of(o))),
        None => (None, None),
    };
    let text = piece.unshown();
    // The line this piece belongs to was shown in part, then ended by another rank's output.
    let cut_off = piece.shown > 0 && mine.is_none();
    if text.is_empty() && mine.is_none() && (end == End::Return || cut_off) {
        // Nothing to show, and another rank's open line stays open.
        return (None, Vec::new());
    }
    let continues = mine.is_some_and(|o| !o.redraw);
    let only_ends = text.is_empty() && (mine.is_some() || cut_off);
    let mut buf = Vec::with_capacity(text.len() + 16);
    if !continues && !only_ends {
        let _ = write!(buf, "[rank {rank:>width$}] ");
    }
    buf.extend_from_slice(text);
    *open = match end {
        End::Newline => {
            buf.push(b'\n');
            None
        }
        End::Return => {
            buf.push(b'\r');
            Some(OpenLine {
                stdout,
                rank,
                redraw: true,
            })
        }
        End::Open => Some(OpenLine {
            stdout,
            rank,
            redraw: false,
        }),
    };
    (close, buf)
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
    /// The files its lines go to (`--rank-logs`, torchrun's layout of `--log-dir`).
    pub logs: Vec<Arc<Mutex<File>>>,
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
/// its pieces of lines; a source that ends is finished and dropped; then the watches that are
/// ready; then the partial lines that have waited long enough.
fn forward_all(sources: Vec<Source>, mut watches: Vec<Watch>) {
    use nix::errno::Errno;
    let mut open: Vec<(Source, Lines)> =
        sources.into_iter().map(|s| (s, Lines::default())).collect();
    let mut buf = vec![0u8; 64 * 1024];
    while !open.is_empty() || !watches.is_empty() {
        let due = open.iter().filter_map(|(_, lines)| lines.due()).min();
        // Polling cannot fail on descriptors we hold; if it did, blocking reads still get
        // every line (a watch is never waited for blocking: that would stop the output).
        let (ready, ready_watches) = readable(&open, &watches, due)
            .unwrap_or_else(|_| ((0..open.len()).collect(), Vec::new()));
        // The watches first, in their order: a worker's exit is seen (and timed) as soon as
        // the poll says so, not after this round's lines, and the first of several that end
        // together is the first told.
        fire(&mut watches, &ready_watches);
        for i in ready.into_iter().rev() {
            let (source, lines) = &mut open[i];
            match nix::unistd::read(&source.pipe, &mut buf) {
                Ok(n) if n > 0 => lines.feed(&buf[..n], Instant::now(), |piece| {
                    deliver(&source.route, &piece)
                }),
                Err(Errno::EINTR | Errno::EAGAIN) => {}
                _ => {
                    // Its end (or a pipe that cannot be read).
                    let (source, mut lines) = open.swap_remove(i);
                    lines.finish(|piece| deliver(&source.route, &piece));
                    (source.done)();
                }
            }
        }
        let now = Instant::now();
        for (source, lines) in &mut open {
            lines.flush_waited(now, |piece| deliver(&source.route, &piece));
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
/// waiting until there is one, or until `due` (then none may be).
fn readable(
    open: &[(Source, Lines)],
    watches: &[Watch],
    due: Option<Instant>,
) -> nix::Result<(Vec<usize>, Vec<usize>)> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    loop {
        let pipes = open.iter().map(|(s, _)| s.pipe.as_fd());
        let mut fds: Vec<PollFd> = pipes
            .chain(watches.iter().map(|w| w.fd.as_fd()))
            .map(|fd| PollFd::new(fd, PollFlags::POLLIN))
            .collect();
        let timeout = match due {
            // Rounded up: a poll that wakes a little early would only spin.
            Some(at) => {
                let ms = at
                    .saturating_duration_since(Instant::now())
                    .as_micros()
                    .div_ceil(1000);
                PollTimeout::try_from(ms.min(60_000) as i32).unwrap_or(PollTimeout::MAX)
            }
            None => PollTimeout::NONE,
        };
        match poll(&mut fds, timeout) {
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

/// One piece of a line to the console, the log file and (once the line is whole) the tail.
fn deliver(route: &Route, piece: &Piece<'_>) {
    match &route.console {
        Some((sinks, muting)) if muting.is_shown() => {
            sinks.write_piece(route.stream, route.rank, piece)
        }
        // A hidden rank's whole lines are held (a bar redrawn in place is not a line).
        Some((_, muting)) if piece.end == End::Newline => {
            muting.hold(route.stream, tail_entry(piece.text))
        }
        _ => {}
    }
    for log in &route.logs {
        if let Ok(mut file) = log.lock() {
            let _ = file.write_all(piece.unshown());
            let _ = file.write_all(piece.end.bytes());
        }
    }
    if let Some(tail) = &route.tail {
        if let (Ok(mut tail), End::Newline) = (tail.lock(), piece.end) {
            if tail.len() == TAIL_LINES {
                tail.pop_front();
            }
            tail.push_back(tail_entry(piece.text));
        }
    }
}

/// How a piece of a line ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    /// `\n` (or `\r\n`, or the stream's end, or a runaway line's cut): the line is whole.
    Newline,
    /// `\r`: the line is to be redrawn from its start (a progress bar).
    Return,
    /// Not ended: the start of a line that has waited [`PARTIAL_WAIT`] for its end.
    Open,
}

impl End {
    /// What the log file gets after the piece's text.
    fn bytes(self) -> &'static [u8] {
        match self {
            End::Newline => b"\n",
            End::Return => b"\r",
            End::Open => b"",
        }
    }
}

/// A line, or its start, as it is passed on: its text since the line began (no terminator),
/// how much of it was shown already, and how it ends.
#[derive(Debug, PartialEq, Eq)]
struct Piece<'a> {
    text: &'a [u8],
    shown: usize,
    end: End,
}

impl Piece<'_> {
    /// The text not shown yet.
    fn unshown(&self) -> &[u8] {
        &self.text[self.shown.min(self.text.len())..]
    }
}

/// A stream's bytes, as they come, cut into pieces of lines: each whole line (up to `\n`, or
/// [`MAX_LINE`] bytes of a longer one), each line ended by `\r`, and the start of a line that
/// has waited [`PARTIAL_WAIT`] for its end.
#[derive(Default)]
struct Lines {
    /// The current line's bytes so far.
    partial: Vec<u8>,
    /// How many of them were passed on already (as an [`End::Open`] piece).
    shown: usize,
    /// When the first byte not passed on arrived.
    since: Option<Instant>,
}

impl Lines {
    /// Takes in `bytes` (arrived at `now`); passes on every piece they end.
    fn feed(&mut self, mut bytes: &[u8], now: Instant, mut emit: impl FnMut(Piece<'_>)) {
        while !bytes.is_empty() {
            let room = MAX_LINE - self.partial.len();
            let found = bytes
                .iter()
                .take(room)
                .position(|&b| b == b'\n' || b == b'\r');
            let (text, used, end) = match found {
                // `\r\n` is one line end.
                Some(pos) if bytes[pos] == b'\r' && bytes.get(pos + 1) == Some(&b'\n') => {
                    (&bytes[..pos], pos + 2, Some(End::Newline))
                }
                Some(pos) if bytes[pos] == b'\r' => (&bytes[..pos], pos + 1, Some(End::Return)),
                Some(pos) => (&bytes[..pos], pos + 1, Some(End::Newline)),
                None if bytes.len() >= room => (&bytes[..room], room, Some(End::Newline)),
                None => (bytes, bytes.len(), None),
            };
            bytes = &bytes[used..];
            let Some(end) = end else {
                self.partial.extend_from_slice(text);
                self.since.get_or_insert(now);
                continue;
            };
            if self.partial.is_empty() {
                emit(Piece {
                    text,
                    shown: 0,
                    end,
                }); // the common case: no copy
                continue;
            }
            self.partial.extend_from_slice(text);
            emit(Piece {
                text: &self.partial,
                shown: self.shown,
                end,
            });
            self.clear();
        }
    }

    /// When the waiting start of a line is due to be shown, if one waits.
    fn due(&self) -> Option<Instant> {
        self.since.map(|since| since + PARTIAL_WAIT)
    }

    /// Passes on the start of a line that has waited [`PARTIAL_WAIT`] by `now`.
    fn flush_waited(&mut self, now: Instant, mut emit: impl FnMut(Piece<'_>)) {
        if self.due().is_some_and(|due| due <= now) {
            emit(Piece {
                text: &self.partial,
                shown: self.shown,
                end: End::Open,
            });
            self.shown = self.partial.len();
            self.since = None;
        }
    }

    /// At the stream's end: passes on a last line that had no newline.
    fn finish(&mut self, mut emit: impl FnMut(Piece<'_>)) {
        if !self.partial.is_empty() {
            emit(Piece {
                text: &self.partial,
                shown: self.shown,
                end: End::Newline,
            });
            self.clear();
        }
    }

    fn clear(&mut self) {
        self.partial.clear();
        self.shown = 0;
        self.since = None;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The pieces of `input` arriving in chunks of `chunk` bytes, all at once: text (what was not
    /// shown yet) and end.
    fn lines_of(input: &[u8], chunk: usize) -> Vec<(Vec<u8>, End)> {
        let (mut lines, mut out) = (Lines::default(), Vec::new());
        let now = Instant::now();
        let mut keep = |p: Piece<'_>| out.push((p.unshown().to_vec(), p.end));
        for piece in input.chunks(chunk) {
            lines.feed(piece, now, &mut keep);
        }
        lines.finish(&mut keep);
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
        let lines = lines_of(b"first line\nsecond, longer line\r\nno newline at end", 7);
        assert_eq!(
            lines,
            vec![
                (b"first line".to_vec(), End::Newline),
                (b"second, longer line".to_vec(), End::Newline),
                (b"no newline at end".to_vec(), End::Newline)
            ]
        );
    }

    /// tqdm's way, `\rbar 1/5\rbar 2/5...\n`: each redraw is a piece of its own.
    #[test]
    fn a_carriage_return_ends_a_piece() {
        let lines = lines_of(b"\rbar 1/3\rbar 2/3\rbar 3/3\n", 4);
        assert_eq!(
            lines,
            vec![
                (b"".to_vec(), End::Return),
                (b"bar 1/3".to_vec(), End::Return),
                (b"bar 2/3".to_vec(), End::Return),
                (b"bar 3/3".to_vec(), End::Newline),
            ]
        );
    }

    /// The start of a line is passed on once it has waited [`PARTIAL_WAIT`], not before; its
    /// end then brings only the rest, and the whole line for the tail.
    #[test]
    fn a_partial_line_is_shown_after_its_wait() {
        let start = Instant::now();
        let mut lines = Lines::default();
        let mut out = Vec::new();
        lines.feed(b"Password: ", start, |_| panic!("nothing is due yet"));
        assert_eq!(lines.due(), Some(start + PARTIAL_WAIT));
        lines.flush_waited(start + PARTIAL_WAIT / 2, |_| panic!("not yet"));
        lines.flush_waited(start + PARTIAL_WAIT, |p| {
            out.push((p.unshown().to_vec(), p.end))
        });
        assert_eq!(out, vec![(b"Password: ".to_vec(), End::Open)]);
        assert_eq!(lines.due(), None);
        lines.feed(b"ok\n", start + PARTIAL_WAIT * 3, |p| {
            assert_eq!(p.text, b"Password: ok");
            out.push((p.unshown().to_vec(), p.end))
        });
        assert_eq!(out[1], (b"ok".to_vec(), End::Newline));
        assert_eq!(lines.due(), None);
    }

    /// The console for a sequence of pieces: `(stream, rank, text, shown, end)`.
    fn console_of(pieces: &[(Stream, u32, &str, usize, End)]) -> String {
        let mut open = None;
        let mut out = Vec::new();
        for &(stream, rank, text, shown, end) in pieces {
            let piece = Piece {
                text: text.as_bytes(),
                shown,
                end,
            };
            let (close, bytes) = render(&mut open, stream, rank, 1, &piece, false);
            if close.is_some() {
                out.push(b'\n');
            }
            out.extend(bytes);
        }
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn a_bar_is_redrawn_in_place_and_ended_by_another_ranks_line() {
        use End::*;
        let o = Stream::Stderr;
        // tqdm: `\r` first, then a bar per redraw; rank 1's line ends the open bar first.
        let console = console_of(&[
            (o, 0, "", 0, Return),
            (o, 0, "bar 1/3", 0, Return),
            (o, 0, "bar 2/3", 0, Return),
            (Stream::Stdout, 1, "hello", 0, Newline),
            (o, 0, "bar 3/3", 0, Newline),
        ]);
        assert_eq!(
            console,
            "[rank 0] bar 1/3\r[rank 0] bar 2/3\r\n[rank 1] hello\n[rank 0] bar 3/3\n"
        );
        // A partial line shown after its wait, then its rest: one label; cut off by another
        // rank, its rest gets a label of its own and an empty end adds nothing.
        let console = console_of(&[
            (o, 0, "Loading", 0, Open),
            (o, 0, "Loading...", 7, Open),
            (o, 0, "Loading... done", 10, Newline),
            (o, 0, "step", 0, Open),
            (o, 1, "x", 0, Newline),
            (o, 0, "step 2", 4, Newline),
            (o, 0, "half", 0, Open),
            (o, 1, "y", 0, Newline),
            (o, 0, "half", 4, Newline),
            (o, 0, "", 0, Newline),
        ]);
        assert_eq!(
            console,
            "[rank 0] Loading... done\n[rank 0] step\n[rank 1] x\n[rank 0]  2\n[rank 0] half\n[rank 1] y\n[rank 0] \n"
        );
        // `text\r` then `\n` (a line end split between reads): the line, once.
        let console = console_of(&[(o, 0, "a", 0, Return), (o, 0, "", 0, Newline)]);
        assert_eq!(console, "[rank 0] a\r\n");
    }

    #[test]
    fn caps_runaway_lines() {
        let long = vec![b'x'; MAX_LINE + 10];
        let lines = lines_of(&long, 64 * 1024);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].0.len(), MAX_LINE);
        assert_eq!(lines[1].0.len(), 10);
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
                logs: vec![log],
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
