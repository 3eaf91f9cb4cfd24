//! ZeRO stage 3's parameter gate ([`super::DdpConfig::zero`] = 3). Between uses a dense
//! bucket's parameters hold no values (their storage is released; the tensors, their shapes and
//! autograd metadata stay, as FSDP's `resize_(0)` leaves them) and this rank's shard of them,
//! in the layout, is the only copy. Each bucket is a *unit*: the parameters under one name
//! prefix the model declares ([`super::DdpConfig::units`]), or a group of the others, which
//! are gathered for the whole window (a model's embeddings and head, used at both ends).
//!
//! The model calls [`ParamGate::enter`] before a declared unit's forward (its values
//! all-gathered from every rank's shard) and [`ParamGate::leave`] after it (released again; in
//! a training forward the unit's outputs are hooked, so that the gradient reaching them first
//! gathers the unit again for its backward). Once autograd has accumulated a declared unit's
//! parameter's gradient, its values are released; in the window's last backward pass each unit,
//! once all its gradients are there and the units before it are done, is reduce-scattered
//! (stage 2's shard kept, the gradients dropped); those a pass did not complete (a parameter
//! the model did not use) after it, in order. Every collective runs on the thread that reaches
//! it, at a point the model's structure fixes: the same sequence on every rank, as long as which
//! parameters get a gradient does not depend on a rank's data (DDP's own rule without
//! `find_unused_parameters`).
//!
//! Owns: which parameters hold values, the hooks (taken off when the engine drops its
//! [`Gate`]) and the collective lent for a window. Must not: decide the layout (the layout
//! does), reorder the units, or run a collective outside a window or an explicit gathering
//! (every rank calls those at the same point).

use std::ffi::c_void;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use tch::Tensor;

use super::param_storage::release;
use super::zero::ZeroLayout;
use super::DdpError;
use crate::collective::{Collective, OpContext};
use crate::shim::take_error;

mod ffi {
    use std::ffi::{c_char, c_void};

    pub use super::super::overlap::ffi::{gptrec_clear_grad_hook, gptrec_set_grad_hook, Release};

    pub type BeforeBackward = extern "C" fn(ctx: *const c_void, unit: i64) -> i32;

    extern "C" {
        /// See `csrc/param_storage.cpp` (takes ownership of `ctx` in every case); null or an
        /// error for [`crate::shim::take_error`].
        pub fn gptrec_set_before_backward(
            tensor: *const torch_sys::C_tensor,
            call: BeforeBackward,
            release: Release,
            ctx: *const c_void,
            unit: i64,
        ) -> *mut c_char;
    }
}

fn shim_error(detail: String) -> DdpError {
    DdpError::Internal(format!("ZeRO stage 3's gate: {detail}"))
}

/// The collective a window lends the gate (see [`ParamGate::lend`]).
struct CommPtr(*mut (dyn Collective + 'static));

// SAFETY: the pointer is only dereferenced under the state's lock, while the `Lent` guard that
// made it keeps the engine's exclusive borrow of the collective alive.
unsafe impl Send for CommPtr {}

/// What the hooks, the model and the engine share.
struct Shared {
    layout: Arc<ZeroLayout>,
    /// Per unit (bucket): the declared name, or `None` for one gathered for the whole window.
    names: Vec<Option<String>>,
    /// Every name the model declared, with or without trainable parameters.
    declared: Vec<String>,
    state: Mutex<State>,
}

struct State {
    /// Shallow copies of the engine's parameters.
    params: Vec<Tensor>,
    comm: Option<CommPtr>,
    ctx: OpContext,
    /// Every unit holds its values and keeps them until the next window (from the start, and
    /// after [`ParamGate::gather_all`]): entering and leaving change nothing.
    whole: bool,
    /// Per parameter: it holds its values now.
    filled: Vec<bool>,
    /// The window's last backward pass has started and gives the gradients their final values:
    /// the units are reduced as they complete.
    armed: bool,
    /// Per parameter: its gradient was accumulated during the current backward pass.
    accumulated: Vec<bool>,
    /// The next unit to reduce, in order, during the armed pass.
    next: usize,
    /// The first error a hook met (hooks cannot return one to the engine).
    error: Option<DdpError>,
    /// The most declared units that held their values at once since the last window opened.
    #[cfg(test)]
    most_held: usize,
}

/// ZeRO stage 3's handle for the model: see the module's documentation. Cheap to clone.
#[derive(Clone)]
pub struct ParamGate(Arc<Shared>);

impl std::fmt::Debug for ParamGate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParamGate")
            .field("units", &self.0.names)
            .finish()
    }
}

