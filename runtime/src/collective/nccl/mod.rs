//! The `nccl` backend: CUDA tensors reduced in place on the device through NCCL, via `cudarc`'s
//! bindings with dynamic loading (the crate builds, and every CPU path runs, on machines without
//! CUDA or NCCL). Rank 0 creates the 128-byte unique id and publishes it in the rendezvous store.
//! Operations are queued on the legacy default stream, the one libtorch uses unless told
//! otherwise, so they are ordered with the surrounding libtorch work. The communicator's life
//! (non-blocking creation, polling to a deadline, the single abort, teardown) is [`comm`]'s;
//! this file turns tensors into NCCL calls and failures into messages that name ranks.
//! It must never panic when the library is missing: [`probe`] turns that into an error first.

mod comm;

use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;
use cudarc::nccl::sys;
use tch::{Device, Kind, Tensor};

use super::{
    flatten_f32, silent_ranks, unflatten_into, Collective, CollectiveError, OpContext, ReduceOp,
};
use crate::cuda_runtime::{CudaRuntime, Event, Stream};
use crate::store::StoreClient;
use comm::{Call, CommFailure, Communicator, NcclApi};

/// The oldest NCCL we accept: non-blocking communicators arrived in 2.14 as experimental, and
/// their abort and teardown were fixed up to 2.19 (PyTorch draws the same line).
const MIN_VERSION: (i32, i32) = (2, 19);

/// Checks that NCCL can be loaded and is recent enough, before anything touches `cudarc`
/// (which panics on a missing library or symbol).
pub fn probe() -> Result<(), CollectiveError> {
    let setup = |detail: String| CollectiveError::Setup {
        backend: "nccl",
        detail,
    };
    // SAFETY: only tries to dlopen the candidate names.
    if !unsafe { sys::is_culib_present() } {
        let candidates = cudarc::get_lib_name_candidates("nccl");
        return Err(setup(format!(
            "the NCCL library could not be loaded (looked for {} on LD_LIBRARY_PATH and the binary's rpath). \
             PyTorch's wheel ships it as nvidia/nccl/lib/libnccl.so.2 only: run scripts/setup.sh (which adds the libnccl.so link), \
             or `ln -s libnccl.so.2 libnccl.so` in that directory and put it on LD_LIBRARY_PATH; or use dist.backend = \"tcp\"",
            candidates.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        )));
    }
    let mut code = 0i32;
    // SAFETY: the library is present and ncclGetVersion exists in every NCCL 2.x.
    unsafe { sys::ncclGetVersion(&mut code) };
    let version = version_of(code);
    if version < MIN_VERSION {
        return Err(setup(format!(
            "the NCCL library found is version {}.{}, older than {}.{} (non-blocking communicators); put the libnccl.so.2 that PyTorch ships (nvidia/nccl/lib) first on LD_LIBRARY_PATH",
            version.0, version.1, MIN_VERSION.0, MIN_VERSION.1
        )));
    }
    Ok(())
}

/// (major, minor) of `ncclGetVersion`'s code (2.8 and older: 2708; since 2.9: 20903).
fn version_of(code: i32) -> (i32, i32) {
    if code >= 10000 {
        (code / 10000, code / 100 % 100)
    } else {
        (code / 1000, code / 100 % 10)
    }
}

/// A C string NCCL or CUDA owns, copied (empty for null).
fn c_text(ptr: *const std::ffi::c_char) -> String {
    if ptr.is_null() {
        return String::new();
    }
    // SAFETY: a NUL-terminated string from the library, read before any further call.
    unsafe { std::ffi::CStr::from_ptr(ptr) }
        .to_string_lossy()
        .into_owned()
}

/// NCCL's last error text (the comm argument is unused by NCCL; null is allowed).
fn nccl_last_error() -> String {
    // SAFETY: returns a pointer to NCCL's static error buffer.
    c_text(unsafe { sys::ncclGetLastError(std::ptr::null_mut()) })
}

/// What usually makes NCCL's set-up fail, for the end of its error message: one GPU taken by
/// two ranks (NCCL's `Duplicate GPU detected`), or between hosts the network interface.
fn init_hint(socket_ifname: Option<&str>, hosts: u32, nccl_said: &str) -> String {
    if nccl_said.contains("Duplicate GPU") {
        return " (two ranks on one GPU: give each process its own, e.g. at most as many processes per node as GPUs; to share one GPU on purpose, start each rank as its own node with its own NCCL_HOSTID)".to_string();
    }
    if hosts <= 1 {
        return String::new();
    }
    match socket_ifname {
        Some(name) if !name.trim().is_empty() => format!(
            " (NCCL_SOCKET_IFNAME={name}: check that every host has that interface and reaches the others through it; NCCL_DEBUG=INFO shows NCCL's choices)"
        ),
        _ => " (NCCL_SOCKET_IFNAME is unset, the usual cause between hosts: NCCL may have picked an interface the other hosts cannot reach, such as docker0 or a second NIC; set it to the hosts' network interface, e.g. NCCL_SOCKET_IFNAME=eth0; NCCL_DEBUG=INFO shows NCCL's choices)".to_string(),
    }
}

