//! Collectives between the workers of one job: one [`Collective`] trait (all-reduce of many
//! tensors at once, broadcast, all-gather, barrier; each with a timeout) and its backends —
//! [`tcp`] (CPU tensors, a ring over persistent TCP connections, all-reducing through
//! [`shm`] shared memory when every rank is on one host) and [`nccl`] (CUDA tensors); and
//! [`flight`], which records any backend's last operations for the post-mortem.
//! This module moves and reduces numbers; it must not know what they mean (that is `ddp`'s).
//!
//! The backends' method bodies look alike on purpose and are not shared: each is the trait's
//! steps (check, flatten with [`flatten_f32`]-style helpers from here, move, unflatten) around
//! its own transport (a ring or shared memory on the host, NCCL's calls on a stream); what is
//! common (flattening, the output checks, the error types) lives here once.

pub mod flight;
pub mod nccl;
pub mod shm;
pub mod tcp;

use std::ops::Range;
use std::time::Duration;

use tch::{Kind, Tensor};

/// How values from all ranks are combined.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// Sum divided by the world size.
    Avg,
}

/// Where in the training a collective is called from, for error messages.
#[derive(Debug, Clone, Copy)]
pub struct OpContext {
    /// Optimizer step (or another counter the caller finds meaningful).
    pub step: u64,
    /// Give up after this long.
    pub timeout: Duration,
}

