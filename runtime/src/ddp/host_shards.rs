//! ZeRO stage 1 on one host ([`super::DdpConfig::shard_optimizer`]): every trainable parameter
//! lives once, with its two AdamW moments, in memory shared by the host's ranks, and each rank's
//! gradients are produced straight into its own block of shared memory (autograd adds into
//! them in place). A step then needs no gradient all-reduce: each rank sums its share of every
//! parameter's rows over the ranks' gradient blocks (reduce-scatter, read where the gradients
//! lie), publishes those rows' sums of squares for the clipping norm, clips and updates its
//! rows, and the parameters are everyone's at once (the all-gather is the shared memory itself,
//! behind a barrier). Sums are taken in rank order and the norm from the same per-row sums, so
//! the step is the unsharded one, bit for bit.
//!
//! Owns: the layout of the shared memory, pointing the parameters and their gradients at it,
//! which rows each rank owns, and the arithmetic of the reduction over those rows. Must not:
//! synchronise the ranks (the engine calls the barriers), know what the parameters mean, or
//! step the optimizer itself.

use std::ops::Range;

use tch::{Device, Kind, Tensor};

use super::DdpError;
use crate::collective::{Collective, OpContext};
use crate::optim::AdamW;

/// Floats between the starts of two arrays: each starts on a 64-byte line.
const ALIGN: usize = 16;

/// One parameter kept in shared memory.
struct ShardedParam {
    /// The values, and the moments, in the shared memory.
    value: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    /// Every rank's gradient, in rank order (ours is the parameter's `.grad()`).
    grads: Vec<Tensor>,
    /// Rows of the first dimension (elements of a 1-D parameter) and floats per row.
    height: i64,
    width: usize,
    /// The rows this rank reduces and updates.
    rows: Range<i64>,
    /// Where its rows' sums of squares start in `row_sums`.
    row_sums_at: usize,
}

/// The parameters of one engine, kept once per host.
pub(super) struct HostShards {
    params: Vec<ShardedParam>,
    /// One f64 per row of every parameter: the sum of squares of the row's reduced gradient,
    /// written by the row's owner.
    row_sums: Tensor,
    world: usize,
}

/// A float count rounded up to whole cache lines.
fn slot(floats: usize) -> usize {
    floats.div_ceil(ALIGN) * ALIGN
}

/// Rows (first dimension) of a parameter; a 0-d one is not sharded.
fn height(t: &Tensor) -> i64 {
    t.size().first().copied().unwrap_or(1)
}

impl HostShards {
    /// Moves every parameter of `params` (f32 CPU tensors of at least one dimension, the same
    /// values on every rank, gradients already given: see `give_dense_grads`) and every rank's
    /// gradients into memory shared by the ranks. `None`, the same on every rank, when some
    /// parameter is not such a tensor or the collective cannot share memory (ranks on several
    /// hosts, no shared memory, a GPU backend).
    pub(super) fn new(
        comm: &mut dyn Collective,
        params: &[Tensor],
        ctx: OpContext,
    ) -> Result<Option<HostShards>, DdpError> {
        let fits = |t: &Tensor| {
            t.device() == Device::Cpu
                && t.kind() == Kind::Float
                && t.dim() >= 1
                && t.grad().defined()
        };
        let (rank, world) = (comm.rank(), comm.world_size());
        if world < 2 || params.is_empty() || !params.iter().all(fits) {
            return Ok(None);
        }
        let per_rank: usize = params.iter().map(|p| slot(p.numel())).sum();
        let row_floats = slot(2 * params.iter().map(|p| height(p) as usize).sum::<usize>());
        let floats = 3 * per_rank + world * per_rank + row_floats;
        let Some(memory) = comm.host_shared(floats, ctx)? else {
            return Ok(None);
        };
        let base = memory.as_ptr();
        // SAFETY (every view below): `floats` f32s at `base` stay mapped until the process
        // exits; the arrays laid out here do not overlap and lie inside them.
        let view = |at: usize, size: &[i64], kind: Kind| unsafe {
            assert!(at + slot(size.iter().product::<i64>() as usize) <= floats);
            Tensor::f_from_blob(
                base.add(at) as *const u8,
                size,
                &contiguous_strides(size),
                kind,
                Device::Cpu,
            )
        };
        let _guard = tch::no_grad_guard();
        // `at`: where the parameter's value starts (then its two moments); `offset`: where its
        // gradient starts in each rank's block.
        let (mut at, mut offset, mut row_sums_at) = (0, 0, 0);
        let mut sharded = Vec::with_capacity(params.len());
        for p in params {
            let size = p.size();
            let n = slot(p.numel());
            let grads = (0..world)
                .map(|r| view(3 * per_rank + r * per_rank + offset, &size, Kind::Float))
                .collect::<Result<Vec<_>, _>>()?;
            let h = height(p);
            sharded.push(ShardedParam {
                value: view(at, &size, Kind::Float)?,
                exp_avg: view(at + n, &size, Kind::Float)?,
                exp_avg_sq: view(at + 2 * n, &size, Kind::Float)?,
                grads,
                height: h,
                width: p.numel() / h.max(1) as usize,
                rows: h * rank as i64 / world as i64..h * (rank as i64 + 1) / world as i64,
                row_sums_at,
            });
            at += 3 * n;
            offset += n;
            row_sums_at += h as usize;
        }
        let row_sums = view(
            3 * per_rank + world * per_rank,
            &[row_sums_at as i64],
            Kind::Double,
        )?;
        // Rank 0 fills the values (the moments and gradients start as zeros, as the memory
        // does); everyone points their parameters and gradients at the memory once it has.
        if rank == 0 {
            for (s, p) in sharded.iter().zip(params) {
                s.value.shallow_clone().f_copy_(p)?;
            }
        }
        comm.barrier(ctx)?;
        for (s, p) in sharded.iter().zip(params) {
            p.shallow_clone().set_data(&s.value);
            p.grad().set_data(&s.grads[rank]);
        }
        Ok(Some(HostShards {
            params: sharded,
            row_sums,
            world,
        }))
    }