/// A real communicator, created non-blocking, on CUDA device `device`.
struct RawComm {
    comm: sys::ncclComm_t,
    device: usize,
    runtime: CudaRuntime,
    /// NCCL's own stream and the event that orders it after libtorch's computation, made at
    /// the first launch: on the legacy default stream a collective would wait behind (and
    /// hold up) every kernel queued there, and its completion would mean the whole stream's,
    /// so buckets could not be reduced while backward goes on.
    stream: Option<(Stream, Event)>,
}

/// How long `ncclCommAbort` may take (it joins NCCL's threads, which can hang when a peer's
/// node is in a bad state) before the process gives up on it and exits.
const ABORT_LIMIT: Duration = Duration::from_secs(10);

// SAFETY: the handle is used by its single owner, one thread at a time (`&mut self`).
unsafe impl Send for RawComm {}

/// The handle, moved to the abort thread while the owner waits for it.
struct CommHandle(sys::ncclComm_t);
// SAFETY: only the abort thread uses it, while the owner is blocked waiting.
unsafe impl Send for CommHandle {}

/// NCCL's `NCCL_CONFIG_INITIALIZER` for the 2.28 layout cudarc binds, with `blocking = 0`.
fn nonblocking_config() -> sys::ncclConfig_t {
    const UNDEF_INT: i32 = i32::MIN;
    sys::ncclConfig_t {
        size: std::mem::size_of::<sys::ncclConfig_t>(),
        magic: 0xcafe_beef,
        version: 22800,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
    }
}

impl NcclApi for RawComm {
    fn launch(&mut self, call: &Call) -> sys::ncclResult_t {
        // The null stream and the stream queries that follow are those of the calling thread's
        // current device: make it ours (the collective may have moved to another thread).
        if self.runtime.set_device(self.device).is_err() {
            return sys::ncclResult_t::ncclUnhandledCudaError;
        }
        if self.stream.is_none() {
            match self.runtime.new_stream() {
                Ok(made) => self.stream = Some(made),
                Err(_) => return sys::ncclResult_t::ncclUnhandledCudaError,
            }
        }
        let Some((own, ready)) = self.stream else {
            return sys::ncclResult_t::ncclUnhandledCudaError;
        };
        // The collective starts once what was queued before it (the gradients, the copies
        // into the bucket) is computed, and the computation queued after it goes on meanwhile.
        if self.runtime.order_after_default(own, ready).is_err() {
            return sys::ncclResult_t::ncclUnhandledCudaError;
        }
        let stream = own.0 as sys::cudaStream_t;
        // SAFETY: the buffers are contiguous device memory of the sizes given (see the callers),
        // the communicator is live (the owner never launches after an abort).
        unsafe {
            match *call {
                Call::AllReduce {
                    buf,
                    count,
                    dtype,
                    op,
                } => sys::ncclAllReduce(buf, buf, count, dtype, op, self.comm, stream),
                Call::Broadcast { buf, bytes, root } => sys::ncclBroadcast(
                    buf,
                    buf,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    root,
                    self.comm,
                    stream,
                ),
                Call::AllGather { send, recv, bytes } => sys::ncclAllGather(
                    send,
                    recv,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    self.comm,
                    stream,
                ),
            }
        }
    }

    fn async_state(&mut self) -> sys::ncclResult_t {
        let mut state = sys::ncclResult_t::ncclSuccess;
        // SAFETY: live communicator, valid out-pointer.
        let r = unsafe { sys::ncclCommGetAsyncError(self.comm, &mut state) };
        if r == sys::ncclResult_t::ncclSuccess {
            state
        } else {
            r
        }
    }

    fn stream_done(&mut self) -> Result<bool, (i32, String)> {
        match self.stream {
            Some((own, _)) => self.runtime.stream_done(own),
            None => self.runtime.default_stream_done(),
        }
    }

    fn finalize(&mut self) -> sys::ncclResult_t {
        // SAFETY: live communicator.
        unsafe { sys::ncclCommFinalize(self.comm) }
    }

