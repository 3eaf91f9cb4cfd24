//! The flight recorder's lines in the failure summary: after a group failed, reads the rings the
//! ranks of this run left in `<run dir>/flight/` (each rank's last collectives, readable even
//! for a rank that was stopped or killed), writes `rank-N.json` for every rank that did not
//! write its own, and says which operation the ranks got stuck in: who never entered it, who
//! waited in it and how long, who entered it late or was still in it.
//!
//! Owns: finding this run's records and the analysis ([`analyze`], a pure function of the
//! records). Must not: decide anything about the group (the supervisor does), or fail the
//! report: a record that cannot be read is left out, one that cannot be written is a line.

use std::collections::BTreeMap;
use std::path::Path;

use common::flight::{self, Dump, Entry, Kind, Outcome, Recording};

use crate::plan::Plan;

/// Records opened this long before the newest one belong to an earlier start (ranks open theirs
/// right after connecting, within seconds of each other).
const STALE_NS: u64 = 60_000_000_000;

/// The summary's flight-recorder lines for a group of `plan` that failed; none when the job
/// does not run a config or no rank of this run left a record.
pub fn lines(plan: &Plan) -> Vec<String> {
    let Some(train) = &plan.config else {
        return Vec::new();
    };
    let run = &train.config.run;
    let dir = run.output_dir.join(&run.name).join(flight::DIR);
    let fingerprint = store::run_fingerprint(&plan.run_id);
    let found = (0..plan.world_size)
        .filter_map(|rank| Some((rank, Recording::read(&flight::ring_path(&dir, rank)).ok()?)))
        .filter(|(rank, rec)| {
            let h = &rec.header;
            h.rank == *rank && h.world == plan.world_size && h.run == fingerprint
        })
        .map(|(_, rec)| rec)
        .collect();
    let records = current(found);
    if records.is_empty() {
        return Vec::new();
    }
    let now = flight::unix_ns_now();
    let first = plan.first_rank;
    let this_node: Vec<u32> = (first..first + plan.nproc).collect();
    let mut out = analyze(&records, &this_node, now);
    out.extend(write_missing_json(&dir, &records, now));
    let ranks: Vec<u32> = records.iter().map(|r| r.header.rank).collect();
    out.push(format!(
        "records of {}: {}",
        ranks_text(&ranks),
        dir.join("rank-N.json").display()
    ));
    out
}

/// The records of the group's latest start: the highest restart count, opened together.
fn current(mut records: Vec<Recording>) -> Vec<Recording> {
    let Some(restart) = records.iter().map(|r| r.header.restart).max() else {
        return records;
    };
    records.retain(|r| r.header.restart == restart);
    let newest = records
        .iter()
        .map(|r| r.header.opened_unix_ns)
        .max()
        .unwrap_or(0);
    records.retain(|r| r.header.opened_unix_ns + STALE_NS >= newest);
    records.sort_by_key(|r| r.header.rank);
    records
}

/// `rank-N.json` for every record whose rank did not write its own (it was stopped, killed or
/// torn down while doing something else); a line for each that could not be written.
fn write_missing_json(dir: &Path, records: &[Recording], now: u64) -> Vec<String> {
    let mut problems = Vec::new();
    for rec in records {
        let path = dir.join(flight::json_name(rec.header.rank));
        if Dump::read(&path).is_ok_and(|d| d.header == rec.header) {
            continue;
        }
        if let Err(e) = Dump::new(rec, "launch", None, now).write(dir) {
            problems.push(format!(
                "could not write the record of rank {}: {e}",
                rec.header.rank
            ));
        }
    }
    problems
}

/// One rank's operations, oldest first.
struct View<'a> {
    rank: u32,
    entries: &'a [Entry],
}

impl View<'_> {
    fn last_ok(&self) -> Option<&Entry> {
        self.entries.iter().rev().find(|e| e.outcome == Outcome::Ok)
    }

    /// The first operation this rank did not complete: one it failed in or was still in, else
    /// the one after its last.
    fn frontier(&self) -> u64 {
        match self.entries.iter().find(|e| e.outcome != Outcome::Ok) {
            Some(e) => e.seq,
            None => self.entries.last().map_or(1, |e| e.seq + 1),
        }
    }

    fn at(&self, seq: u64) -> Option<&Entry> {
        self.entries.iter().find(|e| e.seq == seq)
    }
}

