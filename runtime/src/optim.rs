//! The optimizer: AdamW over `tch` tensors, the learning-rate schedule, and the optimizer state
//! a checkpoint needs to continue exactly.
//!
//! Owns: `torch.optim.AdamW`'s update math, warm-up + constant / linear / cosine LR schedules,
//! and turning the moments and step counter into named tensors (and back) for
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
        // `zeros_like` or are separate arrays of shared memory, the gradient from autograd), and
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
        // lerp(m, g, w1) as PyTorch computes it, by the size of the weight (the branch outside
        // the loop, so that the loop vectorises).
        if k.w1 < 0.5 {
            adamw_elements(p, g, m, v, &k, |m, g| m + k.w1 * (g - m));
        } else {
            adamw_elements(p, g, m, v, &k, |m, g| g - (g - m) * (1.0 - k.w1));
        }
        true
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

/// [`StepScalars`] in f32, as the fused update uses them.
struct FusedScalars {
    decay: f32,
    w1: f32,
    beta2: f32,
    c2: f32,
    bc2_sqrt: f32,
    eps: f32,
    neg_step: f32,
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
}

impl AdamW {
    /// An optimizer for `params` (in this order, which `step` must keep); both moments start as
    /// zeros shaped, typed and placed like each parameter.
    pub fn new(params: &[Tensor], beta1: f64, beta2: f64, eps: f64, weight_decay: f64) -> AdamW {
        let _guard = tch::no_grad_guard();
        AdamW {
            lr: 0.0,
            beta1,
            beta2,
            eps,
            weight_decay,
            step: 0,
            exp_avg: params.iter().map(Tensor::zeros_like).collect(),
            exp_avg_sq: params.iter().map(Tensor::zeros_like).collect(),
            rows: vec![None; params.len()],
        }
    }