    fn destroy(&mut self) {
        // SAFETY: finalized communicator, destroyed once (the owner's state says so).
        unsafe { sys::ncclCommDestroy(self.comm) };
        if let Some((stream, event)) = self.stream.take() {
            self.runtime.destroy_stream(stream, event);
        }
    }

    fn abort(&mut self) {
        // On a helper thread with a limit, so that an abort that hangs cannot hold this rank
        // forever; the owner waits for it, so nothing else touches the communicator meanwhile.
        let comm = CommHandle(self.comm);
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("nccl-abort".into())
            .spawn(move || {
                let comm = comm;
                // SAFETY: called once by the owner; the handle is never used afterwards.
                unsafe { sys::ncclCommAbort(comm.0) };
                let _ = done_tx.send(());
            });
        let finished = match spawned {
            Ok(_) => done_rx.recv_timeout(ABORT_LIMIT).is_ok(),
            Err(_) => {
                // SAFETY: as above, on this thread since no helper could start.
                unsafe { sys::ncclCommAbort(self.comm) };
                true
            }
        };
        if !finished {
            eprintln!(
                "worker: error: ncclCommAbort on cuda:{} did not return within {} s; exiting without further clean-up",
                self.device,
                ABORT_LIMIT.as_secs()
            );
            // Not `exit`: its handlers would wait for CUDA, which waits for the stuck abort.
            // SAFETY: ends the process at once.
            unsafe { libc::_exit(1) };
        }
    }

    fn last_error(&self) -> String {
        nccl_last_error()
    }
}

/// One rank's NCCL communicator.
pub struct NcclCollective {
    rank: usize,
    world: usize,
    device: usize,
    comm: Communicator<RawComm>,
    store: StoreClient,
    seq: u64,
    /// What NCCL's ring algorithms send from this rank for the operations run so far
    /// ([`Collective::bytes_sent`]): computed from their sizes, NCCL does not count.
    sent: u64,
}