/// The engine's side: the gate and its gradient hooks, taken off when it is dropped.
pub(super) struct Gate {
    pub(super) gate: ParamGate,
    hooked: Vec<Tensor>,
}

impl Gate {
    /// A gate over `params` (named `param_names`) laid out by `layout` (stage 3), whose
    /// buckets are the units `names` (`None`: gathered for a whole window); every parameter
    /// holds its values at first, as after [`ParamGate::gather_all`]. `declared`: every unit
    /// name the model may enter (one without trainable parameters has no bucket).
    pub(super) fn new(
        layout: Arc<ZeroLayout>,
        params: &[Tensor],
        param_names: &[String],
        names: Vec<Option<String>>,
        declared: Vec<String>,
    ) -> Result<Gate, DdpError> {
        let state = State {
            params: params.iter().map(Tensor::shallow_clone).collect(),
            comm: None,
            ctx: OpContext {
                step: 0,
                timeout: std::time::Duration::from_secs(1),
            },
            whole: true,
            filled: vec![true; params.len()],
            armed: false,
            accumulated: vec![false; params.len()],
            next: 0,
            error: None,
            #[cfg(test)]
            most_held: 0,
        };
        let shared = Arc::new(Shared {
            layout,
            names,
            declared,
            state: Mutex::new(state),
        });
        let mut gate = Gate {
            gate: ParamGate(shared),
            hooked: Vec::new(),
        };
        let layout = Arc::clone(&gate.gate.0.layout);
        for b in 0..layout.bucket_count() {
            for &i in layout.members(b) {
                let ctx = Arc::into_raw(Arc::clone(&gate.gate.0)) as *const c_void;
                // SAFETY: a live tch tensor; the shim takes ownership of `ctx` (an `Arc`
                // reference, released by `release_shared`) whatever happens.
                let error = unsafe {
                    ffi::gptrec_set_grad_hook(
                        params[i].as_ptr(),
                        accumulated,
                        release_shared,
                        ctx,
                        i as i64,
                    )
                };
                take_error(error).map_err(|detail| {
                    DdpError::Internal(format!(
                        "cannot hook the gradient of `{}` (ZeRO stage 3): {detail}",
                        param_names[i]
                    ))
                })?;
                gate.hooked.push(params[i].shallow_clone());
            }
        }
        Ok(gate)
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        for param in &self.hooked {
            // SAFETY: a live tch tensor; the shim removes only its own hook (which releases its
            // reference to the shared state).
            let error = unsafe { ffi::gptrec_clear_grad_hook(param.as_ptr()) };
            if let Err(e) = take_error(error) {
                tracing::warn!("could not remove a gradient hook: {e}");
            }
        }
    }
}

/// The collective lent to the gate for a window; withdrawn when dropped.
pub(super) struct Lent<'a> {
    shared: &'a Shared,
    _borrow: std::marker::PhantomData<&'a mut dyn Collective>,
}

impl Drop for Lent<'_> {
    fn drop(&mut self) {
        let mut state = self.shared.lock();
        state.comm = None;
        state.armed = false;
    }
}

impl ParamGate {
    /// The most declared units that held their values at once during the last window.
    #[cfg(test)]
    pub(super) fn most_units_held(&self) -> usize {
        self.0.lock().most_held
    }

    /// How many units the model declared that hold trainable parameters.
    pub fn units(&self) -> usize {
        self.0.names.iter().filter(|n| n.is_some()).count()
    }

