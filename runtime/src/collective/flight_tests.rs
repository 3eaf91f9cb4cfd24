//! Tests of the flight recorder: what each operation leaves in the ring file, read from disk as
//! `launch` reads it, and the JSON a failed collective writes.

use std::path::{Path, PathBuf};
use std::time::Duration;

use common::env_contract::WorkerEnv;
use common::flight::{Dtype, Dump, Kind, Outcome, Recording};
use tch::Tensor;

use super::*;

fn env(rank: u32, world: u32) -> WorkerEnv {
    WorkerEnv::single_node(rank, world, "127.0.0.1", 1, "flight-test")
}

fn ctx(step: u64) -> OpContext {
    OpContext {
        step,
        timeout: Duration::from_millis(1500),
    }
}

/// A backend that answers at once, fails when told to, and reads the ring file from disk in the
/// middle of its all-reduce (as `launch` reads a rank stopped there).
struct Fake {
    fail: bool,
    ring: PathBuf,
    seen_while_running: Option<Recording>,
}

impl Fake {
    fn boxed(dir: &Path, fail: bool) -> Box<Fake> {
        Box::new(Fake {
            fail,
            ring: common::flight::ring_path(dir, 1),
            seen_while_running: None,
        })
    }

    fn answer(&self, op: &'static str, ctx: OpContext) -> Result<(), CollectiveError> {
        if self.fail {
            return Err(CollectiveError::Timeout {
                op,
                step: ctx.step,
                after: 1.5,
                who: "no answer from rank(s) [2]".into(),
            });
        }
        Ok(())
    }
}

impl Collective for Fake {
    fn rank(&self) -> usize {
        1
    }
    fn world_size(&self) -> usize {
        3
    }
    fn name(&self) -> &'static str {
        "fake"
    }
    fn all_reduce(
        &mut self,
        _: &mut [Tensor],
        _: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        self.seen_while_running = Recording::read(&self.ring).ok();
        self.answer("all_reduce", ctx)
    }
    fn broadcast(
        &mut self,
        _: &mut [Tensor],
        _: usize,
        c: OpContext,
    ) -> Result<(), CollectiveError> {
        self.answer("broadcast", c)
    }
    fn all_gather(&mut self, t: &Tensor, c: OpContext) -> Result<Vec<Tensor>, CollectiveError> {
        self.answer("all_gather", c)?;
        Ok((0..3).map(|_| t.shallow_clone()).collect())
    }
    fn barrier(&mut self, c: OpContext) -> Result<(), CollectiveError> {
        self.answer("barrier", c)
    }
}

fn tensors() -> Vec<Tensor> {
    vec![
        Tensor::zeros([10, 10], (tch::Kind::Float, tch::Device::Cpu)),
        Tensor::zeros([20], (tch::Kind::Float, tch::Device::Cpu)),
    ]
}

#[test]
fn every_operation_is_in_the_ring_file_with_its_sizes_step_and_outcome() {
    let dir = tempfile::tempdir().unwrap();
    let mut comm = record(Fake::boxed(dir.path(), false), dir.path(), &env(1, 3), 16);
    assert_eq!(comm.name(), "fake");
    let mut ts = tensors();
    comm.all_reduce(&mut ts, ReduceOp::Avg, ctx(4)).unwrap();
    let mut mixed = vec![
        Tensor::from_slice(&[1i64, 2]),
        Tensor::from_slice(&[1.0f32]),
    ];
    comm.broadcast(&mut mixed, 0, ctx(5)).unwrap();
    comm.all_gather(&ts[1], ctx(6)).unwrap();
    comm.barrier(ctx(7)).unwrap();
    let rec = Recording::read(&common::flight::ring_path(dir.path(), 1)).unwrap();
    assert_eq!(
        (rec.header.rank, rec.header.world, rec.header.capacity),
        (1, 3, 16)
    );
    assert_eq!(rec.header.backend, "fake");
    assert_eq!(rec.header.run, crate::store::run_fingerprint("flight-test"));
    let seen: Vec<(u64, Kind, u64, u64, Dtype, u64, Outcome)> = rec
        .entries
        .iter()
        .map(|e| {
            (
                e.seq, e.kind, e.elements, e.bytes, e.dtype, e.step, e.outcome,
            )
        })
        .collect();
    assert_eq!(
        seen,
        [
            (1, Kind::AllReduce, 120, 480, Dtype::F32, 4, Outcome::Ok),
            (2, Kind::Broadcast, 3, 20, Dtype::Mixed, 5, Outcome::Ok),
            (3, Kind::AllGather, 20, 80, Dtype::F32, 6, Outcome::Ok),
            (4, Kind::Barrier, 0, 0, Dtype::None, 7, Outcome::Ok),
        ]
    );
    let first = &rec.entries[0];
    assert_eq!(
        (first.tensors, first.timeout_ms, first.root),
        (2, 1500, None)
    );
    assert_eq!(rec.entries[1].root, Some(0));
    assert!(first.end_unix_ns.unwrap() >= first.start_unix_ns);
    // Nothing failed: no JSON.
    assert!(!dir.path().join("rank-1.json").exists());
}

