//! Shared-memory all-reduce for the ranks of one host: what the `tcp` backend uses instead of
//! its socket ring when every rank runs on the same machine (the common case: one box, several
//! CPU ranks or GPUs). Each rank maps one segment of every other rank, so a byte crosses memory
//! at most three times (copy in, reduce, copy out) and never the kernel.
//!
//! Protocol, per chunk `g` of [`CHUNK_BYTES`] (double-buffered: chunk `g` uses buffer `g % 2`):
//! copy the chunk into our buffer and publish progress `2g+1`; when every member has, sum our
//! slice of the chunk over all members' buffers (in member order, so every rank gets the same
//! bits) into our buffer and publish `2g+2`; when every member has, copy every member's slice
//! out. A member only overwrites a buffer once every other has published `2g-1`, i.e. finished
//! reading chunk `g-2`. Progress counters grow across operations; an operation's descriptor
//! (sequence number, length) is checked against every member's before any data is used.
//!
//! Segments live in `/dev/shm` under names of [`common::shm_segments`] (creator's pid and a
//! random part, mode 0600) only while the group is set up: once every member has mapped every
//! segment, each is unlinked, so nothing is left behind however the processes end later. The
//! launcher sweeps what dies inside that window. This module must not know about tensors or
//! training; it moves `f32`s.

use std::num::NonZeroUsize;
use std::os::fd::OwnedFd;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use nix::fcntl::OFlag;
use nix::sys::mman::{mmap, munmap, shm_open, shm_unlink, MapFlags, ProtFlags};
use nix::sys::stat::Mode;

use crate::store::StoreClient;

/// Bytes of one buffer; a segment holds two (double-buffering) after its header.
pub const CHUNK_BYTES: usize = 1 << 20;
const HEADER_BYTES: usize = 4096;
const SEGMENT_BYTES: usize = HEADER_BYTES + 2 * CHUNK_BYTES;
/// Header fields, each on its own cache line where it is written often.
const PROGRESS_AT: usize = 0;
const OP_SEQ_AT: usize = 64;
const OP_LEN_AT: usize = 72;
const PID_AT: usize = 128;
/// Floats per slice boundary: slices start on a cache line (64 bytes).
const ALIGN_FLOATS: usize = 16;

/// One mapped segment: ours (created, then unlinked) or a peer's.
struct Segment {
    base: NonNull<u8>,
}

// SAFETY: the mapping is plain shared memory; which bytes each thread or process touches, and
// when, is governed by the progress protocol above, not by ownership of this handle.
unsafe impl Send for Segment {}

impl Segment {
    /// Creates and maps a new segment `name` of [`SEGMENT_BYTES`], reserving its pages now (so a
    /// full `/dev/shm` is an error here, not a SIGBUS later).
    fn create(name: &str) -> Result<Segment, String> {
        let flags = OFlag::O_CREAT | OFlag::O_EXCL | OFlag::O_RDWR;
        let fd = shm_open(name, flags, Mode::S_IRUSR | Mode::S_IWUSR)
            .map_err(|e| format!("creating {name}: {e}"))?;
        let mapped = nix::fcntl::posix_fallocate(&fd, 0, SEGMENT_BYTES as libc::off_t)
            .map_err(|e| {
                format!(
                    "reserving {SEGMENT_BYTES} bytes for {name} (is /dev/shm full or small?): {e}"
                )
            })
            .and_then(|()| Segment::map(&fd, name));
        if mapped.is_err() {
            let _ = shm_unlink(name);
        }
        let segment = mapped?;
        segment
            .word(PID_AT)
            .store(std::process::id() as u64, Ordering::Release);
        Ok(segment)
    }

    /// Maps a peer's segment `name`.
    fn open(name: &str) -> Result<Segment, String> {
        let fd = shm_open(name, OFlag::O_RDWR, Mode::empty())
            .map_err(|e| format!("opening {name}: {e}"))?;
        let size = nix::sys::stat::fstat(&fd)
            .map_err(|e| format!("reading the size of {name}: {e}"))?
            .st_size;
        if size < SEGMENT_BYTES as i64 {
            return Err(format!(
                "{name} holds {size} bytes, expected {SEGMENT_BYTES}"
            ));
        }
        Segment::map(&fd, name)
    }

