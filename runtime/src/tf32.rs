//! TF32 for f32 matmuls on CUDA: libtorch's process-wide switch, the one PyTorch sets with
//! `torch.backends.cuda.matmul.allow_tf32` (Lightning's and the Hugging Face Trainer's `tf32`).
//! Owns nothing else: whether a run wants it is the config's business, the device the caller's.

use std::ffi::c_void;

// libtorch's own C++ entry points (tch does not wrap them): `at::globalContext()` and the
// `at::Context` member functions, whose first argument is the context.
extern "C" {
    #[link_name = "_ZN2at13globalContextEv"]
    fn at_global_context() -> *mut c_void;
    #[link_name = "_ZN2at7Context18setAllowTF32CuBLASEb"]
    fn at_context_set_allow_tf32_cublas(context: *mut c_void, allow: bool);
    #[link_name = "_ZNK2at7Context15allowTF32CuBLASEv"]
    fn at_context_allow_tf32_cublas(context: *const c_void) -> bool;
}

/// Lets (or forbids) cuBLAS compute f32 matmuls with TF32 tensor cores, for this process.
/// Callable on any machine; it matters only to CUDA matmuls.
pub fn set_tf32_matmuls(allow: bool) {
    // SAFETY: libtorch's global context lives for the whole process; the setter only stores
    // the precision it is given.
    unsafe { at_context_set_allow_tf32_cublas(at_global_context(), allow) }
}

/// Whether f32 matmuls on CUDA may use TF32 (see [`set_tf32_matmuls`]).
pub fn tf32_matmuls() -> bool {
    // SAFETY: a plain getter on libtorch's global context.
    unsafe { at_context_allow_tf32_cublas(at_global_context()) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_switch_reaches_libtorch_and_reads_back() {
        // The state is libtorch's, read through its own getter: on and off again.
        set_tf32_matmuls(true);
        assert!(tf32_matmuls());
        set_tf32_matmuls(false);
        assert!(!tf32_matmuls());
    }
}
