//! Overlap of the dense gradient all-reduce with the backward pass
//! ([`super::DdpConfig::overlap_backward`]).
//!
//! Owns: the post-accumulate-grad hooks on the parameters of the dense buckets (through the
//! C++ shim `runtime/csrc/grad_hooks.cpp`), which say when autograd has accumulated into a
//! parameter's gradient during the window's last backward pass; and the communication thread
//! that, while that pass runs, reduces each bucket across the ranks (all-reduced, or
//! reduce-scattered under ZeRO: the engine says how) as soon as all of its gradients are final,
//! strictly in bucket order (as PyTorch's DDP reducer launches them), so every rank issues the
//! same operations in the same order, only earlier.
//!
//! Must not: regroup or reorder the buckets (the same all-reduce of the same bytes as the
//! engine's plain path gives the same numbers), touch the row-sparse tables or the summary (they
//! stay on the training thread, after backward), or start a bucket before each of its gradients
//! has been accumulated for the last time (a model whose `finish_backward` adds to gradients
//! says so through [`super::MicroBatchLoss::backward_is_whole`]; a gradient seen to grow again
//! after its bucket could start is an error, never a silent difference).

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use tch::Tensor;

use super::DdpError;
use crate::collective::{Collective, OpContext, ReduceOp};
use crate::shim::take_error;

/// What can go wrong with overlap itself (the collectives' own errors stay theirs).
#[derive(Debug, thiserror::Error)]
pub enum OverlapError {
    #[error("cannot hook the gradient of `{param}` (for dist.overlap_backward or dist.zero = 2): {detail}")]
    Hook { param: String, detail: String },
    #[error("step {step}: the gradient of `{param}` was accumulated into again after its bucket's all-reduce could start during backward (the model's finish_backward adds to gradients, but its MicroBatchLoss::backward_is_whole says it does not); set dist.overlap_backward = false (dist.zero = 1 under ZeRO stage 2)")]
    Late { step: u64, param: String },
}

/// The gradient hooks' shim, also ZeRO stage 3's gate's (`super::gate`).
pub(super) mod ffi {
    use std::ffi::{c_char, c_void};

    pub type GradReady = extern "C" fn(ctx: *const c_void, index: i64);
    pub type Release = extern "C" fn(ctx: *const c_void);

    extern "C" {
        /// See `csrc/grad_hooks.cpp`: takes ownership of `ctx` in every case; returns null or
        /// an error for [`crate::shim::take_error`].
        pub fn gptrec_set_grad_hook(
            tensor: *const torch_sys::C_tensor,
            ready: GradReady,
            release: Release,
            ctx: *const c_void,
            index: i64,
        ) -> *mut c_char;
        pub fn gptrec_clear_grad_hook(tensor: *const torch_sys::C_tensor) -> *mut c_char;
    }
}

/// The engine's side of overlap: the hooks it put on its parameters (taken off when it is
/// dropped) and the state they share with the communication thread.
pub(super) struct Overlap {
    readiness: Arc<Readiness>,
    /// The hooked parameters (shallow copies of the engine's).
    hooked: Vec<Tensor>,
    /// The engine's parameter names, for errors.
    names: Vec<String>,
    /// How many buckets the last step started before its backward pass had ended.
    pub(super) early: usize,
}

impl Overlap {
    /// Hooks every parameter of `buckets` (indices into `params`, named by `names`).
    pub(super) fn new(
        params: &[Tensor],
        names: &[String],
        buckets: &[Vec<usize>],
    ) -> Result<Overlap, OverlapError> {
        let readiness = Arc::new(Readiness::new(params.len(), buckets));
        let mut overlap = Overlap {
            readiness,
            hooked: Vec::new(),
            names: names.to_vec(),
            early: 0,
        };
        for &i in buckets.iter().flatten() {
            hook(&params[i], &overlap.readiness, i).map_err(|detail| OverlapError::Hook {
                param: names[i].clone(),
                detail,
            })?;
            // Kept at once: a failure on a later one unhooks it when `overlap` drops.
            overlap.hooked.push(params[i].shallow_clone());
        }
        Ok(overlap)
    }

