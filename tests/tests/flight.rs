//! The flight recorder, end to end: three workers under `launch` with a short collective
//! timeout, one of them stopped (SIGSTOP, by `GPTREC_FAULT_STOP`) or slowed past the timeout
//! (`GPTREC_FAULT_SLOW`). The failure summary names that rank and the operation the others
//! waited in; every rank's record is in `<run dir>/flight/rank-N.json`, the stopped rank's
//! written by `launch` from its ring; nothing is left running.

mod support;

use std::path::{Path, PathBuf};
use std::time::Duration;

use support::*;

/// `launch` of a tiny 3-rank training whose collectives time out after 2 s, with `env`; its
/// output and the run's flight directory.
fn run(dir: &Path, name: &str, id: &str, env: &[(&str, &str)]) -> (Output, PathBuf) {
    let mut args: Vec<String> = [
        "--num-processes",
        "3",
        "--master-port",
        "0",
        "--grace-period",
        "1",
        "--run-id",
        id,
        "configs/default.toml",
    ]
    .map(String::from)
    .to_vec();
    args.extend(tiny_bpr_sets(dir));
    for set in [
        format!("run.name={name:?}"),
        "dist.timeout_s=2".into(),
        "dist.rendezvous_timeout_s=60".into(),
    ] {
        args.extend(["--set".into(), set]);
    }
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut cmd = launch_cmd(&args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = wait_output(cmd.spawn().expect("start launch"), Duration::from_secs(60));
    (out, dir.join(name).join("flight"))
}

/// The summary line that starts with `prefix` (after its indentation).
#[track_caller]
fn line<'a>(out: &'a Output, prefix: &str) -> &'a str {
    out.stderr
        .lines()
        .map(str::trim_start)
        .find(|l| l.starts_with(prefix))
        .unwrap_or_else(|| panic!("no line starting {prefix:?} in:\n{}", out.stderr))
}

/// The number after `word ` in `text`.
#[track_caller]
fn number_after(text: &str, word: &str) -> f64 {
    let rest = &text[text
        .find(word)
        .unwrap_or_else(|| panic!("{word:?} in {text}"))
        + word.len()..];
    let digits: String = rest
        .trim_start()
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.')
        .collect();
    digits
        .parse()
        .unwrap_or_else(|_| panic!("a number after {word:?} in {text}"))
}

/// The rank the summary names as the root cause.
#[track_caller]
fn root_cause(out: &Output) -> u32 {
    number_after(line(out, "root cause: rank "), "rank") as u32
}

/// Whether `text` says what ranks 0 and 2 did in the operation: together when they ended alike,
/// apart when the teardown's SIGTERM caught one of them before its timeout was over (the two
/// give up within milliseconds of each other, and the first to exit starts the teardown).
fn names_both_waiting(text: &str) -> bool {
    text.contains("ranks 0, 2 were waiting in it for ")
        || (text.contains("rank 0 was ") && text.contains("rank 2 was "))
}

/// The first of the two that waited to fail (`root`) wrote its own record with its error before
/// it exited; the other one's record (its own, or `launch`'s when the teardown's SIGTERM came
/// first) has operation `n`, ended by the timeout or cut short.
#[track_caller]
fn assert_waiting_records(out: &Output, flight: &Path, n: u64, root: u32) {
    assert!(root == 0 || root == 2, "root cause {root}:\n{}", out.stderr);
    let rec = record(flight, root);
    assert_eq!(rec["written_by"], "rank", "{rec}");
    let error = rec["error"].as_str().unwrap_or_default();
    assert!(error.contains("no answer from rank(s) [1]"), "{rec}");
    assert_eq!(entry(flight, root, n)["outcome"], "timeout");
    let other = entry(flight, 2 - root, n);
    assert!(
        other["outcome"] == "timeout" || other["outcome"] == "running",
        "{other}"
    );
}

