//! The optimizer: AdamW over `tch` tensors, the learning-rate schedule, and the optimizer state
//! a checkpoint needs to continue exactly.
//!
//! Owns: `torch.optim.AdamW`'s update math (fused on the CPU, split over the intra-op threads
//! for large tensors), where the moments live (beside the parameters, or in host memory with
//! the update run there: ZeRO-Offload's optimizer half), warm-up + constant / linear / cosine
//! LR schedules, and turning the moments and step counter into named tensors (and back) for
//! `optimizer.safetensors`. Clipping is `clip`'s.
//!
//! Must not: know the model or parameter names, talk to other ranks (gradients arrive already
//! all-reduced, so every rank computes the same update), or touch files (the `checkpoint`
//! module writes what `state_tensors` returns).

use std::collections::HashMap;
use std::ops::Range;

use tch::{Device, Kind, Tensor};
use thiserror::Error;

mod multi_tensor;

/// Shape of the learning-rate curve after warm-up: `train.lr_schedule`'s own type.
pub use common::config::LrScheduleKind as Schedule;

/// Learning rate as a function of the number of optimizer steps already taken.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LrSchedule {
    pub peak_lr: f64,
    pub warmup_steps: u64,
    pub total_steps: u64,
    pub schedule: Schedule,
    pub min_lr: f64,
}

impl LrSchedule {
    /// The learning rate for the optimizer step that follows `step` steps already taken.
    ///
    /// Warm-up (`step < warmup_steps`): linear from `peak_lr / warmup_steps` (step 0) to
    /// `peak_lr` (step `warmup_steps - 1`). Afterwards `Constant` stays at `peak_lr`; `Linear`
    /// and `Cosine` decay from `peak_lr` at `warmup_steps` to `min_lr` at `total_steps` and stay
    /// at `min_lr` from then on (also when `total_steps <= warmup_steps`).
    pub fn lr_at(&self, step: u64) -> f64 {
        if step < self.warmup_steps {
            return self.peak_lr * (step + 1) as f64 / self.warmup_steps as f64;
        }
        if self.schedule == Schedule::Constant {
            return self.peak_lr;
        }
        if step >= self.total_steps {
            return self.min_lr;
        }
        // Here warmup_steps <= step < total_steps, so the span is positive.
        let ratio =
            (step - self.warmup_steps) as f64 / (self.total_steps - self.warmup_steps) as f64;
        let coeff = match self.schedule {
            Schedule::Linear => 1.0 - ratio,
            Schedule::Cosine => 0.5 * (1.0 + (std::f64::consts::PI * ratio).cos()),
            Schedule::Constant => 1.0,
        };
        self.min_lr + coeff * (self.peak_lr - self.min_lr)
    }
}

/// A checkpointed optimizer state that does not fit the parameters it is loaded for.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum OptimError {
    #[error("optimizer state: missing tensor {name:?} (the model has {num_params} parameters)")]
    Missing { name: String, num_params: usize },
    #[error("optimizer state: tensor {name:?} has shape {found:?}, but its parameter has shape {expected:?}")]
    Shape {
        name: String,
        expected: Vec<i64>,
        found: Vec<i64>,
    },
    #[error("optimizer state: tensor {name:?} has dtype {found}, but its parameter's state is {expected}")]
    Dtype {
        name: String,
        expected: String,
        found: String,
    },
    #[error("optimizer state: unexpected tensor {name:?} (the model has {num_params} parameters)")]
    Unexpected { name: String, num_params: usize },
    #[error("optimizer state: tensor {name:?} appears more than once")]
    Duplicate { name: String },
    #[error("optimizer state: tensor \"step\" must be a 1-element integer tensor holding a step >= 0: {detail}")]
    BadStep { detail: String },
}

