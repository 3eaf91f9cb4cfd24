//! ZeRO stages 1 and 2 on any backend ([`super::DdpConfig::zero`]): each rank keeps AdamW's
//! moments for its shard of every dense bucket only (the backend's partition of the bucket's
//! flat buffer, [`Collective::shard_of`]), so the moments take 1/W of their memory. A step is
//! then: the bucket's gradients reduce-scattered (each shard holds exactly what the all-reduce
//! would have put there); the clipping norm from every row's sum of squares, computed by the
//! rank where the row starts (a row that crosses a shard's edge is first made whole by a small
//! all-reduce) and all-gathered, added up in the unsharded order; this rank's shard clipped
//! and updated; the parameters all-gathered. The gradients, the row sums, their order and the
//! element-wise update are the unsharded step's: on CPU tensors the same bits as DDP.
//!
//! Stage 2 also shards the gradients: once a bucket is reduce-scattered (by the communication
//! thread during the last backward pass, [`super::overlap`]) its shard is copied into a buffer
//! of this rank's own and its parameters' gradients are dropped, so the whole gradients of the
//! buckets already reduced never exist at once, and none is kept between steps (autograd makes
//! them anew in the next backward). The update reads the shard buffers. A zero a rank's
//! backward made negative (`-0.0`, where DDP's zeroed gradient gives `0.0 + -0.0 = 0.0`) is
//! made positive in the shard, the only place a sign of zero could differ.
//!
//! Owns: the layout (which elements and rows each rank holds, which rows cross an edge), stage
//! 2's shard buffers and the step's exchanges. Must not: know what the parameters mean or keep
//! state between steps other than the layout and those buffers (the moments are the
//! optimizer's), nor touch the row-sparse tables (the engine exchanges and updates them whole,
//! as without ZeRO).

use std::ops::Range;
use std::sync::{Mutex, PoisonError};

use tch::{Device, Kind, Tensor};

use super::DdpError;
use crate::clip::{device_row_sums, row_sums};
use crate::collective::{flatten_f32, unflatten_into, Collective, OpContext, ReduceOp};
use crate::shim::take_error;

/// One dense bucket as a flat buffer.
struct Bucket {
    /// Indices into the engine's parameters, in the bucket's (flattening) order.
    params: Vec<usize>,
    /// Where each of them starts in the flat buffer.
    offsets: Vec<usize>,
    len: usize,
    /// Every rank's shard of the buffer, in rank order.
    shards: Vec<Range<usize>>,
}

/// Row sums in the making: on the host as they come, or on the device until one read.
struct RowSumsOf {
    on_host: bool,
    host: Vec<f64>,
    device: Vec<Tensor>,
}

impl RowSumsOf {
    fn add(&mut self, values: &Tensor, width: usize, rows: Range<i64>) -> Result<(), DdpError> {
        match self.on_host {
            true => self.host.extend(row_sums(values, width, rows)?),
            false => self.device.push(device_row_sums(values, width, rows)?),
        }
        Ok(())
    }

    fn read(self) -> Result<Vec<f64>, DdpError> {
        if self.on_host || self.device.is_empty() {
            return Ok(self.host);
        }
        let all = Tensor::f_cat(&self.device, 0)?.f_to_device(Device::Cpu)?;
        Ok(Vec::<f64>::try_from(all)?)
    }
}

/// Consecutive rows' sums of squares, from the first row's index.
type RowSums = (i64, Vec<f64>);

/// Rows of the first dimension of a parameter (1 for a 0-d one) and floats per row.
#[derive(Clone, Copy)]
struct Shape {
    height: i64,
    width: usize,
}

