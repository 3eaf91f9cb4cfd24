//! The `nccl` backend: CUDA tensors reduced in place on the device through NCCL, via `cudarc`'s
//! bindings with dynamic loading (the crate builds, and every CPU path runs, on machines without
//! CUDA or NCCL). Rank 0 creates the 128-byte unique id and publishes it in the rendezvous store.
//! Operations are queued on the legacy default stream, the one libtorch uses unless told
//! otherwise, so they are ordered with the surrounding libtorch work; each one is then waited for
//! with a deadline, and a communicator that misses it is aborted (no rank hangs forever).
//! It must never panic when the library is missing: [`probe`] turns that into an error first.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use common::env_contract::WorkerEnv;
use cudarc::nccl::sys;
use tch::{Device, Kind, Tensor};

use super::{
    flatten_f32, silent_ranks, unflatten_into, Collective, CollectiveError, OpContext, ReduceOp,
};
use crate::store::StoreClient;

/// Checks that NCCL can be loaded, before anything touches `cudarc` (which panics otherwise).
pub fn probe() -> Result<(), CollectiveError> {
    // SAFETY: only tries to dlopen the candidate names.
    if unsafe { sys::is_culib_present() } {
        return Ok(());
    }
    let candidates = cudarc::get_lib_name_candidates("nccl");
    Err(CollectiveError::Setup {
        backend: "nccl",
        detail: format!(
            "the NCCL library could not be loaded (looked for {} on LD_LIBRARY_PATH and the binary's rpath). \
             PyTorch's wheel ships it as nvidia/nccl/lib/libnccl.so.2 only: run scripts/setup.sh (which adds the libnccl.so link), \
             or `ln -s libnccl.so.2 libnccl.so` in that directory and put it on LD_LIBRARY_PATH; or use dist.backend = \"tcp\"",
            candidates.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
        ),
    })
}

/// The few CUDA runtime calls we need, from the libcudart libtorch already loaded.
struct CudaRuntime {
    set_device: libloading::os::unix::Symbol<unsafe extern "C" fn(i32) -> i32>,
    stream_query: libloading::os::unix::Symbol<unsafe extern "C" fn(*mut c_void) -> i32>,
}

impl CudaRuntime {
    fn load() -> Result<CudaRuntime, CollectiveError> {
        let fail = |what: &str, e: libloading::Error| CollectiveError::Setup {
            backend: "nccl",
            detail: format!("the CUDA runtime ({what}) is not available in this process: {e}"),
        };
        let this = libloading::os::unix::Library::this();
        // SAFETY: the signatures are those of the CUDA runtime API.
        unsafe {
            Ok(CudaRuntime {
                set_device: this
                    .get(b"cudaSetDevice\0")
                    .map_err(|e| fail("cudaSetDevice", e))?,
                stream_query: this
                    .get(b"cudaStreamQuery\0")
                    .map_err(|e| fail("cudaStreamQuery", e))?,
            })
        }
    }
}

/// One rank's NCCL communicator.
pub struct NcclCollective {
    rank: usize,
    world: usize,
    device: usize,
    comm: sys::ncclComm_t,
    runtime: CudaRuntime,
    store: StoreClient,
    seq: u64,
    /// Set once an operation failed: the communicator was aborted and must not be used.
    broken: bool,
    watchdog: Watchdog,
}

/// A communicator handle that may cross threads (NCCL allows abort from another thread).
struct CommHandle(sys::ncclComm_t);
// SAFETY: an opaque handle; NCCL functions used from other threads (abort) are thread-safe.
unsafe impl Send for CommHandle {}

/// (deadline of the operation in flight, whether the watchdog fired)
type WatchState = (Option<Instant>, bool);

/// Aborts the communicator when an operation outlives its deadline, which unblocks a host
/// thread stuck inside an NCCL call (e.g. connecting to a peer that is gone).
struct Watchdog {
    /// (deadline of the operation in flight, whether the watchdog fired)
    state: std::sync::Arc<std::sync::Mutex<WatchState>>,
}

impl Watchdog {
    fn start(comm: CommHandle) -> Watchdog {
        let state = std::sync::Arc::new(std::sync::Mutex::new((None, false)));
        let shared = std::sync::Arc::downgrade(&state);
        let _ = std::thread::Builder::new()
            .name("nccl-watchdog".into())
            .spawn(move || {
                let comm = comm;
                loop {
                    std::thread::sleep(Duration::from_millis(100));
                    let Some(state) = shared.upgrade() else {
                        return;
                    };
                    let Ok(mut guard) = state.lock() else {
                        return;
                    };
                    if let Some(deadline) = guard.0 {
                        if Instant::now() > deadline + Duration::from_secs(1) && !guard.1 {
                            guard.1 = true;
                            // SAFETY: abort from another thread is what NCCL provides it for.
                            unsafe { sys::ncclCommAbort(comm.0) };
                            return;
                        }
                    }
                }
            });
        Watchdog { state }
    }

    fn arm(&self, deadline: Instant) {
        if let Ok(mut guard) = self.state.lock() {
            guard.0 = Some(deadline);
        }
    }