/// The scalars of one AdamW step (Python floats in PyTorch: f64), applied to one parameter at a
/// time by the fused loop or by tensor ops.
struct StepScalars {
    /// `1 - lr * weight_decay` (exactly 1 without decay).
    decay: f64,
    /// The lerp weight `1 - beta1`.
    w1: f64,
    beta2: f64,
    /// `1 - beta2`.
    c2: f64,
    /// `sqrt(1 - beta2 ^ step)`.
    bc2_sqrt: f64,
    eps: f64,
    /// `-lr / (1 - beta1 ^ step)`.
    neg_step: f64,
}

impl StepScalars {
    /// The whole update of one parameter in one pass over its four arrays, when all four are
    /// contiguous f32 CPU tensors of one length (false otherwise: use [`Self::with_tensor_ops`]).
    /// Tensor ops take nine passes and three temporaries; on embedding tables larger than the
    /// caches that made the optimizer a third of a training step. The same formulas element by
    /// element in f32 (as PyTorch's CPU kernels take their scalars for f32 tensors; its kernels
    /// may fuse a multiply-add, so the two paths can differ in the last bit).
    fn fused(&self, param: &Tensor, grad: &Tensor, m: &Tensor, v: &Tensor) -> bool {
        let n = param.numel();
        let fits = |t: &Tensor| {
            t.device() == Device::Cpu
                && t.kind() == Kind::Float
                && t.is_contiguous()
                && t.numel() == n
        };
        if n == 0 || ![param, grad, m, v].into_iter().all(fits) {
            return false;
        }
        // SAFETY: four contiguous f32 CPU buffers of n elements, alive for this call; the
        // parameter, its gradient and the two moments do not overlap (the moments come from
        // `zeros`/`zeros_like` or are separate arrays of shared memory, the gradient from autograd), and
        // nothing else uses them meanwhile (the step runs on the training thread, under no_grad;
        // other ranks update other rows of a shared table).
        let (p, g, m, v) = unsafe {
            (
                std::slice::from_raw_parts_mut(param.data_ptr() as *mut f32, n),
                std::slice::from_raw_parts(grad.data_ptr() as *const f32, n),
                std::slice::from_raw_parts_mut(m.data_ptr() as *mut f32, n),
                std::slice::from_raw_parts_mut(v.data_ptr() as *mut f32, n),
            )
        };
        let f = |x: f64| x as f32;
        let k = FusedScalars {
            decay: f(self.decay),
            w1: f(self.w1),
            beta2: f(self.beta2),
            c2: f(self.c2),
            bc2_sqrt: f(self.bc2_sqrt),
            eps: f(self.eps),
            neg_step: f(self.neg_step),
        };
        // Large tensors in chunks on libtorch's intra-op threads (`OMP_NUM_THREADS`, which
        // `launch` sets to the host's cores over its processes), none smaller than a spawn is
        // worth: element-wise, so the same bits in any chunking.
        let threads = usize::try_from(tch::get_num_threads()).unwrap_or(1).max(1);
        let chunk = match threads > 1 && n >= PARALLEL_ELEMENTS {
            true => n.div_ceil(threads).max(PARALLEL_ELEMENTS / 4),
            false => n,
        };
        std::thread::scope(|scope| {
            let mut parts = p
                .chunks_mut(chunk)
                .zip(g.chunks(chunk))
                .zip(m.chunks_mut(chunk))
                .zip(v.chunks_mut(chunk));
            let first = parts.next();
            for (((p, g), m), v) in parts {
                scope.spawn(move || k.update(p, g, m, v));
            }
            if let Some((((p, g), m), v)) = first {
                k.update(p, g, m, v);
            }
        });
        true
    }

    /// The update of `param` (any device) with host moments: its values and gradient copied
    /// to the host (always copies, so that a CPU run takes the path a GPU run does), updated
    /// there, the values copied back. Returns the bytes copied.
    fn on_host(&self, param: &Tensor, grad: &Tensor, m: &mut Tensor, v: &mut Tensor) -> u64 {
        let host = |t: &Tensor| t.to_device_(Device::Cpu, t.kind(), false, true);
        let (values, grad_here) = (host(param), host(grad));
        if !self.fused(&values, &grad_here, m, v) {
            self.with_tensor_ops(&values, &grad_here, m, v);
        }
        param.shallow_clone().copy_(&values);
        let bytes = |t: &Tensor| t.numel() as u64 * t.kind().elt_size_in_bytes() as u64;
        2 * bytes(param) + bytes(grad)
    }