    fn map(fd: &OwnedFd, name: &str) -> Result<Segment, String> {
        let len = NonZeroUsize::new(SEGMENT_BYTES).expect("segment size is not zero");
        let prot = ProtFlags::PROT_READ | ProtFlags::PROT_WRITE;
        // SAFETY: a fresh shared mapping of a file we hold open; nothing else in this process
        // refers to the address range.
        let base = unsafe { mmap(None, len, prot, MapFlags::MAP_SHARED, fd, 0) }
            .map_err(|e| format!("mapping {name}: {e}"))?;
        Ok(Segment { base: base.cast() })
    }

    /// The 8-byte header word at byte `at` (8-aligned, inside the header).
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at % 8 == 0 && at + 8 <= HEADER_BYTES);
        // SAFETY: in bounds and aligned (the mapping is page-aligned); AtomicU64 has the
        // layout of u64 and is meant for exactly this kind of sharing.
        unsafe { &*(self.base.as_ptr().add(at) as *const AtomicU64) }
    }

    fn progress(&self) -> &AtomicU64 {
        self.word(PROGRESS_AT)
    }

    /// Start of buffer `which` (0 or 1), `CHUNK_BYTES / 4` floats.
    fn buffer(&self, which: usize) -> *mut f32 {
        debug_assert!(which < 2);
        // SAFETY: in bounds of the mapping; HEADER_BYTES keeps it 64-byte aligned.
        unsafe { self.base.as_ptr().add(HEADER_BYTES + which * CHUNK_BYTES) as *mut f32 }
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `map`, of that length, unmapped once.
        let _ = unsafe { munmap(self.base.cast(), SEGMENT_BYTES) };
    }
}

/// Why a shared-memory operation failed, before the caller turns it into a collective error.
#[derive(Debug, PartialEq, Eq)]
pub enum ShmFailure {
    /// A member did not make progress before the deadline.
    Timeout,
    /// The process of member `rank` is gone.
    Exited { rank: usize, pid: u64 },
    /// Member `rank` is at another operation.
    Mismatch {
        rank: usize,
        their_seq: u64,
        their_len: u64,
    },
}

/// This rank's view of the shared-memory group: every member's segment, mapped.
pub struct ShmGroup {
    /// Our index in `ranks`.
    me: usize,
    /// Global ranks of the members, in member order.
    ranks: Vec<usize>,
    segments: Vec<Segment>,
    /// Chunks every member has completed so far (the `g` of the next chunk).
    chunks: u64,
}

impl ShmGroup {
    /// Sets up the group of `ranks` (global ranks, ascending; we are `rank`), exchanging segment
    /// names through `store` under `shm/*`. Every member reaches the same answer: `Ok(None)`,
    /// with the reason logged, when any member cannot create or map a segment (the caller then
    /// uses sockets); an error only when the store fails.
    pub fn connect(
        store: &mut StoreClient,
        rank: usize,
        ranks: &[usize],
        timeout: Duration,
    ) -> Result<Option<ShmGroup>, String> {
        let me = ranks
            .iter()
            .position(|r| *r == rank)
            .ok_or_else(|| format!("rank {rank} is not in the shared-memory group {ranks:?}"))?;
        let name = common::shm_segments::segment_name(std::process::id(), &random_hex()?);
        let own = Segment::create(&name);
        let published = match &own {
            Ok(_) => name.clone(),
            Err(why) => format!("!{why}"),
        };
        let names = exchange(store, "shm/name", rank, ranks, &published, timeout)?;
        let mapped: Result<Vec<Segment>, String> = match names.iter().find(|n| n.starts_with('!')) {
            Some(failed) => Err(failed[1..].to_string()),
            None => names.iter().map(|n| Segment::open(n)).collect(),
        };
        let verdict = if mapped.is_ok() { "ok" } else { "!" };
        let verdicts = exchange(store, "shm/mapped", rank, ranks, verdict, timeout);
        if own.is_ok() {
            let _ = shm_unlink(name.as_str()); // mapped everywhere (or given up): not needed by name
        }
        let verdicts = verdicts?;
        match (own, mapped) {
            (Ok(_own), Ok(segments)) if verdicts.iter().all(|v| v == "ok") => Ok(Some(ShmGroup {
                me,
                ranks: ranks.to_vec(),
                segments,
                chunks: 0,
            })),
            (_, Err(why)) | (Err(why), _) => {
                tracing::warn!(
                    "shared memory between ranks {ranks:?} unavailable, using sockets: {why}"
                );
                Ok(None)
            }
            _ => {
                tracing::warn!("shared memory between ranks {ranks:?} unavailable (another rank could not map the segments), using sockets");
                Ok(None)
            }
        }
    }