    /// Before unit `name`'s forward: its parameters' values, gathered from every rank's shard
    /// where they were released. Every rank must enter the same units in the same order.
    pub fn enter(&self, name: &str) -> Result<(), DdpError> {
        let Some(unit) = self.0.unit(name)? else {
            return Ok(());
        };
        let mut state = self.0.lock();
        self.0.gather(&mut state, unit)
    }

    /// After unit `name`'s forward, given its inputs and outputs: releases its parameters'
    /// values and, in a forward that autograd records, hooks each output that requires grad so
    /// that the unit is gathered again before its backward runs, and each input that requires
    /// grad so that its values go again once that backward is done (the gradient with respect
    /// to an input is complete only after every node of the unit that reads its values has
    /// run). Without the second hook a unit the model runs twice a micro-batch (the recommender
    /// runs GPT-2 on users' and items' texts) would stay gathered from the first pass's
    /// backward until the second's, and every block with it.
    pub fn leave(
        &self,
        name: &str,
        inputs: &[&Tensor],
        outputs: &[&Tensor],
    ) -> Result<(), DdpError> {
        let Some(unit) = self.0.unit(name)? else {
            return Ok(());
        };
        {
            let mut state = self.0.lock();
            if state.whole {
                return Ok(());
            }
            self.0.release_unit(&mut state, unit)?;
        }
        // Under no_grad nothing requires grad: no backward will come.
        let needing = |ts: &[&Tensor]| -> Vec<Tensor> {
            (ts.iter())
                .filter(|t| t.requires_grad())
                .map(|t| t.shallow_clone())
                .collect()
        };
        for output in needing(outputs) {
            self.hook(&output, before_backward, unit)?;
        }
        for input in needing(inputs) {
            self.hook(&input, after_backward, unit)?;
        }
        Ok(())
    }

    /// Runs `call` with unit `unit` each time autograd has computed the gradient with respect
    /// to `tensor`.
    fn hook(
        &self,
        tensor: &Tensor,
        call: ffi::BeforeBackward,
        unit: usize,
    ) -> Result<(), DdpError> {
        let ctx = Arc::into_raw(Arc::clone(&self.0)) as *const c_void;
        // SAFETY: a live tch tensor; the shim takes ownership of `ctx` (an `Arc` reference,
        // released by `release_shared`) whatever happens.
        let error = unsafe {
            ffi::gptrec_set_before_backward(tensor.as_ptr(), call, release_shared, ctx, unit as i64)
        };
        take_error(error).map_err(shim_error)
    }

    /// Gathers every unit and keeps all values until the next window (for an evaluation, a
    /// checkpoint, or reading the parameters): every rank at the same point.
    pub(super) fn gather_all(
        &self,
        comm: &mut dyn Collective,
        ctx: OpContext,
    ) -> Result<(), DdpError> {
        let mut state = self.0.lock();
        if state.whole {
            return Ok(());
        }
        for b in 0..self.0.layout.bucket_count() {
            let members = self.0.tensors(&state, b);
            self.0.layout.gather_bucket(comm, b, &members, ctx)?;
            for &i in self.0.layout.members(b) {
                state.filled[i] = true;
            }
        }
        state.whole = true;
        Ok(())
    }