    /// The update of one parameter with tensor ops (any device or dtype).
    fn with_tensor_ops(&self, param: &Tensor, grad: &Tensor, m: &mut Tensor, v: &mut Tensor) {
        let mut param = param.shallow_clone();
        if self.decay != 1.0 {
            let _ = param.g_mul_scalar_(self.decay);
        }
        let _ = m.lerp_(grad, self.w1);
        // `addcmul_(g, g, value=c)` computes `self + (c * g) * g`; passing `c * g` as the first
        // factor gives the same roundings.
        let _ = v.g_mul_scalar_(self.beta2);
        let _ = v.addcmul_(&grad.g_mul_scalar(self.c2), grad);
        let mut denom = v.sqrt();
        let _ = denom.g_div_scalar_(self.bc2_sqrt);
        let _ = denom.g_add_scalar_(self.eps);
        // Likewise `addcdiv_(m, denom, value=-s)` is `self + (-s * m) / denom`.
        let _ = param.addcdiv_(&m.g_mul_scalar(self.neg_step), &denom);
    }
}

/// Elements from which the fused update splits a tensor over the intra-op threads.
const PARALLEL_ELEMENTS: usize = 1 << 20;

/// [`StepScalars`] in f32, as the fused update uses them.
#[derive(Clone, Copy)]
struct FusedScalars {
    decay: f32,
    w1: f32,
    beta2: f32,
    c2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step: f32,
}

impl FusedScalars {
    /// The update of these elements. lerp(m, g, w1) as PyTorch computes it, by the size of
    /// the weight (the branch outside the loop, so that the loop vectorises).
    fn update(&self, p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]) {
        let (k, w1) = (self, self.w1);
        if w1 < 0.5 {
            adamw_elements(p, g, m, v, k, |m, g| m + w1 * (g - m));
        } else {
            adamw_elements(p, g, m, v, k, |m, g| g - (g - m) * (1.0 - w1));
        }
    }
}

/// The AdamW update element by element, compiled for AVX-512 and AVX2 too and run with the
/// widest the CPU has (as PyTorch's kernels are): the square root and the division bound
/// it, and each is exactly rounded at any width, so every width gives the same bits.
#[multiversion::multiversion(targets = "simd")]
fn adamw_elements(
    p: &mut [f32],
    g: &[f32],
    m: &mut [f32],
    v: &mut [f32],
    k: &FusedScalars,
    lerp: impl Fn(f32, f32) -> f32,
) {
    for (((p, &g), m), v) in p.iter_mut().zip(g).zip(m.iter_mut()).zip(v.iter_mut()) {
        *m = lerp(*m, g);
        *v = *v * k.beta2 + (k.c2 * g) * g;
        let denom = v.sqrt() / k.bc2_sqrt + k.eps;
        *p = *p * k.decay + (k.neg_step * *m) / denom;
    }
}

/// `torch.optim.AdamW` (single parameter group, non-amsgrad, non-maximize) with state that can be
/// saved and restored bit-exactly.
///
/// One step counter is shared by all parameters (PyTorch keeps one per parameter; they only
/// differ when some parameter has no gradient on some steps, which DDP training does not do).
#[derive(Debug)]
pub struct AdamW {
    lr: f64,
    beta1: f64,
    beta2: f64,
    eps: f64,
    weight_decay: f64,
    step: u64,
    exp_avg: Vec<Tensor>,
    exp_avg_sq: Vec<Tensor>,
    /// Per parameter: the only rows this optimizer updates (see [`AdamW::update_rows_only`]),
    /// or `None` for all of it.
    rows: Vec<Option<Range<i64>>>,
    /// Per parameter: the only elements (of its values flattened) this optimizer holds moments
    /// for and updates ([`AdamW::with_elements`], ZeRO stages 1 and 2), or `None` for all of it.
    elements: Vec<Option<Range<i64>>>,
    /// Every parameter's shape: what its moments have in a checkpoint, whatever is kept here.
    shapes: Vec<Vec<i64>>,
    /// The moments live in host memory and the update runs there ([`AdamW::on_host`]).
    offload: bool,
    /// Bytes the last step copied between the parameters' device and the host.
    offload_bytes: u64,
}

