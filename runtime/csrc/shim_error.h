// Errors of the runtime's C++ shims, handed to Rust as malloc'd strings (never as C++
// exceptions across the boundary); Rust frees them with gptrec_free_error (grad_hooks.cpp).
#pragma once

#include <cstdlib>
#include <cstring>

// Returned when there is no memory for the message: never freed.
inline char gptrec_out_of_memory[] = "out of memory (while reporting an error)";

// A copy of `what` that Rust frees with gptrec_free_error (never nullptr: that means success).
inline char* gptrec_error_copy(const char* what) noexcept {
  size_t n = std::strlen(what);
  char* copy = static_cast<char*>(std::malloc(n + 1));
  if (copy == nullptr) {
    return gptrec_out_of_memory;
  }
  std::memcpy(copy, what, n + 1);
  return copy;
}
