//! Shared-memory all-reduce for the ranks of one host: what the `tcp` backend uses instead of
//! its socket ring when every rank runs on the same machine (the common case: one box, several
//! CPU ranks or GPUs). Each rank maps one control segment of every other rank, so a byte
//! crosses memory at most three times (copy in, reduce, copy out) and never the kernel; data
//! that already lies in the shared arena ([`arena`]) is reduced where it lies.
//!
//! Protocol, per chunk `g` of [`CHUNK_BYTES`] (double-buffered: chunk `g` uses buffer `g % 2`):
//! copy the chunk into our buffer and publish progress `2g+1`; when every member has, sum our
//! slice of the chunk over all members' buffers (in member order, so every rank gets the same
//! bits) into our buffer and publish `2g+2`; when every member has, copy every member's slice
//! out. A member only overwrites a buffer once every other has published `2g-1`, i.e. finished
//! reading chunk `g-2`. Progress counters grow across operations; an operation's descriptor
//! (sequence number, length, kind) is checked against every member's before any data is used.
//!
//! Segments ([`segment`]) are unlinked as soon as every member has mapped them, so nothing is
//! left behind however the processes end later. This module must not know about tensors or
//! training; it moves `f32`s.

mod arena;
mod copy;
mod scatter;
mod segment;

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::store::StoreClient;
pub(crate) use copy::copy_own;
pub use copy::Bytes;
use segment::Segment;

/// Bytes of one buffer; a control segment holds two (double-buffering) after its header.
pub const CHUNK_BYTES: usize = 1 << 20;
const HEADER_BYTES: usize = 4096;
const SEGMENT_BYTES: usize = HEADER_BYTES + 2 * CHUNK_BYTES;
/// Header fields, each on its own cache line where it is written often.
const PROGRESS_AT: usize = 0;
const OP_SEQ_AT: usize = 64;
const OP_LEN_AT: usize = 72;
/// How the operation moves its data: [`CHUNKED`] or [`IN_ARENA`].
const OP_KIND_AT: usize = 80;
const PID_AT: usize = 128;
const CHUNKED: u64 = 1;
const IN_ARENA: u64 = 2;
/// [`ShmGroup::reduce_scatter`].
const REDUCE_SCATTER: u64 = 6;
/// Floats per slice boundary: slices start on a cache line (64 bytes).
const ALIGN_FLOATS: usize = 16;

/// The header and chunk buffers of a member's control segment.
impl Segment {
    /// The 8-byte header word at byte `at` (8-aligned, inside the header).
    fn word(&self, at: usize) -> &AtomicU64 {
        debug_assert!(at % 8 == 0 && at + 8 <= HEADER_BYTES && self.len() >= HEADER_BYTES);
        // SAFETY: in bounds and aligned (the mapping is page-aligned); AtomicU64 has the
        // layout of u64 and is meant for exactly this kind of sharing.
        unsafe { &*(self.base().add(at) as *const AtomicU64) }
    }

    fn progress(&self) -> &AtomicU64 {
        self.word(PROGRESS_AT)
    }

    /// Start of buffer `which` (0 or 1), `CHUNK_BYTES / 4` floats.
    fn buffer(&self, which: usize) -> *mut f32 {
        debug_assert!(which < 2 && self.len() >= SEGMENT_BYTES);
        // SAFETY: in bounds of the mapping; HEADER_BYTES keeps it 64-byte aligned.
        unsafe { self.base().add(HEADER_BYTES + which * CHUNK_BYTES) as *mut f32 }
    }
}

/// Why a shared-memory operation failed, before the caller turns it into a collective error.
#[derive(Debug, PartialEq, Eq)]
pub enum ShmFailure {
    /// A member did not make progress before the deadline.
    Timeout,
    /// The process of member `rank` is gone.
    Exited { rank: usize, pid: u64 },
    /// No arena of that many floats was set up ([`ShmGroup::ensure_arena`]).
    NoArena { floats: usize },
    /// Member `rank` is at another operation.
    Mismatch {
        rank: usize,
        their_seq: u64,
        their_len: u64,
        /// Their operation and ours, in words ([`op_words`]).
        their_op: String,
        our_op: String,
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
    /// The members' arenas, once an operation asked for one.
    arena: arena::ArenaState,
    /// Regions made by [`ShmGroup::host_shared`] so far (names their store keys).
    regions: u64,
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
        // Our pid is in place before anyone maps the segment: peers check it while they wait.
        let stamp = |own: &Segment| {
            own.word(PID_AT)
                .store(std::process::id() as u64, Ordering::Release)
        };
        match segment::share(store, "shm", ranks, me, SEGMENT_BYTES, timeout, stamp)? {
            Ok(segments) => Ok(Some(ShmGroup {
                me,
                ranks: ranks.to_vec(),
                segments,
                chunks: 0,
                arena: arena::ArenaState::default(),
                regions: 0,
            })),
            Err(why) => {
                tracing::warn!(
                    "shared memory between ranks {ranks:?} unavailable, using sockets: {why}"
                );
                Ok(None)
            }
        }
    }