    /// Runs `compute` (the window's micro-batches, which calls [`Arm::arm`] just before its
    /// last backward pass) on this thread while a communication thread reduces `buckets`
    /// (each bucket's parameters) in order with `reduce` (given the bucket's index and
    /// gradients; [`all_reduce_bucket`] for DDP), each as soon as its gradients are final or,
    /// at the latest, once `compute` has returned, whatever it returned (a rank with a loss
    /// that is not finite still takes part in every reduction). When `compute` fails, no
    /// further bucket starts. Returns what `compute` gave and the time spent waiting for the
    /// communication thread after it.
    pub(super) fn around<T>(
        &mut self,
        comm: &mut dyn Collective,
        buckets: Vec<Vec<Tensor>>,
        ctx: OpContext,
        reduce: &BucketReduce<'_>,
        compute: impl FnOnce(&Arm<'_>) -> Result<T, DdpError>,
    ) -> Result<(T, Duration), DdpError> {
        let readiness = &*self.readiness;
        readiness.prepare();
        let (computed, reduced, armed, waited) = std::thread::scope(|s| {
            let reducer = s.spawn(move || readiness.reduce_in_order(comm, buckets, ctx, reduce));
            // Ends the wait of the communication thread even if `compute` panics.
            let gate = GateGuard(Some(readiness));
            let computed = compute(&Arm(readiness));
            let armed = gate.finish(computed.is_ok());
            let waiting = Instant::now();
            let reduced = reducer
                .join()
                .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
            (computed, reduced, armed, waiting.elapsed())
        });
        let computed = computed?;
        self.early = reduced?;
        match readiness.twice.load(Ordering::Acquire) {
            late if armed && late > 0 => Err(OverlapError::Late {
                step: ctx.step,
                param: self.names[late - 1].clone(),
            }
            .into()),
            _ => Ok((computed, waited)),
        }
    }

    /// Hook calls per parameter (engine order; 0 for those not hooked) since the hooks were
    /// made, and the order in which parameters were first accumulated during the last armed
    /// pass.
    #[cfg(test)]
    pub(super) fn calls(&self) -> (Vec<u64>, Vec<usize>) {
        let calls = (self.readiness.calls.iter())
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        (calls, lock(&self.readiness.order).clone())
    }
}

impl Drop for Overlap {
    fn drop(&mut self) {
        for param in &self.hooked {
            // SAFETY: `param` is a live tch tensor; the shim only reads its autograd metadata
            // and removes the hook it made itself (which releases its `Readiness` reference).
            let error = unsafe { ffi::gptrec_clear_grad_hook(param.as_ptr()) };
            if let Err(e) = take_error(error) {
                tracing::warn!("could not remove a gradient hook: {e}");
            }
        }
    }
}

/// Handed to the window's computation: arms the hooks for the last backward pass.
pub(super) struct Arm<'a>(&'a Readiness);

impl Arm<'_> {
    /// Called just before the window's last backward pass. `whole`: that pass alone gives the
    /// gradients their final values (see [`super::MicroBatchLoss::backward_is_whole`]); only
    /// then may a bucket start before the computation has returned.
    pub(super) fn arm(&self, whole: bool) {
        if whole {
            self.0.armed.store(true, Ordering::Release);
        }
    }
}

/// Opens the gate when the computation is over; on unwinding, stops the communication thread.
struct GateGuard<'a>(Option<&'a Readiness>);

impl GateGuard<'_> {
    /// Every remaining bucket may go (`ok`) or none may start any more; returns whether the
    /// hooks were armed.
    fn finish(mut self, ok: bool) -> bool {
        self.0.take().is_some_and(|readiness| readiness.close(ok))
    }
}

