//! The operations of the shared-memory group that move data without reducing it: barrier,
//! broadcast and all-gather, on the same control segments and progress counters as the
//! all-reduce (see the module's protocol), so that any sequence of operations stays in step.
//!
//! Each chunk `g` of an operation: the members that have data for it copy it into their buffer
//! `g % 2` (after every member published `2g-1`: done with chunk `g-2`) and publish `2g+1`;
//! once every member has, each copies what it needs out of the others' buffers and publishes
//! `2g+2`. Only an operation's last chunk waits for every member's `2g+2` (so that no member
//! rewrites its operation's descriptor while another still checks it): within an operation the
//! next chunk goes into the other buffer while the members still copy this one out. A byte
//! crosses memory twice (in, out), never the kernel: the socket ring sends it through loopback
//! W-1 times. Large outputs are written with streaming stores ([`STREAM_FROM`]).

use std::sync::atomic::Ordering;
use std::time::Instant;

use super::{ShmFailure, ShmGroup, CHUNK_BYTES};

/// `len` bytes at `ptr` that an operation reads or writes: the caller keeps them valid and
/// untouched by anything else for the operation (tensor memory, typically; parts of one
/// operation may not overlap).
#[derive(Debug, Clone, Copy)]
pub struct Bytes {
    pub ptr: *mut u8,
    pub len: usize,
}

/// Our own part into its place in the output, unless the caller gathers in place; with
/// streaming stores if `streaming` (see [`STREAM_FROM`]).
pub(crate) fn copy_own(mine: Bytes, into: Bytes, streaming: bool) {
    if mine.ptr != into.ptr {
        // SAFETY: both valid for `mine.len` bytes (see Bytes); parts do not overlap unless they
        // are the same, which is skipped.
        unsafe { copy_out(mine.ptr, into.ptr, mine.len, streaming) };
    }
}

/// Operations that write at least this many bytes of output write them with streaming stores:
/// an output that outgrows the caches would otherwise be read into them before each line is
/// overwritten (a third pass over memory), pushing out the chunk buffers the next copy reads.
/// Below it the output is better left in cache for its reader (16 MiB broadcasts were 25%
/// slower streamed on the machine of docs/figures.md; 64 MiB all-gathers 1.3x faster).
const STREAM_FROM: usize = 32 << 20;

/// Copies `n` bytes from `src` to `dst`, with streaming (non-temporal) stores if `streaming`.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping(src, dst, n)`.
unsafe fn copy_out(src: *const u8, dst: *mut u8, n: usize, streaming: bool) {
    #[cfg(target_arch = "x86_64")]
    if streaming {
        return stream_copy(src, dst, n);
    }
    let _ = streaming;
    std::ptr::copy_nonoverlapping(src, dst, n)
}

/// `copy_nonoverlapping` with SSE2's streaming stores (in every x86-64) for the 16-aligned
/// body of `dst`, and a store fence so that the bytes are visible before any later publication.
///
/// # Safety
/// As `std::ptr::copy_nonoverlapping(src, dst, n)`.
#[cfg(target_arch = "x86_64")]
unsafe fn stream_copy(src: *const u8, dst: *mut u8, n: usize) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
    let head = dst.align_offset(16).min(n);
    std::ptr::copy_nonoverlapping(src, dst, head);
    let (src, dst, n) = (src.add(head), dst.add(head), n - head);
    let body = n / 64 * 64;
    let mut i = 0;
    while i < body {
        let s = src.add(i) as *const __m128i;
        let d = dst.add(i) as *mut __m128i;
        let (a, b, c, e) = (
            _mm_loadu_si128(s),
            _mm_loadu_si128(s.add(1)),
            _mm_loadu_si128(s.add(2)),
            _mm_loadu_si128(s.add(3)),
        );
        _mm_stream_si128(d, a);
        _mm_stream_si128(d.add(1), b);
        _mm_stream_si128(d.add(2), c);
        _mm_stream_si128(d.add(3), e);
        i += 64;
    }
    std::ptr::copy_nonoverlapping(src.add(body), dst.add(body), n - body);
    _mm_sfence();
}

