//! The flight recorder: this rank's last collectives (sequence number, kind, sizes, dtype, step,
//! start, end, outcome), kept by [`Recorded`], a [`Collective`] that wraps any backend (tcp, its
//! shared memory, nccl) and counts operations per communicator, so that operation N is the same
//! operation on every rank.
//!
//! Owns: the ring of the last operations in a file this process maps, `rank-N.ring` in the
//! directory it is given (layout: `common::flight`), which `launch` reads after a failure even
//! when this rank was stopped or killed; and, when one of this rank's collectives fails, the
//! same record as `rank-N.json` beside it (written whole). Recording costs a few stores into one
//! slot and a clock read per operation: no allocation, no lock, no system call.
//! Must not: fail, slow down or change a collective because of recording (a ring that cannot be
//! set up turns the recorder off with a warning), interpret the record (that is `launch`'s
//! summary), or know what the run directory holds besides its own files.

use std::fs::OpenOptions;
use std::io::Write as _;
use std::num::NonZeroUsize;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::ptr::NonNull;
use std::sync::atomic::{fence, AtomicU64, Ordering};

use common::env_contract::WorkerEnv;
use common::flight::{self, Dtype, Entry, Header, Kind, Outcome, Recording};
use nix::sys::mman::{mmap, munmap, MapFlags, ProtFlags};
use tch::Tensor;

use super::{Collective, CollectiveError, HostShared, OpContext, ReduceOp};

/// How many operations each rank keeps, from `GPTREC_FLIGHT_ENTRIES` (0: no recorder).
pub fn entries_from_env() -> Result<u32, flight::FlightError> {
    flight::entries_from(std::env::var(flight::ENTRIES_VAR).ok().as_deref())
}

/// `inner`, recording its last `entries` operations in `dir` (see the module's text). With
/// `entries` 0, or when the ring cannot be made (a warning says why), `inner` itself.
pub fn record(
    inner: Box<dyn Collective>,
    dir: &Path,
    env: &WorkerEnv,
    entries: u32,
) -> Box<dyn Collective> {
    if entries == 0 {
        return inner;
    }
    let header = Header {
        rank: env.rank,
        world: env.world_size,
        capacity: entries.min(flight::MAX_ENTRIES),
        pid: std::process::id(),
        restart: env.restart_count,
        opened_unix_ns: flight::unix_ns_now(),
        run: crate::store::run_fingerprint(&env.run_id),
        backend: inner.name().to_string(),
    };
    match Ring::create(dir, &header) {
        Ok(ring) => Box::new(Recorded {
            inner,
            ring,
            dir: dir.to_path_buf(),
        }),
        Err(why) => {
            tracing::warn!("no flight recorder on rank {}: {why}", env.rank);
            inner
        }
    }
}

/// The ring file, mapped: a header and `capacity` slots of u64 words (little-endian).
struct Ring {
    base: NonNull<AtomicU64>,
    words: usize,
    capacity: u32,
    /// Operations begun so far: the last sequence number given out.
    issued: u64,
}

// SAFETY: the mapping belongs to this handle alone in this process; other processes only read
// the file.
unsafe impl Send for Ring {}