    /// One step with learning rate `lr` over `params` (the same tensors, in the same order, as
    /// given to `new`; their `.grad()` set), with exactly `torch.optim.AdamW`'s math: decoupled
    /// decay `p *= 1 - lr * wd`; `m = lerp(m, g, 1 - beta1)`; `v = beta2 * v + (1 - beta2) * g * g`;
    /// `p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)` with `bc_i = 1 - beta_i ^ step`.
    /// Runs under `no_grad`; parameters are updated in place. Parameters without a defined
    /// gradient are skipped (their moments are left as they are). The step counter advances by
    /// one per call.
    ///
    /// Panics if `params.len()` differs from the number given to `new` (a programming error).
    pub fn step(&mut self, params: &[Tensor], lr: f64) {
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
        for (((param, exp_avg), exp_avg_sq), rows) in params
            .iter()
            .zip(&self.exp_avg)
            .zip(&self.exp_avg_sq)
            .zip(&self.rows)
        {
            let grad = param.grad();
            if !grad.defined() {
                continue;
            }
            if rows.is_none() && on_gpu.take(param, &grad, exp_avg, exp_avg_sq) {
                continue;
            }
            // The update is element-wise: a range of rows is updated as the whole would be.
            let part = |t: &Tensor| match rows {
                Some(r) => t.narrow(0, r.start, r.end - r.start),
                None => t.shallow_clone(),
            };
            let (p, g, mut m, mut v) = (part(param), part(&grad), part(exp_avg), part(exp_avg_sq));
            if !scalars.fused(&p, &g, &m, &v) {
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
    /// steps and ready to be written.
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

    /// Restores what `state_tensors` produced (possibly after a round trip through a file):
    /// every name must be present exactly once, with the shape and dtype of its parameter's
    /// state, and nothing else. Everything is checked before anything is changed, so on error
    /// the optimizer is untouched. Tensors may live on any device; they are copied onto the
    /// parameters' devices.
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
                Self::checked(&by_name, &format!("{name}.{i}"), ours, num_params)
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
        for (((dst_m, dst_v), (src_m, src_v)), rows) in self
            .exp_avg
            .iter()
            .zip(&self.exp_avg_sq)
            .zip(sources)
            .zip(&self.rows)
        {
            let part = |t: &Tensor| match rows {
                Some(r) => t.narrow(0, r.start, r.end - r.start),
                None => t.shallow_clone(),
            };
            part(dst_m).copy_(&part(src_m));
            part(dst_v).copy_(&part(src_v));
        }
        self.step = step;
        Ok(())
    }

    fn checked<'a>(
        by_name: &HashMap<&str, &'a Tensor>,
        name: &str,
        like: &Tensor,
        num_params: usize,
    ) -> Result<&'a Tensor, OptimError> {
        let t = by_name
            .get(name)
            .copied()
            .ok_or_else(|| OptimError::Missing {
                name: name.to_string(),
                num_params,
            })?;
        if t.size() != like.size() {
            return Err(OptimError::Shape {
                name: name.to_string(),
                expected: like.size(),
                found: t.size(),
            });
        }
        if t.kind() != like.kind() {
            return Err(OptimError::Dtype {
                name: name.to_string(),
                expected: format!("{:?}", like.kind()),
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

#[cfg(test)]
mod tests {
    use super::*;

    fn param(values: &[f32]) -> Tensor {
        Tensor::from_slice(values).set_requires_grad(true)
    }

    /// Sets `p.grad` to `g` (creating it through a backward pass the first time).
    fn set_grad(p: &Tensor, g: &[f32]) {
        let g = Tensor::from_slice(g).reshape(p.size());
        let mut grad = p.grad();
        if grad.defined() {
            tch::no_grad(|| grad.copy_(&g));
        } else {
            (p * &g).sum(Kind::Float).backward();
        }
    }

    fn values(t: &Tensor) -> Vec<f64> {
        let flat = t.detach().to_kind(Kind::Double).reshape([-1]);
        Vec::<f64>::try_from(&flat).unwrap()
    }

    fn assert_close(got: &[f64], want: &[f64], tol: f64) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((g - w).abs() <= tol, "element {i}: got {g}, want {w}");
        }
    }

    #[test]
    fn adamw_matches_hand_computed_two_steps() {
        let (beta1, beta2, eps, wd) = (0.9, 0.999, 1e-8, 0.1);
        let p0 = [1.0f32, -2.0, 0.5];
        let grads = [[0.5f32, -1.0, 0.25], [-0.3f32, 0.2, 2.0]];
        let lrs = [0.1, 0.05];

        let p = param(&p0);
        let mut opt = AdamW::new(&[p.shallow_clone()], beta1, beta2, eps, wd);
        for (g, &lr) in grads.iter().zip(&lrs) {
            set_grad(&p, g);
            opt.step(&[p.shallow_clone()], lr);
        }
        assert_eq!(opt.steps_taken(), 2);

        // Reference in plain f64.
        let mut want: Vec<f64> = p0.iter().map(|&x| f64::from(x)).collect();
        let mut m = [0.0f64; 3];
        let mut v = [0.0f64; 3];
        for (t, (g, &lr)) in grads.iter().zip(&lrs).enumerate() {
            let t = (t + 1) as i32;
            let bc1 = 1.0 - beta1.powi(t);
            let bc2 = 1.0 - beta2.powi(t);
            for i in 0..3 {
                let gi = f64::from(g[i]);
                want[i] *= 1.0 - lr * wd;
                m[i] = beta1 * m[i] + (1.0 - beta1) * gi;
                v[i] = beta2 * v[i] + (1.0 - beta2) * gi * gi;
                want[i] -= lr * (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
            }
        }
        assert_close(&values(&p), &want, 1e-6);
        let state = opt.state_tensors();
        assert_close(&values(&state[0].1), &m, 1e-6);
        assert_close(&values(&state[1].1), &v, 1e-6);
    }

    /// The fused loop and the tensor ops compute the same update (to float rounding), with
    /// either lerp formula (beta1 above and below 0.5) and with or without decay.
    #[test]
    fn fused_update_equals_tensor_ops() {
        for (beta1, wd) in [(0.9, 0.0), (0.9, 0.1), (0.3, 0.01)] {
            tch::manual_seed(7);
            let tensors = || -> [Tensor; 4] {
                let p = Tensor::randn([1000, 7], (Kind::Float, Device::Cpu));
                let g = Tensor::randn([1000, 7], (Kind::Float, Device::Cpu));
                let zeros = || Tensor::zeros([1000, 7], (Kind::Float, Device::Cpu));
                [p, g, zeros(), zeros()]
            };
            let fused = tensors();
            let mut ops: Vec<Tensor> = fused.iter().map(Tensor::copy).collect();
            let start = fused[0].copy();
            for step in 1..=5 {
                let (bc1, bc2) = (1.0 - f64::powi(beta1, step), 1.0 - f64::powi(0.999, step));
                let scalars = StepScalars {
                    decay: 1.0 - 0.01 * wd,
                    w1: 1.0 - beta1,
                    beta2: 0.999,
                    c2: 1.0 - 0.999,
                    bc2_sqrt: bc2.sqrt(),
                    eps: 1e-8,
                    neg_step: -0.01 / bc1,
                };
                assert!(scalars.fused(&fused[0], &fused[1], &fused[2], &fused[3]));
                let [p, g, m, v] = &mut ops[..] else {
                    unreachable!()
                };
                scalars.with_tensor_ops(p, g, m, v);
            }
            for (i, (a, b)) in fused.iter().zip(&ops).enumerate() {
                let diff = (a - b).abs().max().double_value(&[]);
                assert!(
                    diff < 1e-6,
                    "beta1 {beta1}, wd {wd}: tensor {i} differs by {diff}"
                );
            }
            let moved = (&fused[0] - &start).abs().max().double_value(&[]);
            assert!(moved > 1e-3, "the parameter moved ({moved})");
        }
    }

    #[test]
    fn weight_decay_is_decoupled() {
        // With zero gradients the Adam update is 0 / (0 + eps) = 0, so only the decoupled decay
        // acts: p *= 1 - lr * wd. (Coupled L2 decay would instead feed wd * p into the moments
        // and move every element by about lr.)
        let (lr, wd) = (0.1, 0.5);
        let p = param(&[2.0, -4.0, 8.0]);
        set_grad(&p, &[0.0, 0.0, 0.0]);
        let mut opt = AdamW::new(&[p.shallow_clone()], 0.9, 0.999, 1e-8, wd);
        opt.step(&[p.shallow_clone()], lr);
        assert_close(&values(&p), &[1.9, -3.8, 7.6], 1e-6);

        // And without weight decay nothing moves.
        let q = param(&[2.0, -4.0, 8.0]);
        set_grad(&q, &[0.0, 0.0, 0.0]);
        let mut opt = AdamW::new(&[q.shallow_clone()], 0.9, 0.999, 1e-8, 0.0);
        opt.step(&[q.shallow_clone()], lr);
        assert_close(&values(&q), &[2.0, -4.0, 8.0], 0.0);
    }

    #[test]
    fn params_without_grad_are_skipped() {
        let a = param(&[1.0, 2.0]);
        let b = param(&[3.0, 4.0]);
        set_grad(&a, &[1.0, 1.0]);
        let params = [a.shallow_clone(), b.shallow_clone()];
        let mut opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.1);
        opt.step(&params, 0.1);
        assert!(!values(&a).iter().zip([1.0, 2.0]).any(|(x, y)| *x == y));
        assert_eq!(values(&b), vec![3.0, 4.0]);
    }

    fn make_params(seed: i64) -> Vec<Tensor> {
        tch::manual_seed(seed);
        vec![
            Tensor::randn([4, 3], (Kind::Float, Device::Cpu)).set_requires_grad(true),
            Tensor::randn([5], (Kind::Float, Device::Cpu)).set_requires_grad(true),
        ]
    }

    fn random_grads(params: &[Tensor]) {
        for p in params {
            let g = Tensor::randn(p.size(), (Kind::Float, Device::Cpu));
            let flat: Vec<f32> = Vec::try_from(&g.reshape([-1])).unwrap();
            set_grad(p, &flat);
        }
    }

    fn clone_params(params: &[Tensor]) -> Vec<Tensor> {
        params
            .iter()
            .map(|p| p.detach().copy().set_requires_grad(true))
            .collect()
    }

    #[test]
    fn save_load_then_step_equals_continuing() {
        let params = make_params(7);
        let mut opt = AdamW::new(&params, 0.9, 0.95, 1e-8, 0.1);
        for step in 0..3 {
            random_grads(&params);
            opt.step(&params, 1e-2 / f64::from(step + 1));
        }
        let saved = opt.state_tensors();
        assert_eq!(saved.len(), 5);
        assert_eq!(saved[4].0, "step");
        assert_eq!(saved[4].1.kind(), Kind::Int64);
        assert_eq!(saved[4].1.size(), vec![1]);

        let resumed_params = clone_params(&params);
        let mut resumed = AdamW::new(&resumed_params, 0.9, 0.95, 1e-8, 0.1);
        resumed.load_state_tensors(&saved).unwrap();
        assert_eq!(resumed.steps_taken(), 3);

        // The snapshot is independent of later steps of the original.
        random_grads(&params);
        for (p, q) in params.iter().zip(&resumed_params) {
            let g = p.grad();
            set_grad(q, &Vec::<f32>::try_from(&g.reshape([-1])).unwrap());
        }
        opt.step(&params, 3e-3);
        resumed.step(&resumed_params, 3e-3);

        for (p, q) in params.iter().zip(&resumed_params) {
            assert!(p.equal(q));
        }
        for ((n1, t1), (n2, t2)) in opt.state_tensors().iter().zip(&resumed.state_tensors()) {
            assert_eq!(n1, n2);
            assert!(t1.equal(t2), "{n1} differs");
        }
        assert!(!saved[0].1.equal(&opt.state_tensors()[0].1));
    }

    #[test]
    fn load_rejects_wrong_shape_naming_the_tensor() {
        let params = make_params(1);
        let opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
        let mut saved = opt.state_tensors();

        let other = [param(&[1.0, 2.0, 3.0]), param(&[0.0; 5])];
        let mut wrong = AdamW::new(&other, 0.9, 0.999, 1e-8, 0.0);
        let err = wrong.load_state_tensors(&saved).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("\"exp_avg.0\""), "{msg}");
        assert!(msg.contains("[4, 3]") && msg.contains("[3]"), "{msg}");
        assert!(!msg.contains('\n'));
        assert_eq!(wrong.steps_taken(), 0);

        // Missing, unexpected, duplicate and bad step are named too.
        let mut missing = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
        let without: Vec<(String, Tensor)> = saved
            .iter()
            .filter(|(n, _)| n != "exp_avg_sq.1")
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        let msg = missing
            .load_state_tensors(&without)
            .unwrap_err()
            .to_string();
        assert!(msg.contains("\"exp_avg_sq.1\""), "{msg}");

        let mut extra: Vec<(String, Tensor)> = saved
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect();
        extra.push((
            "exp_avg.2".to_string(),
            Tensor::zeros([1], (Kind::Float, Device::Cpu)),
        ));
        let msg = missing.load_state_tensors(&extra).unwrap_err().to_string();
        assert!(
            msg.contains("unexpected") && msg.contains("\"exp_avg.2\""),
            "{msg}"
        );
        extra.pop();
        extra.push(("step".to_string(), Tensor::from_slice(&[1i64])));
        let msg = missing.load_state_tensors(&extra).unwrap_err().to_string();
        assert!(
            msg.contains("\"step\"") && msg.contains("more than once"),
            "{msg}"
        );

        let step = saved.iter().position(|(n, _)| n == "step").unwrap();
        saved[step].1 = Tensor::from_slice(&[-1i64]);
        let msg = missing.load_state_tensors(&saved).unwrap_err().to_string();
        assert!(msg.contains("\"step\""), "{msg}");
        saved[step].1 = Tensor::from_slice(&[1.0f32]);
        assert!(missing.load_state_tensors(&saved).is_err());
        assert_eq!(missing.steps_taken(), 0);
    }

    #[test]
    fn load_rejects_wrong_dtype() {
        let params = make_params(2);
        let opt = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
        let mut saved = opt.state_tensors();
        saved[1].1 = saved[1].1.to_kind(Kind::Double);
        let mut fresh = AdamW::new(&params, 0.9, 0.999, 1e-8, 0.0);
        let msg = fresh.load_state_tensors(&saved).unwrap_err().to_string();
        assert!(
            msg.contains("\"exp_avg_sq.0\"") && msg.contains("Double"),
            "{msg}"
        );
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn lr_schedule_values() {
        let (peak, min) = (1e-3, 1e-4);
        let sched = |schedule| LrSchedule {
            peak_lr: peak,
            warmup_steps: 10,
            total_steps: 110,
            schedule,
            min_lr: min,
        };
        for kind in [Schedule::Constant, Schedule::Linear, Schedule::Cosine] {
            let s = sched(kind);
            // Warm-up: peak / warmup at the start, peak at its last step and at its end.
            assert!(close(s.lr_at(0), peak / 10.0), "{kind:?}");
            assert!(close(s.lr_at(4), peak * 5.0 / 10.0), "{kind:?}");
            assert!(close(s.lr_at(9), peak), "{kind:?}");
            assert!(close(s.lr_at(10), peak), "{kind:?}");
        }
        let c = sched(Schedule::Constant);
        for step in [60, 110, 10_000] {
            assert!(close(c.lr_at(step), peak));
        }
        let l = sched(Schedule::Linear);
        assert!(close(l.lr_at(35), peak - 0.25 * (peak - min)));
        assert!(close(l.lr_at(60), (peak + min) / 2.0));
        assert!(close(l.lr_at(110), min));
        assert!(close(l.lr_at(10_000), min));
        let cos = sched(Schedule::Cosine);
        let quarter = min + 0.5 * (1.0 + (std::f64::consts::PI / 4.0).cos()) * (peak - min);
        assert!(close(cos.lr_at(35), quarter));
        assert!(close(cos.lr_at(60), (peak + min) / 2.0));
        assert!(close(cos.lr_at(110), min));
        assert!(close(cos.lr_at(10_000), min));
        // Decreasing over the decay phase.
        for step in 10..110 {
            assert!(cos.lr_at(step + 1) <= cos.lr_at(step));
            assert!(l.lr_at(step + 1) <= l.lr_at(step));
        }
    }

    #[test]
    fn lr_schedule_edge_cases() {
        let no_warmup = LrSchedule {
            peak_lr: 0.5,
            warmup_steps: 0,
            total_steps: 4,
            schedule: Schedule::Linear,
            min_lr: 0.1,
        };
        assert!(close(no_warmup.lr_at(0), 0.5));
        assert!(close(no_warmup.lr_at(2), 0.3));
        assert!(close(no_warmup.lr_at(4), 0.1));
        let total_within_warmup = LrSchedule {
            warmup_steps: 10,
            total_steps: 5,
            schedule: Schedule::Cosine,
            ..no_warmup
        };
        assert!(close(total_within_warmup.lr_at(9), 0.5));
        assert!(close(total_within_warmup.lr_at(10), 0.1));
        assert!(total_within_warmup.lr_at(10).is_finite());
    }
}
