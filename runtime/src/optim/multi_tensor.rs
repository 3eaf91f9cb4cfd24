//! AdamW over many parameters in one call of libtorch's `_fused_adamw_` (what
//! `torch.optim.AdamW(fused=True)` runs), for parameters on a GPU. There the per-parameter
//! update of [`super::AdamW::step`] costs about nine kernel launches per parameter: 21-22 ms
//! of host time per step for GPT-2 small's 148 tensors on an H100, about 11% of an f32 step's
//! phases (`scripts/gpu/check.sh`, 2026-11-27).
//!
//! Owns: which parameters may take the fused kernel and the call into `csrc/fused_adamw.cpp`.
//! Must not: change the math (the kernel's formulas are `AdamW::step`'s, to float rounding) or
//! take parameters on the CPU, where `AdamW::step`'s own fused loop is as fast and bit-exact.
//!
//! `GPTREC_FUSED_ADAMW=0` turns it off (to compare the two paths).

use std::ffi::c_char;
use std::sync::OnceLock;

use tch::{Device, Kind, Tensor};

mod ffi {
    use std::ffi::c_char;

    extern "C" {
        /// See `csrc/fused_adamw.cpp`: returns null or an error for `shim::take_error`.
        #[allow(clippy::too_many_arguments)]
        pub fn gptrec_fused_adamw(
            params: *const *const torch_sys::C_tensor,
            grads: *const *const torch_sys::C_tensor,
            exp_avgs: *const *const torch_sys::C_tensor,
            exp_avg_sqs: *const *const torch_sys::C_tensor,
            n: usize,
            lr: f64,
            beta1: f64,
            beta2: f64,
            weight_decay: f64,
            eps: f64,
            step: f64,
        ) -> *mut c_char;
    }
}

/// The hyper-parameters of one step, as `_fused_adamw_` takes them.
#[derive(Clone, Copy, Debug)]
pub(super) struct Hyper {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub weight_decay: f64,
    pub eps: f64,
    /// The step being taken (1 for the first).
    pub step: u64,
}

/// Whether the fused path is on (`GPTREC_FUSED_ADAMW` is not `0`; read once).
fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("GPTREC_FUSED_ADAMW").map_or(true, |v| v.trim() != "0"))
}

/// The parameters of one step that go to the fused kernel together: on one GPU, f32, dense.
#[derive(Default)]
pub(super) struct Batch {
    /// On the device of the first one taken.
    params: Vec<Tensor>,
    grads: Vec<Tensor>,
    exp_avgs: Vec<Tensor>,
    exp_avg_sqs: Vec<Tensor>,
}

impl Batch {
    /// Takes the parameter into the batch when it fits (true), or leaves it to the caller.
    pub fn take(
        &mut self,
        param: &Tensor,
        grad: &Tensor,
        exp_avg: &Tensor,
        exp_avg_sq: &Tensor,
    ) -> bool {
        let device = param.device();
        let cuda = matches!(device, Device::Cuda(_));
        let other_gpu = self.params.first().is_some_and(|p| p.device() != device);
        if !cuda
            || !enabled()
            || other_gpu
            || !Self::fits(device, param, [grad, exp_avg, exp_avg_sq])
        {
            return false;
        }
        self.params.push(param.shallow_clone());
        self.grads.push(grad.shallow_clone());
        self.exp_avgs.push(exp_avg.shallow_clone());
        self.exp_avg_sqs.push(exp_avg_sq.shallow_clone());
        true
    }

    /// Four dense f32 tensors of one shape on `device`.
    fn fits(device: Device, param: &Tensor, others: [&Tensor; 3]) -> bool {
        let shape = param.size();
        std::iter::once(param).chain(others).all(|t| {
            t.defined()
                && t.device() == device
                && t.kind() == Kind::Float
                && t.is_contiguous()
                && !t.is_sparse()
                && t.size() == shape
        })
    }

    /// Updates every parameter taken, in place; an error is libtorch's text (e.g. an
    /// out-of-memory).
    pub fn run(self, h: Hyper) -> Result<(), String> {
        // One launch updates all of them at once: a tensor given twice would race with itself
        // (the var store never gives one twice; the per-parameter path would update it twice).
        debug_assert!(
            {
                let mut at: Vec<usize> =
                    self.params.iter().map(|t| t.data_ptr() as usize).collect();
                at.sort_unstable();
                at.windows(2).all(|w| w[0] != w[1])
            },
            "fused AdamW: a parameter given twice"
        );
        fused_adamw(
            &self.params,
            &self.grads,
            &self.exp_avgs,
            &self.exp_avg_sqs,
            h,
        )
    }
}