impl Drop for GateGuard<'_> {
    fn drop(&mut self) {
        if let Some(readiness) = self.0.take() {
            readiness.close(false);
        }
    }
}

/// What the hooks and the communication thread share. Every hook holds a reference for as
/// long as it lives, which may be longer than the engine.
struct Readiness {
    /// Per parameter (engine order): its bucket (`None`: not hooked).
    bucket_of: Vec<Option<usize>>,
    /// Per bucket: how many parameters it holds.
    sizes: Vec<usize>,
    /// Set for the window's last backward pass (and its finish): hook calls before it are
    /// earlier micro-batches', whose gradients are not final.
    armed: AtomicBool,
    /// Per parameter: accumulated into since armed.
    seen: Vec<AtomicBool>,
    /// Per bucket: its parameters not yet accumulated into since armed.
    missing: Vec<AtomicUsize>,
    /// The first parameter accumulated into twice since armed (its index + 1; 0: none).
    twice: AtomicUsize,
    /// Parameters in the order they were first accumulated into since armed.
    order: Mutex<Vec<usize>>,
    /// Hook calls per parameter, armed or not.
    calls: Vec<AtomicU64>,
    gate: Mutex<Gate>,
    /// Signalled when a bucket becomes complete or the gate changes.
    wake: Condvar,
}

#[derive(Default)]
struct Gate {
    /// The computation is over: every bucket may go.
    open: bool,
    /// The computation failed: no bucket may start any more.
    stop: bool,
}

impl Readiness {
    fn new(params: usize, buckets: &[Vec<usize>]) -> Readiness {
        let mut bucket_of = vec![None; params];
        for (b, bucket) in buckets.iter().enumerate() {
            for &i in bucket {
                bucket_of[i] = Some(b);
            }
        }
        Readiness {
            bucket_of,
            sizes: buckets.iter().map(Vec::len).collect(),
            armed: AtomicBool::new(false),
            seen: (0..params).map(|_| AtomicBool::new(false)).collect(),
            missing: buckets.iter().map(|b| AtomicUsize::new(b.len())).collect(),
            twice: AtomicUsize::new(0),
            order: Mutex::new(Vec::new()),
            calls: (0..params).map(|_| AtomicU64::new(0)).collect(),
            gate: Mutex::new(Gate::default()),
            wake: Condvar::new(),
        }
    }

    /// Resets the state of a step, before its communication thread starts.
    fn prepare(&self) {
        self.armed.store(false, Ordering::Release);
        for seen in &self.seen {
            seen.store(false, Ordering::Relaxed);
        }
        for (missing, &size) in self.missing.iter().zip(&self.sizes) {
            missing.store(size, Ordering::Relaxed);
        }
        self.twice.store(0, Ordering::Relaxed);
        lock(&self.order).clear();
        *lock(&self.gate) = Gate::default();
    }

    /// The hook: autograd has just accumulated into parameter `index`'s gradient.
    fn accumulated(&self, index: usize) {
        let Some(calls) = self.calls.get(index) else {
            return;
        };
        calls.fetch_add(1, Ordering::Relaxed);
        if !self.armed.load(Ordering::Acquire) {
            return;
        }
        if self.seen[index].swap(true, Ordering::AcqRel) {
            let _ =
                (self.twice).compare_exchange(0, index + 1, Ordering::AcqRel, Ordering::Relaxed);
            return;
        }
        lock(&self.order).push(index);
        let Some(bucket) = self.bucket_of[index] else {
            return;
        };
        if self.missing[bucket].fetch_sub(1, Ordering::AcqRel) == 1 {
            // Under the lock: the communication thread checks `missing` under it before it
            // sleeps, so the wake-up cannot fall between its check and its wait.
            let _gate = lock(&self.gate);
            self.wake.notify_all();
        }
    }

    /// Ends the computation's part: disarms the hooks and opens the gate (`ok`) or stops the
    /// communication thread. Returns whether the hooks were armed.
    fn close(&self, ok: bool) -> bool {
        let armed = self.armed.swap(false, Ordering::AcqRel);
        let mut gate = lock(&self.gate);
        gate.open = true;
        gate.stop = !ok;
        self.wake.notify_all();
        armed
    }

