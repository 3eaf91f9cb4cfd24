//! The arena: one shared buffer per member, big enough for a whole operation, so that data put
//! there is all-reduced where it lies, as NCCL does with registered buffers. Each member sums
//! its slice over every member's arena and writes the sum into all of them: one read and one
//! write of the buffer per rank (the chunked path, from private memory, needs two of each),
//! and two synchronisations per operation instead of two per MiB.
//!
//! Arenas are made on first use and replaced by bigger ones when an operation needs more (every
//! member at the same operation, so they agree); when `/dev/shm` cannot hold them, every member
//! learns so at once and the size is not tried again: callers fall back to the chunked path.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::segment::{self, Segment};
use super::{slice_bounds, ShmFailure, ShmGroup, IN_ARENA};
use crate::store::StoreClient;

/// The smallest arena made, in floats (1 MiB): small operations should not grow it one by one.
const MIN_FLOATS: usize = 1 << 18;

/// The members' arenas, and what shared memory refused.
#[derive(Default)]
pub(super) struct ArenaState {
    /// Every member's arena, in member order, and its size in floats.
    current: Option<(Vec<Segment>, usize)>,
    /// Arenas made so far (names their store keys, the same on every member).
    made: u64,
    /// The smallest size (floats) that could not be had: not tried again.
    refused: Option<usize>,
}

impl ShmGroup {
    /// Makes sure every member has an arena of at least `n` floats; false when that cannot be
    /// had (logged once). Every member must call this at the same point with the same `n`;
    /// a bigger arena replaces the old one, so nothing may still point into that.
    pub fn ensure_arena(
        &mut self,
        store: &mut StoreClient,
        n: usize,
        timeout: Duration,
    ) -> Result<bool, String> {
        let state = &mut self.arena;
        if matches!(&state.current, Some((_, floats)) if *floats >= n) {
            return Ok(true);
        }
        let floats = n.max(MIN_FLOATS).next_power_of_two();
        if state.refused.is_some_and(|refused| floats >= refused) {
            return Ok(false);
        }
        state.current = None; // unmap the old arena before asking for more memory
        state.made += 1;
        let prefix = format!("shm/arena{}", state.made);
        match segment::share(
            store,
            &prefix,
            &self.ranks,
            self.me,
            floats * 4,
            timeout,
            |_| {},
        )? {
            Ok(segments) => {
                state.current = Some((segments, floats));
                Ok(true)
            }
            Err(why) => {
                tracing::warn!(
                    "no shared-memory arena of {} MiB per rank ({why}); buckets of that size are copied through the chunked path",
                    (floats * 4) >> 20
                );
                state.refused = Some(floats);
                Ok(false)
            }
        }
    }

    /// The first `n` floats of our arena, if [`ShmGroup::ensure_arena`] made one that large.
    /// Nobody else touches them outside [`ShmGroup::all_reduce_arena`].
    pub fn arena(&mut self, n: usize) -> Option<&mut [f32]> {
        let (segments, floats) = self.arena.current.as_ref()?;
        if n > *floats {
            return None;
        }
        let base = segments[self.me].base() as *mut f32;
        // SAFETY: our arena holds `floats >= n` floats, page-aligned; the peers write into it
        // only inside an arena operation, which needs `&mut self`, as this borrow does.
        Some(unsafe { std::slice::from_raw_parts_mut(base, n) })
    }

    /// Sums the first `n` floats of every member's arena, element-wise in member order, into
    /// every member's arena, as operation `seq` (the same `seq` and `n` on every member).
    pub fn all_reduce_arena(
        &mut self,
        n: usize,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmFailure> {
        let Some((arenas, floats)) = self.arena.current.as_ref() else {
            return Err(ShmFailure::NoArena { floats: n });
        };
        if n > *floats {
            return Err(ShmFailure::NoArena { floats: n });
        }
        let g = self.chunks;
        self.describe(seq, n, IN_ARENA);
        let mine = &self.segments[self.me];
        // Our data is in place; the others' arenas are not ours to touch until they say so.
        mine.progress().store(2 * g + 1, Ordering::Release);
        self.wait_all(2 * g + 1, deadline)?;
        self.check_descriptors(seq)?;
        let (lo, hi) = slice_bounds(n, arenas.len(), self.me);
        sum_into_all(arenas, lo, hi);
        // Every slice must be final in every arena before anyone reads its result.
        mine.progress().store(2 * g + 2, Ordering::Release);
        self.wait_all(2 * g + 2, deadline)?;
        self.chunks += 1;
        Ok(())
    }
}

/// Floats `lo..hi` of every arena := their sum over the arenas, in member order.
fn sum_into_all(arenas: &[Segment], lo: usize, hi: usize) {
    const BLOCK: usize = 1024;
    let mut acc = [0f32; BLOCK];
    let mut start = lo;
    while start < hi {
        let acc = &mut acc[..BLOCK.min(hi - start)];
        for (j, arena) in arenas.iter().enumerate() {
            // SAFETY: `start + acc.len() <= hi <= n`, within every arena; this slice of every
            // arena is ours alone between progress 2g+1 and 2g+2 (see all_reduce_arena).
            let src = unsafe {
                std::slice::from_raw_parts((arena.base() as *const f32).add(start), acc.len())
            };
            super::accumulate(acc, j, src);
        }
        for arena in arenas {
            // SAFETY: as above.
            unsafe {
                super::copy(
                    acc.as_ptr(),
                    (arena.base() as *mut f32).add(start),
                    acc.len(),
                )
            };
        }
        start += acc.len();
    }
}
