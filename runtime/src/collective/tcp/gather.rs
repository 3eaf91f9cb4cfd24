//! The all-gathers of the `tcp` backend: of whole tensors (through shared memory when the job is
//! on one host, else around the socket ring), and of a flat buffer's shards
//! ([`crate::collective::Collective::all_gather_shards`]) straight into the buffer through shared
//! memory, where the ring's own halves do not apply.

use std::ops::Range;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use super::{bytes_of, Sink, TcpCollective};
use crate::collective::shm::{copy_own, Bytes};
use crate::collective::{Collective, CollectiveError, OpContext};

impl TcpCollective {
    /// All-gather of the contiguous CPU tensor `mine` into `out` (contiguous CPU tensors like
    /// it, one per rank), through shared memory when the job is on one host.
    pub(super) fn gather_staged(
        &mut self,
        mine: &Tensor,
        out: &mut [Tensor],
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        // SAFETY: `mine` and `out` outlive these views; nothing else touches them meanwhile.
        let (mine_bytes, parts): (Bytes, Vec<Bytes>) =
            unsafe { (bytes_of(mine), out.iter().map(|t| bytes_of(t)).collect()) };
        self.gather_bytes(mine_bytes, &parts, ctx)
    }

    /// All-gather of `mine` into `parts` (one per rank, each as long as `mine`; ours may be
    /// `mine` itself), through shared memory when the job is on one host.
    fn gather_bytes(
        &mut self,
        mine_bytes: Bytes,
        parts: &[Bytes],
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if self.world == 1 {
            copy_own(mine_bytes, parts[0], false);
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        let seq = self.seq + 1;
        let gathered = self
            .whole_job_shm()
            .map(|shm| shm.all_gather(mine_bytes, parts, seq, deadline));
        match gathered {
            Some(done) => {
                self.seq = seq;
                self.sent += mine_bytes.len as u64;
                done.map_err(|f| self.shm_op_error("all_gather", f, ctx, mine_bytes.len))
            }
            None => self.socket_all_gather(mine_bytes, parts, ctx, deadline),
        }
    }

    /// Ring all-gather: `mine` into `parts[rank]`, then each rank passes the part it received
    /// last to the next one, W - 1 times, until every part is filled.
    fn socket_all_gather(
        &mut self,
        mine: Bytes,
        parts: &[Bytes],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.handshake("all_gather", 3, mine.len as u64, ctx, deadline)?;
        let (w, r) = (self.world, self.rank);
        copy_own(mine, parts[r], false);
        // SAFETY: every part is `mine.len` bytes and ours alone during the operation (see
        // Bytes); the part sent and the part received differ at every step.
        unsafe {
            for s in 0..w - 1 {
                let (send, recv) = (parts[(r + w - s) % w], parts[(r + 2 * w - s - 1) % w]);
                let send = std::slice::from_raw_parts(send.ptr as *const u8, send.len);
                let recv = std::slice::from_raw_parts_mut(recv.ptr, recv.len);
                self.transfer(send, Sink::Copy(recv), "all_gather", ctx, deadline)?;
            }
        }
        Ok(())
    }

    /// Whether the shards of `flat` (a non-empty contiguous 1-d f32 CPU tensor, more than one
    /// rank) are gathered through the shared memory of a job on one host.
    pub(super) fn shm_shards(&self, flat: &Tensor) -> bool {
        self.world > 1
            && self.shm.is_some()
            && self.hosts.is_none()
            && flat.device() == Device::Cpu
            && flat.kind() == Kind::Float
            && flat.is_contiguous()
            && flat.dim() == 1
            && flat.numel() > 0
    }

    /// [`Collective::all_gather_shards`] through shared memory (`shm_shards` accepted `flat`):
    /// every rank's shard copied from its buffer straight to its place in `flat`, without
    /// staging copies. Shards differ in length by at most one element ([`super::even_shard`]'s
    /// split): the common length goes in one operation, the few elements past it in a second,
    /// small one.
    pub(super) fn shm_all_gather_shards(
        &mut self,
        flat: &mut Tensor,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let shards = self.shards_of(flat.numel());
        let common = shards.iter().map(Range::len).min().unwrap_or(0);
        let longest = shards.iter().map(Range::len).max().unwrap_or(0);
        if common > 0 {
            let base = flat.data_ptr() as *mut u8;
            let parts: Vec<Bytes> = shards
                .iter()
                .map(|s| Bytes {
                    // SAFETY: `s` lies within `flat` (the backend's partition of its elements).
                    ptr: unsafe { base.add(s.start * 4) },
                    len: common * 4,
                })
                .collect();
            // SAFETY: the parts are disjoint pieces of `flat`, which the caller lends us
            // (mutably) for the operation; ours is `mine` itself, so it is not copied.
            self.gather_bytes(parts[self.rank], &parts, ctx)?;
        }
        if longest > common {
            let own = &shards[self.rank];
            let tail = |s: &Range<usize>| (s.start + common) as i64..s.end as i64;
            let mine = Tensor::f_zeros([(longest - common) as i64], (Kind::Float, Device::Cpu))?;
            let t = tail(own);
            mine.f_narrow(0, 0, t.end - t.start)?
                .f_copy_(&flat.f_narrow(0, t.start, t.end - t.start)?)?;
            for (k, theirs) in self.all_gather(&mine, ctx)?.iter().enumerate() {
                let t = tail(&shards[k]);
                if k != self.rank && t.end > t.start {
                    flat.f_narrow(0, t.start, t.end - t.start)?
                        .f_copy_(&theirs.f_narrow(0, 0, t.end - t.start)?)?;
                }
            }
        }
        Ok(())
    }
}