/// Calls `f((pointer, length), offset in the chunk)` for each piece of `parts` (read as one run
/// of bytes) that lies in `start..end`.
fn each_piece(
    parts: &[Bytes],
    start: usize,
    end: usize,
    mut f: impl FnMut((*mut u8, usize), usize),
) {
    let mut at = 0;
    for part in parts {
        let (lo, hi) = (at.max(start), (at + part.len).min(end));
        if lo < hi {
            // SAFETY: `lo - at < part.len`: inside the part.
            f((unsafe { part.ptr.add(lo - at) }, hi - lo), lo - start);
        }
        at += part.len;
        if at >= end {
            break;
        }
    }
}

/// Bytes a broadcast of `total` bytes moves per chunk: a quarter of it (on 4 KiB), between
/// 256 KiB and a whole buffer, so that the root's copy in and the others' copy out of a
/// broadcast of a few MiB overlap (a 1 MiB broadcast in one chunk took 103 µs here, in four
/// 69 µs); every member computes the same from the same length.
fn broadcast_piece(total: usize) -> usize {
    (total / 4)
        .next_multiple_of(4096)
        .clamp(256 << 10, CHUNK_BYTES)
}

/// Operation kinds in the descriptor, beside the all-reduce's.
pub(super) const BARRIER: u64 = 3;
pub(super) const BROADCAST: u64 = 4;
pub(super) const ALL_GATHER: u64 = 5;

impl ShmGroup {
    /// Returns once every member has entered barrier `seq` (two publications, no data).
    pub fn barrier(&mut self, seq: u64, deadline: Instant) -> Result<(), ShmFailure> {
        self.describe(seq, 0, BARRIER);
        self.chunk_with(deadline, Some(seq), true, |_| {}, |_, _| {})?;
        self.chunks += 1;
        Ok(())
    }