    /// Whether `param` (the engine's `params[index]`) reads and writes the host's copy, and
    /// its gradient lies in this rank's block, as every rank's must: a parameter off the copy
    /// trains alone, and a gradient off the block is never seen by the rows' owners.
    pub(super) fn is_shared_copy(&self, index: usize, param: &Tensor, rank: usize) -> bool {
        let s = &self.params[index];
        s.value.data_ptr() == param.data_ptr()
            && s.grads[rank].data_ptr() == param.grad().data_ptr()
    }

    /// Our rows of parameter `index` (or those of them in `listed`, ascending) := the mean of
    /// every rank's gradient, summed in rank order (as the all-reduce sums); and each such row's
    /// sum of squares into the shared row sums. Call once every rank's gradients are complete.
    pub(super) fn reduce(&self, index: usize, listed: Option<&[i64]>, rank: usize) {
        let s = &self.params[index];
        let sources: Vec<*const f32> = s.grads.iter().map(|g| g.data_ptr() as *const f32).collect();
        let ours = s.grads[rank].data_ptr() as *mut f32;
        let sums = self.row_sums.data_ptr() as *mut f64;
        let w = self.world as f32;
        let reduce_rows = |lo: i64, hi: i64| {
            let (start, end) = (lo as usize * s.width, hi as usize * s.width);
            // SAFETY: rows `lo..hi` are ours: no other rank writes them in any gradient, and
            // their own ranks finished writing their gradients before this step's summary
            // all-reduce, which every rank has passed; the ranges lie inside each gradient.
            unsafe { mean_into(&sources, ours, start, end, w) };
            for r in lo..hi {
                let at = r as usize * s.width;
                // SAFETY: our rows (see above); one row sum per row, ours alone to write.
                unsafe {
                    let row = std::slice::from_raw_parts(ours.add(at), s.width);
                    *sums.add(s.row_sums_at + r as usize) = crate::clip::row_sum_of_squares(row);
                }
            }
        };
        match listed {
            None => reduce_rows(s.rows.start, s.rows.end),
            Some(listed) => {
                // Runs of consecutive rows at once (`listed` is ascending).
                let mut ours = listed.iter().copied().filter(|r| s.rows.contains(r));
                let Some(mut lo) = ours.next() else { return };
                let mut hi = lo + 1;
                for r in ours {
                    if r != hi {
                        reduce_rows(lo, hi);
                        lo = r;
                    }
                    hi = r + 1;
                }
                reduce_rows(lo, hi);
            }
        }
    }

    /// Parameter `index`'s sum of squares from the row sums its rows' owners published (all
    /// rows, or the `listed` ones), added as `clip::clip_grads` adds a gradient's rows.
    pub(super) fn sum_of_squares(
        &self,
        index: usize,
        listed: Option<&[i64]>,
    ) -> Result<f64, DdpError> {
        let s = &self.params[index];
        // SAFETY: `row_sums` holds one f64 per row of every parameter; their owners wrote them
        // before the barrier that precedes this call.
        let sums = unsafe {
            std::slice::from_raw_parts(
                (self.row_sums.data_ptr() as *const f64).add(s.row_sums_at),
                s.height as usize,
            )
        };
        Ok(crate::clip::add_rows(s.height, listed, |r| sums[r])?)
    }

    /// Scales our rows of parameter `index`'s gradient (those in `listed`, when given) by
    /// `coef`, as clipping scales a whole gradient.
    pub(super) fn scale(
        &self,
        index: usize,
        grad: &Tensor,
        listed: Option<&[i64]>,
        coef: f64,
    ) -> Result<(), DdpError> {
        let s = &self.params[index];
        match listed {
            None => {
                let len = s.rows.end - s.rows.start;
                let _ = grad.f_narrow(0, s.rows.start, len)?.f_mul_scalar_(coef)?;
            }
            Some(listed) => {
                let ours: Vec<i64> = listed
                    .iter()
                    .copied()
                    .filter(|r| s.rows.contains(r))
                    .collect();
                crate::rows::scale(grad, &ours, coef)?;
            }
        }
        Ok(())
    }

