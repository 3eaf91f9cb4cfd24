// Gradient-ready hooks for `runtime::ddp::overlap`: puts a post-accumulate-grad hook on a
// parameter (the `torch::Tensor*` that tch's `Tensor::as_ptr` gives) that calls a Rust function
// with the parameter's index each time autograd has accumulated into its `.grad`; and drops a
// parameter's gradient once ZeRO stage 2 has kept its shard (`runtime::ddp::zero`).
//
// Owns: the hook objects and the C++ exceptions of registering them (turned into a malloc'd
// error string for Rust, never thrown across the boundary). Must not: call into Rust for
// anything but the two callbacks, or keep any state of its own (the Rust side owns the
// context, reference-counted through `release`).
//
// Built by runtime/build.rs with the `cc` crate against the libtorch tch links.

#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include "shim_error.h"

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <new>

extern "C" {
// Called on the thread that runs the backward pass, inside autograd's AccumulateGrad node
// (holding its lock): must be quick and must not unwind.
typedef void (*gptrec_grad_ready_fn)(const void* ctx, int64_t index);
// Called once when the hook is destroyed (replaced, cleared, or its tensor freed).
typedef void (*gptrec_release_fn)(const void* ctx);
}

namespace {

struct RustHook final : torch::autograd::PostAccumulateGradHook {
  RustHook(gptrec_grad_ready_fn ready, gptrec_release_fn release, const void* ctx,
           int64_t index) noexcept
      : ready_(ready), release_(release), ctx_(ctx), index_(index) {}
  ~RustHook() override { release_(ctx_); }
  RustHook(const RustHook&) = delete;
  RustHook& operator=(const RustHook&) = delete;

  void operator()(const torch::autograd::Variable& /*tensor*/) override {
    ready_(ctx_, index_);
  }

 private:
  gptrec_grad_ready_fn ready_;
  gptrec_release_fn release_;
  const void* ctx_;
  int64_t index_;
};

}  // namespace

extern "C" {

// Hooks `*tensor` (a leaf that requires grad and has no post-accumulate-grad hook yet).
// Ownership of `ctx` passes to this call in every case: `release(ctx)` runs when the hook is
// destroyed, or before returning when no hook was made. Returns nullptr, or an error to free
// with gptrec_free_error.
char* gptrec_set_grad_hook(const at::Tensor* tensor, gptrec_grad_ready_fn ready,
                           gptrec_release_fn release, const void* ctx, int64_t index) {
  std::unique_ptr<RustHook> hook(new (std::nothrow) RustHook(ready, release, ctx, index));
  if (!hook) {
    release(ctx);
    return gptrec_error_copy("out of memory making a gradient hook");
  }
  try {
    if (!tensor->defined() || !tensor->requires_grad() || !tensor->is_leaf()) {
      return gptrec_error_copy("not a leaf tensor that requires grad");
    }
    if (torch::autograd::impl::post_acc_grad_hooks(*tensor) != nullptr) {
      return gptrec_error_copy("it already has a post-accumulate-grad hook (another engine's?)");
    }
    torch::autograd::impl::set_post_acc_grad_hooks(*tensor, std::move(hook));
    return nullptr;
  } catch (const std::exception& e) {
    return gptrec_error_copy(e.what());
  } catch (...) {
    return gptrec_error_copy("an unknown C++ exception");
  }
}

// Removes the hook gptrec_set_grad_hook put on `*tensor`, if it is still there (another
// kind of hook is left alone). Returns nullptr, or an error to free with gptrec_free_error.
char* gptrec_clear_grad_hook(const at::Tensor* tensor) {
  try {
    // No autograd metadata: no hook either (a parameter frozen since keeps its metadata).
    if (!tensor->defined() || torch::autograd::impl::get_autograd_meta(*tensor) == nullptr) {
      return nullptr;
    }
    auto& hook = torch::autograd::impl::post_acc_grad_hooks(*tensor);
    if (dynamic_cast<RustHook*>(hook.get()) != nullptr) {
      torch::autograd::impl::set_post_acc_grad_hooks(*tensor, nullptr);
    }
    return nullptr;
  } catch (const std::exception& e) {
    return gptrec_error_copy(e.what());
  } catch (...) {
    return gptrec_error_copy("an unknown C++ exception");
  }
}

// Drops `*tensor`'s gradient, as `param.grad = None` does (ZeRO stage 2 keeps only its shard
// elsewhere); its memory goes once no other tensor refers to it. Returns nullptr, or an error
// to free with gptrec_free_error.
char* gptrec_release_grad(const at::Tensor* tensor) {
  try {
    if (tensor->defined() && torch::autograd::impl::get_autograd_meta(*tensor) != nullptr) {
      tensor->mutable_grad().reset();
    }
    return nullptr;
  } catch (const std::exception& e) {
    return gptrec_error_copy(e.what());
  } catch (...) {
    return gptrec_error_copy("an unknown C++ exception");
  }
}

void gptrec_free_error(char* error) {
  if (error != gptrec_out_of_memory) {
    std::free(error);
  }
}

}  // extern "C"