/// Where every dense parameter's elements and rows lie across the ranks.
pub(super) struct ZeroLayout {
    buckets: Vec<Bucket>,
    /// Per parameter of the engine.
    shapes: Vec<Shape>,
    /// Rows that cross a shard's edge, as (bucket, position in it, row), each once.
    straddlers: Vec<(usize, usize, i64)>,
    /// See [`ZeroLayout::elements`].
    elements: Vec<Option<Range<i64>>>,
    /// Per parameter: its bucket and where it starts in the bucket's buffer (`None`: in none).
    place: Vec<Option<(usize, usize)>>,
    /// Stage 2: per bucket, this rank's shard of the reduced gradients (written by
    /// [`ZeroLayout::reduce_bucket`], maybe on the communication thread, read by the update
    /// once it has joined; the lock makes the layout shareable with that thread, it is never
    /// contended); `None` under stage 1.
    grad_shards: Option<Mutex<Vec<Tensor>>>,
    /// Stage 3: per bucket, this rank's shard of the parameters' values, the only copy kept
    /// between uses (the update writes it; [`ZeroLayout::gather_bucket`] makes the whole
    /// values from every rank's); `None` under stages 1 and 2.
    param_shards: Option<Mutex<Vec<Tensor>>>,
    rank: usize,
}

mod ffi {
    use std::ffi::c_char;

    extern "C" {
        /// See `csrc/grad_hooks.cpp`: `param.grad = None`; null or an error for
        /// [`crate::shim::take_error`].
        pub fn gptrec_release_grad(tensor: *const torch_sys::C_tensor) -> *mut c_char;
    }
}

impl ZeroLayout {
    /// The layout of `buckets` (indices into `params`, every rank the same) over `comm`'s
    /// ranks, from the backend's partition ([`Collective::shards_of`]), for ZeRO `stage` (1 or
    /// 2: with its gradient shard buffers, zeroed, on the parameters' device).
    pub(super) fn new(
        comm: &dyn Collective,
        params: &[Tensor],
        buckets: &[Vec<usize>],
        stage: u8,
    ) -> Result<ZeroLayout, DdpError> {
        let shapes: Vec<Shape> = params.iter().map(shape_of).collect();
        let lens: Vec<usize> = (buckets.iter())
            .map(|b| b.iter().map(|&i| params[i].numel()).sum())
            .collect();
        let mut layout = ZeroLayout {
            buckets: Vec::with_capacity(buckets.len()),
            shapes,
            straddlers: Vec::new(),
            elements: Vec::new(),
            place: vec![None; params.len()],
            grad_shards: None,
            param_shards: None,
            rank: comm.rank(),
        };
        for (members, len) in buckets.iter().zip(lens) {
            let shards = comm.shards_of(len);
            let offsets = (members.iter())
                .scan(0, |at, &i| {
                    let start = *at;
                    *at += params[i].numel();
                    Some(start)
                })
                .collect();
            layout.buckets.push(Bucket {
                params: members.clone(),
                offsets,
                len,
                shards,
            });
        }
        layout.straddlers = layout.find_straddlers();
        layout.elements = layout.find_elements();
        for (b, bucket) in layout.buckets.iter().enumerate() {
            for (&i, &at) in bucket.params.iter().zip(&bucket.offsets) {
                layout.place[i] = Some((b, at));
            }
        }
        if stage >= 2 {
            let in_buckets = buckets.iter().flatten().map(|&i| &params[i]);
            if let Some(p) = in_buckets.clone().find(|p| p.kind() != Kind::Float) {
                return Err(DdpError::Internal(format!(
                    "ZeRO stages 2 and 3 keep f32 shards; a parameter of shape {:?} is {:?}",
                    p.size(),
                    p.kind()
                )));
            }
            let device = params.first().map_or(Device::Cpu, Tensor::device);
            let shard = |b: &Bucket| b.shards[layout.rank].len() as i64;
            let shards = || -> Result<Vec<Tensor>, tch::TchError> {
                (layout.buckets.iter())
                    .map(|b| Tensor::f_zeros([shard(b)], (Kind::Float, device)))
                    .collect()
            };
            layout.grad_shards = Some(Mutex::new(shards()?));
            if stage >= 3 {
                layout.param_shards = Some(Mutex::new(shards()?));
            }
        }
        Ok(layout)
    }

