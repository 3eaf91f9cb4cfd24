// AdamW over many parameters in one call for `runtime::optim::multi_tensor`: libtorch's
// `_fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs, on the `torch::Tensor*`s that
// tch's `Tensor::as_ptr` gives. On CUDA it replaces about nine kernel launches per parameter
// with a few for all of them.
//
// Owns: gathering the tensors into lists and the C++ exceptions of the call (turned into a
// malloc'd error string for Rust, never thrown across the boundary). Must not: keep state or
// decide which parameters take this path (the Rust side does).
//
// Built by runtime/build.rs with the `cc` crate against the libtorch tch links.

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/_fused_adamw.h>

#include "shim_error.h"

#include <cstddef>
#include <exception>
#include <vector>

extern "C" {

// One AdamW step (non-amsgrad, non-maximize, decoupled weight decay) of the `n` parameters
// `params[i]` with gradients `grads[i]` and moments `exp_avgs[i]`, `exp_avg_sqs[i]`, updated in
// place; `step` is the step being taken (1 for the first). All tensors must be on one device,
// of one dtype, dense. Returns nullptr, or an error to free with gptrec_free_error.
char* gptrec_fused_adamw(const at::Tensor* const* params, const at::Tensor* const* grads,
                         const at::Tensor* const* exp_avgs, const at::Tensor* const* exp_avg_sqs,
                         size_t n, double lr, double beta1, double beta2, double weight_decay,
                         double eps, double step) {
  if (n == 0) {
    return nullptr;
  }
  try {
    at::NoGradGuard no_grad;
    std::vector<at::Tensor> p, g, m, v;
    p.reserve(n);
    g.reserve(n);
    m.reserve(n);
    v.reserve(n);
    for (size_t i = 0; i < n; ++i) {
      p.push_back(*params[i]);
      g.push_back(*grads[i]);
      m.push_back(*exp_avgs[i]);
      v.push_back(*exp_avg_sqs[i]);
    }
    // The kernel only reads the step: one tensor serves every parameter.
    at::Tensor steps = at::full({}, step, p[0].options().dtype(at::kFloat));
    std::vector<at::Tensor> state_steps(n, steps);
    at::_fused_adamw_(p, g, m, v, /*max_exp_avg_sqs=*/{}, state_steps, lr, beta1, beta2,
                      weight_decay, eps, /*amsgrad=*/false, /*maximize=*/false);
    return nullptr;
  } catch (const std::exception& e) {
    return gptrec_error_copy(e.what());
  } catch (...) {
    return gptrec_error_copy("an unknown C++ exception");
  }
}

}  // extern "C"