    fn disarm(&self) {
        if let Ok(mut guard) = self.state.lock() {
            guard.0 = None;
        }
    }

    fn fired(&self) -> bool {
        self.state.lock().map(|g| g.1).unwrap_or(true)
    }
}

// SAFETY: the communicator handle is only used through &mut self, one thread at a time.
unsafe impl Send for NcclCollective {}

/// Cudart's "not ready" status for cudaStreamQuery.
const CUDA_ERROR_NOT_READY: i32 = 600;

impl NcclCollective {
    /// Creates the communicator of `env.rank` on CUDA device `device`.
    pub fn connect(
        env: &WorkerEnv,
        mut store: StoreClient,
        device: usize,
        timeout: Duration,
    ) -> Result<NcclCollective, CollectiveError> {
        probe()?;
        let runtime = CudaRuntime::load()?;
        let setup = |detail: String| CollectiveError::Setup {
            backend: "nccl",
            detail,
        };
        // SAFETY: plain runtime call.
        let status = unsafe { (runtime.set_device)(device as i32) };
        if status != 0 {
            return Err(setup(format!(
                "cudaSetDevice({device}) failed with CUDA error {status}"
            )));
        }
        let (rank, world) = (env.rank as usize, env.world_size as usize);
        let id = if rank == 0 {
            let id = cudarc::nccl::result::get_uniqueid()
                .map_err(|e| setup(format!("ncclGetUniqueId: {:?}", e.0)))?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            store
                .set("nccl/unique-id", &bytes)
                .map_err(|e| setup(format!("publishing the unique id: {e}")))?;
            id
        } else {
            let bytes = store
                .wait(&["nccl/unique-id"], timeout)
                .map_err(|e| setup(format!("waiting for rank 0's unique id: {e}")))?;
            let mut id = sys::ncclUniqueId { internal: [0; 128] };
            if bytes[0].len() != 128 {
                return Err(setup(format!(
                    "rank 0's unique id has {} bytes, not 128",
                    bytes[0].len()
                )));
            }
            for (dst, src) in id.internal.iter_mut().zip(&bytes[0]) {
                *dst = *src as std::ffi::c_char;
            }
            id
        };
        // ncclCommInitRank blocks until every rank has joined: run it on a helper thread so that
        // a rank that never comes makes this one fail after the timeout instead of hanging (the
        // stuck thread goes away with the process).
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("nccl-init".into())
            .spawn(move || {
                // SAFETY: plain runtime call (the device is per thread in CUDA); `comm` is a
                // valid out-pointer; all ranks pass the same id and world size.
                let result = unsafe {
                    if let Ok(rt) = CudaRuntime::load() {
                        (rt.set_device)(device as i32);
                    }
                    let mut comm: sys::ncclComm_t = std::ptr::null_mut();
                    cudarc::nccl::result::comm_init_rank(&mut comm, world as i32, id, rank as i32)
                        .map(|_| CommHandle(comm))
                        .map_err(|e| e.0)
                };
                let _ = tx.send(result);
            })
            .map_err(|e| setup(format!("cannot start the NCCL init thread: {e}")))?;
        let comm = match rx.recv_timeout(timeout) {
            Ok(Ok(handle)) => handle.0,
            Ok(Err(code)) => {
                return Err(setup(format!(
                    "ncclCommInitRank (rank {rank} of {world}) failed: {code:?}"
                )))
            }
            Err(_) => {
                return Err(setup(format!(
                    "ncclCommInitRank (rank {rank} of {world}) did not complete within {:.1} s: a rank did not join",
                    timeout.as_secs_f64()
                )))
            }
        };
        let watchdog = Watchdog::start(CommHandle(comm));
        Ok(NcclCollective {
            rank,
            world,
            device,
            comm,
            runtime,
            store,
            seq: 0,
            broken: false,
            watchdog,
        })
    }

    fn check(&self, op: &'static str) -> Result<(), CollectiveError> {
        if self.broken {
            return Err(CollectiveError::Unsupported {
                op,
                detail: "the NCCL communicator was aborted after an earlier failure".into(),
            });
        }
        Ok(())
    }

    /// Turns an NCCL status into our error (a timeout when the watchdog aborted the call).
    fn nccl(
        &mut self,
        op: &'static str,
        ctx: OpContext,
        r: sys::ncclResult_t,
    ) -> Result<(), CollectiveError> {
        match r {
            sys::ncclResult_t::ncclSuccess => Ok(()),
            _ if self.watchdog.fired() => {
                self.broken = true;
                self.watchdog.disarm();
                Err(self.timeout_error(op, ctx))
            }
            other => {
                self.watchdog.disarm();
                self.abort();
                Err(CollectiveError::Failed {
                    op,
                    step: ctx.step,
                    detail: format!("NCCL returned {other:?}"),
                })
            }
        }
    }