    /// The stage this layout serves: 3 with parameter shards, 2 with gradient shards, else 1.
    pub(super) fn stage(&self) -> u8 {
        match (&self.param_shards, &self.grad_shards) {
            (Some(_), _) => 3,
            (None, Some(_)) => 2,
            (None, None) => 1,
        }
    }

    /// The bucket parameter `i` is in, if any.
    pub(super) fn bucket_of(&self, i: usize) -> Option<usize> {
        self.place.get(i).copied().flatten().map(|(b, _)| b)
    }

    /// The parameters of bucket `b` (indices into the engine's).
    pub(super) fn members(&self, b: usize) -> &[usize] {
        &self.buckets[b].params
    }

    /// How many buckets there are.
    pub(super) fn bucket_count(&self) -> usize {
        self.buckets.len()
    }

    /// Stage 3: copies this rank's elements of every bucket's whole parameters (the values
    /// every rank has after the broadcast, a checkpoint's load or a gathering) into its
    /// parameter shards, which are the values from then on.
    pub(super) fn take_param_shards(&self, params: &[Tensor]) -> Result<(), DdpError> {
        let Some(shards) = &self.param_shards else {
            return Ok(());
        };
        let shards = shards.lock().unwrap_or_else(PoisonError::into_inner);
        for (b, bucket) in self.buckets.iter().enumerate() {
            let members: Vec<Tensor> = (bucket.params.iter())
                .map(|&i| params[i].shallow_clone())
                .collect();
            self.copy_own_parts(b, &members, &shards[b])?;
        }
        Ok(())
    }

    /// Bucket `b`'s `members` (one tensor per parameter, in bucket order: values or
    /// gradients), over the elements that lie in this rank's shard, into `shard`.
    fn copy_own_parts(&self, b: usize, members: &[Tensor], shard: &Tensor) -> Result<(), DdpError> {
        let bucket = &self.buckets[b];
        let own = &bucket.shards[self.rank];
        for (member, &at) in members.iter().zip(&bucket.offsets) {
            let part = intersect(&(at..at + member.numel()), own);
            if part.is_empty() {
                continue;
            }
            let len = part.len() as i64;
            let from = member
                .f_view([-1])?
                .f_narrow(0, (part.start - at) as i64, len)?;
            shard
                .f_narrow(0, (part.start - own.start) as i64, len)?
                .f_copy_(&from)?;
        }
        Ok(())
    }

    /// Stage 3: bucket `b`'s parameters' whole values (`members`, its parameters in order),
    /// from every rank's shard, into their storage (given memory again where it was released;
    /// see [`super::gate`]).
    pub(super) fn gather_bucket(
        &self,
        comm: &mut dyn Collective,
        b: usize,
        members: &[Tensor],
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        let Some(shards) = &self.param_shards else {
            return Err(DdpError::Internal(
                "a stage 3 gathering without parameter shards".into(),
            ));
        };
        let bucket = &self.buckets[b];
        let own = &bucket.shards[self.rank];
        let shard = shards.lock().unwrap_or_else(PoisonError::into_inner)[b].shallow_clone();
        let mut flat = Tensor::f_empty([bucket.len as i64], (Kind::Float, shard.device()))?;
        flat.f_narrow(0, own.start as i64, own.len() as i64)?
            .f_copy_(&shard)?;
        comm.all_gather_shards(&mut flat, ctx)?;
        for (p, &at) in members.iter().zip(&bucket.offsets) {
            let values = flat.f_narrow(0, at as i64, p.numel() as i64)?;
            super::param_storage::refill(p, &values)?;
        }
        Ok(())
    }

    /// Under stage 3, per parameter, its values over the elements this rank keeps (views of
    /// the parameter shards, for [`crate::optim::AdamW::step_parts`]); empty otherwise.
    pub(super) fn own_values(&self) -> Result<Vec<Option<Tensor>>, DdpError> {
        let Some(shards) = &self.param_shards else {
            return Ok(Vec::new());
        };
        let shards = shards.lock().unwrap_or_else(PoisonError::into_inner);
        (self.elements.iter().enumerate())
            .map(|(i, e)| {
                let (Some(e), Some((b, at))) = (e, self.place[i]) else {
                    return Ok(None);
                };
                if e.is_empty() {
                    return Ok(None);
                }
                let start = at + e.start as usize - self.buckets[b].shards[self.rank].start;
                Ok(Some(shards[b].f_narrow(
                    0,
                    start as i64,
                    e.end - e.start,
                )?))
            })
            .collect()
    }