fn record(flight: &Path, rank: u32) -> serde_json::Value {
    let path = flight.join(format!("rank-{rank}.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Rank `rank`'s record of operation `seq`.
#[track_caller]
fn entry(flight: &Path, rank: u32, seq: u64) -> serde_json::Value {
    let rec = record(flight, rank);
    rec["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["seq"] == seq)
        .cloned()
        .unwrap_or_else(|| panic!("rank {rank} has no operation {seq}: {rec}"))
}

#[test]
fn a_stopped_rank_is_named_as_never_entering_the_operation_the_others_waited_in() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("flight-stop");
    let (out, flight) = run(dir.path(), "stopped", &id, &[("GPTREC_FAULT_STOP", "4@1")]);
    out.assert_code(1);
    out.assert_ended_within(25);
    assert_no_processes(&id, Duration::from_secs(5));
    // The stopped rank is the root cause, though the others failed (timed out) before launch
    // killed it.
    line(&out, "root cause: rank 1 ");
    line(&out, "flight recorder (the last collectives of each rank):");
    let stuck = line(&out, "rank 1 never entered operation ");
    let n = number_after(stuck, "operation") as u64;
    assert!(stuck.contains(" at step 4); "), "{stuck}");
    assert!(names_both_waiting(stuck), "{stuck}");
    // The root cause waited the 2 s timeout, then up to 3 s for the others to report.
    assert!(stuck.contains(" s, then timed out"), "{stuck}");
    let waited = number_after(stuck, "waiting in it for");
    assert!((1.9..8.0).contains(&waited), "{stuck}");
    let done = line(&out, "last operation completed by every rank: ");
    assert_eq!(number_after(done, "rank:") as u64, n - 1, "{done}");
    let records = format!(
        "records of ranks 0, 1, 2: {}",
        flight.join("rank-N.json").display()
    );
    line(&out, &records);
    // Which of the two waiting ranks failed first: the one that wrote its own record.
    let first = [0, 2]
        .into_iter()
        .find(|&r| record(&flight, r)["written_by"] == "rank")
        .unwrap_or_else(|| panic!("neither waiting rank wrote its record:\n{}", out.stderr));
    assert_waiting_records(&out, &flight, n, first);
    // `launch` wrote the stopped rank's record from its ring: it ends at operation n - 1.
    let stopped = record(&flight, 1);
    assert_eq!(stopped["written_by"], "launch", "{stopped}");
    let last = stopped["entries"]
        .as_array()
        .unwrap()
        .last()
        .cloned()
        .unwrap();
    assert_eq!(
        (last["seq"].as_u64(), &last["outcome"]),
        (Some(n - 1), &"ok".into())
    );
}

#[test]
fn a_rank_later_than_the_timeout_is_named_with_how_late_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("flight-slow");
    // 3.5 s more per micro-batch on rank 1: its first training step comes 1.5 s after the
    // others' 2 s timeout, and before they stop waiting to hear who is silent (3 s more).
    let (out, flight) = run(dir.path(), "slow", &id, &[("GPTREC_FAULT_SLOW", "3500@1")]);
    out.assert_code(1);
    out.assert_ended_within(25);
    assert_no_processes(&id, Duration::from_secs(5));
    let late = line(&out, "rank 1 entered operation ");
    let n = number_after(late, "operation") as u64;
    let by = number_after(late, ")");
    assert!((3.4..5.0).contains(&by), "{late}");
    assert!(
        late.contains(" at step 1) ") && late.contains(" later than its 2.0 s timeout; "),
        "{late}"
    );
    assert!(names_both_waiting(late), "{late}");
    // The records agree: rank 1 began operation n that much after the others.
    let start = |rank| entry(&flight, rank, n)["start_unix_ns"].as_u64().unwrap();
    let gap = start(1).saturating_sub(start(0).min(start(2))) as f64 / 1e9;
    assert!((by - gap).abs() < 0.2, "{late}: the records say {gap} s");
    assert_waiting_records(&out, &flight, n, root_cause(&out));
}

#[test]
fn a_bad_number_of_entries_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let id = unique_run_id("flight-bad");
    let (out, _) = run(dir.path(), "bad", &id, &[("GPTREC_FLIGHT_ENTRIES", "lots")]);
    out.assert_code(2);
    out.assert_stderr(
        "GPTREC_FLIGHT_ENTRIES=lots: expected a whole number of operations from 0 (no recorder) to 65536",
    );
}