    /// Sums `data` element-wise over the members, in place, as operation `seq` (which must be
    /// the same number on every member, as `data.len()` must be).
    pub fn all_reduce(
        &mut self,
        data: &mut [f32],
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmFailure> {
        let mine = &self.segments[self.me];
        mine.word(OP_SEQ_AT).store(seq, Ordering::Relaxed);
        mine.word(OP_LEN_AT)
            .store(data.len() as u64, Ordering::Relaxed);
        let per_chunk = CHUNK_BYTES / 4;
        for (c, part) in data.chunks_mut(per_chunk).enumerate() {
            let g = self.chunks + c as u64;
            self.reduce_chunk(part, g, deadline, (c == 0).then_some(seq))?;
        }
        self.chunks += data.len().div_ceil(per_chunk) as u64;
        Ok(())
    }

    /// One chunk of [`ShmGroup::all_reduce`]; `check` is the operation to compare descriptors
    /// against (on an operation's first chunk). Our own slice never goes through our buffer on
    /// the way in: we sum it straight from `part`.
    fn reduce_chunk(
        &self,
        part: &mut [f32],
        g: u64,
        deadline: Instant,
        check: Option<u64>,
    ) -> Result<(), ShmFailure> {
        let which = (g % 2) as usize;
        let (n, members) = (part.len(), self.segments.len());
        let mine = &self.segments[self.me];
        if g >= 1 {
            self.wait_all(2 * g - 1, deadline)?; // everyone is done with chunk g - 2
        }
        for j in (0..members).filter(|j| *j != self.me) {
            let (lo, hi) = slice_bounds(n, members, j);
            // SAFETY: our buffer `which` is ours alone to write until we publish 2g+1 (see the
            // module's protocol); `part` is a distinct allocation.
            unsafe { copy(part[lo..hi].as_ptr(), mine.buffer(which).add(lo), hi - lo) };
        }
        mine.progress().store(2 * g + 1, Ordering::Release);
        self.wait_all(2 * g + 1, deadline)?;
        if let Some(seq) = check {
            self.check_descriptors(seq)?;
        }
        let (lo, hi) = slice_bounds(n, members, self.me);
        self.sum_slice(which, &mut part[lo..hi], lo);
        mine.progress().store(2 * g + 2, Ordering::Release);
        self.wait_all(2 * g + 2, deadline)?;
        for (j, seg) in self
            .segments
            .iter()
            .enumerate()
            .filter(|(j, _)| *j != self.me)
        {
            let (lo, hi) = slice_bounds(n, members, j);
            // SAFETY: member j's slice of buffer `which` is final (it published 2g+2) and stays
            // so until we publish 2(g+1)+1.
            unsafe {
                copy(
                    seg.buffer(which).add(lo),
                    part[lo..hi].as_mut_ptr(),
                    hi - lo,
                )
            };
        }
        Ok(())
    }

    /// Our slice (`ours`, starting at float `lo` of the chunk) := the sum over members, in member
    /// order (ours from `ours`, the others' from their buffer `which`); the sum is also left in
    /// our buffer for the others to copy.
    fn sum_slice(&self, which: usize, ours: &mut [f32], lo: usize) {
        const BLOCK: usize = 1024;
        let mut acc = [0f32; BLOCK];
        let dst = self.segments[self.me].buffer(which);
        for (b, block) in ours.chunks_mut(BLOCK).enumerate() {
            let start = lo + b * BLOCK;
            let acc = &mut acc[..block.len()];
            for (j, seg) in self.segments.iter().enumerate() {
                let src: &[f32] = if j == self.me {
                    block
                } else {
                    // SAFETY: member j published 2g+1, so this part of its buffer holds its
                    // data, and no one writes it until we publish 2g+2.
                    unsafe { std::slice::from_raw_parts(seg.buffer(which).add(start), acc.len()) }
                };
                if j == 0 {
                    acc.copy_from_slice(src);
                } else {
                    acc.iter_mut().zip(src).for_each(|(a, s)| *a += *s);
                }
            }
            block.copy_from_slice(acc);
            // SAFETY: our own slice of our buffer; nobody reads it before we publish 2g+2.
            unsafe { copy(acc.as_ptr(), dst.add(start), acc.len()) };
        }
    }

    fn check_descriptors(&self, seq: u64) -> Result<(), ShmFailure> {
        let len = self.segments[self.me]
            .word(OP_LEN_AT)
            .load(Ordering::Relaxed);
        for (j, seg) in self.segments.iter().enumerate() {
            let their_seq = seg.word(OP_SEQ_AT).load(Ordering::Relaxed);
            let their_len = seg.word(OP_LEN_AT).load(Ordering::Relaxed);
            if their_seq != seq || their_len != len {
                return Err(ShmFailure::Mismatch {
                    rank: self.ranks[j],
                    their_seq,
                    their_len,
                });
            }
        }
        Ok(())
    }

    /// Waits until every member has published progress `target`: spinning briefly, then
    /// yielding the core (ranks may outnumber cores); checks the deadline and whether the
    /// laggards are still alive now and then.
    fn wait_all(&self, target: u64, deadline: Instant) -> Result<(), ShmFailure> {
        for (j, seg) in self.segments.iter().enumerate() {
            let mut spins = 0u32;
            while seg.progress().load(Ordering::Acquire) < target {
                spins = spins.wrapping_add(1);
                if spins < 128 {
                    std::hint::spin_loop();
                    continue;
                }
                std::thread::yield_now();
                if spins % 4096 == 0 {
                    self.check_alive(j)?;
                    if Instant::now() >= deadline {
                        return Err(ShmFailure::Timeout);
                    }
                }
            }
        }
        Ok(())
    }

    fn check_alive(&self, j: usize) -> Result<(), ShmFailure> {
        let pid = self.segments[j].word(PID_AT).load(Ordering::Acquire);
        match u32::try_from(pid) {
            Ok(pid) if !common::shm_segments::creator_gone(pid) => Ok(()),
            _ => Err(ShmFailure::Exited {
                rank: self.ranks[j],
                pid,
            }),
        }
    }
}

/// Member `i`'s slice of a chunk of `n` floats split over `members`: cache-line aligned
/// boundaries, together covering `0..n`.
fn slice_bounds(n: usize, members: usize, i: usize) -> (usize, usize) {
    let edge = |k: usize| {
        if k >= members {
            n
        } else {
            (k * n / members) / ALIGN_FLOATS * ALIGN_FLOATS
        }
    };
    (edge(i), edge(i + 1))
}

/// Publishes `value` under `{prefix}/{rank}` and returns every member's, in member order.
fn exchange(
    store: &mut StoreClient,
    prefix: &str,
    rank: usize,
    ranks: &[usize],
    value: &str,
    timeout: Duration,
) -> Result<Vec<String>, String> {
    store
        .set(&format!("{prefix}/{rank}"), value.as_bytes())
        .map_err(|e| format!("publishing {prefix}/{rank}: {e}"))?;
    let keys: Vec<String> = ranks.iter().map(|r| format!("{prefix}/{r}")).collect();
    let keys: Vec<&str> = keys.iter().map(String::as_str).collect();
    let values = store
        .wait(&keys, timeout)
        .map_err(|e| format!("waiting for {prefix} of ranks {ranks:?}: {e}"))?;
    Ok(values
        .into_iter()
        .map(|v| String::from_utf8_lossy(&v).into_owned())
        .collect())
}

/// `count` floats from `src` to `dst` (which do not overlap).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`].
unsafe fn copy(src: *const f32, dst: *mut f32, count: usize) {
    // SAFETY: passed on to the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, count) }
}

fn random_hex() -> Result<String, String> {
    let mut bytes = [0u8; 16];
    getrandom::fill(&mut bytes).map_err(|e| format!("no random numbers from the OS: {e}"))?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_chunk_in_order_on_cache_lines() {
        for n in [0, 1, 15, 16, 17, 1000, 262_144] {
            for members in 1..=5 {
                let mut next = 0;
                for i in 0..members {
                    let (lo, hi) = slice_bounds(n, members, i);
                    assert_eq!(lo, next, "n {n} members {members} slice {i}");
                    assert!(hi >= lo);
                    assert!(lo % ALIGN_FLOATS == 0 || lo == n);
                    next = hi;
                }
                assert_eq!(next, n);
            }
        }
    }
}