impl NcclCollective {
    /// Creates the communicator of `env.rank` on CUDA device `device`.
    pub fn connect(
        env: &WorkerEnv,
        mut store: StoreClient,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclCollective, CollectiveError> {
        probe()?;
        let deadline = Instant::now() + timeout;
        let setup = |detail: String| CollectiveError::Setup {
            backend: "nccl",
            detail,
        };
        let runtime = CudaRuntime::load().map_err(setup)?;
        runtime.set_device(device).map_err(setup)?;
        let (rank, world) = (env.rank as usize, env.world_size as usize);
        let id = unique_id(rank, &mut store, timeout).map_err(setup)?;
        let mut raw: sys::ncclComm_t = std::ptr::null_mut();
        let mut config = nonblocking_config();
        // SAFETY: valid out-pointer and config; all ranks pass the same id and world size.
        // Non-blocking: returns at once, the rendezvous goes on inside NCCL and is polled below.
        let r = unsafe {
            sys::ncclCommInitRankConfig(&mut raw, world as i32, id, rank as i32, &mut config)
        };
        // A handle came back even when init already failed (NCCL returns the communicator's
        // state): the owner below sees the error and aborts it once, so nothing leaks.
        if raw.is_null() {
            return Err(setup(format!(
                "ncclCommInitRankConfig (rank {rank} of {world}) failed: {}{}",
                CommFailure::Nccl {
                    code: r,
                    text: nccl_last_error()
                },
                init_hint(
                    std::env::var("NCCL_SOCKET_IFNAME").ok().as_deref(),
                    env.group_world_size,
                    &nccl_last_error()
                )
            )));
        }
        let raw = RawComm {
            comm: raw,
            device,
            runtime,
            stream: None,
        };
        let comm = Communicator::init(raw, deadline).map_err(|f| {
            let hint = init_hint(
                std::env::var("NCCL_SOCKET_IFNAME").ok().as_deref(),
                env.group_world_size,
                &f.to_string(),
            );
            setup(match f {
                CommFailure::Timeout => format!(
                    "NCCL communicator (rank {rank} of {world}) not ready within {:.1} s: a rank did not join, or NCCL could not reach it{hint}",
                    timeout.as_secs_f64()
                ),
                other => format!("NCCL communicator (rank {rank} of {world}): {other}{hint}"),
            })
        })?;
        Ok(NcclCollective {
            rank,
            world,
            device,
            comm,
            store,
            seq: 0,
            sent: 0,
        })
    }

    fn check(&self, op: &'static str, ctx: OpContext) -> Result<(), CollectiveError> {
        if !self.comm.is_live() {
            return Err(CollectiveError::Failed {
                op,
                step: ctx.step,
                detail: CommFailure::Aborted.to_string(),
            });
        }
        Ok(())
    }

    /// Runs one NCCL call to completion or to a message that says what went wrong.
    fn run(
        &mut self,
        op: &'static str,
        ctx: OpContext,
        call: Call,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        match self.comm.run(&call, deadline) {
            Ok(()) => Ok(()),
            // The communicator is already aborted: naming the silent ranks (a few seconds of
            // store traffic) cannot race with anything.
            Err(CommFailure::Timeout) => {
                // NCCL waits on no one rank in particular: the silent ranks are the news.
                let ranks: Vec<usize> = (0..self.world).collect();
                let who = silent_ranks(&mut self.store, "stall", self.seq, self.rank, &ranks, None);
                Err(CollectiveError::Timeout {
                    op,
                    step: ctx.step,
                    after: ctx.timeout.as_secs_f64(),
                    who,
                })
            }
            Err(cuda @ CommFailure::Cuda { .. }) => Err(CollectiveError::Failed {
                op,
                step: ctx.step,
                detail: cuda.to_string(),
            }),
            Err(other) => Err(CollectiveError::Failed {
                op,
                step: ctx.step,
                detail: format!("{other} (a peer failed?)"),
            }),
        }
    }

    /// A contiguous tensor on our device holding `t`'s values (a view when `t` already is one).
    fn on_device(&self, t: &Tensor) -> Result<Tensor, tch::TchError> {
        t.f_to_device(Device::Cuda(self.device))?.f_contiguous()
    }
}

/// Rank 0 creates the unique id and publishes it; the others wait for it.
fn unique_id(
    rank: usize,
    store: &mut StoreClient,
    timeout: Duration,
) -> Result<sys::ncclUniqueId, String> {
    if rank == 0 {
        let id = cudarc::nccl::result::get_uniqueid().map_err(|e| {
            format!(
                "ncclGetUniqueId: {}",
                CommFailure::Nccl {
                    code: e.0,
                    text: nccl_last_error()
                }
            )
        })?;
        let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
        store
            .set("nccl/unique-id", &bytes)
            .map_err(|e| format!("publishing the unique id: {e}"))?;
        return Ok(id);
    }
    let bytes = store
        .wait(&["nccl/unique-id"], timeout)
        .map_err(|e| format!("waiting for rank 0's unique id: {e}"))?;
    let mut id = sys::ncclUniqueId { internal: [0; 128] };
    if bytes[0].len() != 128 {
        return Err(format!(
            "rank 0's unique id has {} bytes, not 128",
            bytes[0].len()
        ));
    }
    for (dst, src) in id.internal.iter_mut().zip(&bytes[0]) {
        *dst = *src as std::ffi::c_char;
    }
    Ok(id)
}

fn nccl_type(kind: Kind) -> Option<sys::ncclDataType_t> {
    Some(match kind {
        Kind::Float => sys::ncclDataType_t::ncclFloat32,
        Kind::BFloat16 => sys::ncclDataType_t::ncclBfloat16,
        Kind::Half => sys::ncclDataType_t::ncclFloat16,
        Kind::Double => sys::ncclDataType_t::ncclFloat64,
        Kind::Int64 => sys::ncclDataType_t::ncclInt64,
        Kind::Int => sys::ncclDataType_t::ncclInt32,
        Kind::Uint8 => sys::ncclDataType_t::ncclUint8,
        Kind::Int8 => sys::ncclDataType_t::ncclInt8,
        _ => return None,
    })
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.world
    }

