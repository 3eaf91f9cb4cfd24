//! `ranks --watch`: the detection phase after the set-up rounds. Every simulated rank does what
//! `runtime::job_watch::JobWatch::start` does: one more connection (from its host's loopback
//! address), its will left on it (`job/will/<r>`: write `job/failed` = "rank r (host hG, node G,
//! pid P) ended before the job finished" if this connection ends holding it), and a thread of
//! its own (small stack) parked in `wait ["job/failed"]` on that connection. The set-up
//! connections stay open meanwhile (as a real job keeps them): the server holds 2N + N/L.
//!
//! Then `watching` on stdout, and commands on stdin:
//! - `kill R`: if this process owns rank R, it notes the time and closes R's watching
//!   connection (as R's process death would; the server writes R's will). Every process then
//!   waits until each of its watchers (R's own aside) has its answer, 10 s at most, and prints
//!   `{"watch_first_unix","watch_last_unix","kill_unix" (the owner only),"watchers","answered",
//!   "line"}`: the first and last answer, how many watchers should be told and how many were
//!   told R's line, and the value seen (a wrong one if any was); "errors" and "error" when a
//!   wait failed.
//! - EOF: the same line if no `kill` came, and the process ends.

use std::collections::HashMap;
use std::io::{self, BufRead, Write};
use std::sync::{Arc, Condvar, Mutex};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use store::{StoreClient, StoreCloser, StoreError};

use crate::traffic::{host_ip, Job, Rank, WAIT_TIMEOUT};

/// `job_watch.rs`'s key, and its one wait.
const FAILED: &str = "job/failed";
const WATCH_WAIT: Duration = Duration::from_secs(3600);
/// A watcher thread's stack: it only waits.
const WATCHER_STACK: usize = 64 << 10;
/// How long a process waits, after `kill R`, for its watchers' answers.
const ANSWERS_WITHIN: Duration = Duration::from_secs(10);

/// What the watchers share with the main thread.
#[derive(Default)]
struct Board {
    /// Watchers about to send their wait.
    parked: u32,
    /// Each watcher's return: its rank, when (unix s), the value or the error.
    returned: Vec<(u32, f64, Result<String, String>)>,
    /// The watching connections, kept open once answered (until the process ends).
    kept: Vec<StoreClient>,
}

#[derive(Default)]
struct Shared {
    board: Mutex<Board>,
    changed: Condvar,
}