impl AdamW {
    /// An optimizer for `params` (in this order, which `step` must keep); both moments start as
    /// zeros shaped, typed and placed like each parameter.
    pub fn new(params: &[Tensor], beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> AdamW {
        let whole = vec![None; params.len()];
        AdamW::with_elements(params, whole, beta1, beta2, eps, weight_decay)
    }

    /// [`AdamW::new`], keeping moments for and updating only `elements[i]` of parameter `i`'s
    /// flattened values where it is `Some` (a rank's shard under ZeRO stages 1 and 2): the moments of
    /// the rest are never allocated here. The update is element-wise, so each element gets
    /// the bits the whole parameter's update would give it.
    ///
    /// Panics if `elements` does not have one entry per parameter or a range lies outside its
    /// parameter (a programming error: the engine computes them).
    pub fn with_elements(
        params: &[Tensor],
        elements: Vec<Option<Range<i64>>>,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> AdamW {
        Self::placed(params, elements, false, [beta1, beta2, eps, weight_decay])
    }

    /// ZeRO-Offload's optimizer half (`dist.offload = "optimizer"`): [`AdamW::with_elements`]
    /// with the moments in host memory (allocated there: a device that cannot hold them never
    /// does), and each step copying a parameter's values (the elements kept) and gradient to
    /// the host, updating them there with the fused loop on libtorch's intra-op threads, and
    /// copying the values back. The same formulas: on CPU tensors the same bits as without
    /// offload (there the copies are all it adds); on a GPU the device keeps no moments.
    /// Parameters updated by rows in memory of their own ([`AdamW::update_rows_only`]) are
    /// updated there as before.
    pub fn on_host(
        params: &[Tensor],
        elements: Vec<Option<Range<i64>>>,
        beta1: f64,
        beta2: f64,
        eps: f64,
        weight_decay: f64,
    ) -> AdamW {
        Self::placed(params, elements, true, [beta1, beta2, eps, weight_decay])
    }

    fn placed(
        params: &[Tensor],
        elements: Vec<Option<Range<i64>>>,
        offload: bool,
        [beta1, beta2, eps, weight_decay]: [f64; 4],
    ) -> AdamW {
        assert_eq!(
            elements.len(),
            params.len(),
            "one element range per parameter"
        );
        let _guard = tch::no_grad_guard();
        let on = |p: &Tensor| if offload { Device::Cpu } else { p.device() };
        let zeros = |(p, e): (&Tensor, &Option<Range<i64>>)| match e {
            Some(e) => {
                assert!(
                    e.start <= e.end && e.end <= p.numel() as i64,
                    "{e:?} outside {:?}",
                    p.size()
                );
                Tensor::zeros([e.end - e.start], (p.kind(), on(p)))
            }
            None if !offload => p.zeros_like(),
            None => Tensor::zeros(p.size(), (p.kind(), Device::Cpu)),
        };
        AdamW {
            lr: 0.0,
            beta1,
            beta2,
            eps,
            weight_decay,
            step: 0,
            exp_avg: params.iter().zip(&elements).map(zeros).collect(),
            exp_avg_sq: params.iter().zip(&elements).map(zeros).collect(),
            rows: vec![None; params.len()],
            shapes: params.iter().map(Tensor::size).collect(),
            elements,
            offload,
            offload_bytes: 0,
        }
    }

    /// Whether the update runs on the host ([`AdamW::on_host`]).
    pub fn offloaded(&self) -> bool {
        self.offload
    }

    /// Bytes the last step copied between the parameters' device and the host (values out and
    /// back, gradients out; 0 without offload).
    pub fn offload_bytes(&self) -> u64 {
        self.offload_bytes
    }

    /// The elements of parameter `i` this optimizer keeps, when only some
    /// ([`AdamW::with_elements`]).
    pub fn elements_kept(&self, i: usize) -> Option<Range<i64>> {
        self.elements.get(i).cloned().flatten()
    }

    /// One step with learning rate `lr` over `params` (the same tensors, in the same order, as
    /// given to `new`; their `.grad()` set), with exactly `torch.optim.AdamW`'s math: decoupled
    /// decay `p *= 1 - lr * wd`; `m = lerp(m, g, 1 - beta1)`; `v = beta2 * v + (1 - beta2) * g * g`;
    /// `p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)` with `bc_i = 1 - beta_i ^ step`.
    /// Runs under `no_grad`; parameters are updated in place. Parameters without a defined
    /// gradient are skipped (their moments are left as they are). The step counter advances by
    /// one per call. Whole parameters on a GPU are updated together by libtorch's fused kernel
    /// (`multi_tensor`), which matches these formulas to float rounding, not bit for bit.
    ///
    /// Panics if `params.len()` differs from the number given to `new` (a programming error).
    pub fn step(&mut self, params: &[Tensor], lr: f64) {
        self.step_with(params, lr, &[]);
    }

    /// [`AdamW::step`], with `parts[i]` (where given) as parameter `i`'s gradient over the
    /// elements this optimizer keeps of it ([`AdamW::with_elements`]), 1-d, instead of its
    /// `.grad()`: ZeRO stage 2 keeps nothing else of the gradient.
    pub fn step_with(&mut self, params: &[Tensor], lr: f64, parts: &[Option<Tensor>]) {
        self.step_parts(params, lr, parts, &[])
    }

    /// [`AdamW::step_with`], with `values[i]` (where given) as parameter `i`'s values over the
    /// elements this optimizer keeps of it, 1-d, updated in place of the parameter's own: ZeRO
    /// stage 3 keeps nothing else of them between uses.
    pub fn step_parts(
        &mut self,
        params: &[Tensor],
        lr: f64,
        parts: &[Option<Tensor>],
        values: &[Option<Tensor>],
    ) {
        assert_eq!(
            params.len(),
            self.exp_avg.len(),
            "AdamW::step: got {} parameters, the optimizer was built for {}",
            params.len(),
            self.exp_avg.len()
        );
        let _guard = tch::no_grad_guard();
        self.step += 1;
        self.lr = lr;
        // As PyTorch: Python floats (f64) with `beta ** step` as `pow`.
        let step = self.step as f64;
        let bias_correction1 = 1.0 - self.beta1.powf(step);
        let bias_correction2 = 1.0 - self.beta2.powf(step);
        let scalars = StepScalars {
            decay: 1.0 - lr * self.weight_decay,
            w1: 1.0 - self.beta1,
            beta2: self.beta2,
            c2: 1.0 - self.beta2,
            bc2_sqrt: bias_correction2.powf(0.5),
            eps: self.eps,
            neg_step: -(lr / bias_correction1),
        };
        // Whole parameters on a GPU go to the fused kernel together, the rest one by one.
        let mut on_gpu = multi_tensor::Batch::default();
        self.offload_bytes = 0;
        for (i, ((((param, exp_avg), exp_avg_sq), rows), elements)) in params
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.rows)
            .zip(&self.elements)
            .enumerate()
        {
            let part = parts
                .get(i)
                .and_then(Option::as_ref)
                .filter(|_| elements.is_some());
            let grad = part.map_or_else(|| param.grad(), Tensor::shallow_clone);
            if !grad.defined() {
                continue;
            }
            let whole = rows.is_none() && elements.is_none();
            let offloaded = self.offload && rows.is_none();
            if whole && !offloaded && on_gpu.take(param, &grad, exp_avg, exp_avg_sq) {
                continue;
            }
            let value = values.get(i).and_then(Option::as_ref);
            let Some([p, g, mut m, mut v]) = update_span(
                [param, &grad, exp_avg, exp_avg_sq],
                rows,
                elements,
                value,
                part,
            ) else {
                continue;
            };
            if offloaded {
                self.offload_bytes += scalars.on_host(&p, &g, &mut m, &mut v);
            } else if !scalars.fused(&p, &g, &m, &v) {
                scalars.with_tensor_ops(&p, &g, &mut m, &mut v);
            }
        }
        let hyper = multi_tensor::Hyper {
            lr,
            beta1: self.beta1,
            beta2: self.beta2,
            weight_decay: self.weight_decay,
            eps: self.eps,
            step: self.step,
        };
        // As tch's own calls do, a failure (a CUDA out-of-memory) panics with libtorch's text,
        // which the worker's out-of-memory report catches and names.
        if let Err(e) = on_gpu.run(hyper) {
            panic!("{e}");
        }
    }

    /// From now on parameter `i` (index in `new`'s order) is updated only on `rows` (of its first
    /// dimension), and its moments live in `exp_avg` and `exp_avg_sq` (shaped like the
    /// parameter; e.g. in memory that other processes update for the other rows); the current
    /// moments of those rows are copied there first. `load_state_tensors` then writes only those
    /// rows, and `state_tensors` reads the whole of the given tensors.
    pub fn update_rows_only(
        &mut self,
        i: usize,
        rows: Range<i64>,
        exp_avg: Tensor,
        exp_avg_sq: Tensor,
    ) -> Result<(), OptimError> {
        let ours = &self.exp_avg[i];
        let fits = |t: &Tensor| {
            t.size() == ours.size() && t.kind() == ours.kind() && t.device() == ours.device()
        };
        let height = ours.size().first().copied().unwrap_or(0);
        if !fits(&exp_avg) || !fits(&exp_avg_sq) || rows.start > rows.end || rows.end > height {
            return Err(OptimError::Shape {
                name: format!("exp_avg.{i} (rows {rows:?})"),
                expected: ours.size(),
                found: exp_avg.size(),
            });
        }
        let _guard = tch::no_grad_guard();
        let len = rows.end - rows.start;
        for (old, new) in [
            (&self.exp_avg[i], &exp_avg),
            (&self.exp_avg_sq[i], &exp_avg_sq),
        ] {
            new.narrow(0, rows.start, len)
                .copy_(&old.narrow(0, rows.start, len));
        }
        self.exp_avg[i] = exp_avg;
        self.exp_avg_sq[i] = exp_avg_sq;
        self.rows[i] = Some(rows);
        Ok(())
    }

    /// The rows parameter `i` is updated on, when only some ([`AdamW::update_rows_only`]).
    pub fn rows_updated(&self, i: usize) -> Option<Range<i64>> {
        self.rows.get(i).cloned().flatten()
    }

    /// Optimizer steps taken so far (restored by `load_state_tensors`).
    pub fn steps_taken(&self) -> u64 {
        self.step
    }

    /// The learning rate of the most recent `step` (0 before the first).
    pub fn lr(&self) -> f64 {
        self.lr
    }

    /// Named tensors for a checkpoint: `exp_avg.{i}`, `exp_avg_sq.{i}` for parameter `i`, and
    /// `step` (a 1-element i64 tensor). They are CPU snapshots (copies), independent of later
    /// steps and ready to be written. A parameter kept by its elements
    /// ([`AdamW::with_elements`]) gives those elements' moments only (1-d): the engine that
    /// sharded them gathers the whole (`Ddp::optimizer_state`).
    pub fn state_tensors(&self) -> Vec<(String, Tensor)> {
        let _guard = tch::no_grad_guard();
        let snapshot = |t: &Tensor| {
            if t.device() == Device::Cpu {
                t.copy()
            } else {
                t.to_device(Device::Cpu)
            }
        };
        let mut out = Vec::with_capacity(2 * self.exp_avg.len() + 1);
        for (i, (m, v)) in self.exp_avg.iter().zip(&self.exp_avg_sq).enumerate() {
            out.push((format!("exp_avg.{i}"), snapshot(m)));
            out.push((format!("exp_avg_sq.{i}"), snapshot(v)));
        }
        let step = i64::try_from(self.step).unwrap_or(i64::MAX);
        out.push(("step".to_string(), Tensor::from_slice(&[step])));
        out
    }

    /// A checkpoint's optimizer state in shape only: zeros shaped and typed as `state_tensors`
    /// gives them for whole parameters (every moment whole, on the CPU, whatever this optimizer
    /// keeps), and `step`. What a rank receives another's whole state into.
    pub fn state_template(&self) -> Vec<(String, Tensor)> {
        let mut out = Vec::with_capacity(2 * self.shapes.len() + 1);
        for (i, (shape, m)) in self.shapes.iter().zip(&self.exp_avg).enumerate() {
            for name in ["exp_avg", "exp_avg_sq"] {
                let zeros = Tensor::zeros(shape.as_slice(), (m.kind(), Device::Cpu));
                out.push((format!("{name}.{i}"), zeros));
            }
        }
        out.push(("step".to_string(), Tensor::from_slice(&[0i64])));
        out
    }

    /// Restores what `state_tensors` produced (possibly after a round trip through a file):
    /// every name must be present exactly once, with the shape and dtype of its parameter's
    /// state, and nothing else. Everything is checked before anything is changed, so on error
    /// the optimizer is untouched. Tensors may live on any device; they are copied onto the
    /// moments' (the parameters' devices, or the host when offloaded).
    pub fn load_state_tensors(&mut self, named: &[(String, Tensor)]) -> Result<(), OptimError> {
        let num_params = self.exp_avg.len();
        let mut by_name: HashMap<&str, &Tensor> = HashMap::with_capacity(named.len());
        for (name, tensor) in named {
            if by_name.insert(name.as_str(), tensor).is_some() {
                return Err(OptimError::Duplicate { name: name.clone() });
            }
        }

        let step = Self::read_step(by_name.get("step").copied(), num_params)?;

        let mut sources: Vec<(&Tensor, &Tensor)> = Vec::with_capacity(num_params);
        for i in 0..num_params {
            let moment = |name: &str, ours: &Tensor| {
                let like = (self.shapes[i].as_slice(), ours.kind());
                Self::checked(&by_name, &format!("{name}.{i}"), like, num_params)
            };
            let m = moment("exp_avg", &self.exp_avg[i])?;
            let v = moment("exp_avg_sq", &self.exp_avg_sq[i])?;
            sources.push((m, v));
        }
        if by_name.len() != 2 * num_params + 1 {
            let expected = |n: &str| {
                n == "step"
                    || ["exp_avg.", "exp_avg_sq."].iter().any(|prefix| {
                        n.strip_prefix(prefix)
                            .and_then(|i| i.parse::<usize>().ok())
                            .is_some_and(|i| i < num_params && i.to_string() == n[prefix.len()..])
                    })
            };
            let mut extra: Vec<&str> = by_name.keys().copied().filter(|n| !expected(n)).collect();
            extra.sort_unstable();
            let name = extra.first().map_or_else(String::new, |n| (*n).to_string());
            return Err(OptimError::Unexpected { name, num_params });
        }

        let _guard = tch::no_grad_guard();
        for ((((dst_m, dst_v), (src_m, src_v)), rows), elements) in self
            .exp_avg
            .iter()
            .zip(&self.exp_avg_sq)
            .zip(sources)
            .zip(&self.rows)
            .zip(&self.elements)
        {
            let source = |t: &Tensor| match (rows, elements) {
                (_, Some(e)) => t.reshape([-1]).narrow(0, e.start, e.end - e.start),
                (Some(r), None) => t.narrow(0, r.start, r.end - r.start),
                (None, None) => t.shallow_clone(),
            };
            let target = |t: &Tensor| match rows {
                Some(r) if elements.is_none() => t.narrow(0, r.start, r.end - r.start),
                _ => t.shallow_clone(),
            };
            target(dst_m).copy_(&source(src_m));
            target(dst_v).copy_(&source(src_v));
        }
        self.step = step;
        Ok(())
    }

    /// The tensor `name`, checked against the (shape, kind) its parameter's state has.
    fn checked<'a>(
        by_name: &HashMap<&str, &'a Tensor>,
        name: &str,
        (shape, kind): (&[i64], Kind),
        num_params: usize,
    ) -> Result<&'a Tensor, OptimError> {
        let t = by_name
            .get(name)
            .copied()
            .ok_or_else(|| OptimError::Missing {
                name: name.to_string(),
                num_params,
            })?;
        if t.size() != shape {
            return Err(OptimError::Shape {
                name: name.to_string(),
                expected: shape.to_vec(),
                found: t.size(),
            });
        }
        if t.kind() != kind {
            return Err(OptimError::Dtype {
                name: name.to_string(),
                expected: format!("{kind:?}"),
                found: format!("{:?}", t.kind()),
            });
        }
        Ok(t)
    }

    fn read_step(t: Option<&Tensor>, num_params: usize) -> Result<u64, OptimError> {
        let t = t.ok_or_else(|| OptimError::Missing {
            name: "step".to_string(),
            num_params,
        })?;
        if !matches!(
            t.kind(),
            Kind::Int64 | Kind::Int | Kind::Int16 | Kind::Int8 | Kind::Uint8
        ) {
            return Err(OptimError::BadStep {
                detail: format!("dtype is {:?}", t.kind()),
            });
        }
        if t.numel() != 1 {
            return Err(OptimError::BadStep {
                detail: format!("shape is {:?}", t.size()),
            });
        }
        let value = t
            .reshape([1])
            .f_int64_value(&[0])
            .map_err(|e| OptimError::BadStep {
                detail: e.to_string().lines().next().unwrap_or_default().to_string(),
            })?;
        u64::try_from(value).map_err(|_| OptimError::BadStep {
            detail: format!("value is {value}"),
        })
    }
}