    fn name(&self) -> &'static str {
        "nccl"
    }

    fn all_reduce(
        &mut self,
        tensors: &mut [Tensor],
        op: ReduceOp,
        ctx: OpContext,
    ) -> Result<(), CollectiveError> {
        self.check("all_reduce", ctx)?;
        if tensors.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + ctx.timeout;
        self.seq += 1;
        let device = Device::Cuda(self.device);
        let direct = tensors.len() == 1
            && tensors[0].device() == device
            && tensors[0].is_contiguous()
            && matches!(tensors[0].kind(), Kind::Float | Kind::BFloat16);
        let flat = if direct {
            tensors[0].shallow_clone()
        } else {
            flatten_f32(tensors, device)?
        };
        let dtype = nccl_type(flat.kind()).unwrap_or(sys::ncclDataType_t::ncclFloat32);
        let red = match op {
            ReduceOp::Sum => sys::ncclRedOp_t::ncclSum,
            ReduceOp::Avg => sys::ncclRedOp_t::ncclAvg,
        };
        // In place on a contiguous device buffer of `numel` elements, alive until the wait ends.
        let call = Call::AllReduce {
            buf: flat.data_ptr(),
            count: flat.numel(),
            dtype,
            op: red,
        };
        self.run("all_reduce", ctx, call, deadline)?;
        // A ring all-reduce: a reduce-scatter and an all-gather, each (W-1)/W of the buffer.
        let bytes = (flat.numel() * flat.kind().elt_size_in_bytes()) as u64;
        self.sent += 2 * bytes * (self.world as u64 - 1) / self.world as u64;
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
        self.check("broadcast", ctx)?;
        let deadline = Instant::now() + ctx.timeout;
        for t in tensors.iter_mut() {
            self.seq += 1;
            let buf = self.on_device(t)?;
            let bytes = buf.numel() * buf.kind().elt_size_in_bytes();
            let call = Call::Broadcast {
                buf: buf.data_ptr(),
                bytes,
                root: root as i32,
            };
            self.run("broadcast", ctx, call, deadline)?;
            // Along the ring every rank but the last forwards the whole buffer.
            if (self.rank + 1) % self.world != root {
                self.sent += bytes as u64;
            }
            if buf.data_ptr() != t.data_ptr() {
                t.f_copy_(&buf)?;
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        tensor: &Tensor,
        ctx: OpContext,
    ) -> Result<Vec<Tensor>, CollectiveError> {
        self.check("all_gather", ctx)?;
        let deadline = Instant::now() + ctx.timeout;
        self.seq += 1;
        let mine = self.on_device(tensor)?;
        let mut shape = vec![self.world as i64];
        shape.extend(mine.size());
        let out = Tensor::f_zeros(shape.as_slice(), (mine.kind(), Device::Cuda(self.device)))?;
        let bytes = mine.numel() * mine.kind().elt_size_in_bytes();
        // Send `bytes` bytes, receive world x bytes into a contiguous buffer.
        let call = Call::AllGather {
            send: mine.data_ptr(),
            recv: out.data_ptr(),
            bytes,
        };
        self.run("all_gather", ctx, call, deadline)?;
        // Around the ring every part but the one arriving last passes through each rank.
        self.sent += (bytes * (self.world - 1)) as u64;
        (0..self.world as i64).map(|i| Ok(out.f_get(i)?)).collect()
    }

    fn bytes_sent(&self) -> Option<u64> {
        Some(self.sent)
    }

    fn barrier(&mut self, ctx: OpContext) -> Result<(), CollectiveError> {
        let mut token = [Tensor::f_ones(
            [1],
            (Kind::Float, Device::Cuda(self.device)),
        )?];
        self.all_reduce(&mut token, ReduceOp::Sum, ctx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_version_codes_of_both_encodings() {
        assert_eq!(version_of(2708), (2, 7));
        assert_eq!(version_of(21403), (2, 14));
        assert_eq!(version_of(22809), (2, 28));
    }

    #[test]
    fn a_failed_set_up_names_the_socket_interface_or_its_absence() {
        let unset = init_hint(None, 2, "");
        assert!(unset.contains("NCCL_SOCKET_IFNAME is unset"), "{unset}");
        assert_eq!(init_hint(Some(" "), 2, ""), unset);
        let set = init_hint(Some("ens5"), 2, "");
        assert!(set.contains("NCCL_SOCKET_IFNAME=ens5"), "{set}");
        // One node: the interface is not the cause.
        assert_eq!(init_hint(None, 1, ""), "");
        let twice = init_hint(
            None,
            1,
            "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 1e000",
        );
        assert!(
            twice.contains("two ranks on one GPU") && twice.contains("NCCL_HOSTID"),
            "{twice}"
        );
    }

    #[test]
    fn the_config_is_nccls_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        // The 2.28 header's struct: 3 header fields, 12 ints and 2 pointers.
        assert_eq!(c.size, 8 + 4 + 4 + 4 * 4 + 8 + 4 * 2 + 8 + 4 * 6);
        assert_eq!(c.minCTAs, i32::MIN);
    }

    /// On a machine without NCCL (CI), the probe explains instead of panicking; where NCCL is
    /// present it succeeds. Either way, no panic.
    #[test]
    fn probe_never_panics() {
        match probe() {
            Ok(()) => eprintln!("NCCL is loadable here"),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("libnccl.so"), "{text}");
                assert!(text.contains("dist.backend = \"tcp\""), "{text}");
            }
        }
    }
}