impl Shared {
    fn board(&self) -> std::sync::MutexGuard<'_, Board> {
        self.board.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The detection phase for ranks `first..first + count`, with `threads` threads opening the
/// watching connections; `setup` holds the set-up connections open until the end.
pub fn watch(
    job: &Arc<Job>,
    (first, count): (u32, u32),
    threads: u32,
    setup: Vec<Rank>,
) -> Result<(), String> {
    let shared = Arc::new(Shared::default());
    let openers: Vec<_> = (0..threads)
        .map(|t| {
            let lo = first + (u64::from(count) * u64::from(t) / u64::from(threads)) as u32;
            let hi = first + (u64::from(count) * u64::from(t + 1) / u64::from(threads)) as u32;
            let job = Arc::clone(job);
            let shared = Arc::clone(&shared);
            thread::Builder::new()
                .name(format!("watch-open-{lo}"))
                .spawn(move || open(&job, lo..hi, &shared))
        })
        .collect::<Result<_, _>>()
        .map_err(|e| format!("cannot start a thread: {e}"))?;
    let mut closers = HashMap::new();
    for opener in openers {
        let opened = opener
            .join()
            .map_err(|_| "a watch-opening thread panicked".to_string())??;
        closers.extend(opened);
    }
    // Every watcher is about to send its wait (the caller gives them time to reach the server).
    let deadline = Instant::now() + WAIT_TIMEOUT;
    let mut board = shared.board();
    while board.parked < count {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(format!(
                "{} of {count} watchers started within {WAIT_TIMEOUT:?}",
                board.parked
            ));
        }
        board = shared
            .changed
            .wait_timeout(board, left)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
    drop(board);
    say("watching")?;

    let mut reported = false;
    for line in io::stdin().lock().lines() {
        let line = line.map_err(|e| format!("stdin: {e}"))?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            [] => {}
            ["kill", rank] => {
                let rank: u32 = rank
                    .parse()
                    .map_err(|_| format!("kill {rank:?}: not a rank"))?;
                let kill_unix = closers.get(&rank).map(|closer: &StoreCloser| {
                    let at = unix_now();
                    closer.close();
                    at
                });
                let mine = (first..first + count).contains(&rank);
                let expected = count - u32::from(mine);
                let deadline = Instant::now() + ANSWERS_WITHIN;
                let mut board = shared.board();
                while told(&board, rank) < expected {
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        break;
                    }
                    board = shared
                        .changed
                        .wait_timeout(board, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                let shown = report(&board, Some(rank), kill_unix, expected);
                drop(board);
                say(&shown)?;
                reported = true;
            }
            _ => return Err(format!("unexpected command {line:?} (kill R, or EOF)")),
        }
    }
    if !reported {
        let shown = report(&shared.board(), None, None, count);
        say(&shown)?;
    }
    drop(setup);
    Ok(())
}

/// Opens the watching connection of each of `ranks`, leaves its will and starts its watcher;
/// the closers, by rank.
fn open(
    job: &Job,
    ranks: std::ops::Range<u32>,
    shared: &Arc<Shared>,
) -> Result<Vec<(u32, StoreCloser)>, String> {
    let mut closers = Vec::with_capacity(ranks.len());
    let pid = std::process::id();
    for rank in ranks {
        let g = rank / job.local;
        let source = host_ip(g);
        let mut client = StoreClient::connect_from(&job.addr, &job.run_id, WAIT_TIMEOUT, source)
            .map_err(|e| format!("rank {rank}: watch: connect from {source}: {e}"))?;
        // As `JobWatch::start` and the worker's line.
        let line =
            format!("rank {rank} (host h{g}, node {g}, pid {pid}) ended before the job finished");
        client
            .set_will(&format!("job/will/{rank}"), FAILED, line.as_bytes())
            .map_err(|e| format!("rank {rank}: watch: will: {e}"))?;
        let closer = client
            .closer()
            .ok_or_else(|| format!("rank {rank}: watch: no closer"))?;
        let shared = Arc::clone(shared);
        thread::Builder::new()
            .name(format!("watch-{rank}"))
            .stack_size(WATCHER_STACK)
            .spawn(move || watcher(rank, client, &shared))
            .map_err(|e| format!("rank {rank}: watch: cannot start its thread: {e}"))?;
        closers.push((rank, closer));
    }
    Ok(closers)
}

/// One rank's watch: parked in the wait for `job/failed` until it is written (or the
/// connection ends).
fn watcher(rank: u32, mut client: StoreClient, shared: &Shared) {
    shared.board().parked += 1;
    shared.changed.notify_all();
    let outcome = loop {
        match client.wait(&[FAILED], WATCH_WAIT) {
            Ok(mut values) => break Ok(String::from_utf8_lossy(&values.remove(0)).into_owned()),
            Err(StoreError::WaitTimeout { .. }) => continue,
            Err(e) => break Err(e.to_string()),
        }
    };
    let at = unix_now();
    let mut board = shared.board();
    board.returned.push((rank, at, outcome));
    board.kept.push(client);
    drop(board);
    shared.changed.notify_all();
}

/// Whether `line` is the will of `rank`.
fn names(line: &str, rank: u32) -> bool {
    line.starts_with(&format!("rank {rank} ("))
}

/// How many watchers other than `killed`'s returned.
fn told(board: &Board, killed: u32) -> u32 {
    board.returned.iter().filter(|(r, ..)| *r != killed).count() as u32
}

/// The JSON line of the phase (see the module documentation).
fn report(board: &Board, killed: Option<u32>, kill_unix: Option<f64>, watchers: u32) -> String {
    let others = || {
        board
            .returned
            .iter()
            .filter(move |(r, ..)| Some(*r) != killed)
    };
    let times: Vec<f64> = others()
        .filter(|(_, _, o)| o.is_ok())
        .map(|(_, at, _)| *at)
        .collect();
    let values: Vec<&str> = others().filter_map(|(_, _, o)| o.as_deref().ok()).collect();
    let right = |v: &str| killed.is_some_and(|k| names(v, k));
    let answered = values.iter().filter(|v| right(v)).count();
    let line = values
        .iter()
        .find(|v| !right(v))
        .or(values.first())
        .copied()
        .unwrap_or("");
    let errors: Vec<&str> = others()
        .filter_map(|(_, _, o)| o.as_ref().err().map(String::as_str))
        .collect();
    let mut shown = serde_json::json!({
        "watch_first_unix": times.iter().copied().reduce(f64::min),
        "watch_last_unix": times.iter().copied().reduce(f64::max),
        "watchers": watchers,
        "answered": answered,
        "line": line,
    });
    if let Some(at) = kill_unix {
        shown["kill_unix"] = at.into();
    }
    if let Some(first) = errors.first() {
        shown["errors"] = errors.len().into();
        shown["error"] = (*first).into();
    }
    shown.to_string()
}

fn say(line: &str) -> Result<(), String> {
    let mut out = io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| format!("stdout: {e}"))
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}
