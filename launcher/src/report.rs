//! What the user reads when a group ends badly: the failure summary (root cause first, with its
//! last stderr lines, then what the flight recorder says: [`flight`]) and the exit code that goes
//! with it. It formats; it decides nothing.

use std::fmt::Write as _;
use std::ops::Range;
use std::time::Duration;

use nix::sys::signal::Signal;

pub mod error_file;
pub mod flight;
pub mod oom;

/// How one worker ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    Code(i32),
    Signal(i32),
}

impl Ending {
    /// The shell convention: the exit code, or 128 + signal number.
    pub fn exit_code(self) -> i32 {
        match self {
            Ending::Code(code) => code,
            Ending::Signal(sig) => 128 + sig,
        }
    }

    pub fn is_success(self) -> bool {
        self == Ending::Code(0)
    }
}

impl std::fmt::Display for Ending {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Ending::Code(code) => write!(f, "exit code {code}"),
            Ending::Signal(sig) => write!(f, "killed by {}", signal_name(*sig)),
        }
    }
}

/// `SIGKILL`, `SIGSEGV`, ... or `signal 42`.
pub fn signal_name(sig: i32) -> String {
    Signal::try_from(sig).map_or_else(|_| format!("signal {sig}"), |s| s.as_str().to_string())
}

/// One worker's record at the end of a group run.
#[derive(Debug, Clone)]
pub struct WorkerRecord {
    pub rank: u32,
    pub local_rank: u32,
    pub pid: i32,
    pub ending: Ending,
    /// Time from the group's start to this worker's exit.
    pub after: Duration,
    /// The signal the launcher sent it during teardown, if any.
    pub sent_by_launcher: Option<Signal>,
    /// It was stopped (SIGSTOP) when the teardown began: it had stopped answering.
    pub was_stopped: bool,
    pub stderr_tail: Vec<String>,
    /// torchrun's error file of this worker (`TORCHELASTIC_ERROR_FILE`), where it may have
    /// recorded its exception.
    pub error_file: Option<std::path::PathBuf>,
}

/// Says that every worker stopped at a checkpoint (a preemption on another node); exit code 75.
pub fn stopped_at_checkpoint() -> i32 {
    tracing::info!("every worker stopped at a checkpoint (exit code 75: preempted, resumable): run the same command again to resume");
    common::env_contract::EXIT_REGROUP
}

/// Says that the launcher was stopped by `signal`; the exit code for it.
pub fn interrupted(signal: i32) -> i32 {
    tracing::warn!(
        "stopped by {}: every worker was terminated; exit code {}",
        signal_name(signal),
        128 + signal
    );
    128 + signal
}

/// The root cause among `records`: the first to fail (`earliest`), or a rank it names in its
/// last words (`no answer from rank(s) [1]`, `rank 3 ... ended before the job finished`) that
/// was found stopped (SIGSTOP, a debugger) when the teardown began or failed on its own without
/// naming it back, and so on down the chain: a rank that failed because another went away did
/// so however soon it said so (two exits in the same millisecond are reaped in either order).
/// A stopped rank that nobody names is only said to be stopped.
pub fn root_cause(records: &[WorkerRecord], earliest: usize) -> usize {
    let mut root = earliest;
    let mut seen = vec![earliest];
    while let Some(next) = named_cause(records, root).filter(|n| !seen.contains(n)) {
        seen.push(next);
        root = next;
    }
    root
}

/// The rank that `records[by]` names as gone and that went on its own (see [`root_cause`]).
fn named_cause(records: &[WorkerRecord], by: usize) -> Option<usize> {
    let first = &records[by];
    let named = named_peers(&first.stderr_tail, first.rank);
    if let Some(stopped) = (records.iter()).position(|r| r.was_stopped && named.contains(&r.rank)) {
        return Some(stopped);
    }
    (records.iter().enumerate())
        .filter(|(_, r)| {
            named.contains(&r.rank)
                && r.sent_by_launcher.is_none()
                && !r.ending.is_success()
                && !named_peers(&r.stderr_tail, r.rank).contains(&first.rank)
        })
        .min_by_key(|(_, r)| r.after)
        .map(|(i, _)| i)
}

/// The launcher's exit code after a failure: the root cause's, unless launch itself ended it (a
/// stopped rank, killed in the teardown): then that of the first rank that failed on its own,
/// else 1. Never 0.
pub fn exit_code(records: &[WorkerRecord], root: usize) -> i32 {
    let r = &records[root];
    let code = if r.was_stopped && r.sent_by_launcher.is_some() {
        records
            .iter()
            .filter(|w| w.sent_by_launcher.is_none() && !w.ending.is_success())
            .min_by_key(|w| w.after)
            .map_or(1, |w| w.ending.exit_code())
    } else {
        r.ending.exit_code()
    };
    if code == 0 {
        1
    } else {
        code
    }
}

