//! The `nccl` backend (CUDA tensors): not built yet. Selecting it says so clearly; `auto`
//! falls back to `tcp` until it lands.

use super::CollectiveError;

/// Why NCCL cannot be used in this build.
pub fn unavailable() -> CollectiveError {
    CollectiveError::Setup {
        backend: "nccl",
        detail: "the NCCL backend is not available in this build yet; use dist.backend = \"tcp\" (CPU tensors)".into(),
    }
}