/// What one parameter's update touches, as views of `[param, grad, exp_avg, exp_avg_sq]`: the
/// whole, `rows` of them, or `elements` of the values flattened (`value` in place of the
/// parameter's where given, `part` being the gradient over those elements already); `None` when
/// no element is kept here. The update is element-wise: a range is updated as the whole would be.
fn update_span(
    [param, grad, m, v]: [&Tensor; 4],
    rows: &Option<Range<i64>>,
    elements: &Option<Range<i64>>,
    value: Option<&Tensor>,
    part: Option<&Tensor>,
) -> Option<[Tensor; 4]> {
    Some(match (rows, elements) {
        (_, Some(e)) if e.is_empty() => return None,
        (_, Some(e)) => [
            value.map_or_else(|| flat_part(param, e), Tensor::shallow_clone),
            match part {
                Some(_) => grad.shallow_clone(),
                None => flat_part(grad, e),
            },
            m.shallow_clone(),
            v.shallow_clone(),
        ],
        (Some(r), None) => [param, grad, m, v].map(|t| t.narrow(0, r.start, r.end - r.start)),
        (None, None) => [param, grad, m, v].map(Tensor::shallow_clone),
    })
}

/// Elements `e` of `t`'s values flattened, as a view (`t` is contiguous: a parameter or its
/// gradient).
fn flat_part(t: &Tensor, e: &Range<i64>) -> Tensor {
    t.view([-1]).narrow(0, e.start, e.end - e.start)
}

#[cfg(test)]
#[path = "optim_tests.rs"]
mod tests;
