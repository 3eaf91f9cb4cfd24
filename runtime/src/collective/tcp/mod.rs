//! The `tcp` backend: CPU tensors over persistent TCP connections arranged in a ring (each rank
//! sends to `rank + 1` and receives from `rank - 1`). All-reduce is the bandwidth-optimal ring:
//! reduce-scatter then all-gather, `2 (W-1)/W` of the buffer on the wire per rank, with a sender
//! thread so that sending, receiving and reducing overlap. Addresses are exchanged through the
//! rendezvous store, which also serves to find out who is silent when an operation times out.
//! A ring connection must prove it belongs to the run: rank 0 draws a secret and publishes it in
//! the store (which only admits the run's own ranks), every rank publishes a nonce with its
//! address, and the greeting carries SHA-256(secret, nonce, ranks); anything else is dropped.
//! It must not be used for CUDA tensors in production (they are copied through the host).

use std::net::TcpStream;
use std::time::Instant;

use tch::{Device, Kind, Tensor};

use link::{exchange, read_exact_until, write_all_until};

use super::shm::{Bytes, ShmFailure, ShmGroup};
use super::{
    flatten_f32, flatten_into, unflatten_into, Collective, CollectiveError, HostShared, OpContext,
    ReduceOp,
};
use crate::store::StoreClient;

/// Bytes received and reduced at a time.
const PIECE_BYTES: usize = 1 << 20;
const HEADER_MAGIC: u32 = 0x5249_4e47; // "RING"

/// How the `tcp` backend may move data besides its socket ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpOptions {
    /// All-reduce through shared memory when every rank runs on this host (`[dist]
    /// shared_memory`). Default: true.
    pub shared_memory: bool,
}

impl Default for TcpOptions {
    fn default() -> Self {
        TcpOptions {
            shared_memory: true,
        }
    }
}

/// The ring communicator of one rank.
pub struct TcpCollective {
    /// Our position in the ring (the global rank, except in a leader ring).
    rank: usize,
    /// Ring length.
    world: usize,
    /// The global rank at each ring position: `0..world` for the job's ring, the nodes'
    /// leaders for a leader ring. Errors name these.
    ring_ranks: Vec<usize>,
    /// Store key prefix of the ring's set-up (`tcp`, `tcp/leaders`).
    scope: &'static str,
    /// Connection to `rank + 1` (we write), and from `rank - 1` (we read). None when world is 1.
    links: Option<(TcpStream, TcpStream)>,
    /// Every rank's segment, when all ranks share this host and shared memory could be had:
    /// all-reduces (and barriers) go through it instead of the ring. With several hosts, the
    /// segments of this host's ranks (see `hosts`).
    shm: Option<ShmGroup>,
    /// Several hosts, several ranks each, shared memory in every host: all-reduce is
    /// hierarchical (sum inside the host through `shm`, ring between hosts, back through `shm`).
    hosts: Option<Hosts>,
    store: StoreClient,
    /// Operations issued so far; identical on every rank when they call the same operations.
    seq: u64,
    scratch: Vec<f32>,
    /// Bytes this rank has handed to the others: written to its socket, or put into shared
    /// memory for them to read ([`Collective::bytes_sent`]).
    sent: u64,
}

/// This rank's part in the ring between hosts.
enum Hosts {
    /// Local rank 0: a member of the ring of every host's leader.
    Leader(Box<TcpCollective>),
    /// Another local rank: the leader speaks for this host.
    Member,
}

/// Which ring to set up: our position, the global rank at each position, the store scope.
struct RingSpec {
    pos: usize,
    ranks: Vec<usize>,
    scope: &'static str,
}

/// Why a transfer failed, before it is turned into a [`CollectiveError`].
enum LinkFailure {
    Timeout,
    Send(std::io::Error),
    Recv(std::io::Error),
}