/// What the records say, in a few lines: the last operation every rank completed; then, for the
/// first operation some rank did not complete, who never entered it (or left no record: the
/// ranks of `expected` without one), who waited in it and how it ended, who entered it later
/// than its timeout, who was still in it `now` (ns since the epoch).
pub fn analyze(records: &[Recording], expected: &[u32], now: u64) -> Vec<String> {
    let views: Vec<View> = records
        .iter()
        .map(|r| View {
            rank: r.header.rank,
            entries: &r.entries,
        })
        .collect();
    let mut out: Vec<String> = completed_line(&views).into_iter().collect();
    let missing: Vec<u32> = expected
        .iter()
        .copied()
        .filter(|r| !views.iter().any(|v| v.rank == *r))
        .collect();
    let n = views.iter().map(View::frontier).min().unwrap_or(1);
    let entered: Vec<(u32, &Entry)> = views
        .iter()
        .filter_map(|v| Some((v.rank, v.at(n)?)))
        .collect();
    if entered.is_empty() {
        if !missing.is_empty() {
            out.push(format!("{} left no flight record", ranks_text(&missing)));
        }
        return out;
    }
    out.extend(mismatch_line(n, &entered));
    // Those whose last operation is before `n` (one past it whose record of `n` was overwritten
    // did enter it).
    let never: Vec<u32> = views
        .iter()
        .filter(|v| v.entries.last().map_or(0, |e| e.seq) < n)
        .map(|v| v.rank)
        .collect();
    out.push(stuck_line(n, &entered, &never, &missing, now));
    out
}

/// "last operation completed by every rank: 41 (...)", or each rank's when they differ.
fn completed_line(views: &[View]) -> Option<String> {
    let last: Vec<Option<&Entry>> = views.iter().map(View::last_ok).collect();
    let first = last.first()?;
    if let Some(e) = first.filter(|e| last.iter().all(|l| l.map(|x| x.seq) == Some(e.seq))) {
        return Some(format!(
            "last operation completed by every rank: {} ({})",
            e.seq,
            describe(e)
        ));
    }
    let mut by_seq: BTreeMap<Option<u64>, Vec<u32>> = BTreeMap::new();
    for (v, l) in views.iter().zip(&last) {
        by_seq.entry(l.map(|e| e.seq)).or_default().push(v.rank);
    }
    let parts: Vec<String> = by_seq
        .iter()
        .map(|(seq, ranks)| match seq {
            Some(seq) => format!("{seq} by {}", ranks_text(ranks)),
            None => format!("none recorded by {}", ranks_text(ranks)),
        })
        .collect();
    Some(format!("last operation completed: {}", parts.join(", ")))
}

/// When the ranks that entered operation `n` did not call the same thing.
fn mismatch_line(n: u64, entered: &[(u32, &Entry)]) -> Option<String> {
    let (_, first) = entered.first()?;
    let same =
        |e: &Entry| (e.kind, e.elements, e.dtype) == (first.kind, first.elements, first.dtype);
    if entered.iter().all(|(_, e)| same(e)) {
        return None;
    }
    let each: Vec<String> = entered
        .iter()
        .map(|(r, e)| format!("rank {r}: {} of {} elements", e.kind.as_str(), e.elements))
        .collect();
    Some(format!(
        "the ranks disagree on operation {n}: {}",
        each.join(", ")
    ))
}

