//! What the runtime's C++ shims (`csrc/`, built by `build.rs`) share on the Rust side: their
//! errors, malloc'd strings that must be freed by the shim that made them.
//!
//! Must not: hold any shim's own declarations (each module declares the functions it calls).

use std::ffi::{c_char, CStr};

extern "C" {
    /// Frees an error a shim returned (`csrc/grad_hooks.cpp`).
    fn gptrec_free_error(error: *mut c_char);
}

/// A shim's error, if any, as a `String` (freed on the C++ side's allocator).
pub(crate) fn take_error(error: *mut c_char) -> Result<(), String> {
    if error.is_null() {
        return Ok(());
    }
    // SAFETY: a NUL-terminated string the shim malloc'd for us, read once, then freed by the
    // shim and never used again.
    let text = unsafe { CStr::from_ptr(error) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see above.
    unsafe { gptrec_free_error(error) };
    Err(text)
}