    /// Overwrites `parts` (read as one run of bytes, one part after another) with member
    /// `root`'s (an index into the members), as operation `seq` (the same `seq`, `root` and part
    /// lengths on every member).
    pub fn broadcast(
        &mut self,
        parts: &[Bytes],
        root: usize,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmFailure> {
        let total: usize = parts.iter().map(|p| p.len).sum();
        self.describe(seq, total, BROADCAST + ((root as u64) << 8));
        let (me, piece) = (self.me, broadcast_piece(total));
        let streaming = total >= STREAM_FROM;
        let mut start = 0;
        loop {
            let end = total.min(start + piece);
            let put = |buffer: *mut u8| {
                if me == root {
                    // SAFETY: `end - start <= piece <= CHUNK_BYTES` bytes into our own buffer, ours to
                    // write until we publish 2g+1; the parts are the caller's, valid (see Bytes).
                    each_piece(parts, start, end, |part, at| unsafe {
                        std::ptr::copy_nonoverlapping(part.0, buffer.add(at), part.1)
                    })
                }
            };
            let take = |group: &ShmGroup, which: usize| {
                if me != root {
                    let from = group.segments[root].buffer(which) as *const u8;
                    // SAFETY: the root published 2g+1, so its buffer holds the chunk, unchanged
                    // until we publish 2g+2.
                    each_piece(parts, start, end, |part, at| unsafe {
                        copy_out(from.add(at), part.0, part.1, streaming)
                    })
                }
            };
            self.chunk_with(
                deadline,
                (start == 0).then_some(seq),
                end >= total,
                put,
                take,
            )?;
            self.chunks += 1;
            start = end;
            if start >= total {
                return Ok(());
            }
        }
    }

    /// Every member's `mine` (the same length on all) into `out[j]` for member `j` (each as long
    /// as `mine`; ours is copied too, unless `mine` is `out[me]` itself), as operation `seq`.
    pub fn all_gather(
        &mut self,
        mine: Bytes,
        out: &[Bytes],
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmFailure> {
        let (len, members) = (mine.len, self.segments.len());
        assert!(
            out.len() == members && out.iter().all(|o| o.len == len),
            "all_gather: out must hold one part as long as ours per member"
        );
        self.describe(seq, len, ALL_GATHER);
        let me = self.me;
        let streaming = len * members >= STREAM_FROM;
        // A large output takes our own part from our buffer, chunk by chunk, where it was just
        // put (in the cache): one read of `mine` from memory instead of two (64 MiB parts in
        // about 14% less time). A small one copies it first, while the others still put their
        // first chunk (1 MiB parts took about 12% longer the other way).
        let own = streaming && mine.ptr != out[me].ptr;
        if !streaming {
            copy_own(mine, out[me], false);
        }
        let mut start = 0;
        loop {
            let n = CHUNK_BYTES.min(len - start);
            let put = |buffer: *mut u8| {
                // SAFETY: `n <= CHUNK_BYTES` bytes into our own buffer, ours to write until we
                // publish 2g+1.
                unsafe { std::ptr::copy_nonoverlapping(mine.ptr.add(start), buffer, n) }
            };
            let take = |group: &ShmGroup, which: usize| {
                for j in (0..members).filter(|j| *j != me || own) {
                    let from = group.segments[j].buffer(which) as *const u8;
                    // SAFETY: member j published 2g+1, so its buffer holds its chunk, unchanged
                    // until we publish 2g+2 (ours until we put chunk g+2 in it); `start + n <=
                    // len`, the length of out[j].
                    unsafe { copy_out(from, out[j].ptr.add(start), n, streaming) }
                }
            };
            let last = start + n >= len;
            self.chunk_with(deadline, (start == 0).then_some(seq), last, put, take)?;
            self.chunks += 1;
            start += n;
            if start >= len {
                return Ok(());
            }
        }
    }

    /// Chunk `self.chunks` of an operation: `put` fills our buffer, `take` reads the others'
    /// (given the buffer's index), with the synchronisation around them (see the module doc).
    /// `check` is the operation whose descriptors every member's must match (its first chunk);
    /// `last` says whether it ends the operation.
    pub(super) fn chunk_with(
        &self,
        deadline: Instant,
        check: Option<u64>,
        last: bool,
        put: impl FnOnce(*mut u8),
        take: impl FnOnce(&ShmGroup, usize),
    ) -> Result<(), ShmFailure> {
        let g = self.chunks;
        let which = (g % 2) as usize;
        let mine = &self.segments[self.me];
        if g >= 1 {
            self.wait_all(2 * g - 1, deadline)?; // everyone is done with chunk g - 2
        }
        put(mine.buffer(which) as *mut u8);
        mine.progress().store(2 * g + 1, Ordering::Release);
        self.wait_all(2 * g + 1, deadline)?;
        if let Some(seq) = check {
            self.check_descriptors(seq)?;
        }
        take(self, which);
        mine.progress().store(2 * g + 2, Ordering::Release);
        if last {
            self.wait_all(2 * g + 2, deadline)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::{broadcast_piece, copy_out, CHUNK_BYTES};

    #[test]
    fn broadcast_pieces_split_a_few_mib_in_four_and_fit_a_buffer() {
        assert_eq!(broadcast_piece(0), 256 << 10);
        assert_eq!(broadcast_piece(100), 256 << 10);
        assert_eq!(broadcast_piece(1 << 20), 256 << 10);
        assert_eq!(broadcast_piece(2 << 20), 512 << 10);
        assert_eq!(broadcast_piece((2 << 20) + 16384), (512 << 10) + 4096);
        assert_eq!(broadcast_piece(64 << 20), CHUNK_BYTES);
    }

    #[test]
    fn streaming_copies_are_exact_at_every_alignment_and_length() {
        let src: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        for streaming in [false, true] {
            for offset in 0..17 {
                for n in [0, 1, 15, 16, 63, 64, 65, 200, 1000, 4000] {
                    let mut dst = vec![0xAAu8; 4096 + 32];
                    // SAFETY: `offset + n <= 4096 + 32` and `n <= 4096`; distinct vectors.
                    unsafe { copy_out(src.as_ptr(), dst.as_mut_ptr().add(offset), n, streaming) };
                    assert_eq!(
                        &dst[offset..offset + n],
                        &src[..n],
                        "offset {offset}, n {n}"
                    );
                    assert!(
                        dst[..offset].iter().all(|b| *b == 0xAA),
                        "before, {offset}/{n}"
                    );
                    assert!(
                        dst[offset + n..].iter().all(|b| *b == 0xAA),
                        "after, {offset}/{n}"
                    );
                }
            }
        }
    }
}