    /// Opens a window: lends it `comm`; after [`ParamGate::gather_all`] (or at first) takes
    /// this rank's shards from the whole values; then gathers the window-long units and
    /// releases the declared ones.
    pub(super) fn lend<'a>(
        &'a self,
        comm: &'a mut (dyn Collective + 'static),
        ctx: OpContext,
    ) -> Result<Lent<'a>, DdpError> {
        let mut state = self.0.lock();
        state.comm = Some(CommPtr(comm as *mut (dyn Collective + 'static)));
        state.ctx = ctx;
        state.armed = false;
        state.next = 0;
        state.accumulated.iter_mut().for_each(|a| *a = false);
        #[cfg(test)]
        {
            state.most_held = 0;
        }
        let opened = self.0.open(&mut state);
        if opened.is_err() {
            state.comm = None;
        }
        drop(state);
        opened?;
        Ok(Lent {
            shared: &self.0,
            _borrow: std::marker::PhantomData,
        })
    }

    /// Just before the window's last backward pass (`whole`: it alone gives the gradients their
    /// final values): from then on each unit is reduce-scattered once complete.
    pub(super) fn arm(&self, whole: bool) {
        let mut state = self.0.lock();
        state.accumulated.iter_mut().for_each(|a| *a = false);
        state.armed = whole;
    }

    /// Ends a window's computation (`ok`: it succeeded): the error a hook kept, if any; after an
    /// armed pass, the units it did not complete (a parameter the model did not use: zero
    /// gradients, as DDP's) reduced in order; then every value released. Returns whether the
    /// units are reduced (else the engine reduces them all).
    pub(super) fn close(&self, ok: bool) -> Result<bool, DdpError> {
        let mut state = self.0.lock();
        if let Some(error) = state.error.take() {
            return Err(error);
        }
        let armed = std::mem::take(&mut state.armed);
        if ok && armed {
            self.0.reduce_from(&mut state, |_, _| true)?;
        }
        for b in 0..self.0.layout.bucket_count() {
            self.0.release_unit(&mut state, b)?;
        }
        Ok(ok && armed)
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A window's start: the shards taken from whole values, the window-long units gathered,
    /// the declared ones released.
    fn open(&self, state: &mut State) -> Result<(), DdpError> {
        // Copies between parameters and shards are not part of any model's graph.
        let _no_grad = tch::no_grad_guard();
        if state.whole {
            self.layout.take_param_shards(&state.params)?;
            state.whole = false;
        }
        for (b, name) in self.names.iter().enumerate() {
            match name {
                None => self.gather(state, b)?,
                Some(_) => self.release_unit(state, b)?,
            }
        }
        Ok(())
    }

    /// Unit `name`'s bucket: `None` for a declared unit without trainable dense parameters.
    fn unit(&self, name: &str) -> Result<Option<usize>, DdpError> {
        match self.names.iter().position(|n| n.as_deref() == Some(name)) {
            Some(b) => Ok(Some(b)),
            None if self.declared.iter().any(|d| d == name) => Ok(None),
            None => Err(DdpError::Internal(format!(
                "ZeRO stage 3: the model entered unit `{name}`, which it did not declare in DdpConfig::units"
            ))),
        }
    }

    /// Unit `b`'s parameters (shallow copies), in bucket order.
    fn tensors(&self, state: &State, b: usize) -> Vec<Tensor> {
        (self.layout.members(b).iter())
            .map(|&i| state.params[i].shallow_clone())
            .collect()
    }

    /// Unit `b`'s values, gathered where any of its parameters was released.
    fn gather(&self, state: &mut State, b: usize) -> Result<(), DdpError> {
        let _no_grad = tch::no_grad_guard();
        let members = self.layout.members(b);
        if members.iter().all(|&i| state.filled[i]) {
            return Ok(());
        }
        let Some(comm) = &state.comm else {
            return Err(DdpError::Internal(
                "ZeRO stage 3: the model used its parameters outside a training step; call Ddp::gather_params first (every rank)".into(),
            ));
        };
        // SAFETY: the `Lent` guard that set the pointer keeps the engine's exclusive borrow of
        // the collective until it is dropped, which clears it under this same lock.
        let comm = unsafe { &mut *comm.0 };
        let tensors = self.tensors(state, b);
        self.layout.gather_bucket(comm, b, &tensors, state.ctx)?;
        members.iter().for_each(|&i| state.filled[i] = true);
        #[cfg(test)]
        {
            let held = (0..self.names.len())
                .filter(|&u| self.names[u].is_some())
                .filter(|&u| self.layout.members(u).iter().all(|&i| state.filled[i]))
                .count();
            state.most_held = state.most_held.max(held);
        }
        Ok(())
    }

    fn release_unit(&self, state: &mut State, b: usize) -> Result<(), DdpError> {
        for &i in self.layout.members(b) {
            if state.filled[i] {
                release(&state.params[i])?;
                state.filled[i] = false;
            }
        }
        Ok(())
    }

    /// Autograd has accumulated parameter `i`'s gradient in this pass.
    fn accumulated(&self, i: usize) -> Result<(), DdpError> {
        let mut state = self.lock();
        if state.whole || state.comm.is_none() {
            return Ok(()); // a backward pass outside a window: the engine's business
        }
        state.accumulated[i] = true;
        let Some(b) = self.layout.bucket_of(i) else {
            return Ok(());
        };
        // A declared unit's values are needed again only after its next `enter` or its
        // gradient hook; a window-long one's until the window ends.
        if self.names[b].is_some() && state.filled[i] {
            release(&state.params[i])?;
            state.filled[i] = false;
        }
        if !state.armed {
            return Ok(());
        }
        self.reduce_from(&mut state, |accumulated, members| {
            members.iter().all(|&m| accumulated[m])
        })
    }

    /// Reduce-scatters the units from the next one on, in order, while `ready` (given which
    /// parameters were accumulated in this pass, and the unit's members) says so.
    fn reduce_from(
        &self,
        state: &mut State,
        ready: impl Fn(&[bool], &[usize]) -> bool,
    ) -> Result<(), DdpError> {
        let _no_grad = tch::no_grad_guard();
        while state.next < self.layout.bucket_count() {
            let next = state.next;
            let members = self.layout.members(next);
            if !ready(&state.accumulated, members) {
                break;
            }
            let tensors = self.tensors(state, next);
            let Some(comm) = &state.comm else {
                break;
            };
            // SAFETY: as in `gather`.
            let comm = unsafe { &mut *comm.0 };
            self.layout.reduce_bucket(comm, next, &tensors, state.ctx)?;
            state.next += 1;
        }
        Ok(())
    }

    /// Keeps the first error a hook met, for [`ParamGate::close`].
    fn keep(&self, error: DdpError) {
        let mut state = self.lock();
        state.error.get_or_insert(error);
    }
}

/// The post-accumulate-grad hook: must not unwind into C++.
extern "C" fn accumulated(ctx: *const c_void, index: i64) {
    // SAFETY: `ctx` is an `Arc<Shared>` reference the hook owns until `release_shared`.
    let shared = unsafe { &*(ctx as *const Shared) };
    let done = std::panic::catch_unwind(AssertUnwindSafe(|| shared.accumulated(index as usize)));
    match done {
        Ok(Ok(())) => {}
        Ok(Err(e)) => shared.keep(e),
        Err(_) => shared.keep(DdpError::Internal(
            "ZeRO stage 3's gradient hook panicked".into(),
        )),
    }
}

/// The hook on a unit's output: gathers the unit before its backward; non-zero stops the pass.
extern "C" fn before_backward(ctx: *const c_void, unit: i64) -> i32 {
    // SAFETY: as in `accumulated`.
    let shared = unsafe { &*(ctx as *const Shared) };
    let done = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut state = shared.lock();
        if state.whole {
            return Ok(());
        }
        shared.gather(&mut state, unit as usize)
    }));
    let error = match done {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e,
        Err(_) => DdpError::Internal("ZeRO stage 3's backward hook panicked".into()),
    };
    shared.keep(error);
    1
}

/// The hook on a unit's input: its backward is done for this pass, its values go.
extern "C" fn after_backward(ctx: *const c_void, unit: i64) -> i32 {
    // SAFETY: as in `accumulated`.
    let shared = unsafe { &*(ctx as *const Shared) };
    let done = std::panic::catch_unwind(AssertUnwindSafe(|| {
        let mut state = shared.lock();
        match state.whole {
            true => Ok(()),
            false => shared.release_unit(&mut state, unit as usize),
        }
    }));
    let error = match done {
        Ok(Ok(())) => return 0,
        Ok(Err(e)) => e,
        Err(_) => DdpError::Internal("ZeRO stage 3's backward hook panicked".into()),
    };
    shared.keep(error);
    1
}

extern "C" fn release_shared(ctx: *const c_void) {
    // SAFETY: made by `Arc::into_raw` for this hook, released once.
    drop(unsafe { Arc::from_raw(ctx as *const Shared) });
}