    /// Whether parameter `i` is in a dense bucket (its gradient is dropped under stage 2).
    pub(super) fn in_bucket(&self, i: usize) -> bool {
        self.place.get(i).is_some_and(Option::is_some)
    }

    /// Parameter `i`'s reduced gradient over its elements `span` (of its values flattened),
    /// which lie in this rank's shard: a view of its gradient, or under stage 2 of the
    /// bucket's shard buffer.
    pub(super) fn grad_span(
        &self,
        params: &[Tensor],
        i: usize,
        span: Range<i64>,
    ) -> Result<Tensor, DdpError> {
        let len = span.end - span.start;
        let Some(shards) = &self.grad_shards else {
            return Ok(params[i]
                .grad()
                .f_view([-1])?
                .f_narrow(0, span.start, len)?);
        };
        let Some((b, at)) = self.place[i] else {
            return Err(DdpError::Internal(
                "a gradient shard of a parameter in no bucket".into(),
            ));
        };
        let start = (at + span.start as usize) - self.buckets[b].shards[self.rank].start;
        let shard = shards.lock().unwrap_or_else(PoisonError::into_inner)[b].shallow_clone();
        Ok(shard.f_narrow(0, start as i64, len)?)
    }

    /// Under stage 2, per parameter, its reduced gradient over the elements this rank keeps
    /// (for [`crate::optim::AdamW::step_with`]); empty under stage 1 (the update reads the gradients).
    pub(super) fn own_grads(&self, params: &[Tensor]) -> Result<Vec<Option<Tensor>>, DdpError> {
        if self.grad_shards.is_none() {
            return Ok(Vec::new());
        }
        (self.elements.iter().enumerate())
            .map(|(i, e)| match e {
                Some(e) if !e.is_empty() => self.grad_span(params, i, e.clone()).map(Some),
                _ => Ok(None),
            })
            .collect()
    }

    /// Per parameter, the elements (of its values flattened) this rank holds: `None` for one
    /// in no bucket (a row-sparse table). Made once, with the layout.
    pub(super) fn elements(&self) -> &[Option<Range<i64>>] {
        &self.elements
    }

    fn find_elements(&self) -> Vec<Option<Range<i64>>> {
        let mut out = vec![None; self.shapes.len()];
        for b in &self.buckets {
            for (&i, &at) in b.params.iter().zip(&b.offsets) {
                let span = at..at + self.numel(i);
                let own = intersect(&span, &b.shards[self.rank]);
                out[i] = Some(match own.is_empty() {
                    true => 0..0,
                    false => (own.start - at) as i64..(own.end - at) as i64,
                });
            }
        }
        out
    }

    fn numel(&self, i: usize) -> usize {
        self.shapes[i].height.max(0) as usize * self.shapes[i].width
    }

    /// The rows of parameter `i` (at `at` in its bucket) that start in `shard`.
    fn rows_starting_in(&self, i: usize, at: usize, shard: &Range<usize>) -> Range<i64> {
        let Shape { height, width } = self.shapes[i];
        if width == 0 {
            return 0..0;
        }
        let first_at_or_after = |x: usize| (x.saturating_sub(at)).div_ceil(width) as i64;
        first_at_or_after(shard.start).min(height)..first_at_or_after(shard.end).min(height)
    }

