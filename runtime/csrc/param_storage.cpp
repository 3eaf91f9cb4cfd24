// Parameter storage for ZeRO stage 3 (`runtime::ddp::gate`): frees the memory of a parameter's
// values while the tensor (its shape, its autograd metadata, the views and saved tensors that
// share its storage) stays; refills that same storage with new memory and values; and a hook on
// a tensor (a unit's forward output) that calls Rust when autograd has computed the gradient
// with respect to it, before the gradient flows into the unit's own backward nodes.
//
// Owns: the storage's data pointers (freed and allocated through the storage's own allocator,
// as PyTorch FSDP's `untyped_storage().resize_`) and the C++ exceptions of these calls (turned
// into malloc'd error strings for Rust, never thrown across the boundary; a failed Rust
// callback becomes an exception inside autograd, which ends the backward pass). Must
// not: bump a version counter (autograd's saved tensors would refuse the refilled values) or
// keep any state of its own (the Rust side owns the hook's context, released through
// `release`).
//
// Built by runtime/build.rs with the `cc` crate against the libtorch tch links.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/variable.h>

#include "shim_error.h"

#include <cstdint>
#include <exception>
#include <memory>
#include <stdexcept>

extern "C" {
// Called on the thread that runs the backward pass; returns 0, or another value that stops
// the backward pass (the Rust side keeps the error itself).
typedef int (*gptrec_before_backward_fn)(const void* ctx, int64_t unit);
// Called once when the hook is destroyed (with the graph that holds it).
typedef void (*gptrec_hook_release_fn)(const void* ctx);
}

namespace {

// The parameter's storage, checked to hold exactly its values, or nothing once released (a
// view into another tensor's storage would free that tensor's values too).
c10::StorageImpl* own_storage(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) {
    throw std::runtime_error("not a tensor with a storage");
  }
  c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
  size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  bool whole = storage->nbytes() == bytes || storage->nbytes() == 0;
  if (t.storage_offset() != 0 || !t.is_contiguous() || !whole) {
    throw std::runtime_error("its values are not the whole of a contiguous storage");
  }
  return storage;
}

// Calls Rust once per gradient that reaches the tensor; owns the context.
struct BeforeBackward {
  BeforeBackward(gptrec_before_backward_fn call, gptrec_hook_release_fn release,
                 const void* ctx, int64_t unit) noexcept
      : call_(call), release_(release), ctx_(ctx), unit_(unit) {}
  ~BeforeBackward() { release_(ctx_); }
  BeforeBackward(const BeforeBackward&) = delete;
  BeforeBackward& operator=(const BeforeBackward&) = delete;

  void run() const {
    if (call_(ctx_, unit_) != 0) {
      throw std::runtime_error(
          "ZeRO stage 3 could not gather a unit's parameters for its backward pass");
    }
  }

 private:
  gptrec_before_backward_fn call_;
  gptrec_hook_release_fn release_;
  const void* ctx_;
  int64_t unit_;
};

template <typename F>
char* guarded(F body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return gptrec_error_copy(e.what());
  } catch (...) {
    return gptrec_error_copy("an unknown C++ exception");
  }
}

}  // namespace

extern "C" {

// Frees the memory of `*tensor`'s values, keeping the tensor and its storage object (0 bytes
// now; reading the values before gptrec_storage_refill is an error of the caller's). Returns
// nullptr, or an error to free with gptrec_free_error.
char* gptrec_storage_release(const at::Tensor* tensor) {
  return guarded([&] {
    c10::StorageImpl* storage = own_storage(*tensor);
    storage->set_data_ptr_noswap(at::DataPtr(nullptr, tensor->device()));
    storage->set_nbytes(0);
  });
}

// Gives `*tensor`'s storage memory for its values again (when it has none) and copies
// `*values` (as many elements, same dtype and device, any shape) into it, without bumping the
// tensor's version counter. Returns nullptr, or an error to free with gptrec_free_error.
char* gptrec_storage_refill(const at::Tensor* tensor, const at::Tensor* values) {
  return guarded([&] {
    const at::Tensor& t = *tensor;
    c10::StorageImpl* storage = own_storage(t);
    if (values->numel() != t.numel() || values->scalar_type() != t.scalar_type() ||
        values->device() != t.device()) {
      throw std::runtime_error("the values do not match the parameter's count, dtype or device");
    }
    size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
    if (storage->nbytes() != bytes) {
      // On the tensor's device, whichever is current on this thread (as PyTorch's resize).
      c10::DeviceGuard on_its_device(t.device());
      c10::Allocator* allocator = storage->allocator();
      if (allocator == nullptr) {
        allocator = c10::GetAllocator(t.device().type());
      }
      storage->set_data_ptr_noswap(allocator->allocate(bytes));
      storage->set_nbytes(bytes);
    }
    // A tensor of its own on the same storage: copying into it leaves `t`'s version alone.
    c10::AutoGradMode no_grad(false);
    at::Tensor alias = at::empty({0}, t.options().requires_grad(false));
    alias.set_(t.storage(), 0, {t.numel()}, {1});
    alias.copy_(values->reshape({t.numel()}));
  });
}

// Gives `*tensor` (a leaf that requires grad) a dense zero gradient in place of whatever it has,
// reading only its shape and options, never its values (which may be released). Returns
// nullptr, or an error to free with gptrec_free_error.
char* gptrec_give_zero_grad(const at::Tensor* tensor) {
  return guarded([&] {
    if (!tensor->defined() || !tensor->requires_grad()) {
      throw std::runtime_error("not a tensor that requires grad");
    }
    tensor->mutable_grad() = at::zeros_like(*tensor, tensor->options().requires_grad(false));
  });
}

// The number of bytes `*tensor`'s storage holds now (0 once released). Returns nullptr, or an
// error to free with gptrec_free_error.
char* gptrec_storage_bytes(const at::Tensor* tensor, int64_t* bytes) {
  return guarded([&] { *bytes = static_cast<int64_t>(own_storage(*tensor)->nbytes()); });
}

// Hooks `*tensor` (an output of a unit's forward that requires grad): `call(ctx, unit)` runs
// each time autograd has computed the gradient with respect to it, before that gradient flows
// on; a non-zero return ends the backward pass with an error. Ownership of `ctx` passes to this call in
// every case: `release(ctx)` runs when the hook is destroyed, or before returning when none was
// made. Returns nullptr, or an error to free with gptrec_free_error.
char* gptrec_set_before_backward(const at::Tensor* tensor, gptrec_before_backward_fn call,
                                 gptrec_hook_release_fn release, const void* ctx,
                                 int64_t unit) {
  std::shared_ptr<BeforeBackward> hook;
  try {
    hook = std::make_shared<BeforeBackward>(call, release, ctx, unit);
  } catch (...) {
    release(ctx);
    return gptrec_error_copy("out of memory making a backward hook");
  }
  return guarded([&] {
    if (!tensor->defined() || !tensor->requires_grad()) {
      throw std::runtime_error("not a tensor that requires grad");
    }
    at::Tensor t = *tensor;
    t.register_hook([hook](const at::Tensor&) { hook->run(); });
  });
}

}  // extern "C"