    fn timeout_error(&mut self, op: &'static str, ctx: OpContext) -> CollectiveError {
        let upstream = (self.rank + self.world - 1) % self.world;
        let who = silent_ranks(&mut self.store, self.seq, self.rank, self.world, upstream);
        CollectiveError::Timeout {
            op,
            step: ctx.step,
            after: ctx.timeout.as_secs_f64(),
            who,
        }
    }

    /// Waits for the queued work on the default stream, up to the deadline.
    fn wait(
        &mut self,
        op: &'static str,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        let result = self.wait_inner(op, ctx, deadline);
        self.watchdog.disarm();
        result
    }

    fn wait_inner(
        &mut self,
        op: &'static str,
        ctx: OpContext,
        deadline: Instant,
    ) -> Result<(), CollectiveError> {
        loop {
            // SAFETY: querying the legacy default stream (null).
            let status = unsafe { (self.runtime.stream_query)(std::ptr::null_mut()) };
            if status == 0 {
                return Ok(());
            }
            if status != CUDA_ERROR_NOT_READY {
                self.abort();
                return Err(CollectiveError::Failed {
                    op,
                    step: ctx.step,
                    detail: format!("CUDA error {status} while waiting for NCCL"),
                });
            }
            let mut async_error = sys::ncclResult_t::ncclSuccess;
            // SAFETY: valid communicator and out-pointer.
            unsafe { sys::ncclCommGetAsyncError(self.comm, &mut async_error) };
            if !matches!(
                async_error,
                sys::ncclResult_t::ncclSuccess | sys::ncclResult_t::ncclInProgress
            ) {
                self.abort();
                return Err(CollectiveError::Failed {
                    op,
                    step: ctx.step,
                    detail: format!("NCCL reported {async_error:?} (a peer failed?)"),
                });
            }
            if Instant::now() >= deadline {
                self.abort();
                return Err(self.timeout_error(op, ctx));
            }
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    fn abort(&mut self) {
        if self.watchdog.fired() {
            self.broken = true; // already aborted by the watchdog
        }
        if !self.broken {
            self.broken = true;
            // SAFETY: the communicator is valid until aborted; never used afterwards.
            unsafe { sys::ncclCommAbort(self.comm) };
        }
    }

    /// A contiguous tensor on our device holding `t`'s values (a view when `t` already is one).
    fn on_device(&self, t: &Tensor) -> Result<Tensor, tch::TchError> {
        t.f_to_device(Device::Cuda(self.device))?.f_contiguous()
    }
}

impl Drop for NcclCollective {
    fn drop(&mut self) {
        self.watchdog.disarm();
        if !self.broken && !self.watchdog.fired() {
            // SAFETY: valid communicator, destroyed once.
            unsafe { sys::ncclCommDestroy(self.comm) };
        }
    }
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
        self.check("all_reduce")?;
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
        let ptr = flat.data_ptr();
        self.watchdog.arm(deadline);
        // SAFETY: in-place all-reduce on a contiguous device buffer of `numel` elements.
        let r = unsafe {
            sys::ncclAllReduce(
                ptr,
                ptr,
                flat.numel(),
                dtype,
                red,
                self.comm,
                std::ptr::null_mut(),
            )
        };
        self.nccl("all_reduce", ctx, r)?;
        self.wait("all_reduce", ctx, deadline)?;
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
        self.check("broadcast")?;
        let deadline = Instant::now() + ctx.timeout;
        for t in tensors.iter_mut() {
            self.seq += 1;
            let buf = self.on_device(t)?;
            let bytes = buf.numel() * buf.kind().elt_size_in_bytes();
            let ptr = buf.data_ptr();
            self.watchdog.arm(deadline);
            // SAFETY: in-place broadcast of `bytes` bytes of a contiguous device buffer.
            let r = unsafe {
                sys::ncclBroadcast(
                    ptr,
                    ptr,
                    bytes,
                    sys::ncclDataType_t::ncclUint8,
                    root as i32,
                    self.comm,
                    std::ptr::null_mut(),
                )
            };
            self.nccl("broadcast", ctx, r)?;
            self.wait("broadcast", ctx, deadline)?;
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
        self.check("all_gather")?;
        let deadline = Instant::now() + ctx.timeout;
        self.seq += 1;
        let mine = self.on_device(tensor)?;
        let mut shape = vec![self.world as i64];
        shape.extend(mine.size());
        let out = Tensor::f_zeros(shape.as_slice(), (mine.kind(), Device::Cuda(self.device)))?;
        let bytes = mine.numel() * mine.kind().elt_size_in_bytes();
        self.watchdog.arm(deadline);
        // SAFETY: send `bytes` bytes, receive world * bytes into a contiguous buffer.
        let r = unsafe {
            sys::ncclAllGather(
                mine.data_ptr(),
                out.data_ptr(),
                bytes,
                sys::ncclDataType_t::ncclUint8,
                self.comm,
                std::ptr::null_mut(),
            )
        };
        self.nccl("all_gather", ctx, r)?;
        self.wait("all_gather", ctx, deadline)?;
        (0..self.world as i64).map(|i| Ok(out.f_get(i)?)).collect()
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