/// A collective that failed; every message names the operation and the training step.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error("{op} at step {step} timed out after {after:.1} s: {who}")]
    Timeout {
        op: &'static str,
        step: u64,
        after: f64,
        /// e.g. "no answer from rank(s) [2]".
        who: String,
    },
    #[error("{op} at step {step}: connection to rank {peer} failed: {source}")]
    Peer {
        op: &'static str,
        step: u64,
        peer: usize,
        source: std::io::Error,
    },
    #[error("{op} at step {step}: ranks disagree: {detail}")]
    Mismatch {
        op: &'static str,
        step: u64,
        detail: String,
    },
    #[error("{op}: {detail}")]
    Unsupported { op: &'static str, detail: String },
    #[error("{op} at step {step} failed: {detail}")]
    Failed {
        op: &'static str,
        step: u64,
        detail: String,
    },
    #[error("setting up the {backend} collective: {detail}")]
    Setup {
        backend: &'static str,
        detail: String,
    },
    #[error(transparent)]
    Torch(#[from] tch::TchError),
}

/// The operations the DDP engine and the trainer need. All ranks must call the same operations
/// in the same order with tensors of the same shapes and kinds.
pub trait Collective: Send {
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// The backend's name, for logs.
    fn name(&self) -> &'static str;

    /// Reduces every tensor in place across ranks (f32 or bf16: `tcp` reduces in f32, `nccl`
    /// reduces a single bf16 tensor in bf16 as PyTorch does). Many tensors travel as one flat
    /// buffer, so callers should pass a whole bucket at once.
    fn all_reduce(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError>;

    /// Overwrites every tensor with rank `root`'s values (any kind).
    fn broadcast(
        &mut self,
        tensors: &mut [Tensor],
        root: usize,
        ctx: OpContext,
    ) -> Result<(), CollectiveError>;

    /// Every rank's `tensor` (same shape and kind everywhere), in rank order.
    fn all_gather(
        &mut self,
        tensor: &Tensor,
        ctx: OpContext,
    ) -> Result<Vec<Tensor>, CollectiveError>;

    /// Every rank's `tensor` into `out`, one tensor per rank in rank order, each shaped and
    /// typed like `tensor` (as `torch.distributed.all_gather(out, tensor)`): no allocation when
    /// the caller keeps `out` from call to call. `tensor` may be `out[rank]` itself (in place,
    /// as FSDP gathers): `tcp` then does not copy our own part. Default:
    /// [`Collective::all_gather`], copied.
    fn all_gather_into(
        &mut self,
        tensor: &Tensor,
        out: &mut [Tensor],
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        check_gather_out(tensor, out, self.world_size())?;
        for (o, part) in out.iter_mut().zip(self.all_gather(tensor, ctx)?) {
            o.f_copy_(&part)?;
        }
        Ok(())
    }

    /// Returns once every rank has entered the barrier.
    fn barrier(&mut self, ctx: OpContext) -> Result<(), CollectiveError>;

    /// Every rank's shard of a flat buffer of `n` elements, in rank order: the ranges
    /// partition `0..n`, a function of `n` and the world (the same on every rank for a given
    /// backend), so that no rank needs to ask another where its shard lies. Default: the even
    /// split, rank `r` holding `r*n/W .. (r+1)*n/W`.
    fn shards_of(&self, n: usize) -> Vec<Range<usize>> {
        let world = self.world_size();
        (0..world).map(|r| even_shard(n, world, r)).collect()
    }

    /// This rank's shard of a flat buffer of `n` elements ([`Collective::shards_of`]).
    fn shard_of(&self, n: usize) -> Range<usize> {
        let mut all = self.shards_of(n);
        all.swap_remove(self.rank().min(all.len().saturating_sub(1)))
    }

    /// Reduces the contiguous f32 tensor `flat` across ranks, leaving this rank's shard
    /// ([`Collective::shard_of`]) holding exactly what [`Collective::all_reduce`] would have
    /// put there, bit for bit; the rest of `flat` is unspecified. Returns the shard. Default:
    /// a whole all-reduce (every part then holds its sum).
    fn reduce_scatter(
        &mut self,
        flat: &mut Tensor,
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<Range<usize>, CollectiveError> {
        reduce_scatter_by_all_reduce(self, flat, op, ctx)
    }

    /// Bytes this rank has handed to the others since the collective was made (payload and
    /// headers written to a socket, or put into shared memory for the others to read; on NCCL,
    /// what its ring algorithms send for each operation's size), or `None` where the backend
    /// does not count (the default).
    fn bytes_sent(&self) -> Option<u64> {
        None
    }

    /// Whether [`Collective::reduce_scatter`] of a contiguous f32 buffer is this backend's own
    /// (less traffic than an all-reduce). Where it is not (the default), it is a whole
    /// all-reduce, and a caller holding several tensors all-reduces them as they are (as DDP
    /// does) instead of first copying them into a buffer of its own: the same sums.
    fn reduce_scatter_is_native(&self) -> bool {
        false
    }

    /// Fills the contiguous f32 tensor `flat` outside this rank's shard from the ranks that
    /// hold the rest, so that after [`Collective::reduce_scatter`] it is what
    /// [`Collective::all_reduce`] gives, bit for bit. Default: every rank's shard copied to
    /// every rank through [`Collective::all_gather`].
    fn all_gather_shards(
        &mut self,
        flat: &mut Tensor,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        all_gather_shards_by_copy(self, flat, ctx)
    }

    /// Memory that every rank maps, when all of them run on one host and the backend can share
    /// it there: `floats` f32s, zeroed. `None` otherwise (the default). Every rank must call it
    /// at the same point with the same `floats`, and all get the same answer.
    fn host_shared(
        &mut self,
        _floats: usize,
        _ctx: OpContext,
    ) -> Result<Option<HostShared>, CollectiveError> {
        Ok(None)
    }
}

/// Checks that `out` holds one tensor like `tensor` per rank (the same on every rank, so every
/// rank fails alike before anything is exchanged).
pub(crate) fn check_gather_out(
    tensor: &Tensor,
    out: &[Tensor],
    world: usize,
) -> Result<(), CollectiveError> {
    let like = |o: &Tensor| o.size() == tensor.size() && o.kind() == tensor.kind();
    if out.len() != world || !out.iter().all(like) {
        return Err(CollectiveError::Unsupported {
            op: "all_gather",
            detail: format!(
                "the output needs {world} tensors of shape {:?} and kind {:?}, got {} of shapes {:?}",
                tensor.size(),
                tensor.kind(),
                out.len(),
                out.iter().map(Tensor::size).collect::<Vec<_>>()
            ),
        });
    }
    Ok(())
}

/// Memory shared by every rank of a group ([`Collective::host_shared`]): mapped until the
/// process exits, so tensors may point into it for the rest of the run. Which rank writes which
/// part, and when the others may read it, is the user's protocol.
pub struct HostShared {
    base: std::ptr::NonNull<f32>,
    floats: usize,
}

// SAFETY: plain shared memory that is never unmapped; the handle owns nothing.
unsafe impl Send for HostShared {}

impl HostShared {
    /// `floats` f32s at `base`, which must stay mapped until the process exits.
    pub(crate) fn new(base: std::ptr::NonNull<f32>, floats: usize) -> HostShared {
        HostShared { base, floats }
    }

    /// The first float (64-byte aligned).
    pub fn as_ptr(&self) -> *mut f32 {
        self.base.as_ptr()
    }

    /// Its length in floats.
    pub fn len(&self) -> usize {
        self.floats
    }

    pub fn is_empty(&self) -> bool {
        self.floats == 0
    }
}

/// How long ranks that timed out wait for each other to report, to tell who is silent.
const STALL_WINDOW: Duration = Duration::from_secs(3);

/// After a timeout: finds out which ranks are silent. Every rank that times out reports in the
/// store under `scope` and the operation's sequence number, waits a moment for the others, and
/// names those that did not report. Positions (`me`, `upstream`, the reports) index `ranks`,
/// the global ranks taking part (all of them, or a sub-ring's); `upstream` is the position we
/// were waiting for (a ring's neighbour), named when all report; `None` where no one rank's
/// data is awaited (NCCL's own transport).
pub(crate) fn silent_ranks(
    store: &mut crate::store::StoreClient,
    scope: &str,
    seq: u64,
    me: usize,
    ranks: &[usize],
    upstream: Option<usize>,
) -> String {
    if store.set(&format!("{scope}/{seq}/{me}"), b"").is_err() {
        return "no answer from rank 0, which hosts the rendezvous store".to_string();
    }
    let window = std::time::Instant::now() + STALL_WINDOW;
    let mut silent: Vec<usize> = (0..ranks.len()).filter(|p| *p != me).collect();
    while !silent.is_empty() && std::time::Instant::now() < window {
        silent.retain(|p| !matches!(store.get(&format!("{scope}/{seq}/{p}")), Ok(Some(_))));
        if !silent.is_empty() {
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    match (silent.is_empty(), upstream) {
        (true, Some(upstream)) => format!(
            "every rank is waiting; no data arrived from rank {} (network problem?)",
            ranks[upstream]
        ),
        (true, None) => "every rank entered it and is waiting in it: the transport between them stalled (network problem? NCCL_DEBUG=INFO names NCCL's connections)".to_string(),
        (false, _) => {
            let silent: Vec<usize> = silent.iter().map(|p| ranks[*p]).collect();
            format!("no answer from rank(s) {silent:?} (stopped, or never entered it)")
        }
    }
}

/// Copies `tensors` into one contiguous f32 tensor (the bucket) on `device`, in order.
pub(crate) fn flatten_f32(
    tensors: &[Tensor],
    device: tch::Device,
) -> Result<Tensor, tch::TchError> {
    let flat: Vec<Tensor> = tensors
        .iter()
        .map(|t| {
            t.f_to_device(device)?
                .f_to_kind(tch::Kind::Float)?
                .f_reshape([-1])
        })
        .collect::<Result<_, _>>()?;
    Tensor::f_cat(&flat, 0)?.f_contiguous()
}

/// Copies `tensors` into `flat` (f32, as many elements as they hold together), in order.
pub(crate) fn flatten_into(tensors: &[Tensor], flat: &Tensor) -> Result<(), tch::TchError> {
    let mut offset = 0i64;
    for t in tensors {
        let n = t.numel() as i64;
        let mut part = flat.f_narrow(0, offset, n)?;
        part.f_copy_(&t.f_reshape([-1])?)?;
        offset += n;
    }
    Ok(())
}

/// Copies the bucket back into `tensors` (converting kind and device as needed).
pub(crate) fn unflatten_into(flat: &Tensor, tensors: &mut [Tensor]) -> Result<(), tch::TchError> {
    let mut offset = 0i64;
    for t in tensors.iter_mut() {
        let n = t.numel() as i64;
        let part = flat.f_narrow(0, offset, n)?.f_view(t.size().as_slice())?;
        t.f_copy_(&part)?;
        offset += n;
    }
    Ok(())
}

/// The backend `[dist] backend` resolves to on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chosen {
    Tcp,
    Nccl(usize),
}

/// `tcp` for CPU tensors, `nccl` for CUDA tensors; `auto` picks by device. On a CUDA device
/// `auto` never falls back to the TCP ring when NCCL is missing (a silent 10-100x slowdown):
/// that is an error saying how to fix it, and `tcp` must be asked for by name.
fn choose(
    backend: common::config::Backend,
    device: tch::Device,
    nccl_probe: impl FnOnce() -> Result<(), CollectiveError>,
) -> Result<Chosen, CollectiveError> {
    use common::config::Backend;
    match (backend, device) {
        (Backend::Auto, tch::Device::Cuda(index)) => match nccl_probe() {
            Ok(()) => Ok(Chosen::Nccl(index)),
            Err(why) => {
                let why = match why {
                    CollectiveError::Setup { detail, .. } => detail,
                    other => other.to_string(),
                };
                Err(CollectiveError::Setup {
                    backend: "nccl",
                    detail: format!(
                        "dist.backend = \"auto\" on cuda:{index} needs NCCL: {why}. \
                         (To reduce through host memory instead, 10-100x slower on GPUs, set dist.backend = \"tcp\".)"
                    ),
                })
            }
        },
        (Backend::Nccl, tch::Device::Cuda(index)) => Ok(Chosen::Nccl(index)),
        (Backend::Nccl, _) => Err(CollectiveError::Setup {
            backend: "nccl",
            detail: "dist.backend = \"nccl\" needs CUDA tensors, but this worker runs on the CPU; use \"tcp\" or \"auto\"".into(),
        }),
        _ => Ok(Chosen::Tcp),
    }
}

/// The communicator `[dist]` asks for on `device` (see [`choose`]).
pub fn connect(
    dist: &common::config::DistConfig,
    device: tch::Device,
    env: &common::env_contract::WorkerEnv,
    store: crate::store::StoreClient,
    timeout: Duration,
) -> Result<Box<dyn Collective>, CollectiveError> {
    Ok(match choose(dist.backend, device, nccl::probe)? {
        Chosen::Nccl(index) => Box::new(nccl::NcclCollective::connect(env, store, index, timeout)?),
        Chosen::Tcp => {
            let options = tcp::TcpOptions {
                shared_memory: dist.shared_memory,
            };
            Box::new(tcp::TcpCollective::connect_with(
                env, store, timeout, options,
            )?)
        }
    })
}

/// [`Collective::reduce_scatter`] as a whole all-reduce (every part then holds its sum).
pub fn reduce_scatter_by_all_reduce<C: Collective + ?Sized>(
    c: &mut C,
    flat: &mut Tensor,
    op: ReduceOp,
    ctx: OpContext,
) -> Result<Range<usize>, CollectiveError> {
    check_flat("reduce_scatter", flat)?;
    c.all_reduce(std::slice::from_mut(flat), op, ctx)?;
    Ok(c.shard_of(flat.numel()))
}

/// [`Collective::all_gather_shards`] by copying: every rank's shard (padded to the longest) in
/// one all-gather, each put where it lies ([`Collective::shards_of`]). A copy, so every bit
/// pattern arrives as sent (a sum with zeros would turn -0.0 into 0.0).
pub fn all_gather_shards_by_copy<C: Collective + ?Sized>(
    c: &mut C,
    flat: &mut Tensor,
    ctx: OpContext,
) -> Result<(), CollectiveError> {
    check_flat("all_gather_shards", flat)?;
    if c.world_size() == 1 {
        return Ok(());
    }
    let (rank, shards) = (c.rank(), c.shards_of(flat.numel()));
    let longest = shards.iter().map(|s| s.len()).max().unwrap_or(0) as i64;
    if longest == 0 {
        return Ok(());
    }
    let own = &shards[rank];
    let mine = Tensor::f_zeros([longest], (Kind::Float, flat.device()))?;
    let len = own.len() as i64;
    mine.f_narrow(0, 0, len)?
        .f_copy_(&flat.f_narrow(0, own.start as i64, len)?)?;
    for (k, (s, theirs)) in shards.iter().zip(c.all_gather(&mine, ctx)?).enumerate() {
        if k != rank && !s.is_empty() {
            let len = s.len() as i64;
            flat.f_narrow(0, s.start as i64, len)?
                .f_copy_(&theirs.f_narrow(0, 0, len)?)?;
        }
    }
    Ok(())
}

/// Rank `rank`'s part of `n` elements split evenly over `world` ranks.
pub fn even_shard(n: usize, world: usize, rank: usize) -> Range<usize> {
    let world = world.max(1);
    rank * n / world..(rank + 1) * n / world
}

/// A sharded operation's buffer: one contiguous, one-dimensional f32 CPU or device tensor.
fn check_flat(op: &'static str, flat: &Tensor) -> Result<(), CollectiveError> {
    if flat.kind() != Kind::Float || flat.dim() != 1 || !flat.is_contiguous() {
        return Err(CollectiveError::Unsupported {
            op,
            detail: format!(
                "needs one contiguous 1-d f32 tensor, got {:?} of shape {:?}",
                flat.kind(),
                flat.size()
            ),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use common::config::Backend;
    use tch::Device;

    fn missing() -> Result<(), CollectiveError> {
        Err(CollectiveError::Setup {
            backend: "nccl",
            detail: "the NCCL library could not be loaded (looked for libnccl.so)".into(),
        })
    }

    #[test]
    fn auto_on_a_gpu_without_nccl_is_an_error_that_says_how_to_fix_it() {
        let text = choose(Backend::Auto, Device::Cuda(1), missing)
            .unwrap_err()
            .to_string();
        assert!(text.contains("cuda:1 needs NCCL"), "{text}");
        assert!(text.contains("libnccl.so"), "{text}");
        assert!(text.contains("dist.backend = \"tcp\""), "{text}");
    }

    #[test]
    fn backends_by_device() {
        let ok = || Ok(());
        assert_eq!(
            choose(Backend::Auto, Device::Cuda(2), ok).unwrap(),
            Chosen::Nccl(2)
        );
        assert_eq!(
            choose(Backend::Auto, Device::Cpu, missing).unwrap(),
            Chosen::Tcp
        );
        // tcp asked for by name runs on a GPU without NCCL.
        assert_eq!(
            choose(Backend::Tcp, Device::Cuda(0), missing).unwrap(),
            Chosen::Tcp
        );
        assert!(choose(Backend::Nccl, Device::Cpu, ok).is_err());
    }

    #[test]
    fn flatten_and_back_preserve_values_and_kinds() {
        let mut tensors = vec![
            Tensor::from_slice(&[1.0f32, 2.0, 3.0, 4.0]).view([2, 2]),
            Tensor::from_slice(&[5.0f32]).to_kind(tch::Kind::BFloat16),
        ];
        let flat = flatten_f32(&tensors, tch::Device::Cpu).unwrap();
        assert_eq!(flat.size(), vec![5]);
        let doubled = &flat * 2.0;
        unflatten_into(&doubled, &mut tensors).unwrap();
        assert_eq!(
            tensors[0],
            Tensor::from_slice(&[2.0f32, 4.0, 6.0, 8.0]).view([2, 2])
        );
        assert_eq!(tensors[1].kind(), tch::Kind::BFloat16);
        assert_eq!(
            tensors[1].to_kind(tch::Kind::Float).double_value(&[0]),
            10.0
        );
    }
}