/// The multi-line summary after a failure. `root` indexes `records`; `this_node` holds the
/// global ranks that run on this node (all of them on a single node); `flight` is what the
/// flight recorder says ([`flight::lines`]), if anything.
pub fn failure_summary(
    records: &[WorkerRecord],
    root: usize,
    attempts: u32,
    this_node: Range<u32>,
    flight: &[String],
) -> String {
    let mut out = String::new();
    let r = &records[root];
    let _ = writeln!(out, "launch: worker group failed");
    // A rank that failed because a rank on another node went away is only this node's first
    // failure: the other node's launch reports the one that came first.
    let remote = remote_peers(&r.stderr_tail, r.rank, &this_node);
    let _ = writeln!(
        out,
        "  root cause{}: rank {} (local_rank {}, pid {}): {} after {:.2} s",
        if remote.is_empty() {
            ""
        } else {
            " on this node"
        },
        r.rank,
        r.local_rank,
        r.pid,
        if r.was_stopped {
            format!(
                "stopped (SIGSTOP, or a debugger) and no longer answering; {} from launch",
                r.ending
            )
        } else {
            r.ending.to_string()
        },
        r.after.as_secs_f64()
    );
    if let Some(line) = oom::line(r) {
        let _ = writeln!(out, "{line}");
    }
    if !remote.is_empty() {
        let list = remote
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        let _ = writeln!(
            out,
            "  rank {} lost rank(s) {list}, which run on another node: the first failure is probably there (that node's launch names it)",
            r.rank
        );
    }
    if let Some(recorded) = r.error_file.as_deref().and_then(error_file::read) {
        out.push_str(&recorded.lines());
    }
    if r.stderr_tail.is_empty() {
        let _ = writeln!(out, "  rank {} wrote nothing to stderr", r.rank);
    } else {
        let _ = writeln!(out, "  last stderr lines of rank {}:", r.rank);
        for line in &r.stderr_tail {
            let _ = writeln!(out, "    | {line}");
        }
    }
    let others: Vec<&WorkerRecord> = records
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != root)
        .map(|(_, w)| w)
        .collect();
    if !others.is_empty() {
        let _ = writeln!(out, "  other ranks:");
        for w in others {
            let how = match (w.sent_by_launcher, w.ending) {
                (Some(Signal::SIGKILL), _) => {
                    format!("{} (SIGKILL from launch after the grace period)", w.ending)
                }
                (Some(sent), _) => format!("{} (after {} from launch)", w.ending, sent.as_str()),
                (None, ending) if !ending.is_success() => format!("{ending} (also failed)"),
                (None, ending) => ending.to_string(),
            };
            let how = if w.was_stopped {
                format!("{how}; it was stopped (SIGSTOP) when the teardown began: it had stopped answering")
            } else {
                how
            };
            let _ = writeln!(
                out,
                "    rank {} (local_rank {}, pid {}): {how} at {:.2} s",
                w.rank,
                w.local_rank,
                w.pid,
                w.after.as_secs_f64()
            );
        }
    }
    if !flight.is_empty() {
        let _ = writeln!(
            out,
            "  flight recorder (the last collectives of each rank):"
        );
        for line in flight {
            let _ = writeln!(out, "    {line}");
        }
    }
    if attempts > 1 {
        let _ = writeln!(
            out,
            "  the group was started {attempts} times; this was the last"
        );
    }
    let _ = write!(out, "  launch exits with {}", exit_code(records, root));
    out
}

/// Ranks outside `this_node` that the last stderr lines of a failed rank name (`connection to
/// rank 3 failed`, `no answer from rank(s) [2, 3]`): the peers it lost. Progress and debug
/// log lines are skipped: they name ranks that are well (`peak mem 360 MiB (rank 3)`).
fn remote_peers(tail: &[String], own: u32, this_node: &Range<u32>) -> Vec<u32> {
    let mut peers = named_peers(tail, own);
    peers.retain(|n| !this_node.contains(n));
    peers
}

/// The ranks other than `own` that the last lines of a rank's stderr name (`rank 3`,
/// `rank(s) [1, 2]`), sorted, once each.
fn named_peers(tail: &[String], own: u32) -> Vec<u32> {
    let mut peers = Vec::new();
    for line in tail.iter().rev().take(3).filter(|l| !is_progress_log(l)) {
        let mut rest = line.as_str();
        while let Some(at) = rest.find("rank") {
            rest = &rest[at + 4..];
            let after = rest
                .trim_start_matches("(s)")
                .trim_start()
                .trim_start_matches('[');
            let mut numbers = after;
            loop {
                let digits: String = numbers.chars().take_while(char::is_ascii_digit).collect();
                let Ok(n) = digits.parse::<u32>() else { break };
                if n != own && !peers.contains(&n) {
                    peers.push(n);
                }
                numbers = numbers[digits.len()..].trim_start_matches([',', ' ']);
            }
        }
    }
    peers.sort_unstable();
    peers
}

