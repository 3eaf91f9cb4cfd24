//! The reduce-scatter of the `tcp` backend through shared memory, for a job on one host
//! ([`crate::collective::shm::ShmGroup::reduce_scatter`]): each rank's shard ends holding what
//! the shared-memory all-reduce would have put there, bit for bit, and with
//! [`TcpCollective::shm_all_gather_shards`] after it a rank moves what one all-reduce moves,
//! where a whole all-reduce and a gathering moved half as much again. Across hosts the trait's
//! default (a whole all-reduce) applies.

use std::ops::Range;
use std::time::Instant;

use tch::Tensor;

use super::TcpCollective;
use crate::collective::{Collective, CollectiveError, OpContext, ReduceOp};

impl TcpCollective {
    /// [`Collective::reduce_scatter`] through shared memory, when `shm_shards` accepted
    /// `flat`.
    pub(super) fn shm_reduce_scatter(
        &mut self,
        flat: &mut Tensor,
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<Range<usize>, CollectiveError> {
        let n = flat.numel();
        let shards = self.shards_of(n);
        let own = shards[self.rank].clone();
        let (seq, deadline) = (self.seq + 1, Instant::now() + ctx.timeout);
        // SAFETY: `shm_shards` found it a contiguous f32 CPU tensor.
        let data = unsafe { super::ring::f32_slice(flat) };
        let done = match self.whole_job_shm() {
            Some(shm) => shm.reduce_scatter(data, &shards, seq, deadline),
            None => return crate::collective::reduce_scatter_by_all_reduce(self, flat, op, ctx),
        };
        self.seq = seq;
        self.sent += ((n - own.len()) * 4) as u64;
        done.map_err(|f| self.shm_op_error("reduce_scatter", f, ctx, n))?;
        self.average_if(op, &mut data[own.clone()]);
        Ok(own)
    }
}