    /// Each row that starts in one rank's shard and ends beyond it.
    fn find_straddlers(&self) -> Vec<(usize, usize, i64)> {
        let mut out = Vec::new();
        for (b, bucket) in self.buckets.iter().enumerate() {
            for (pos, (&i, &at)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
                for shard in &bucket.shards {
                    let rows = self.rows_starting_in(i, at, shard);
                    let end_of_last = at + rows.end as usize * self.shapes[i].width;
                    if !rows.is_empty() && end_of_last > shard.end {
                        out.push((b, pos, rows.end - 1));
                    }
                }
            }
        }
        out
    }

    /// The span of straddler `s` in its bucket's flat buffer.
    fn straddler_span(&self, (b, pos, row): (usize, usize, i64)) -> Range<usize> {
        let bucket = &self.buckets[b];
        let width = self.shapes[bucket.params[pos]].width;
        let start = bucket.offsets[pos] + row as usize * width;
        start..start + width
    }

    /// Reduce-scatters (averages) each bucket's gradients (see [`ZeroLayout::reduce_bucket`]).
    pub(super) fn reduce_scatter(
        &self,
        comm: &mut dyn Collective,
        params: &[Tensor],
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        for (b, bucket) in self.buckets.iter().enumerate() {
            let members: Vec<Tensor> = bucket
                .params
                .iter()
                .map(|&i| params[i].shallow_clone())
                .collect();
            self.reduce_bucket(comm, b, &members, ctx)?;
        }
        Ok(())
    }

    /// Reduce-scatters (averages) the gradients of bucket `b`'s parameters `members` and writes
    /// this rank's shard back into them (the rest is left unreduced and unused), or under stage
    /// 2 into its shard buffer, dropping the gradients: after backward, or from the
    /// communication thread during it.
    pub(super) fn reduce_bucket(
        &self,
        comm: &mut dyn Collective,
        b: usize,
        members: &[Tensor],
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        let bucket = &self.buckets[b];
        let mut grads = match self.grad_shards {
            Some(_) => made_whole(members)?,
            None => members.iter().map(Tensor::grad).collect(),
        };
        if grads.len() > 1 && !comm.reduce_scatter_is_native() {
            // The backend's reduce-scatter would be a whole all-reduce of a copy: reduce the
            // gradients as DDP does (every shard then holds its sums).
            comm.all_reduce(&mut grads, ReduceOp::Avg, ctx)?;
            return self.keep_shard(b, members, &grads, None);
        }
        let (mut flat, in_place) = flat_of(&grads)?;
        let own = comm.reduce_scatter(&mut flat, ReduceOp::Avg, ctx)?;
        if own != bucket.shards[self.rank] {
            return Err(layout_changed(&own, &bucket.shards[self.rank]));
        }
        if self.grad_shards.is_some() {
            return self.keep_shard(b, members, &grads, Some(&flat));
        }
        if in_place {
            return Ok(());
        }
        for (grad, &at) in grads.iter().zip(&bucket.offsets) {
            let span = at..at + grad.numel();
            let part = intersect(&span, &own);
            if !part.is_empty() {
                let len = part.len() as i64;
                grad.f_view([-1])?
                    .f_narrow(0, (part.start - at) as i64, len)?
                    .f_copy_(&flat.f_narrow(0, part.start as i64, len)?)?;
            }
        }
        Ok(())
    }

    /// Stage 2 (nothing otherwise): bucket `b`'s reduced shard into its buffer, from the
    /// reduce-scattered `flat` or else from the reduced `grads`, its zeros made positive; then
    /// the `members`' gradients dropped.
    fn keep_shard(
        &self,
        b: usize,
        members: &[Tensor],
        grads: &[Tensor],
        flat: Option<&Tensor>,
    ) -> Result<(), DdpError> {
        let Some(shards) = &self.grad_shards else {
            return Ok(());
        };
        let shard = shards.lock().unwrap_or_else(PoisonError::into_inner)[b].shallow_clone();
        let (bucket, shard) = (&self.buckets[b], &shard);
        let own = &bucket.shards[self.rank];
        match flat {
            Some(flat) => {
                let own = flat.f_narrow(0, own.start as i64, own.len() as i64)?;
                shard.shallow_clone().f_copy_(&own)?;
            }
            None => self.copy_own_parts(b, grads, shard)?,
        }
        // -0.0 + 0.0 = 0.0: DDP's gradients start from zeros, ours (dropped) do not.
        let _ = shard.shallow_clone().f_add_scalar_(0.0)?;
        members.iter().try_for_each(drop_grad)
    }