/// A `tracing` line below warning level (`  INFO epoch 1/2 ...`): a report, never a failure.
fn is_progress_log(line: &str) -> bool {
    let first = line.split_whitespace().next().unwrap_or("");
    // `INFO epoch ...` (ours), `INFO:root:...` (Python's logging without a format).
    let level = first.split(':').next().unwrap_or("");
    matches!(level, "INFO" | "DEBUG" | "TRACE")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(rank: u32, ending: Ending, sent: Option<Signal>) -> WorkerRecord {
        WorkerRecord {
            rank,
            local_rank: rank,
            pid: 100 + rank as i32,
            ending,
            after: Duration::from_millis(1500),
            sent_by_launcher: sent,
            was_stopped: false,
            stderr_tail: if rank == 1 {
                vec!["Traceback".into(), "ValueError: boom".into()]
            } else {
                vec![]
            },
            error_file: None,
        }
    }

    #[test]
    fn exit_codes_follow_the_shell_convention() {
        assert_eq!(Ending::Code(3).exit_code(), 3);
        assert_eq!(Ending::Signal(9).exit_code(), 137);
        assert_eq!(Ending::Signal(9).to_string(), "killed by SIGKILL");
    }

    #[test]
    fn summary_names_the_root_cause_first() {
        let records = vec![
            record(0, Ending::Signal(15), Some(Signal::SIGTERM)),
            record(1, Ending::Code(3), None),
            record(2, Ending::Signal(9), Some(Signal::SIGKILL)),
        ];
        let text = failure_summary(&records, 1, 1, 0..3, &[]);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[1],
            "  root cause: rank 1 (local_rank 1, pid 101): exit code 3 after 1.50 s"
        );
        assert!(text.contains("    | ValueError: boom"));
        assert!(text.contains(
            "rank 0 (local_rank 0, pid 100): killed by SIGTERM (after SIGTERM from launch)"
        ));
        assert!(text.contains("SIGKILL from launch after the grace period"));
        assert!(text.ends_with("launch exits with 3"));
        assert!(!text.contains("on this node"), "{text}");
    }

    #[test]
    fn a_stopped_rank_is_the_root_cause_though_the_others_failed_first() {
        // Rank 0 timed out waiting for rank 1, which was stopped and then killed by launch.
        let mut records = vec![
            record(0, Ending::Code(1), None),
            record(1, Ending::Signal(9), Some(Signal::SIGKILL)),
        ];
        assert_eq!(root_cause(&records, 0), 0);
        records[1].was_stopped = true;
        // Stopped, but not named by the rank that failed: that one stays the root cause.
        assert_eq!(root_cause(&records, 0), 0);
        records[0].stderr_tail = vec![
            "worker: error: training: all_reduce at step 4 timed out after 2.0 s: no answer from rank(s) [1] (stopped, or never entered it)".into(),
        ];
        let root = root_cause(&records, 0);
        assert_eq!(root, 1);
        let text = failure_summary(&records, root, 1, 0..2, &[]);
        assert!(
            text.contains("  root cause: rank 1 (local_rank 1, pid 101): stopped (SIGSTOP, or a debugger) and no longer answering; killed by SIGKILL from launch after 1.50 s"),
            "{text}"
        );
        assert!(
            text.contains("    rank 0 (local_rank 0, pid 100): exit code 1 (also failed)"),
            "{text}"
        );
        // Not 137: launch killed it; the job failed with the others' code.
        assert_eq!(exit_code(&records, root), 1);
        assert!(text.ends_with("launch exits with 1"), "{text}");
    }

    #[test]
    fn a_rank_that_failed_on_its_own_is_the_root_cause_though_its_peer_was_reaped_first() {
        // Rank 1 ran out of memory; rank 0 saw it go and exited in the same millisecond, and
        // its exit was the first the launcher reaped.
        let oom = "worker: error: out of memory on rank 1 (cpu) during the forward pass";
        let mut records = vec![
            record(0, Ending::Code(1), None),
            record(1, Ending::Code(3), None),
        ];
        records[0].stderr_tail = vec![
            " INFO epoch 1/1 step 2/19 peak mem 369 MiB (rank 2) ETA 0s".into(),
            "worker: error: stopping: rank 1 (host vm, node 0, pid 101) ended before the job finished".into(),
        ];
        records[1].stderr_tail = vec![oom.into()];
        assert_eq!(root_cause(&records, 0), 1);
        let text = failure_summary(&records, 1, 1, 0..2, &[]);
        assert!(
            text.contains("  root cause: rank 1 (local_rank 1, pid 101): exit code 3"),
            "{text}"
        );
        assert!(text.ends_with("launch exits with 3"), "{text}");
        // Killed by launch in the teardown: a consequence, not a cause.
        records[1].sent_by_launcher = Some(Signal::SIGTERM);
        assert_eq!(root_cause(&records, 0), 0);
        // Two ranks that each name the other (both timed out): the first stays the root cause.
        records[1].sent_by_launcher = None;
        records[1].stderr_tail = vec!["no answer from rank(s) [0]".into()];
        assert_eq!(root_cause(&records, 0), 0);
        records[1].stderr_tail = vec![oom.into()];
        assert_eq!(root_cause(&records, 0), 1);
        // Named only by a progress line (ours, or Python's logging): not a lost peer.
        for progress in [
            " INFO epoch 1/1 step 2/19 peak mem 369 MiB (rank 1) ETA 0s",
            "INFO:root:rank 1 is at step 2",
        ] {
            records[0].stderr_tail = vec![progress.into(), "ValueError: boom".into()];
            assert_eq!(root_cause(&records, 0), 0, "{progress}");
        }
    }

    #[test]
    fn the_root_cause_is_followed_down_a_chain_of_lost_peers() {
        // Rank 0 lost rank 1, which lost rank 2, which failed on its own; rank 3 also failed
        // on its own, later, and nobody names it.
        let mut records: Vec<WorkerRecord> = (0..4)
            .map(|r| record(r, Ending::Code(if r == 2 { 3 } else { 1 }), None))
            .collect();
        records[0].stderr_tail = vec!["connection to rank 1 failed".into()];
        records[1].stderr_tail = vec!["no answer from rank(s) [2, 3]".into()];
        records[2].stderr_tail = vec!["CUDA error: an illegal memory access".into()];
        records[3].stderr_tail = vec!["ValueError: boom".into()];
        records[3].after = Duration::from_millis(1600);
        assert_eq!(root_cause(&records, 0), 2);
        // Of two named ranks that failed on their own, the first to end.
        records[3].after = Duration::from_millis(1400);
        assert_eq!(root_cause(&records, 0), 3);
        // A cycle (0 -> 1 -> 2 -> 0) ends before a rank comes round again.
        records[2].stderr_tail = vec!["connection to rank 0 failed".into()];
        records[3].stderr_tail = vec!["connection to rank 1 failed".into()];
        assert_eq!(root_cause(&records, 0), 2);
    }

    #[test]
    fn the_flight_recorder_speaks_after_the_ranks_and_before_the_exit_code() {
        let records = vec![
            record(0, Ending::Code(1), None),
            record(1, Ending::Signal(9), Some(Signal::SIGKILL)),
        ];
        let flight = ["rank 1 never entered operation 24".to_string()];
        let text = failure_summary(&records, 0, 1, 0..2, &flight);
        let tail: Vec<&str> = text.lines().rev().take(3).collect();
        assert_eq!(
            tail,
            [
                "  launch exits with 1",
                "    rank 1 never entered operation 24",
                "  flight recorder (the last collectives of each rank):",
            ]
        );
        let none = failure_summary(&records, 0, 1, 0..2, &[]);
        assert!(!none.contains("flight recorder"), "{none}");
    }

    #[test]
    fn a_rank_that_lost_a_peer_on_another_node_is_only_this_nodes_root_cause() {
        let mut lost = record(0, Ending::Code(1), None);
        lost.stderr_tail = vec![
            "INFO epoch 1/6 step 2/138 (rank 0)".into(),
            // The rank with the peak memory, on another node, is not a lost peer.
            " INFO epoch 1/6 step 3/138 peak mem 360 MiB (rank 5) ETA 0s".into(),
            "worker: error: training: all_reduce at step 3: connection to rank 3 failed: the peer closed the connection".into(),
        ];
        let text = failure_summary(&[lost.clone()], 0, 1, 0..2, &[]);
        assert!(
            text.contains("  root cause on this node: rank 0 "),
            "{text}"
        );
        assert!(
            text.contains("rank 0 lost rank(s) 3, which run on another node"),
            "{text}"
        );
        lost.stderr_tail = vec![
            "all_reduce at step 3 timed out after 3.0 s: no answer from rank(s) [1, 2, 3]".into(),
        ];
        let text = failure_summary(&[lost.clone()], 0, 1, 0..2, &[]);
        assert!(text.contains("lost rank(s) 2, 3,"), "{text}");
        // A local peer is not another node's failure.
        lost.stderr_tail = vec!["connection to rank 1 failed".into()];
        let text = failure_summary(&[lost], 0, 1, 0..2, &[]);
        assert!(text.contains("  root cause: rank 0 "), "{text}");
    }
}