#[test]
fn an_operation_in_progress_reads_as_running_from_another_reader() {
    let dir = tempfile::tempdir().unwrap();
    let fake = Fake::boxed(dir.path(), false);
    let raw: *const Fake = &*fake;
    let mut comm = record(fake, dir.path(), &env(1, 3), 8);
    comm.barrier(ctx(1)).unwrap();
    comm.all_reduce(&mut tensors(), ReduceOp::Sum, ctx(2))
        .unwrap();
    // SAFETY: `comm` owns the fake and is alive; nothing else touches it now.
    let seen = unsafe { (*raw).seen_while_running.clone() }.expect("the ring read mid-call");
    let last = seen.entries.last().unwrap();
    assert_eq!(
        (last.seq, last.kind, last.outcome),
        (2, Kind::AllReduce, Outcome::Running)
    );
    assert_eq!(last.end_unix_ns, None);
    assert_eq!(seen.entries[0].outcome, Outcome::Ok);
}

#[test]
fn the_ring_keeps_the_last_operations_only() {
    let dir = tempfile::tempdir().unwrap();
    let mut comm = record(Fake::boxed(dir.path(), false), dir.path(), &env(1, 3), 4);
    for step in 0..10 {
        comm.barrier(ctx(step)).unwrap();
    }
    let rec = Recording::read(&common::flight::ring_path(dir.path(), 1)).unwrap();
    let seqs: Vec<u64> = rec.entries.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [7, 8, 9, 10]);
    assert_eq!(rec.entries[3].step, 9);
}

#[test]
fn a_failed_collective_writes_the_json_and_returns_the_same_error() {
    let dir = tempfile::tempdir().unwrap();
    // A JSON of an earlier run is not taken for this one's.
    std::fs::write(dir.path().join("rank-1.json"), "stale").unwrap();
    let mut comm = record(Fake::boxed(dir.path(), true), dir.path(), &env(1, 3), 8);
    assert!(!dir.path().join("rank-1.json").exists());
    let err = comm.barrier(ctx(3)).unwrap_err();
    assert!(matches!(err, CollectiveError::Timeout { .. }), "{err}");
    let dump = Dump::read(&dir.path().join("rank-1.json")).unwrap();
    assert_eq!(dump.written_by, "rank");
    assert_eq!(dump.error.as_deref(), Some(err.to_string().as_str()));
    assert_eq!(dump.entries.len(), 1);
    assert_eq!(dump.entries[0].outcome, Outcome::Timeout);
    assert!(dump.entries[0].end_unix_ns.is_some());
}

#[test]
fn zero_entries_or_a_ring_that_cannot_be_made_leave_the_backend_as_it_is() {
    let dir = tempfile::tempdir().unwrap();
    let mut comm = record(
        Fake::boxed(dir.path(), false),
        &dir.path().join("f"),
        &env(1, 3),
        0,
    );
    comm.barrier(ctx(0)).unwrap();
    assert!(!dir.path().join("f").exists());
    // A file where the directory should be: a warning, and training goes on unrecorded.
    let blocked = dir.path().join("blocked");
    std::fs::write(&blocked, "").unwrap();
    let mut comm = record(Fake::boxed(dir.path(), false), &blocked, &env(1, 3), 8);
    comm.barrier(ctx(0)).unwrap();
}

#[test]
fn operation_n_is_the_same_operation_on_every_rank_of_a_real_ring() {
    let dirs: Vec<tempfile::TempDir> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let paths: Vec<PathBuf> = dirs.iter().map(|d| d.path().to_path_buf()).collect();
    let seen = crate::collective::tcp::test_ring::with_ring_owned(3, move |rank, tcp| {
        let mut comm = record(Box::new(tcp), &paths[rank], &env(rank as u32, 3), 8);
        let mut t = [Tensor::from_slice(&[rank as f32; 5])];
        comm.all_reduce(&mut t, ReduceOp::Sum, ctx(1)).unwrap();
        comm.broadcast(&mut t, 2, ctx(2)).unwrap();
        comm.barrier(ctx(3)).unwrap();
        let rec = Recording::read(&common::flight::ring_path(&paths[rank], rank as u32)).unwrap();
        rec.entries
            .iter()
            .map(|e| (e.seq, e.kind, e.elements, e.step, e.outcome))
            .collect::<Vec<_>>()
    });
    assert_eq!(seen[0].len(), 3, "{seen:?}");
    assert!(seen.iter().all(|s| s == &seen[0]), "{seen:?}");
}