    /// Stage 2: drops the gradient of every parameter in a bucket (before a step: autograd
    /// makes them in backward, and the shards are what the update reads).
    pub(super) fn drop_bucket_grads(&self, params: &[Tensor]) -> Result<(), DdpError> {
        (self.buckets.iter())
            .flat_map(|b| &b.params)
            .try_for_each(|&i| drop_grad(&params[i]))
    }

    /// Every straddling row whole, in `straddlers` order, on every rank: each rank gives its
    /// part, zeros elsewhere, and a sum (exact: x + 0 = x) joins them. `None` when there are
    /// none (the same on every rank).
    fn straddling_rows(
        &self,
        comm: &mut dyn Collective,
        params: &[Tensor],
        ctx: OpContext,
    ) -> Result<Option<Tensor>, DdpError> {
        let total: usize = (self.straddlers.iter())
            .map(|&s| self.straddler_span(s).len())
            .sum();
        if total == 0 {
            return Ok(None);
        }
        let device = params.first().map_or(Device::Cpu, Tensor::device);
        let whole = Tensor::f_zeros([total as i64], (Kind::Float, device))?;
        let mut at = 0;
        for &s in &self.straddlers {
            let (b, pos, _) = s;
            let bucket = &self.buckets[b];
            let span = self.straddler_span(s);
            let part = intersect(&span, &bucket.shards[self.rank]);
            if !part.is_empty() {
                let from = (part.start - bucket.offsets[pos]) as i64;
                let len = part.len() as i64;
                let grad = self.grad_span(params, bucket.params[pos], from..from + len)?;
                whole
                    .f_narrow(0, (at + part.start - span.start) as i64, len)?
                    .f_copy_(&grad)?;
            }
            at += span.len();
        }
        let mut whole = [whole];
        comm.all_reduce(&mut whole, ReduceOp::Sum, ctx)?;
        let [whole] = whole;
        Ok(Some(whole))
    }

    /// The sums of squares of the rows of `shard` of bucket `b` that start there, in
    /// (parameter, row) order: `straddling` holds the whole straddlers.
    fn own_row_sums(
        &self,
        params: &[Tensor],
        straddling: Option<&Tensor>,
    ) -> Result<Vec<f64>, DdpError> {
        // On a device the sums stay there until one read at the end (a read per parameter
        // would be a host wait per parameter).
        let on_host = (params.first()).is_none_or(|p| p.device() == Device::Cpu);
        let mut sums = RowSumsOf {
            on_host,
            host: Vec::new(),
            device: Vec::new(),
        };
        for (b, bucket) in self.buckets.iter().enumerate() {
            let shard = &bucket.shards[self.rank];
            for (pos, (&i, &at)) in bucket.params.iter().zip(&bucket.offsets).enumerate() {
                let rows = self.rows_starting_in(i, at, shard);
                let width = self.shapes[i].width;
                let crosses = !rows.is_empty() && at + rows.end as usize * width > shard.end;
                let inside = rows.start..rows.end - i64::from(crosses);
                // The rows' values alone (row sums of no row, or of empty rows, read nothing).
                let w = width as i64;
                let values = match inside.is_empty() || w == 0 {
                    true => Tensor::f_zeros([0], (Kind::Float, params[i].device()))?,
                    false => self.grad_span(params, i, inside.start * w..inside.end * w)?,
                };
                sums.add(&values, width, 0..inside.end - inside.start)?;
                if crosses {
                    let s = (b, pos, rows.end - 1);
                    let k = self.straddlers.iter().position(|&x| x == s);
                    let (Some(k), Some(whole)) = (k, straddling) else {
                        return Err(DdpError::Internal(
                            "a row crossing a shard's edge was not exchanged".into(),
                        ));
                    };
                    let at: usize = (self.straddlers[..k].iter())
                        .map(|&x| self.straddler_span(x).len())
                        .sum();
                    let row = whole.f_narrow(0, at as i64, width as i64)?;
                    sums.add(&row, width, 0..1)?;
                }
            }
        }
        sums.read()
    }

