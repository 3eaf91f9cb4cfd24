//! Tests of the flight recorder's summary lines: records in, lines out.

use common::flight::{Dtype, Dump, Entry, Header, Kind, Outcome, Recording};

use super::*;

const S: u64 = 1_000_000_000;
/// When operation 42 began on the first rank.
const T0: u64 = 1_700_000_000 * S;

fn op(seq: u64, outcome: Outcome, start: u64, end: Option<u64>) -> Entry {
    Entry {
        seq,
        kind: Kind::AllReduce,
        tensors: 3,
        elements: 300_000,
        bytes: 1_200_000,
        dtype: Dtype::F32,
        step: seq / 8,
        root: None,
        timeout_ms: 2000,
        start_unix_ns: start,
        end_unix_ns: end,
        outcome,
    }
}

/// Operations 35..=41 completed, 0.1 s apart, before `T0`.
fn done() -> Vec<Entry> {
    (35..=41)
        .map(|seq| {
            let start = T0 - (42 - seq) * S / 10;
            op(seq, Outcome::Ok, start, Some(start + S / 100))
        })
        .collect()
}

fn rec(rank: u32, entries: Vec<Entry>) -> Recording {
    Recording {
        header: Header {
            rank,
            world: 3,
            capacity: 256,
            pid: 100 + rank,
            restart: 0,
            opened_unix_ns: T0 - 10 * S,
            run: "sha256:0123456789ab".into(),
            backend: "tcp (shared memory)".into(),
        },
        entries,
    }
}

/// A rank that waited in 42 from `T0 + start_s` for `for_s`, ending with `outcome`.
fn waited(rank: u32, start_s: f64, for_s: f64, outcome: Outcome) -> Recording {
    let start = T0 + (start_s * 1e9) as u64;
    let end = (outcome != Outcome::Running).then_some(start + (for_s * 1e9) as u64);
    let mut entries = done();
    entries.push(op(42, outcome, start, end));
    rec(rank, entries)
}

#[test]
fn a_stopped_rank_never_entered_the_operation_the_others_waited_in() {
    let records = [
        waited(0, 0.0, 5.0, Outcome::Timeout),
        rec(1, done()),
        waited(2, 0.01, 5.0, Outcome::Timeout),
    ];
    let lines = analyze(&records, &[0, 1, 2], T0 + 7 * S);
    assert_eq!(
        lines,
        [
            "last operation completed by every rank: 41 (all_reduce of 1.1 MiB f32 at step 5)",
            "rank 1 never entered operation 42 (all_reduce of 1.1 MiB f32 at step 5); ranks 0, 2 were waiting in it for 5.0 s, then timed out",
        ]
    );
}

#[test]
fn a_rank_that_came_later_than_the_timeout_is_named_with_how_late() {
    let records = [
        waited(0, 0.0, 5.0, Outcome::Timeout),
        waited(1, 3.5, 0.0, Outcome::Running),
        waited(2, 0.0, 5.0, Outcome::Timeout),
    ];
    let lines = analyze(&records, &[0, 1, 2], T0 + 6 * S);
    assert_eq!(
        lines[1],
        "rank 1 entered operation 42 (all_reduce of 1.1 MiB f32 at step 5) 3.5 s after rank 0, later than its 2.0 s timeout; ranks 0, 2 were waiting in it for 5.0 s, then timed out; rank 1 was still in it (started 2.5 s ago)"
    );
}

#[test]
fn a_rank_without_a_record_is_named_and_ranks_still_waiting_say_since_when() {
    let records = [
        waited(0, 0.0, 0.0, Outcome::Running),
        waited(2, 0.2, 0.0, Outcome::Running),
    ];
    let lines = analyze(&records, &[0, 1, 2], T0 + 3 * S);
    assert_eq!(
        lines[1],
        "rank 1 left no flight record; ranks 0, 2 were still in operation 42 (all_reduce of 1.1 MiB f32 at step 5) (started 3.0 s ago)"
    );
}

#[test]
fn when_every_rank_entered_on_time_each_ending_is_told() {
    let records = [
        waited(0, 0.0, 2.0, Outcome::PeerFailed),
        waited(1, 0.5, 0.0, Outcome::Running),
    ];
    let lines = analyze(&records, &[0, 1], T0 + 4 * S);
    assert_eq!(
        lines[1],
        "every rank entered operation 42 (all_reduce of 1.1 MiB f32 at step 5) and none completed it: rank 0 was waiting in it for 2.0 s, then lost a peer; rank 1 was still in it (started 3.5 s ago)"
    );
}

