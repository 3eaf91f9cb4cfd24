//! The shared-memory reduce-scatter: each member ends with the sum over the members of its own
//! part of the buffer only, where the all-reduce gives every member the whole sum. A chunk
//! holds a piece of every member's part (so the members sum their pieces at once, as the
//! all-reduce's slices do): each member copies the others' pieces of its data into its buffer,
//! then sums its own piece over every member's buffer, in member order, so its part holds the
//! bits [`ShmGroup::all_reduce`] would have put there. Nothing is copied back out: a member
//! moves `(W-1)/W` of the buffer where the all-reduce moves all of it. No arena: a bucket
//! costs no shared memory beyond the control segments (a sharded optimizer is there to save
//! memory).

use std::ops::Range;
use std::time::Instant;

use super::{copy, ShmFailure, ShmGroup, ALIGN_FLOATS, CHUNK_BYTES, REDUCE_SCATTER};

impl ShmGroup {
    /// Sums `data` element-wise over the members into our part of it, `parts[me]`, as
    /// operation `seq`; `parts` (one per member, in member order) partition `0..data.len()`,
    /// the same on every member, as are `seq` and the length. The rest of `data` is left as it
    /// was.
    pub fn reduce_scatter(
        &mut self,
        data: &mut [f32],
        parts: &[Range<usize>],
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmFailure> {
        let members = self.segments.len();
        assert!(
            parts.len() == members
                && parts
                    .iter()
                    .all(|p| p.start <= p.end && p.end <= data.len()),
            "reduce_scatter: one part of the buffer per member"
        );
        self.describe(seq, data.len(), REDUCE_SCATTER);
        let per = piece_floats(members);
        assert!(
            per * members <= CHUNK_BYTES / 4,
            "reduce_scatter: {members} members do not fit a chunk"
        );
        let longest = parts.iter().map(Range::len).max().unwrap_or(0);
        let chunks = longest.div_ceil(per);
        let (me, base) = (self.me, data.as_mut_ptr());
        let piece = |j: usize, c: usize| {
            let p = &parts[j];
            let lo = (p.start + c * per).min(p.end);
            lo..(lo + per).min(p.end)
        };
        for c in 0..chunks {
            let put = |buffer: *mut u8| {
                for j in (0..members).filter(|j| *j != me) {
                    let p = piece(j, c);
                    // SAFETY: `p` lies in `data` (checked above); slot j of our buffer holds
                    // `per >= p.len()` floats, ours to write until we publish 2g+1.
                    unsafe {
                        copy(
                            base.add(p.start),
                            (buffer as *mut f32).add(j * per),
                            p.len(),
                        )
                    }
                }
            };
            let take = |group: &ShmGroup, which: usize| {
                let p = piece(me, c);
                // SAFETY: our own piece of `data`, which no `put` of this chunk reads (they
                // read the others' pieces).
                let ours = unsafe { std::slice::from_raw_parts_mut(base.add(p.start), p.len()) };
                group.sum_slice(which, ours, me * per, false);
            };
            self.chunk_with(
                deadline,
                (c == 0).then_some(seq),
                c + 1 == chunks,
                put,
                take,
            )?;
            self.chunks += 1;
        }
        Ok(())
    }
}

/// Floats of each member's piece in a chunk: the buffer split evenly, on cache lines.
fn piece_floats(members: usize) -> usize {
    let even = CHUNK_BYTES / 4 / members.max(1);
    match even >= ALIGN_FLOATS {
        true => even / ALIGN_FLOATS * ALIGN_FLOATS,
        false => even.max(1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_members_piece_fits_its_slot_of_the_buffer() {
        for members in [1, 2, 3, 4, 7, 64, 1000, 20_000] {
            let per = piece_floats(members);
            assert!(
                per * members <= CHUNK_BYTES / 4,
                "reduce_scatter: {members} members do not fit a chunk"
            );
            assert!(
                per >= 1 && per * members * 4 <= CHUNK_BYTES,
                "{members}: {per}"
            );
        }
    }
}