/// What to do with received bytes.
enum Sink<'a> {
    Copy(&'a mut [u8]),
    Add(&'a mut [f32]),
}

impl TcpCollective {
    /// Whether all-reduces go through shared memory (rather than the socket ring only).
    pub fn uses_shared_memory(&self) -> bool {
        self.shm.is_some()
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.world
    }

    fn prev(&self) -> usize {
        (self.rank + self.world - 1) % self.world
    }

    /// The global rank at ring position `pos`.
    fn global(&self, pos: usize) -> usize {
        self.ring_ranks[pos]
    }

    /// Checks that the previous rank is running the same operation on the same amount of data.
    fn handshake(
        &mut self,
        op: &'static str,
        code: u8,
        len: u64,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.seq += 1;
        let mut header = [0u8; 24];
        header[..4].copy_from_slice(&HEADER_MAGIC.to_le_bytes());
        header[4] = code;
        header[8..16].copy_from_slice(&self.seq.to_le_bytes());
        header[16..24].copy_from_slice(&len.to_le_bytes());
        let mut theirs = [0u8; 24];
        self.transfer(&header, Sink::Copy(&mut theirs), op, ctx, deadline)?;
        if theirs != header {
            let their_seq = u64::from_le_bytes(theirs[8..16].try_into().unwrap_or_default());
            let their_len = u64::from_le_bytes(theirs[16..24].try_into().unwrap_or_default());
            return Err(CollectiveError::Mismatch {
                op,
                step: ctx.step,
                detail: format!(
                    "rank {} is at operation #{their_seq} ({}, {their_len} elements) while rank {} is at #{} ({op}, {len} elements)",
                    self.global(self.prev()),
                    op_name(theirs[4]),
                    self.global(self.rank),
                    self.seq
                ),
            });
        }
        Ok(())
    }

    /// Sends `send` to the next rank while receiving as many bytes as the sink holds from the
    /// previous one.
    fn transfer(
        &mut self,
        send: &[u8],
        sink: Sink<'_>,
        op: &'static str,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let Some((to_next, from_prev)) = self.links.as_mut() else {
            return Ok(());
        };
        self.sent += send.len() as u64;
        match exchange(to_next, from_prev, send, sink, &mut self.scratch, deadline) {
            Ok(()) => Ok(()),
            Err(LinkFailure::Timeout) => Err(self.timeout_error(op, ctx)),
            Err(LinkFailure::Send(source)) => Err(CollectiveError::Peer {
                op,
                step: ctx.step,
                peer: self.global(self.next()),
                source,
            }),
            Err(LinkFailure::Recv(source)) => Err(CollectiveError::Peer {
                op,
                step: ctx.step,
                peer: self.global(self.prev()),
                source,
            }),
        }
    }

    fn timeout_error(&mut self, op: &'static str, ctx: OpContext) -> CollectiveError {
        let (upstream, scope) = (self.prev(), format!("{}/stall", self.scope));
        let who = super::silent_ranks(
            &mut self.store,
            &scope,
            self.seq,
            self.rank,
            &self.ring_ranks,
            Some(upstream),
        );
        CollectiveError::Timeout {
            op,
            step: ctx.step,
            after: ctx.timeout.as_secs_f64(),
            who,
        }
    }

    /// The rest of a hierarchical all-reduce (nothing on one host) once `buf` holds this host's
    /// sum: the leaders
    /// all-reduce it over their ring, then each leader's result reaches its host's ranks as a
    /// shared-memory sum in which the others contribute zeros (exact: x + 0 = x).
    fn between_hosts(
        &mut self,
        buf: &mut [f32],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        match self.hosts.as_mut() {
            Some(Hosts::Leader(ring)) => {
                ring.handshake("all_reduce", 1, buf.len() as u64, ctx, deadline)?;
                ring.ring_all_reduce(buf, ctx, deadline)?;
            }
            Some(Hosts::Member) => buf.fill(0.0),
            None => return Ok(()),
        }
        self.shm_all_reduce(buf, ctx, deadline)
    }

    /// All-reduce (sum) of `buf` in place through the shared-memory group.
    fn shm_all_reduce(
        &mut self,
        buf: &mut [f32],
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        self.seq += 1;
        let Some(shm) = self.shm.as_mut() else {
            return Ok(());
        };
        self.sent += std::mem::size_of_val(buf) as u64;
        shm.all_reduce(buf, self.seq, deadline)
            .map_err(|failure| self.shm_error(failure, ctx, buf.len()))
    }

    /// The error a failed shared-memory all-reduce of `len` elements reports.
    fn shm_error(&mut self, failure: ShmFailure, ctx: OpContext, len: usize) -> CollectiveError {
        self.shm_op_error("all_reduce", failure, ctx, len)
    }

    /// The error a failed shared-memory operation `op` of `len` elements reports.
    fn shm_op_error(
        &mut self,
        op: &'static str,
        failure: ShmFailure,
        ctx: OpContext,
        len: usize,
    ) -> CollectiveError {
        match failure {
            ShmFailure::Timeout => self.timeout_error(op, ctx),
            ShmFailure::Exited { rank, pid } => CollectiveError::Peer {
                op,
                step: ctx.step,
                peer: rank,
                source: std::io::Error::other(format!(
                    "its process {pid} exited (shared memory)"
                )),
            },
            ShmFailure::NoArena { floats } => CollectiveError::Failed {
                op,
                step: ctx.step,
                detail: format!("no shared buffer of {floats} floats was set up"),
            },
            ShmFailure::Mismatch {
                rank,
                their_seq,
                their_len,
                their_op,
                our_op,
            } => CollectiveError::Mismatch {
                op,
                step: ctx.step,
                detail: format!(
                    "rank {rank} is at operation #{their_seq} ({their_op}, {their_len} elements) while rank {} is at #{} ({our_op}, {len} elements)",
                    self.rank, self.seq
                ),
            },
        }
    }

    /// The shared-memory group, when it holds every rank of the job (one host): broadcast,
    /// all-gather and barrier go through it instead of the ring.
    fn whole_job_shm(&mut self) -> Option<&mut ShmGroup> {
        self.shm.as_mut().filter(|_| self.hosts.is_none())
    }

    /// Broadcast of `bytes` from `root` through shared memory; false, doing nothing, when the
    /// job is not on one host.
    fn shm_broadcast(
        &mut self,
        parts: &[Bytes],
        root: usize,
        ctx: OpContext,
    ) -> Result<bool, CollectiveError> {
        let (seq, deadline) = (self.seq + 1, Instant::now() + ctx.timeout);
        let Some(shm) = self.whole_job_shm() else {
            return Ok(false);
        };
        let done = shm.broadcast(parts, root, seq, deadline);
        self.seq = seq;
        let len = parts.iter().map(|p| p.len).sum();
        if root == self.rank {
            self.sent += len as u64;
        }
        done.map_err(|f| self.shm_op_error("broadcast", f, ctx, len))?;
        Ok(true)
    }

    /// A buffer of `n` floats in this rank's shared-memory arena: data put there is all-reduced
    /// by [`TcpCollective::all_reduce_shared`] where it lies, with no copy in or out (as NCCL
    /// does with registered buffers). `None` without shared memory, or when `/dev/shm` cannot
    /// hold it. Every rank must call this at the same point with the same `n` (it may set up a
    /// bigger arena, together); the slice is valid until the next call.
    pub fn shared_buffer(
        &mut self,
        n: usize,
        ctx: OpContext,
    ) -> Result<Option<&mut [f32]>, CollectiveError> {
        let Some(shm) = self.shm.as_mut() else {
            return Ok(None);
        };
        let made = shm
            .ensure_arena(&mut self.store, n, ctx.timeout)
            .map_err(|detail| CollectiveError::Setup {
                backend: "tcp",
                detail,
            })?;
        Ok(if made { shm.arena(n) } else { None })
    }

    /// All-reduces the first `n` floats of the shared buffer ([`TcpCollective::shared_buffer`])
    /// in place, on every rank.
    pub fn all_reduce_shared(
        &mut self,
        n: usize,
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        let deadline = Instant::now() + ctx.timeout;
        self.seq += 1;
        let seq = self.seq;
        self.sent += (n * 4) as u64;
        let reduced = match self.shm.as_mut() {
            Some(shm) => shm
                .all_reduce_arena(n, seq, deadline)
                .map(|()| shm.arena(n)),
            None => Err(ShmFailure::NoArena { floats: n }),
        };
        let ptr = match reduced {
            Ok(Some(buf)) => buf.as_mut_ptr(),
            Ok(None) => return Err(self.shm_error(ShmFailure::NoArena { floats: n }, ctx, n)),
            Err(failure) => return Err(self.shm_error(failure, ctx, n)),
        };
        // SAFETY: `n` floats of our arena, which `self.shm` keeps mapped; the peers touch it
        // only in arena operations, and the hosts' exchange below is not one.
        let buf = unsafe { std::slice::from_raw_parts_mut(ptr, n) };
        self.between_hosts(buf, ctx, deadline)?;
        self.average_if(op, buf);
        Ok(())
    }

    /// Turns a sum over the ranks into their mean when `op` asks for it.
    fn average_if(&self, op: ReduceOp, buf: &mut [f32]) {
        if op == ReduceOp::Avg {
            let w = self.world as f32;
            buf.iter_mut().for_each(|x| *x /= w);
        }
    }

    /// All-reduces several tensors (or one that is not a contiguous f32 CPU tensor) by copying
    /// them straight into the shared buffer; false, doing nothing, when there is none.
    fn all_reduce_through_arena(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<bool, CollectiveError> {
        let n = tensors.iter().map(Tensor::numel).sum::<usize>();
        if n == 0 {
            return Ok(true); // the same on every rank: nothing to exchange
        }
        let Some(ptr) = self.shared_buffer(n, ctx)?.map(|buf| buf.as_mut_ptr()) else {
            return Ok(false);
        };
        // SAFETY: `n` floats of our arena, valid until the next `shared_buffer` call; `flat` is
        // dropped before this function returns.
        let flat = unsafe {
            Tensor::f_from_blob(
                ptr as *const u8,
                &[n as i64],
                &[1],
                Kind::Float,
                Device::Cpu,
            )?
        };
        flatten_into(tensors, &flat)?;
        self.all_reduce_shared(n, op, ctx)?;
        unflatten_into(&flat, tensors)?;
        Ok(true)
    }

    /// Broadcast of `bytes` from `root` along the socket ring (each rank forwards what it
    /// receives, piece by piece, to the next, which the root does not need).
    fn socket_broadcast(
        &mut self,
        parts: &[Bytes],
        root: usize,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let total: usize = parts.iter().map(|p| p.len).sum();
        self.handshake("broadcast", 2, total as u64, ctx, deadline)?;
        let forward = self.next() != root;
        let receive = self.rank != root;
        let Some((to_next, from_prev)) = self.links.as_mut() else {
            return Ok(());
        };
        let sent = &mut self.sent;
        let mut result = Ok(());
        'parts: for part in parts.iter().filter(|p| p.len > 0) {
            // SAFETY: valid for `len` bytes and ours alone during the operation (see Bytes).
            let bytes = unsafe { std::slice::from_raw_parts_mut(part.ptr, part.len) };
            for piece in bytes.chunks_mut(PIECE_BYTES) {
                if receive {
                    if let Err(e) = read_exact_until(from_prev, piece, deadline) {
                        result = Err(e.map_recv());
                        break 'parts;
                    }
                }
                if forward {
                    *sent += piece.len() as u64;
                    if let Err(e) = write_all_until(to_next, piece, deadline) {
                        result = Err(e);
                        break 'parts;
                    }
                }
            }
        }
        match result {
            Ok(()) => Ok(()),
            Err(LinkFailure::Timeout) => Err(self.timeout_error("broadcast", ctx)),
            Err(LinkFailure::Send(source)) => Err(CollectiveError::Peer {
                op: "broadcast",
                step: ctx.step,
                peer: self.global(self.next()),
                source,
            }),
            Err(LinkFailure::Recv(source)) => Err(CollectiveError::Peer {
                op: "broadcast",
                step: ctx.step,
                peer: self.global(self.prev()),
                source,
            }),
        }
    }
}