#[test]
fn ranks_that_called_different_operations_are_shown_side_by_side() {
    let mut other = waited(1, 0.0, 1.0, Outcome::Mismatch);
    if let Some(last) = other.entries.last_mut() {
        last.kind = Kind::Broadcast;
        last.elements = 10;
    }
    let lines = analyze(
        &[waited(0, 0.0, 1.0, Outcome::Mismatch), other],
        &[0, 1],
        T0 + 2 * S,
    );
    assert_eq!(
        lines[1],
        "the ranks disagree on operation 42: rank 0: all_reduce of 300000 elements, rank 1: broadcast of 10 elements"
    );
}

#[test]
fn with_nothing_stuck_only_the_last_operations_are_told() {
    let lines = analyze(&[rec(0, done()), rec(1, done())], &[0, 1, 2], T0);
    assert_eq!(
        lines,
        [
            "last operation completed by every rank: 41 (all_reduce of 1.1 MiB f32 at step 5)",
            "rank 2 left no flight record",
        ]
    );
    assert_eq!(
        analyze(&[rec(0, vec![])], &[0], T0),
        ["last operation completed: none recorded by rank 0"]
    );
}

#[test]
fn ranks_that_got_further_than_others_are_told_apart() {
    let mut ahead = done();
    ahead.push(op(42, Outcome::Ok, T0, Some(T0 + S / 2)));
    let lines = analyze(&[rec(0, ahead), rec(1, done())], &[0, 1], T0);
    assert_eq!(
        lines,
        [
            "last operation completed: 41 by rank 1, 42 by rank 0",
            "rank 1 never entered operation 42 (all_reduce of 1.1 MiB f32 at step 5); rank 0 was waiting in it for 0.5 s, then completed it",
        ]
    );
}

#[test]
fn only_the_latest_start_counts() {
    let mut restarted = rec(0, done());
    restarted.header.restart = 1;
    let mut stale = rec(2, done());
    stale.header.restart = 1;
    stale.header.opened_unix_ns -= 3600 * S;
    let kept = current(vec![stale, rec(1, done()), restarted]);
    let ranks: Vec<u32> = kept.iter().map(|r| r.header.rank).collect();
    assert_eq!(ranks, [0]);
}

#[test]
fn sizes_and_operations_read_as_words() {
    assert_eq!(size_text(96), "96 B");
    assert_eq!(size_text(1536), "1.5 KiB");
    assert_eq!(size_text(3 << 30), "3.0 GiB");
    let mut e = op(1, Outcome::Ok, 0, Some(1));
    e.kind = Kind::Broadcast;
    e.root = Some(0);
    e.dtype = Dtype::Mixed;
    e.bytes = 96;
    assert_eq!(
        describe(&e),
        "broadcast of 96 B mixed from rank 0 at step 0"
    );
    e.kind = Kind::Barrier;
    e.root = None;
    assert_eq!(describe(&e), "barrier at step 0");
}

#[test]
fn launch_writes_the_json_of_ranks_that_wrote_none_and_keeps_theirs() {
    let dir = tempfile::tempdir().unwrap();
    let own = waited(0, 0.0, 5.0, Outcome::Timeout);
    Dump::new(&own, "rank", Some("all_reduce timed out".into()), T0)
        .write(dir.path())
        .unwrap();
    // Rank 1's file is an earlier run's.
    let stopped = rec(1, done());
    let mut earlier = stopped.clone();
    earlier.header.opened_unix_ns -= 3600 * S;
    Dump::new(&earlier, "rank", None, T0)
        .write(dir.path())
        .unwrap();
    let problems = write_missing_json(dir.path(), &[own, stopped.clone()], T0 + S);
    assert!(problems.is_empty(), "{problems:?}");
    let read = |rank| Dump::read(&dir.path().join(format!("rank-{rank}.json"))).unwrap();
    assert_eq!(read(0).written_by, "rank");
    assert_eq!(read(0).error.as_deref(), Some("all_reduce timed out"));
    assert_eq!(read(1).written_by, "launch");
    assert_eq!(read(1).header, stopped.header);
    assert_eq!(read(1).entries, stopped.entries);
}