/// One `_fused_adamw_` call over the four lists (one length, one device, one dtype; the
/// caller checks).
pub(super) fn fused_adamw(
    params: &[Tensor],
    grads: &[Tensor],
    exp_avgs: &[Tensor],
    exp_avg_sqs: &[Tensor],
    h: Hyper,
) -> Result<(), String> {
    let n = params.len();
    assert!(
        grads.len() == n && exp_avgs.len() == n && exp_avg_sqs.len() == n,
        "fused_adamw: lists of different lengths"
    );
    let ptrs = |ts: &[Tensor]| ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let (p, g, m, v) = (ptrs(params), ptrs(grads), ptrs(exp_avgs), ptrs(exp_avg_sqs));
    // SAFETY: four arrays of `n` live `at::Tensor*` (tch's, borrowed for this call); the shim
    // only reads the pointers and updates the tensors in place, on this thread.
    let error: *mut c_char = unsafe {
        ffi::gptrec_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n,
            h.lr,
            h.beta1,
            h.beta2,
            h.weight_decay,
            h.eps,
            h.step as f64,
        )
    };
    crate::shim::take_error(error)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fused kernel (run here on the CPU, where libtorch has it too) computes
    /// `AdamW::step`'s update to float rounding, weight decay included, over several steps.
    #[test]
    fn the_fused_kernel_computes_adamw_s_update() {
        tch::manual_seed(3);
        let shapes: [&[i64]; 3] = [&[64, 8], &[8], &[3, 5, 7]];
        let leaf = |t: Tensor| t.set_requires_grad(true);
        let ours: Vec<Tensor> = shapes
            .iter()
            .map(|s| leaf(Tensor::randn(*s, (Kind::Float, Device::Cpu))))
            .collect();
        let fused: Vec<Tensor> = ours.iter().map(|t| leaf(t.detach().copy())).collect();
        let start: Vec<Tensor> = ours.iter().map(|t| t.detach().copy()).collect();
        for t in ours.iter().chain(&fused) {
            t.sum(Kind::Float).backward();
        }
        let (beta1, beta2, eps, weight_decay) = (0.9, 0.999, 1e-8, 0.01);
        let mut adamw = super::super::AdamW::new(&ours, beta1, beta2, eps, weight_decay);
        let zeros = |ts: &[Tensor]| ts.iter().map(Tensor::zeros_like).collect::<Vec<_>>();
        let (m, v) = (zeros(&fused), zeros(&fused));
        for step in 1..=4u64 {
            let lr = 1e-2 / step as f64;
            for (a, b) in ours.iter().zip(&fused) {
                // Small gradients, so that eps (1e-8) moves the update by about 1e-3 of it.
                let g = Tensor::randn(a.size(), (Kind::Float, Device::Cpu)) * 1e-5;
                a.grad().copy_(&g);
                b.grad().copy_(&g);
            }
            adamw.step(&ours, lr);
            let grads: Vec<Tensor> = fused.iter().map(Tensor::grad).collect();
            let _guard = tch::no_grad_guard();
            let h = Hyper {
                lr,
                beta1,
                beta2,
                weight_decay,
                eps,
                step,
            };
            fused_adamw(&fused, &grads, &m, &v, h).expect("the fused kernel runs on the CPU");
        }
        for ((a, b), s) in ours.iter().zip(&fused).zip(&start) {
            let diff = (a - b).abs().max().double_value(&[]);
            assert!(diff <= 1e-6, "the two updates differ by {diff}");
            let moved = (a - s).abs().max().double_value(&[]);
            assert!(
                moved > 1e-3,
                "four steps moved the parameter by {moved} only"
            );
        }
    }

    /// On a GPU, `AdamW::step` (the fused kernel for whole parameters, tensor ops for a
    /// row-ranged one, nothing for one without a gradient) matches the CPU's update to float
    /// rounding. Skipped without a GPU.
    #[test]
    fn on_a_gpu_the_step_matches_the_cpu_s() {
        if !tch::Cuda::is_available() {
            eprintln!("skipping: no CUDA device");
            return;
        }
        tch::manual_seed(5);
        let gpu = Device::Cuda(0);
        let shapes: [&[i64]; 4] = [&[64, 8], &[8], &[6, 4], &[5]];
        let on = |d: Device| -> Vec<Tensor> {
            shapes
                .iter()
                .enumerate()
                .map(|(i, s)| {
                    let t = Tensor::arange(s.iter().product::<i64>(), (Kind::Float, d))
                        .reshape(*s)
                        .sin()
                        + i as f64;
                    t.set_requires_grad(true)
                })
                .collect()
        };
        let (cpu, cuda) = (on(Device::Cpu), on(gpu));
        // Every parameter but the last gets a gradient.
        for t in cpu.iter().chain(&cuda).filter(|t| t.size() != [5]) {
            t.sum(Kind::Float).backward();
        }
        let mut a = super::super::AdamW::new(&cpu, 0.9, 0.999, 1e-8, 0.01);
        let mut b = super::super::AdamW::new(&cuda, 0.9, 0.999, 1e-8, 0.01);
        let moments = |t: &Tensor| (Tensor::zeros_like(t), Tensor::zeros_like(t));
        let (m, v) = moments(&cpu[2]);
        a.update_rows_only(2, 1..4, m, v).expect("rows on the CPU");
        let (m, v) = moments(&cuda[2]);
        b.update_rows_only(2, 1..4, m, v).expect("rows on the GPU");
        for step in 1..=4 {
            for (x, y) in cpu.iter().zip(&cuda).filter(|(x, _)| x.grad().defined()) {
                let g = Tensor::randn(x.size(), (Kind::Float, Device::Cpu)) * 1e-5;
                x.grad().copy_(&g);
                y.grad().copy_(&g.to_device(gpu));
            }
            a.step(&cpu, 1e-2 / step as f64);
            b.step(&cuda, 1e-2 / step as f64);
        }
        for (x, y) in cpu.iter().zip(&cuda) {
            let diff = (x - y.to_device(Device::Cpu)).abs().max().double_value(&[]);
            assert!(diff <= 1e-5, "the GPU's update differs by {diff}");
        }
    }

    /// Parameters on the CPU never take the fused path.
    #[test]
    fn cpu_parameters_stay_with_the_per_parameter_update() {
        let t = Tensor::zeros([4], (Kind::Float, Device::Cpu));
        assert!(!Batch::default().take(&t, &t, &t, &t));
    }
}