    /// Every dense parameter's row sums (`None` for the others), from every rank's own ones
    /// (one all-gather, padded to the longest).
    pub(super) fn all_row_sums(
        &self,
        comm: &mut dyn Collective,
        params: &[Tensor],
        ctx: OpContext,
    ) -> Result<Vec<Option<Vec<f64>>>, DdpError> {
        let straddling = self.straddling_rows(comm, params, ctx)?;
        let mut mine = self.own_row_sums(params, straddling.as_ref())?;
        let counts: Vec<usize> = (0..self.world())
            .map(|k| self.rows_of_rank(k).map(|(_, _, r)| count(&r)).sum())
            .collect();
        let longest = counts.iter().copied().max().unwrap_or(0);
        // Per dense parameter, its rows' sums as (first row, sums) pieces, one per rank.
        let mut pieces: Vec<Option<Vec<RowSums>>> = vec![None; self.shapes.len()];
        for b in &self.buckets {
            for &i in &b.params {
                pieces[i] = Some(Vec::new());
            }
        }
        if longest > 0 {
            mine.resize(longest, 0.0);
            let device = params.first().map_or(Device::Cpu, Tensor::device);
            let sent = Tensor::from_slice(&mine).f_to_device(device)?;
            let all = comm.all_gather(&sent, ctx)?;
            // One read of every rank's sums.
            let all = Tensor::f_cat(&all, 0)?.f_to_device(Device::Cpu)?;
            let all = Vec::<f64>::try_from(all)?;
            for (k, theirs) in all.chunks(longest).enumerate() {
                let mut at = 0;
                for (i, _, rows) in self.rows_of_rank(k) {
                    let sums = theirs[at..at + count(&rows)].to_vec();
                    if let Some(p) = pieces[i].as_mut() {
                        p.push((rows.start, sums));
                    }
                    at += count(&rows);
                }
            }
        }
        // Ranks need not hold the shards in rank order (the ring's rank r holds chunk r + 1).
        Ok(pieces
            .into_iter()
            .map(|p| {
                p.map(|mut p| {
                    p.sort_by_key(|(first, _)| *first);
                    p.into_iter().flat_map(|(_, sums)| sums).collect()
                })
            })
            .collect())
    }

    /// (parameter, bucket, rows) rank `k` starts, in the order its row sums travel.
    fn rows_of_rank(&self, k: usize) -> impl Iterator<Item = (usize, usize, Range<i64>)> + '_ {
        self.buckets
            .iter()
            .enumerate()
            .flat_map(move |(b, bucket)| {
                (bucket.params.iter().zip(&bucket.offsets))
                    .map(move |(&i, &at)| (i, b, self.rows_starting_in(i, at, &bucket.shards[k])))
            })
    }

    fn world(&self) -> usize {
        self.buckets.first().map_or(1, |b| b.shards.len())
    }

    /// Overwrites every rank's parameters with each shard's owner's (after the update).
    pub(super) fn all_gather_params(
        &self,
        comm: &mut dyn Collective,
        params: &[Tensor],
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        for b in &self.buckets {
            let mut members: Vec<Tensor> = b
                .params
                .iter()
                .map(|&i| params[i].shallow_clone())
                .collect();
            let (mut flat, in_place) = flat_of(&members)?;
            comm.all_gather_shards(&mut flat, ctx)?;
            if !in_place {
                unflatten_into(&flat, &mut members)?;
            }
        }
        Ok(())
    }

    /// The optimizer's moments whole (its own shard from each rank), in `state`'s layout
    /// (`exp_avg.{i}`, `exp_avg_sq.{i}` at `2i`, `2i + 1`), on rank 0 only: the others take
    /// part in the gathering, one bucket at a time, and keep their shards (whole moments on
    /// every rank would undo stage 1's saving at each checkpoint).
    pub(super) fn gather_moments(
        &self,
        comm: &mut dyn Collective,
        params: &[Tensor],
        state: &mut [(String, Tensor)],
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        for b in &self.buckets {
            let device = b
                .params
                .first()
                .map_or(Device::Cpu, |&i| params[i].device());
            for moment in 0..2 {
                let mut flat = Tensor::f_zeros([b.len as i64], (Kind::Float, device))?;
                for (&i, &at) in b.params.iter().zip(&b.offsets) {
                    let own = intersect(&(at..at + self.numel(i)), &b.shards[self.rank]);
                    let piece = &state[2 * i + moment].1;
                    if !own.is_empty() {
                        flat.f_narrow(0, own.start as i64, own.len() as i64)?
                            .f_copy_(piece)?;
                    }
                }
                comm.all_gather_shards(&mut flat, ctx)?;
                if self.rank != 0 {
                    continue;
                }
                for (&i, &at) in b.params.iter().zip(&b.offsets) {
                    let p = &params[i];
                    let whole = flat
                        .f_narrow(0, at as i64, p.numel() as i64)?
                        .f_view(p.size().as_slice())?
                        .f_to_kind(p.kind())?
                        .f_to_device(Device::Cpu)?
                        .f_contiguous()?;
                    state[2 * i + moment].1 = whole.copy();
                }
            }
        }
        Ok(())
    }
}