impl Collective for TcpCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        if self.hosts.is_some() {
            "tcp (shared memory in each host, ring between hosts)"
        } else if self.shm.is_some() {
            "tcp (shared memory)"
        } else {
            "tcp"
        }
    }

    fn all_reduce(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if self.world == 1 || tensors.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        // One contiguous f32 CPU tensor is reduced where it lies; anything else goes through
        // a flat bucket.
        let direct = tensors.len() == 1
            && tensors[0].device() == Device::Cpu
            && tensors[0].kind() == Kind::Float
            && tensors[0].is_contiguous();
        if !direct && self.shm.is_some() && self.all_reduce_through_arena(tensors, op, ctx)? {
            return Ok(());
        }
        let flat = if direct {
            tensors[0].shallow_clone()
        } else {
            flatten_f32(tensors, Device::Cpu)?
        };
        let n = flat.numel();
        if n == 0 {
            return Ok(()); // the same on every rank: nothing to exchange
        }
        // SAFETY: `flat` is a contiguous f32 CPU tensor of `n` elements that nothing else
        // touches while we hold this slice.
        let buf = unsafe { std::slice::from_raw_parts_mut(flat.data_ptr() as *mut f32, n) };
        if self.shm.is_some() {
            self.shm_all_reduce(buf, ctx, deadline)?;
            self.between_hosts(buf, ctx, deadline)?;
        } else {
            self.handshake("all_reduce", 1, n as u64, ctx, deadline)?;
            self.ring_all_reduce(buf, ctx, deadline)?;
        }
        self.average_if(op, buf);
        if !direct {
            unflatten_into(&flat, tensors)?;
        }
        Ok(())
    }

    fn broadcast(
        &mut self,
        tensors: &mut [Tensor],
        root: usize,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if root >= self.world {
            return Err(CollectiveError::Unsupported {
                op: "broadcast",
                detail: format!("root {root} is not a rank of a world of {}", self.world),
            });
        }
        if self.world == 1 || tensors.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        // Received straight into the tensors' memory (a contiguous CPU copy of any other).
        let staged = tensors.iter().map(staged).collect::<Result<Vec<_>, _>>()?;
        // SAFETY: the staged tensors outlive `parts`; nothing else touches them meanwhile.
        let parts: Vec<Bytes> = staged.iter().map(|t| unsafe { bytes_of(t) }).collect();
        if !self.shm_broadcast(&parts, root, ctx)? {
            self.socket_broadcast(&parts, root, ctx, deadline)?;
        }
        if self.rank != root {
            for (t, s) in tensors.iter_mut().zip(&staged) {
                if s.data_ptr() != t.data_ptr() {
                    t.f_copy_(s)?;
                }
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        tensor: &Tensor,
        ctx: OpContext,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        let mine = staged(tensor)?;
        let mut out = (0..self.world)
            .map(|_| mine.f_empty_like())
            .collect::<Result<Vec<_>, _>>()?;
        self.gather_staged(&mine, &mut out, ctx)?;
        Ok(out)
    }

    fn all_gather_into(
        &mut self,
        tensor: &Tensor,
        out: &mut [Tensor],
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        super::check_gather_out(tensor, out, self.world)?;
        let mine = staged(tensor)?;
        // Received straight into `out` (a contiguous CPU copy of any other tensor).
        let mut staged_out = out.iter().map(staged).collect::<Result<Vec<_>, _>>()?;
        self.gather_staged(&mine, &mut staged_out, ctx)?;
        for (o, s) in out.iter_mut().zip(&staged_out) {
            if s.data_ptr() != o.data_ptr() {
                o.f_copy_(s)?;
            }
        }
        Ok(())
    }

    /// The ring's own: rank r holds chunk (r+1) % W, which its reduce-scatter finishes there.
    fn shards_of(&self, n: usize) -> Vec<std::ops::Range<usize>> {
        let chunk = |r: usize| {
            let (start, end) = self.ring_chunk(r + 1, n);
            start..end
        };
        (0..self.world).map(chunk).collect()
    }

    fn reduce_scatter(
        &mut self,
        flat: &mut Tensor,
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<std::ops::Range<usize>, CollectiveError> {
        if self.ring_shards(flat) {
            return self.ring_reduce_scatter(flat, op, ctx);
        }
        if self.shm_shards(flat) {
            return self.shm_reduce_scatter(flat, op, ctx);
        }
        super::reduce_scatter_by_all_reduce(self, flat, op, ctx)
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(self.sent)
    }

    /// The ring's own halves apply where the ring alone carries the sums, the arenas' where
    /// the job is on one host with shared memory (for f32 CPU buffers; others fall back to an
    /// all-reduce all the same).
    fn reduce_scatter_is_native(&self) -> bool {
        self.world > 1 && (self.ring_only() || (self.shm.is_some() && self.hosts.is_none()))
    }

    fn all_gather_shards(
        &mut self,
        flat: &mut Tensor,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        if self.ring_shards(flat) {
            self.ring_all_gather(flat, ctx)
        } else if self.shm_shards(flat) {
            self.shm_all_gather_shards(flat, ctx)
        } else {
            super::all_gather_shards_by_copy(self, flat, ctx)
        }
    }

    fn barrier(&mut self, ctx: OpContext) -> Result<(), CollectiveError> {
        if self.world == 1 {
            return Ok(());
        }
        let (seq, deadline) = (self.seq + 1, Instant::now() + ctx.timeout);
        if let Some(shm) = self.whole_job_shm() {
            let done = shm.barrier(seq, deadline);
            self.seq = seq;
            return done.map_err(|f| self.shm_op_error("barrier", f, ctx, 0));
        }
        let mut token = [Tensor::from_slice(&[1.0f32])];
        self.all_reduce(&mut token, ReduceOp::Sum, ctx)
    }

    /// Through the shared-memory group, when every rank is on this host.
    fn host_shared(
        &mut self,
        floats: usize,
        ctx: OpContext,
    ) -> Result<Option<HostShared>, CollectiveError> {
        let Some(shm) = self.shm.as_mut().filter(|_| self.hosts.is_none()) else {
            return Ok(None);
        };
        let base = shm
            .host_shared(&mut self.store, floats.max(1) * 4, ctx.timeout)
            .map_err(|detail| CollectiveError::Setup {
                backend: "tcp",
                detail,
            })?;
        Ok(base.map(|base| HostShared::new(base.cast(), floats)))
    }
}

impl LinkFailure {
    /// A read that failed is the receiving side's problem.
    fn map_recv(self) -> LinkFailure {
        match self {
            LinkFailure::Send(e) => LinkFailure::Recv(e),
            other => other,
        }
    }
}

/// The bytes of a tensor's values (contiguous, on the CPU).
/// `t` itself when it is a contiguous CPU tensor, otherwise a contiguous CPU copy: what a
/// broadcast or all-gather reads and writes in place.
fn staged(t: &Tensor) -> Result<Tensor, tch::TchError> {
    let t = t.f_detach()?;
    if t.device() == Device::Cpu && t.is_contiguous() {
        return Ok(t);
    }
    t.f_to_device(Device::Cpu)?.f_contiguous()
}

/// The bytes of a contiguous CPU tensor.
///
/// # Safety
/// The caller keeps `t` alive, and its memory untouched by anything else, while the view is used.
unsafe fn bytes_of(t: &Tensor) -> Bytes {
    let len = t.numel() * t.kind().elt_size_in_bytes();
    Bytes {
        ptr: if len == 0 {
            std::ptr::NonNull::<u8>::dangling().as_ptr()
        } else {
            t.data_ptr() as *mut u8
        },
        len,
    }
}

fn op_name(code: u8) -> &'static str {
    match code {
        1 => "all_reduce",
        2 => "broadcast",
        3 => "all_gather",
        4 => "reduce_scatter",
        5 => "all_gather_shards",
        _ => "an unknown operation",
    }
}

fn as_bytes(v: &[f32]) -> &[u8] {
    // SAFETY: f32 has no padding and any byte pattern is a valid u8.
    unsafe { std::slice::from_raw_parts(v.as_ptr() as *const u8, std::mem::size_of_val(v)) }
}

fn as_bytes_mut(v: &mut [f32]) -> &mut [u8] {
    // SAFETY: as above; every byte pattern written is a valid f32 bit pattern.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, std::mem::size_of_val(v)) }
}

/// Disjoint views of chunk `send` (to send, as bytes) and chunk `recv` (to fill) of `buf`.
fn split_send_recv(
    buf: &mut [f32],
    send: (usize, usize),
    recv: (usize, usize),
) -> (&[u8], &mut [f32]) {
    let (send, recv) = split_pair(buf, send, recv);
    (as_bytes(send), recv)
}

/// Disjoint views of the half-open ranges `send` and `recv` (which do not overlap; either may
/// be empty, as happens when the buffer is shorter than the world size).
fn split_pair<T>(buf: &mut [T], send: (usize, usize), recv: (usize, usize)) -> (&[T], &mut [T]) {
    if send.0 == send.1 {
        return (&[], &mut buf[recv.0..recv.1]);
    }
    if recv.0 == recv.1 {
        return (&buf[send.0..send.1], &mut []);
    }
    if send.0 < recv.0 {
        let (lo, hi) = buf.split_at_mut(recv.0);
        (&lo[send.0..send.1], &mut hi[..recv.1 - recv.0])
    } else {
        let (lo, hi) = buf.split_at_mut(send.0);
        (&hi[..send.1 - send.0], &mut lo[recv.0..recv.1])
    }
}

mod gather;
mod link;
mod ring;
mod scatter;
mod setup;

#[cfg(any(test, feature = "test-support"))]
pub mod test_ring;

#[cfg(test)]
mod tests;