impl Ring {
    /// Writes a fresh ring as `dir/rank-N.ring` (staged, then renamed over an older one) and
    /// maps it; removes this rank's `rank-N.json` of an earlier run.
    fn create(dir: &Path, header: &Header) -> Result<Ring, String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        let path = flight::ring_path(dir, header.rank);
        let staged = dir.join(format!(".rank-{}.ring.{}", header.rank, std::process::id()));
        let _ = std::fs::remove_file(&staged);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&staged)
            .map_err(|e| format!("creating {}: {e}", staged.display()))?;
        // Every byte written now: the file system has the blocks, so no store into the mapping
        // can fail later (a SIGBUS on a full disk).
        let mut bytes = vec![0u8; flight::ring_bytes(header.capacity)];
        for (i, w) in header.words().iter().enumerate() {
            bytes[i * 8..i * 8 + 8].copy_from_slice(&w.to_le_bytes());
        }
        let written = file
            .write_all(&bytes)
            .and_then(|()| std::fs::rename(&staged, &path));
        if let Err(e) = written {
            let _ = std::fs::remove_file(&staged);
            return Err(format!("writing {}: {e}", path.display()));
        }
        let _ = std::fs::remove_file(dir.join(flight::json_name(header.rank)));
        let len = NonZeroUsize::new(bytes.len()).ok_or("an empty ring")?;
        let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        // SAFETY: a new shared mapping of a file we hold open and that nothing else in this
        // process maps; it stays mapped until `drop`.
        let base = unsafe { mmap(None, len, prot, MapFlags::MAP_SHARED, &file, 0) }
            .map_err(|e| format!("mapping {}: {e}", path.display()))?;
        Ok(Ring {
            base: base.cast(),
            words: bytes.len() / 8,
            capacity: header.capacity,
            issued: 0,
        })
    }

    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.words, "flight ring word {i} of {}", self.words);
        // SAFETY: in bounds of a mapping of `words` u64s that lives as long as `self`; mmap
        // returns page-aligned memory, so every word is aligned.
        unsafe { &*self.base.as_ptr().add(i) }
    }

    /// Records the start of operation `entry` (its `seq` is given here); the slot's first word.
    fn begin(&mut self, mut entry: Entry) -> usize {
        self.issued += 1;
        entry.seq = self.issued;
        let at = flight::slot_at(entry.seq, self.capacity);
        let words = entry.words();
        // The slot stops being the older operation before any of its words change, and becomes
        // the new one only once all of them have.
        self.word(at + flight::SLOT_SEQ).store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        for (i, w) in words.iter().enumerate().skip(1) {
            self.word(at + i).store(w.to_le(), Ordering::Relaxed);
        }
        self.word(at + flight::SLOT_SEQ)
            .store(entry.seq.to_le(), Ordering::Release);
        at
    }

    /// Records how the operation in the slot at `at` ended (`entry` as begun).
    fn finish(&self, at: usize, entry: &Entry, outcome: Outcome) {
        let end = flight::unix_ns_now();
        self.word(at + flight::SLOT_END)
            .store(end.to_le(), Ordering::Relaxed);
        let meta = flight::meta_word(entry.kind, entry.dtype, outcome, entry.tensors);
        self.word(at + flight::SLOT_META)
            .store(meta.to_le(), Ordering::Release);
    }

    /// What the ring holds now.
    fn read(&self) -> Result<Recording, String> {
        let words: Vec<u64> = (0..self.words)
            .map(|i| u64::from_le(self.word(i).load(Ordering::Acquire)))
            .collect();
        Recording::decode(&words)
    }
}

impl Drop for Ring {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `create`, of that length, unmapped once. The file stays:
        // it is the record.
        let _ = unsafe { munmap(self.base.cast(), self.words * 8) };
    }
}

/// A backend whose operations are recorded.
pub struct Recorded {
    inner: Box<dyn Collective>,
    ring: Ring,
    dir: PathBuf,
}

impl Recorded {
    /// Runs `call` on the backend as the operation `entry` describes, recording it.
    fn run<T>(
        &mut self,
        entry: Entry,
        call: impl FnOnce(&mut dyn Collective) -> Result<T, CollectiveError>,
    ) -> Result<T, CollectiveError> {
        let at = self.ring.begin(entry.clone());
        let result = call(self.inner.as_mut());
        let outcome = match &result {
            Ok(_) => Outcome::Ok,
            Err(e) => outcome_of(e),
        };
        self.ring.finish(at, &entry, outcome);
        if let Err(e) = &result {
            self.dump(e);
        }
        result
    }

    /// After a failed collective: the ring as `rank-N.json`, for whoever reads the run
    /// directory without `launch` (torchrun). Failing to write it only costs that file.
    fn dump(&self, error: &CollectiveError) {
        let written = self.ring.read().and_then(|recording| {
            flight::Dump::new(
                &recording,
                "rank",
                Some(error.to_string()),
                flight::unix_ns_now(),
            )
            .write(&self.dir)
            .map_err(|e| e.to_string())
        });
        match written {
            Ok(path) => tracing::info!("flight record written to {}", path.display()),
            Err(why) => tracing::warn!("writing the flight record: {why}"),
        }
    }
}

fn outcome_of(e: &CollectiveError) -> Outcome {
    match e {
        CollectiveError::Timeout { .. } => Outcome::Timeout,
        CollectiveError::Peer { .. } => Outcome::PeerFailed,
        CollectiveError::Mismatch { .. } => Outcome::Mismatch,
        _ => Outcome::Failed,
    }
}