    /// The communication thread: reduces each bucket in order once it may go. Returns how
    /// many started before the gate opened.
    fn reduce_in_order(
        &self,
        comm: &mut dyn Collective,
        buckets: Vec<Vec<Tensor>>,
        ctx: OpContext,
        reduce: &BucketReduce<'_>,
    ) -> Result<usize, DdpError> {
        let _no_grad = tch::no_grad_guard();
        let mut early = 0;
        for (b, params) in buckets.iter().enumerate() {
            match self.wait_for(b) {
                None => break,
                Some(before_gate) => early += usize::from(before_gate),
            }
            // The gradients are read there, not before: final once their hooks have run.
            reduce(comm, b, params, ctx)?;
        }
        Ok(early)
    }

    /// Waits until bucket `b` may go: `Some(true)` when all its gradients are final before the
    /// gate opened, `Some(false)` through the open gate, `None` when stopped.
    fn wait_for(&self, b: usize) -> Option<bool> {
        let mut gate = lock(&self.gate);
        loop {
            if gate.stop {
                return None;
            }
            if self.missing[b].load(Ordering::Acquire) == 0 {
                return Some(!gate.open);
            }
            if gate.open {
                return Some(false);
            }
            gate = self.wake.wait(gate).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// How the communication thread reduces bucket `b` (its parameters, whose gradients are
/// final): the same operations the engine's plain path runs after backward.
pub(super) type BucketReduce<'a> =
    dyn Fn(&mut dyn Collective, usize, &[Tensor], OpContext) -> Result<(), DdpError> + Sync + 'a;

/// DDP's reduction of a bucket: its parameters' gradients averaged over the ranks.
pub(super) fn all_reduce_bucket(
    comm: &mut dyn Collective,
    _bucket: usize,
    params: &[Tensor],
    ctx: OpContext,
) -> Result<(), DdpError> {
    let mut grads: Vec<Tensor> = params.iter().map(Tensor::grad).collect();
    comm.all_reduce(&mut grads, ReduceOp::Avg, ctx)?;
    Ok(())
}

/// A lock whose holder never panics in a way that leaves the data inconsistent (plain flags
/// and a list): a poisoned one is used as it is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Puts the gradient hook of parameter `index` on `param`.
fn hook(param: &Tensor, readiness: &Arc<Readiness>, index: usize) -> Result<(), String> {
    let ctx = Arc::into_raw(Arc::clone(readiness)).cast::<c_void>();
    // SAFETY: `param.as_ptr()` is tch's live `at::Tensor*` for this call. The shim takes the
    // reference `ctx` holds in every case and gives it back through `release` exactly once;
    // until then it calls `grad_ready` with it, which only reads through it.
    let error = unsafe {
        ffi::gptrec_set_grad_hook(param.as_ptr(), grad_ready, release, ctx, index as i64)
    };
    take_error(error)
}

/// The hook's callback, on the thread running backward (inside autograd's AccumulateGrad).
extern "C" fn grad_ready(ctx: *const c_void, index: i64) {
    // SAFETY: `ctx` is the `Arc<Readiness>` reference the calling hook holds until `release`.
    let readiness = unsafe { &*ctx.cast::<Readiness>() };
    // Nothing may unwind into C++ (it would abort): a panic here only loses the early start.
    let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
        readiness.accumulated(usize::try_from(index).unwrap_or(usize::MAX));
    }));
}

/// Gives back a hook's reference when the hook is destroyed.
extern "C" fn release(ctx: *const c_void) {
    // SAFETY: the reference `hook` made with `Arc::into_raw` for this hook, released once.
    drop(unsafe { Arc::from_raw(ctx.cast::<Readiness>()) });
}

#[cfg(test)]
#[path = "overlap_tests.rs"]
mod tests;
