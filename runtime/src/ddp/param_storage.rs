//! A parameter's storage for ZeRO stage 3 (`csrc/param_storage.cpp`): its values' memory
//! released while the tensor stays (its shape, its autograd metadata, the views and saved
//! tensors that share its storage), given back and refilled, and a zero gradient made from its
//! shape alone. Must not: decide when (the gate and the layout do) or read the values.

use tch::Tensor;

use super::DdpError;
use crate::shim::take_error;

mod ffi {
    use std::ffi::c_char;

    extern "C" {
        /// See `csrc/param_storage.cpp`; each returns null or an error for
        /// [`crate::shim::take_error`].
        pub fn gptrec_storage_release(tensor: *const torch_sys::C_tensor) -> *mut c_char;
        pub fn gptrec_storage_refill(
            tensor: *const torch_sys::C_tensor,
            values: *const torch_sys::C_tensor,
        ) -> *mut c_char;
        pub fn gptrec_give_zero_grad(tensor: *const torch_sys::C_tensor) -> *mut c_char;
        #[cfg(test)]
        pub fn gptrec_storage_bytes(
            tensor: *const torch_sys::C_tensor,
            bytes: *mut i64,
        ) -> *mut c_char;
    }
}

/// Frees the memory of `p`'s values (the tensor stays; its values must not be read until
/// [`refill`]: a kernel that does reads through a null pointer, which fails loudly, with an
/// error or a crash, never on stale values).
pub(super) fn release(p: &Tensor) -> Result<(), DdpError> {
    // SAFETY: `p` is a live tch tensor; the shim checks that its storage holds exactly its
    // values and swaps the storage's data pointer, which no kernel is using (the gate releases
    // a parameter only once autograd and the forward are done with it).
    take_error(unsafe { ffi::gptrec_storage_release(p.as_ptr()) }).map_err(shim_error)
}

/// Gives `p` memory for its values again where it has none and copies `values` (as many f32
/// elements, any shape) into it, leaving its version counter as it was (the tensors autograd
/// saved during the forward read the new memory).
pub(super) fn refill(p: &Tensor, values: &Tensor) -> Result<(), DdpError> {
    // SAFETY: both are live tch tensors; the shim checks counts, dtypes and devices.
    take_error(unsafe { ffi::gptrec_storage_refill(p.as_ptr(), values.as_ptr()) })
        .map_err(shim_error)
}

/// Gives `p` a dense zero gradient without reading its values (which may be released).
pub(super) fn give_zero_grad(p: &Tensor) -> Result<(), DdpError> {
    // SAFETY: a live tch tensor; the shim reads its metadata and replaces its gradient, which
    // no backward is using (the engine calls it before a window).
    take_error(unsafe { ffi::gptrec_give_zero_grad(p.as_ptr()) }).map_err(shim_error)
}

/// How many bytes `p`'s storage holds now (0 once released).
#[cfg(test)]
pub(super) fn storage_bytes(p: &Tensor) -> Result<i64, DdpError> {
    let mut bytes = 0;
    // SAFETY: `p` is a live tch tensor and `bytes` a valid place to write.
    take_error(unsafe { ffi::gptrec_storage_bytes(p.as_ptr(), &mut bytes) }).map_err(shim_error)?;
    Ok(bytes)
}

fn shim_error(detail: String) -> DdpError {
    DdpError::Internal(format!("ZeRO stage 3's parameter storage: {detail}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tch::Kind;

    fn values(t: &Tensor) -> Vec<f32> {
        Vec::<f32>::try_from(t.flatten(0, -1)).unwrap()
    }

    /// What stage 3 relies on: the tensors autograd saved during the forward (the parameter
    /// itself, a view of it) share its storage, so a backward after a release and a refill
    /// reads the refilled values, and the version counter does not object.
    #[test]
    fn a_released_parameter_refilled_is_what_the_backward_reads() {
        let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0]).set_requires_grad(true);
        let x = Tensor::from_slice(&[4.0f32, 5.0, 6.0]).set_requires_grad(true);
        // d/dw of sum(w * w) is 2w (w saved itself); d/dx of w[1x3] @ x[3x1] is w (a view
        // of w saved).
        let y =
            (&w * &w).sum(Kind::Float) + w.view([1, 3]).matmul(&x.view([3, 1])).sum(Kind::Float);
        release(&w).unwrap();
        assert_eq!(storage_bytes(&w).unwrap(), 0);
        assert_eq!(w.size(), [3], "the shape stays");
        refill(&w, &Tensor::from_slice(&[10.0f32, 20.0, 30.0])).unwrap();
        assert_eq!(storage_bytes(&w).unwrap(), 12);
        y.backward();
        assert_eq!(values(&w.grad()), [24.0, 45.0, 66.0]); // 2w + x, w refilled
        assert_eq!(values(&x.grad()), [10.0, 20.0, 30.0]);
    }

    #[test]
    fn storage_calls_refuse_what_they_cannot_do_whole() {
        let w = Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let tail = w.narrow(0, 1, 2);
        let e = release(&tail).unwrap_err().to_string();
        assert!(e.contains("not the whole of a contiguous storage"), "{e}");
        let e = refill(&w, &Tensor::from_slice(&[1.0f32]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("do not match"), "{e}");
        assert_eq!(
            values(&w),
            [1.0, 2.0, 3.0],
            "a refused call changes nothing"
        );
    }
}