/// `p.grad = None`: its memory goes once nothing else refers to it.
fn drop_grad(p: &Tensor) -> Result<(), DdpError> {
    // SAFETY: `p` is a live tch tensor; the shim only resets its autograd metadata's gradient,
    // which autograd is done with (its bucket's hooks have all run, or no backward runs).
    take_error(unsafe { ffi::gptrec_release_grad(p.as_ptr()) })
        .map_err(|e| DdpError::Internal(format!("could not drop a gradient (ZeRO stage 2): {e}")))
}

/// Stage 2's gradients of `members` to reduce: each as autograd left it, a dense zero one
/// where this rank's batches did not reach the parameter (DDP's zeroed gradient) and a dense
/// copy of a sparse one.
fn made_whole(members: &[Tensor]) -> Result<Vec<Tensor>, tch::TchError> {
    members
        .iter()
        .map(|p| {
            let grad = p.grad();
            match (grad.defined(), grad.defined() && grad.is_sparse()) {
                (false, _) => p.f_zeros_like(),
                (true, true) => grad.f_to_dense(None, false),
                (true, false) => Ok(grad),
            }
        })
        .collect()
}

/// A bucket's tensors as one flat f32 buffer: the tensor itself, flattened, when it is the only
/// one and already such a buffer (true: nothing to copy back; a large parameter has a bucket
/// of its own, so this spares two copies of the largest ones), else a copy.
fn flat_of(tensors: &[Tensor]) -> Result<(Tensor, bool), tch::TchError> {
    if let [t] = tensors {
        if t.kind() == Kind::Float && t.is_contiguous() {
            return Ok((t.f_view([-1])?, true));
        }
    }
    let device = tensors.first().map_or(Device::Cpu, Tensor::device);
    Ok((flatten_f32(tensors, device)?, false))
}

/// Rows of the first dimension (1 for a 0-d tensor, as clipping counts them) and their width.
fn shape_of(t: &Tensor) -> Shape {
    let n = t.numel();
    let height = if t.dim() == 0 { 1 } else { t.size()[0] };
    let width = if height > 0 { n / height as usize } else { 0 };
    Shape { height, width }
}

/// Rows in `r`.
fn count(r: &Range<i64>) -> usize {
    (r.end - r.start).max(0) as usize
}

fn intersect(a: &Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

fn layout_changed(got: &Range<usize>, expected: &Range<usize>) -> DdpError {
    DdpError::Internal(format!(
        "the backend's shard moved from {expected:?} to {got:?} since the ZeRO layout was made"
    ))
}