    /// `len` bytes that every member maps (the same memory), zeroed, and mapped until the
    /// process exits: tensors may point into it for the rest of the run. `Ok(None)`, with the
    /// reason logged, on every member when any could not map it. Every member must call this at
    /// the same point with the same `len`.
    pub fn host_shared(
        &mut self,
        store: &mut StoreClient,
        len: usize,
        timeout: Duration,
    ) -> Result<Option<std::ptr::NonNull<u8>>, String> {
        self.regions += 1;
        let prefix = format!("shm/region{}", self.regions);
        match segment::share_one(store, &prefix, &self.ranks, self.me, len, timeout)? {
            Ok(region) => {
                let base = region.base();
                // Never unmapped: what points into it may live as long as the process.
                std::mem::forget(region);
                Ok(std::ptr::NonNull::new(base))
            }
            Err(why) => {
                tracing::warn!(
                    "no shared memory of {len} bytes between ranks {:?}: {why}",
                    self.ranks
                );
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
        self.describe(seq, data.len(), CHUNKED);
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
        self.sum_slice(which, &mut part[lo..hi], lo, true);
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
    /// order (ours from `ours`, the others' from their buffer `which`); with `share`, the sum is
    /// also left in our buffer for the others to copy.
    fn sum_slice(&self, which: usize, ours: &mut [f32], lo: usize, share: bool) {
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
                accumulate(acc, j, src);
            }
            block.copy_from_slice(acc);
            if share {
                // SAFETY: our own slice of our buffer; nobody reads it before we publish 2g+2.
                unsafe { copy(acc.as_ptr(), dst.add(start), acc.len()) };
            }
        }
    }

    /// Publishes the descriptor of the operation we start (read by the others once we publish
    /// its first progress).
    fn describe(&self, seq: u64, len: usize, kind: u64) {
        let mine = &self.segments[self.me];
        mine.word(OP_SEQ_AT).store(seq, Ordering::Relaxed);
        mine.word(OP_LEN_AT).store(len as u64, Ordering::Relaxed);
        mine.word(OP_KIND_AT).store(kind, Ordering::Relaxed);
    }

    fn check_descriptors(&self, seq: u64) -> Result<(), ShmFailure> {
        let mine = &self.segments[self.me];
        let len = mine.word(OP_LEN_AT).load(Ordering::Relaxed);
        let kind = mine.word(OP_KIND_AT).load(Ordering::Relaxed);
        for (j, seg) in self.segments.iter().enumerate() {
            let their_seq = seg.word(OP_SEQ_AT).load(Ordering::Relaxed);
            let their_len = seg.word(OP_LEN_AT).load(Ordering::Relaxed);
            let their_kind = seg.word(OP_KIND_AT).load(Ordering::Relaxed);
            if their_seq != seq || their_len != len || their_kind != kind {
                return Err(ShmFailure::Mismatch {
                    rank: self.ranks[j],
                    their_seq,
                    their_len,
                    their_op: op_words(their_kind),
                    our_op: op_words(kind),
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

/// An operation's descriptor kind in words, for a mismatch's message (members are global
/// ranks when the group is the whole job).
fn op_words(kind: u64) -> String {
    match kind & 0xff {
        CHUNKED | IN_ARENA => "all_reduce".to_string(),
        REDUCE_SCATTER => "reduce_scatter".to_string(),
        copy::BARRIER => "barrier".to_string(),
        copy::BROADCAST => format!("broadcast from member {}", kind >> 8),
        copy::ALL_GATHER => "all_gather".to_string(),
        other => format!("operation kind {other}"),
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

/// Member `j`'s part of a sum taken in member order: the first member's values start `acc`, the
/// others' are added, so every rank gets the same bits.
fn accumulate(acc: &mut [f32], j: usize, src: &[f32]) {
    if j == 0 {
        acc.copy_from_slice(src);
    } else {
        acc.iter_mut().zip(src).for_each(|(a, s)| *a += *s);
    }
}

/// `count` floats from `src` to `dst` (which do not overlap).
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`].
unsafe fn copy(src: *const f32, dst: *mut f32, count: usize) {
    // SAFETY: passed on to the caller.
    unsafe { std::ptr::copy_nonoverlapping(src, dst, count) }
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