    /// Makes `optimizer` update only this rank's rows of every parameter, with the moments in
    /// the shared memory (their current values of those rows are copied there). Nothing to do
    /// when it already does.
    pub(super) fn attach(&self, optimizer: &mut AdamW) -> Result<(), DdpError> {
        for (i, s) in self.params.iter().enumerate() {
            if optimizer.rows_updated(i).as_ref() == Some(&s.rows) {
                continue;
            }
            optimizer.update_rows_only(
                i,
                s.rows.clone(),
                s.exp_avg.shallow_clone(),
                s.exp_avg_sq.shallow_clone(),
            )?;
        }
        Ok(())
    }
}

/// Row-major strides of `size`.
fn contiguous_strides(size: &[i64]) -> Vec<i64> {
    let mut strides = vec![1i64; size.len()];
    for d in (0..size.len().saturating_sub(1)).rev() {
        strides[d] = strides[d + 1] * size[d + 1];
    }
    strides
}

/// `ours[start..end]` := (sum of `sources[r][start..end]` over r, in order) / `w`: the
/// arithmetic of a sharded step's reduction (public for `collective-bench`, which times it).
///
/// # Safety
/// Every source and `ours` are valid for `end` floats; `ours` may be one of the sources (each
/// block is read whole before it is written); nobody else writes the range meanwhile.
pub unsafe fn mean_into(sources: &[*const f32], ours: *mut f32, start: usize, end: usize, w: f32) {
    // A row of an embedding table is short: zeroing a large accumulator for it would cost more
    // than the row's arithmetic.
    if end - start <= 64 {
        // SAFETY: passed on from the caller.
        unsafe { mean_blocks(sources, ours, start, end, w, &mut [0f32; 64]) }
    } else {
        // SAFETY: passed on from the caller.
        unsafe { mean_blocks(sources, ours, start, end, w, &mut [0f32; 1024]) }
    }
}

/// [`mean_into`], a block of `acc.len()` floats at a time.
///
/// # Safety
/// As [`mean_into`].
unsafe fn mean_blocks(
    sources: &[*const f32],
    ours: *mut f32,
    start: usize,
    end: usize,
    w: f32,
    acc: &mut [f32],
) {
    let (mut at, block) = (start, acc.len());
    while at < end {
        let acc = &mut acc[..(end - at).min(block)];
        if let [a, b] = sources {
            // Two ranks, the usual host: one pass, the same arithmetic as the loop below.
            // SAFETY: passed on from the caller.
            let (a, b) = unsafe {
                (
                    std::slice::from_raw_parts(a.add(at), acc.len()),
                    std::slice::from_raw_parts(b.add(at), acc.len()),
                )
            };
            acc.iter_mut()
                .zip(a.iter().zip(b))
                .for_each(|(acc, (a, b))| *acc = (*a + *b) / w);
            // SAFETY: passed on from the caller.
            unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), ours.add(at), acc.len()) };
            at += acc.len();
            continue;
        }
        for (j, src) in sources.iter().enumerate() {
            // SAFETY: passed on from the caller.
            let src = unsafe { std::slice::from_raw_parts(src.add(at), acc.len()) };
            if j == 0 {
                acc.copy_from_slice(src);
            } else {
                acc.iter_mut().zip(src).for_each(|(a, s)| *a += *s);
            }
        }
        // As the all-reduce averages: the sum, then one division.
        acc.iter_mut().for_each(|a| *a /= w);
        // SAFETY: passed on from the caller.
        unsafe { std::ptr::copy_nonoverlapping(acc.as_ptr(), ours.add(at), acc.len()) };
        at += acc.len();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strides_are_row_major() {
        assert_eq!(contiguous_strides(&[3, 4, 5]), vec![20, 5, 1]);
        assert_eq!(contiguous_strides(&[7]), vec![1]);
    }

    #[test]
    fn the_mean_sums_in_rank_order_then_divides() {
        let a: Vec<f32> = (0..3000).map(|i| (i as f32).sin() * 1e3).collect();
        let b: Vec<f32> = (0..3000).map(|i| (i as f32).cos() * 1e-3).collect();
        let mut ours = b.clone();
        let sources = [a.as_ptr(), ours.as_ptr()];
        // SAFETY: all 3000 floats long; `ours` is a source, as the engine's own gradient is.
        unsafe { mean_into(&sources, ours.as_mut_ptr(), 5, 2500, 2.0) };
        for i in 0..3000 {
            let want = if (5..2500).contains(&i) {
                (a[i] + b[i]) / 2.0
            } else {
                b[i]
            };
            assert_eq!(ours[i].to_bits(), want.to_bits(), "element {i}");
        }
    }
}