/// Who kept operation `n` from completing, and what the ranks in it were doing.
fn stuck_line(
    n: u64,
    entered: &[(u32, &Entry)],
    never: &[u32],
    missing: &[u32],
    now: u64,
) -> String {
    let op = describe(entered[0].1);
    let mut culprits = Vec::new();
    if !never.is_empty() {
        culprits.push(format!(
            "{} never entered operation {n} ({op})",
            ranks_text(never)
        ));
    }
    if !missing.is_empty() {
        culprits.push(format!("{} left no flight record", ranks_text(missing)));
    }
    if !culprits.is_empty() {
        let about = if never.is_empty() {
            format!("operation {n} ({op})")
        } else {
            "it".to_string()
        };
        return format!("{}; {}", culprits.join("; "), states(entered, &about, now));
    }
    let start = entered
        .iter()
        .map(|(_, e)| e.start_unix_ns)
        .min()
        .unwrap_or(0);
    let (first, _) = entered
        .iter()
        .min_by_key(|(_, e)| e.start_unix_ns)
        .unwrap_or(&entered[0]);
    let (late, e) = entered
        .iter()
        .max_by_key(|(_, e)| e.start_unix_ns)
        .unwrap_or(&entered[0]);
    let lateness = e.start_unix_ns.saturating_sub(start);
    if entered.len() > 1 && lateness > u64::from(e.timeout_ms) * 1_000_000 {
        let others: Vec<(u32, &Entry)> =
            entered.iter().filter(|(r, _)| r != late).copied().collect();
        return format!(
            "rank {late} entered operation {n} ({op}) {} after rank {first}, later than its {} timeout; {}; {}",
            secs(lateness),
            secs(u64::from(e.timeout_ms) * 1_000_000),
            states(&others, "it", now),
            states(&[(*late, *e)], "it", now)
        );
    }
    format!(
        "every rank entered operation {n} ({op}) and none completed it: {}",
        states(entered, "it", now)
    )
}

/// "ranks 0, 2 were waiting in {about} for 5.0 s, then timed out; rank 1 was still in {about}
/// (started 3.2 s ago)": the ranks grouped by how their operation ended.
fn states(entered: &[(u32, &Entry)], about: &str, now: u64) -> String {
    let mut groups: Vec<(Outcome, Vec<u32>, u64)> = Vec::new();
    for (rank, e) in entered {
        let took = e.end_unix_ns.unwrap_or(now).saturating_sub(e.start_unix_ns);
        match groups.iter_mut().find(|(o, _, _)| *o == e.outcome) {
            Some((_, ranks, longest)) => {
                ranks.push(*rank);
                *longest = (*longest).max(took);
            }
            None => groups.push((e.outcome, vec![*rank], took)),
        }
    }
    let parts: Vec<String> = groups
        .iter()
        .map(|(outcome, ranks, took)| {
            let (who, verb) = (
                ranks_text(ranks),
                if ranks.len() == 1 { "was" } else { "were" },
            );
            let then = match outcome {
                Outcome::Running => {
                    return format!(
                        "{who} {verb} still in {about} (started {} ago)",
                        secs(*took)
                    )
                }
                Outcome::Ok => "completed it",
                Outcome::Timeout => "timed out",
                Outcome::PeerFailed => "lost a peer",
                Outcome::Mismatch => "found the ranks disagree",
                Outcome::Failed => "failed",
            };
            format!(
                "{who} {verb} waiting in {about} for {}, then {then}",
                secs(*took)
            )
        })
        .collect();
    parts.join("; ")
}

/// "all_reduce of 1.2 MiB f32 at step 5", "broadcast of 96 B i64 from rank 0 at step 0".
fn describe(e: &Entry) -> String {
    let mut text = e.kind.as_str().to_string();
    if e.kind != Kind::Barrier {
        text.push_str(&format!(" of {}", size_text(e.bytes)));
        if e.dtype != flight::Dtype::None {
            text.push_str(&format!(" {}", e.dtype.as_str()));
        }
    }
    if let Some(root) = e.root {
        text.push_str(&format!(" from rank {root}"));
    }
    format!("{text} at step {}", e.step)
}

fn size_text(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["KiB", "MiB", "GiB", "TiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

fn secs(ns: u64) -> String {
    format!("{:.1} s", ns as f64 / 1e9)
}

/// "rank 1", "ranks 0, 2".
fn ranks_text(ranks: &[u32]) -> String {
    let list: Vec<String> = ranks.iter().map(u32::to_string).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        _ => format!("ranks {}", list.join(", ")),
    }
}

#[cfg(test)]
#[path = "flight_tests.rs"]
mod tests;