/// An operation about to start, before its sequence number is known.
fn op(kind: Kind, tensors: &[Tensor], ctx: OpContext) -> Entry {
    let (mut elements, mut bytes, mut dtype) = (0u64, 0u64, Dtype::None);
    for t in tensors {
        let n = t.numel() as u64;
        let kind = t.f_kind().ok();
        elements += n;
        bytes += n * kind.map_or(0, |k| k.elt_size_in_bytes() as u64);
        let this = kind.map_or(Dtype::Other, dtype_of);
        dtype = match dtype {
            Dtype::None => this,
            same if same == this => same,
            _ => Dtype::Mixed,
        };
    }
    Entry {
        seq: 0,
        kind,
        tensors: u32::try_from(tensors.len()).unwrap_or(u32::MAX),
        elements,
        bytes,
        dtype,
        step: ctx.step,
        root: None,
        timeout_ms: u32::try_from(ctx.timeout.as_millis()).unwrap_or(u32::MAX),
        start_unix_ns: flight::unix_ns_now(),
        end_unix_ns: None,
        outcome: Outcome::Running,
    }
}

fn dtype_of(kind: tch::Kind) -> Dtype {
    match kind {
        tch::Kind::Float => Dtype::F32,
        tch::Kind::BFloat16 => Dtype::Bf16,
        tch::Kind::Half => Dtype::F16,
        tch::Kind::Double => Dtype::F64,
        tch::Kind::Int64 => Dtype::I64,
        tch::Kind::Int => Dtype::I32,
        tch::Kind::Uint8 => Dtype::U8,
        _ => Dtype::Other,
    }
}

impl Collective for Recorded {
    fn rank(&self) -> usize {
        self.inner.rank()
    }

    fn world_size(&self) -> usize {
        self.inner.world_size()
    }

    fn name(&self) -> &'static str {
        self.inner.name()
    }

    fn all_reduce(
        &mut self,
        tensors: &mut [Tensor],
        op_: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let entry = op(Kind::AllReduce, tensors, ctx);
        self.run(entry, |c| c.all_reduce(tensors, op_, ctx))
    }

    fn broadcast(
        &mut self,
        tensors: &mut [Tensor],
        root: usize,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let entry = Entry {
            root: u32::try_from(root).ok(),
            ..op(Kind::Broadcast, tensors, ctx)
        };
        self.run(entry, |c| c.broadcast(tensors, root, ctx))
    }

    fn all_gather(
        &mut self,
        tensor: &Tensor,
        ctx: OpContext,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let entry = op(Kind::AllGather, std::slice::from_ref(tensor), ctx);
        self.run(entry, |c| c.all_gather(tensor, ctx))
    }

    fn all_gather_into(
        &mut self,
        tensor: &Tensor,
        out: &mut [Tensor],
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let entry = op(Kind::AllGather, std::slice::from_ref(tensor), ctx);
        self.run(entry, |c| c.all_gather_into(tensor, out, ctx))
    }

    fn barrier(&mut self, ctx: OpContext) -> Result<(), CollectiveError> {
        self.run(op(Kind::Barrier, &[], ctx), |c| c.barrier(ctx))
    }

    fn shards_of(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        self.inner.shards_of(n)
    }

    fn shard_of(&self, n: usize) -> std::ops::Range<usize> {
        self.inner.shard_of(n)
    }

    fn reduce_scatter(
        &mut self,
        flat: &mut Tensor,
        reduce: ReduceOp,
        ctx: OpContext,
    ) -> Result<std::ops::Range<usize>, CollectiveError> {
        let entry = op(Kind::ReduceScatter, std::slice::from_ref(flat), ctx);
        self.run(entry, |c| c.reduce_scatter(flat, reduce, ctx))
    }

    fn bytes_sent(&self) -> Option<u64> {
        self.inner.bytes_sent()
    }

    fn reduce_scatter_is_native(&self) -> bool {
        self.inner.reduce_scatter_is_native()
    }

    fn all_gather_shards(
        &mut self,
        flat: &mut Tensor,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let entry = op(Kind::AllGatherShards, std::slice::from_ref(flat), ctx);
        self.run(entry, |c| c.all_gather_shards(flat, ctx))
    }

    fn host_shared(
        &mut self,
        floats: usize,
        ctx: OpContext,
    ) -> Result<Option<HostShared>, CollectiveError> {
        let entry = Entry {
            elements: floats as u64,
            bytes: floats as u64 * 4,
            dtype: Dtype::F32,
            ..op(Kind::HostShared, &[], ctx)
        };
        self.run(entry, |c| c.host_shared(floats, ctx))
    }
}

#[cfg(test)]
#[path = "flight_tests.rs"]
mod tests;
