//! The ring's two halves (reduce-scatter, all-gather) over the neighbours' connections: the
//! all-reduce is both, the sharded operations one each. Owns the chunking of a buffer among the
//! ranks; must not decide which path an operation takes (the communicator does).

use std::ops::Range;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::{as_bytes_mut, split_send_recv, Sink, TcpCollective};
use crate::collective::{even_shard, CollectiveError, OpContext, ReduceOp};

impl TcpCollective {
    /// Ring all-reduce (sum) of `buf` in place: its reduce-scatter, then its all-gather.
    pub(super) fn ring_all_reduce(
        &mut self,
        buf: &mut [f32],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.ring_pass(buf, 0, true, ("all_reduce", ctx, deadline))?;
        self.ring_pass(buf, 1, false, ("all_reduce", ctx, deadline))
    }

    /// Chunk `i` of a ring buffer of `n` elements (the ring's own split).
    pub(super) fn ring_chunk(&self, i: usize, n: usize) -> (usize, usize) {
        let r = even_shard(n, self.world, i % self.world);
        (r.start, r.end)
    }

    /// The ring's reduce-scatter of `flat` (which [`TcpCollective::ring_shards`] accepted):
    /// after W-1 steps chunk (r+1) % W holds the full sum, this rank's shard
    /// ([`crate::collective::Collective::shard_of`]), averaged there for `op` Avg.
    pub(super) fn ring_reduce_scatter(
        &mut self,
        flat: &mut Tensor,
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<Range<usize>, CollectiveError> {
        let n = flat.numel();
        // SAFETY: `ring_shards` found it a contiguous f32 CPU tensor.
        let buf = unsafe { f32_slice(flat) };
        let deadline = Instant::now() + ctx.timeout;
        self.handshake("reduce_scatter", 4, n as u64, ctx, deadline)?;
        self.ring_pass(buf, 0, true, ("reduce_scatter", ctx, deadline))?;
        let (start, end) = self.ring_chunk(self.rank + 1, n);
        self.average_if(op, &mut buf[start..end]);
        Ok(start..end)
    }

    /// The ring's all-gather of `flat` (accepted by [`TcpCollective::ring_shards`]): passes
    /// each rank's finished chunk ((r+1) % W) around.
    pub(super) fn ring_all_gather(
        &mut self,
        flat: &mut Tensor,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let n = flat.numel() as u64;
        // SAFETY: `ring_shards` found it a contiguous f32 CPU tensor.
        let buf = unsafe { f32_slice(flat) };
        let deadline = Instant::now() + ctx.timeout;
        self.handshake("all_gather_shards", 5, n, ctx, deadline)?;
        self.ring_pass(buf, 1, false, ("all_gather_shards", ctx, deadline))
    }

    /// W-1 steps around the ring: at step s this rank sends chunk r + `first` - s and receives
    /// the one before it, added to its own (`add`) or copied over it.
    fn ring_pass(
        &mut self,
        buf: &mut [f32],
        first: usize,
        add: bool,
        (op, ctx, deadline): (&'static str, OpContext, Instant),
    ) -> Result<(), CollectiveError> {
        let (w, r, n) = (self.world, self.rank, buf.len());
        for s in 0..w - 1 {
            let send = self.ring_chunk(r + first + w - s, n);
            let recv = self.ring_chunk(r + first + 2 * w - s - 1, n);
            let (send_bytes, sink) = split_send_recv(buf, send, recv);
            let sink = match add {
                true => Sink::Add(sink),
                false => Sink::Copy(as_bytes_mut(sink)),
            };
            self.transfer(send_bytes, sink, op, ctx, deadline)?;
        }
        Ok(())
    }

    /// Whether the ring alone carries this job's sums (no shared memory, no leader ring): where
    /// the sharded operations are the ring's own halves. Elsewhere they are the trait's
    /// defaults (whole all-reduces), which agree with `all_reduce` bit for bit too.
    pub(super) fn ring_only(&self) -> bool {
        self.shm.is_none() && self.hosts.is_none()
    }

    /// Whether the ring shards `flat` itself (a non-empty contiguous 1-d f32 CPU tensor, the
    /// ring alone, more than one rank); elsewhere the trait's default applies.
    pub(super) fn ring_shards(&self, flat: &Tensor) -> bool {
        self.world > 1
            && self.ring_only()
            && flat.device() == Device::Cpu
            && flat.kind() == Kind::Float
            && flat.is_contiguous()
            && flat.dim() == 1
            && flat.numel() > 0
    }
}

/// A contiguous f32 CPU tensor's elements, for as long as the tensor is borrowed.
///
/// # Safety
/// `flat` must be a contiguous f32 CPU tensor ([`TcpCollective::ring_shards`] and
/// [`TcpCollective::shm_shards`] check it).
pub(super) unsafe fn f32_slice(flat: &mut Tensor) -> &mut [f32] {
    let n = flat.numel();
    std::slice::from_raw_parts_mut(flat.data_ptr() as *mut f32, n)
}
